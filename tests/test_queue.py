"""The router's queue (gpud.core.queue): who comes up next, who makes room, and that an
alternating storm does not thrash."""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpud.core.queue import (
    IDLE_AFTER_S,
    Arrival,
    Ask,
    EvictionCandidate,
    Freeing,
    Held,
    Next,
    Place,
    Protected,
    QueueRefusal,
    Shares,
    Ticket,
    admit,
    after_refusal,
    arrive,
    backfill,
    could_fit,
    earliest_start,
    evictable,
    expected_wait_s,
    forget,
    idle_in,
    joined,
    let_through,
    may_cut,
    may_evict,
    median_s,
    next_up,
    order,
    places,
    position,
    victims,
)
from gpud.core.serverecord import Put
from gpud.core.vocab import RUNNING
from gpud.server.ondemand import OnDemand
from tests.test_bringup import Clock, CrashLooping, FakeService


def T(serve: str, requester: str, arrived: float, priority: int = 5, **kw: Any) -> Ticket:
    return Ticket(serve, requester, arrived, priority, **kw)


@pytest.mark.parametrize(("waiting", "first"), [
    ([], None),
    # collation: the serve already up goes first, whatever the others' priority or queue
    ([T("b", "u", 0.0, 0), T("a", "u", 1.0, running=True)], "a"),
    # then the most important serve
    ([T("b", "u", 0.0, 5), T("c", "v", 1.0, 1)], "c"),
    # then the key's priority (smaller first); a key that names none is of priority 0
    ([T("b", "u", 0.0), T("c", "v", 1.0, key_priority=-1)], "c"),
    ([T("b", "u", 0.0), T("c", "v", 1.0, key_priority=0)], "b"),
    ([T("b", "u", 1.0), T("c", "v", 0.0, key_priority=0)], "c"),
    # never the most requests: one requester's three for c do not outrank the older b
    ([T("b", "v", 0.0), T("c", "u", 1.0), T("c", "u", 1.1), T("c", "u", 1.2)], "b"),
    # two requesters at one virtual time: the older request, then by requester, then serve
    ([T("b", "u", 2.0), T("c", "v", 1.0)], "c"),
    ([T("c", "v", 1.0), T("b", "u", 1.0)], "b"),
    ([T("c", "u", 1.0), T("b", "u", 1.0)], "b"),
])
def test_next_up(waiting: list[Ticket], first: str | None) -> None:
    assert next_up(waiting, Shares()) == first


def test_a_requester_let_through_goes_behind_the_others() -> None:
    # u had a request let through (its virtual time 1): v's younger request goes first
    shares = let_through(joined(joined(Shares(), "u"), "v"), T("a", "u", 0.0))
    assert shares.used == {"u": 1.0, "v": 0.0}
    assert next_up([T("b", "u", 0.0), T("c", "v", 5.0)], shares) == "c"
    # by its weight: with weight 4 a request costs a quarter
    heavy = let_through(joined(Shares(), "u"), T("a", "u", 0.0, weight=4.0))
    assert heavy.used == {"u": 0.25}


def test_a_requester_joins_at_the_smallest_virtual_time() -> None:
    shares = Shares({"u": 3.0, "v": 2.0})
    assert shares.of("u") == 3.0  # its own, not the smallest
    assert joined(shares, "w").used == {"u": 3.0, "v": 2.0, "w": 2.0}
    assert joined(shares, "u") is shares  # waiting already: kept
    assert Shares().of("x") == 0.0 and shares.of("x") == 2.0
    # who no longer waits is forgotten: no credit banked, no debt kept
    assert forget(shares, ["v", "z"]).used == {"v": 2.0}


def test_order_interleaves_requesters_by_weight() -> None:
    tickets = [T("a", "u", float(i)) for i in range(4)] + \
        [T("b", "v", 10.0 + i, weight=2.0) for i in range(4)]
    got = [(t.requester, t.arrived) for t in order(tickets, Shares())]
    # v (weight 2) gets two turns for each of u's
    assert got == [("u", 0.0), ("v", 10.0), ("v", 11.0), ("u", 1.0), ("v", 12.0), ("v", 13.0),
                   ("u", 2.0), ("u", 3.0)]
    assert position(tickets, Shares(), tickets[1]) == 4
    assert position(tickets, Shares(), T("z", "z", 0.0)) == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("acd"), st.integers(0, 2), st.floats(0.0, 100.0)),
                min_size=0, max_size=60),
       st.floats(0.0, 100.0), st.sampled_from([0.25, 1.0, 4.0]), st.sampled_from([1.0, 8.0]),
       st.integers(0, 5))
def test_one_waiting_request_is_served_within_a_bound(
        others: list[tuple[str, int, float]], mine_at: float, my_weight: float,
        their_weight: float, history: int) -> None:
    """A requester ("me") with one request waiting for b is let through within one turn of
    each other requester, however many requests they queue, whatever the weights and
    whatever was let through before: each turn brings the next serve up (next_up) and lets
    all its requests through; the others keep queuing (each request let through comes back)."""
    tickets = [T(serve, f"r{who}", at, weight=their_weight) for serve, who, at in others]
    mine = T("b", "me", mine_at, weight=my_weight)
    shares = Shares()
    for t in tickets:
        shares = joined(shares, t.requester)
    for i in range(history):  # the others were let through before: no credit for that
        shares = let_through(shares, T("a", f"r{i % 3}", 0.0, weight=their_weight))
    shares = joined(shares, "me")
    tickets.append(mine)
    requesters = {t.requester for t in tickets} - {"me"}
    for turn in range(len(requesters) + 1):
        serve = next_up(tickets, shares)
        assert serve is not None
        if serve == "b":
            return
        through = [t for t in tickets if t.serve == serve]
        tickets = [t for t in tickets if t.serve != serve]
        for t in through:
            shares = let_through(shares, t)
            # it comes back at once, for the same serve: the others never stop asking
            tickets.append(replace(t, arrived=t.arrived + 1000.0 * (turn + 1)))
        shares = forget(shares, (t.requester for t in tickets))
    raise AssertionError(f"not let through within {len(requesters) + 1} turns")


def test_the_storm_of_the_issue_gives_the_other_user_turns() -> None:
    """Issue 42's storm: u keeps 3 requests waiting for a and 3 for c, v has 1 for b. With
    "most requests wins" b never came up; with fair shares it comes up within two turns."""
    tickets = [T("a", "u", 0.0 + i) for i in range(3)] + [T("c", "u", 0.5 + i) for i in range(3)]
    tickets.append(T("b", "v", 1.0))
    shares = Shares()
    for t in tickets:
        shares = joined(shares, t.requester)
    came_up = []
    for _ in range(3):
        serve = next_up(tickets, shares)
        assert serve is not None
        came_up.append(serve)
        for t in [t for t in tickets if t.serve == serve]:
            shares = let_through(shares, t)
        tickets = [t for t in tickets if t.serve != serve] + \
            [T(serve, "u", 100.0 + len(came_up))] * (serve != "b")
        shares = forget(shares, (t.requester for t in tickets))
    assert came_up[:2] == ["a", "b"], came_up


@pytest.mark.parametrize(("kw", "decision"), [
    (dict(queue_on=True, others_waiting=True, bringing_up=False), Arrival.JOIN),
    (dict(queue_on=False, others_waiting=True, bringing_up=False), Arrival.TRY),
    (dict(queue_on=True, others_waiting=False, bringing_up=False), Arrival.TRY),
    (dict(queue_on=True, others_waiting=True, bringing_up=True), Arrival.TRY),
    # backfill: it fits now and delays the head of the queue in nothing
    (dict(queue_on=True, others_waiting=True, bringing_up=False, backfills=True), Arrival.TRY),
])
def test_arrive(kw: dict[str, bool], decision: Arrival) -> None:
    assert arrive(**kw) == decision


def test_after_refusal() -> None:
    base = dict(queue_on=True, no_memory=True, could_fit=True, queued=1, max_queued=2)
    assert after_refusal(**base) == Arrival.JOIN  # type: ignore[arg-type]
    for off in ("queue_on", "no_memory", "could_fit"):
        assert after_refusal(**{**base, off: False}) is None  # type: ignore[arg-type]
    full = after_refusal(**{**base, "queued": 2})  # type: ignore[arg-type]
    assert isinstance(full, QueueRefusal) and full.why == "queue-full" and "2 request(s)" in \
        full.message and full.max_queued == 2


@given(joined=st.booleans(), refused=st.sampled_from([None, "no-memory", "failed", "stopped"]),
       never_fits=st.booleans(), queue_on=st.booleans(), could_fit=st.booleans(),
       queued=st.integers(0, 4), max_queued=st.integers(0, 4))
def test_admit_is_a_returned_decision(joined: bool, refused: str | None, never_fits: bool,
                                      queue_on: bool, could_fit: bool, queued: int,
                                      max_queued: int) -> None:
    """What follows a request's try (gpud.core.queue.admit): it goes when its serve came up; it
    waits in the queue only when told to JOIN, or refused for memory with the queue on, room an
    eviction could make and room in its serve's queue; a refusal of the queue's only when the
    queue is full; any other refusal, and one that can never fit, stands as it is."""
    decided = admit(joined=joined, refused=refused, never_fits=never_fits, queue_on=queue_on,
                    could_fit=could_fit, queued=queued, max_queued=max_queued)
    if not joined and refused is None:
        assert decided.next == Next.UP and decided.refusal is None
        return
    waits = joined or (refused == "no-memory" and not never_fits and queue_on and could_fit)
    if waits and queued < max_queued:
        assert decided.next == Next.WAIT and decided.refusal is None
    elif waits:
        assert decided.next == Next.REFUSED and decided.refusal is not None
        assert decided.refusal.why == "queue-full" and decided.refusal.max_queued == max_queued
    else:
        assert decided.next == Next.REFUSED and decided.refusal is None


@given(evict_busy=st.booleans(), priority=st.integers(0, 100),
       victim_priority=st.integers(0, 100), aborts=st.booleans())
def test_an_eviction_ends_requests_in_flight_only_as_allowed(
        evict_busy: bool, priority: int, victim_priority: int, aborts: bool) -> None:
    """Past the drain's bound (gpud.core.queue.may_cut): a queued request ends a victim's
    requests in flight only when router.evict_busy allows it, for a serve of equal or higher
    priority (a smaller or equal number), and on a victim that ends them with a told end."""
    cut = may_cut(evict_busy=evict_busy, priority=priority, victim_priority=victim_priority,
                  aborts=aborts)
    assert cut == (evict_busy and aborts and priority <= victim_priority)


def test_an_eviction_past_the_drain_bound_by_example() -> None:
    assert may_cut(evict_busy=True, priority=50, victim_priority=50, aborts=True)
    assert may_cut(evict_busy=True, priority=10, victim_priority=50, aborts=True)
    assert not may_cut(evict_busy=True, priority=90, victim_priority=50, aborts=True)
    assert not may_cut(evict_busy=False, priority=10, victim_priority=50, aborts=True)
    assert not may_cut(evict_busy=True, priority=10, victim_priority=50, aborts=False)


def test_a_queue_refusal_names_its_limits_figure_and_no_other() -> None:
    from gpud.core.queue import figures_text, refusal_figures
    assert refusal_figures("queue-full", {"max_queued": 8, "queued": 8}) == {"max_queued": 8}
    assert refusal_figures("queue-timeout", {"queue_timeout_s": 60}) == {"queue_timeout_s": 60}
    # another class, a missing or non-integer figure: none
    assert refusal_figures("no-memory", {"max_queued": 8, "need_mib": 9000}) == {}
    assert refusal_figures("queue-full", {}) == {}
    assert refusal_figures("queue-full", {"max_queued": True}) == {}
    assert figures_text({"max_queued": 8}) == " (router.max_queued = 8)"
    assert figures_text({}) == ""


@pytest.mark.parametrize(("o", "priority", "may"), [
    (EvictionCandidate("o", 1, True, True), 5, False),    # more important: never
    (EvictionCandidate("o", 5, True, False), 5, True),    # on demand, equal: yes
    (EvictionCandidate("o", 5, False, True), 5, False),   # an operator's serve of equal priority: no
    (EvictionCandidate("o", 6, False, True), 5, True),    # ... of lower priority that yields: yes
    (EvictionCandidate("o", 6, False, False), 5, False),  # ... that cannot sleep nor be stopped: no
])
def test_may_evict(o: EvictionCandidate, priority: int, may: bool) -> None:
    assert may_evict(priority, o) is may


def test_could_fit() -> None:
    assert could_fit(100, 40, [60])
    assert not could_fit(100, 40, [59])
    assert could_fit(100, 100, [])
    assert not could_fit(100, 0, [30, 30, 39])


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
    # nothing in flight and no request seen: idle
    assert evictable(Held("x", 5, 0, None, 4.0), 5, min_awake_s=10.0) == 0.0
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
    # nothing in flight, a request 0.25 s ago: idle (evictable) in 0.75 s, before min_awake_s
    out = victims([Held("q", 5, in_flight=0, quiet_s=0.25, up_for_s=2.0)], "me", 5, 10.0)
    assert isinstance(out, Protected) and out.wait_s == pytest.approx(IDLE_AFTER_S - 0.25)
    assert "min_awake_s (10 s)" in out.reason


@pytest.mark.parametrize(("in_flight", "quiet_s", "wait"), [
    (0, 0.25, IDLE_AFTER_S - 0.25), (0, None, 0.0), (0, 5.0, 0.0), (2, 0.0, math.inf),
    (None, None, math.inf)])
def test_idle_in(in_flight: int | None, quiet_s: float | None, wait: float) -> None:
    assert idle_in(Held("x", 5, in_flight, quiet_s, None)) == pytest.approx(wait)


def test_median() -> None:
    assert median_s([]) is None
    assert median_s([100.0, 1.0, 2.0, 3.0, 4.0, 50.0]) == 3.0  # the last five only
    assert median_s([0.12345678]) == 0.123  # to the millisecond


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
        waiting = [T(down, "u", 0.0)] * len(queued[down])
        if next_up(waiting, Shares()) == down:
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
                           vram_mib=16000, all_roles=("r",), sleep_level=0,
                           preemptible="sleep")
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
    svc.ledger = SimpleNamespace(roles=svc.ledger.roles, reservations={  # type: ignore[attr-defined]
        "other": SimpleNamespace(mib=20000, all_roles=("r",))})
    sup = CrashLooping(svc, denied=True)
    od = OnDemand(cast(Any, svc), cast(Any, sup), clock=time.monotonic)
    svc.records.apply("other", Put(demand=replace(svc.records.demand("other"), up_at=time.monotonic())))
    began = time.monotonic()
    waiting = asyncio.ensure_future(od.ensure("od"))
    await asyncio.sleep(0.2)
    assert od.queued == {"od": [od.queued["od"][0]]}
    full = await od.ensure("od")
    assert time.monotonic() - began < 0.5
    timed_out = await waiting
    assert 1.0 <= time.monotonic() - began < 3.0
    for reply, why, figure, text in (
            (full, "queue-full", {"max_queued": 1}, "(router.max_queued = 1)"),
            (timed_out, "queue-timeout", {"queue_timeout_s": 1}, "(router.queue_timeout_s = 1)")):
        assert reply.status == 403 and int(reply.headers["Retry-After"]) >= 1, reply.headers
        said = json.loads(reply.headers["X-Gpud-Reason"])["error"]
        assert said["details"]["class"] == why, said
        # the limit's figure, the router's config's: in the details and the message
        assert {k: said["details"][k] for k in figure} == figure, said
        assert text in said["message"], said
        assert "16000" not in reply.headers["X-Gpud-Reason"]  # no memory figures
    assert od.queued == {} and od.counts.queue_waits["od"].n == 1


def test_histogram_is_cumulative() -> None:
    from gpud.core.queue import Histogram
    h = Histogram.empty()
    for s in (0.05, 0.3, 0.3, 400.0, 0.25):
        h.observe(s)
    rows = dict(h.cumulative())
    # a duration on a bound is in its bucket (le: at most)
    assert (rows["0.1"], rows["0.25"], rows["0.5"], rows["300.0"], rows["+Inf"]) == (1, 2, 4, 4, 5)
    assert h.n == 5 and h.total_s == pytest.approx(400.9)


async def test_a_serve_no_eviction_could_make_room_for_is_refused_at_once() -> None:
    """Nothing the queue may evict would free enough (the running serve is more important):
    the refusal for memory is answered at once, as without a queue, not after a wait."""
    spec = SimpleNamespace(on_demand=True, preempt=False, start_timeout_s=30.0, priority=5,
                           vram_mib=16000, all_roles=("r",), sleep_level=0,
                           preemptible="sleep")
    vital = SimpleNamespace(on_demand=True, priority=1, all_roles=("r",), sleep_level=0,
                            preemptible="sleep")
    svc = FakeService(Clock())
    svc.config = SimpleNamespace(
        router=SimpleNamespace(max_queued=8, queue_timeout_s=30, min_awake_s=10.0),
        serves={"od": spec, "vital": vital})
    svc.serve_spec = lambda _name: spec  # type: ignore[method-assign]
    svc.states["vital"] = RUNNING
    svc.free_for = lambda _serve, _role: 807  # type: ignore[attr-defined]
    svc.ledger = SimpleNamespace(roles=svc.ledger.roles, reservations={  # type: ignore[attr-defined]
        "vital": SimpleNamespace(mib=20000, all_roles=("r",))})
    od = OnDemand(cast(Any, svc), cast(Any, CrashLooping(svc, denied=True)), clock=time.monotonic)
    began = time.monotonic()
    reply = await od.ensure("od")
    assert time.monotonic() - began < 0.5 and reply.status == 403
    assert json.loads(reply.headers["X-Gpud-Reason"])["error"]["details"]["class"] == "no-memory"
    assert od.queued == {}


def test_places_show_each_serves_queue_by_requester() -> None:
    tickets = [T("a", "u", 0.0), T("a", "u", 1.0), T("b", "v", 2.0), T("a", "v", 3.0)]
    # order: u a@0 (v0), v b@2 (v0), u a@1 (v1), v a@3 (v1)
    assert places(tickets, Shares()) == {
        "a": [Place("u", 2, 1), Place("v", 1, 4)], "b": [Place("v", 1, 2)]}
    assert places([], Shares()) == {}


def test_expected_wait_sums_the_bring_ups_ahead() -> None:
    tickets = [T("a", "u", 0.0), T("b", "v", 2.0), T("c", "w", 3.0)]
    assert expected_wait_s(tickets, Shares(), {"a": 4.0, "b": 10.36, "c": 1.0}) == {
        "a": 4.0, "b": 14.4, "c": 15.4}  # tenths of a second
    # one unmeasured: it and those after it unknown
    assert expected_wait_s(tickets, Shares(), {"a": 4.0, "c": 1.0}) == {
        "a": 4.0, "b": None, "c": None}
    # a serve running already costs nothing
    assert expected_wait_s([T("a", "u", 0.0, running=True), T("b", "v", 1.0)], Shares(),
                           {"b": 2.0}) == {"a": 0.0, "b": 2.0}


# ---- backfill (EASY, as Slurm's backfill scheduler) -----------------------------------------

ROLES = ("r", "s")


def _takes(asks_from: dict[str, int], go: list[str], asks: list[Ask], upto: int,
           free: dict[str, int]) -> dict[str, int]:
    """FREE less what the asks before index UPTO that went take."""
    left = dict(free)
    for a in asks[:upto]:
        if a.serve in go:
            for r, need in a.takes_mib.items():
                left[r] = left.get(r, 0) - need
    return left


def _less(free: dict[str, int], ask: Ask) -> dict[str, int]:
    return {r: free.get(r, 0) - ask.takes_mib.get(r, 0) for r in set(free) | set(ask.takes_mib)}


freeings = st.builds(Freeing, st.sampled_from(ROLES), st.integers(0, 30000),
                     st.sampled_from([0.0, 0.5, 3.0, 287.0]))
ask_lists = st.lists(st.tuples(
    st.dictionaries(st.sampled_from(ROLES), st.integers(0, 30000), min_size=1),
    st.lists(freeings, max_size=4)), max_size=6).map(
    lambda xs: [Ask(f"s{i}", takes, tuple(frees)) for i, (takes, frees) in enumerate(xs)])
frees_now = st.fixed_dictionaries({r: st.integers(0, 40000) for r in ROLES})


def test_backfill_the_issue_layout() -> None:
    """a (20000 MiB) is up for min_awake_s, 287 s more; b heads the queue (20000 MiB, needs a
    gone); chat wakes with 5200 of the 11607 free: it goes at once, b's start is not delayed.
    A serve that would take what b needs then (10000) waits."""
    b = Ask("b", {"r": 20000}, (Freeing("r", 20000, 287.0),))
    chat = Ask("chat", {"r": 5200})
    greedy = Ask("big", {"r": 10000})
    assert earliest_start(b, {"r": 11607}) == 287.0
    assert backfill([b, chat], {"r": 11607}) == ["chat"]
    # b needing 25000 leaves 6607 spare at its start: chat goes, big would delay b
    b25 = Ask("b", {"r": 25000}, (Freeing("r", 20000, 287.0),))
    assert backfill([b25, greedy], {"r": 11607}) == []
    assert backfill([b25, chat, greedy], {"r": 11607}) == ["chat"]
    assert backfill([b25, greedy, chat], {"r": 11607}) == ["chat"]
    assert backfill([b25, chat, chat], {"r": 11607}) == ["chat"]
    # before the head, in the queue's order, each that fits goes (it is next anyway)
    assert backfill([chat, b, greedy], {"r": 11607}) == ["chat"]
    assert backfill([greedy, b, chat], {"r": 11607}) == ["big"]
    # the head can never start by evictions: it keeps nothing from the others
    assert backfill([Ask("huge", {"r": 99999}), greedy], {"r": 11607}) == ["big"]
    # on another role than the head's, only the fit now counts
    assert backfill([b25, Ask("o", {"s": 9000})], {"r": 11607, "s": 9000}) == ["o"]


@settings(max_examples=300, deadline=None)
@given(ask_lists, frees_now)
def test_a_backfilled_request_never_delays_the_heads_earliest_start(
        asks: list[Ask], free: dict[str, int]) -> None:
    go = backfill(asks, free)
    heads = [i for i, a in enumerate(asks) if a.serve not in go]
    if not heads:
        return
    h = heads[0]
    assert all(a.serve in go for a in asks[:h])  # before the head, all went
    before = _takes({}, go, asks, h, free)   # what the head would see without the backfills
    after = _takes({}, go, asks, len(asks), free)
    assert earliest_start(asks[h], after) == earliest_start(asks[h], before)


@settings(max_examples=300, deadline=None)
@given(ask_lists, frees_now)
def test_a_request_that_fits_now_and_delays_nobody_never_waits(
        asks: list[Ask], free: dict[str, int]) -> None:
    go = backfill(asks, free)
    heads = [i for i, a in enumerate(asks) if a.serve not in go]
    if not heads:
        return
    h = heads[0]
    head = asks[h]
    for i in heads[1:]:
        seen = _takes({}, go, asks, i, free)
        fits = all(seen.get(r, 0) >= need for r, need in asks[i].takes_mib.items())
        # it waits only when it does not fit now, or would delay the head's earliest start
        assert not fits or earliest_start(head, _less(seen, asks[i])) > \
            earliest_start(head, seen), (asks[i], head, seen)


weights = st.sampled_from([0.5, 1.0, 2.0, 4.0])  # dyadic: the virtual times add exactly
tickets_st = st.lists(st.builds(
    Ticket, st.sampled_from(["a", "b", "chat", "d"]), st.sampled_from(["u1", "u2", "u3"]),
    st.integers(0, 20).map(float), st.integers(0, 2), st.just(False), st.integers(-1, 1), weights),
    max_size=10)


@settings(max_examples=300, deadline=None)
@given(tickets_st, ask_lists.map(lambda xs: xs), frees_now)
def test_fairness_among_those_that_wait_is_unchanged_by_a_backfill(
        tickets: list[Ticket], _asks: list[Ask], free: dict[str, int]) -> None:
    # one key's weight and priority for all its tickets, as the router gives them
    first = {}
    for t in tickets:
        first.setdefault(t.requester, t)
    tickets = [replace(t, weight=first[t.requester].weight,
                       key_priority=first[t.requester].key_priority) for t in tickets]
    shares = Shares()
    for t in tickets:
        shares = joined(shares, t.requester)
    serves = list(dict.fromkeys(t.serve for t in order(tickets, shares)))
    sizes = {"a": 20000, "b": 20000, "chat": 5200, "d": 9000}
    asks = [Ask(s, {"r": sizes[s]}, (Freeing("r", 20000, 287.0),)) for s in serves]
    go = set(backfill(asks, free))
    went = [t for t in tickets if t.serve in go]
    left = [t for t in tickets if t.serve not in go]
    # each backfilled request is charged to its requester as any request let through
    after = shares
    for t in went:
        after = let_through(after, t)
    after = forget(after, (t.requester for t in left))
    before_rank = {id(t): i for i, t in enumerate(order(tickets, shares))}
    after_rank = {id(t): i for i, t in enumerate(order(left, after))}
    served = {t.requester for t in went}
    for x in left:
        for y in left:
            if y.requester in served or before_rank[id(y)] > before_rank[id(x)]:
                continue
            # y went before x and its requester had nothing backfilled: it still does (among
            # requesters without a backfill the order is the same; one that had a request
            # backfilled gains no place by it)
            assert after_rank[id(y)] <= after_rank[id(x)], (x, y, went)


def test_waiting_for_says_what_and_until_when() -> None:
    from gpud.core.queue import Waiting, waiting_for
    b = Ask("b", {"r": 20000}, (Freeing("r", 20000, 286.4, "a", "min_awake_s"),))
    assert waiting_for(b, {"r": 11607}, requests=16, head="b").text() == \
        "16 requests; a may be evicted in 287 s (min_awake_s)"
    assert waiting_for(b, {"r": 11607}, requests=16, head="b").in_s == 286.4
    assert waiting_for(b, {"r": 11607}, requests=1, head="c") == \
        Waiting(1, "behind c in the queue", None)
    assert waiting_for(Ask("b", {"r": 99999}, b.frees), {"r": 11607}, requests=2,
                       head="b").in_s is None
    assert waiting_for(b, {"r": 20000}, requests=2, head="b").reason == "fits now: coming up"
    two = Ask("b", {"r": 30000}, (Freeing("r", 9000, 3.0, "c", "idle time"),
                                  Freeing("r", 20000, 3.0, "a", "min_awake_s")))
    assert waiting_for(two, {"r": 1000}, requests=1, head=None).reason == \
        "a, c may be evicted in 3 s (idle time, min_awake_s)"
