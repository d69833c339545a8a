"""The ledger service: admission, holds, reload and reads, on top of the write path
(gpud.life.writes), which commits every change to the store before anyone is told it happened.

Mutations are serialized by one asyncio lock: the decision is made on the current ledger, the
transaction commits (in the store's worker thread), and only then the in-memory ledger moves on.
A failed commit leaves memory as it was. Everything the service needs from outside (store,
clock, observer) is passed in.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn, Protocol

from gpud import __version__
from gpud.config import Config, ServeConfig, check_name, parse_config
from gpud.core import answers
from gpud.core.budgets import resolve_budgets as resolve_budgets  # re-exported: its old home
from gpud.core.ledger import (
    Admission,
    Check,
    Denial,
    Ledger,
    PhysicalView,
    Reservation,
    shrink_reservation,
)
from gpud.core.serverecord import (
    Dropped,
    FoundHeld,
    Happened,
    Report,
    Reserved,
    Stored,
    StoreState,
)
from gpud.core.states import StateRefusal
from gpud.core.transition import Refusal, Transition, transition, violated
from gpud.core.vocab import (
    DENIED,
    LIVE_STATES,
    ORPHAN,
    STARTING,
    DenialBound,
    EventKind,
    ServeState,
)
from gpud.durable.store import Changes, Event, ServeStateRow, Store
from gpud.errors import BadRequest, ConfigError, Conflict, Denied, NotFound
from gpud.life.writes import Writes

log = logging.getLogger("gpud")

# The key of the hold on admissions while the invariant does not hold (not a serve name).
INVARIANT_HOLD = ":invariant"
# What an error in the config read back from the store names as its source.
STORED_CONFIG = "the config gpud last ran with"


class Observing(Protocol):
    """What the service asks of observation (see gpud.host.observer)."""

    @property
    def available(self) -> bool: ...

    def physical_view(self, device: str, serve: str, ledger: Ledger,
                      states: Mapping[str, ServeState]) -> PhysicalView | None: ...

    def device_total(self, device: str) -> int | None: ...

    def present_devices(self) -> list[str] | None: ...

    def device_problem(self, ref: str) -> str | None: ...


class Supervision(Protocol):
    """What the service asks of whoever launches the serves (the supervisor)."""

    def launch_under_way(self, serve: str) -> bool:
        """The serve's launch is under way: its unit may be about to run."""
        ...

    def launching(self) -> tuple[bool, str | None]:
        """Whether launching works, and why not."""
        ...

    def freed(self, role: str) -> None:
        """A durable change gave memory back on `role`: sleeping serves there may wake."""
        ...


class _Unsupervised:
    def launch_under_way(self, serve: str) -> bool:
        return False

    def launching(self) -> tuple[bool, str | None]:
        return False, "launching is not set up in this gpud"

    def freed(self, role: str) -> None:
        pass


UNSUPERVISED: Supervision = _Unsupervised()


@dataclass(frozen=True)
class Reported:
    """What happened to a serve, as an adapter reports it to the serve's one writer
    (`LedgerService.report`): the state it leads to is decided by gpud.core.serverecord.step."""

    serve: str
    report: Report
    reason: str | None = None


class StateRefused(Conflict):
    """A change of a serve's state the rule (gpud.core.states) refuses: the whole change it
    came with (reservation, event and state) is not made."""


class LedgerService(Writes):
    def __init__(
        self,
        config: Config,
        store: Store,
        *,
        config_path: Path | None = None,
        observer: Observing | None = None,
        clock: Callable[[], float] = time.time,
        config_text: str | None = None,
        overrides: Callable[[Config], Config] = lambda cfg: cfg,
    ) -> None:
        super().__init__(config, store, clock)
        # The text the running config came from, kept in the store: the next start decides the
        # file it finds against it.
        self.config_text = config_text
        self.overrides = overrides
        # Why the config file on disk is not the one in force (a refused change), if it is not.
        self.config_refused: str | None = None
        self.config_path = config_path
        self.observer = observer
        self.started_at = clock()
        self.ready = False
        # Who launches the serves, while one does (Supervisor, between entering and leaving
        # its context): see Supervision.
        self._supervision: Supervision = UNSUPERVISED
        # Roles on which no admission is granted for now, by who holds them (a serve whose
        # reservation disagrees with what it says it is, the invariant): key -> (roles, why).
        self._holds: dict[str, tuple[tuple[str, ...], str]] = {}
        # The invariant, evaluated after every commit: what was last found false, how often it
        # was found false, and how far adopted units may leave each role over-committed.
        self.violations: list[str] = []
        self.invariant_violations = 0
        self._adopted_over: dict[str, int] = {}

    # ---- lifecycle -------------------------------------------------------------------------

    def load(self) -> None:
        """Load the ledger from the store and decide the config against it, as a reload would:
        a change the ledger cannot follow (made to the file while gpud was away) is refused,
        and gpud goes on with the config it last ran with, saying why."""
        held = self.store.reservations()
        for row in self.store.serve_states():
            self._records.apply(row.serve, Stored(row.state, row.reason, row.updated))
        stored = self._stored_config()
        try:
            roles = resolve_budgets(stored or self.config, self._device_total, self._devices(),
                                    self._device_problem, self._device_id,
                                    source=STORED_CONFIG if stored else self.source)
        except ConfigError:
            if stored is None:
                raise
            stored = None  # it does not fit this host any more: decide against the file alone
            roles = resolve_budgets(self.config, self._device_total, self._devices(),
                                    self._device_problem, self._device_id, source=self.source)
        before = stored or self.config
        self.ledger = self._decided = Ledger.build(roles, held)
        for res in self.ledger.reservations.values():
            # In memory only, as it always was: a held reservation is never shown unreserved.
            self._records.apply(res.serve, FoundHeld(res.external))
        outcome = self._decide(before, self.config)
        if isinstance(outcome, Refusal):
            if stored is not None:
                self.config_refused = f"refused at start: {outcome.message}"
                log.error("the config file was changed while gpud was away in a way the ledger "
                          "cannot follow; running the config it last ran with: %s",
                          outcome.message)
                self.config = stored
                self.config_text = self.store.meta("config")
            else:
                log.error("the ledger does not fit the config: %s", outcome.message)
        else:
            self.store.commit(self._transition_changes(outcome, "config loaded at start", None))
            self._moved_on(outcome)
        self._reserved(self._records)
        for over in self.ledger.over_committed():
            self._adopted_over[over.role] = -over.free_mib  # units found running: allowed
            log.warning(
                "role %s is over-committed by %d MiB: %s", over.role, -over.free_mib, over.line(),
                extra={"journal": {"GPUD_EVENT": EventKind.OVER_COMMITTED, "GPUD_ROLE": over.role}},
            )

    def _stored_config(self) -> Config | None:
        text = self.store.meta("config")
        if text is None:
            return None
        try:
            return self.overrides(parse_config(text, STORED_CONFIG, checkpoints=False))
        except ConfigError as exc:
            log.warning("the stored config cannot be read (%s); deciding against the file alone",
                        exc.message)
            return None

    @property
    def source(self) -> str:
        """What a config error names: the config file, when gpud has one."""
        return str(self.config_path) if self.config_path is not None else "the config"

    def _devices(self) -> list[str] | None:
        return self.observer.present_devices() if self.observer else None

    def _decide(self, old: Config, new: Config, *, may_stop: bool = False) -> Transition | Refusal:
        budgets = resolve_budgets(new, self._device_total, self._devices(), self._device_problem,
                                  self._device_id, source=self.source)
        return transition(old=old, new=new, ledger=self.ledger, budgets=budgets,
                          states=self.states(), may_stop=may_stop)

    def decide(self, new: Config, *, may_stop: bool) -> Transition | Refusal:
        """What changing to `new` would do (see gpud.core.transition)."""
        return self._decide(self.config, new, may_stop=may_stop)

    def _transition_changes(self, t: Transition, source: str, uid: int | None) -> Changes:
        changes = Changes(meta={"config": self.config_text} if self.config_text else {})
        for serve in t.released:
            res = self.ledger.reservations[serve]
            figures = [t.ledger.figures(r) for r in res.all_roles if r in t.ledger.roles]
            changes.delete.append(serve)
            self._store_state(changes, self.report(serve, Happened.CONFIG_DROPPED,
                                                   f"released: {source}"), after=t.ledger)
            changes.events.append(self.event(
                EventKind.RELEASE, f"{serve} released {res.mib} MiB on {on_roles(res)} ({source}: the "
                f"serve left the config or its role)"
                + "".join(f"; {f.line()}" for f in figures),
                serve=serve, role=res.role, mib=res.mib, uid=uid, **roles_detail(res)))
        return changes

    def _moved_on(self, t: Transition) -> None:
        self.ledger = self._decided = t.ledger
        for serve in t.released:
            if serve in self._records:
                self._records.apply(serve, Dropped())
        self._reserved(self._records)

    def supervise(self, supervision: Supervision | None) -> None:
        """`supervision` launches the serves from now on (None: nobody does any more)."""
        self._supervision = supervision if supervision is not None else UNSUPERVISED

    def launching(self) -> tuple[bool, str | None]:
        """Whether launching works, and why not."""
        return self._supervision.launching()

    def busy(self, serve: str) -> bool:
        """The serve's launch is under way: its unit may be about to run."""
        return self._supervision.launch_under_way(serve)

    def _device_total(self, device: str) -> int | None:
        return self.observer.device_total(device) if self.observer else None

    def _device_problem(self, device: str) -> str | None:
        return self.observer.device_problem(device) if self.observer else None

    def _device_id(self, device: str) -> str | None:
        """The UUID of the device a reference names, where observation knows it."""
        find = getattr(self.observer, "device", None)
        dev = find(device) if callable(find) else None
        uuid = getattr(dev, "uuid", None)
        return uuid if isinstance(uuid, str) else None

    # ---- what became durable ---------------------------------------------------------------

    def _freed(self, roles: list[str]) -> None:
        for role in roles:
            self._supervision.freed(role)
        self._clear_denials(roles)

    def _clear_denials(self, roles: Sequence[str]) -> None:
        """A denied serve on `roles` that would now be admitted at its vram_mib is no longer
        denied: its reason is not true any more (it goes back to declared, unreserved)."""
        changes = Changes()
        for name, spec in self.config.serves.items():
            rec = self._records.get(name)
            if rec is None or rec.state != DENIED or self._decided_state(name) != DENIED \
                    or not any(r in roles for r in spec.all_roles):
                continue
            if all(self.free_for(name, r) >= spec.vram_mib for r in spec.all_roles):
                self._store_state(changes, self.report(name, Happened.CLEARED))
        if changes.states:
            self.submit(changes)

    def _check_invariant(self) -> None:
        """The invariant against what is durable now. Found false: an `invariant` event with
        the violations (journal at error level), the count behind
        gpud_invariant_violations_total, and admissions held on the roles concerned until it
        holds again."""
        for role, allowed in list(self._adopted_over.items()):
            budget = self.ledger.roles.get(role)
            over = -self.ledger.figures(role).free_mib if budget is not None else 0
            if min(allowed, over) > 0:
                self._adopted_over[role] = min(allowed, over)  # drains, never grows back
            else:
                del self._adopted_over[role]
        found = violated(self.config, self.ledger, self.states(), adopted_over=self._adopted_over)
        texts = sorted({text for _roles, text in found})
        if texts == self.violations:
            return
        new = [t for t in texts if t not in self.violations]
        self.violations = texts
        if texts:
            self.invariant_violations += len(new)
            roles = sorted({r for rs, _ in found for r in rs})
            self.hold(INVARIANT_HOLD, roles, "the invariant does not hold: " + "; ".join(texts))
            ev = self.event(EventKind.INVARIANT, "the invariant does not hold: " + "; ".join(texts)
                            + (f"; admissions on {', '.join(roles)} are refused until it holds"
                               if roles else ""), violations=texts, roles=roles, holds=False)
        else:
            self.lift(INVARIANT_HOLD)
            ev = self.event(EventKind.INVARIANT, "the invariant holds again", violations=[], holds=True)
        self.submit(Changes(events=[ev]))

    # ---- a serve's state, into the change that commits it ------------------------------------

    async def store_event(self, ev: Event, *, report: Reported | None = None,
                          meta: dict[str, str | None] | None = None) -> Event:
        """Store one event, with what happened to its serve (`report`: the state it leads to is
        decided by gpud.core.serverecord) and named values (`meta`, None deleting one) in its
        commit, outside any ledger change. A change the rule refuses raises StateRefused and
        stores nothing, the event neither."""
        async with self._lock:
            changes = Changes(events=[ev], meta=dict(meta or {}))
            if report is not None:
                self._store_state(changes, report)
            done = self.submit(changes)
        return (await done)[0]

    def _store_state(self, changes: Changes, row: Reported, *,
                     after: Ledger | None = None) -> None:
        """The one writer of a serve's recorded state. A report (`Reported`) is stepped on the
        serve's record (gpud.core.serverecord.step: its state decided, with the reservation it
        holds once `after`, the ledger the change makes, is committed). The state goes into
        `changes`, committed with the reservation change and the event beside it in one
        transaction. A change the rule refuses is logged and raises StateRefused: the caller
        submits nothing of `changes`. Callers hold the lock."""
        serve = row.serve
        prev = self._decided_states.get(serve)
        if prev is None and serve in self._records:
            prev = self._records[serve].state
        res = (after or self._decided).reservations.get(serve)
        stepped = self._records.decide(serve, row.report, prev, Reserved(
            res is not None, bool(res and res.external), serve in self.config.serves))
        if isinstance(stepped, StateRefusal):
            self._refuse_state(serve, stepped)
        stores = [e.state for e in stepped.effects if isinstance(e, StoreState)]
        if stores:
            changes.states.append(self.state_row(serve, stores[-1], row.reason))

    def _refuse_state(self, serve: str, refusal: StateRefusal) -> NoReturn:
        log.warning("%s: change refused: %s", serve, refusal.message, extra={
            "journal": {"GPUD_SERVE": serve, "GPUD_STATE_FROM": refusal.prev or "",
                        "GPUD_STATE_TO": refusal.next, "GPUD_CAUSE": refusal.cause or ""}})
        raise StateRefused(f"serve {serve!r}: {refusal.message}",
                           {"serve": serve, "state": refusal.prev, "next": refusal.next,
                            "cause": refusal.cause})

    def report(self, serve: str, happened: Happened, reason: str | None = None, *,
               back_to: ServeState | None = None) -> Reported:
        """What happened to `serve`, for `store_event`: its state is decided by its one step."""
        return Reported(serve, Report(happened, back_to), reason)

    def state_row(self, serve: str, state: ServeState,
                  reason: str | None = None) -> ServeStateRow:
        """A serve's state to commit."""
        return ServeStateRow(serve, state, reason, self.clock())

    # ---- holds -----------------------------------------------------------------------------

    def hold(self, key: str, roles: Sequence[str], why: str) -> None:
        """Refuse admissions on `roles` until `lift(key)`; the admissions of the serve named
        `key` itself (the one putting its reservation right) go through."""
        self._holds[key] = (tuple(roles), why)

    def lift(self, key: str) -> None:
        self._holds.pop(key, None)

    def hold_reason(self, role: str, serve: str) -> str | None:
        """Why admissions of `serve` on `role` are refused for now, else None."""
        for key, (roles, why) in self._holds.items():
            if key != serve and role in roles:
                return why
        return None

    # ---- admission -------------------------------------------------------------------------

    def serve_role(self, serve: str, role: str | None) -> tuple[str, bool]:
        """The (first) role an admission is for, and whether the reservation is external."""
        roles, external = self.serve_roles(serve, role)
        return roles[0], external

    def serve_roles(self, serve: str, role: str | None) -> tuple[tuple[str, ...], bool]:
        """The roles an admission is for (a configured serve's, all of them), and whether the
        reservation is external."""
        spec = self.config.serves.get(serve)
        if spec is not None:
            if role is not None and role not in spec.all_roles:
                if spec.extra_roles:
                    raise BadRequest(
                        f"serve {serve!r} is configured on roles {', '.join(spec.all_roles)}, "
                        f"not {role!r}",
                        {"serve": serve, "role": role, "configured_role": spec.role,
                         "configured_roles": list(spec.all_roles)})
                raise BadRequest(
                    f"serve {serve!r} is configured on role {spec.role!r}, not {role!r}",
                    {"serve": serve, "role": role, "configured_role": spec.role},
                )
            return spec.all_roles, False
        if role is None:
            raise NotFound(
                f"unknown serve {serve!r}: not in the config; to reserve memory for a process "
                f"gpud does not launch, give its role (gpuctl admit {serve} MIB --role ROLE)",
                {"serve": serve},
            )
        check_role_name(role)
        if role not in self.ledger.roles or self.ledger.roles[role].missing:
            raise NotFound(f"unknown role {role!r}", {"role": role, "roles": sorted(self.config.roles)})
        return (role,), True

    def _physical(self, roles: tuple[str, ...], serve: str
                  ) -> tuple[dict[str, PhysicalView] | None, Check, str | None]:
        """Strict admission's physical view of every device the serve would use, or the ledger
        bound alone (saying why) when one of them cannot be observed."""
        if self.config.daemon.admission == "ledger":
            return None, "ledger", None
        obs = self.observer
        decided_states = {**self.states(), **self._decided_states}
        views: dict[str, PhysicalView] = {}
        spec = self.serve_spec(serve)
        # vLLM's start check counts its CUDA context as used: a reservation that leaves no room
        # for it (vllm.context_mib unset) is admitted only with that much more free.
        headroom = (self.config.daemon.vllm_start_context_mib
                    if spec is not None and spec.vllm is not None and not spec.vllm.context_mib
                    else 0)
        for role in roles:
            device = self._decided.roles[role].device
            view = obs.physical_view(device, serve, self._decided, decided_states) if obs else None
            if view is None:
                return None, "ledger", (
                    "observation unavailable: strict admission fell back to the ledger bound")
            views[role] = replace(view, start_headroom_mib=headroom) if headroom else view
        return views, "strict", None

    async def admit(self, serve: str, mib: int, *, role: str | None = None,
                    uid: int | None = None,
                    event: tuple[EventKind, str, dict[str, Any]] | None = None,
                    shrink: bool = False, state_reason: str | None = None,
                    meta: dict[str, str | None] | None = None,
                    happened: Happened = Happened.ADMITTED) -> Admission:
        """Reserve `mib` for `serve` (its own reservation replaced), with its new state (what
        `happened` leads to: gpud.core.serverecord) and the event in the same transaction.
        `shrink` (a serve put to sleep) is decided on the ledger bound alone and never refused
        for a smaller reservation; `event` replaces the "admit" event (kind, message, details)."""
        check_serve_name(serve)
        async with self._lock:
            decided = self._admit_locked(serve, mib, role=role, uid=uid,
                                         event=event, shrink=shrink,
                                         state_reason=state_reason, meta=meta,
                                         happened=happened)
        admission, done = decided
        await done  # durable; a denial is answered only once what it was decided on is, too
        if isinstance(admission, Denied):
            raise admission
        return admission

    def _admit_locked(self, serve: str, mib: int, *, role: str | None, uid: int | None,
                      event: tuple[EventKind, str, dict[str, Any]] | None = None,
                      shrink: bool = False, state_reason: str | None = None,
                      meta: dict[str, str | None] | None = None,
                      happened: Happened = Happened.ADMITTED) -> tuple[Admission | Denied,
                                                     asyncio.Future[list[Event]]]:
        roles, external = self.serve_roles(serve, role)
        role_name = roles[0]
        for name in roles if not shrink else ():
            lost = self.lost_device(name)
            if lost is not None:
                return self._deny_on_lost_device(serve, name, mib, uid, lost)
            why = self.hold_reason(name, serve)
            if why is not None:
                return self._deny_on_lost_device(serve, name, mib, uid, why,
                                                 bound=DenialBound.HELD)
        physical, check, note = (None, "ledger", None) if shrink else self._physical(roles,
                                                                                     serve)
        outcome = self._decided.decide(
            serve, roles, mib, since=self.clock(), by_uid=uid, external=external,
            physical=physical, check=check, note=note,
        )
        if shrink and isinstance(outcome, Denial):
            # A shrink makes no role fuller: made even where the ledger bound refuses any size.
            outcome = shrink_reservation(self._decided, serve, roles, mib, by_uid=uid,
                                         external=external, note=note) or outcome
        if isinstance(outcome, Denial):
            done = self._deny(outcome, uid, check, note, roles)
            return Denied(outcome.message, {**outcome.details(), "check": check,
                                            "note": note}), done
        ledger, admission = outcome
        figures = admission.figures
        verb = f"replaced {admission.replaced_mib} MiB" if admission.replaced_mib else "new"
        each = " on each" if len(roles) > 1 else ""
        kind, message, details = event or (
            EventKind.ADMIT, f"{serve} admitted on {on_roles(admission.reservation)}: {mib} MiB{each} "
            f"({verb})", {})
        ev = self.event(
            kind, f"{message}; " + "; ".join(f.line() for f in admission.all_figures),
            serve=serve, role=role_name, mib=mib, uid=uid, check=check,
            replaced_mib=admission.replaced_mib, free_mib=figures.free_mib,
            committed_mib=figures.committed_mib, **roles_detail(admission.reservation),
            **details,
        )
        changes = Changes(put=[admission.reservation], events=[ev], meta=dict(meta or {}))
        self._store_state(changes, self.report(serve, happened, state_reason), after=ledger)
        done = self.submit(changes, ledger)
        return admission, done

    def free_for(self, serve: str, role: str) -> int:
        """What an admission of `serve` on `role` could get now (its own reservation counted
        back in): the ledger bound and, in strict admission, the physical one. Decides
        nothing."""
        free = self._decided.figures(role, excluding=serve).free_mib
        physical, _check, _note = self._physical((role,), serve)
        if physical is not None and role in physical:
            free = min(free, physical[role].free_for_serve())
        return free

    def lost_device(self, role: str) -> str | None:
        """Why the role's device cannot take memory now (observation reports it lost), else
        None. Its free figures mean nothing then: the ledger bound is no fallback."""
        budget = self.ledger.roles.get(role)
        problem = getattr(self.observer, "device_problem", None)
        if budget is None or budget.missing or not callable(problem):
            return None
        why = problem(budget.device)
        return f"device {budget.device!r} of role {role!r} is lost: {why}" if why else None

    def _deny_on_lost_device(self, serve: str, role: str, mib: int, uid: int | None,
                             lost: str, *, bound: DenialBound = DenialBound.DEVICE
                             ) -> tuple[Denied, asyncio.Future[list[Event]]]:
        """The denial (recorded, with the reason) of an admission on a role whose device is
        lost, or (`bound` "held") on which admissions are held."""
        message = f"{serve} denied on {role}: {lost}"
        ev = self.event(EventKind.DENY, message, serve=serve, role=role, mib=mib, uid=uid,
                        check=bound, bound=bound, need_mib=mib)
        return Denied(message, {"serve": serve, "role": role, "bound": bound,
                                "need_mib": mib, "device": self.ledger.roles[role].device,
                                "check": bound}), self.submit(Changes(events=self.refusals.stored(ev)))

    def _deny(self, denial: Denial, uid: int | None, check: Check,
              note: str | None, roles: tuple[str, ...] = ()) -> asyncio.Future[list[Event]]:
        ev = self.event(EventKind.DENY, denial.message, serve=denial.serve, role=denial.role,
                        mib=denial.need_mib, uid=uid, check=check, bound=denial.bound,
                        need_mib=denial.need_mib, free_mib=denial.free_mib,
                        shortfall_mib=denial.shortfall_mib,
                        **({"roles": list(roles)} if len(roles) > 1 else {}),
                        **({"lacking": denial.details()["lacking"]} if denial.more else {}))
        # Whether the serve is shown denied is its step's (a running serve, or one that holds
        # a reservation, keeps its state; an external name is not remembered for a failed ask).
        changes = Changes(events=self.refusals.stored(ev))
        self._store_state(changes, self.report(denial.serve, Happened.DENIED, denial.reason))
        return self.submit(changes)

    async def release(self, serve: str, *, uid: int | None = None, reason: str = "released",
                      state_reason: str | None = None,
                      allow_live: bool = False,
                      happened: Happened = Happened.RELEASED,
                      back_to: ServeState | None = None) -> Reservation:
        """Release a reservation, the serve's state what `happened` leads to (gpud.core.
        serverecord; `back_to` for a rollback). A serve whose process may still hold the memory is refused
        unless the caller (the supervisor, after stopping it) says otherwise."""
        check_serve_name(serve)
        async with self._lock:
            res, done = self._release_locked(serve, uid=uid, reason=reason,
                                             state_reason=state_reason,
                                             allow_live=allow_live,
                                             happened=happened, back_to=back_to)
        await done
        return res

    async def adopt(self, serve: str, role: str | Sequence[str], mib: int) -> Reservation:
        """Record the reservation of a unit found running: its memory is already in use, so it
        is kept even when it does not fit (the role then shows as over-committed). A serve on
        several roles is adopted on all of them at once."""
        roles = (role,) if isinstance(role, str) else tuple(role)
        async with self._lock:
            res = Reservation(serve, roles[0], mib, self.clock(), None, False, roles[1:])
            ledger = Ledger(self._decided.roles, {**self._decided.reservations, serve: res})
            figures = ledger.figures(roles[0])
            for name in roles:
                over = -ledger.figures(name).free_mib
                if over > 0:  # its memory is in use already: the invariant allows it
                    self._adopted_over[name] = max(self._adopted_over.get(name, 0), over)
            ev = self.event(EventKind.ADMIT, f"{serve} re-admitted on {on_roles(res)} for its running "
                            f"unit: {mib} MiB{' on each' if len(roles) > 1 else ''}; "
                            + "; ".join(ledger.figures(r).line() for r in roles),
                            serve=serve, role=roles[0], mib=mib,
                            adopted=True, free_mib=figures.free_mib, **roles_detail(res))
            done = self.submit(Changes(put=[res], events=[ev]), ledger)
        await done
        return res

    def _release_locked(self, serve: str, *, uid: int | None, reason: str,
                        state_reason: str | None,
                        allow_live: bool,
                        happened: Happened = Happened.RELEASED,
                        back_to: ServeState | None = None
                        ) -> tuple[Reservation, asyncio.Future[list[Event]]]:
        if serve not in self._decided.reservations:
            if serve in self.config.serves or serve in self._records:
                raise Conflict(f"serve {serve!r} holds no reservation", {"serve": serve})
            raise NotFound(f"unknown serve {serve!r}", {"serve": serve})
        state = self._decided_state(serve)
        if self.busy(serve) and not allow_live:
            state = STARTING
        if state in LIVE_STATES and not allow_live:
            raise Conflict(
                f"serve {serve!r} is {state}: its process may still hold the memory; stop it in "
                f"the same request (gpuctl release {serve} --stop)",
                {"serve": serve, "state": state},
            )
        ledger, res = self._decided.release(serve)
        figures = ledger.figures(res.role)
        ev = self.event(EventKind.RELEASE, f"{serve} released {res.mib} MiB"
                        f"{' on each of' if res.extra_roles else ' on'} {on_roles(res)} "
                        f"({reason}); " + "; ".join(ledger.figures(r).line() for r in res.all_roles),
                        serve=serve, role=res.role, mib=res.mib, uid=uid,
                        free_mib=figures.free_mib, **roles_detail(res))
        changes = Changes(delete=[serve], events=[ev])
        self._store_state(changes, self.report(serve, happened, state_reason,
                                               back_to=back_to), after=ledger)
        done = self.submit(changes, ledger)
        return res, done

    # ---- reload ----------------------------------------------------------------------------

    async def reload(self, cfg: Config, text: str, *, source: str,
                     uid: int | None = None) -> list[str]:
        """Swap in a new config, decided against the ledger in one step: reservations of serves
        that left it are released in the same transaction; a change the ledger cannot follow
        (a live serve removed, a held role removed, a role over-committed) is refused whole.
        Returns the roles that stay over-committed (adopted units)."""
        async with self._lock:
            await self.drain()  # decided on what is durable, with nothing on its way
            outcome = self.decide(cfg, may_stop=False)
            if isinstance(outcome, Refusal):
                raise Conflict(f"config change refused, nothing changed: {outcome.message}",
                               {"blockers": [b.to_json() for b in outcome.blockers]})
            previous = self.config_text
            self.config_text = text
            changes = self._transition_changes(outcome, f"reload from {source}", uid)
            over = [f.role for f in outcome.ledger.over_committed()]
            released = ", ".join(outcome.released)
            changes.events.append(self.event(
                EventKind.RELOAD, f"config reloaded from {source}"
                + (f"; released: {released}" if released else "")
                + (f"; over-committed: {', '.join(over)}" if over else ""),
                uid=uid, over_committed=",".join(over), released=released))
            try:
                await self.commit(changes, outcome.ledger)
            except BaseException:
                self.config_text = previous
                raise
            self.config = cfg
            self.config_refused = None
            self._moved_on(outcome)
            for role in over:  # adopted units keep it over-committed, as they did
                self._adopted_over[role] = -self.ledger.figures(role).free_mib
            return over

    # ---- reads -----------------------------------------------------------------------------

    def states(self) -> dict[str, ServeState]:
        return {name: self._records.state_of(name) for name in self._records}

    def state_of(self, serve: str) -> ServeState:
        return self._records.state_of(serve)

    def known_serves(self) -> list[str]:
        """The configured serves, those holding memory, and those whose unit may still run
        (an orphan, a removed serve still stopping). A serve the config no longer names that
        holds nothing is not listed: its history stays in the events."""
        names = set(self.config.serves) | set(self.ledger.reservations)
        names |= {n for n, r in self._records.items()
                  if r.state in LIVE_STATES or r.state == ORPHAN}
        return sorted(names)

    def serve_spec(self, serve: str) -> ServeConfig | None:
        return self.config.serves.get(serve)

    def summary(self) -> str:
        parts = []
        for name in sorted(self.ledger.roles):
            f = self.ledger.figures(name)
            parts.append(f"{name} {f.committed_mib}/{f.capacity_mib - f.reserve_mib} MiB committed "
                         f"(free {f.free_mib})")
        counts: dict[str, int] = {}
        for serve in self.known_serves():
            state = self.state_of(serve)
            counts[state] = counts.get(state, 0) + 1
        serves = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        return "; ".join(parts) + f"; {sum(counts.values())} serves: {serves or 'none'}"

    def status_view(self, observation: answers.Observation) -> answers.Status:
        counts: dict[str, int] = {}
        for serve in self.known_serves():
            state = self.state_of(serve)
            counts[state] = counts.get(state, 0) + 1
        available, why = self.launching()
        return {
            "version": __version__,
            "host": socket.gethostname(),
            "config": str(self.config_path) if self.config_path else None,
            "admission": self.config.daemon.admission,
            "started_at": self.started_at,
            "ready": self.ready,
            "launching": {"available": available, "reason": why},
            "observation": observation,
            "serve_states": counts,
            "over_committed": [f.role for f in self.ledger.over_committed()],
            "config_file": self.config_file_status(),
            "store_transactions": self.commits,
            "store": self.store_status(),
            "summary": self.summary(),
        }

    def config_file_status(self) -> answers.ConfigFile:
        """Whether the config file on disk is the config in force, and why not."""
        if self.config_path is None:
            return {"differs": False, "reason": None}
        try:
            on_disk: str | None = self.config_path.read_text()
        except (OSError, UnicodeDecodeError):
            on_disk = None
        differs = self.config_text is not None and on_disk != self.config_text
        reason = self.config_refused if differs else None
        if differs and reason is None:
            reason = ("the file changed since it was loaded: gpuctl plan shows what a reload "
                      "would do" if on_disk is not None else "the file cannot be read")
        return {"differs": differs, "reason": reason}



def on_roles(res: Reservation) -> str:
    """The roles of a reservation for a message: `dark-fast`, or `left, right`."""
    return res.roles_text


def roles_detail(res: Reservation) -> dict[str, Any]:
    """An event's `roles` detail (every role, for a serve on several), nothing for one role: a
    single-role serve's events stay as they were."""
    return {"roles": list(res.all_roles)} if res.extra_roles else {}


def check_serve_name(name: str) -> None:
    try:
        check_name("serve", name)
    except ValueError as exc:
        raise BadRequest(str(exc), {"serve": name[:300]}) from exc


def check_role_name(name: str) -> None:
    try:
        check_name("role", name)
    except ValueError as exc:
        raise BadRequest(str(exc), {"role": name[:300]}) from exc

