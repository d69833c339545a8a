"""gpud.core.demand: a serve's on-demand facts and the rules of how a bring-up's start, success,
failure or refusal changes them. Pure, so checked as properties (Hypothesis) over any facts."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpud.core import bringup, demand
from gpud.core.bringup import Policy, Tries, Why
from gpud.core.demand import NO_DEMAND, Demand


def test_a_record_is_frozen() -> None:
    with pytest.raises(FrozenInstanceError):
        NO_DEMAND.idling = True  # type: ignore[misc]


POLICY = Policy(refusal_hold_s=5, first_s=2, max_s=60, stable_s=30)
TIMES = st.floats(0, 1e6, allow_nan=False)
REFUSALS = st.sampled_from([w for w in Why if w != Why.FAILED])
DEMANDS = st.builds(
    Demand, tries=st.none() | st.builds(Tries, failures=st.integers(0, 40), not_before=TIMES,
                                        why=st.none() | st.sampled_from(list(Why)),
                                        up_since=st.none() | TIMES),
    failure_counted=st.booleans(), idling=st.booleans(), up_at=st.none() | TIMES)


def _failures(d: Demand) -> int:
    return d.tries.failures if d.tries is not None else 0


@given(DEMANDS, TIMES, TIMES)
def test_a_failure_seen_again_and_again_counts_once(d: Demand, at: float, later: float) -> None:
    once = demand.failed_since(demand.began(d), at, "failed: exited", POLICY)
    assert once.failure_counted and _failures(once) >= 1
    assert demand.failed_since(once, later, "failed: exited", POLICY) == once
    # a new bring-up's failure is one more
    again = demand.failed_since(demand.began(once), at, "failed: exited", POLICY)
    assert _failures(again) in (1, _failures(once) + 1)  # 1: it had stayed up stable_s


@given(DEMANDS, TIMES, REFUSALS)
def test_a_refusal_holds_the_next_try_off_and_is_no_failure(d: Demand, now: float,
                                                            why: Why) -> None:
    after = demand.tried(d, now, why, "no room", POLICY)
    assert _failures(after) == _failures(d) and after.failure_counted == d.failure_counted
    assert after.tries is not None and after.tries.not_before == now + POLICY.refusal_hold_s
    hold = bringup.held(after.tries, now)
    assert hold is not None and hold.why == why


@given(DEMANDS, TIMES, TIMES)
def test_a_serve_that_came_up_is_held_off_no_more(d: Demand, now: float, later: float) -> None:
    up = demand.came_up(d, now)
    assert up.up_at == now and bringup.held(up.tries, now + later) is None
    # the other facts are left as they were
    assert (up.idling, up.failure_counted, up.need_mib) == (d.idling, d.failure_counted,
                                                           d.need_mib)


@given(DEMANDS, TIMES)
def test_an_operators_start_ends_the_backoff(d: Demand, now: float) -> None:
    started = demand.operator_started(d)
    assert bringup.held(started.tries, now) is None and not started.failure_counted
    assert replace(started, tries=d.tries, failure_counted=d.failure_counted) == d
