"""On-demand serves: the front asks gpud (nginx's auth_request, before each request to such a
serve) to have the serve up, and gpud admits and starts it, or wakes it, and answers once it
is healthy.

``POST /v1/serves/NAME/ensure`` (gpud.api's route, which only the front's user and root may
call) answers 204 when the serve is running (at once when it already
is), 403 with ``X-Gpud-Reason`` (the error as JSON) and ``Retry-After`` when it cannot be
brought up: the front turns that into a 503 with the reason as its body. Concurrent requests
for one serve share one start (or wake).

Ordered with sleeps and stops: while the serve is being put to sleep or stopped (the lifecycle's
phase falling-asleep or stopping, gpud.core.lifecycle; or drained before one, or about to be
by the idle check), `ensure` waits for that to end and then wakes or starts the serve: the
serve stays `running` until a sleep commits, and nothing must be forwarded into an engine that
is going to sleep or away.

Idle: from the later of the last ensure and the end of the last request (the serve's own count
of requests in flight, gpud.traffic); never while a request is in flight.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from aiohttp import web

from gpud.core.front import RETRY_AFTER_S
from gpud.core.text import printable
from gpud.core.traffic import Flight, idle_due, idle_from, settling
from gpud.core.vocab import LIVE_STATES, RUNNING, SLEEPING, STARTING, ServeState, SleepAction
from gpud.errors import GpudError, NotFound, Unavailable
from gpud.responses import error_response
from gpud.router import wakes_through_router
from gpud.service import LedgerService

if TYPE_CHECKING:
    from gpud.config import ServeConfig
    from gpud.supervisor import Supervisor
    from gpud.traffic import Traffic

log = logging.getLogger(__name__)

# How often a start or wake in progress is looked at until the serve is running.
POLL_S = 0.005
# How often idle serves are looked for.
IDLE_CHECK_S = 0.5


class OnDemand:
    def __init__(self, svc: LedgerService, supervisor: Supervisor, *,
                 clock: Callable[[], float] = time.monotonic,
                 traffic: Traffic | None = None) -> None:
        self.svc = svc
        self.sup = supervisor
        self.clock = clock
        self.traffic = traffic
        self._pending: dict[str, asyncio.Task[None]] = {}
        # Serves the idle check is putting to sleep or stopping (from its decision on).
        self._idling: set[str] = set()
        # When each on-demand serve is idle from (the clock's time): its last request through
        # the front, or when it was first seen running without one.
        self.last_activity: dict[str, float] = {}
        # The last request through each on-demand serve's front, as answered in GET /v1/serves.
        self.last_request: dict[str, float] = {}
        # Idle sleeps and stops carried out since gpud started, by serve (the metrics').
        self.idle_sleeps: dict[str, int] = {}
        self.idle_stops: dict[str, int] = {}

    async def ensure(self, name: str, model: str | None = None) -> web.Response:
        """The answer to the front's `POST /v1/serves/NAME/ensure` (gpud.api authorizes it);
        MODEL: the name a request through the router gave (docs/router.md)."""
        spec = self.svc.serve_spec(name)
        if spec is None or not (spec.on_demand or wakes_through_router(self.svc.config, name)):
            raise NotFound(f"serve {name!r} is not an on_demand serve", {"serve": name})
        self.last_activity[name] = self.last_request[name] = self.clock()
        try:
            if not self.svc.ready and self.svc.state_of(name) != RUNNING:
                # Before reconciliation a start could race the adoption of running units.
                raise Unavailable("gpud is starting (reconciling running serves)",
                                  {"serve": name, "retry": True})
            await self.up(name, spec, model)
            # its wait for the start is not idle time
            self.last_activity[name] = self.last_request[name] = self.clock()
        except GpudError as exc:
            log.warning("on-demand %s not brought up: %s", name, exc.message)
            # The error document is the body too (what the API schema says a 403 is); nginx's
            # auth_request reads only the headers.
            resp = error_response(exc)
            resp.set_status(403)
            resp.headers["X-Gpud-Reason"] = json.dumps(exc.to_json())
            resp.headers["Retry-After"] = str(RETRY_AFTER_S)
            return resp
        return web.Response(status=204)

    def settling(self, name: str) -> bool:
        """A sleep or a stop of NAME is under way (or the drain before one, or the idle
        check's decision to): a request must not reach it now."""
        return name in self._idling or settling(
            self.sup.life(name).phase,
            self.traffic is not None and self.traffic.draining(name))

    async def up(self, name: str, spec: ServeConfig, model: str | None = None) -> None:
        """Return once NAME is running, bringing it up once for all who wait; within its
        start_timeout_s. A sleep or a stop under way is waited for first."""
        if self.svc.state_of(name) == RUNNING and not self.settling(name):
            return
        if not spec.on_demand and self.svc.state_of(name) not in (SLEEPING, STARTING) \
                and not self.settling(name):
            # A serve the router only wakes (or waits for while it starts): started by its
            # operator, not by a request.
            raise Unavailable(f"serve {name!r} is {self.svc.state_of(name)} (not on_demand: "
                              "a request wakes it, gpuctl start starts it)", {"serve": name})
        try:
            async with asyncio.timeout(spec.start_timeout_s):
                while self.settling(name):
                    await asyncio.sleep(POLL_S)
                if self.svc.state_of(name) == RUNNING:
                    return
                task = self._pending.get(name)
                if task is None:
                    task = asyncio.get_running_loop().create_task(
                        self._bring_up(name, spec, model))
                    self._pending[name] = task
                    task.add_done_callback(lambda t: self._done(name, t))
                await asyncio.shield(task)
        except TimeoutError:
            raise Unavailable(f"serve {name!r} not healthy within its start_timeout_s "
                              f"({spec.start_timeout_s:g} s)", {"serve": name}) from None

    def _done(self, name: str, task: asyncio.Task[None]) -> None:
        if self._pending.get(name) is task:
            del self._pending[name]
        if not task.cancelled():
            task.exception()  # retrieved here: every waiter may have timed out

    async def _bring_up(self, name: str, spec: ServeConfig, model: str | None = None) -> None:
        state = self.svc.state_of(name)
        # a request through the router names its model (printable: it is logged)
        by = "on-demand request" if model is None else \
            f"request for model {printable(model[:256])!r} through the router"
        if state == SLEEPING:
            await self.sup.sleeps.wake(name, None, by=by)
        elif state not in LIVE_STATES:
            log.info("on-demand %s: starting (%s)", name, by)
            # Returns once the launch is over: healthy, or failed with its reason.
            await self.sup.start(name, None, wait=True, preempt=spec.preempt)
        # A start or wake of someone else's, still under way.
        while (state := self.svc.state_of(name)) in (STARTING, SLEEPING):
            await asyncio.sleep(POLL_S)
        if state != RUNNING:
            rec = self.svc.records.get(name)
            reason = rec.reason if rec is not None else None
            raise Unavailable(f"serve {name!r} is {state}" + (f": {reason}" if reason else ""),
                              {"serve": name, "state": state})

    def _flight(self, name: str) -> Flight:
        return self.traffic.flight(name) if self.traffic is not None else Flight()

    def activity_s_ago(self, name: str) -> float | None:
        """Seconds since NAME's last request ended (0 while one is in flight): the later of
        the last request through its front (an on-demand serve's ensure) and the end of the
        last request it counted; None when neither is known since gpud started."""
        flight = self._flight(name)
        if flight.in_flight:
            return 0.0
        last = idle_from(self.last_request.get(name), flight)
        return None if last is None else round(max(0.0, self.clock() - last), 1)

    def in_flight(self, name: str) -> int | None:
        """The requests in flight on NAME as it last counted them (None: unknown)."""
        return self._flight(name).in_flight

    # ---- idle ------------------------------------------------------------------------------

    async def idle_loop(self) -> None:
        """Put to sleep or stop the on-demand serves idle past idle_sleep_s / idle_stop_s."""
        while True:
            await asyncio.sleep(IDLE_CHECK_S)
            for name, spec in self.svc.config.serves.items():
                if spec.on_demand and name not in self._pending:
                    await self._idle_check(name, spec)

    async def _idle_check(self, name: str, spec: ServeConfig) -> None:
        state = ServeState(self.svc.state_of(name))
        now = self.clock()
        if state not in (RUNNING, SLEEPING):
            if state not in LIVE_STATES:
                self.last_activity.pop(name, None)
            return
        # A serve running without a request seen (started by hand, or before gpud started)
        # is idle from when it is first seen, or from the end of its last request.
        first = self.last_activity.setdefault(name, now)
        flight = self._flight(name)
        if self.traffic is not None and flight.read_at is None and \
                self.traffic.reachable(spec):
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
        self._idling.add(name)
        try:
            if action == SleepAction.SLEEP:
                await self.sup.sleeps.sleep(name, None, idle_s=idle)
                self.idle_sleeps[name] = self.idle_sleeps.get(name, 0) + 1
            else:
                if self.traffic is None:
                    await self.sup.stop(name, None, idle_s=idle)
                else:
                    with self.traffic.held(name):
                        # nothing in flight by the idle check's count: the drain confirms it
                        drained = await self.traffic.drain(
                            name, spec, self.svc.config.daemon.drain_timeout_s)
                        await self.sup.stop(name, None, idle_s=idle, drained=drained)
                self.idle_stops[name] = self.idle_stops.get(name, 0) + 1
                self.last_activity.pop(name, None)
        except GpudError as exc:
            log.warning("on-demand %s: idle %s refused: %s", name, action, exc.message)
        finally:
            self._idling.discard(name)
