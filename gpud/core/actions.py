"""What an apply does, as a list of values: the plan's steps, in order, each with its undo.

`actions(plan)` is the whole of an apply before any of it happens: back up the config, stop the
live serves that leave the config or their role (while their spec is still in force), release
the reservations of the serves that leave it or their role without running (admitted only),
write the new file, reload it, restart changed serves and resize the reservations of serves
that hold one without running, shrinking ones before growing ones (so a device is never
over-committed on the way), start resident serves that now fit by the new config's priority (a
serve that moved to another role starts there again), verify. `gpuctl plan` shows
this list; gpud.life.rebalance carries it out step by step and journals each one.

Every step that changes a serve has its undo. `rollback(done)` is the undo of the steps done (a
step counts as done once it began: a half-done step is undone too), in the order a rollback
runs them: the undos that run under the new config first (serves the apply started are
stopped, latest first: they may not exist in the old config), then the return to the old config
(`restore`: the old file written back, never over a file changed on disk, and reloaded), then
the undos that run under the old config, latest first (restarted, resized, stopped and
released serves come back with their old figures, after the reload that gives them their old
spec; each through the service's admission, which refuses what no longer fits). The return to the old
config is part of every rollback: it writes only when the file holds the new text and reloads
only when the config in force is not the old one.

Values in, values out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from gpud.core import answers
from gpud.core.change import ServeChange
from gpud.core.vocab import ADMITTED, RUNNING, SLEEPING, STARTING, STATES, ServeState, StepKind

if TYPE_CHECKING:
    from gpud.core import preempt

Kind = StepKind
KINDS: tuple[Kind, ...] = tuple(StepKind)
# The config in force while a step runs: "old" until the reload ("new" for the reload itself,
# which puts it in force), "new" after it, "old" again after a rollback's restore.
Under = Literal["old", "new"]


@dataclass(frozen=True, slots=True)
class Action:
    """One step. For a serve: its reservation before and after the step (None: none) and, for
    an undo, the state the serve had before the apply (`state_after`: where the undo takes it
    back to). `undo` is what brings the step back (None: nothing to bring back)."""

    kind: Kind
    under: Under
    serve: str | None = None
    mib_before: int | None = None
    mib_after: int | None = None
    state_after: ServeState | None = None
    undo: Action | None = None
    rollback: bool = False  # an undo step

    @property
    def message(self) -> str:
        if self.serve is None:
            return {StepKind.BACKUP: "back up the config file",
                    StepKind.WRITE: "write the new config file",
                    StepKind.RELOAD: "reload the config",
                    StepKind.VERIFY: "verify the changed serves are healthy",
                    StepKind.RESTORE: "write the old config back (unless changed on disk) and "
                                      "reload it",
                    }.get(self.kind, self.kind)
        figures = ("" if self.mib_before is None and self.mib_after is None
                   else f" ({_mib(self.mib_before)} -> {_mib(self.mib_after)})")
        if self.rollback and self.state_after is not None:
            return f"{self.serve}: {self.kind} back to {self.state_after}{figures}"
        return f"{self.serve}: {self.kind}{figures}"

    def undo_json(self) -> answers.PlanUndo:
        return {"kind": self.kind, "under": self.under, "serve": self.serve,
                "mib_before": self.mib_before, "mib_after": self.mib_after,
                "state_after": self.state_after, "message": self.message}

    def to_json(self) -> answers.PlanStep:
        return {"kind": self.kind, "under": self.under, "serve": self.serve,
                "mib_before": self.mib_before, "mib_after": self.mib_after,
                "message": self.message,
                "undo": None if self.undo is None else self.undo.undo_json()}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Action:
        """The step `to_json` wrote (the journal of an apply keeps its steps so): ValueError
        when it is not one."""
        undo = doc.get("undo")
        return cls(_kind(doc.get("kind")), _under(doc.get("under")), _name(doc.get("serve")),
                   _int(doc.get("mib_before")), _int(doc.get("mib_after")),
                   undo=None if undo is None else cls(
                       _kind(undo.get("kind")), _under(undo.get("under")),
                       _name(undo.get("serve")), _int(undo.get("mib_before")),
                       _int(undo.get("mib_after")), _state(undo.get("state_after")),
                       rollback=True))


def _kind(value: object) -> Kind:
    if isinstance(value, str) and value in KINDS:
        return StepKind(value)
    raise ValueError(f"not a kind of step: {value!r}")


def _under(value: object) -> Under:
    if value == "old":
        return "old"
    if value == "new":
        return "new"
    raise ValueError(f"not a config a step runs under: {value!r}")


def _name(value: object) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise ValueError(f"not a name: {value!r}")


def _state(value: object) -> ServeState | None:
    if value is None:
        return None
    if isinstance(value, str) and value in STATES:
        return ServeState(value)
    raise ValueError(f"not a serve state: {value!r}")


def _int(value: object) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise ValueError(f"not a size in MiB: {value!r}")


def _mib(value: int | None) -> str:
    return "none" if value is None else f"{value} MiB"


RESTORE = Action(StepKind.RESTORE, "old", rollback=True)


class PlanSteps(Protocol):
    """What of a rebalance plan (gpud.core.plan.RebalancePlan, whose answer lists these steps) the
    steps are read from."""

    @property
    def serves(self) -> Sequence[ServeChange]: ...
    @property
    def stop_first(self) -> Sequence[str]: ...
    @property
    def release_first(self) -> Sequence[str]: ...


def _serve_action(kind: Kind, change: ServeChange) -> Action:
    under: Under = "old" if kind in (StepKind.STOP, StepKind.RELEASE) else "new"
    if kind == StepKind.START:
        # A serve the apply starts (or started again on the role it moved to): stopped again
        # under the new config, where it exists, and what the apply gave it released. A serve
        # resized before its start holds its new size when it starts; the resize's own undo
        # gives it its old one.
        held = change.mib_after if resized(change) else change.mib_before
        undo = Action(StepKind.STOP, "new", change.name, change.mib_after, held, change.state_before,
                      rollback=True)
        return Action(kind, under, change.name, held, change.mib_after, undo=undo)
    if kind == StepKind.RELEASE:
        # Its reservation released under the old config (it is not live): re-admitted at its
        # old size under the old config, by the admission that refuses what does not fit.
        undo = Action(StepKind.ADMIT, "old", change.name, None, change.mib_before, change.state_before,
                      rollback=True)
    elif kind == StepKind.RESIZE:
        undo = Action(StepKind.RESIZE, "old", change.name, change.mib_after, change.mib_before,
                      change.state_before, rollback=True)
    elif kind == StepKind.STOP and change.state_before == SLEEPING:
        # A sleep cannot be given back: the serve stopped asleep starts again awake under the
        # old config, admitted there at its vram_mib (its sleep reservation would size its
        # launch on the memory it kept asleep).
        undo = Action(StepKind.START, "old", change.name, change.mib_after, None, RUNNING,
                      rollback=True)
    else:
        # A stop or a restart: under the old config, after its reload, the serve gets its old
        # figures back, and runs again if it ran.
        undo = Action(StepKind.START if kind == StepKind.STOP else StepKind.RESTART, "old", change.name,
                      change.mib_after, change.mib_before, change.state_before, rollback=True)
    return Action(kind, under, change.name, change.mib_before, change.mib_after, undo=undo)


def stop_first(plan: PlanSteps) -> list[ServeChange]:
    changes = {c.name: c for c in plan.serves}
    return [changes[n] for n in plan.stop_first]


def release_first(plan: PlanSteps) -> list[ServeChange]:
    """Serves that hold a reservation without running and leave the config or their role: the
    transition releases them (gpud.core.transition), here a step of its own, with its undo."""
    changes = {c.name: c for c in plan.serves}
    return [changes[n] for n in plan.release_first if n in changes]


def resized(change: ServeChange) -> bool:
    """A reservation kept by the reload whose size the new config changes, on a serve that is
    not restarted (admitted, not running): the reload keeps its old size and a start admits
    only a serve that holds nothing, so a step of its own resizes it."""
    return (change.mib_before is not None and change.mib_after is not None
            and change.mib_before != change.mib_after and not change.restart
            and change.role_before == change.role_after)


def restarts(plan: PlanSteps) -> list[ServeChange]:
    """Restarts and resizes after the reload, shrinking before growing (then by name)."""
    first = set(plan.stop_first) | set(plan.release_first)
    return sorted((c for c in plan.serves if (c.restart or resized(c)) and c.name not in first),
                  key=lambda c: ((c.mib_after or 0) - (c.mib_before or 0), c.name))


def starts(plan: PlanSteps) -> list[ServeChange]:
    """Starts after the restarts, in the new config's priority order: resident serves admitted
    that do not run yet, and serves that moved to another role. A serve that is not resident and
    holds an admission only (gpuctl admit) stays admitted: an apply does not start it."""
    moved = set(plan.stop_first)
    order = {c.name: i for i, c in enumerate(plan.serves)}
    chosen = [c for c in plan.serves
              if (c.state_after == ADMITTED and c.resident
                  and c.state_before not in (STARTING, RUNNING))
              or (c.name in moved and c.role_after is not None)]
    return sorted(chosen, key=lambda c: order[c.name])


def actions(plan: PlanSteps) -> list[Action]:
    """The apply of `plan`, step by step (the plan must be ok: nothing blocked, the resident
    set fits)."""
    steps = [Action(StepKind.BACKUP, "old")]
    steps += [_serve_action(StepKind.STOP, c) for c in stop_first(plan)]
    steps += [_serve_action(StepKind.RELEASE, c) for c in release_first(plan)]
    steps += [Action(StepKind.WRITE, "old", undo=RESTORE), Action(StepKind.RELOAD, "new", undo=RESTORE)]
    steps += [_serve_action(StepKind.RESTART if c.restart else StepKind.RESIZE, c) for c in restarts(plan)]
    steps += [_serve_action(StepKind.START, c) for c in starts(plan)]
    steps.append(Action(StepKind.VERIFY, "new"))
    return steps


def rollback(done: Sequence[Action]) -> list[Action]:
    """The undo of the steps `done` (in the order they were done), in the order it runs."""
    undos = [a.undo for a in reversed(done) if a.undo is not None and a.undo.kind != StepKind.RESTORE]
    return ([u for u in undos if u.under == "new"] + [RESTORE]
            + [u for u in undos if u.under == "old"])


def undo_in_reverse(done: Sequence[Action]) -> list[Action]:
    """The undo of the steps `done`, latest first: a rollback where every step runs under the
    same config (a preemption's)."""
    return [a.undo for a in reversed(done) if a.undo is not None]


def preemption(plan: preempt.PreemptPlan) -> list[Action]:
    """The steps of a preemption (gpud.core.preempt), in its order: each serve put to sleep or
    stopped, its undo a wake or a start. Undone latest first (`undo_in_reverse`)."""
    return [Action(StepKind(s.action), "new", s.serve,
                   undo=Action(s.undo, "new", s.serve, rollback=True)) for s in plan.steps]


def serve_steps(steps: Iterable[Action]) -> list[tuple[str, str]]:
    """(kind, serve) of the steps about a serve: what the journal keeps of the steps done."""
    return [(a.kind, a.serve) for a in steps if a.serve is not None]
