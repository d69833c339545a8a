"""The on-demand orchestrator: a request through the front (nginx's auth_request, before each
request to an on-demand serve, or one the router wakes) has its serve brought up, or woken, and
waits until it is healthy; requests refused for memory wait in the router's queue for their turn,
evicting as the queue allows; idle serves are put to sleep or stopped (gpud.life.idle). The
decisions are the pure core's (gpud.core.bringup: when a serve may be tried again and the class
of a refusal; gpud.core.queue: whether a request goes now, waits in the queue or is refused, who
goes next, who is evicted); this carries them out and holds the waits. What it reads of the
serves is gpud.life.demandview's, what it has done is counted in gpud.life.counts; the HTTP
answer to the front (gpud.server.ondemand) turns its outcome, or its refusal, into a response.

Concurrent requests for one serve share one start (or wake).

Ordered with sleeps and stops: while the serve is being put to sleep or stopped (the lifecycle's
phase falling-asleep or stopping, gpud.core.lifecycle; or drained before one, or about to be
by the idle check), a request waits for that to end and then wakes or starts the serve: the
serve stays `running` until a sleep commits, and nothing must be forwarded into an engine that
is going to sleep or away.

Queued (with a [router]; docs/router.md, "Queue instead of thrash", "Who is asking"): a request
refused for memory waits in its serve's queue, the ensure held, until the serve is up, at most
router.queue_timeout_s and router.max_queued per serve; one waiting serve at a time makes room,
in the fair order between requesters (each request carries its requester: the key's name, else
the client's address), evicting serves of equal or lower priority that are idle or were brought
up router.min_awake_s ago, the cheapest to bring back first (each serve's wakes and starts by a
request are measured here). Every wait is on `changes` (a state stored, a life's step, a drain's
end, a count of requests in flight read, the queue itself), bounded by the deadline the queue
names: no polling. A change names the serves it concerns and wakes only the waiters it can
concern (`changed`): those of the serves sharing a role with them, and those the queue now
lets go (its head, the serves that backfill). A waiting request whose asker hung up leaves at
once; when gpud stops, those still waiting are answered (class gpud-stopping), not cut.

Bounded (gpud.core.bringup): after a refused try the next is REFUSAL_HOLD_S later, after a
failure an exponential, capped backoff; requests meanwhile are refused at once (details.held).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable, Collection, Coroutine
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from gpud.config import routed
from gpud.core import answers
from gpud.core.bringup import Hold, Policy, Tries, Why, classify, held, refusal_class
from gpud.core.demand import (
    BringupBegan,
    CameUp,
    Idling,
    NeedMib,
    OperatorStarted,
    Requested,
    SeenFailed,
    Tried,
    UpAt,
)
from gpud.core.launch import tells_abort
from gpud.core.queue import (
    KEY_PRIORITY,
    WEIGHT,
    Arrival,
    Next,
    Protected,
    Shares,
    Ticket,
    Waiting,
    admit,
    arrive,
    backfill,
    expected_wait_s,
    forget,
    joined,
    let_through,
    may_cut,
    order,
    places,
    victims,
    waiting_for,
)
from gpud.core.router import ANONYMOUS, RouterRequest
from gpud.core.vocab import FAILED, LIVE_STATES, RUNNING, SLEEPING, STARTING, StepKind
from gpud.errors import GpudError, NotFound, Unavailable
from gpud.life.demandview import DemandView
from gpud.life.idle import IdleCheck
from gpud.life.pulse import Wakeups
from gpud.life.traffic import drain_and_stop
from gpud.life.writes import COALESCE_REFUSALS

if TYPE_CHECKING:
    from gpud.config import ServeConfig
    from gpud.life.service import LedgerService
    from gpud.life.supervisor import Supervisor
    from gpud.life.traffic import Traffic

log = logging.getLogger("gpud.ondemand")

DEFAULT_POLICY = Policy()
# A request in the router's queue that is not next tries its serve again without evicting
# anything (memory freed otherwise: a stop, an idle sleep) on a change, at most this often.
QUEUE_RETRY_S = 1.0
# Retry-After of a request answered because gpud stops (it is back within seconds: a restart).
STOPPING_RETRY_S = 5


@dataclass(frozen=True, slots=True)
class EvictionRefused(Protected):
    """A victim's eviction was refused: the changes its attempt made (its drain's end, its
    life's steps) are its own, not a reason to evict it again at once."""


def no_share(_requester: str) -> tuple[int, float]:
    return KEY_PRIORITY, WEIGHT


def _retrieve(task: asyncio.Task[None]) -> None:
    """A bring-up's outcome retrieved once it ends: every request that waited on it may have
    timed out."""
    if not task.cancelled():
        task.exception()


def _why(exc: GpudError) -> Why:
    """The class of a refusal (gpud.core.bringup.refusal_class)."""
    return refusal_class(exc.code, exc.details)


class Orchestrator(DemandView):
    def __init__(self, svc: LedgerService, supervisor: Supervisor, *,
                 clock: Callable[[], float] = time.monotonic,
                 traffic: Traffic | None = None, policy: Policy = DEFAULT_POLICY,
                 share: Callable[[str], tuple[int, float]] = no_share) -> None:
        super().__init__(svc, supervisor, clock=clock, traffic=traffic)
        # A requester's key priority and weight (keys.NAME.priority, .weight; gpud.nginx.router).
        self.share = share
        self.policy = policy
        # Each serve's on-demand facts (gpud.core.demand: its tries, whether the idle check is
        # putting it away, its last activity and request, when a request last brought it up,
        # what it needed) are in the serve's one record (gpud.life.records): read with
        # `svc.records.demand`, changed only by their events (gpud.core.demand) through
        # `svc.records.apply`.
        # What a request waits on (a sleep or stop settling, a start or wake of someone else's
        # ending) changes only when a serve's state is stored, its life steps, a drain ends or
        # the idle check lets go of it: each fires this (`changed`, wired by gpud.daemon, naming
        # the serve), and the waiters look again then, never on a timer: each serve's waiters
        # on their own pulse, woken by a change on one of their roles (gpud.life.pulse).
        self.changes = Wakeups(lambda: self.svc.config.serves)
        # The router's queue (gpud.core.queue): each serve's waiting requests, the waiting
        # requesters' fair shares, one swap at a time.
        self.queued: dict[str, list[Ticket]] = {}
        self.shares = Shares()
        # Set when gpud stops: every request still waiting is answered (GPUD_STOPPING).
        self._stopping: asyncio.Future[None] | None = None
        self._swapping: asyncio.Task[Protected | None] | None = None
        # Each waiting serve's turn: the one task that brings it up for its waiting requests.
        self._turns: dict[str, asyncio.Task[None]] = {}
        # The waiting requests in the order they go, as last sorted (None: since changed).
        self._looked: list[Ticket] | None = None
        # ... and the serves not running among them, each once, in that order (with `_looked`).
        self._to_bring: list[str] = []
        # The waiting serves the queue let go at its last look (its head, those that backfill:
        # `_look_again`), the look due (a change since), and whether it wakes them all (a swap
        # ended: they may go now) but the serve whose swap it was (`_swapper`).
        self._acting: frozenset[str] = frozenset()
        self._look: asyncio.Handle | None = None
        self._swap_ended: tuple[str | None] | None = None
        self._swapper: str | None = None
        self._idle = IdleCheck(self, self.changes, self.changed)

    @property
    def tries(self) -> dict[str, Tries]:
        """Each serve's failed or refused bring-ups (gpud.core.bringup), from the records."""
        return {n: r.demand.tries for n, r in self.svc.records.items()
                if r.demand.tries is not None}

    def _requested(self, name: str) -> None:
        """A request through NAME's front, now: its last activity and its last request."""
        now = self.clock()
        self.svc.records.apply(name, Requested(now))

    async def bring(self, name: str, cause: RouterRequest | None = None,
                    gone: asyncio.Future[None] | None = None) -> bool:
        """Have NAME up for a request through its front: True once it runs; False when GONE
        was done first (the asker hung up: a request waiting then leaves the queue at once).
        CAUSE: the request through the router that asked, its model, key and requester. The
        refusal raised (GpudError) otherwise: when gpud stops, a request still waiting is
        refused GPUD_STOPPING, never cut. NotFound: NAME is not a serve a request brings up."""
        spec = self.svc.serve_spec(name)
        if spec is None or not (spec.on_demand or name in routed(self.svc.config)):
            raise NotFound(f"serve {name!r} is neither an on_demand serve nor one the router "
                           "reaches", {"serve": name})
        self._requested(name)
        if not await self._unless_ended(self._when_ready_up(name, spec, cause), gone):
            log.info("on-demand %s: the request waiting for it went away (%s)", name,
                     "on-demand request" if cause is None else cause.text)
            return False
        # its wait for the start is not idle time
        self._requested(name)
        return True

    async def _when_ready_up(self, name: str, spec: ServeConfig,
                             cause: RouterRequest | None) -> None:
        """`up`, once gpud has reconciled the running serves (before that a start could race
        the adoption of running units): a request that comes while gpud starts waits for it,
        at most the serve's start_timeout_s."""
        if not self.svc.ready and self.svc.state_of(name) != RUNNING:
            try:
                async with asyncio.timeout(spec.start_timeout_s):
                    await self.changes.of(name).until(lambda: self.svc.ready)
            except TimeoutError:
                raise Unavailable("gpud is starting (reconciling running serves)",
                                  {"serve": name, "retry": True}) from None
        await self.up(name, spec, cause)

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

    def changed(self, serves: Collection[str] | None = None) -> None:
        """The state, life, drain or count of requests in flight of SERVES changed (None: of
        anything: gpud became ready, its config was reloaded): the requests waiting on one
        look again. Woken: the waiters of every serve that shares a role with one of SERVES
        (its own state, memory freed or taken there, a victim settling: gpud.life.pulse), and,
        when the change touches the queue (a role a waiting serve holds memory on, or a
        waiting serve itself), those the queue now lets go that it did not before
        (`_look_again`). A change that names no serve wakes every waiter."""
        named = None if serves is None else frozenset(serves)
        if named is None or not named.isdisjoint(self.queued):
            self._looked = None  # who runs among the waiting serves: their order
        roles = self.changes.fire(named)
        if not self.queued:
            self._acting = frozenset()
            return
        if roles is None or not roles.isdisjoint(
                r for n in self.queued if n in self.svc.config.serves
                for r in self.svc.config.serves[n].all_roles):
            self._look_again()

    def _queue_changed(self, *, swap_ended: bool = False, swapper: str | None = None) -> None:
        """The queue changed (a request joined or left: its order; SWAP_ENDED: SWAPPER's swap
        ended, so that the others may go): its head and the serves that backfill are looked
        for again (`_look_again`). Wakes nobody else: the change of no serve."""
        self.changes.any.fire()
        if swap_ended:
            self._swap_ended = (swapper,)  # the order is as it was
        else:
            self._looked = None
        self._look_again()

    def _look_again(self) -> None:
        """Wake the waiting serves the queue lets go now (its head, those that backfill) that
        it did not at its last look; all of them (but the swapper) after a swap's end. Once,
        when the change (and any made with it) is done: soon, not in the middle of a commit."""
        if not self.queued:
            self._acting = frozenset()
        elif self._look is None:
            self._look = asyncio.get_running_loop().call_soon(self._looked_again)

    def _looked_again(self) -> None:
        self._look = None
        ended, self._swap_ended = self._swap_ended, None
        head = self._head()
        acting = frozenset(([head] if head is not None else []) + self.backfills())
        woken = acting - self._acting if ended is None else acting - set(ended)
        self._acting = acting
        for serve in woken:
            self.changes.wake(serve)

    def operator_started(self, name: str) -> None:
        """An operator started the serve (gpuctl start): its backoff is over and starts over."""
        self.svc.records.apply(name, OperatorStarted())

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
            self.svc.records.apply(name, SeenFailed(at, reason, self.policy))
        return held(self.svc.records.demand(name).tries, now)

    def _tried(self, name: str, exc: GpudError) -> None:
        """A bring-up of `name` ended without the serve running: when it may be tried next."""
        now = self.clock()
        why = classify(exc.code, exc.details)
        self.svc.records.apply(name, Tried(now, why, exc.message, self.policy))

    async def up(self, name: str, spec: ServeConfig,
                 cause: RouterRequest | None = None) -> None:
        """Return once NAME is running, bringing it up once for all who wait; within its
        start_timeout_s. A sleep or a stop under way is waited for first. Unavailable at once
        (details.held) while its last try's hold or backoff lasts. With the router's queue,
        what comes next is the queue's decision (gpud.core.queue.admit): go now, wait in the
        queue (`_queued`), or be refused with the try's reason or the queue's."""
        tried = await self._try(name, spec, cause)
        refusal = tried if isinstance(tried, GpudError) else None
        why = None if refusal is None else _why(refusal)
        never = why == Why.NO_MEMORY and self.never_fits(name) is not None
        if refusal is not None and why == Why.NO_MEMORY and not never:
            need = refusal.details.get("need_mib")
            if isinstance(need, int):
                mib: int = need
                self.svc.records.apply(name, NeedMib(mib))
        router = self.svc.config.router
        waits = tried == Arrival.JOIN or (why == Why.NO_MEMORY and not never)
        need_mib = self.svc.records.demand(name).need_mib
        decided = admit(joined=tried == Arrival.JOIN, refused=why, never_fits=never,
                        queue_on=self._queues(),
                        could_fit=not waits or not self._queues() or need_mib is None
                        or self._could_fit(name, spec, need_mib),
                        queued=len(self.queued.get(name, ())),
                        max_queued=router.max_queued if router is not None else 0)
        first = refusal.message if refusal is not None else \
            "requests for other serves wait for memory already"
        if decided.next == Next.UP:
            return
        if decided.next == Next.REFUSED:
            if decided.refusal is None:
                assert refusal is not None
                raise refusal
            raise Unavailable(f"serve {name!r} not brought up: {decided.refusal.message}; "
                              f"{first}", {"serve": name, "class": Why(decided.refusal.why),
                                           "queued": len(self.queued.get(name, ())),
                                           "max_queued": decided.refusal.max_queued})
        await self._queued(name, spec, cause, first)

    async def _try(self, name: str, spec: ServeConfig,
                   cause: RouterRequest | None) -> Arrival | GpudError | None:
        """A request's try of NAME (`_up`): None, up; Arrival.JOIN, told to wait behind others;
        or the try's refusal, as a value for `admit` to decide on."""
        try:
            return await self._up(name, spec, cause)
        except GpudError as exc:
            return exc

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
                await self.changes.of(name).until(lambda: not self.settling(name))
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
        # coalesced (gpud.life.writes.COALESCE_REFUSALS; the task runs in a copy of the context).
        COALESCE_REFUSALS.set(True)
        self.svc.records.apply(name, BringupBegan())
        try:
            await self._bring_up_once(name, spec, cause, quiet=quiet)
        except GpudError as exc:
            self._tried(name, exc)
            raise
        now = self.clock()
        self.svc.records.apply(name, CameUp(now))

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
            await self.sup.launch_job.start(name, None, wait=True, preempt=spec.preempt)
        # A start or wake of someone else's (a boot's, an operator's, a restart's after a
        # crash), still under way: its end is a stored state, its failure answered at once.
        await self.changes.of(name).until(
            lambda: self.svc.state_of(name) not in (STARTING, SLEEPING)
            and not self.start_under_way(name))
        state = self.svc.state_of(name)
        if state != RUNNING:
            rec = self.svc.records.get(name)
            reason = rec.reason if rec is not None else None
            raise Unavailable(f"serve {name!r} is {state}" + (f": {reason}" if reason else ""),
                              {"serve": name, "state": state})
        if kind is not None:
            self.counts.brought_up(name, kind, self.clock() - began)
            log.info("on-demand %s up (%s): the %s took %.1f s", name, by, kind,
                     self.clock() - began)

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
        self._queue_changed()  # the queue's order changed: who is next may be another
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
            self.counts.waited(name, self.clock() - ticket.arrived)
            self._queue_changed()

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
            self._to_bring = list(dict.fromkeys(t.serve for t in self._looked if not t.running))
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
        Each wait ends on the next change that can alter what it decides, or the next
        deadline, whichever is first: a retry that the last try's QUEUE_RETRY_S held off, or
        what the queue's decision names (Protected.wait_s: a victim's min_awake_s ending, an
        idle time to come). A change that comes while a try is held off is tried at the hold's
        end, never lost; nor one that comes while it tries, evicts or awaits a bring-up (its
        pulse's `fired`, read before it looks), but those of an eviction refused (the
        attempt's own: its victim's drain and life), looked at when the refusal's wait ends.

        What it decides on, and the change that wakes it (NAME's pulse, `changed`): NAME's
        state, settling and bring-up: a change naming NAME. The memory free on NAME's roles and
        the serves there it may evict (their state, settling, bring-up, requests in flight):
        a change naming a serve on one of its roles. Whether it is the head, and whether it
        backfills (the queue's order; the memory free on every waiting serve's roles): the
        queue's look once such a change is done (`_look_again`), which wakes it when it becomes
        the head or begins to backfill. Another's swap under way: its end wakes the head and
        the serves that backfill (`_swapped`). Anything else (a reload, gpud ready) names no
        serve and wakes every waiter."""
        pulse = self.changes.of(name)
        tried = self.clock()  # the refusal that made the first request wait was a try
        while True:
            seen = pulse.fired  # a change from here on is looked at (never lost)
            if self.svc.state_of(name) == RUNNING and not self.settling(name):
                return
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
                self._swapping, self._swapper = swap, name
                swap.add_done_callback(self._swapped)
                outcome = await asyncio.shield(swap)
                if outcome is None:
                    continue
                if isinstance(outcome, EvictionRefused):
                    seen = pulse.fired  # the attempt's own changes: looked at past wait_s
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
                    await pulse.next(since=seen)

    def backfills(self, also: str | None = None) -> list[str]:
        """The waiting serves that may come up now without evicting anything and without taking
        memory the head of the queue needs at its earliest start (gpud.core.queue.backfill),
        the queue in its fair order; ALSO: a serve a request arrives for, after them."""
        serves = self.svc.config.serves
        self.ordered()
        names = list(self._to_bring)  # each once: not one per waiting request
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
        swapper = None
        if self._swapping is task:
            self._swapping, swapper = None, self._swapper
        if not task.cancelled():
            task.exception()  # retrieved here: its request may have gone
        # the next swap may begin, and the serves that backfill go (the swapper has its outcome)
        self._queue_changed(swap_ended=True, swapper=swapper)

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
            refused = await self._evict(chosen[0], name, cause, spec.priority)
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

    async def _evict(self, victim: str, name: str, cause: RouterRequest | None,
                     priority: int) -> Protected | None:
        """Put VICTIM to sleep (when it can sleep) or stop it, for a queued request for NAME (a
        serve of PRIORITY); its requests in flight are drained first, new ones wait (settling).
        A request still in flight at the drain's bound is ended only as gpud.core.queue.may_cut
        allows (router.evict_busy, a victim that sleeps or tells_abort: each stream told), and
        journaled; else the eviction is refused then. None: evicted; else how long the queue
        waits before it looks again (refused, logged): a busy victim on the next change of its
        count (or another change), any other refusal QUEUE_RETRY_S."""
        vspec = self.svc.config.serves[victim]
        by = f"serve {name}" if cause is None else f"serve {name} ({cause.text})"
        log.info("on-demand %s: evicted for %s", victim, by,
                 extra={"journal": {"GPUD_SERVE": victim, "GPUD_FOR": name}})
        self.svc.records.apply(victim, Idling(True))
        try:
            if vspec.sleep_level:
                cut = self._may_cut(vspec, priority, aborts=True)
                slept = await self.sup.sleeps.sleep(victim, None, evicted_for=name,
                                                    uncut=self.traffic is not None and not cut)
                self._cut(victim, name, by, slept.get("in_flight"))
            elif self.traffic is None:
                await self.sup.stop_job.stop(victim, None)
            else:
                # what is left at the drain's bound is told its end before the stop
                # (/pause?mode=abort: drain_to_stop) where the victim tells_abort
                drained = await drain_and_stop(
                    self.traffic, self.sup.stop_job, victim, vspec, None,
                    self.svc.config.daemon.drain_timeout_s,
                    cut=self._may_cut(vspec, priority, aborts=tells_abort(vspec)),
                    tell=functools.partial(self.sup.sleeps.post, victim, vspec))
                if drained is not None:
                    self._cut(victim, name, by, drained.details())
        except GpudError as exc:
            log.warning("on-demand %s: eviction for %s refused: %s", victim, name, exc.message,
                        extra={"journal": {"GPUD_SERVE": victim, "GPUD_FOR": name}})
            if exc.details.get("busy"):
                return EvictionRefused(math.inf, exc.message)
            return EvictionRefused(QUEUE_RETRY_S, f"the eviction of {victim} was refused")
        finally:
            self.svc.records.apply(victim, Idling(False))
            self.changed((victim,))
        self.counts.add(self.counts.evictions, victim)
        self.svc.records.apply(victim, UpAt(None))
        return None

    def _may_cut(self, vspec: ServeConfig, priority: int, *, aborts: bool) -> bool:
        """Requests in flight on a victim (VSPEC) at the drain's bound may be ended for a
        request of PRIORITY (gpud.core.queue.may_cut): ABORTS, the victim tells each its end."""
        router = self.svc.config.router
        return may_cut(evict_busy=router is None or router.evict_busy, priority=priority,
                       victim_priority=vspec.priority, aborts=aborts)

    def _cut(self, victim: str, name: str, by: str, drained: object) -> None:
        """The journal's line for requests in flight on VICTIM that its eviction for NAME ended
        past the drain's bound (DRAINED: the sleep's account of its drain, Drain.details)."""
        if not isinstance(drained, dict) or drained.get("outcome") != "aborted":
            return
        log.warning("on-demand %s: %s request(s) in flight ended for %s past the %g s drain "
                    "bound (router.evict_busy); each stream was told (finish_reason abort, "
                    "an error event)", victim, drained.get("after"), by, drained.get("bound_s"),
                    extra={"journal": {"GPUD_SERVE": victim, "GPUD_FOR": name,
                                       "GPUD_CUT": drained.get("after")}})

    async def idle_loop(self) -> None:
        """The idle check (gpud.life.idle), for as long as gpud runs."""
        await self._idle.loop()
