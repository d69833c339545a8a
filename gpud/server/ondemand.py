"""The HTTP answer of on-demand serves: the front asks gpud (nginx's auth_request, before each
request to such a serve) to have the serve up; the orchestrator (gpud.life.ondemand) admits and
starts it, or wakes it, or queues the request, and this answers once it is healthy, or turns its
refusal into the response the front reads.

``POST /v1/serves/NAME/ensure`` (gpud.server.api's route, which only the front's user and root may
call) answers 204 when the serve is running (at once when it already
is), 403 with ``X-Gpud-Reason`` (the error as JSON) and ``Retry-After`` when it cannot be
brought up: the front turns that into a 503 with the reason as its body (or, once a stream has
begun with loading feedback, an error event in it).

``X-Gpud-Reason`` (what the front shows any local user) says the reason's class only; the 403's
body (the front's and root's) the whole error. Refusals of a bring-up asked for here are logged
coalesced (gpud.core.coalesce): a flood of requests is not a flood of lines.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from aiohttp import web

from gpud.core import bringup
from gpud.core.bringup import Policy, Why
from gpud.core.coalesce import Coalescer, Verdict
from gpud.core.queue import figures_text, refusal_figures
from gpud.core.router import RouterRequest
from gpud.errors import Denied, GpudError, NotFound, Unavailable
from gpud.life.ondemand import (
    DEFAULT_POLICY,
    QUEUE_RETRY_S,
    STOPPING_RETRY_S,
    Orchestrator,
    no_share,
)
from gpud.server.responses import error_response

if TYPE_CHECKING:
    from gpud.life.service import LedgerService
    from gpud.life.supervisor import Supervisor
    from gpud.life.traffic import Traffic

__all__ = ["QUEUE_RETRY_S", "OnDemand"]

log = logging.getLogger("gpud.ondemand")


class OnDemand(Orchestrator):
    """The orchestrator (gpud.life.ondemand), answering the front."""

    def __init__(self, svc: LedgerService, supervisor: Supervisor, *,
                 clock: Callable[[], float] = time.monotonic,
                 traffic: Traffic | None = None, policy: Policy = DEFAULT_POLICY,
                 share: Callable[[str], tuple[int, float]] = no_share) -> None:
        super().__init__(svc, supervisor, clock=clock, traffic=traffic, policy=policy,
                         share=share)
        # The refusals' log lines, coalesced by serve and class: (count since, the last text).
        self._refusal_log: Coalescer[tuple[str, Why], str] = Coalescer()
        self._refusal_log_timer: asyncio.TimerHandle | None = None

    async def ensure(self, name: str, cause: RouterRequest | None = None,
                     gone: asyncio.Future[None] | None = None) -> web.Response:
        """The answer to the front's `POST /v1/serves/NAME/ensure` (gpud.server.api authorizes it);
        CAUSE: the request through the router that asked, its model, key and requester
        (docs/router.md, "Seeing it", "Who is asking"). GONE: done when the asker hung up (its
        client went: nginx closes the ensure's connection): a request waiting then leaves the
        queue at once. When gpud stops, a request still waiting is answered GPUD_STOPPING with
        Retry-After, never cut."""
        try:
            if not await self.bring(name, cause, gone):
                return web.Response(status=503)  # nobody reads it
        except GpudError as exc:
            if isinstance(exc, NotFound):
                raise
            return self._refusal(name, exc)
        return web.Response(status=204)


    def _refusal(self, name: str, exc: GpudError) -> web.Response:
        """The 403 the front turns into its 503: the reason's class and Retry-After in the
        headers (what any local user sees), the whole error in the body (the front's and
        root's; nginx's auth_request reads only the headers)."""
        why = bringup.refusal_class(exc.code, exc.details)
        hold = bringup.held(self.svc.records.demand(name).tries, self.clock())
        retry = STOPPING_RETRY_S if why == Why.GPUD_STOPPING else hold.retry_after_s \
            if hold is not None else max(1, math.ceil(self.policy.refusal_hold_s))
        never = self.never_fits(name) if why == Why.NO_MEMORY else None
        if never is not None:  # the operator's error and journal line: with the figures
            exc = Denied(f"{exc.message}; can never fit as configured: {never}",
                         {**exc.details, "never_fits": True})
        self._log_refusal(name, why, exc.message)
        resp = error_response(exc)
        resp.set_status(403)
        # a queue refusal names its limit's figure (max_queued, queue_timeout_s): the config's,
        # never another request's or serve's
        figures = refusal_figures(why, exc.details)
        public = {"error": {"code": Denied.code if why == Why.NO_MEMORY else Unavailable.code,
                            "message": bringup.public_reason(name, why, retry,
                                                             figures_text(figures),
                                                             never=never is not None),
                            "details": {"serve": name, "class": why, "retry_after_s": retry,
                                        **figures}}}
        resp.headers["X-Gpud-Reason"] = json.dumps(public)
        resp.headers["Retry-After"] = str(retry)
        return resp

    def _log_refusal(self, name: str, why: Why, message: str) -> None:
        """One journal line per serve and class per window (gpud.core.coalesce), carrying the
        count of those it stands for: a flood of requests is not a flood of lines."""
        now = self.clock()
        self._flush_refusal_log(now)
        if self._refusal_log.offer((name, why), message, now) == Verdict.STORE:
            log.warning("on-demand %s not brought up: %s", name, message)
            return
        if self._refusal_log_timer is None:
            due = self._refusal_log.next_due()
            if due is not None:
                def fire() -> None:
                    self._refusal_log_timer = None
                    self._flush_refusal_log(self.clock())
                self._refusal_log_timer = asyncio.get_running_loop().call_later(
                    max(0.0, due - now) + 0.01, fire)

    def _flush_refusal_log(self, now: float) -> None:
        for s in self._refusal_log.due(now):
            name, why = s.key
            log.warning("on-demand %s not brought up %d more time(s) in %g s (%s), the last: %s",
                        name, s.count, s.window_s, why, s.last,
                        extra={"journal": {"GPUD_SERVE": name, "GPUD_REPEATED": s.count,
                                           "GPUD_CLASS": str(why)}})
