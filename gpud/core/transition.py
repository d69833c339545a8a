"""The ledger invariant, and the one function that decides every config change against it.

After every change (admit, release, start, stop, adopt, boot, reload, apply) these hold:

- every role's committed <= capacity - reserve, except over-commit left by reservations adopted
  from running units (a role may stay over-committed, never become more so);
- every reservation sits on roles that exist, and a configured serve's reservation sits on its
  configured role(s), all of them (a serve on several devices is never half-reserved: its
  reservation is one value, made, moved and released on every role at once);
- no serve is starting or running without a reservation.

`transition` takes the config in force, the new one, the ledger and the serve states, and returns
either the change (reservations to release, live serves whose units must stop first, the ledger
after) or a refusal naming every reservation in the way. Values in, values out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from gpud.core import answers
from gpud.core.config import Config, ServeConfig
from gpud.core.ledger import Ledger, Reservation, RoleBudget
from gpud.core.vocab import HOLDING_STATES, LIVE_STATES, ORPHAN, SLEEPING, ServeState


class Fate(StrEnum):
    """What a config change does to one reservation (`_fate`)."""

    KEEP = "keep"
    RELEASE = "release"  # its serve not live: the reservation goes
    STOP = "stop"  # its serve stopped first (only when the change may stop serves)

# [daemon] keys that gpud reads once, at start: a reload or apply cannot switch them.
RESTART_ONLY_KEYS = ("socket", "state_dir")


@dataclass(frozen=True, slots=True)
class ConfigBlocker:
    """One thing that stands in the way of a config change."""

    what: str  # a serve name, or a config key path
    reason: str
    role: str | None = None
    mib: int | None = None

    @property
    def message(self) -> str:
        held = f" ({self.mib} MiB on {self.role})" if self.role is not None else ""
        return f"{self.what}{held}: {self.reason}"

    def to_json(self) -> answers.Blocker:
        return {"what": self.what, "role": self.role, "mib": self.mib, "reason": self.reason,
                "message": self.message}


@dataclass(frozen=True, slots=True)
class Refusal:
    blockers: tuple[ConfigBlocker, ...]

    @property
    def message(self) -> str:
        return "; ".join(b.message for b in self.blockers)


@dataclass(frozen=True, slots=True)
class Transition:
    """What a config change does to the ledger: `stop` are live serves whose units stop first
    (their reservations are released with them), `release` reservations of serves that are not
    live. `ledger` is the ledger after, under the new roles."""

    ledger: Ledger
    release: tuple[str, ...] = ()
    stop: tuple[str, ...] = ()

    @property
    def released(self) -> tuple[str, ...]:
        return self.stop + self.release


def transition(
    *,
    old: Config,
    new: Config,
    ledger: Ledger,
    budgets: Iterable[RoleBudget],
    states: Mapping[str, ServeState],
    may_stop: bool,
) -> Transition | Refusal:
    """Decide a change from `old` to `new` (with `budgets`, the new roles resolved).

    A serve that leaves the config, or moves to another role, gives up its reservation: released
    when it is not live; when it is live its unit must stop first, which only `apply` does
    (`may_stop`); a plain reload is refused. An external reservation stays where it is: a role it
    sits on may not be removed, and a serve of its name may not be configured. A role the change
    would over-commit (beyond what it already was) is refused, naming what it holds.
    """
    blockers = _restart_only(old, new)
    roles = {b.name: b for b in budgets}
    kept: dict[str, Reservation] = {}
    release: list[str] = []
    stop: list[str] = []
    for res in sorted(ledger.reservations.values(), key=lambda r: (r.since, r.serve)):
        fate = _fate(res, old, new, roles, ledger, states, may_stop)
        if isinstance(fate, ConfigBlocker):
            blockers.append(fate)
        elif fate == Fate.KEEP:
            kept[res.serve] = res
            if states.get(res.serve) == SLEEPING and not res.external:
                blockers.extend(_unwakeable(res, old.serves.get(res.serve),
                                            new.serves[res.serve], roles, ledger.roles))
        elif fate == Fate.RELEASE:
            release.append(res.serve)
        else:
            stop.append(res.serve)
    blockers += _held_without_reservation(new, ledger, states)
    after = Ledger(roles, kept)
    blockers += _over_committed(after, ledger)
    if blockers:
        return Refusal(tuple(blockers))
    return Transition(after, tuple(release), tuple(stop))


def _restart_only(old: Config, new: Config) -> list[ConfigBlocker]:
    """[daemon] keys a change cannot switch (read once, at start)."""
    blockers: list[ConfigBlocker] = []
    for key in RESTART_ONLY_KEYS:
        before, after = getattr(old.daemon, key), getattr(new.daemon, key)
        if before != after:
            blockers.append(ConfigBlocker(f"daemon.{key}", f"{before!r} -> {after!r} takes effect only "
                                    "when gpud restarts: restart gpud instead"))
    return blockers


def _fate(res: Reservation, old: Config, new: Config, roles: Mapping[str, RoleBudget],
          ledger: Ledger, states: Mapping[str, ServeState],
          may_stop: bool) -> ConfigBlocker | Fate:
    """What the change does to one reservation: kept, released (its serve not live), its
    serve stopped first (only `may_stop`), or what stands in the way."""
    spec = new.serves.get(res.serve)
    if res.external:
        if spec is not None:
            return _blocker(res, "holds an external reservation; release it before "
                                 "configuring a serve of that name")
        if any(r not in roles for r in res.all_roles):
            gone = next(r for r in res.all_roles if r not in roles)
            return _blocker(res, f"external reservation on role {gone!r}, which the change "
                                 "removes; release it first")
        return Fate.KEEP
    # A serve on several roles keeps its reservation only on exactly the same roles: a
    # change of any of them moves the whole reservation (it is one, held on each).
    if spec is not None and spec.all_roles == res.all_roles \
            and all(r in roles for r in res.all_roles):
        return Fate.KEEP
    why = ("leaves the config" if spec is None
           else f"moves to role {spec.role!r}" if len(spec.all_roles) == 1
           else f"moves to roles {', '.join(spec.all_roles)}")
    if states.get(res.serve) not in LIVE_STATES:
        return Fate.RELEASE
    if may_stop:
        return Fate.STOP
    return _blocker(res, f"is {states[res.serve]} and {why}: stop it first "
                         "(gpuctl stop), or use gpuctl apply")


def _held_without_reservation(new: Config, ledger: Ledger,
                              states: Mapping[str, ServeState]) -> list[ConfigBlocker]:
    """Configured serves that run (or an orphan unit of their name does) with nothing held."""
    blockers: list[ConfigBlocker] = []
    for serve, state in sorted(states.items()):
        if serve not in new.serves or serve in ledger.reservations:
            continue
        if state in HOLDING_STATES:
            blockers.append(ConfigBlocker(serve, f"is {state} without a reservation"))
        elif state == ORPHAN:
            blockers.append(ConfigBlocker(serve, "an orphan unit of that name runs: stop it first "
                                           "(gpuctl stop)"))
    return blockers


def _over_committed(after: Ledger, ledger: Ledger) -> list[ConfigBlocker]:
    """Roles the change would over-commit, beyond what they already were."""
    blockers: list[ConfigBlocker] = []
    for name in sorted(after.roles):
        figures = after.figures(name)
        if figures.free_mib >= 0:
            continue
        if name in ledger.roles and not ledger.roles[name].missing \
                and figures.free_mib >= ledger.figures(name).free_mib:
            continue  # over-committed already (adopted units), and no worse
        held = ", ".join(f"{r.serve} {r.mib} MiB" for r in after.on_role(name))
        blockers.append(ConfigBlocker(f"roles.{name}", f"committed {figures.committed_mib} MiB would "
                                f"exceed capacity - reserve = "
                                f"{figures.capacity_mib - figures.reserve_mib} MiB (held: {held})"))
    return blockers


def _unwakeable(res: Reservation, before: ServeConfig | None, after: ServeConfig,
                roles: Mapping[str, RoleBudget],
                were: Mapping[str, RoleBudget]) -> list[ConfigBlocker]:
    """A sleeping serve keeps its sleep reservation through a change, and is woken later
    through its sleep endpoints, at the port its process listens on, to the size its process was
    launched with (its vram_mib before the change): a change that takes any of these away would
    leave it asleep for good, holding memory no one could get back."""
    lost: list[str] = []
    if not after.sleep_level:
        lost.append("its sleep_level is removed")
    if before is not None and after.port != before.port:
        lost.append(f"its port changes ({before.port} -> {after.port}; its process listens on "
                    f"{before.port})")
    awake = (before or after).vram_mib
    for name in res.all_roles:
        room = roles[name].capacity_mib - roles[name].reserve_mib
        was = were.get(name)
        had = was.capacity_mib - was.reserve_mib if was is not None and not was.missing else None
        if awake > room and (had is None or awake <= had):  # made so by this change
            lost.append(f"role {name!r} would hold {room} MiB at most (capacity - reserve), "
                        f"less than the {awake} MiB it wakes to")
    if not lost:
        return []
    return [_blocker(res, f"is sleeping and {' and '.join(lost)}: it could not be woken; wake "
                          "it (gpuctl wake) or stop it first")]


def _blocker(res: Reservation, reason: str) -> ConfigBlocker:
    return ConfigBlocker(res.serve, reason, res.roles_text, res.mib)


def violations(config: Config, ledger: Ledger, states: Mapping[str, ServeState], *,
               adopted_over: Mapping[str, int] | None = None) -> list[str]:
    """What is false about (config, ledger, states) against the invariant; [] when it holds.
    `adopted_over` gives, per role, how far adopted units may leave it over-committed."""
    return [text for _roles, text in violated(config, ledger, states, adopted_over=adopted_over)]


def violated(config: Config, ledger: Ledger, states: Mapping[str, ServeState], *,
             adopted_over: Mapping[str, int] | None = None) -> list[tuple[tuple[str, ...], str]]:
    """`violations`, each with the roles it concerns; one pass over the reservations (gpud
    evaluates it after every commit)."""
    problems: list[tuple[tuple[str, ...], str]] = []
    allowance = adopted_over or {}
    committed: dict[str, int] = {}
    for res in ledger.reservations.values():
        for role in set(res.all_roles):
            committed[role] = committed.get(role, 0) + res.mib
        for role in res.all_roles:
            budget = ledger.roles.get(role)
            if budget is None or budget.missing or role not in config.roles:
                problems.append(((role,), f"{res.serve}: reservation on role {role!r}, which is "
                                 "not configured"))
        if len(set(res.all_roles)) != len(res.all_roles):
            problems.append((res.all_roles, f"{res.serve}: reservation names a role twice: "
                             f"{res.roles_text}"))
    for name, budget in ledger.roles.items():
        held = committed.get(name, 0)
        if not budget.missing and name in config.roles and \
                budget.capacity_mib - budget.reserve_mib - held < -allowance.get(name, 0):
            problems.append(((name,), f"role {name!r}: committed {held} > capacity "
                             f"{budget.capacity_mib} - reserve {budget.reserve_mib}"))
    for res in ledger.reservations.values():
        spec = config.serves.get(res.serve)
        if res.external and spec is not None:
            problems.append((res.all_roles, f"{res.serve}: external reservation under a "
                             "configured serve's name"))
        if spec is not None and spec.all_roles != res.all_roles:
            problems.append((res.all_roles + spec.all_roles,
                             f"{res.serve}: reservation on {res.roles_text!r}, configured on "
                             f"{', '.join(spec.all_roles)!r}"))
    for serve, state in states.items():
        if state in HOLDING_STATES and serve not in ledger.reservations:
            spec = config.serves.get(serve)
            problems.append((spec.all_roles if spec else (), f"{serve}: {state} without a "
                             "reservation"))
    return problems
