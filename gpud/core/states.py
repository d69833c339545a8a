"""Which recorded states a serve may go to, and why: the rule its one writer consults.

A serve's state (what `gpuctl serves` shows) is stored by one adapter,
`LedgerService._store_state`; before it stores one it asks `check_change(prev, next, cause)` here. The
answer is the state to store, or a `StateRefusal` saying why not: the adapter logs a refusal and
stores nothing. What is allowed is what gpud does today, site by site (the `cause` each writer
passes): a cause names the states it may lead to (`TARGETS`) and the states it may leave
(`SOURCES`; `None` is a serve with no record yet). Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

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
    STATES,
    STOPPING,
    ServeState,
)


class Cause(StrEnum):
    """Why a serve's recorded state changes: what the writer that asks has seen or done."""

    ADMIT = "admit"  # a reservation granted (the API, a launch's, an apply's)
    DENY = "deny"  # an admission refused: the serve is denied, with the reason
    CLEAR = "clear"  # a denial that is no longer true (memory came back): declared again
    LAUNCH = "launch"  # gpud started the serve's unit
    HEALTHY = "healthy"  # its health check answered
    RESTART = "restart"  # restarted (by systemd or by gpud), or found running again
    ADOPT = "adopt"  # a unit found running (at startup, or started outside gpud)
    EXIT = "exit"  # its unit ended (an orphan's end, a stop's end)
    STOP = "stop"  # gpud stops it (or its stop failed, or it was stopped outside gpud)
    FAIL = "fail"  # it exited, went unhealthy or crash-looped
    SLEEP = "sleep"  # put to sleep (by gpud, or seen asleep outside it)
    WAKE = "wake"  # woken (by gpud, or seen awake outside it)
    RELEASE = "release"  # its reservation released (the API, a stop, a failure, a rollback)
    RELOAD = "reload"  # a config change released it (reload, or the config found at start)


ANY: frozenset[ServeState | None] = frozenset((*STATES, None))
_NOT_LIVE: frozenset[ServeState | None] = ANY - LIVE_STATES

# The states each cause may lead to.
TARGETS: Mapping[Cause, frozenset[ServeState]] = {
    # An admission keeps a live serve's state (a re-admission), else admitted or external; a
    # wake's re-admission keeps it sleeping until it is awake; reconciliation re-admits an
    # awake serve running.
    Cause.ADMIT: frozenset({ADMITTED, EXTERNAL, *LIVE_STATES}),
    Cause.DENY: frozenset({DENIED}),
    Cause.CLEAR: frozenset({DECLARED}),
    Cause.LAUNCH: frozenset({STARTING}),
    Cause.HEALTHY: frozenset({RUNNING}),
    Cause.RESTART: frozenset({STARTING}),
    Cause.ADOPT: frozenset({ORPHAN, STARTING, RUNNING, SLEEPING}),
    Cause.EXIT: frozenset({DECLARED, ADMITTED}),
    Cause.STOP: frozenset({STOPPING, ADMITTED, DECLARED}),
    Cause.FAIL: frozenset({FAILED}),
    Cause.SLEEP: frozenset({SLEEPING}),
    Cause.WAKE: frozenset({RUNNING, SLEEPING}),
    # A rollback's release takes the serve back to the state it had before the apply.
    Cause.RELEASE: frozenset({DECLARED, FAILED, ADMITTED, DENIED, EXTERNAL}),
    Cause.RELOAD: frozenset({DECLARED}),
}

# The states each cause may leave.
SOURCES: Mapping[Cause, frozenset[ServeState | None]] = {
    Cause.ADMIT: ANY,
    # A serve whose process may hold memory keeps its state when its re-admission is refused.
    Cause.DENY: _NOT_LIVE,
    Cause.CLEAR: frozenset({DENIED}),
    Cause.LAUNCH: ANY - {STOPPING, ORPHAN},
    # Healthy: a start or a restart that answered, or a failed serve that recovered.
    Cause.HEALTHY: frozenset({STARTING, RUNNING, FAILED, SLEEPING}),
    Cause.RESTART: ANY - {DECLARED, DENIED, ORPHAN, None},
    Cause.ADOPT: ANY,
    Cause.EXIT: ANY,
    Cause.STOP: ANY,
    Cause.FAIL: ANY,
    Cause.SLEEP: ANY - {DECLARED, DENIED, ORPHAN, None},
    Cause.WAKE: ANY - {DECLARED, DENIED, ORPHAN, None},
    Cause.RELEASE: ANY,
    Cause.RELOAD: ANY,
}


@dataclass(frozen=True)
class StateRefusal:
    """A change of recorded state the rule does not allow: not stored."""

    prev: ServeState | None
    next: ServeState
    cause: Cause | None
    # Why, where the rule of the serve's record (gpud.core.serverecord) refuses a change this
    # rule allows: it names what the record lacks.
    why: str | None = None

    @property
    def message(self) -> str:
        was = self.prev or "unrecorded"
        if self.why is not None:
            why = self.why
        elif self.cause is None:
            why = "no cause leads there from there"
        elif self.next not in TARGETS[self.cause]:
            why = f"{self.cause} leads only to {', '.join(sorted(TARGETS[self.cause]))}"
        else:
            why = f"{self.cause} does not apply to a serve that is {was}"
        return f"{was} -> {self.next} ({self.cause or 'no cause named'}) refused: {why}"


def check_change(prev: ServeState | None, next: ServeState,
                 cause: Cause) -> ServeState | StateRefusal:
    """The state to store when a serve that is `prev` (None: no record) is to become `next`
    because of `cause`, or why it may not. Every change names its cause."""
    if next in TARGETS[cause] and prev in SOURCES[cause]:
        return next
    return StateRefusal(prev, next, cause)
