"""gpud.core.traffic at its edges, by its own tests (issue 45, item 6): what a /metrics text
counts and what it skips, how a read moves the idle clock, when an idle serve is due, when a
drain ends, and a drain's account word for word."""

from __future__ import annotations

import pytest

from gpud.core.lifecycle import Phase
from gpud.core.traffic import (
    Drain,
    Flight,
    Outcome,
    drain_done,
    idle_action,
    idle_due,
    idle_due_in,
    idle_from,
    in_flight_from_metrics,
    observe,
    settling,
)
from gpud.core.vocab import ServeState, SleepAction


@pytest.mark.parametrize(("text", "count"), [
    ("", None),
    ("# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n", None),
    ("vllm:num_requests_running 3\n", 3),
    ("vllm:num_requests_running 0\n", 0),  # a zero is a count, not an unknown
    ('vllm:num_requests_running{engine="0",model_name="m"} 2\n'
     'vllm:num_requests_waiting{engine="0",model_name="m"} 1\n'
     'vllm:num_requests_running{engine="1",model_name="m"} 4\n', 7),
    ('vllm:num_requests_waiting{model_name="a b} c"} 5\n', 5),  # the value after the last }
    ("vllm:num_requests_running_total 9\nvllm:num_requests_runnin 9\n", None),  # names exact
    ("vllm:num_requests_running\n", None),  # no value
    ('vllm:num_requests_running{engine="0"}\n', None),
    ("vllm:num_requests_running abc\nvllm:num_requests_waiting 2\n", 2),
    ("vllm:num_requests_running NaN\nvllm:num_requests_waiting +Inf\n", None),
    ("vllm:num_requests_running -1\nvllm:num_requests_waiting 1\n", 1),
    ("vllm:num_requests_running 1.4\nvllm:num_requests_waiting 1.4\n", 3),  # summed, rounded
    ("\nvllm:num_requests_waiting 6 1700000000\n", 6),  # a timestamp after the value
    ("other_metric 5\n", None),
])
def test_what_a_metrics_text_counts(text: str, count: int | None) -> None:
    assert in_flight_from_metrics(text) == count


def test_a_read_moves_the_idle_clock_only_when_the_count_drops_to_zero() -> None:
    start = Flight()
    busy = observe(start, 2, 10.0)
    assert busy == Flight(2, None, 10.0)
    ended = observe(busy, 0, 20.0)
    assert ended == Flight(0, 20.0, 20.0)
    assert observe(ended, 0, 30.0) == Flight(0, 20.0, 30.0)  # still zero: the end stays
    unknown = observe(ended, None, 40.0)
    assert unknown == Flight(None, 20.0, 40.0)
    assert observe(unknown, 0, 50.0) == Flight(0, 20.0, 50.0)  # unknown is no request
    assert observe(Flight(), 0, 5.0) == Flight(0, None, 5.0)


@pytest.mark.parametrize(("last_begin", "ended_at", "since"), [
    (None, None, None), (5.0, None, 5.0), (None, 7.0, 7.0), (5.0, 7.0, 7.0), (9.0, 7.0, 9.0),
])
def test_idle_from_the_later_of_the_last_begin_and_the_last_end(
        last_begin: float | None, ended_at: float | None, since: float | None) -> None:
    assert idle_from(last_begin, Flight(0, ended_at, 1.0)) == since


@pytest.mark.parametrize(("in_flight", "due"), [
    (1, None), (5, None), (0, SleepAction.SLEEP), (None, SleepAction.SLEEP),
])
def test_no_idle_action_while_a_request_is_in_flight(in_flight: int | None,
                                                     due: SleepAction | None) -> None:
    assert idle_due(ServeState.RUNNING, Flight(in_flight, None, 0.0), 100.0, idle_sleep_s=60.0,
                    idle_stop_s=None, sleep_level=1) == due


def test_idle_due_is_the_fronts_rule() -> None:
    flight = Flight(0, None, 0.0)
    assert idle_due(ServeState.SLEEPING, flight, 100.0, idle_sleep_s=None, idle_stop_s=100.0,
                    sleep_level=1) == SleepAction.STOP
    assert idle_due(ServeState.RUNNING, flight, 99.0, idle_sleep_s=None, idle_stop_s=100.0,
                    sleep_level=0) is None


@pytest.mark.parametrize("phase", list(Phase))
@pytest.mark.parametrize("draining", [False, True])
def test_settling(phase: Phase, draining: bool) -> None:
    assert settling(phase, draining) == (draining or phase in (Phase.FALLING_ASLEEP,
                                                               Phase.STOPPING))


@pytest.mark.parametrize(("count", "waited", "done"), [
    (None, 0.0, True), (0, 0.0, True), (1, 0.0, False), (1, 9.99, False), (1, 10.0, True),
    (3, 11.0, True),
])
def test_a_drain_ends(count: int | None, waited: float, done: bool) -> None:
    assert drain_done(count, waited, 10.0) is done


@pytest.mark.parametrize(("before", "after", "outcome", "mode", "line"), [
    (None, None, Outcome.UNKNOWN, "wait", "requests in flight unknown (the serve gives no count)"),
    (2, None, Outcome.UNKNOWN, "wait", "requests in flight unknown (the serve gives no count)"),
    (None, 0, Outcome.UNKNOWN, "wait", "requests in flight unknown (the serve gives no count)"),
    (0, 0, Outcome.NONE, "wait", "no request in flight"),
    (0, 1, Outcome.NONE, "wait", "no request in flight"),  # one came meanwhile: it waits
    (3, 0, Outcome.DRAINED, "wait", "3 request(s) in flight drained in 2.3 s"),
    (3, 1, Outcome.ABORTED, "abort", "1 of 3 request(s) in flight aborted after the 2.5 s "
                                     "drain bound"),
])
def test_a_drains_account(before: int | None, after: int | None, outcome: Outcome, mode: str,
                          line: str) -> None:
    drain = Drain(before, after, 2.26, 2.5)
    assert drain.outcome == outcome
    assert drain.sleep_mode == mode
    assert drain.line() == line
    assert drain.details() == {"outcome": outcome, "before": before, "after": after,
                               "waited_s": 2.3, "bound_s": 2.5}


def test_the_outcomes_are_their_words() -> None:
    assert [str(o) for o in Outcome] == ["none", "drained", "aborted", "unknown"]


@pytest.mark.parametrize(("state", "idle", "sleep_s", "stop_s", "level", "action"), [
    ("running", 9.9, 10.0, None, 1, None),
    ("running", 10.0, 10.0, None, 1, "sleep"),
    ("running", 10.0, 10.0, None, 0, None),  # cannot sleep
    ("sleeping", 50.0, 10.0, None, 1, None),  # asleep already, no stop configured
    ("sleeping", 60.0, 10.0, 60.0, 1, "stop"),
    ("running", 60.0, 10.0, 60.0, 1, "stop"),  # past both: stopped at once
    ("running", 30.0, None, 60.0, 0, None),
    ("starting", 99.0, 1.0, 1.0, 1, None),
    ("declared", 99.0, 1.0, 1.0, 1, None),
])
def test_idle_action(state: str, idle: float, sleep_s: float | None, stop_s: float | None,
                     level: int, action: str | None) -> None:
    assert idle_action(state, idle, idle_sleep_s=sleep_s, idle_stop_s=stop_s,
                       sleep_level=level) == action


@pytest.mark.parametrize(("idle", "sleep_s", "stop_s", "due_in"), [
    (10.0, 30.0, 100.0, 20.0),  # the nearer threshold: the sleep, 20 s on
    (40.0, 30.0, 100.0, 60.0),  # past the sleep's: the stop's
    (10.0, None, 100.0, 90.0),
    (30.0, 30.0, None, None),  # at a threshold it is due now (idle_due), none is ahead
    (5.0, None, None, None),
])
def test_the_idle_check_waits_until_the_next_threshold_ahead(
        idle: float, sleep_s: float | None, stop_s: float | None, due_in: float | None) -> None:
    assert idle_due_in(idle, idle_sleep_s=sleep_s, idle_stop_s=stop_s) == due_in
