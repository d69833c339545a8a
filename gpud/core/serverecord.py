"""A serve's one record and its one step: adapters say what happened, this module decides.

`Record` is what gpud knows of one serve at a time, whole: its recorded state (what `gpuctl
serves` shows) with its reason and when it was stored, whether it holds a reservation (and an
external one), whether the config names it, its unit's main PID and restart count as systemd
last said them, its on-demand facts (`demand`: gpud.core.demand.Demand) and its runtime under
the supervisor (`life`: gpud's work under way on it, its pending job, its unit as last seen:
gpud.core.lifecycle.ServeLife). What is asked of a serve across those parts ("is a stop of it
under way?", "is it settling?") is answered here, as properties of the record.

`step(serve, event) -> Stepped | StateRefusal` is the one way it changes, in the manner of
systemd's `Unit` (one record, one writer of its active state), and it sees the whole record.
An event is one of:

- a `Report` (what an adapter saw or did: `Happened`): decides the next state here
  (`next_state`), checked against the rule of gpud.core.states (which states each cause may
  leave and lead to); the adapter that reports it never names the state;
- `Stored` (the state the store holds: committed after a report's step, or read back at
  start), `Reserved` (what the ledger and the config now say of it), `FoundHeld` (a
  reservation found in the store at start), `Dropped` (a config without it released it);
- `UnitPid`, `UnitRestarts` (what systemd said of its unit); `Put` (a part set whole, for
  tests and tools alone);
- one of gpud.core.demand's events (its on-demand facts);
- one of the supervisor's inputs of gpud.core.lifecycle (its life).

A refusal is a value: the adapter that asked fails the whole change (reservation, event and
state together) and says so. gpud.life.records.ServeRecords.apply is the one place a stepped
record is kept. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum

from gpud.core import demand as demand_rules
from gpud.core import traffic
from gpud.core.demand import NO_DEMAND, Demand, DemandEvent
from gpud.core.lifecycle import IDLE_LIFE, Input, LifeAction, ServeLife
from gpud.core.lifecycle import step as life_step
from gpud.core.states import Cause, StateRefusal, check_change
from gpud.core.vocab import (
    ADMITTED,
    DECLARED,
    DENIED,
    EXTERNAL,
    FAILED,
    LIVE_STATES,
    ORPHAN,
    RUNNING,
    SLEEPING,
    STARTING,
    STOPPING,
    Phase,
    ServeState,
)


class Happened(StrEnum):
    """What an adapter reports of a serve: something it saw or did, never the state it leads to."""

    ADMITTED = "admitted"  # a reservation granted (the API, a start's, an apply's)
    DENIED = "denied"  # an admission refused
    CLEARED = "cleared"  # a denial no longer true (memory came back)
    LAUNCHED = "launched"  # gpud started the serve's unit
    HEALTHY = "healthy"  # its health check answered
    RESTARTING = "restarting"  # restarted by systemd or by gpud, or found active again
    FOUND_ORPHAN = "found-orphan"  # a unit found running for a serve the config does not name
    FOUND_ACTIVE = "found-active"  # its unit found running at gpud's start
    FOUND_ASLEEP = "found-asleep"  # found running and asleep (whatever was recorded)
    FOUND_AS_RECORDED = "found-as-recorded"  # found running as recorded, asleep or awake
    FOUND_AWAKE = "found-awake"  # recorded asleep, found awake and re-admitted: starts over
    STARTED_OUTSIDE = "started-outside"  # its unit started by something other than gpud
    ORPHAN_ENDED = "orphan-ended"  # an orphan's unit ended (or gpud stopped it)
    STOP_BEGUN = "stop-begun"  # a stop of its unit under way (or failed, its unit not ended)
    STOPPED = "stopped"  # its unit ended by a stop: admitted while it holds a reservation
    FAILED = "failed"  # it exited, went unhealthy or crash-looped
    ASLEEP = "asleep"  # put to sleep (by gpud, or seen asleep outside it)
    WAKE_ADMITTED = "wake-admitted"  # its awake size re-admitted: still asleep until awake
    WOKEN = "woken"  # awake (woken by gpud, or seen awake outside it)
    RELEASED = "released"  # its reservation released
    ROLLED_BACK = "rolled-back"  # an apply's undo released it: back to its state before
    CONFIG_DROPPED = "config-dropped"  # a config without it released it (reload, start)


# Why each report changes the state, in gpud.core.states' words (its rule checks the change).
CAUSES: Mapping[Happened, Cause] = {
    Happened.ADMITTED: Cause.ADMIT,
    Happened.DENIED: Cause.DENY,
    Happened.CLEARED: Cause.CLEAR,
    Happened.LAUNCHED: Cause.LAUNCH,
    Happened.HEALTHY: Cause.HEALTHY,
    Happened.RESTARTING: Cause.RESTART,
    Happened.FOUND_ORPHAN: Cause.ADOPT,
    Happened.FOUND_ACTIVE: Cause.ADOPT,
    Happened.FOUND_ASLEEP: Cause.ADOPT,
    Happened.FOUND_AS_RECORDED: Cause.ADOPT,
    Happened.FOUND_AWAKE: Cause.ADOPT,
    Happened.STARTED_OUTSIDE: Cause.ADOPT,
    Happened.ORPHAN_ENDED: Cause.EXIT,
    Happened.STOP_BEGUN: Cause.STOP,
    Happened.STOPPED: Cause.STOP,
    Happened.FAILED: Cause.FAIL,
    Happened.ASLEEP: Cause.SLEEP,
    Happened.WAKE_ADMITTED: Cause.WAKE,
    Happened.WOKEN: Cause.WAKE,
    Happened.RELEASED: Cause.RELEASE,
    Happened.ROLLED_BACK: Cause.RELEASE,
    Happened.CONFIG_DROPPED: Cause.RELOAD,
}

# The reports that lead to one state whatever the serve was.
FIXED: Mapping[Happened, ServeState] = {
    Happened.DENIED: DENIED,
    Happened.CLEARED: DECLARED,
    Happened.LAUNCHED: STARTING,
    Happened.HEALTHY: RUNNING,
    Happened.RESTARTING: STARTING,
    Happened.FOUND_ORPHAN: ORPHAN,
    Happened.FOUND_ASLEEP: SLEEPING,
    Happened.FOUND_AWAKE: STARTING,
    Happened.STARTED_OUTSIDE: STARTING,
    Happened.ORPHAN_ENDED: DECLARED,
    Happened.STOP_BEGUN: STOPPING,
    Happened.FAILED: FAILED,
    Happened.ASLEEP: SLEEPING,
    Happened.WAKE_ADMITTED: SLEEPING,
    Happened.WOKEN: RUNNING,
    Happened.RELEASED: DECLARED,
    Happened.CONFIG_DROPPED: DECLARED,
}


# The reports that leave a serve awake on its memory: refused when the change they come with
# leaves it no reservation (a release that said "woken" would leave a running serve that
# holds none).
NEEDS_RESERVATION: frozenset[Happened] = frozenset({Happened.WOKEN})


@dataclass(frozen=True)
class Report:
    """What happened to a serve, as an adapter says it. `back_to` (a rollback alone): the state
    the serve had before the apply, as the apply's plan recorded it (None: declared)."""

    happened: Happened
    back_to: ServeState | None = None


@dataclass(frozen=True)
class Record:
    """One serve's record (see the module). Stepped on a report, `holds` and `external` are its
    reservation once the change the report comes with is made (a release's report sees none
    held)."""

    state: ServeState | None = None  # None: no state recorded yet
    holds: bool = False
    external: bool = False
    configured: bool = True
    life: ServeLife = IDLE_LIFE
    reason: str | None = None  # why it is in its state, as stored with it
    updated: float = 0.0  # when its state was stored (the service's clock)
    main_pid: int | None = None  # its unit's MainPID as systemd last said it (None: none)
    n_restarts: int = 0  # its unit's NRestarts as systemd last said it
    demand: Demand = NO_DEMAND

    @property
    def stopping(self) -> bool:
        """A job of gpud's on its unit is under way (a stop, a restart, a failed serve's stop):
        the unit's signals are gpud's own doing now, and the job records what happens."""
        return self.life.stopping

    @property
    def stop_recorded(self) -> bool:
        """Its recorded state is stopping (a stop begun, or one that failed with its unit not
        ended)."""
        return self.state == STOPPING

    def settling(self, draining: bool = False) -> bool:
        """A sleep or a stop of it is under way, or decided, or drained for (`settling`)."""
        return settling(self.demand, self.life.phase, draining)


def settling(demand: Demand, phase: Phase, draining: bool) -> bool:
    """A serve whose on-demand facts are DEMAND and whose life is in PHASE is settling: a sleep
    or a stop of it is under way (SETTLING_PHASES), or the idle check decided one
    (`demand.idling`), or the drain before one (DRAINING, the in-flight poller's:
    gpud.life.traffic). A request must not reach it now, and waits for it to end before it is
    woken or started again."""
    return demand.idling or traffic.settling(phase, draining)


@dataclass(frozen=True)
class StoreState:
    """Store this state for the serve, in the transaction of the change reported."""

    state: ServeState


@dataclass(frozen=True)
class Stored:
    """The serve's state as the store holds it: committed (after its report was stepped, in the
    transaction of its change), or read back from the store at start."""

    state: ServeState
    reason: str | None
    updated: float


@dataclass(frozen=True)
class Reserved:
    """What the ledger and the config say of the serve now: it holds a reservation (an external
    one), the config names it."""

    holds: bool
    external: bool
    configured: bool


@dataclass(frozen=True)
class FoundHeld:
    """A reservation of the serve found in the store at start. A held reservation is never
    shown unreserved: a serve recorded declared or denied (or with no state) shows admitted
    (external, for an external one)."""

    external: bool


@dataclass(frozen=True)
class Dropped:
    """A config without the serve released its reservation (a reload, or gpud's start): it is
    declared, holds nothing, and the config does not name it."""


@dataclass(frozen=True)
class UnitPid:
    """The main PID of the serve's unit as systemd said it (None: none, or none to show)."""

    pid: int | None


@dataclass(frozen=True)
class UnitRestarts:
    """How often systemd restarted the serve's unit (its NRestarts), 0 after a launch."""

    count: int


@dataclass(frozen=True)
class Put:
    """Its on-demand facts or its life set whole (None: left as they are): for tests and tools
    that put a serve in a given condition. gpud's own adapters report what happened (the
    events above, gpud.core.demand's, gpud.core.lifecycle's), never a part of the record."""

    demand: Demand | None = None
    life: ServeLife | None = None


Effect = StoreState | LifeAction
Fact = Stored | Reserved | FoundHeld | Dropped | UnitPid | UnitRestarts | Put
Event = Report | Input | DemandEvent | Fact


@dataclass(frozen=True)
class Stepped:
    serve: Record
    effects: tuple[Effect, ...] = ()


def _admitted(serve: Record, report: Report) -> ServeState:
    # A re-admission keeps a live serve's state.
    return (EXTERNAL if serve.external
            else serve.state if serve.state in LIVE_STATES else ADMITTED)


def _found_active(serve: Record, report: Report) -> ServeState:
    # Found running, its health not yet asked: it keeps a running or starting state.
    return serve.state if serve.state in (RUNNING, STARTING) else STARTING


def _found_as_recorded(serve: Record, report: Report) -> ServeState:
    return RUNNING if serve.state == RUNNING else SLEEPING


def _stopped(serve: Record, report: Report) -> ServeState:
    # A stop that keeps the reservation (a restart's first half) leaves the serve admitted.
    return ADMITTED if serve.holds else DECLARED


def _rolled_back(serve: Record, report: Report) -> ServeState:
    return report.back_to or DECLARED


# The reports whose state depends on the serve (or on the report).
RULES: Mapping[Happened, Callable[[Record, Report], ServeState]] = {
    Happened.ADMITTED: _admitted,
    Happened.FOUND_ACTIVE: _found_active,
    Happened.FOUND_AS_RECORDED: _found_as_recorded,
    Happened.STOPPED: _stopped,
    Happened.ROLLED_BACK: _rolled_back,
}


def next_state(serve: Record, report: Report) -> ServeState | None:
    """The state `report` leads the serve to, before the rule checks it; None: the report
    changes no state (a denial of a serve whose process may hold memory, or that holds a
    reservation, or that the config does not name)."""
    what = report.happened
    if what is Happened.DENIED and (serve.state in LIVE_STATES or serve.holds
                                    or not serve.configured):
        return None
    if what in FIXED:
        return FIXED[what]
    return RULES[what](serve, report)


def _fact(serve: Record, fact: Fact) -> Record:
    if isinstance(fact, Stored):
        return replace(serve, state=fact.state, reason=fact.reason, updated=fact.updated)
    if isinstance(fact, Reserved):
        return replace(serve, holds=fact.holds, external=fact.external,
                       configured=fact.configured)
    if isinstance(fact, FoundHeld):
        shown = serve.state
        if shown is None:
            shown = ADMITTED
        elif shown in (DECLARED, DENIED):
            shown = EXTERNAL if fact.external else ADMITTED
        return replace(serve, state=shown, holds=True, external=fact.external)
    if isinstance(fact, Dropped):
        return replace(serve, state=DECLARED, reason=None, holds=False, external=False,
                       configured=False)
    if isinstance(fact, UnitPid):
        return replace(serve, main_pid=fact.pid)
    if isinstance(fact, Put):
        return replace(serve, demand=serve.demand if fact.demand is None else fact.demand,
                       life=serve.life if fact.life is None else fact.life)
    return replace(serve, n_restarts=fact.count)


def step(serve: Record, event: Event) -> Stepped | StateRefusal:
    """The serve after `event`, and what its adapter is to do; or why the change is refused (a
    report whose state gpud.core.states does not allow from the serve's)."""
    if isinstance(event, Fact):
        return Stepped(_fact(serve, event))
    if isinstance(event, DemandEvent):
        return Stepped(replace(serve, demand=demand_rules.step(serve.demand, event)))
    if not isinstance(event, Report):
        life, actions = life_step(serve.life, event)
        return Stepped(replace(serve, life=life), tuple(actions))
    target = next_state(serve, event)
    if target is None:
        return Stepped(serve)
    decided = check_change(serve.state, target, CAUSES[event.happened])
    if isinstance(decided, StateRefusal):
        return decided
    if event.happened in NEEDS_RESERVATION and not serve.holds:
        return StateRefusal(serve.state, target, CAUSES[event.happened],
                            f"{event.happened} needs a reservation held, and the serve holds none")
    return Stepped(replace(serve, state=decided), (StoreState(decided),))


def as_planned(serve: Record, state: ServeState | None, reserved: Reserved) -> Record:
    """The serve's record as the change under way leaves it, for a report to be stepped on
    before the change is committed: its state as decided so far (STATE: None, none recorded)
    and its reservation and config as the change makes them (RESERVED)."""
    return replace(_fact(serve, reserved), state=state)
