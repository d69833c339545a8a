"""On-demand serves: the front asks gpud (nginx's auth_request, before each request to such a
serve) to have the serve up, and gpud admits and starts it, or wakes it, and answers once it
is healthy.

``POST /v1/serves/NAME/ensure`` answers 204 when the serve is running (at once when it already
is), 403 with ``X-Gpud-Reason`` (the error as JSON) and ``Retry-After`` when it cannot be
brought up: the front turns that into a 503 with the reason as its body. Concurrent requests
for one serve share one start (or wake). Only the front's user (and root) may call it: the
route is outside the usual read/admin split, so its handler checks the peer's uid itself
(SO_PEERCRED, as every route's authorization does), and it is refused on the TCP metrics
listener, where no peer is known.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import pwd
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from aiohttp import web

from gpud.core.front import RETRY_AFTER_S, idle_action
from gpud.core.vocab import LIVE_STATES, RUNNING, SLEEPING, STARTING, ServeState, SleepAction
from gpud.errors import BadRequest, Forbidden, GpudError, NotFound, Unavailable
from gpud.service import LedgerService, check_serve_name

if TYPE_CHECKING:
    from gpud.api import Api, Peer
    from gpud.config import ServeConfig
    from gpud.supervisor import Supervisor

log = logging.getLogger(__name__)

# How often a start or wake in progress is looked at until the serve is running.
POLL_S = 0.005
# How often idle serves are looked for.
IDLE_CHECK_S = 0.5


@functools.lru_cache(maxsize=8)
def _uid_of(user: str) -> int | None:
    """The front user's uid, looked up once per name: every request to an on-demand serve
    asks, and a read of the passwd database each time would add to its latency."""
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        return None


class OnDemand:
    def __init__(self, svc: LedgerService, supervisor: Supervisor, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.svc = svc
        self.sup = supervisor
        self.clock = clock
        self._pending: dict[str, asyncio.Task[None]] = {}
        # The last request through each on-demand serve's front (the clock's time).
        self.last_activity: dict[str, float] = {}

    def routes(self, api: Api) -> None:
        api.route("POST", "/v1/serves/{name}/ensure", self.ensure, "public")

    def _authorize(self, peer: Peer | None) -> None:
        user = self.svc.config.daemon.front_user
        if peer is None or peer.uid not in (0, _uid_of(user)):
            uid = peer.uid if peer else None
            raise Forbidden(f"uid {uid}: only the front ({user}) and root may ensure a serve",
                            {"uid": uid})

    async def ensure(self, request: web.Request) -> web.Response:
        self._authorize(request.get("peer"))
        name = request.match_info["name"]
        check_serve_name(name)
        spec = self.svc.serve_spec(name)
        if spec is None or not spec.on_demand:
            raise NotFound(f"serve {name!r} is not an on_demand serve", {"serve": name})
        self.last_activity[name] = self.clock()
        try:
            if not self.svc.ready and self.svc.state_of(name) != RUNNING:
                # Before reconciliation a start could race the adoption of running units.
                raise Unavailable("gpud is starting (reconciling running serves)",
                                  {"serve": name, "retry": True})
            await self.up(name, spec)
            self.last_activity[name] = self.clock()
        except (Forbidden, BadRequest, NotFound):
            raise
        except GpudError as exc:
            log.warning("on-demand %s not brought up: %s", name, exc.message)
            return web.Response(status=403, headers={
                "X-Gpud-Reason": json.dumps(exc.to_json()),
                "Retry-After": str(RETRY_AFTER_S)})
        return web.Response(status=204)

    async def up(self, name: str, spec: ServeConfig) -> None:
        """Return once NAME is running, bringing it up once for all who wait; within its
        start_timeout_s."""
        if self.svc.state_of(name) == RUNNING:
            return
        task = self._pending.get(name)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._bring_up(name, spec))
            self._pending[name] = task
            task.add_done_callback(lambda t: self._done(name, t))
        try:
            async with asyncio.timeout(spec.start_timeout_s):
                await asyncio.shield(task)
        except TimeoutError:
            raise Unavailable(f"serve {name!r} not healthy within its start_timeout_s "
                              f"({spec.start_timeout_s:g} s)", {"serve": name}) from None

    def _done(self, name: str, task: asyncio.Task[None]) -> None:
        if self._pending.get(name) is task:
            del self._pending[name]
        if not task.cancelled():
            task.exception()  # retrieved here: every waiter may have timed out

    async def _bring_up(self, name: str, spec: ServeConfig) -> None:
        state = self.svc.state_of(name)
        if state == SLEEPING:
            await self.sup.sleeps.wake(name, None, by="on-demand request")
        elif state not in LIVE_STATES:
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
        # is idle from when it is first seen.
        last = self.last_activity.setdefault(name, now)
        action = idle_action(state, now - last, idle_sleep_s=spec.idle_sleep_s,
                             idle_stop_s=spec.idle_stop_s, sleep_level=spec.sleep_level)
        if action is None:
            return
        idle = now - last
        # The sleep or stop records its own event (kind sleep / stop, by gpud: uid none).
        log.info("on-demand %s idle for %.1f s without a request through its front: %s",
                 name, idle, action)
        try:
            if action == SleepAction.SLEEP:
                await self.sup.sleeps.sleep(name, None)
            else:
                await self.sup.stop(name, None)
                self.last_activity.pop(name, None)
        except GpudError as exc:
            log.warning("on-demand %s: idle %s refused: %s", name, action, exc.message)
