"""On-demand serves: the front asks gpud (nginx's auth_request, before each request to such a
serve) to have the serve up, and gpud admits and starts it, or wakes it, and answers once it
is healthy.

``POST /v1/serves/NAME/ensure`` (gpud.server.api's route, which only the front's user and root may
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
of requests in flight, gpud.life.traffic); never while a request is in flight.

Queued (with a [router]; docs/router.md, "Queue instead of thrash", "Who is asking"; the
decisions are gpud.core.queue's: whether a request joins, who goes next, who is evicted): a
request refused for memory waits in its serve's queue, the ensure held, until the serve is up,
at most router.queue_timeout_s and router.max_queued per serve; one waiting serve at a time makes
room, in the fair order between requesters (each request carries its requester: the key's name,
else the client's address), evicting serves of equal or lower priority that are idle or were
brought up router.min_awake_s ago, the cheapest to bring back first (each serve's wakes and
starts by a request are measured here). Every wait is on `changes` (a state stored, a life's
step, a drain's end, a count of requests in flight read, the queue itself), bounded by the
deadline the queue names: no polling. A waiting request whose asker hung up leaves at once; when
gpud stops, those still waiting are answered (class gpud-stopping), not cut.

Bounded (gpud.core.bringup): after a refused try the next is REFUSAL_HOLD_S later, after a
failure an exponential, capped backoff; requests meanwhile are answered at once, with
``Retry-After`` the seconds left. ``X-Gpud-Reason`` (what the front shows any local user) says
the reason's class only; the 403's body (the front's and root's) the whole error. Refusals of a
bring-up asked for here are stored and logged coalesced (gpud.core.coalesce).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from aiohttp import web

from gpud.core import answers, bringup, demand
from gpud.core.bringup import Hold, Policy, Tries, Why
from gpud.core.coalesce import Coalescer, Verdict
from gpud.core.queue import (
    KEY_PRIORITY,
    MEASURED,
    WEIGHT,
    Arrival,
    Ask,
    EvictionCandidate,
    Freeing,
    Held,
    Histogram,
    Protected,
    QueueRefusal,
    Shares,
    Ticket,
    Waiting,
    after_refusal,
    arrive,
    backfill,
    could_fit,
    evictable,
    expected_wait_s,
    figures_text,
    forget,
    idle_in,
    joined,
    let_through,
    may_evict,
    median_s,
    order,
    places,
    refusal_figures,
    victims,
    waiting_for,
)
from gpud.core.router import ANONYMOUS, RouterRequest
from gpud.core.traffic import Flight, idle_due, idle_due_in, idle_from, settling
from gpud.core.vocab import (
    FAILED,
    LIVE_STATES,
    RUNNING,
    SLEEPING,
    STARTING,
    ServeState,
    SleepAction,
    StepKind,
)
from gpud.errors import Denied, GpudError, NotFound, Unavailable
from gpud.life.pulse import Pulse
from gpud.life.service import COALESCE_REFUSALS, LedgerService
from gpud.life.traffic import refuse_cut
from gpud.nginx.router import wakes_through_router
from gpud.server.responses import error_response

if TYPE_CHECKING:
    from gpud.config import ServeConfig
    from gpud.life.supervisor import Supervisor
    from gpud.life.traffic import Traffic

log = logging.getLogger("gpud.ondemand")

DEFAULT_POLICY = Policy()
# The idle check looks this long after a threshold is due (the clock's rounding).
IDLE_MARGIN_S = 0.05
# A request in the router's queue that is not next tries its serve again without evicting
# anything (memory freed otherwise: a stop, an idle sleep) on a change, at most this often.
QUEUE_RETRY_S = 1.0
# Retry-After of a request answered because gpud stops (it is back within seconds: a restart).
STOPPING_RETRY_S = 5


def _no_share(_requester: str) -> tuple[int, float]:
    return KEY_PRIORITY, WEIGHT


def _retrieve(task: asyncio.Task[None]) -> None:
    """A bring-up's outcome retrieved once it ends: every request that waited on it may have
    timed out."""
    if not task.cancelled():
        task.exception()


class OnDemand:
    def __init__(self, svc: LedgerService, supervisor: Supervisor, *,
                 clock: Callable[[], float] = time.monotonic,
                 traffic: Traffic | None = None, policy: Policy = DEFAULT_POLICY,
                 share: Callable[[str], tuple[int, float]] = _no_share) -> None:
        self.svc = svc
        # A requester's key priority and weight (keys.NAME.priority, .weight; gpud.nginx.router).
        self.share = share
        self.sup = supervisor
        self.clock = clock
        self.traffic = traffic
        self.policy = policy
        # Each serve's on-demand facts (gpud.core.demand: its tries, whether the idle check is
        # putting it away, its last activity and request, when a request last brought it up,
        # what it needed) are in the serve's one record (gpud.life.records): read with
        # `svc.records.demand`, changed only through `svc.records.note_demand`.
        # The refusals' log lines, coalesced by serve and class: (count since, the last text).
        self._refusal_log: Coalescer[tuple[str, Why], str] = Coalescer()
        self._refusal_log_timer: asyncio.TimerHandle | None = None
        # What a request waits on (a sleep or stop settling, a start or wake of someone else's
        # ending) changes only when a serve's state is stored, its life steps, a drain ends or
        # the idle check lets go of it: each fires this (`changed`, wired by gpud.daemon), and
        # the waiters look again then, never on a timer.
        self.changes = Pulse()
        # Idle sleeps and stops carried out since gpud started, by serve (the metrics').
        self.idle_sleeps: dict[str, int] = {}
        self.idle_stops: dict[str, int] = {}
        # The router's queue (gpud.core.queue): each serve's waiting requests, the waiting
        # requesters' fair shares, one swap at a time, and the durations of each serve's last
        # bring-ups by kind (wake, start): the cost of evicting it.
        self.queued: dict[str, list[Ticket]] = {}
        self.shares = Shares()
        # Set when gpud stops: every request still waiting is answered (GPUD_STOPPING).
        self._stopping: asyncio.Future[None] | None = None
        self._swapping: asyncio.Task[Protected | None] | None = None
        # Each waiting serve's turn: the one task that brings it up for its waiting requests.
        self._turns: dict[str, asyncio.Task[None]] = {}
        # The waiting requests in the order they go, as last sorted (None: since changed).
        self._looked: list[Ticket] | None = None
        self.took: dict[str, dict[StepKind, deque[float]]] = {}
        # Evictions for a queued request, by serve (the metrics').
        self.evictions: dict[str, int] = {}
        # The metrics': how long queued requests waited, by serve; the bring-ups by request,
        # by serve and kind, and their durations.
        self.queue_waits: dict[str, Histogram] = {}
        self.bringups: dict[tuple[str, StepKind], Histogram] = {}

    @property
    def tries(self) -> dict[str, Tries]:
        """Each serve's failed or refused bring-ups (gpud.core.bringup), from the records."""
        return {n: r.demand.tries for n, r in self.svc.records.items()
                if r.demand.tries is not None}

    def _requested(self, name: str) -> None:
        """A request through NAME's front, now: its last activity and its last request."""
        now = self.clock()
        self.svc.records.note_demand(
            name, lambda d: replace(d, last_activity=now, last_request=now))

    async def ensure(self, name: str, cause: RouterRequest | None = None,
                     gone: asyncio.Future[None] | None = None) -> web.Response:
        """The answer to the front's `POST /v1/serves/NAME/ensure` (gpud.server.api authorizes it);
        CAUSE: the request through the router that asked, its model, key and requester
        (docs/router.md, "Seeing it", "Who is asking"). GONE: done when the asker hung up (its
        client went: nginx closes the ensure's connection): a request waiting then leaves the
        queue at once. When gpud stops, a request still waiting is answered GPUD_STOPPING with
        Retry-After, never cut."""
        spec = self.svc.serve_spec(name)
        if spec is None or not (spec.on_demand or wakes_through_router(self.svc.config, name)):
            raise NotFound(f"serve {name!r} is not an on_demand serve", {"serve": name})
        self._requested(name)
        try:
            if not await self._unless_ended(self._when_ready_up(name, spec, cause), gone):
                log.info("on-demand %s: the request waiting for it went away (%s)", name,
                         "on-demand request" if cause is None else cause.text)
                return web.Response(status=503)  # nobody reads it
            # its wait for the start is not idle time
            self._requested(name)
        except GpudError as exc:
            return self._refusal(name, exc)
        return web.Response(status=204)

    async def _when_ready_up(self, name: str, spec: ServeConfig,
                             cause: RouterRequest | None) -> None:
        """`up`, once gpud has reconciled the running serves (before that a start could race
        the adoption of running units): a request that comes while gpud starts waits for it,
        at most the serve's start_timeout_s."""
        if not self.svc.ready and self.svc.state_of(name) != RUNNING:
            try:
                async with asyncio.timeout(spec.start_timeout_s):
                    await self.changes.until(lambda: self.svc.ready)
            except TimeoutError:
                raise Unavailable("gpud is starting (reconciling running serves)",
                                  {"serve": name, "retry": True}) from None
        await self.up(name, spec, cause)

    def start_under_way(self, name: str) -> bool:
        """A start of NAME that is not a request's is under way: its state is starting, or its
        launch (a boot's, an operator's) or the health wait of its restart after a crash runs.
        A request waits for it rather than start it again or be refused."""
        life = self.sup.life(name)
        return self.svc.state_of(name) == STARTING or life.launching or life.watching

    async def _unless_ended(self, up: Coroutine[Any, Any, None],
                            gone: asyncio.Future[None] | None) -> bool:
        """Run UP; False when GONE is done first (it is cancelled: a queued request leaves its
        queue, a bring-up it shared goes on). Unavailable (GPUD_STOPPING) when gpud stops."""
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(up)
        ends: set[asyncio.Future[Any]] = {task, self._stopping}
        if gone is not None:
            ends.add(gone)
        done, _ = await asyncio.wait(ends, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()
            return True
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, GpudError):
            await task
        if gone is not None and gone in done:
            return False
        raise Unavailable("gpud is stopping (a restart): the request waited for the serve and "
                          "is answered, not cut; retry", {"class": Why.GPUD_STOPPING,
                                                          "retry_after_s": STOPPING_RETRY_S})

    async def stopping(self) -> None:
        """gpud stops: every request still waiting is answered now (GPUD_STOPPING), before
        the API's listener closes."""
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_future()
        if not self._stopping.done():
            self._stopping.set_result(None)
        await asyncio.sleep(0)  # the waiters' answers begin

    def changed(self) -> None:
        """A serve's state, life or drain changed: the requests waiting on one look again."""
        self._looked = None
        self.changes.fire()

    def settling(self, name: str) -> bool:
        """A sleep or a stop of NAME is under way (or the drain before one, or the idle
        check's decision to): a request must not reach it now."""
        return self.svc.records.demand(name).idling or settling(
            self.sup.life(name).phase,
            self.traffic is not None and self.traffic.draining(name))

    def operator_started(self, name: str) -> None:
        """An operator started the serve (gpuctl start): its backoff is over and starts over."""
        self.svc.records.note_demand(name, demand.operator_started)

    def _held(self, name: str) -> Hold | None:
        """Whether a request for `name` may not try to bring it up now (gpud.core.bringup)."""
        state = self.svc.state_of(name)
        pending = self.sup.bringup(name)
        if state == RUNNING or (pending is not None and not pending.done()):
            return None  # running, or a bring-up under way that this request joins
        now = self.clock()
        rec = self.svc.records.get(name)
        if state == FAILED and rec is not None:
            # its backoff counted from when it failed
            at = now - max(0.0, self.svc.clock() - rec.updated)
            reason = f"{state}: {rec.reason or ''}"
            self.svc.records.note_demand(
                name, lambda d: demand.failed_since(d, at, reason, self.policy))
        return bringup.held(self.svc.records.demand(name).tries, now)

    def _tried(self, name: str, exc: GpudError) -> None:
        """A bring-up of `name` ended without the serve running: when it may be tried next."""
        now = self.clock()
        why = bringup.classify(exc.code, exc.details)
        self.svc.records.note_demand(
            name, lambda d: demand.tried(d, now, why, exc.message, self.policy))

    def _refusal(self, name: str, exc: GpudError) -> web.Response:
        """The 403 the front turns into its 503: the reason's class and Retry-After in the
        headers (what any local user sees), the whole error in the body (the front's and
        root's; nginx's auth_request reads only the headers)."""
        why = _why(exc)
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

    def never_fits(self, name: str) -> str | None:
        """Why serve NAME can never fit as configured (gpud.core.bringup.never_fits)."""
        spec = self.svc.serve_spec(name)
        roles = self.svc.ledger.roles
        if spec is None:
            return None
        return bringup.never_fits(spec.vram_mib, {
            r: roles[r].capacity_mib - roles[r].reserve_mib for r in spec.all_roles if r in roles})

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

    async def up(self, name: str, spec: ServeConfig,
                 cause: RouterRequest | None = None) -> None:
        """Return once NAME is running, bringing it up once for all who wait; within its
        start_timeout_s. A sleep or a stop under way is waited for first. Unavailable at once
        (details.held) while its last try's hold or backoff lasts. With the router's queue: a
        refusal for memory (or a hold after one) waits in the queue instead (`_queued`)."""
        try:
            if await self._up(name, spec, cause) is None:
                return
            first = "requests for other serves wait for memory already"
        except GpudError as exc:
            # one that can never fit does not wait for memory: nothing would ever make room
            if _why(exc) != Why.NO_MEMORY or self.never_fits(name) is not None:
                raise
            need = exc.details.get("need_mib")
            if isinstance(need, int):
                mib: int = need
                self.svc.records.note_demand(name, lambda d: replace(d, need_mib=mib))
            entry = self._entry(name, spec)
            if entry is None:
                raise  # no queue, or no eviction it may make could ever make room
            first = exc.message
        else:
            entry = self._entry(name, spec)
        if isinstance(entry, QueueRefusal):
            raise Unavailable(f"serve {name!r} not brought up: {entry.message}; {first}",
                              {"serve": name, "class": Why(entry.why),
                               "queued": len(self.queued.get(name, ())),
                               "max_queued": entry.max_queued})
        await self._queued(name, spec, cause, first)

    def _entry(self, name: str, spec: ServeConfig) -> Arrival | QueueRefusal | None:
        """Whether a request for NAME refused for memory joins the queue (gpud.core.queue)."""
        router = self.svc.config.router
        if router is None or not self._queues():
            return None  # (the queue's own answer without a queue; the fit is not looked at)
        need = self.svc.records.demand(name).need_mib
        return after_refusal(queue_on=True, no_memory=True,
                             could_fit=need is None or self._could_fit(name, spec, need),
                             queued=len(self.queued.get(name, ())),
                             max_queued=router.max_queued)

    async def _up(self, name: str, spec: ServeConfig, cause: RouterRequest | None = None, *,
                  queued: bool = False) -> Arrival | None:
        """None once NAME is up; Arrival.JOIN: the queue says this request waits its turn."""
        if self.svc.state_of(name) == RUNNING and not self.settling(name):
            return None
        if not spec.on_demand and self.svc.state_of(name) != SLEEPING \
                and not self.start_under_way(name) and not self.settling(name):
            # A serve the router only wakes (or waits for while it starts): started by its
            # operator, not by a request.
            raise Unavailable(f"serve {name!r} is {self.svc.state_of(name)} (not on_demand: "
                              "a request wakes it, gpuctl start starts it)",
                              {"serve": name, "class": Why.STOPPED})
        try:
            async with asyncio.timeout(spec.start_timeout_s):
                await self.changes.until(lambda: not self.settling(name))
                if self.svc.state_of(name) == RUNNING:
                    return None
                task = self.sup.bringup(name)
                if task is not None and task.done():
                    task = None  # ended; its callback, which forgets it, has not run yet
                others = any(self.queued.get(o) for o in self.queued if o != name)
                if not queued and arrive(
                        queue_on=self._queues(), bringing_up=task is not None,
                        others_waiting=others,
                        backfills=others and self._queues() and self._swapping is None
                        and name in self.backfills(also=name)) == Arrival.JOIN:
                    return Arrival.JOIN
                if task is None:
                    # Not tried again before its time (gpud.core.bringup): answered at once.
                    # (nor held while someone else's start of it is under way: it is waited for)
                    hold = None if queued or self.start_under_way(name) else self._held(name)
                    if hold is not None:
                        raise Unavailable(
                            f"serve {name!r} not brought up again for {hold.retry_after_s} s "
                            f"(after {hold.failures} failure(s) in a row)"
                            if hold.why == Why.FAILED else
                            f"serve {name!r} not tried again for {hold.retry_after_s} s", {
                                "serve": name, "class": hold.why,
                                "retry_after_s": hold.retry_after_s, "failures": hold.failures,
                                "last_reason": hold.reason, "held": True})
                    task = asyncio.get_running_loop().create_task(
                        self._bring_up(name, spec, cause, quiet=queued))
                    self.sup.hold_bringup(name, task)
                    task.add_done_callback(_retrieve)
                await asyncio.shield(task)
                return None
        except TimeoutError:
            raise Unavailable(f"serve {name!r} not healthy within its start_timeout_s "
                              f"({spec.start_timeout_s:g} s)", {"serve": name, "timeout": True}
                              ) from None

    async def _bring_up(self, name: str, spec: ServeConfig,
                        cause: RouterRequest | None = None, *, quiet: bool = False) -> None:
        # This task's refusals (and its launch's) are a request's, through the front: stored
        # coalesced (gpud.life.service.COALESCE_REFUSALS; the task runs in a copy of the context).
        COALESCE_REFUSALS.set(True)
        self.svc.records.note_demand(name, demand.began)
        try:
            await self._bring_up_once(name, spec, cause, quiet=quiet)
        except GpudError as exc:
            self._tried(name, exc)
            raise
        now = self.clock()
        self.svc.records.note_demand(name, lambda d: demand.came_up(d, now))

    async def _bring_up_once(self, name: str, spec: ServeConfig,
                             cause: RouterRequest | None = None, *, quiet: bool = False) -> None:
        """QUIET: a try of the queue's (its waiting is told once, `_told_turn`, not each try)."""
        state = self.svc.state_of(name)
        # a request through the router names its model and key (printable: they are logged)
        by = "on-demand request" if cause is None else cause.text
        began = self.clock()
        # measured when this bring-up is the whole of it (not one of someone else's under way)
        kind = StepKind.WAKE if state == SLEEPING else \
            StepKind.START if state not in LIVE_STATES else None
        if state == SLEEPING:
            # A wake preempts as a start does (serves.NAME.preempt): a serve of higher priority
            # gets its GPU back from lower ones that started in the room it left asleep.
            await self.sup.sleeps.wake(name, None, by=by, preempt=spec.preempt)
        elif state not in LIVE_STATES and not self.start_under_way(name):
            log.log(logging.DEBUG if quiet else logging.INFO, "on-demand %s: starting (%s)",
                    name, by)
            # Returns once the launch is over: healthy, or failed with its reason.
            await self.sup.start(name, None, wait=True, preempt=spec.preempt)
        # A start or wake of someone else's (a boot's, an operator's, a restart's after a
        # crash), still under way: its end is a stored state, its failure answered at once.
        await self.changes.until(lambda: self.svc.state_of(name) not in (STARTING, SLEEPING)
                                 and not self.start_under_way(name))
        state = self.svc.state_of(name)
        if state != RUNNING:
            rec = self.svc.records.get(name)
            reason = rec.reason if rec is not None else None
            raise Unavailable(f"serve {name!r} is {state}" + (f": {reason}" if reason else ""),
                              {"serve": name, "state": state})
        if kind is not None:
            self.took.setdefault(name, {}).setdefault(kind, deque(maxlen=MEASURED)).append(
                self.clock() - began)
            self.bringups.setdefault((name, kind), Histogram.empty()).observe(
                self.clock() - began)
            log.info("on-demand %s up (%s): the %s took %.1f s", name, by, kind,
                     self.clock() - began)

    # ---- the router's queue (gpud.core.queue) ---------------------------------------------

    def _queues(self) -> bool:
        r = self.svc.config.router
        return r is not None and r.max_queued > 0

    async def _queued(self, name: str, spec: ServeConfig, cause: RouterRequest | None,
                      first: str) -> None:
        """Wait in NAME's queue until it is running: brought up by this request or another, in
        the queue's fair order (gpud.core.queue.next_up), evicting running serves as it allows.
        Unavailable (class queue-timeout) when it is not up within router.queue_timeout_s."""
        router = self.svc.config.router
        assert router is not None
        requester = cause.requester if cause is not None else ANONYMOUS
        key_priority, weight = self.share(requester)
        ticket = Ticket(name, requester, self.clock(), spec.priority, key_priority=key_priority,
                        weight=weight)
        self.shares = joined(self.shares, requester)
        self.queued.setdefault(name, []).append(ticket)
        self.changed()  # the queue's order changed: who is next may be another
        went = False
        try:
            async with asyncio.timeout(router.queue_timeout_s):
                # shielded: one waiter's timeout or hang-up leaves the serve's turn to the others
                await asyncio.shield(self._turn(name, spec, cause, router.min_awake_s))
            went = True
        except TimeoutError:
            raise Unavailable(f"serve {name!r} not brought up within router.queue_timeout_s "
                              f"({router.queue_timeout_s} s); {first}",
                              {"serve": name, "class": Why.QUEUE_TIMEOUT,
                               "queue_timeout_s": router.queue_timeout_s}) from None
        finally:
            waiting = self.queued.get(name, [])
            waiting.remove(ticket)
            if not waiting:
                self.queued.pop(name, None)
                turn = self._turns.pop(name, None)
                if turn is not None and not turn.done():
                    turn.cancel()  # nobody waits for it any more (a swap under way goes on)
            if went:
                self.shares = let_through(self.shares, ticket)
            self.shares = forget(self.shares, (t.requester for w in self.queued.values()
                                               for t in w))
            self.queue_waits.setdefault(name, Histogram.empty()).observe(
                self.clock() - ticket.arrived)
            self.changed()

    def _turn(self, name: str, spec: ServeConfig, cause: RouterRequest | None,
              min_awake_s: float) -> asyncio.Task[None]:
        """The one task that brings NAME up for all the requests waiting for it (`_wait_turn`):
        a change is looked at once per waiting serve, not once per waiting request."""
        turn = self._turns.get(name)
        if turn is None or turn.done():
            turn = asyncio.get_running_loop().create_task(
                self._told_turn(name, spec, cause, min_awake_s))
            turn.add_done_callback(_retrieve)
            self._turns[name] = turn
        return turn

    def tickets(self) -> list[Ticket]:
        """The waiting requests as the queue ranks them: each serve's priority and whether it
        runs now."""
        serves = self.svc.config.serves
        return [replace(t, priority=serves[n].priority,
                        running=self.svc.state_of(n) == RUNNING)
                for n, w in self.queued.items() if n in serves for t in w]

    def queue_of(self, name: str) -> tuple[list[answers.QueuePlace], float | None,
                                           answers.ServeWaiting | None] | None:
        """Who waits for NAME, in the order they go, the wait to expect from the measured
        bring-ups ahead (gpud.core.queue.places, expected_wait_s), and what it waits for
        (`waiting`); None: nobody waits."""
        tickets = self.tickets()
        mine = places(tickets, self.shares).get(name)
        if mine is None:
            return None
        serves = self.svc.config.serves
        costs = {n: self.cost_s(n, serves[n]) for n in {t.serve for t in tickets}}
        w = self.waiting(name)
        return ([{"requester": p.requester, "waiting": p.waiting, "position": p.position}
                 for p in mine], expected_wait_s(tickets, self.shares, costs).get(name),
                None if w is None else {"requests": w.requests, "reason": w.reason,
                                        "in_s": None if w.in_s is None else round(w.in_s, 1)})

    def ordered(self) -> list[Ticket]:
        """The waiting requests in the order they go (gpud.core.queue.order), sorted once per
        change (every change of what it reads fires `changed`: a stored state, the queue's
        own), not once per waiting serve that looks."""
        if self._looked is None:
            self._looked = order(self.tickets(), self.shares)
        return self._looked

    def _head(self) -> str | None:
        """The serve whose turn it is (gpud.core.queue.next_up: the first in `ordered`)."""
        first = self.ordered()
        return first[0].serve if first else None

    async def _told_turn(self, name: str, spec: ServeConfig, cause: RouterRequest | None,
                         min_awake_s: float) -> None:
        """`_wait_turn`, with one journal line when NAME begins to wait and one when it is up,
        its requests are refused, or none waits any more; never one per try."""
        began = self.clock()
        said = self.waiting(name)
        fields = {"journal": {"GPUD_SERVE": name, "GPUD_EVENT": "queue"}}
        log.info("on-demand %s: waiting for memory: %s", name,
                 said.text() if said is not None else "its requests wait", extra=fields)

        def count() -> str:
            n = len(self.queued.get(name, ()))
            return f"{n} request{'s' if n != 1 else ''}"
        try:
            await self._wait_turn(name, spec, cause, min_awake_s)
        except asyncio.CancelledError:
            log.info("on-demand %s: no request waits for it any more (after %.1f s)", name,
                     self.clock() - began, extra=fields)
            raise
        except GpudError as exc:
            log.warning("on-demand %s: the %s waiting for it refused after %.1f s: %s", name,
                        count(), self.clock() - began, exc.message, extra=fields)
            raise
        log.info("on-demand %s: up after %.1f s waiting for memory (%s)", name,
                 self.clock() - began, count(), extra=fields)

    async def _wait_turn(self, name: str, spec: ServeConfig, cause: RouterRequest | None,
                         min_awake_s: float) -> None:
        """Wait for NAME to run, for every request waiting for it: at its turn (the head of
        the queue) it tries and evicts as the queue allows; before it only when it backfills.
        Each wait ends on the next change (a state stored, a life's step, a drain's end, a
        count of requests in flight read, the queue's own) or the next deadline, whichever is
        first: a retry that the last try's QUEUE_RETRY_S held off, or what the queue's decision
        names (Protected.wait_s: a victim's min_awake_s ending, an idle time to come). A change
        that comes while a try is held off is tried at the hold's end, never lost."""
        tried = self.clock()  # the refusal that made the first request wait was a try
        while not (self.svc.state_of(name) == RUNNING and not self.settling(name)):
            task = self.sup.bringup(name)
            if task is not None and not task.done():  # under way: the waiters share it
                try:
                    await asyncio.shield(task)
                except GpudError as exc:
                    if _why(exc) != Why.NO_MEMORY:
                        raise
                # (a done task is held until its callback runs: never loop on it
                # without yielding)
                await asyncio.sleep(0)
                continue
            wait_s = math.inf
            held_s = tried + QUEUE_RETRY_S - self.clock()  # > 0: the last try was just now
            if self._swapping is not None:
                pass  # another serve's swap: its end is a change
            elif self._head() == name:
                if held_s <= 0:
                    tried = self.clock()
                # One swap at a time, in a task of its own: a request that goes away (its
                # client gone, its queue_timeout_s over) does not cut an eviction short.
                swap = asyncio.get_running_loop().create_task(
                    self._swap_in(name, spec, cause, min_awake_s, try_first=held_s <= 0))
                self._swapping = swap
                swap.add_done_callback(self._swapped)
                outcome = await asyncio.shield(swap)
                if outcome is None:
                    continue
                wait_s = outcome.wait_s if held_s <= 0 else min(outcome.wait_s, held_s)
            elif name in self.backfills():
                # memory freed otherwise (a stop, an idle sleep), and none the head of the
                # queue needs at its earliest start: try again without evicting (backfill)
                if held_s > 0:
                    wait_s = held_s
                else:
                    tried = self.clock()
                    if await self._try_up(name, spec, cause):
                        return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(None if math.isinf(wait_s) else wait_s):
                    await self.changes.next()

    def backfills(self, also: str | None = None) -> list[str]:
        """The waiting serves that may come up now without evicting anything and without taking
        memory the head of the queue needs at its earliest start (gpud.core.queue.backfill),
        the queue in its fair order; ALSO: a serve a request arrives for, after them."""
        serves = self.svc.config.serves
        names = [t.serve for t in self.ordered() if not t.running]
        if also is not None:
            names.append(also)
        names = [n for n in dict.fromkeys(names) if n in serves]
        asks = [self._ask(n, serves[n]) for n in names]
        roles = {r for n in names for r in serves[n].all_roles}
        # each role's free MiB before any of them is brought up: what an admission of each
        # could get, less what it holds already (the least of them: the strict bound's)
        free = {r: min(self.svc.free_for(n, r) - self._holds(n, r) for n in names
                       if r in serves[n].all_roles) for r in roles}
        return backfill(asks, free)

    def _holds(self, name: str, role: str) -> int:
        res = self.svc.ledger.reservations.get(name)
        return res.mib if res is not None and role in res.all_roles else 0

    def _ask(self, name: str, spec: ServeConfig) -> Ask:
        """NAME as the backfill sees it: what its bring-up adds on each of its roles (a sleeping
        serve wakes to its awake reservation), and what each serve it may evict would free on
        each role, once it may evict it (router.min_awake_s, the idle time)."""
        router = self.svc.config.router
        min_awake_s = router.min_awake_s if router is not None else 0.0
        need = self.sup.sleeps.awake_mib(name, spec) \
            if self.svc.state_of(name) == SLEEPING else spec.vram_mib
        takes = {r: need - self._holds(name, r) for r in spec.all_roles}
        frees = []
        for h in self._running_beside(name, spec):
            # as `victims` takes them: evictable at its min_awake_s, or once idle if sooner
            awake_s = evictable(h, spec.priority, min_awake_s)
            in_s = min(awake_s, idle_in(h))
            res = self.svc.ledger.reservations.get(h.serve)
            if res is None or math.isinf(awake_s):
                continue
            o = self.svc.config.serves[h.serve]
            keeps = self.sup.sleeps.sleep_mib(h.serve, o) if o.sleep_level else 0
            mib = res.mib - (res.mib if keeps is None else min(keeps, res.mib))
            why = "min_awake_s" if in_s == awake_s and awake_s > 0 else "idle time"
            frees += [Freeing(r, mib, in_s, h.serve, why) for r in res.all_roles if r in takes]
        return Ask(name, takes, tuple(frees))

    def waiting(self, name: str) -> Waiting | None:
        """What NAME, with requests waiting for memory, waits for and until when
        (gpud.core.queue.waiting_for); None: no request waits for it."""
        tickets = self.queued.get(name)
        spec = self.svc.config.serves.get(name)
        if not tickets or spec is None:
            return None
        free = {r: self.svc.free_for(name, r) - self._holds(name, r) for r in spec.all_roles}
        return waiting_for(self._ask(name, spec), free, requests=len(tickets),
                           head=self._head())

    def _swapped(self, task: asyncio.Task[Protected | None]) -> None:
        if self._swapping is task:
            self._swapping = None
        if not task.cancelled():
            task.exception()  # retrieved here: its request may have gone
        self.changed()  # the next swap may begin

    async def _swap_in(self, name: str, spec: ServeConfig, cause: RouterRequest | None,
                       min_awake_s: float, *, try_first: bool) -> Protected | None:
        """NAME's turn: try it (`try_first`: its last try was a while ago); while it does not
        fit, evict the first victim the queue allows and try again. None: it is up; else no
        victim now (the request waits on, at most Protected.wait_s)."""
        if try_first and await self._try_up(name, spec, cause):
            return None
        while True:
            chosen = victims(self._running_beside(name, spec), name, spec.priority, min_awake_s)
            if not isinstance(chosen, list):
                return chosen
            refused = await self._evict(chosen[0], name, cause)
            if refused is not None:
                return refused
            if await self._try_up(name, spec, cause):
                return None

    async def _try_up(self, name: str, spec: ServeConfig, cause: RouterRequest | None) -> bool:
        """Bring NAME up for the queue: False when it does not fit (other errors raised)."""
        try:
            await self._up(name, spec, cause, queued=True)
        except GpudError as exc:
            if _why(exc) != Why.NO_MEMORY:
                raise
            return False
        return True

    @staticmethod
    def _candidate(name: str, o: ServeConfig) -> EvictionCandidate:
        return EvictionCandidate(name, o.priority, o.on_demand,
                         bool(o.sleep_level or o.preemptible == SleepAction.STOP))

    def _could_fit(self, name: str, spec: ServeConfig, need: int) -> bool:
        """Whether NAME (needing NEED MiB on each of its roles) would fit were every serve
        the queue may evict for it evicted (gpud.core.queue.could_fit): else waiting is
        pointless."""
        for role in spec.all_roles:
            freed = []
            for other, o in self.svc.config.serves.items():
                res = self.svc.ledger.reservations.get(other)
                # any that holds memory: running, starting, or being evicted now (it frees
                # what it holds once stopped); one asleep frees nothing more
                if other == name or res is None or role not in res.all_roles \
                        or self.svc.state_of(other) == SLEEPING \
                        or not may_evict(spec.priority, self._candidate(other, o)):
                    continue
                keeps = self.sup.sleeps.sleep_mib(other, o) if o.sleep_level else 0
                freed.append(res.mib - (res.mib if keeps is None else min(keeps, res.mib)))
            if not could_fit(need, self.svc.free_for(name, role), freed):
                return False
        return True

    def _running_beside(self, name: str, spec: ServeConfig) -> list[Held]:
        """The running serves on NAME's roles that a request may evict (may_evict); none
        being brought up, put to sleep or stopped."""
        now = self.clock()
        roles = set(spec.all_roles)
        out = []
        for other, o in self.svc.config.serves.items():
            if (other == name or self.svc.state_of(other) != RUNNING
                    or self.sup.bringup(other) is not None or self.settling(other)
                    or not roles & set(o.all_roles)):
                continue
            if not may_evict(spec.priority, self._candidate(other, o)):
                continue
            up_at = self.svc.records.demand(other).up_at
            out.append(Held(other, o.priority, self.in_flight(other), self.activity_s_ago(other),
                            None if up_at is None else now - up_at, self.cost_s(other, o)))
        return out

    def cost_s(self, name: str, spec: ServeConfig) -> float | None:
        """What bringing NAME back would take: the median of its last wakes when it can sleep,
        else of its last starts (None: none measured since gpud started)."""
        return self.bringup_s(name, StepKind.WAKE if spec.sleep_level else StepKind.START)

    def bringup_s(self, name: str, kind: StepKind) -> float | None:
        """The median of NAME's last measured bring-ups of KIND (gpud.core.queue.MEASURED)."""
        return median_s(self.took.get(name, {}).get(kind, ()))

    async def _evict(self, victim: str, name: str,
                     cause: RouterRequest | None) -> Protected | None:
        """Put VICTIM to sleep (when it can sleep) or stop it, for a queued request for NAME;
        its requests in flight are drained first, new ones wait (settling). A request still in
        flight at the drain's bound is never cut for another's: the eviction is refused then.
        None: evicted; else how long the queue waits before it looks again (refused, logged):
        a busy victim on the next change of its count (or another change), any other refusal
        QUEUE_RETRY_S."""
        vspec = self.svc.config.serves[victim]
        by = f"serve {name}" if cause is None else f"serve {name} ({cause.text})"
        log.info("on-demand %s: evicted for %s", victim, by,
                 extra={"journal": {"GPUD_SERVE": victim, "GPUD_FOR": name}})
        self.svc.records.note_demand(victim, lambda d: replace(d, idling=True))
        try:
            if vspec.sleep_level:
                await self.sup.sleeps.sleep(victim, None, preempted_by=name,
                                            uncut=self.traffic is not None)
            elif self.traffic is None:
                await self.sup.stop(victim, None)
            else:
                with self.traffic.held(victim):
                    drained = await self.traffic.drain(
                        victim, vspec, self.svc.config.daemon.drain_timeout_s)
                    refuse_cut(victim, drained)
                    await self.sup.stop(victim, None, drained=drained)
        except GpudError as exc:
            log.warning("on-demand %s: eviction for %s refused: %s", victim, name, exc.message,
                        extra={"journal": {"GPUD_SERVE": victim, "GPUD_FOR": name}})
            if exc.details.get("busy"):
                return Protected(math.inf, exc.message)
            return Protected(QUEUE_RETRY_S, f"the eviction of {victim} was refused")
        finally:
            self.svc.records.note_demand(victim, lambda d: replace(d, idling=False))
            self.changed()
        self.evictions[victim] = self.evictions.get(victim, 0) + 1
        self.svc.records.note_demand(victim, lambda d: replace(d, up_at=None))
        return None

    def _flight(self, name: str) -> Flight:
        return self.traffic.flight(name) if self.traffic is not None else Flight()

    def activity_s_ago(self, name: str) -> float | None:
        """Seconds since NAME's last request ended (0 while one is in flight): the later of
        the last request through its front (an on-demand serve's ensure) and the end of the
        last request it counted; None when neither is known since gpud started."""
        flight = self._flight(name)
        if flight.in_flight:
            return 0.0
        last = idle_from(self.svc.records.demand(name).last_request, flight)
        return None if last is None else round(max(0.0, self.clock() - last), 1)

    def in_flight(self, name: str) -> int | None:
        """The requests in flight on NAME as it last counted them (None: unknown)."""
        return self._flight(name).in_flight

    # ---- idle ------------------------------------------------------------------------------

    async def idle_loop(self) -> None:
        """Put to sleep or stop the on-demand serves idle past idle_sleep_s / idle_stop_s.
        Waits on changes (a state stored, a count of requests in flight read, a drain's end)
        or until the first idle threshold ahead, never on a fixed tick."""
        while True:
            for name, spec in self.svc.config.serves.items():
                if spec.on_demand and self.sup.bringup(name) is None:
                    await self._idle_check(name, spec)
            wait_s = self._idle_due_in()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(None if wait_s is None else wait_s + IDLE_MARGIN_S):
                    await self.changes.next()

    def _idle_due_in(self) -> float | None:
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

    async def _idle_check(self, name: str, spec: ServeConfig) -> None:
        state = ServeState(self.svc.state_of(name))
        now = self.clock()
        if state not in (RUNNING, SLEEPING):
            if state not in LIVE_STATES:
                self.svc.records.note_demand(name, lambda d: replace(d, last_activity=None))
            return
        # A serve running without a request seen (started by hand, or before gpud started)
        # is idle from when it is first seen, or from the end of its last request.
        first = self.svc.records.demand(name).last_activity
        if first is None:
            first = now
            self.svc.records.note_demand(name, lambda d: replace(d, last_activity=now))
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
        self.svc.records.note_demand(name, lambda d: replace(d, idling=True))
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
                self.svc.records.note_demand(name, lambda d: replace(d, last_activity=None))
        except GpudError as exc:
            log.warning("on-demand %s: idle %s refused: %s", name, action, exc.message)
        finally:
            self.svc.records.note_demand(name, lambda d: replace(d, idling=False))
            self.changed()


def _why(exc: GpudError) -> Why:
    """The class of a refusal (gpud.core.bringup.refusal_class)."""
    return bringup.refusal_class(exc.code, exc.details)
