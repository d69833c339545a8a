"""What is in flight on a serve, since when it is idle and what it is then due: as data, pure.

The source is the serve's own count, read from its ``GET /metrics`` (gpud.life.traffic polls it):
vLLM's gauges ``vllm:num_requests_running`` (requests in its model execution batches) and
``vllm:num_requests_waiting`` (queued: admitted by the API server, not scheduled yet, and every
request held while the engine is paused or asleep), one sample per engine (labels
``model_name`` and ``engine``; vLLM 0.32's ``vllm/v1/metrics/loggers.py:527-545``). Their sum is
what the serve has in flight. Why the serve's count and not the front's:

- it is right after a gpud restart: the count lives in the serve, so a stream that began before
  gpud started is seen at the first read (a count gpud kept itself, from the ends the front
  reports, would have lost the begins it did not see);
- it is the same for every fronted serve, on demand or not, and for a serve on a port: nginx
  gets no new channel, and nothing of gpud's sits in the data path (a read of /metrics is
  gpud's own request to the serve; the front forwards clients' requests as before);
- a request the front forwarded but the engine has not taken yet is covered by the front's
  ensure (an on-demand serve's begin, `OnDemand.ensure`): idle time counts from the later of the
  last ensure and the last time the count was seen drop to zero.

"When the last request ended" is known to within one poll (gpud.life.traffic.POLL_S). A serve whose
/metrics names neither gauge (not vLLM, or vLLM with ``--disable-log-stats``) has an unknown
count (None): its idle time counts from the last ensure alone, as before, and gpud says so once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Final

from gpud.core.vocab import Phase, ServeState, SleepAction

RUNNING_GAUGE: Final = "vllm:num_requests_running"
WAITING_GAUGE: Final = "vllm:num_requests_waiting"
GAUGES: Final = (RUNNING_GAUGE, WAITING_GAUGE)

# While one of these is under way, a request must not reach the serve: it is going to sleep or
# going away. The front's ensure waits for it to end, then wakes or starts the serve.
SETTLING_PHASES: Final = frozenset({Phase.FALLING_ASLEEP, Phase.STOPPING})


def in_flight_from_metrics(text: str) -> int | None:
    """The requests in flight that a Prometheus text exposition of vLLM's says: the sum of every
    sample of its running and waiting gauges; None when it names neither."""
    total = 0.0
    seen = False
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_end = len(line)
        for i, ch in enumerate(line):
            if ch in "{ ":
                name_end = i
                break
        if line[:name_end] not in GAUGES:
            continue
        parts = line.rpartition("}")[2].split() if "{" in line else line.split()[1:]
        if not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        if not math.isfinite(value) or value < 0:
            continue
        total += value
        seen = True
    return round(total) if seen else None


@dataclass(frozen=True)
class Flight:
    """A serve's traffic as gpud last read it. `in_flight`: requests the serve has (None: its
    count is unknown, or not read yet); `ended_at`: when the count was first seen at zero after
    requests (the last request's end, within a poll); `read_at`: the last read that answered."""

    in_flight: int | None = None
    ended_at: float | None = None
    read_at: float | None = None


def observe(flight: Flight, count: int | None, now: float) -> Flight:
    """`flight` after a read at `now` that found `count` (None: the serve gave no count)."""
    if count is None:
        return replace(flight, in_flight=None, read_at=now)
    if count > 0:
        return replace(flight, in_flight=count, read_at=now)
    ended = now if flight.in_flight else flight.ended_at
    return replace(flight, in_flight=0, ended_at=ended, read_at=now)


def idle_from(last_begin: float | None, flight: Flight) -> float | None:
    """Since when the serve is idle: the later of the last request's begin gpud saw (the
    front's ensure, or when the serve was first seen running) and the last request's end."""
    times = [t for t in (last_begin, flight.ended_at) if t is not None]
    return max(times) if times else None


def idle_action(state: ServeState, idle_for_s: float, *, idle_sleep_s: float | None,
                idle_stop_s: float | None, sleep_level: int) -> SleepAction | None:
    """What an on-demand serve idle for `idle_for_s` (no request through its front) is due:
    "stop" once past idle_stop_s (running or asleep), "sleep" once a running one with a
    sleep_level is past idle_sleep_s, else None."""
    if state not in (ServeState.RUNNING, ServeState.SLEEPING):
        return None
    if idle_stop_s is not None and idle_for_s >= idle_stop_s:
        return SleepAction.STOP
    if state == ServeState.RUNNING and sleep_level and idle_sleep_s is not None \
            and idle_for_s >= idle_sleep_s:
        return SleepAction.SLEEP
    return None


def idle_due(state: ServeState, flight: Flight, idle_for_s: float, *,
             idle_sleep_s: float | None, idle_stop_s: float | None,
             sleep_level: int) -> SleepAction | None:
    """What an on-demand serve idle for `idle_for_s` is due (idle_action), and
    never while a request is in flight. An unknown count (None) does not hold it: its idle time
    then counts from the front's last ensure alone."""
    if flight.in_flight:
        return None
    return idle_action(state, idle_for_s, idle_sleep_s=idle_sleep_s, idle_stop_s=idle_stop_s,
                       sleep_level=sleep_level)


def idle_due_in(idle_for_s: float, *, idle_sleep_s: float | None,
                idle_stop_s: float | None) -> float | None:
    """How long until a serve idle for `idle_for_s` reaches its next idle threshold (None:
    none ahead): the idle check waits that long at most, or for a change."""
    ahead = [t - idle_for_s for t in (idle_sleep_s, idle_stop_s)
             if t is not None and t > idle_for_s]
    return min(ahead) if ahead else None


def settling(phase: Phase, draining: bool) -> bool:
    """A sleep or a stop of the serve is under way (or the drain before one): a request must
    wait for it to end before the serve is woken or started again."""
    return draining or phase in SETTLING_PHASES


class Outcome(StrEnum):
    """What happened to the requests in flight when a serve was preempted (or idled)."""

    NONE = "none"  # nothing was in flight
    DRAINED = "drained"  # all ended by themselves within the bound
    ABORTED = "aborted"  # still in flight at the bound: ended by the sleep (mode=abort) or stop
    UNKNOWN = "unknown"  # the serve gives no count


@dataclass(frozen=True)
class Drain:
    """A drain's account, for the event: the requests in flight when it began, those left at
    its end, how long it waited and its bound."""

    before: int | None
    after: int | None
    waited_s: float
    bound_s: float

    @property
    def outcome(self) -> Outcome:
        if self.before is None or self.after is None:
            return Outcome.UNKNOWN
        if self.before == 0:
            return Outcome.NONE
        return Outcome.DRAINED if self.after == 0 else Outcome.ABORTED

    @property
    def sleep_mode(self) -> str:
        """vLLM's pause mode for the sleep that follows: "wait" (what the drain left, a request
        that came meanwhile included, finishes before the memory goes) unless requests were
        still in flight at the bound: then "abort"."""
        return "abort" if self.outcome == Outcome.ABORTED else "wait"

    def details(self) -> dict[str, object]:
        return {"outcome": self.outcome, "before": self.before, "after": self.after,
                "waited_s": round(self.waited_s, 1), "bound_s": self.bound_s}

    def line(self) -> str:
        """The event message's words for it."""
        outcome = self.outcome
        if outcome == Outcome.NONE:
            return "no request in flight"
        if outcome == Outcome.UNKNOWN:
            return "requests in flight unknown (the serve gives no count)"
        if outcome == Outcome.DRAINED:
            return f"{self.before} request(s) in flight drained in {self.waited_s:.1f} s"
        return (f"{self.after} of {self.before} request(s) in flight aborted after the "
                f"{self.bound_s:g} s drain bound")


def drain_done(count: int | None, waited_s: float, bound_s: float) -> bool:
    """A drain ends when nothing is in flight, the count is unknown, or at its bound."""
    return count is None or count == 0 or waited_s >= bound_s
