"""A serve's one record and its one step: adapters say what happened, this module decides.

`Record` is what gpud knows of one serve at a time: its recorded state (what `gpuctl serves`
shows), whether it holds a reservation (and an external one), whether the config names it, and
its runtime under the supervisor (`life`: gpud's work under way on it, its pending job, its unit
as last seen: gpud.core.lifecycle.ServeLife).

`step(serve, event) -> Stepped | StateRefusal` is how it changes, in the manner of systemd's
`Unit` (one record, one writer of its active state). An event is either a `Report` (what an
adapter saw or did: `Happened`) or one of the supervisor's inputs of gpud.core.lifecycle. A
report decides the next state here (`next_state`), checked against the rule of
gpud.core.states (which states each cause may leave and lead to); the adapter that reports it
never names the state. A refusal is a value: the adapter that asked fails the whole change
(reservation, event and state together) and says so. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum

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
    """One serve's record. `holds` and `external` are its reservation once the change the
    report comes with is made (a release's report sees none held)."""

    state: ServeState | None = None  # None: no state recorded yet
    holds: bool = False
    external: bool = False
    configured: bool = True
    life: ServeLife = IDLE_LIFE


@dataclass(frozen=True)
class StoreState:
    """Store this state for the serve, in the transaction of the change reported."""

    state: ServeState


Effect = StoreState | LifeAction
Event = Report | Input


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


def step(serve: Record, event: Event) -> Stepped | StateRefusal:
    """The serve after `event`, and what its adapter is to do; or why the change is refused (a
    report whose state gpud.core.states does not allow from the serve's)."""
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
    return Stepped(Record(decided, serve.holds, serve.external, serve.configured, serve.life),
                   (StoreState(decided),))
