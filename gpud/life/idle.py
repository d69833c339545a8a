"""The idle check of on-demand serves (docs/config.md, idle_sleep_s and idle_stop_s): a serve idle
past its threshold is put to sleep or stopped. Idle from the later of the last request through
its front and the end of the last request it counted (gpud.life.traffic); never while a request
is in flight. The decision is gpud.core.traffic's (idle_due); this carries it out, counted in the
orchestrator's counts (gpud.life.counts), and waits on changes or until the first threshold
ahead, never on a fixed tick."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from gpud.core.demand import Idling, LastActivity
from gpud.core.traffic import Flight, idle_due, idle_due_in, idle_from
from gpud.core.vocab import LIVE_STATES, RUNNING, SLEEPING, ServeState, SleepAction
from gpud.errors import GpudError
from gpud.host.traffic import reachable
from gpud.life.traffic import drain_and_stop

if TYPE_CHECKING:
    from gpud.config import ServeConfig
    from gpud.life.demandview import DemandView
    from gpud.life.pulse import Wakeups

log = logging.getLogger("gpud.ondemand")

# The idle check looks this long after a threshold is due (the clock's rounding).
IDLE_MARGIN_S = 0.05


class IdleCheck:
    """VIEW: the orchestrator's reads (its service, supervisor, traffic, clock and counts);
    CHANGES: what it waits on (any change); CHANGED: told when a sleep or stop of its ends,
    with the serve's name."""

    def __init__(self, view: DemandView, changes: Wakeups,
                 changed: Callable[[Collection[str]], None]) -> None:
        self.view = view
        self.svc, self.sup, self.traffic = view.svc, view.sup, view.traffic
        self.clock = view.clock
        self.changes = changes
        self.changed = changed

    def _flight(self, name: str) -> Flight:
        return self.view.flight(name)


    async def loop(self) -> None:
        """Put to sleep or stop the on-demand serves idle past idle_sleep_s / idle_stop_s.
        Waits on changes (a state stored, a count of requests in flight read, a drain's end)
        or until the first idle threshold ahead, never on a fixed tick."""
        while True:
            for name, spec in self.svc.config.serves.items():
                if spec.on_demand and self.sup.bringup(name) is None:
                    await self._check(name, spec)
            wait_s = self._due_in()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(None if wait_s is None else wait_s + IDLE_MARGIN_S):
                    await self.changes.next()

    def _due_in(self) -> float | None:
        """How long until the first on-demand serve reaches an idle threshold (None: none)."""
        now, due = self.clock(), []
        for name, spec in self.svc.config.serves.items():
            last = idle_from(self.svc.records.demand(name).last_activity, self._flight(name))
            if not spec.on_demand or last is None or \
                    self.svc.state_of(name) not in (RUNNING, SLEEPING):
                continue
            ahead = idle_due_in(now - last, idle_sleep_s=spec.idle_sleep_s,
                                idle_stop_s=spec.idle_stop_s)
            if ahead is not None:
                due.append(ahead)
        # a serve running without a request seen is idle from when the check first sees it
        unseen = any(spec.on_demand and self.svc.records.demand(name).last_activity is None
                     and self.sup.bringup(name) is None
                     and self.svc.state_of(name) in (RUNNING, SLEEPING)
                     for name, spec in self.svc.config.serves.items())
        return 0.0 if unseen else min(due, default=None)

    async def _check(self, name: str, spec: ServeConfig) -> None:
        state = ServeState(self.svc.state_of(name))
        now = self.clock()
        if state not in (RUNNING, SLEEPING):
            if state not in LIVE_STATES:
                self.svc.records.apply(name, LastActivity(None))
            return
        # A serve running without a request seen (started by hand, or before gpud started)
        # is idle from when it is first seen, or from the end of its last request.
        first = self.svc.records.demand(name).last_activity
        if first is None:
            first = now
            self.svc.records.apply(name, LastActivity(now))
        flight = self._flight(name)
        if self.traffic is not None and flight.read_at is None and \
                reachable(spec):
            return  # its count not read yet (gpud just started): a stream may be running
        last = idle_from(first, flight)
        assert last is not None
        action = idle_due(state, flight, now - last, idle_sleep_s=spec.idle_sleep_s,
                          idle_stop_s=spec.idle_stop_s, sleep_level=spec.sleep_level)
        if action is None:
            return
        idle = round(now - last, 1)
        # The sleep or stop records its own event (kind sleep / stop, by gpud: uid none), its
        # idle_s saying why.
        log.info("on-demand %s idle for %.1f s without a request through its front: %s",
                 name, idle, action)
        self.svc.records.apply(name, Idling(True))
        try:
            if action == SleepAction.SLEEP:
                await self.sup.sleeps.sleep(name, None, idle_s=idle)
                self.view.counts.add(self.view.counts.idle_sleeps, name)
            else:
                # nothing in flight by the idle check's count: the drain confirms it
                await drain_and_stop(
                    self.traffic, self.sup.stop_job, name, spec, None,
                    self.svc.config.daemon.drain_timeout_s, cut=True,
                    tell=functools.partial(self.sup.sleeps.post, name, spec), idle_s=idle)
                self.view.counts.add(self.view.counts.idle_stops, name)
                self.svc.records.apply(name, LastActivity(None))
        except GpudError as exc:
            log.warning("on-demand %s: idle %s refused: %s", name, action, exc.message)
        finally:
            self.svc.records.apply(name, Idling(False))
            self.changed((name,))
