"""The router's queue (gpud.core.queue): who comes up next, who makes room, and that an
alternating storm does not thrash."""

from __future__ import annotations

import asyncio
import json
import math
import time
from types import SimpleNamespace
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpud.core.queue import (
    IDLE_AFTER_S,
    Held,
    Protected,
    Waiting,
    evictable,
    median_s,
    next_up,
    victims,
)
from gpud.core.vocab import RUNNING
from gpud.ondemand import OnDemand
from tests.test_bringup import Clock, CrashLooping, FakeService


@pytest.mark.parametrize(("waiting", "first"), [
    ([], None),
    # collation: the serve already up goes first, whatever the others' priority or queue
    ([Waiting("b", 0, 9, 0.0), Waiting("a", 5, 1, 1.0, running=True)], "a"),
    # then the most important
    ([Waiting("b", 5, 9, 0.0), Waiting("c", 1, 1, 1.0)], "c"),
    # then the longest queue
    ([Waiting("b", 5, 2, 0.0), Waiting("c", 5, 3, 1.0)], "c"),
    # then the longest waiting, then the name
    ([Waiting("b", 5, 2, 2.0), Waiting("c", 5, 2, 1.0)], "c"),
    ([Waiting("c", 5, 2, 1.0), Waiting("b", 5, 2, 1.0)], "b"),
])
def test_next_up(waiting: list[Waiting], first: str | None) -> None:
    assert next_up(waiting) == first


BUSY = dict(in_flight=2, quiet_s=0.0)
IDLE = dict(in_flight=0, quiet_s=IDLE_AFTER_S)


@pytest.mark.parametrize(("held", "priority", "wait"), [
    # a more important serve is never evicted, idle or not
    (Held("x", 1, up_for_s=100.0, **IDLE), 5, math.inf),
    # equal priority, busy, up less than min_awake_s: protected for the rest of it
    (Held("x", 5, up_for_s=4.0, **BUSY), 5, 6.0),
    # ... idle: evictable at once
    (Held("x", 5, up_for_s=4.0, **IDLE), 5, 0.0),
    # ... nothing in flight, but a request just ended: not idle yet
    (Held("x", 5, in_flight=0, quiet_s=0.2, up_for_s=4.0), 5, 6.0),
    # ... its count unknown: busy
    (Held("x", 5, in_flight=None, quiet_s=None, up_for_s=4.0), 5, 6.0),
    # busy, up min_awake_s or longer: evictable
    (Held("x", 5, up_for_s=10.0, **BUSY), 5, 0.0),
    # lower priority, within min_awake_s: protected too
    (Held("x", 9, up_for_s=1.0, **BUSY), 5, 9.0),
    # not brought up by a request: min_awake_s does not hold it
    (Held("x", 9, up_for_s=None, **BUSY), 5, 0.0),
])
def test_evictable(held: Held, priority: int, wait: float) -> None:
    assert evictable(held, priority, min_awake_s=10.0) == wait


def test_victims_by_priority_then_cost() -> None:
    held = [Held("cheap", 5, up_for_s=None, cost_s=1.0, **IDLE),
            Held("dear", 5, up_for_s=None, cost_s=30.0, **IDLE),
            Held("unmeasured", 5, up_for_s=None, **IDLE),
            Held("least", 9, up_for_s=None, cost_s=60.0, **IDLE),
            Held("vital", 1, up_for_s=None, cost_s=0.1, **IDLE),
            Held("me", 9, up_for_s=None, **IDLE)]
    assert victims(held, "me", 5, 10.0) == ["least", "cheap", "dear", "unmeasured"]


def test_victims_protected_says_how_long() -> None:
    held = [Held("a", 5, up_for_s=7.0, **BUSY), Held("b", 5, up_for_s=2.0, **BUSY),
            Held("v", 1, up_for_s=None, **IDLE)]
    out = victims(held, "me", 5, 10.0)
    assert isinstance(out, Protected) and out.wait_s == pytest.approx(3.0)
    out = victims([Held("v", 1, up_for_s=None, **IDLE)], "me", 5, 10.0)
    assert isinstance(out, Protected) and out.wait_s == math.inf


def test_median() -> None:
    assert median_s([]) is None
    assert median_s([100.0, 1.0, 2.0, 3.0, 4.0, 50.0]) == 3.0  # the last five only


def swaps_in_storm(gaps: list[float], durations: list[float], min_awake_s: float,
                   tick: float = 0.05) -> tuple[int, float]:
    """Two serves that do not fit together, A up first; requests for A and B in turn, `gaps`
    apart, each in flight `durations` once its serve is up. Returns the swaps and the time."""
    arrivals = []
    t = 0.0
    for i, gap in enumerate(gaps):
        t += gap
        arrivals.append((t, "ab"[i % 2], durations[i % len(durations)]))
    up, up_at, swaps = "a", 0.0, 0
    queued: dict[str, list[float]] = {"a": [], "b": []}  # durations of the requests waiting
    flight: list[tuple[float, str]] = []  # (ends at, serve)
    last: dict[str, float] = {"a": 0.0, "b": 0.0}
    now, i = 0.0, 0
    end = t + 60.0
    while now <= end and (i < len(arrivals) or queued["a"] or queued["b"] or flight):
        while i < len(arrivals) and arrivals[i][0] <= now:
            _, serve, took = arrivals[i]
            i += 1
            if serve == up:
                flight.append((now + took, serve))
                last[serve] = now
            else:
                queued[serve].append(took)
        flight = [(e, s) for e, s in flight if e > now or not last.update({s: e})]
        down = "b" if up == "a" else "a"
        waiting = [Waiting(down, 5, len(queued[down]), 0.0)] if queued[down] else []
        if next_up(waiting) == down:
            in_flight = sum(1 for _, s in flight if s == up)
            h = Held(up, 5, in_flight, 0.0 if in_flight else now - last[up], now - up_at)
            if isinstance(victims([h], down, 5, min_awake_s), list):
                swaps += 1
                up, up_at = down, now
                flight = [(e, s) for e, s in flight if s != down]  # the evicted drained (ended)
                for took in queued[down]:
                    flight.append((now + took, down))
                last[down] = now
                queued[down] = []
        now += tick
    return swaps, now


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, 0.4), min_size=10, max_size=200),
       st.lists(st.floats(0.01, 2.0), min_size=1, max_size=20),
       st.floats(1.0, 10.0))
def test_alternating_storm_swaps_at_most_once_per_min_awake(
        gaps: list[float], durations: list[float], min_awake_s: float) -> None:
    # A request for each serve at most 0.8 s apart: neither is ever idle for IDLE_AFTER_S.
    swaps, took = swaps_in_storm(gaps, durations, min_awake_s)
    assert swaps <= 1 + took / min_awake_s


def test_storm_without_min_awake_would_thrash() -> None:
    # the same storm with min_awake_s 0 swaps on (nearly) every request: what the bound stops
    gaps = [0.1] * 100
    assert swaps_in_storm(gaps, [1.0], 0.0)[0] > 20
    assert swaps_in_storm(gaps, [1.0], 5.0)[0] <= 1 + 15 / 5.0


# ---- the queue in OnDemand's ensure (a supervisor that always refuses for memory) ----------

async def test_a_full_queue_and_a_timeout_are_refusals_with_retry_after() -> None:
    """With a [router]: a request refused for memory waits (here nothing can be evicted) and is
    answered the queue-timeout class after router.queue_timeout_s; one more than max_queued is
    answered the queue-full class at once. Both 403 with Retry-After: the front's 503."""
    spec = SimpleNamespace(on_demand=True, preempt=False, start_timeout_s=30.0, priority=5,
                           all_roles=("r",), sleep_level=0, preemptible="sleep")
    svc = FakeService(Clock())
    svc.config = SimpleNamespace(
        router=SimpleNamespace(max_queued=1, queue_timeout_s=1, min_awake_s=10.0),
        serves={"od": spec, "other": spec})
    svc.serve_spec = lambda _name: spec  # type: ignore[method-assign]
    # od needs 16000 MiB, 807 are free: "other" (on demand, equal priority) holds 20000, so
    # evicting it would make room, but it was brought up just now (min_awake_s) and its count
    # of requests in flight is unknown (busy)
    svc.states["other"] = RUNNING
    svc.free_for = lambda _serve, _role: 807  # type: ignore[attr-defined]
    svc.ledger = SimpleNamespace(reservations={  # type: ignore[attr-defined]
        "other": SimpleNamespace(mib=20000, all_roles=("r",))})
    sup = CrashLooping(svc, denied=True)
    od = OnDemand(cast(Any, svc), cast(Any, sup), clock=time.monotonic)
    od.up_at["other"] = time.monotonic()
    began = time.monotonic()
    waiting = asyncio.ensure_future(od.ensure("od"))
    await asyncio.sleep(0.2)
    assert od.queued == {"od": [od.queued["od"][0]]}
    full = await od.ensure("od")
    assert time.monotonic() - began < 0.5
    timed_out = await waiting
    assert 1.0 <= time.monotonic() - began < 3.0
    for reply, why in ((full, "queue-full"), (timed_out, "queue-timeout")):
        assert reply.status == 403 and int(reply.headers["Retry-After"]) >= 1, reply.headers
        said = json.loads(reply.headers["X-Gpud-Reason"])["error"]
        assert said["details"]["class"] == why, said
        assert "16000" not in reply.headers["X-Gpud-Reason"]  # the class only
    assert od.queued == {} and od.queue_waits["od"].n == 1


def test_histogram_is_cumulative() -> None:
    from gpud.core.queue import Histogram
    h = Histogram.empty()
    for s in (0.05, 0.3, 0.3, 400.0):
        h.observe(s)
    rows = dict(h.cumulative())
    assert (rows["0.1"], rows["0.25"], rows["0.5"], rows["300.0"], rows["+Inf"]) == (1, 1, 3, 3, 4)
    assert h.n == 4 and h.total_s == pytest.approx(400.65)


async def test_a_serve_no_eviction_could_make_room_for_is_refused_at_once() -> None:
    """Nothing the queue may evict would free enough (the running serve is more important):
    the refusal for memory is answered at once, as without a queue, not after a wait."""
    spec = SimpleNamespace(on_demand=True, preempt=False, start_timeout_s=30.0, priority=5,
                           all_roles=("r",), sleep_level=0, preemptible="sleep")
    vital = SimpleNamespace(on_demand=True, priority=1, all_roles=("r",), sleep_level=0,
                            preemptible="sleep")
    svc = FakeService(Clock())
    svc.config = SimpleNamespace(
        router=SimpleNamespace(max_queued=8, queue_timeout_s=30, min_awake_s=10.0),
        serves={"od": spec, "vital": vital})
    svc.serve_spec = lambda _name: spec  # type: ignore[method-assign]
    svc.states["vital"] = RUNNING
    svc.free_for = lambda _serve, _role: 807  # type: ignore[attr-defined]
    svc.ledger = SimpleNamespace(reservations={  # type: ignore[attr-defined]
        "vital": SimpleNamespace(mib=20000, all_roles=("r",))})
    od = OnDemand(cast(Any, svc), cast(Any, CrashLooping(svc, denied=True)), clock=time.monotonic)
    began = time.monotonic()
    reply = await od.ensure("od")
    assert time.monotonic() - began < 0.5 and reply.status == 403
    assert json.loads(reply.headers["X-Gpud-Reason"])["error"]["details"]["class"] == "no-memory"
    assert od.queued == {}
