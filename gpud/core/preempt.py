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

A serve on several roles (tensor parallel) must fit on every one of them: `plan_on_roles` takes
what it lacks on each, and victims on any of its roles; a victim on several of them frees its
reservation on each (it is one value, shrunk or released on every role at once). The fewest
victims that cover every role are found by a search in the least-important-first order, so
among the sets of that size the one taken is the same the single-role rule would take.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpud.core.vocab import SleepAction, StepKind

Action = SleepAction
# Steps of the exact search for a plan over several roles (see _fewest_on_roles).
SEARCH_BUDGET = 20_000


@dataclass(frozen=True, slots=True)
class Candidate:
    """A serve that might be preempted: it runs on the role and holds `held_mib`."""

    serve: str
    priority: int
    held_mib: int
    # A value is taken too (the sleep controller passes "sleep" or "stop"); the member is kept.
    action: SleepAction
    # What it keeps after the step: its sleep reservation, or 0 when stopped.
    keeps_mib: int = 0
    # The roles it holds `held_mib` on, each (a serve on several devices); empty: the one role
    # a plan is made on.
    roles: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "action", SleepAction(self.action))

    @property
    def sleep_action(self) -> SleepAction:
        return SleepAction(self.action)

    @property
    def frees_mib(self) -> int:
        return max(0, self.held_mib - self.keeps_mib)

    def on(self, role: str) -> bool:
        return not self.roles or role in self.roles


@dataclass(frozen=True, slots=True)
class Step:
    serve: str
    action: Action
    frees_mib: int
    priority: int
    # In a plan on several roles: those of the plan this step frees `frees_mib` on, each.
    roles: tuple[str, ...] = ()

    @property
    def undo(self) -> StepKind:
        return StepKind.WAKE if self.action == SleepAction.SLEEP else StepKind.START

    def line(self) -> str:
        verb = "put to sleep" if self.action == SleepAction.SLEEP else str(self.action)
        where = f" on each of {', '.join(self.roles)}" if len(self.roles) > 1 else (
            f" on {self.roles[0]}" if self.roles else "")
        return (f"{verb} {self.serve} (priority {self.priority}): frees {self.frees_mib} MiB"
                f"{where}; undo: {self.undo}")

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"serve": self.serve, "action": self.action,
                                  "frees_mib": self.frees_mib, "priority": self.priority,
                                  "undo": self.undo}
        if self.roles:
            out["roles"] = list(self.roles)
        return out


@dataclass(frozen=True, slots=True)
class RoleRoom:
    """One role of a plan on several roles: what the serve gets there now, and after."""

    role: str
    free_mib: int
    free_after_mib: int

    def to_json(self) -> dict[str, object]:
        return {"role": self.role, "free_mib": self.free_mib,
                "free_after_mib": self.free_after_mib}


@dataclass(frozen=True, slots=True)
class PreemptPlan:
    serve: str
    priority: int
    need_mib: int
    free_mib: int
    steps: tuple[Step, ...]
    # A plan on several roles: each of them (free_mib is then the least of their frees).
    roles: tuple[RoleRoom, ...] = ()

    @property
    def frees_mib(self) -> int:
        return sum(s.frees_mib for s in self.steps)

    @property
    def free_after_mib(self) -> int:
        if self.roles:
            return min(r.free_after_mib for r in self.roles)
        return self.free_mib + self.frees_mib

    def lines(self) -> list[str]:
        if self.roles:
            rooms = ", ".join(f"{r.role} {r.free_mib}" for r in self.roles)
            head = (f"preempt for {self.serve} (priority {self.priority}): need "
                    f"{self.need_mib} MiB on each of its roles, free {rooms} MiB")
            after = ", ".join(f"{r.role} {r.free_after_mib}" for r in self.roles)
            tail = f"after: free {after} MiB, {self.serve} fits"
        else:
            head = (f"preempt for {self.serve} (priority {self.priority}): need "
                    f"{self.need_mib} MiB, free {self.free_mib} MiB, " + (_short(self) if self.steps
                    else "it fits already: nothing to preempt"))
            tail = f"after: free {self.free_after_mib} MiB, {self.serve} fits"
        return [head, *(f"  {i}. {s.line()}" for i, s in enumerate(self.steps, 1)), tail]

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "serve": self.serve, "priority": self.priority, "need_mib": self.need_mib,
            "free_mib": self.free_mib, "free_after_mib": self.free_after_mib,
            "steps": [s.to_json() for s in self.steps], "lines": self.lines()}
        if self.roles:
            out["roles"] = [r.to_json() for r in self.roles]
        return out


@dataclass(frozen=True, slots=True)
class NoPlan:
    """No preemption can make room; `reason` says why."""

    serve: str
    need_mib: int
    free_mib: int
    reason: str
    # What the eligible serves could free together (on the role that lacks most, for a serve
    # on several roles).
    could_free_mib: int = 0
    # For a serve on several roles: the role no preemption can make room on.
    role: str | None = None

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"serve": self.serve, "need_mib": self.need_mib,
                                  "free_mib": self.free_mib,
                                  "could_free_mib": self.could_free_mib, "reason": self.reason}
        if self.role is not None:
            out["role"] = self.role
        return out


def plan_preemption(serve: str, priority: int, need_mib: int, free_mib: int,
                    candidates: Iterable[Candidate]) -> PreemptPlan | NoPlan:
    """The fewest serves of lower priority (larger number) whose steps free what `serve` lacks
    (`need_mib - free_mib`), as ordered steps, or why there are none. `free_mib` is what the
    serve would get now (its own reservation, if any, counted back in)."""
    if need_mib <= 0:
        raise ValueError("need_mib must be positive")
    short = need_mib - free_mib
    if short <= 0:
        return PreemptPlan(serve, priority, need_mib, free_mib, ())
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
    steps = tuple(Step(c.serve, c.sleep_action, c.frees_mib, c.priority) for c in chosen)
    return PreemptPlan(serve, priority, need_mib, free_mib, steps)


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


def plan_on_roles(serve: str, priority: int, need_mib: int, free: Mapping[str, int],
                  candidates: Iterable[Candidate]) -> PreemptPlan | NoPlan:
    """The fewest serves of lower priority whose steps make room for `serve` on EVERY role of
    `free` (role -> what the serve would get there now, its own reservation counted back in),
    or why there are none. A candidate frees its `frees_mib` on each of its roles; one on none of
    the roles that lack room is no victim. On one role this is `plan_preemption`."""
    if need_mib <= 0:
        raise ValueError("need_mib must be positive")
    if not free:
        raise ValueError("a plan needs at least one role")
    if len(free) == 1:
        (role, room), = free.items()
        return plan_preemption(serve, priority, need_mib, room,
                               [c for c in candidates if c.on(role)])
    short = {role: need_mib - room for role, room in free.items() if need_mib > room}
    least = min(free.values())
    if not short:
        return PreemptPlan(serve, priority, need_mib, least, (), _rooms(free, ()))
    eligible = sorted((c for c in candidates
                       if c.serve != serve and c.priority > priority and c.frees_mib > 0
                       and any(c.on(r) for r in short)), key=_least_important)
    for role in sorted(short, key=lambda r: (-short[r], r)):
        could = sum(c.frees_mib for c in eligible if c.on(role))
        if could < short[role]:
            on_role = [c.serve for c in eligible if c.on(role)]
            reason = (f"on role {role!r}: no serve of lower priority than {priority} can be put "
                      "to sleep or stopped" if not on_role else
                      f"on role {role!r}: the serves of lower priority ({', '.join(on_role)}) "
                      f"free {could} MiB together, {short[role]} MiB are needed")
            return NoPlan(serve, need_mib, least, reason, could, role)
    chosen = _fewest_on_roles(eligible, short)
    steps = tuple(Step(c.serve, c.sleep_action, c.frees_mib, c.priority,
                       tuple(r for r in free if c.on(r))) for c in chosen)
    return PreemptPlan(serve, priority, need_mib, least, steps, _rooms(free, chosen))


def _rooms(free: Mapping[str, int], chosen: Sequence[Candidate]) -> tuple[RoleRoom, ...]:
    return tuple(RoleRoom(role, room, room + sum(c.frees_mib for c in chosen if c.on(role)))
                 for role, room in free.items())


def _fewest_on_roles(eligible: Sequence[Candidate], short: Mapping[str, int]) -> list[Candidate]:
    """The first set, in the order of `eligible` (least important first), of the smallest size
    that covers every role's shortfall: a depth-first search by size, pruned where the largest
    frees left on some role could not make up what it still lacks.

    Covering several roles at once is a set-cover problem: the exact search can take time
    exponential in the number of candidates. It is given SEARCH_BUDGET steps; past them the
    plan is `_greedy_cover`'s, which still covers every role with serves of lower priority
    only and holds no victim it could do without, but may not be the fewest."""
    n = len(eligible)
    budget = [SEARCH_BUDGET]
    # On each role, what the candidates from index i on free, largest first (for the bound).
    tails = {role: [sorted((c.frees_mib for c in eligible[i:] if c.on(role)), reverse=True)
                    for i in range(n + 1)] for role in short}
    lower = max(_fewest_count(tails[role][0], need) for role, need in short.items())

    def search(start: int, slots: int, need: dict[str, int],
               picked: list[Candidate]) -> list[Candidate] | None:
        if all(v <= 0 for v in need.values()):
            return list(picked)
        if slots == 0:
            return None
        budget[0] -= 1
        if budget[0] < 0:
            raise _OutOfBudget
        for role, lack in need.items():
            if lack > 0 and sum(tails[role][start][:slots]) < lack:
                return None
        for i in range(start, n):
            c = eligible[i]
            if not any(lack > 0 and c.on(role) for role, lack in need.items()):
                continue  # frees nothing where room is still lacking
            picked.append(c)
            found = search(i + 1, slots - 1,
                           {r: v - (c.frees_mib if c.on(r) else 0) for r, v in need.items()},
                           picked)
            picked.pop()
            if found is not None:
                return found
        return None

    try:
        for k in range(lower, n + 1):
            found = search(0, k, dict(short), [])
            if found is not None:
                return found
    except _OutOfBudget:
        return _greedy_cover(eligible, short)
    raise AssertionError("no completion of the preemption plan")  # pragma: no cover


class _OutOfBudget(Exception):
    pass


def _greedy_cover(eligible: Sequence[Candidate], short: Mapping[str, int]) -> list[Candidate]:
    """A cover of every role's shortfall found greedily: each time the candidate that makes up
    the most of what is still lacking (the least important first among equals), then, the most
    important first, every victim the others cover without is dropped. The candidates must
    cover every shortfall together (the caller checks)."""
    need = dict(short)
    order = {c.serve: i for i, c in enumerate(eligible)}
    rest = list(eligible)
    picked: list[Candidate] = []
    while any(v > 0 for v in need.values()):
        best = max(rest, key=lambda c: (sum(min(c.frees_mib, v) for r, v in need.items()
                                            if v > 0 and c.on(r)), -order[c.serve]))
        rest.remove(best)
        picked.append(best)
        need = {r: v - (best.frees_mib if best.on(r) else 0) for r, v in need.items()}
    for c in sorted(picked, key=lambda c: -order[c.serve]):
        others = [o for o in picked if o is not c]
        if all(sum(o.frees_mib for o in others if o.on(r)) >= lack for r, lack in short.items()):
            picked = others
    return sorted(picked, key=lambda c: order[c.serve])


def _fewest_count(frees: Sequence[int], need: int) -> int:
    k, total = 0, 0
    while total < need:
        total += frees[k]
        k += 1
    return k


def _short(plan: PreemptPlan) -> str:
    return f"short {plan.need_mib - plan.free_mib} MiB"
