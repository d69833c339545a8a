"""The ledger and its arithmetic: values in, values out. No I/O, no clock, no asyncio.

Per role::

    committed   = sum of reservations on the role
    ledger_free = capacity - reserve - committed

Per device, when observation is available::

    managed_draw    = draw of processes inside gpud's serve units
    non_ledger_draw = used - managed_draw
    reserve_excess  = non_ledger_draw - reserve
    pending         = sum over reservations not yet drawing of max(0, mib - observed)
    effective_free  = min(ledger_free, physical_free - pending)

A serve's own reservation is replaced on re-admission, never added to.

A serve may hold its reservation on several roles at once (tensor parallel: one role per device),
the same MiB on each. Such a reservation is one value: it is made on every role or on none, and
released, replaced and moved as one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from gpud.core import answers
from gpud.core.vocab import ADMITTED, PENDING_STATES, RUNNING, SLEEPING, STOPPING, ServeState

Bound = Literal["ledger", "physical"]
Check = Literal["ledger", "strict"]



@dataclass(frozen=True, slots=True)
class Reservation:
    """`mib` reserved for `serve` on `role` and on each of `extra_roles` (a serve on several
    devices: its first role, then the others in the order configured)."""

    serve: str
    role: str
    mib: int
    since: float
    by_uid: int | None = None
    external: bool = False
    extra_roles: tuple[str, ...] = ()

    @property
    def all_roles(self) -> tuple[str, ...]:
        return (self.role, *self.extra_roles)

    def on(self, role: str) -> bool:
        return role == self.role or role in self.extra_roles

    @property
    def roles_text(self) -> str:
        return ", ".join(self.all_roles)


@dataclass(frozen=True, slots=True)
class RoleBudget:
    name: str
    device: str
    capacity_mib: int
    reserve_mib: int
    note: str | None = None
    # A role that holds reservations but is gone from the config: capacity 0, so everything on it
    # shows as over-committed instead of vanishing.
    missing: bool = False


@dataclass(frozen=True, slots=True)
class RoleFigures:
    role: str
    capacity_mib: int
    reserve_mib: int
    committed_mib: int

    @property
    def free_mib(self) -> int:
        return self.capacity_mib - self.reserve_mib - self.committed_mib

    @property
    def over_committed(self) -> bool:
        return self.free_mib < 0

    def line(self) -> str:
        return (
            f"gpu_role '{self.role}': capacity {self.capacity_mib} MiB, reserve "
            f"{self.reserve_mib} MiB, committed {self.committed_mib} MiB, free {self.free_mib} MiB"
        )


@dataclass(frozen=True, slots=True)
class Denial:
    """A refused admission: the first role that lacks room, and in `more` every other role of
    the same serve that lacks room too (a serve on several roles is admitted on all or none)."""

    serve: str
    role: str
    bound: Bound
    need_mib: int
    free_mib: int
    more: tuple[Denial, ...] = ()

    @property
    def shortfall_mib(self) -> int:
        return self.need_mib - self.free_mib

    @property
    def lacking(self) -> tuple[Denial, ...]:
        """One denial per role that lacks room, the first one first."""
        return (replace(self, more=()), *self.more)

    def _own_reason(self) -> str:
        return (
            f"{self.bound} bound: need {self.need_mib} MiB, free {self.free_mib} MiB, "
            f"short {self.shortfall_mib} MiB"
        )

    @property
    def reason(self) -> str:
        if not self.more:
            return self._own_reason()
        return "; ".join(f"on {d.role}: {d._own_reason()}" for d in self.lacking)

    @property
    def message(self) -> str:
        if not self.more:
            return f"{self.serve} denied on {self.role}: {self.reason}"
        roles = ", ".join(d.role for d in self.lacking)
        return f"{self.serve} denied (nothing reserved; lacking room on {roles}): {self.reason}"

    def details(self) -> dict[str, object]:
        out: dict[str, object] = {
            "serve": self.serve,
            "role": self.role,
            "bound": self.bound,
            "need_mib": self.need_mib,
            "free_mib": self.free_mib,
            "shortfall_mib": self.shortfall_mib,
        }
        if self.more:
            out["lacking"] = [{"role": d.role, "bound": d.bound, "need_mib": d.need_mib,
                               "free_mib": d.free_mib, "shortfall_mib": d.shortfall_mib}
                              for d in self.lacking]
        return out

    def to_json(self) -> answers.PlanDenied:
        out: answers.PlanDenied = {
            "serve": self.serve, "role": self.role, "bound": self.bound,
            "need_mib": self.need_mib, "free_mib": self.free_mib,
            "shortfall_mib": self.shortfall_mib, "reason": self.reason}
        if self.more:
            out["lacking"] = [{"role": d.role, "bound": d.bound, "need_mib": d.need_mib,
                               "free_mib": d.free_mib, "shortfall_mib": d.shortfall_mib}
                              for d in self.lacking]
        return out


@dataclass(frozen=True, slots=True)
class PhysicalView:
    """What the observer says about the device a role sits on, for one admission."""

    physical_free_mib: int
    pending_mib: int
    # The serve's own observed draw (already on the device, counted in "used") and its own
    # pending share: both come back to it when its reservation is replaced.
    own_observed_mib: int = 0
    own_pending_mib: int = 0
    # What the serve needs free beyond its reservation to pass its own start check: vLLM
    # checks free >= util x total after its CUDA context exists, so a reservation that leaves
    # no room for that context (vllm.context_mib = 0) needs the context free besides.
    start_headroom_mib: int = 0

    def free_for_serve(self) -> int:
        return (self.physical_free_mib - (self.pending_mib - self.own_pending_mib)
                + self.own_observed_mib)


@dataclass(frozen=True, slots=True)
class Admission:
    reservation: Reservation
    replaced_mib: int | None
    figures: RoleFigures  # of the reservation's first role
    check: Check
    note: str | None = None
    # The figures of its other roles (a serve on several devices), in order.
    more_figures: tuple[RoleFigures, ...] = ()

    @property
    def all_figures(self) -> tuple[RoleFigures, ...]:
        return (self.figures, *self.more_figures)


@dataclass(frozen=True)
class Ledger:
    roles: Mapping[str, RoleBudget]
    reservations: Mapping[str, Reservation] = field(default_factory=dict)

    @classmethod
    def build(cls, roles: Iterable[RoleBudget], reservations: Iterable[Reservation]) -> Ledger:
        """A ledger over the configured roles; roles only the reservations still name are kept
        as `missing` (capacity 0) so those reservations show up as over-committed."""
        by_name = {r.name: r for r in roles}
        held = {r.serve: r for r in reservations}
        for res in held.values():
            for role in res.all_roles:
                if role not in by_name:
                    by_name[role] = RoleBudget(role, "", 0, 0, missing=True)
        return cls(by_name, held)

    def on_role(self, role: str) -> list[Reservation]:
        return sorted(
            (r for r in self.reservations.values() if r.on(role)),
            key=lambda r: (r.since, r.serve),
        )

    def figures(self, role: str, *, excluding: str | None = None) -> RoleFigures:
        budget = self.roles[role]
        # Inline rather than r.on(role): this runs for every reservation of every role of a plan.
        committed = sum(
            r.mib for r in self.reservations.values()
            if (r.role == role or role in r.extra_roles) and r.serve != excluding
        )
        return RoleFigures(role, budget.capacity_mib, budget.reserve_mib, committed)

    def over_committed(self) -> list[RoleFigures]:
        return [f for f in (self.figures(name) for name in sorted(self.roles)) if f.over_committed]

    def decide(
        self,
        serve: str,
        role: str | Sequence[str],
        mib: int,
        *,
        since: float,
        by_uid: int | None,
        external: bool = False,
        physical: PhysicalView | Mapping[str, PhysicalView] | None = None,
        check: Check = "ledger",
        note: str | None = None,
    ) -> tuple[Ledger, Admission] | Denial:
        """Admit `mib` for `serve` on `role` (or on each of several roles, all or none), or say
        which bound refused it on every role that lacks room.

        With `physical` given (strict admission with observation available; per role for a serve
        on several roles) the serve must also fit in what each device physically has free, less
        memory promised to serves that are not drawing yet.
        """
        if mib <= 0:
            raise ValueError("mib must be positive")
        roles = (role,) if isinstance(role, str) else tuple(role)
        if not roles or len(set(roles)) != len(roles):
            raise ValueError(f"roles must be distinct and at least one: {roles!r}")
        previous = self.reservations.get(serve)
        lacking: list[Denial] = []
        for name in roles:
            ledger_free = self.figures(name, excluding=serve).free_mib
            if mib > ledger_free:
                lacking.append(Denial(serve, name, "ledger", mib, ledger_free))
                continue
            view = (physical if isinstance(physical, PhysicalView) or physical is None
                    else physical.get(name))
            if view is not None:
                physical_free = view.free_for_serve()
                if mib + view.start_headroom_mib > physical_free:
                    lacking.append(Denial(serve, name, "physical",
                                          mib + view.start_headroom_mib, physical_free))
        if lacking:
            return replace(lacking[0], more=tuple(lacking[1:]))
        # A replaced reservation keeps its place (its original since) in the role's listing.
        if previous is not None and previous.role == roles[0]:
            since = previous.since
        reservation = Reservation(serve, roles[0], mib, since, by_uid, external, roles[1:])
        held = dict(self.reservations)
        held[serve] = reservation
        after = replace(self, reservations=held)
        replaced = previous.mib if previous is not None else None
        figures = tuple(after.figures(name) for name in roles)
        return after, Admission(reservation, replaced, figures[0], check, note, figures[1:])

    def admit_in_order(self, wanted: Iterable[tuple[str, str | Sequence[str], int]], *,
                       since: float) -> tuple[Ledger, list[Denial]]:
        """Admit (serve, role or roles, mib) one after another against the ledger bound, as that
        many `decide` calls would, for serves that hold nothing yet; in one pass (a boot or a
        plan of thousands of serves). A serve on several roles is admitted on all or on none.
        Returns the ledger after and the denials."""
        held = dict(self.reservations)
        committed = {name: self.figures(name).committed_mib for name in self.roles}
        denials: list[Denial] = []
        for serve, role, mib in wanted:
            if mib <= 0:
                raise ValueError("mib must be positive")
            if serve in held:
                raise ValueError(f"{serve} already holds a reservation")
            roles = (role,) if isinstance(role, str) else tuple(role)
            lacking: list[Denial] = []
            for name in roles:
                budget = self.roles[name]
                free = budget.capacity_mib - budget.reserve_mib - committed[name]
                if mib > free:
                    lacking.append(Denial(serve, name, "ledger", mib, free))
            if lacking:
                denials.append(replace(lacking[0], more=tuple(lacking[1:])))
                continue
            held[serve] = Reservation(serve, roles[0], mib, since, None, False, roles[1:])
            for name in roles:
                committed[name] += mib
        return replace(self, reservations=held), denials

    def release(self, serve: str) -> tuple[Ledger, Reservation]:
        held = dict(self.reservations)
        reservation = held.pop(serve)
        return replace(self, reservations=held), reservation


def shrink_reservation(ledger: Ledger, serve: str, roles: Sequence[str], mib: int, *,
                       by_uid: int | None, external: bool = False,
                       note: str | None = None) -> tuple[Ledger, Admission] | None:
    """`serve`'s own reservation made `mib` (a serve put to sleep), whatever the ledger bound
    says: a shrink makes no role fuller, so it is made even on a role over-committed by adopted
    units (where the bound refuses any size). The reservation keeps its place (its since);
    decided on the ledger alone. None when it is no shrink: the serve holds nothing, or `mib`
    is more than it holds."""
    holding = ledger.reservations.get(serve)
    if holding is None or mib > holding.mib:
        return None
    res = Reservation(serve, roles[0], mib, holding.since, by_uid, external, tuple(roles[1:]))
    after = replace(ledger, reservations={**ledger.reservations, serve: res})
    figures = tuple(after.figures(name) for name in roles)
    return after, Admission(res, holding.mib, figures[0], "ledger", note, figures[1:])


@dataclass(frozen=True, slots=True)
class DeviceDraw:
    """One device's observed memory split by who draws it. All MiB."""

    total_mib: int
    used_mib: int
    physical_free_mib: int
    managed_draw_mib: int
    reserve_mib: int
    pending_mib: int
    by_serve: Mapping[str, int]
    # The driver reports no per-process memory (WDDM: NVML_VALUE_NOT_AVAILABLE for every
    # process; WSL2: no processes at all): the serves' draw is their reservations, an estimate.
    estimated: bool = False

    @property
    def non_ledger_draw_mib(self) -> int:
        return self.used_mib - self.managed_draw_mib

    @property
    def reserve_excess_mib(self) -> int:
        """Non-ledger draw beyond the reserve: what ledger free overstates. Estimated, a serve
        still starting draws unseen anything up to its reservation (pending_mib), which the
        estimate counts as non-ledger: only what is surely non-ledger is an excess, so that a
        start is never called one."""
        unseen = self.pending_mib if self.estimated else 0
        return self.non_ledger_draw_mib - unseen - self.reserve_mib

    def effective_free(self, ledger_free_mib: int) -> int:
        return min(ledger_free_mib, self.physical_free_mib - self.pending_mib)


def serve_draws(processes: Iterable[tuple[int, int | None]], owners: Mapping[int, str]) -> dict[str, int]:
    """MiB per serve from (pid, mib) pairs and pid → serve attribution. A process whose draw the
    driver could not report counts as unattributed (it stays in `used`, so in non-ledger draw)."""
    draws: dict[str, int] = {}
    for pid, mib in processes:
        serve = owners.get(pid)
        if serve is not None and mib is not None:
            draws[serve] = draws.get(serve, 0) + mib
    return draws


# Serves whose memory is in use by now: what an estimate attributes their reservation to.
DRAWING_STATES = frozenset({RUNNING, STOPPING, SLEEPING})


def estimated_draws(reservations: Iterable[Reservation], states: Mapping[str, ServeState],
                    used_mib: int) -> dict[str, int]:
    """Where the driver reports no per-process memory: each serve that runs (or sleeps, or is
    stopping) draws its reservation, never more in all than the device's used memory. Serves
    still starting draw nothing yet (they stay pending, as when nothing is seen of them)."""
    draws: dict[str, int] = {}
    left = used_mib
    for res in sorted(reservations, key=lambda r: r.serve):
        if states.get(res.serve) in DRAWING_STATES:
            mib = max(0, min(res.mib, left))
            draws[res.serve] = mib
            left -= mib
    return draws


def device_draw(
    *,
    total_mib: int,
    used_mib: int,
    free_mib: int,
    draws: Mapping[str, int],
    reservations: Iterable[Reservation],
    states: Mapping[str, ServeState],
    reserve_mib: int,
    per_process: bool = True,
) -> DeviceDraw:
    """Split one device's draw. `reservations` are those on the roles of this device; `draws`
    are the observed MiB per serve on it. Without `per_process` figures from the driver the
    draws are estimated from the reservations (estimated_draws) and the split says so."""
    reservations = list(reservations)
    if not per_process:
        draws = estimated_draws(reservations, states, used_mib)
    pending = 0
    for res in reservations:
        if states.get(res.serve, ADMITTED) in PENDING_STATES:
            pending += max(0, res.mib - draws.get(res.serve, 0))
    return DeviceDraw(
        total_mib=total_mib,
        used_mib=used_mib,
        physical_free_mib=free_mib,
        managed_draw_mib=sum(draws.values()),
        reserve_mib=reserve_mib,
        pending_mib=pending,
        by_serve=dict(draws),
        estimated=not per_process,
    )


def pending_share(res: Reservation | None, state: str | None, observed: int) -> int:
    if res is None or (state or ADMITTED) not in PENDING_STATES:
        return 0
    return max(0, res.mib - observed)


def sleep_reservation(held_mib: int, *, configured_mib: int | None, awake_seen_mib: int | None,
                      asleep_seen_mib: int | None, tolerance_mib: int) -> int:
    """What a serve put to sleep keeps reserved, never more than it held.

    Its sleep figure (`configured_mib`: serves.NAME.sleep_mib, or the draw measured after an
    earlier sleep), but never less than observation sees it hold asleep (plus the tolerance);
    without a figure, what it is seen to hold asleep plus the tolerance. A draw of 0 MiB is
    evidence only when observation saw the serve draw while awake: a serve none of whose memory
    is attributed to it (a driver that reports no per-process figure, a process outside its
    unit) is seen at 0 awake and asleep alike, and then, without a figure, it keeps all it held:
    the ledger does not call memory free that no one saw freed."""
    seen = asleep_seen_mib if awake_seen_mib else None
    if seen is None:
        if configured_mib is None:
            return held_mib
        target = configured_mib
    elif configured_mib is None or seen > configured_mib:
        target = seen + tolerance_mib
    else:
        target = configured_mib
    return max(1, min(target, held_mib))


def gpu_memory_utilization(vram_mib: int, total_mib: int) -> str:
    """vLLM's --gpu-memory-utilization is a fraction of the device TOTAL. Floor to 4 decimals so
    util x total never exceeds the reservation (14336 / 32607 -> 0.4396)."""
    if total_mib <= 0:
        raise ValueError("total_mib must be positive")
    ten_thousandths = (vram_mib * 10_000) // total_mib
    ten_thousandths = min(ten_thousandths, 10_000)
    return f"{ten_thousandths // 10_000}.{ten_thousandths % 10_000:04d}"
