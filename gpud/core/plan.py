"""Rebalance plans: the ledger a new config would give, computed from values only.

A plan is the seed's "What changed" table made by gpud: per role before/after (capacity,
reserve, committed, free), per serve before/after (MiB, util, fingerprint, state), the serves
that must restart, and whether the full resident set is admitted under the new config.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from gpud.core import actions, answers
from gpud.core.change import ServeChange as ServeChange
from gpud.core.config import Config, ServeConfig
from gpud.core.launch import BootStep, boot_steps, fingerprint
from gpud.core.ledger import (
    Denial,
    DeviceDraw,
    Ledger,
    Reservation,
    RoleBudget,
    RoleFigures,
    gpu_memory_utilization,
    pending_share,
)
from gpud.core.transition import ConfigBlocker, Refusal, transition
from gpud.core.vocab import (
    ADMITTED,
    DECLARED,
    DENIED,
    HOLDING_STATES,
    SLEEPING,
    Gone,
    ServeState,
    StepKind,
)

# Fields of a serve that do not change how its process runs: a change of only these needs no
# restart.
NO_RESTART_FIELDS = frozenset({"resident", "priority", "start_timeout_s"})


@dataclass(frozen=True)
class RebalancePlan:
    roles: list[tuple[str, RoleFigures | None, RoleFigures | None]]
    serves: list[ServeChange]
    denied: list[Denial]
    source: str
    after: Ledger = field(repr=False)
    # What stands in the way of the change (see gpud.core.transition); empty when nothing does.
    blocked: tuple[ConfigBlocker, ...] = ()
    # Live serves that leave the config or move to another role: their units stop first.
    stop_first: tuple[str, ...] = ()
    # Serves that hold a reservation without running and leave the config or their role: their
    # reservations are released before the new config is written (the reload would).
    release_first: tuple[str, ...] = ()
    # The boot of the resident set under the new config, per device (gpud.core.launch).
    boot: tuple[BootStep, ...] = ()

    @property
    def resident_fits(self) -> bool:
        return not self.denied

    @property
    def ok(self) -> bool:
        return self.resident_fits and not self.blocked

    @property
    def restart(self) -> list[str]:
        return [s.name for s in self.serves if s.restart]

    def to_json(self) -> answers.Plan:
        def fig(f: RoleFigures | None) -> answers.Figures | None:
            if f is None:
                return None
            return {"capacity_mib": f.capacity_mib, "reserve_mib": f.reserve_mib,
                    "committed_mib": f.committed_mib, "free_mib": f.free_mib}

        return {
            "source": self.source,
            "roles": [{"name": n, "before": fig(b), "after": fig(a)} for n, b, a in self.roles],
            "serves": [s.to_json() for s in self.serves],
            "restart": self.restart,
            "resident_fits": self.resident_fits,
            "denied": [d.to_json() for d in self.denied],
            "blocked": [b.to_json() for b in self.blocked],
            "stop_first": list(self.stop_first),
            "steps": [a.to_json() for a in actions.actions(self)] if self.ok else [],
            "boot": [{"device": b.device, "serves": list(b.serves), "together": b.together,
                      "why": b.why} for b in self.boot],
        }


def _roles(roles: tuple[str, ...]) -> str:
    """A serve's roles as one plan cell: the role, or the roles joined with '+'."""
    return "+".join(roles)


def _util(mib: int | None, total: int | None) -> str | None:
    return gpu_memory_utilization(mib, total) if mib and total else None


def _runs_differently(old: ServeConfig, new: ServeConfig) -> bool:
    if old == new:
        return False
    return any(value != getattr(new, name) for name, value in old.__dict__.items()
               if name not in NO_RESTART_FIELDS)


@dataclass(frozen=True, slots=True)
class DeviceRoom:
    """What strict admission sees of one device before an apply (gpud.core.ledger.PhysicalView):
    `room_mib`, its physical free less the memory promised to serves not drawing yet, and what
    each serve holds of the device (its observed draw plus its pending share), which comes back
    to that serve when it is admitted again, and to the others when it stops."""

    room_mib: int
    held_mib: Mapping[str, int] = field(default_factory=dict)


def device_rooms(draws: Mapping[str, DeviceDraw], ledger: Ledger,
                 states: Mapping[str, ServeState],
                 device_key: Callable[[str], str | None]) -> dict[str, DeviceRoom]:
    """The room on each observed device (`draws`, by `device_key` of a role's device) and what
    each serve of `ledger` holds of it."""
    held: dict[str, dict[str, int]] = {key: {} for key in draws}
    for res in ledger.reservations.values():
        for role in res.all_roles:
            budget = ledger.roles.get(role)
            key = device_key(budget.device) if budget is not None else None
            if key is None or key not in draws:
                continue
            seen = draws[key].by_serve.get(res.serve, 0)
            held[key][res.serve] = seen + pending_share(res, states.get(res.serve), seen)
    for key, draw in draws.items():  # a serve that draws without a reservation (stopping)
        for serve, seen in draw.by_serve.items():
            held[key].setdefault(serve, seen)
    return {key: DeviceRoom(d.physical_free_mib - d.pending_mib, held[key])
            for key, d in draws.items()}


def physical_denial(steps: Sequence[actions.Action], *, new: Config, before: Ledger,
                    after: Ledger, rooms: Mapping[str, DeviceRoom],
                    device_key: Callable[[str], str | None]) -> Denial | None:
    """The first admission of the apply `steps` (in their order) that strict admission would
    refuse on a device's physical free, or None: what the service decides at each of them
    (gpud.life.service._admit_locked with gpud.core.ledger.PhysicalView), on the devices as
    observed now. A stop or a release gives back what its serve held there; a restart or a
    resize is admitted with the serve's own share counted back; a start of a serve that holds
    nothing is admitted at its vram_mib. A device that is not observed is left to the ledger
    bound, as strict admission falls back to it."""
    if new.daemon.admission != "strict":
        return None
    room = {key: r.room_mib for key, r in rooms.items()}
    held = {(key, serve): mib for key, r in rooms.items() for serve, mib in r.held_mib.items()}
    holding = set(before.reservations)

    def give_back(serve: str) -> None:
        for key in room:
            room[key] += held.pop((key, serve), 0)

    def admit(serve: str, mib: int) -> Denial | None:
        spec = new.serves[serve]
        headroom = (new.daemon.vllm_start_context_mib
                    if spec.vllm is not None and not spec.vllm.context_mib else 0)
        where = [(role, key) for role in spec.all_roles
                 if (key := device_key(after.roles[role].device)) is not None and key in room]
        lacking = [Denial(serve, role, "physical", mib + headroom,
                          room[key] + held.get((key, serve), 0))
                   for role, key in where
                   if mib + headroom > room[key] + held.get((key, serve), 0)]
        if lacking:
            return replace(lacking[0], more=tuple(lacking[1:]))
        for _role, key in where:
            room[key] += held.get((key, serve), 0) - mib
            held[(key, serve)] = mib
        holding.add(serve)
        return None

    for step in steps:
        name = step.serve
        if name is None:
            continue
        denial = None
        if step.kind in (StepKind.STOP, StepKind.RELEASE):
            give_back(name)
            holding.discard(name)
        elif step.kind in (StepKind.RESTART, StepKind.RESIZE) and step.mib_after is not None:
            denial = admit(name, step.mib_after)
        elif step.kind == StepKind.START and name not in holding:
            denial = admit(name, new.serves[name].vram_mib)
        if denial is not None:
            return denial
    return None


def make_plan(
    *,
    old: Config,
    new: Config,
    ledger: Ledger,
    new_budgets: list[RoleBudget],
    states: Mapping[str, ServeState],
    totals: Mapping[str, int | None],
    source: str,
    rooms: Mapping[str, DeviceRoom] | None = None,
    device_key: Callable[[str], str | None] = lambda device: device,
) -> RebalancePlan:
    """What applying `new` would do to `ledger` (held under `old`).

    Held reservations of serves that stay are resized to their new vram_mib; those of serves
    that leave the config are released; external ones are kept. Then every resident serve that
    holds nothing is admitted in priority order against the ledger bound; the ones that do not
    fit are the plan's denials. With `rooms` (the devices as observed, by `device_key` of a
    role's device), every admission the apply would make is checked against the physical bound
    of strict admission too, in the apply's order (physical_denial): the first it would refuse
    is the plan's denial, as it would be the apply's.
    """
    held = dict(ledger.reservations)
    after = Ledger.build(new_budgets, [])
    after = Ledger(after.roles, _kept(new, held, after.roles, states))
    # Resident serves holding nothing: admitted by priority, like the boot would.
    wanted = [(name, spec.all_roles, spec.vram_mib) for _, name, spec in
              sorted((s.priority, n, s) for n, s in new.serves.items() if s.resident)
              if name not in after.reservations
              and all(r in after.roles for r in spec.all_roles)]
    after, denied = after.admit_in_order(wanted, since=0.0)
    # Over-commit left by resized reservations blocks the change: the set does not fit.
    over = [ConfigBlocker(f"roles.{f.role}", f"the resized reservations commit {f.committed_mib} "
                       f"MiB, over capacity - reserve = {f.capacity_mib - f.reserve_mib} MiB "
                       f"(held: {', '.join(f'{r.serve} {r.mib} MiB' for r in after.on_role(f.role))})")
               for f in after.over_committed()]

    new_budget_map = dict(after.roles)
    boot = tuple(boot_steps(
        {n: s for n, s in new.serves.items() if s.resident and n in after.reservations},
        lambda n: new_budget_map[new.serves[n].role].device
        if new.serves[n].role in new_budget_map else ""))
    denied_by = {d.serve: d for d in denied}

    def order(name: str) -> tuple[str, int, str]:
        spec = new.serves.get(name) or old.serves.get(name)
        return (spec.role if spec else "", spec.priority if spec else 1 << 30, name)

    def changes(denied_by: Mapping[str, Denial]) -> list[ServeChange]:
        return [_change(name, old.serves.get(name), new.serves.get(name), held.get(name),
                        after.reservations.get(name), states.get(name, DECLARED),
                        denied_by.get(name),
                        before_total=lambda roles: _device_total(roles, ledger.roles, totals),
                        after_total=lambda roles: _device_total(roles, new_budget_map, totals))
                for name in sorted(set(old.serves) | set(new.serves) | set(held), key=order)
                if not (name in held and held[name].external)]

    role_names = sorted(set(ledger.roles) | set(after.roles))
    roles = [(n, ledger.figures(n) if n in ledger.roles else None,
              after.figures(n) if n in after.roles else None) for n in role_names]
    decided = transition(old=old, new=new, ledger=ledger, budgets=new_budgets, states=states,
                         may_stop=True)
    if isinstance(decided, Refusal):
        return RebalancePlan(roles, changes(denied_by), denied, source, after,
                             blocked=decided.blockers + tuple(over), boot=boot)
    plan = RebalancePlan(roles, changes(denied_by), denied, source, after, blocked=tuple(over),
                         stop_first=decided.stop, release_first=decided.release, boot=boot)
    if rooms is None or not plan.ok:
        return plan
    # The ledger bound holds at every step: what the devices have free must too (strict).
    physical = physical_denial(actions.actions(plan), new=new, before=ledger, after=after,
                               rooms=rooms, device_key=device_key)
    if physical is None:
        return plan
    return replace(plan, denied=[physical], serves=changes({physical.serve: physical}))


def _device_total(roles: str | None, budgets: Mapping[str, RoleBudget],
                  totals: Mapping[str, int | None]) -> int | None:
    """The total a utilization is computed against (`roles`: a plan cell, _roles): the
    smallest of the roles' devices."""
    if roles is not None and "+" not in roles:  # one role: the common case, kept cheap
        if roles not in budgets:
            return None
        b = budgets[roles]
        return totals.get(b.device) or b.capacity_mib
    if roles is None or any(r not in budgets for r in roles.split("+")):
        return None
    found = [totals.get(budgets[r].device) or budgets[r].capacity_mib
             for r in roles.split("+")]
    return min(found) if all(found) else None


def _kept(new: Config, held: Mapping[str, Reservation], roles: Mapping[str, RoleBudget],
          states: Mapping[str, ServeState]) -> dict[str, Reservation]:
    """The reservations that stay under `new` (on `roles`), resized, in the order they were
    made."""
    kept: dict[str, Reservation] = {}
    for res in sorted(held.values(), key=lambda r: (r.since, r.serve)):
        spec = new.serves.get(res.serve)
        if res.external:
            if all(r in roles for r in res.all_roles):
                kept[res.serve] = res
            continue
        if spec is not None and all(r in roles for r in spec.all_roles):
            if (spec.all_roles != res.all_roles and not spec.resident
                    and states.get(res.serve) == ADMITTED):
                # Admitted only, and it leaves its role: its admission is released, and
                # nothing starts or admits it on the new one (it is not resident).
                continue
            if states.get(res.serve) == SLEEPING and spec.all_roles == res.all_roles:
                # Asleep it holds its sleep reservation, and it stays asleep: its wake is
                # re-admitted then (strict bound), at what its process was launched with.
                kept[res.serve] = res
                continue
            kept[res.serve] = Reservation(res.serve, spec.role, spec.vram_mib, res.since,
                                          res.by_uid, False, spec.extra_roles)
    return kept


def _change(name: str, before_spec: ServeConfig | None, after_spec: ServeConfig | None,
            cur: Reservation | None, res_after: Reservation | None, state: ServeState,
            denial: Denial | None, *, before_total: Callable[[str | None], int | None],
            after_total: Callable[[str | None], int | None]) -> ServeChange:
    """One serve's line of the plan: held `cur` now, `res_after` after, recorded `state`."""
    asleep = state == SLEEPING and cur is not None
    # The figure a sleeping serve's process was launched with (its util), not its sleep one.
    launched = before_spec.vram_mib if before_spec else cur.mib if cur else None
    change, state_after = _what_changes(before_spec, after_spec, cur, res_after, state, denial)
    running = state in HOLDING_STATES  # runs now: a change to how it runs restarts it
    restart = running and after_spec is not None and before_spec is not None and (
        _runs_differently(before_spec, after_spec)
        or (cur is not None and res_after is not None and cur.mib != res_after.mib))
    reason = denial.reason if denial is not None else None
    if asleep and restart and cur is not None and res_after is cur:
        # Not restarted (that would wake it at full size, behind the ledger's back): the
        # change to how it runs takes effect at its next start.
        restart = False
        reason = ("sleeping: not restarted; the change takes effect when it is next "
                  "started (it wakes as it was launched)")
    role_before = (_roles(before_spec.all_roles) if before_spec
                   else (_roles(cur.all_roles) if cur else None))
    role_after = _roles(after_spec.all_roles) if after_spec else None
    return ServeChange(
        name=name, role_before=role_before, role_after=role_after,
        mib_before=cur.mib if cur else None,
        mib_after=res_after.mib if res_after else None,
        util_before=_util(launched if asleep else cur.mib if cur else None,
                          before_total(role_before)),
        util_after=_util(launched if asleep and res_after is cur else
                         res_after.mib if res_after else (
            after_spec.vram_mib if after_spec else None),
            after_total(role_after)),
        fingerprint_before=fingerprint(before_spec) if before_spec else None,
        fingerprint_after=fingerprint(after_spec) if after_spec else None,
        state_before=state, state_after=state_after, change=change, restart=restart,
        reason=reason, resident=bool(after_spec and after_spec.resident),
    )


def _what_changes(before_spec: ServeConfig | None, after_spec: ServeConfig | None,
                  cur: Reservation | None, res_after: Reservation | None, state: ServeState,
                  denial: Denial | None) -> tuple[str, ServeState | Gone]:
    """The kind of change (added, removed, changed, resized...) and the state after it."""
    was_denied = denial is not None
    if after_spec is None:
        return "removed", Gone.REMOVED
    if before_spec is None:
        return "added", DENIED if was_denied else (ADMITTED if res_after else DECLARED)
    # A sleeping serve holds its sleep reservation: resized is of what it wakes to.
    asleep = state == SLEEPING and cur is not None
    awake = before_spec.vram_mib if asleep or cur is None else cur.mib
    resized = awake != after_spec.vram_mib
    differs = _runs_differently(before_spec, after_spec)
    change = ("changed, resized" if differs and resized else "changed" if differs
              else "resized" if resized else "unchanged")
    if was_denied:
        return change, DENIED
    if res_after is not None and state not in HOLDING_STATES and after_spec.resident:
        return change, ADMITTED
    if res_after is None and state == ADMITTED:
        return change, DECLARED  # its admission released, nothing admits it again
    return change, state if state != DENIED or res_after is None else ADMITTED
