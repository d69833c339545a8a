"""A serve's on-demand facts, in one record: what gpud.server.ondemand knows of one serve
between requests through its front (issue 45, "one record per serve": these were seven dicts and
sets of their own, keyed by serve name).

`Demand` is pure data, frozen; the adapter keeps one per serve and changes it only through one
function (`OnDemand.note`), so that a serve's on-demand facts are read and changed in one place.
`NO_DEMAND` is a serve of which nothing is known (the adapter keeps no record equal to it).
Pure: no I/O, no clock (the times are the adapter's clock's, given in).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpud.core.bringup import Tries


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
