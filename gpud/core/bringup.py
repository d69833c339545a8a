"""On-demand bring-ups, bounded: when a request through the front may make gpud try again to
bring a serve up, and what a refused request is told. Pure: values in, values out; the caller
(gpud.life.ondemand) passes the time in.

Every request through the front to an on-demand serve that is not running asks gpud to bring it
up. Unbounded, a serve that cannot be brought up is tried once per request: four clients
hammering a crash-looping serve for 30 s caused 12 unit starts (each one holding its device's
start lock, so an operator's start of another serve there waited 15.6 s instead of 2.0 s), and a
serve that does not fit was denied about 94 times a second. So, per serve:

- after a refusal (it does not fit now; gpud or its device cannot take it now), the next try is
  `refusal_hold_s` later, not sooner: the requests meanwhile get the same answer at once;
- after a failure (its unit exited, crash-looped, failed to launch), the next try waits an
  exponential backoff, `first_s` doubling with each failure in a row up to `max_s`;
- a bring-up that ends with the serve running ends the hold; the failures in a row are
  forgotten once it has stayed up `stable_s` (a serve that comes up and dies at once goes on
  doubling its backoff), and at once by an operator's start (`gpuctl start`: the operator's word
  overrides the backoff and starts it over).

A request that is held gets 503 with `Retry-After` = the seconds left (rounded up), and the
reason's class only (`Why`): the front answers any local user over TCP, who cannot be told
ledger figures, other serves' names or a preemption plan (those stay in the API, the events and
the journal).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from gpud.core.vocab import ADMITTED, FAILED, STARTING, DenialBound
from gpud.errors import Denied, Unavailable

# After a refusal, the next try of the same serve no sooner than this.
REFUSAL_HOLD_S: Final = 5.0
# After a failure: first_s, doubling with each failure in a row, at most max_s.
BACKOFF_FIRST_S: Final = 10.0
BACKOFF_MAX_S: Final = 300.0
# Up this long after a bring-up, a serve's failures in a row are forgotten.
STABLE_S: Final = 60.0


class Why(StrEnum):
    """The class of a refusal to bring a serve up: all a client of the front is told."""

    NO_MEMORY = "no-memory"  # it does not fit (the ledger or the device's free memory)
    FAILED = "failed"  # it failed (exited, crash-looped, could not be launched)
    STARTING = "starting"  # it is being brought up, and was not up in time
    UNAVAILABLE = "unavailable"  # gpud, or the serve's device, cannot take it now
    REFUSED = "refused"  # any other refusal (a conflicting operation under way)
    # stopped and not on demand: requests wake it or wait for its start, its operator starts it
    STOPPED = "stopped"
    # the router's queue (gpud.core.queue): too many requests wait for the serve already, or
    # this one waited router.queue_timeout_s
    QUEUE_FULL = "queue-full"
    QUEUE_TIMEOUT = "queue-timeout"
    # gpud stopped (a restart) while the request waited: it is answered, never cut
    GPUD_STOPPING = "gpud-stopping"


TEXT: Final[Mapping[Why, str]] = {
    Why.NO_MEMORY: "not enough GPU memory",
    Why.FAILED: "the serve failed",
    Why.STARTING: "the serve is starting",
    Why.UNAVAILABLE: "the serve cannot be brought up now",
    Why.REFUSED: "the serve cannot be brought up now",
    Why.STOPPED: "the serve is stopped and not on_demand (its operator starts it)",
    Why.QUEUE_FULL: "too many requests wait for the serve",
    Why.QUEUE_TIMEOUT: "the serve could not be brought up while the request waited",
    Why.GPUD_STOPPING: "gpud is restarting (the request was waiting for the serve)",
}

# Bounds of a denial that say the device or gpud cannot take anything now (not a shortfall).
_NOT_MEMORY_BOUNDS: Final = frozenset({DenialBound.DEVICE, DenialBound.HELD})


@dataclass(frozen=True, slots=True)
class Policy:
    refusal_hold_s: float = REFUSAL_HOLD_S
    first_s: float = BACKOFF_FIRST_S
    max_s: float = BACKOFF_MAX_S
    stable_s: float = STABLE_S

    def __post_init__(self) -> None:
        if self.refusal_hold_s < 0 or not 0 < self.first_s <= self.max_s:
            raise ValueError("bring-up policy: refusal_hold_s >= 0 and 0 < first_s <= max_s")

    def backoff_s(self, failures: int) -> float:
        """The wait after `failures` failures in a row (at least one)."""
        if failures < 1:
            return 0.0
        # 2 ** 60 is far past any cap: no float overflow, however long the run of failures
        return min(self.max_s, self.first_s * 2.0 ** min(failures - 1, 60))


@dataclass(frozen=True, slots=True)
class Tries:
    """What is remembered of one serve's bring-ups: the failures in a row, when the next try
    may be, and the class and full text of what held it."""

    failures: int = 0
    not_before: float = 0.0
    why: Why | None = None
    reason: str = ""
    # When its last bring-up ended with it running (None: none since the last failure).
    up_since: float | None = None


@dataclass(frozen=True, slots=True)
class Hold:
    """A request held off: no try before `not_before`."""

    why: Why
    reason: str
    retry_after_s: int
    failures: int


def refused(tries: Tries | None, now: float, why: Why, reason: str, policy: Policy) -> Tries:
    """After a try that was refused (the serve does not fit, or cannot be taken now)."""
    failures = tries.failures if tries is not None else 0
    return Tries(failures, now + policy.refusal_hold_s, why, reason)


def failed(tries: Tries | None, now: float, reason: str, policy: Policy) -> Tries:
    """After a try that ended with the serve failed, or a failure of the serve once up: one
    more failure in a row (the first, when it had stayed up `stable_s`)."""
    failures = tries.failures if tries is not None else 0
    if tries is not None and tries.up_since is not None and now - tries.up_since >= policy.stable_s:
        failures = 0
    failures += 1
    return Tries(failures, now + policy.backoff_s(failures), Why.FAILED, reason)


def came_up(tries: Tries | None, now: float) -> Tries | None:
    """After a bring-up that ended with the serve running: no hold; its failures in a row kept
    until it has stayed up (see `failed`)."""
    if tries is None or tries.failures == 0:
        return None
    return Tries(tries.failures, 0.0, None, "", now)


def held(tries: Tries | None, now: float) -> Hold | None:
    """Whether a request at `now` is held off, and for how long (whole seconds, at least 1)."""
    if tries is None or tries.why is None or now >= tries.not_before:
        return None
    return Hold(tries.why, tries.reason, max(1, math.ceil(tries.not_before - now)),
                tries.failures)


def refusal_class(code: str, details: Mapping[str, Any]) -> Why:
    """The class of a refusal answered to a request: the one its details name (a refusal of the
    queue's, a hold, gpud stopping), else by its code and details (`classify`)."""
    named = details.get("class")
    return Why(named) if isinstance(named, str) else classify(code, details)


def classify(code: str, details: Mapping[str, Any]) -> Why:
    """The class of an error met bringing a serve up (its code and details, gpud.errors)."""
    if code == Denied.code:
        return Why.UNAVAILABLE if details.get("bound") in _NOT_MEMORY_BOUNDS else Why.NO_MEMORY
    state = details.get("state")
    if state == FAILED:
        return Why.FAILED
    if state in (STARTING, ADMITTED) or details.get("timeout"):
        return Why.STARTING
    if code == Unavailable.code:
        return Why.UNAVAILABLE
    return Why.REFUSED


def never_fits(need_mib: int, most_mib: Mapping[str, int]) -> str | None:
    """Why a serve that needs `need_mib` on each of its roles can never fit as configured, or
    None: it needs more than a role holds with nothing else on it (`most_mib`: each role's
    capacity less its reserve), so no wait, release or preemption makes room, and a retry is
    pointless until the config changes."""
    for role, most in sorted(most_mib.items()):
        if need_mib > most:
            return (f"it needs {need_mib} MiB and role {role!r} holds at most {most} MiB with "
                    "nothing else on it (capacity less reserve): lower its vram_mib, or the "
                    "role's reserve_mib")
    return None


NEVER_FITS: Final = ("it can never fit on its GPU as configured (it needs more than its role "
                     "holds with nothing else on it): retrying is pointless until its operator "
                     "changes its vram_mib or its role")


def public_reason(serve: str, why: Why, retry_after_s: int, figures: str = "", *,
                  never: bool = False) -> str:
    """What a client of the front is told: the class, the limit of the router's config it is
    about when it is one (FIGURES: gpud.core.queue.figures_text), and when to try again, or, for
    a serve that can never fit (`never`: never_fits), that it cannot. No memory figures, no
    other serve's name, no plan (the operator's error and journal line have the figures)."""
    if never:
        return f"serve {serve}: {NEVER_FITS}"
    return f"serve {serve}: {TEXT[why]}{figures}; retry after {retry_after_s} s"
