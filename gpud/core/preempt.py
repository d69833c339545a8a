"""Preemption: which serves of lower priority make room for one that does not fit. Pure: values
in, values out.

A serve that does not fit on its role may put serves of LOWER priority (a larger `priority`
number) on the same role to sleep (vLLM's sleep mode: the reservation shrinks to its sleep
reservation) or, where a serve says `preemptible = "stop"`, stop them (the reservation is
released). Serves of equal or higher priority are never touched.

The plan takes the fewest victims that free enough: the k largest frees are the best any k
victims can do, so the smallest k whose largest frees cover the shortfall is the fewest
possible. Among the sets of that size that cover it, the least important serves are taken
(the largest priority numbers first). Steps run in the plan's order; each has its undo (wake
or start), run in reverse order when the serve still does not fit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

Action = Literal["sleep", "stop"]


@dataclass(frozen=True, slots=True)
class Candidate:
    """A serve that might be preempted: it runs on the role and holds `held_mib`."""

    serve: str
    priority: int
    held_mib: int
    action: Action
    # What it keeps after the step: its sleep reservation, or 0 when stopped.
    keeps_mib: int = 0

    @property
    def frees_mib(self) -> int:
        return max(0, self.held_mib - self.keeps_mib)


@dataclass(frozen=True, slots=True)
class Step:
    serve: str
    action: Action
    frees_mib: int
    priority: int

    @property
    def undo(self) -> Literal["wake", "start"]:
        return "wake" if self.action == "sleep" else "start"

    def line(self) -> str:
        verb = "put to sleep" if self.action == "sleep" else "stop"
        return (f"{verb} {self.serve} (priority {self.priority}): frees {self.frees_mib} MiB; "
                f"undo: {self.undo}")

    def to_json(self) -> dict[str, object]:
        return {"serve": self.serve, "action": self.action, "frees_mib": self.frees_mib,
                "priority": self.priority, "undo": self.undo}


@dataclass(frozen=True, slots=True)
class Plan:
    serve: str
    priority: int
    need_mib: int
    free_mib: int
    steps: tuple[Step, ...]

    @property
    def frees_mib(self) -> int:
        return sum(s.frees_mib for s in self.steps)

    @property
    def free_after_mib(self) -> int:
        return self.free_mib + self.frees_mib

    def lines(self) -> list[str]:
        head = (f"preempt for {self.serve} (priority {self.priority}): need {self.need_mib} MiB, "
                f"free {self.free_mib} MiB, short {self.need_mib - self.free_mib} MiB")
        tail = f"after: free {self.free_after_mib} MiB, {self.serve} fits"
        return [head, *(f"  {i}. {s.line()}" for i, s in enumerate(self.steps, 1)), tail]

    def to_json(self) -> dict[str, object]:
        return {"serve": self.serve, "priority": self.priority, "need_mib": self.need_mib,
                "free_mib": self.free_mib, "free_after_mib": self.free_after_mib,
                "steps": [s.to_json() for s in self.steps], "lines": self.lines()}


@dataclass(frozen=True, slots=True)
class NoPlan:
    """No preemption can make room; `reason` says why."""

    serve: str
    need_mib: int
    free_mib: int
    reason: str
    # What the eligible serves could free together.
    could_free_mib: int = 0

    def to_json(self) -> dict[str, object]:
        return {"serve": self.serve, "need_mib": self.need_mib, "free_mib": self.free_mib,
                "could_free_mib": self.could_free_mib, "reason": self.reason}


def plan_preemption(serve: str, priority: int, need_mib: int, free_mib: int,
                    candidates: Iterable[Candidate]) -> Plan | NoPlan:
    """The fewest serves of lower priority (larger number) whose steps free what `serve` lacks
    (`need_mib - free_mib`), as ordered steps, or why there are none. `free_mib` is what the
    serve would get now (its own reservation, if any, counted back in)."""
    if need_mib <= 0:
        raise ValueError("need_mib must be positive")
    short = need_mib - free_mib
    if short <= 0:
        return Plan(serve, priority, need_mib, free_mib, ())
    eligible = [c for c in candidates
                if c.serve != serve and c.priority > priority and c.frees_mib > 0]
    could = sum(c.frees_mib for c in eligible)
    if not eligible:
        return NoPlan(serve, need_mib, free_mib,
                      f"no serve of lower priority than {priority} on the role can be put to "
                      "sleep or stopped", 0)
    if could < short:
        names = ", ".join(c.serve for c in sorted(eligible, key=_least_important))
        return NoPlan(serve, need_mib, free_mib,
                      f"the serves of lower priority ({names}) free {could} MiB together, "
                      f"{short} MiB are needed", could)
    chosen = _fewest(eligible, short)
    steps = tuple(Step(c.serve, c.action, c.frees_mib, c.priority) for c in chosen)
    return Plan(serve, priority, need_mib, free_mib, steps)


def _least_important(c: Candidate) -> tuple[int, int, str]:
    # Largest priority number first; then the larger free (fewer steps); then by name.
    return (-c.priority, -c.frees_mib, c.serve)


def _fewest(eligible: Sequence[Candidate], short: int) -> list[Candidate]:
    by_free = sorted((c.frees_mib for c in eligible), reverse=True)
    k, total = 0, 0
    while total < short:
        total += by_free[k]
        k += 1
    # Pick k, least important first, keeping it possible to cover `short` with what is left:
    # after each pick the largest frees of the remaining serves must still make up the rest.
    chosen: list[Candidate] = []
    rest = sorted(eligible, key=_least_important)
    need = short
    while len(chosen) < k:
        slots = k - len(chosen) - 1
        for i, c in enumerate(rest):
            others = sorted((o.frees_mib for j, o in enumerate(rest) if j != i), reverse=True)
            if c.frees_mib + sum(others[:slots]) >= need:
                chosen.append(c)
                need -= c.frees_mib
                del rest[i]
                break
        else:  # pragma: no cover - k was chosen so that the largest frees always complete it
            raise AssertionError("no completion of the preemption plan")
    return chosen
