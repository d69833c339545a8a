"""The rule of recorded states (gpud.core.states): every (state before, state after, cause)
from the enums, against a table written out here, and the transitions gpud's writers make."""

from __future__ import annotations

import itertools

import pytest

from gpud.core.states import Cause, StateRefusal, check_change
from gpud.core.vocab import (
    ADMITTED,
    DECLARED,
    DENIED,
    EXTERNAL,
    FAILED,
    ORPHAN,
    RUNNING,
    SLEEPING,
    STARTING,
    STOPPING,
    ServeState,
)

S = ServeState
EVERY: tuple[ServeState | None, ...] = (*S, None)

# cause: (the states it may leave, the states it may lead to), spelled out: "*" is every state
# and no record; "-x,y" every one but those.
TABLE: dict[Cause, tuple[str, str]] = {
    Cause.ADMIT: ("*", "admitted,external,starting,running,stopping,sleeping"),
    Cause.DENY: ("-starting,running,stopping,sleeping", "denied"),
    Cause.CLEAR: ("denied", "declared"),
    Cause.LAUNCH: ("-stopping,orphan", "starting"),
    Cause.HEALTHY: ("starting,running,failed,sleeping", "running"),
    Cause.RESTART: ("-declared,denied,orphan,none", "starting"),
    Cause.ADOPT: ("*", "orphan,starting,running,sleeping"),
    Cause.EXIT: ("*", "declared,admitted"),
    Cause.STOP: ("*", "stopping,admitted,declared"),
    Cause.FAIL: ("*", "failed"),
    Cause.SLEEP: ("-declared,denied,orphan,none", "sleeping"),
    Cause.WAKE: ("-declared,denied,orphan,none", "running,sleeping"),
    Cause.RELEASE: ("*", "declared,failed,admitted,denied,external"),
    Cause.RELOAD: ("*", "declared"),
}


def _states(text: str) -> set[ServeState | None]:
    def one(name: str) -> ServeState | None:
        return None if name == "none" else S(name)
    if text == "*":
        return set(EVERY)
    if text.startswith("-"):
        return set(EVERY) - {one(n) for n in text[1:].split(",")}
    return {one(n) for n in text.split(",")}


def test_the_table_names_every_cause() -> None:
    assert set(TABLE) == set(Cause)


@pytest.mark.parametrize(("prev", "nxt", "cause"),
                         list(itertools.product(EVERY, tuple(S), tuple(Cause))))
def test_every_state_and_cause(prev: ServeState | None, nxt: ServeState, cause: Cause) -> None:
    sources, targets = TABLE[cause]
    got = check_change(prev, nxt, cause)
    if prev in _states(sources) and nxt in _states(targets):
        assert got == nxt
    else:
        assert got == StateRefusal(prev, nxt, cause)
        assert isinstance(got, StateRefusal)
        assert str(nxt) in got.message and str(cause) in got.message
        assert str(prev or "unrecorded") in got.message


# What gpud's writers do today (the site, then the transition): each one allowed.
WRITERS = [
    (None, ADMITTED, Cause.ADMIT),  # gpuctl admit of a configured serve
    (DECLARED, EXTERNAL, Cause.ADMIT),  # an external reservation
    (RUNNING, RUNNING, Cause.ADMIT),  # a running serve re-admitted keeps its state
    (SLEEPING, SLEEPING, Cause.ADMIT),  # a wake's re-admission: asleep until awake
    (ADMITTED, STARTING, Cause.LAUNCH),  # supervisor/launch: the unit started
    (FAILED, STARTING, Cause.LAUNCH),  # started again after a failure
    (STARTING, RUNNING, Cause.HEALTHY),  # supervisor/health: healthy
    (FAILED, RUNNING, Cause.HEALTHY),  # healthy again
    (RUNNING, STARTING, Cause.RESTART),  # unhealthy: restarted through its unit
    (FAILED, STARTING, Cause.RESTART),  # re-read after the bus came back
    (None, ORPHAN, Cause.ADOPT),  # boot: a unit the config does not name
    (DECLARED, STARTING, Cause.ADOPT),  # a unit started outside gpud
    (ORPHAN, DECLARED, Cause.EXIT),  # an orphan's unit ended
    (RUNNING, STOPPING, Cause.STOP),  # supervisor/stop
    (STOPPING, ADMITTED, Cause.STOP),  # stopped, its reservation kept
    (STOPPING, DECLARED, Cause.RELEASE),  # stopped, its reservation released
    (STARTING, FAILED, Cause.FAIL),  # exited
    (RUNNING, FAILED, Cause.RELEASE),  # released before the failure is recorded
    (RUNNING, SLEEPING, Cause.SLEEP),  # sleeping: asleep
    (SLEEPING, RUNNING, Cause.WAKE),  # sleeping: awake
    (None, DENIED, Cause.DENY),  # an admission refused
    (DENIED, DECLARED, Cause.CLEAR),  # its denial no longer true
    (RUNNING, DECLARED, Cause.RELOAD),  # left the config (a removed serve stopped first)
]


@pytest.mark.parametrize(("prev", "nxt", "cause"), WRITERS)
def test_what_gpud_writes_is_allowed(prev: ServeState | None, nxt: ServeState,
                                     cause: Cause) -> None:
    assert check_change(prev, nxt, cause) == nxt


REFUSED = [
    (STOPPING, RUNNING, Cause.HEALTHY),  # a health answer does not undo a stop
    (DECLARED, RUNNING, Cause.HEALTHY),  # nor bring up a serve that was never started
    (RUNNING, DENIED, Cause.DENY),  # a running serve keeps its state when refused more
    (SLEEPING, DENIED, Cause.DENY),
    (RUNNING, DECLARED, Cause.CLEAR),  # only a denial is cleared
    (STOPPING, STARTING, Cause.LAUNCH),  # no start on top of a stop under way
    (DECLARED, SLEEPING, Cause.SLEEP),  # only a serve that runs sleeps
    (RUNNING, RUNNING, Cause.FAIL),  # each cause leads only where it says
    (RUNNING, DECLARED, Cause.ADMIT),
]


@pytest.mark.parametrize(("prev", "nxt", "cause"), REFUSED)
def test_what_no_writer_may_do_is_refused(prev: ServeState | None, nxt: ServeState,
                                          cause: Cause) -> None:
    assert isinstance(check_change(prev, nxt, cause), StateRefusal)
