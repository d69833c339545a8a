"""The router's queue: which waiting serve comes up next, and which running serve makes room for
it. Pure: values in, values out (gpud.ondemand holds the requests and carries the decisions out).

A request for an on-demand serve that does not fit (a refusal of class no-memory) waits in its
serve's queue (at most `max_queued` requests per serve, each at most `queue_timeout_s`) instead
of failing. Of the serves that wait, one at a time may make room (`next_up`): a serve that is
running already is served first (collation: its requests go through at once), then the most
important (the smallest priority number), then the one with most requests waiting, then the one
waiting longest.

A running serve may be evicted for it (`victims`) when it is of equal or lower priority (a
larger or equal number: a more important serve is never evicted by a request) and either idle
(nothing in flight and no request for IDLE_AFTER_S) or up for at least `min_awake_s` since it was
brought up on demand: an alternating storm A B A B swaps at most once per `min_awake_s`. The
victims are taken least important first, then the cheapest to bring back (the median of its
measured wakes or starts), then by name.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

# A serve is idle (evictable before min_awake_s) with nothing in flight and no request for this long.
IDLE_AFTER_S: Final = 1.0
# How many measured bring-ups of each kind the median is taken over.
MEASURED: Final = 5


@dataclass(frozen=True, slots=True)
class Waiting:
    """A serve with requests in the queue."""

    serve: str
    priority: int
    queued: int
    # the oldest waiting request's arrival (the clock's time)
    since: float
    running: bool = False


@dataclass(frozen=True, slots=True)
class Held:
    """A running serve a queued request might evict."""

    serve: str
    priority: int
    # requests in flight as it last counted them; None: unknown (counted busy)
    in_flight: int | None
    # seconds since its last request (0 while one is in flight); None: none seen
    quiet_s: float | None
    # seconds since it was brought up on demand; None: not brought up by a request
    up_for_s: float | None
    # the median of its measured bring-backs (wake when it sleeps, else start); None: unmeasured
    cost_s: float | None = None


@dataclass(frozen=True, slots=True)
class Protected:
    """No victim now: wait this long (at most) before asking again."""

    wait_s: float
    reason: str


def next_up(waiting: Iterable[Waiting]) -> str | None:
    """The serve whose queued requests go first: running ones (collation), then by priority,
    then by the most requests waiting, then the longest waiting, then by name."""
    ranked = sorted(waiting, key=lambda w: (not w.running, w.priority, -w.queued, w.since,
                                            w.serve))
    return ranked[0].serve if ranked else None


def idle(h: Held) -> bool:
    return h.in_flight == 0 and (h.quiet_s is None or h.quiet_s >= IDLE_AFTER_S)


def evictable(h: Held, priority: int, min_awake_s: float) -> float:
    """0 when a request for a serve of `priority` may evict H now, else how long until it may
    (math.inf: never, a more important serve)."""
    if h.priority < priority:
        return math.inf
    if idle(h) or h.up_for_s is None or h.up_for_s >= min_awake_s:
        return 0.0
    return min_awake_s - h.up_for_s


def victims(held: Iterable[Held], serve: str, priority: int,
            min_awake_s: float) -> list[str] | Protected:
    """The serves a request for SERVE (of `priority`) may evict now, in the order to evict
    them, or how long to wait when there is none."""
    now: list[Held] = []
    later: list[float] = []
    for h in held:
        if h.serve == serve:
            continue
        wait = evictable(h, priority, min_awake_s)
        if wait == 0.0:
            now.append(h)
        elif math.isfinite(wait):
            later.append(wait)
    if now:
        return [h.serve for h in sorted(now, key=_eviction_order)]
    if later:
        return Protected(min(later), "the running serves of equal or lower priority are busy "
                         f"and up for less than min_awake_s ({min_awake_s:g} s)")
    return Protected(math.inf, "no running serve of equal or lower priority to evict")


def _eviction_order(h: Held) -> tuple[int, float, str]:
    return (-h.priority, math.inf if h.cost_s is None else h.cost_s, h.serve)


def median_s(took: Sequence[float]) -> float | None:
    """The median of the last MEASURED durations, rounded to the millisecond; None: none."""
    last = list(took)[-MEASURED:]
    return round(statistics.median(last), 3) if last else None


# The buckets of the queue's waits and the bring-ups' durations (seconds; the metrics').
BUCKETS_S: Final = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(slots=True)
class Histogram:
    """Counts of durations by bucket (cumulative when read, as Prometheus' histogram is)."""

    counts: list[int]
    total_s: float = 0.0
    n: int = 0
    bounds: tuple[float, ...] = BUCKETS_S

    @classmethod
    def empty(cls, bounds: tuple[float, ...] = BUCKETS_S) -> Histogram:
        return cls([0] * len(bounds), bounds=bounds)

    def observe(self, seconds: float) -> None:
        for i, bound in enumerate(self.bounds):
            if seconds <= bound:
                self.counts[i] += 1
                break
        self.total_s += seconds
        self.n += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, count of durations at most le) for each bucket, then "+Inf"."""
        out, running = [], 0
        for bound, count in zip(self.bounds, self.counts, strict=True):
            running += count
            out.append((repr(bound), running))
        out.append(("+Inf", self.n))
        return out
