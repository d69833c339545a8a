"""What the on-demand orchestrator (gpud.life.ondemand) has done since gpud started, counted by
serve: its idle sleeps and stops, its evictions for a queued request, how long queued requests
waited, and its bring-ups by kind, timed. One small object the orchestrator adds to as it acts
and the metrics (gpud.server.metrics) read when they are scraped, as prometheus_client's
collectors read their values at collection: nothing is pushed to them."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from gpud.core.queue import MEASURED, Histogram, median_s
from gpud.core.vocab import StepKind


@dataclass
class DemandCounts:
    # idle sleeps and stops carried out (idle_sleep_s, idle_stop_s)
    idle_sleeps: dict[str, int] = field(default_factory=dict)
    idle_stops: dict[str, int] = field(default_factory=dict)
    # evictions for a queued request, of the serve evicted
    evictions: dict[str, int] = field(default_factory=dict)
    # how long queued requests waited, by the serve they waited for
    queue_waits: dict[str, Histogram] = field(default_factory=dict)
    # the bring-ups by request, by serve and kind, timed
    bringups: dict[tuple[str, StepKind], Histogram] = field(default_factory=dict)
    # the durations of each serve's last MEASURED bring-ups by kind: the cost of evicting it
    took: dict[str, dict[StepKind, deque[float]]] = field(default_factory=dict)

    @staticmethod
    def add(counts: dict[str, int], serve: str, n: int = 1) -> None:
        counts[serve] = counts.get(serve, 0) + n

    def waited(self, serve: str, seconds: float) -> None:
        self.queue_waits.setdefault(serve, Histogram.empty()).observe(seconds)

    def brought_up(self, serve: str, kind: StepKind, seconds: float) -> None:
        self.took.setdefault(serve, {}).setdefault(kind, deque(maxlen=MEASURED)).append(seconds)
        self.bringups.setdefault((serve, kind), Histogram.empty()).observe(seconds)

    def bringup_s(self, serve: str, kind: StepKind) -> float | None:
        """The median of SERVE's last measured bring-ups of KIND (gpud.core.queue.MEASURED)."""
        return median_s(self.took.get(serve, {}).get(kind, ()))
