"""gpud.core.traffic: the serve's count of requests in flight read from vLLM's /metrics, idle time
from the last request's end, the ordering of requests with sleeps and stops, a drain's
account."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import pytest

from gpud.config import parse_config
from gpud.core.lifecycle import Phase
from gpud.core.traffic import (
    Drain,
    Flight,
    drain_done,
    idle_due,
    idle_from,
    in_flight_from_metrics,
    observe,
    settling,
)
from gpud.core.vocab import ServeState, SleepAction
from gpud.errors import Conflict, Unavailable
from gpud.life.traffic import ABORT_PATH, Traffic, drain_and_stop, drain_to_stop
from tests.conftest import example_toml

# What vLLM 0.32's /metrics says (vllm/v1/metrics/loggers.py:527-545), two engines (data
# parallel), and a histogram whose name begins like a gauge's.
VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 9.0
vllm:num_requests_running_total 100.0
"""


@pytest.mark.parametrize(("text", "expected"), [
    (VLLM_TEXT, 7),
    ('vllm:num_requests_running{model_name="a b} c"} 1.0\n', 1),  # a brace inside a label value
    ("vllm:num_requests_running 3\nvllm:num_requests_waiting 0\n", 3),  # no labels
    ("vllm:num_requests_running{} 0.0\n", 0),
    ("# nothing but comments\nprocess_cpu_seconds_total 3.0\n", None),  # not vLLM's
    ("", None),
    ("vllm:num_requests_running{} NaN\nvllm:num_requests_waiting{} -1\n", None),
    ("vllm:num_requests_running{} junk\n", None),
])
def test_in_flight_from_metrics(text: str, expected: int | None) -> None:
    assert in_flight_from_metrics(text) == expected


def test_the_end_of_the_last_request_is_when_the_count_drops_to_zero() -> None:
    f = observe(Flight(), 0, 10.0)
    assert (f.in_flight, f.ended_at, f.read_at) == (0, None, 10.0)  # nothing ended yet
    f = observe(f, 2, 11.0)
    f = observe(f, 1, 12.0)
    assert (f.in_flight, f.ended_at) == (1, None)
    f = observe(f, 0, 13.0)
    assert (f.in_flight, f.ended_at) == (0, 13.0)
    f = observe(f, 0, 14.0)
    assert f.ended_at == 13.0  # not again while nothing runs
    unknown = observe(f, None, 15.0)
    assert (unknown.in_flight, unknown.ended_at, unknown.read_at) == (None, 13.0, 15.0)


def test_idle_counts_from_the_later_of_the_last_begin_and_the_last_end() -> None:
    ended = Flight(in_flight=0, ended_at=50.0, read_at=51.0)
    assert idle_from(10.0, ended) == 50.0  # a stream began at 10 s, ended at 50 s
    assert idle_from(60.0, ended) == 60.0  # a request through the front since
    assert idle_from(None, ended) == 50.0
    assert idle_from(None, Flight()) is None


def test_no_idle_sleep_or_stop_while_a_request_is_in_flight() -> None:
    kw = {"idle_sleep_s": 10.0, "idle_stop_s": 20.0, "sleep_level": 1}
    busy = Flight(in_flight=1, read_at=0.0)
    assert idle_due(ServeState.RUNNING, busy, 1000.0, **kw) is None
    assert idle_due(ServeState.SLEEPING, busy, 1000.0, **kw) is None  # a request held asleep
    quiet = Flight(in_flight=0, read_at=0.0)
    assert idle_due(ServeState.RUNNING, quiet, 10.0, **kw) == SleepAction.SLEEP
    assert idle_due(ServeState.RUNNING, quiet, 20.0, **kw) == SleepAction.STOP
    assert idle_due(ServeState.RUNNING, quiet, 9.9, **kw) is None
    # unknown: as before, from the front's last request alone
    assert idle_due(ServeState.RUNNING, Flight(), 10.0, **kw) == SleepAction.SLEEP


@pytest.mark.parametrize("phase", list(Phase))
def test_a_request_waits_while_a_sleep_or_stop_is_under_way(phase: Phase) -> None:
    assert settling(phase, False) is (phase in (Phase.FALLING_ASLEEP, Phase.STOPPING))
    assert settling(phase, True)  # drained before a stop or a sleep


@pytest.mark.parametrize(("before", "after", "outcome", "mode", "words"), [
    (0, 0, "none", "wait", "no request in flight"),
    (3, 0, "drained", "wait", "3 request(s) in flight drained in 2.5 s"),
    (3, 2, "aborted", "abort", "2 of 3 request(s) in flight aborted after the 30 s drain bound"),
    (None, None, "unknown", "wait", "requests in flight unknown (the serve gives no count)"),
    (2, None, "unknown", "wait", "requests in flight unknown (the serve gives no count)"),
])
def test_a_drains_account(before: int | None, after: int | None, outcome: str, mode: str,
                          words: str) -> None:
    d = Drain(before, after, 2.5, 30.0)
    assert (d.outcome, d.sleep_mode, d.line()) == (outcome, mode, words)
    assert d.details() == {"outcome": outcome, "before": before, "after": after,
                           "waited_s": 2.5, "bound_s": 30.0}


def test_a_drain_ends_at_zero_unknown_or_its_bound() -> None:
    assert drain_done(0, 0.0, 30.0)
    assert drain_done(None, 0.0, 30.0)
    assert not drain_done(1, 29.9, 30.0)
    assert drain_done(1, 30.0, 30.0)
    assert drain_done(1, 0.0, 0.0)  # a bound of 0 drains nothing


async def test_a_drains_end_and_a_changed_count_are_told_with_the_serves_name() -> None:
    """`watch`: the end of a serve's drain, and a read of its count of requests in flight that
    changed it, are told with the serve's name (the on-demand orchestrator wakes the requests
    waiting on that serve's devices, not all); a read that changes nothing is not told."""
    counts = iter([2, 2, 0])

    class Reader:
        async def read(self, serve: str, spec: Any) -> tuple[bool, int | None]:
            return True, next(counts)
    traffic = Traffic(cast(Any, None), cast(Any, Reader()), clock=lambda: 100.0)
    told: list[str] = []
    traffic.watch(told.append)
    with traffic.held("a"):
        assert told == []
    for _ in range(3):
        await traffic.poll("b", cast(Any, None))
    assert told == ["a", "b", "b"]


class _Drainer:
    def __init__(self, drained: Drain, asked: list[str] | None = None) -> None:
        self.drained = drained
        self.asked = asked if asked is not None else []
        self.holding: set[str] = set()

    @contextlib.contextmanager
    def held(self, serve: str) -> Iterator[None]:
        self.holding.add(serve)
        try:
            yield
        finally:
            self.holding.discard(serve)

    async def drain(self, serve: str, spec: Any, bound_s: float) -> Drain:
        held = " held" if serve in self.holding else ""  # the front lets nothing new in
        self.asked.append(f"drain {serve} {bound_s:g}{held}")
        return self.drained

    def mark_cut(self, serve: str) -> None:
        self.asked.append(f"mark {serve}")


async def test_drain_to_stop_tells_what_is_left_at_the_bound_or_refuses() -> None:
    """Issue 50 item 6, the stop's half: what is still in flight at the drain's bound is ended
    with a told end (POST /pause?mode=abort) on a serve that can be told, refused when the
    caller may not cut it, and stopped all the same (a journal line) when the pause fails."""
    fast = parse_config(example_toml(), "etc/serves.toml").serves["fast"]
    told = fast.model_copy(update={"front": True})  # dev mode, behind its front
    busy, done = Drain(1, 1, 1.0, 1.0), Drain(1, 0, 0.5, 1.0)
    asked: list[str] = []

    async def tell(path: str) -> None:
        asked.append(path)

    assert await drain_to_stop(_Drainer(done), "s", told, 1.0, cut=True, tell=tell) == done
    assert asked == []  # nothing left: nothing to tell
    assert await drain_to_stop(_Drainer(busy, asked), "s", told, 1.0, cut=True,
                               tell=tell) == busy
    assert asked == ["drain s 1", "mark s", ABORT_PATH]  # the note first, then the abort
    asked.clear()
    assert await drain_to_stop(_Drainer(busy), "s", told, 1.0, cut=True, tell=tell) == busy
    assert asked == [ABORT_PATH]
    with pytest.raises(Conflict) as refused:
        await drain_to_stop(_Drainer(busy), "s", told, 1.0, cut=False, tell=tell)
    assert refused.value.details["busy"] and asked == [ABORT_PATH]
    # a serve that cannot be told (no dev mode) is stopped as it is: nothing asked of it
    assert await drain_to_stop(_Drainer(busy), "s", fast, 1.0, cut=True, tell=tell) == busy
    assert asked == [ABORT_PATH]

    async def fails(path: str) -> None:
        raise Unavailable("serve 's': POST /pause?mode=abort failed: refused", {})

    assert await drain_to_stop(_Drainer(busy), "s", told, 1.0, cut=True, tell=fails) == busy


async def test_drain_and_stop_stops_after_the_drain_while_the_serve_is_held() -> None:
    """The one way gpud stops a serve that may have requests in flight (an eviction, a
    preemption, an idle stop, an operator's stop): held while it is drained, told, and
    stopped, the drain's account given to the stop; without a drainer, the stop alone."""
    told = parse_config(example_toml(), "etc/serves.toml").serves["fast"].model_copy(
        update={"front": True})
    busy = Drain(1, 1, 2.0, 2.0)
    asked: list[str] = []
    drainer = _Drainer(busy, asked)

    class Stopper:
        async def stop(self, serve: str, uid: int | None, *, keep_reservation: bool = False,
                       idle_s: float | None = None, drained: Drain | None = None) -> None:
            asked.append(f"stop {serve} uid={uid} keep={keep_reservation} idle={idle_s} "
                         f"held={serve in drainer.holding} drained={drained == busy}")

    async def tell(path: str) -> None:
        asked.append(path)

    assert await drain_and_stop(drainer, Stopper(), "s", told, 7, 2.0, cut=True, tell=tell,
                                keep_reservation=True) == busy
    assert asked == ["drain s 2 held", "mark s", ABORT_PATH,
                     "stop s uid=7 keep=True idle=None held=True drained=True"]
    assert drainer.holding == set()  # let go after the stop
    asked.clear()
    assert await drain_and_stop(None, Stopper(), "s", told, None, 2.0, cut=True, tell=tell,
                                idle_s=3.0) is None
    assert asked == ["stop s uid=None keep=False idle=3.0 held=False drained=False"]
    asked.clear()
    with pytest.raises(Conflict):  # may not cut: refused, and not stopped
        await drain_and_stop(drainer, Stopper(), "s", told, None, 2.0, cut=False, tell=tell)
    assert asked == ["drain s 2 held"] and drainer.holding == set()
