"""`gpuctl plan` and `gpuctl apply`: the seed's hand-made rebalance as two commands.

apply: validate and plan (refused, nothing touched, when the resident set would not fit or the
ledger invariant cannot hold, see gpud.core.transition), then compute the whole apply as a list
of steps, each with its undo (gpud.core.actions: back up, stop live serves that leave the config
or their role, release admitted ones that do, write, reload, restart and resize shrinking before
growing, start by priority, verify; the list `gpuctl plan` shows), record the apply's intent and
its steps in the store, and carry the steps out one by one, journaling each before it begins.
If a step fails, the undo of the steps done is carried out (gpud.core.actions.rollback,
`Undoer`) and every serve is brought back to the state and reservation it had; a config file
changed on disk meanwhile is never written over. Each step is reported as it happens and logged
as an event; a gpud that died during an apply finds its record at the next start and runs the
same rollback over the steps begun (`Recovery`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpud.config import Config, parse_config
from gpud.core import answers
from gpud.core.actions import Action, actions, rollback, serve_steps
from gpud.core.ledger import DeviceDraw
from gpud.core.plan import RebalancePlan
from gpud.core.serverecord import Happened
from gpud.core.vocab import (
    ADMITTED,
    LIVE_STATES,
    RUNNING,
    STARTING,
    ApplyOutcome,
    EventKind,
    StepKind,
)
from gpud.durable.store import Changes
from gpud.errors import Conflict, Denied, GpudError, StoreError
from gpud.files import write_atomically
from gpud.host.observer import Observer
from gpud.life.offload import INLINE, Offload
from gpud.life.planning import PlanInputs, plan_json, plan_of
from gpud.life.service import LedgerService
from gpud.life.steps import Halt, carry_out, undo_all
from gpud.life.supervisor import Supervisor

log = logging.getLogger("gpud.rebalance")

Emit = Callable[[answers.ApplyStep | answers.ApplyResult], Awaitable[None]]
# reload(uid, text): decide `text` (just written to the config file) against the ledger.
Reload = Callable[[int | None, str], Awaitable[answers.Reloaded]]
# The store's key for an apply under way: its intent and the steps done so far.
JOURNAL = "apply"


def _mib(value: int | None) -> str:
    return "none" if value is None else f"{value} MiB"


def backup(path: Path, keep: int, now: float) -> Path:
    folder = path.parent / "backups"
    stamp = time.strftime("%Y%m%dT%H%M%S", time.localtime(now)) + f".{int(now * 1e6) % 10**6:06d}"
    target = folder / f"{path.name}.{stamp}"
    try:
        # Inside the try: a folder that cannot be made (a file in its place) is a refusal of
        # the apply like any other, rolled back, not a foreign error past the apply's journal.
        folder.mkdir(mode=0o700, exist_ok=True)
        shutil.copy2(path, target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            target.unlink()
        raise GpudError(f"cannot back up {path} to {target}: {exc.strerror or exc}") from exc
    for old in sorted(folder.glob(f"{path.name}.*"))[:-keep]:
        old.unlink()
    return target


class Rebalancer:
    def __init__(self, svc: LedgerService, supervisor: Supervisor, observer: Observer, *,
                 config_path: Path | None, reload: Reload, offload: Offload = INLINE,
                 overrides: dict[str, Any] | None = None,
                 front_listens: Callable[[], frozenset[str] | None] | None = None) -> None:
        self.svc = svc
        self.supervisor = supervisor
        self.observer = observer
        self.config_path = config_path
        self.reload = reload
        self.offload = offload
        # the daemon's --socket/--state-dir (as svc.overrides applies them): a plan made in a
        # worker process applies them itself
        self.overrides = dict(overrides or {})
        self._busy = False
        # What the front listens on now (gpud.nginx.front.Front.listening; None: no front, or
        # not yet): a plan and an apply are refused for what they would leave dark.
        self.front_listens = front_listens

    @property
    def busy(self) -> bool:
        return self._busy

    def parse(self, text: str, source: str) -> Config:
        return self.svc.overrides(parse_config(text, source))

    def plan(self, text: str, source: str) -> RebalancePlan:
        return plan_of(self.parse(text, source), source, self.inputs())

    def inputs(self) -> PlanInputs:
        """On the event loop: what a plan is made against (values only)."""
        view, ledger, states = self.observer.view(), self.svc.ledger, self.svc.states()
        draws: dict[str, DeviceDraw] | None = None
        if self.observer.available and view.latest is not None:
            draws = {d.uuid: draw for d in view.latest.devices
                     if (draw := self.observer.draw_for(d.uuid, ledger, states)) is not None}
        return PlanInputs(self.svc.config, ledger, states, view, self.overrides,
                          self.front_listens() if self.front_listens is not None else None,
                          draws)

    async def plan_json(self, text: str, source: str) -> str:
        """The plan of `text`, as the JSON text POST /v1/plan answers: parsed, planned and
        written in a worker process (gpud.life.offload)."""
        return await self.offload.in_process(plan_json, text, source, self.inputs())

    def check_can_begin(self) -> None:
        """An apply begins only when nothing else is changing the serves: not during another
        apply, and not while the resident set is still booting."""
        if self.config_path is None:
            raise Conflict("gpud runs without a config file: nothing to apply to")
        if self._busy:
            raise Conflict("another apply is in progress")
        if not self.supervisor.boot_job.booted.is_set():
            starting = sorted(n for n in self.svc.known_serves()
                              if self.svc.state_of(n) in (ADMITTED, STARTING))
            raise Conflict("the resident set is still starting: apply when it is done "
                           f"(starting: {', '.join(starting) or 'none yet'})",
                           {"starting": starting})

    async def apply(self, text: str, source: str, uid: int | None,
                    emit: Emit, cfg: Config | None = None) -> answers.ApplyResult:
        """`cfg`: `text` already parsed (by self.parse), when the caller has it."""
        self.check_can_begin()
        self._busy = True
        try:
            return await self._apply(text, source, uid, emit, cfg)
        finally:
            self._busy = False

    async def _step(self, emit: Emit, step: str, message: str, ok: bool = True,
                    uid: int | None = None, *, path: str | None = None,
                    serve: str | None = None) -> None:
        line: answers.ApplyStep = {"step": step, "ok": ok, "message": message}
        if path is not None:
            line["path"] = path
        if serve is not None:
            line["serve"] = serve
        await emit(line)
        await self.svc.store_event(self.svc.event(EventKind.APPLY, f"apply {step}: {message}", uid=uid,
                                             step=step, ok=ok))

    async def _journal(self, record: dict[str, Any] | None) -> None:
        await self.svc.put_meta(JOURNAL, None if record is None else json.dumps(record))

    async def _apply(self, text: str, source: str, uid: int | None,
                     emit: Emit, cfg: Config | None) -> answers.ApplyResult:
        assert self.config_path is not None
        if cfg is None:
            cfg = await self.offload.run(self.parse, text, source)
        plan = await self.offload.run(plan_of, cfg, source, self.inputs())
        if plan.blocked:
            message = "; ".join(b.message for b in plan.blocked)
            await self._step(emit, "validate", f"refused: {message}", ok=False, uid=uid)
            raise Conflict(f"apply refused, nothing changed: {message}",
                           {"blockers": [b.to_json() for b in plan.blocked],
                            "plan": plan.to_json()})
        if not plan.resident_fits:
            d = plan.denied[0]
            await self._step(emit, "validate", f"refused: {d.message}", ok=False, uid=uid)
            raise Denied(f"apply refused, nothing changed: the resident set does not fit: "
                         f"{d.message}", {"plan": plan.to_json()})
        steps = actions(plan)  # the whole apply, decided before anything is touched
        old_text = self.svc.config_text or self.config_path.read_text()
        if text == old_text and self._file_text() == text:
            # Nothing changes: gpud runs this text and the file holds it. No backup (ten no-op
            # applies pushed every earlier backup out) and no write of the same bytes.
            steps = [a for a in steps if a.kind not in ("backup", "write")]
        journal: dict[str, Any] = {"old": old_text, "new": text, "source": source,
                                   "uid": uid, "done": [],
                                   "steps": [a.to_json() for a in steps]}
        await self._journal(journal)  # before anything is touched: a crash is found at start
        run = _Run(emit, uid, journal)
        try:
            await self._step(emit, "validate", f"{source} is valid; the resident set fits; "
                             f"restart: {', '.join(plan.restart) or 'none'}"
                             + (f"; stop first: {', '.join(plan.stop_first)}"
                                if plan.stop_first else ""), uid=uid)
            await carry_out(steps, lambda action: self._carry_out(run, action, text), run.done,
                            count_begun=True)
            await self._journal(None)
            return {"result": ApplyOutcome.APPLIED, "backup": str(run.saved) if run.saved else None,
                    "summary": run.summary}
        except GpudError as exc:
            with contextlib.suppress(GpudError):
                await self._step(emit, ApplyOutcome.FAILED, exc.message, ok=False, uid=uid)
            await self._rollback(old_text, text, run.done, uid, emit)
            with contextlib.suppress(GpudError):
                await self._journal(None)
            return {"result": ApplyOutcome.ROLLED_BACK, "error": exc.message,
                    "backup": str(run.saved) if run.saved else None,
                    "summary": self.svc.summary()}

    def _file_text(self) -> str | None:
        assert self.config_path is not None
        try:
            return self.config_path.read_text()
        except (OSError, UnicodeDecodeError):
            return None

    async def _carry_out(self, run: _Run, action: Action, text: str) -> None:
        """One step of the apply: done, journaled (a step about a serve before it begins: a
        half-done step is undone too) and reported."""
        assert self.config_path is not None
        emit, uid = run.emit, run.uid
        # The steps begun, before this one begins: gpud's next start undoes them if it dies.
        run.journal["begun"] = len(run.done)
        run.journal["done"] = serve_steps(run.done)
        await self._journal(run.journal)
        if action.kind == StepKind.BACKUP:
            run.saved = backup(self.config_path, self.svc.config.daemon.backups_keep,
                               time.time())
            await self._step(emit, "backup", f"saved {run.saved}", uid=uid, path=str(run.saved))
        elif action.kind == StepKind.WRITE:
            write_atomically(self.config_path, text)
            run.journal["written"] = True
            await self._journal(run.journal)
            await self._step(emit, "write", f"wrote {self.config_path}", uid=uid)
        elif action.kind == StepKind.RELOAD:
            await self.reload(uid, text)
            await self._step(emit, StepKind.RELOAD, "config reloaded", uid=uid)
        elif action.kind == StepKind.VERIFY:
            run.summary = self.svc.summary()
            await self._step(emit, "verify", f"all changed serves healthy; {run.summary}",
                             uid=uid)
        else:
            assert action.kind in (StepKind.STOP, StepKind.RELEASE, StepKind.RESTART, StepKind.RESIZE,
                               StepKind.START)
            assert action.serve is not None
            await self._do(action, uid)
            await self._step(emit, action.kind, f"{action.serve}: {action.kind} done "
                             f"({_mib(action.mib_before)} -> {_mib(action.mib_after)})",
                             uid=uid, serve=action.serve)

    async def _do(self, action: Action, uid: int | None) -> None:
        name = action.serve
        assert name is not None
        if action.kind == StepKind.STOP:
            await self.supervisor.stop_job.stop(name, uid)
            return
        if action.kind == StepKind.RELEASE:
            # Not live (a live one is stopped instead): the service refuses it if it started
            # since the plan was made, and the apply is rolled back.
            await self.svc.release(name, uid=uid, reason="apply: the serve leaves the config "
                                   "or its role")
            return
        if action.kind == StepKind.RESIZE:
            # Decided against the ledger like any admission: one that does not fit fails the
            # apply, which is rolled back.
            assert action.mib_after is not None
            await self.svc.admit(name, action.mib_after, uid=uid)
            return
        if action.kind == StepKind.RESTART:
            await self.supervisor.stop_job.stop(name, uid, keep_reservation=True)
            if action.mib_after is not None:
                await self.svc.admit(name, action.mib_after, uid=uid)
        await self.supervisor.launch_job.start(name, uid, wait=True)
        if self.svc.state_of(name) != RUNNING:
            rec = self.svc.records.get(name)
            raise GpudError(f"{name} did not become healthy: "
                            f"{rec.reason if rec and rec.reason else self.svc.state_of(name)}")

    async def _rollback(self, old_text: str, new_text: str, done: list[Action],
                        uid: int | None, emit: Emit) -> None:
        async def say(message: str, ok: bool, serve: str | None) -> None:
            await self._say(emit, "rollback", message, uid, ok=ok, serve=serve)

        await Undoer(self.svc, self.supervisor, self.config_path, self.reload,
                     say).run(old_text, new_text, done, uid)

    async def _say(self, emit: Emit, step: str, message: str, uid: int | None, *,
                   ok: bool = True, serve: str | None = None) -> None:
        with contextlib.suppress(GpudError):
            await self._step(emit, step, message, ok=ok, uid=uid, serve=serve)


# What a rollback says of each undo: (message, ok, serve).
Say = Callable[[str, bool, str | None], Awaitable[None]]


class Undoer:
    """The undo of an apply's steps done (gpud.core.actions.rollback), carried out: by a failed
    apply, and by gpud's next start after one it did not live to finish (`Recovery`), so both
    end the same way."""

    def __init__(self, svc: LedgerService, supervisor: Supervisor, config_path: Path | None,
                 reload: Reload, say: Say) -> None:
        self.svc = svc
        self.supervisor = supervisor
        self.config_path = config_path
        self.reload = reload
        self.say = say

    async def run(self, old_text: str, new_text: str, done: list[Action],
                  uid: int | None) -> None:
        """Serves the apply started go first (they may not exist in the old config), then the
        old config is written back (unless the file changed on disk meanwhile) and reloaded,
        then restarted, resized, stopped and released serves come back with their old figures,
        each through the service's admission (what no longer fits is said, never
        over-committed). A restore that cannot be done ends the rollback there: the serves
        stay as they are."""
        async def do(undo: Action) -> None:
            if undo.kind == StepKind.RESTORE:
                if not await self._restore(old_text, new_text, uid):
                    raise Halt
                return
            assert undo.serve is not None
            if undo.kind == StepKind.STOP:
                work = self._undo_start(undo, uid)
            elif undo.kind in (StepKind.ADMIT, StepKind.RESIZE):
                work = self._undo_reservation(undo, uid)
            else:
                work = self._undo_change(undo, uid)
            await self._undo(undo.serve, work)

        await undo_all(rollback(done), do)

    async def _restore(self, old_text: str, new_text: str, uid: int | None) -> bool:
        assert self.config_path is not None
        try:
            on_disk = self.config_path.read_text()
        except OSError as exc:
            on_disk = f"(unreadable: {exc})"
        wrote = False
        if on_disk == new_text and new_text != old_text:
            try:
                write_atomically(self.config_path, old_text)
                wrote = True
            except GpudError as exc:
                await self.say(f"old config NOT written back: {exc.message}", False, None)
                return False
        elif on_disk != old_text:
            await self.say(f"{self.config_path} changed on disk since the apply began: not "
                           "written over; the serves stay as they are now", False, None)
            return False
        reloaded = False
        try:
            if self.svc.config_text != old_text:
                await self.reload(uid, old_text)
                reloaded = True
        except GpudError as exc:
            await self.say(f"old config {'written back' if wrote else 'on disk'} but not "
                           f"reloaded: {exc.message}", False, None)
            return False
        await self.say("old config " + ("written back and reloaded" if wrote and reloaded
                                        else "written back" if wrote
                                        else "reloaded" if reloaded else "still in force"),
                       True, None)
        return True

    async def _undo(self, name: str, work: Awaitable[None]) -> None:
        try:
            await work
            held = self.svc.ledger.reservations.get(name)
            await self.say(f"{name}: back to {self.svc.state_of(name)}"
                           + (f" ({held.mib} MiB)" if held is not None else ""), True, name)
        except GpudError as exc:
            await self.say(f"{name}: could not be restored: {exc.message}", False, name)

    async def _undo_start(self, undo: Action, uid: int | None) -> None:
        """Undo of a start: stopped again under the new config; a reservation the serve did not
        hold before the apply is released, the serve back to the state it had."""
        name = undo.serve
        assert name is not None
        if self.svc.serve_spec(name) is not None:
            with contextlib.suppress(GpudError):
                await self.supervisor.stop_job.stop(name, uid, keep_reservation=True)
        held = self.svc.ledger.reservations.get(name)
        if held is not None and undo.mib_after is None:
            await self.svc.release(name, uid=uid, reason="rollback", allow_live=True,
                                   happened=Happened.ROLLED_BACK, back_to=undo.state_after)

    async def _undo_reservation(self, undo: Action, uid: int | None) -> None:
        """Undo of a release or a resize, under the old config: the old reservation back
        through the service's admission, which refuses it (said so, nothing over-committed)
        when it no longer fits."""
        name = undo.serve
        assert name is not None and undo.mib_after is not None
        if self.svc.serve_spec(name) is None:
            return
        await self.svc.admit(name, undo.mib_after, uid=uid)

    async def _undo_change(self, undo: Action, uid: int | None) -> None:
        """Undo of a stop or a restart, under the old config: the old figures back, and the
        serve running again if it was live."""
        name = undo.serve
        assert name is not None
        if self.svc.serve_spec(name) is None:
            return
        with contextlib.suppress(GpudError):
            await self.supervisor.stop_job.stop(name, uid, keep_reservation=True)
        if undo.mib_after is not None:
            await self.svc.admit(name, undo.mib_after, uid=uid)
        if undo.state_after in LIVE_STATES:
            await self.supervisor.launch_job.start(name, uid, wait=True)


@dataclass
class _Run:
    """An apply under way: where it reports, the steps done, what it saved."""

    emit: Emit
    uid: int | None
    journal: dict[str, Any]
    done: list[Action] = field(default_factory=list)
    saved: Path | None = None
    summary: str = ""


class Recovery:
    """An apply that gpud did not live to finish left its record in the store: its old and new
    config, its steps and how many of them had begun. gpud starts again under the config that
    was in force when it died (the stored one, old or new), and once the units are reconciled
    the undo of the steps begun is carried out exactly as a failed apply's rollback
    (gpud.core.actions.rollback, `Undoer`): serves it started stopped, the old config written
    back (never over a file changed on disk) and reloaded, restarted, resized, stopped and
    released serves back with their old figures. The outcome is one `apply` event."""

    def __init__(self, svc: LedgerService, config_path: Path | None) -> None:
        self.svc = svc
        self.config_path = config_path
        self.record: dict[str, Any] | None = None
        self.begun: list[Action] = []
        # The config text in force when gpud died: gpud starts under it.
        self.text: str | None = None

    def prepare(self) -> bool:
        """Read the record; True when there was an apply to recover (`text`: the config to
        start under)."""
        raw = self.svc.store.meta(JOURNAL)
        if raw is None or self.config_path is None:
            return False
        try:
            record = json.loads(raw)
            old, new = str(record["old"]), str(record["new"])
            steps = [Action.from_json(doc) for doc in record["steps"]]
            begun = record.get("begun")
            count = _begun(steps, record) if begun is None else int(begun)
            self.svc.overrides(parse_config(old, "the config before the apply", checkpoints=False))
            self.svc.overrides(parse_config(new, "the config of the apply", checkpoints=False))
        except (ValueError, KeyError, TypeError, AttributeError, GpudError) as exc:
            log.error("the record of an interrupted apply cannot be read (%s): dropped", exc)
            self.svc.store.commit(Changes(meta={JOURNAL: None}))
            return False
        self.record = record
        self.begun = steps[:max(0, count)]
        # The reload of the apply commits the config with the ledger it gives: the stored one
        # says which was in force.
        self.text = new if self.svc.store.meta("config") == new else old
        return True

    async def finish(self, supervisor: Supervisor, reload: Reload) -> str | None:
        if self.record is None or self.config_path is None:
            return None
        notes: list[str] = []

        async def say(message: str, ok: bool, _serve: str | None) -> None:
            notes.append(message if ok else f"FAILED: {message}")

        await Undoer(self.svc, supervisor, self.config_path, reload, say).run(
            str(self.record["old"]), str(self.record["new"]), self.begun, None)
        steps = ", ".join(a.message for a in self.begun) or "none"
        message = (f"apply interrupted (gpud stopped during it), rolled back as a failed one "
                   f"would be; steps it had begun: {steps}; rollback: {'; '.join(notes)}")
        log.warning("%s", message)
        await self.svc.put_meta(JOURNAL, None)
        with contextlib.suppress(StoreError):
            await self.svc.store_event(self.svc.event(EventKind.APPLY, message, step="recover", ok=False))
        return message


def _begun(steps: list[Action], record: dict[str, Any]) -> int:
    """How many steps had begun, from a record that does not say (an older gpud's): up to the
    last serve step it journaled, or to the reload once the file was written."""
    done = {(str(kind), str(name)) for kind, name in record.get("done", [])}
    count = 1
    for i, step in enumerate(steps):
        if (step.kind, step.serve) in done or (record.get("written") and step.kind == StepKind.RELOAD):
            count = max(count, i + 1)
    return count
