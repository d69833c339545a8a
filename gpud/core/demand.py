"""A serve's on-demand facts: what gpud.life.ondemand knows of one serve between requests
through its front, and the rules of how each thing that happens to a bring-up changes them.

`Demand` is pure data, frozen, and part of the serve's one record (gpud.core.serverecord.Record,
beside its state and its life). It changes by events (`DemandEvent`: a request came, a bring-up
began, came up or was tried, the idle check decided...), stepped here (`step`) as part of the
record's one step, through the records' one writer (gpud.life.records.ServeRecords.apply), so
that a serve's on-demand facts are read and changed in one place and a change of its state
keeps them. `NO_DEMAND` is a serve of which nothing is known. Pure: no I/O, no clock (the times
are the adapter's clock's, given in).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gpud.core import bringup
from gpud.core.bringup import Policy, Tries, Why


@dataclass(frozen=True)
class Demand:
    """One serve's on-demand facts (None / False: not known, not so)."""

    # Its failed or refused bring-ups in a row (gpud.core.bringup), and whether its failure is
    # counted there since its last bring-up began (one failure is one, however many times its
    # failed state is written: a crash-loop writes it, then its release).
    tries: Tries | None = None
    failure_counted: bool = False
    # The idle check (or an eviction for a queued request) is putting it to sleep or stopping
    # it, from its decision on: a request must not reach it now.
    idling: bool = False
    # When it is idle from (the adapter's clock): its last request through the front, or when
    # it was first seen running without one.
    last_activity: float | None = None
    # The last request through its front, as answered in GET /v1/serves.
    last_request: float | None = None
    # When a request last brought it up (the router's queue: router.min_awake_s).
    up_at: float | None = None
    # What it needed when last refused for memory (MiB on each of its roles).
    need_mib: int | None = None


NO_DEMAND = Demand()


# --- the bring-up rules: how each thing that happens to a serve changes its Demand ----------

def began(d: Demand) -> Demand:
    """A bring-up of the serve began: a failure from now on is this bring-up's, not counted."""
    return replace(d, failure_counted=False)


def came_up(d: Demand, now: float) -> Demand:
    """The bring-up ended with the serve running at NOW: no hold (its failures in a row kept
    until it has stayed up, gpud.core.bringup.came_up), and up from NOW (router.min_awake_s)."""
    return replace(d, up_at=now, tries=bringup.came_up(d.tries, now))


def tried(d: Demand, now: float, why: Why, reason: str, policy: Policy) -> Demand:
    """The bring-up ended at NOW without the serve running, for WHY: a failure counts one more
    in a row (once: see `failed_since`); a refusal holds the next try off without one."""
    if why == Why.FAILED:
        return replace(d, failure_counted=True,
                       tries=bringup.failed(d.tries, now, reason, policy))
    return replace(d, tries=bringup.refused(d.tries, now, why, reason, policy))


def failed_since(d: Demand, at: float, reason: str, policy: Policy) -> Demand:
    """The serve is seen failed (since AT) when a request comes: a failure since its last
    bring-up began (a crash loop once up, an operator's start that failed) counts one in a row,
    once however often it is seen."""
    if d.failure_counted:
        return d
    return tried(d, at, Why.FAILED, reason, policy)


def operator_started(d: Demand) -> Demand:
    """An operator started the serve (gpuctl start): its backoff is over and starts over."""
    return replace(d, tries=None, failure_counted=False)


# --- what happens to a serve's on-demand facts, as events of its record ---------------------

@dataclass(frozen=True)
class Requested:
    """A request came through the serve's front at AT: its last activity and last request."""

    at: float


@dataclass(frozen=True)
class BringupBegan:
    """A bring-up of the serve began (`began`)."""


@dataclass(frozen=True)
class CameUp:
    """The bring-up ended with the serve running at AT (`came_up`)."""

    at: float


@dataclass(frozen=True)
class Tried:
    """The bring-up ended at AT without the serve running, for WHY (`tried`)."""

    at: float
    why: Why
    reason: str
    policy: Policy


@dataclass(frozen=True)
class SeenFailed:
    """The serve is seen failed since AT when a request comes (`failed_since`)."""

    at: float
    reason: str
    policy: Policy


@dataclass(frozen=True)
class OperatorStarted:
    """An operator started the serve (`operator_started`)."""


@dataclass(frozen=True)
class Idling:
    """The idle check (or an eviction) put the serve to sleep or stops it from now (True), or
    that is over (False)."""

    idling: bool


@dataclass(frozen=True)
class UpAt:
    """When a request last brought it up (None: forget it, the serve was evicted)."""

    at: float | None


@dataclass(frozen=True)
class LastActivity:
    """When the serve is idle from (None: not known, it is counted again when next seen)."""

    at: float | None


@dataclass(frozen=True)
class NeedMib:
    """What the serve needed when last refused for memory (MiB on each of its roles)."""

    mib: int | None


DemandEvent = (Requested | BringupBegan | CameUp | Tried | SeenFailed | OperatorStarted
               | Idling | UpAt | LastActivity | NeedMib)


def step(d: Demand, event: DemandEvent) -> Demand:
    """The serve's on-demand facts after EVENT."""
    if isinstance(event, Requested):
        return replace(d, last_activity=event.at, last_request=event.at)
    if isinstance(event, BringupBegan):
        return began(d)
    if isinstance(event, CameUp):
        return came_up(d, event.at)
    if isinstance(event, Tried):
        return tried(d, event.at, event.why, event.reason, event.policy)
    if isinstance(event, SeenFailed):
        return failed_since(d, event.at, event.reason, event.policy)
    if isinstance(event, OperatorStarted):
        return operator_started(d)
    if isinstance(event, Idling):
        return replace(d, idling=event.idling)
    if isinstance(event, UpAt):
        return replace(d, up_at=event.at)
    if isinstance(event, LastActivity):
        return replace(d, last_activity=event.at)
    return replace(d, need_mib=event.mib)
