"""What is in flight on each serve, and the drains: which serves are read and how often, what a
read changes, when a drain is over. The read itself (the serve's ``GET /metrics`` over HTTP) is
the host's adapter, gpud.host.traffic.InFlightReader; what the count means and what follows
from it is gpud.core.traffic, whose docstring says why the serve's own count is the source.

A read that gets no answer leaves what was known; one that answers without vLLM's gauges makes
the count unknown (None), said once in the journal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Final, Protocol

from gpud.core.launch import tells_abort
from gpud.core.traffic import Drain, Flight, Outcome, drain_done, observe
from gpud.core.vocab import RUNNING, SLEEPING
from gpud.errors import Conflict, GpudError
from gpud.files import write_atomically
from gpud.host.traffic import InFlightReader, reachable
from gpud.life.service import LedgerService
from gpud.nginx.router import cut_dir

if TYPE_CHECKING:
    from gpud.config import ServeConfig

log = logging.getLogger("gpud.traffic")

# How often the serves' counts are read (the end of a request is known within this), and how
# often during a drain.
POLL_S: Final = 0.5
DRAIN_POLL_S: Final = 0.1


class Traffic:
    """The requests in flight on each running or sleeping serve that gpud can reach over HTTP
    (fronted, or with a port), and the drains under way."""

    def __init__(self, svc: LedgerService, reader: InFlightReader, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.svc = svc
        self.reader = reader
        self.clock = clock
        self.flights: dict[str, Flight] = {}
        # Serves being drained, then stopped or put to sleep (`held`): the front's ensure
        # waits until that is over (gpud.life.ondemand).
        self._held: dict[str, int] = {}
        self._uncounted: set[str] = set()
        # Told when a drain is over (`watch`): the front's ensure waits for that.
        self._listeners: list[Callable[[str], None]] = []

    def watch(self, listener: Callable[[str], None]) -> None:
        """Call `listener` with the serve's name whenever a serve stops being held (`held`) and
        whenever a serve's count of requests in flight, as read, changes (the queue's victims
        wait on both)."""
        self._listeners.append(listener)

    def draining(self, serve: str) -> bool:
        return self._held.get(serve, 0) > 0

    @contextlib.contextmanager
    def held(self, serve: str) -> Iterator[None]:
        """While the serve is drained and then stopped or put to sleep: no request is let
        through to it by the front's ensure."""
        self._held[serve] = self._held.get(serve, 0) + 1
        try:
            yield
        finally:
            self._held[serve] -= 1
            if not self._held[serve]:
                del self._held[serve]
            for listener in self._listeners:
                listener(serve)

    def mark_cut(self, serve: str) -> None:
        """Note, just before gpud ends what is in flight on SERVE (a sleep's or a pause's
        mode=abort), that it does so: SERVE's file of the cut directory
        (gpud.nginx.router.cut_dir) written anew, the wall clock's epoch in nanoseconds, so
        that no two notes are the same. The router's script reads it at the first bytes and
        at the end of a /v1/responses stream, and tells one whose note changed between them
        (vLLM 0.32 ends an aborted one as a whole one: router.js cutSince): an order, which no
        tie and no clock set back can turn. Only with a router; a file that cannot be written
        is said in the journal, and the abort goes on."""
        if self.svc.config.router is None:
            return
        where = Path(cut_dir(self.svc.config.daemon)) / serve
        try:
            write_atomically(where, str(time.time_ns()), mode=0o644)
        except GpudError as exc:
            log.warning("serve %s: cannot note the end of its requests in flight for the "
                        "router (%s): a /v1/responses stream among them is not told",
                        serve, exc.message)

    def flight(self, serve: str) -> Flight:
        return self.flights.get(serve, Flight())

    def in_flight(self, serve: str) -> int | None:
        return self.flight(serve).in_flight

    async def poll(self, serve: str, spec: ServeConfig) -> Flight:
        answered, count = await self.reader.read(serve, spec)
        flight = before = self.flight(serve)
        if answered:
            flight = observe(flight, count, self.clock())
            if count is None and serve not in self._uncounted:
                self._uncounted.add(serve)
                log.warning("serve %s: its /metrics gives no vllm:num_requests_running nor "
                            "vllm:num_requests_waiting: its requests in flight are unknown, and "
                            "its idle time counts from the front's last request alone", serve)
            elif count is not None:
                self._uncounted.discard(serve)
            self.flights[serve] = flight
            if flight.in_flight != before.in_flight:
                for listener in self._listeners:
                    listener(serve)
        return flight

    async def loop(self) -> None:
        """Read every running or sleeping reachable serve's count, every POLL_S."""
        while True:
            watched = {name: spec for name, spec in self.svc.config.serves.items()
                       if reachable(spec) and self.svc.state_of(name) in (RUNNING, SLEEPING)}
            for name in [n for n in self.flights if n not in watched]:
                # not running: nothing in flight; when its last request ended is kept
                self.flights[name] = observe(self.flights[name], 0, self.clock())
            if watched:
                await asyncio.gather(*(self.poll(n, s) for n, s in watched.items()))
            await asyncio.sleep(POLL_S)

    async def drain(self, serve: str, spec: ServeConfig, bound_s: float) -> Drain:
        """Wait, at most `bound_s`, until nothing is in flight on the serve (the caller holds
        it: `held`). Returns what happened."""
        began = self.clock()
        flight = await self.poll(serve, spec)
        before = after = flight.in_flight
        while not drain_done(after, self.clock() - began, bound_s):
            await asyncio.sleep(DRAIN_POLL_S)
            after = (await self.poll(serve, spec)).in_flight
        drained = Drain(before, after, self.clock() - began, bound_s)
        log.info("serve %s: %s", serve, drained.line())
        return drained


def refuse_cut(serve: str, drained: Drain) -> None:
    """Conflict (details.busy) when DRAINED left requests in flight at its bound: what the
    router queue's eviction asks, so that a stream in flight is never cut for another
    request (docs/router.md, "Queue instead of thrash"). A count the serve does not give is
    not known to be busy: that goes ahead as before."""
    if drained.outcome == Outcome.ABORTED:
        raise Conflict(f"serve {serve!r} not evicted: {drained.after} request(s) still in "
                       f"flight after the {drained.bound_s:g} s drain bound, not cut "
                       "(the queue looks again when its count changes)",
                       {"serve": serve, "busy": True, "in_flight": drained.details()})


# vLLM's pause with mode=abort: every request in flight ends at once, told (gpud.core.launch
# .tells_abort); the stop that follows finds nothing in flight.
ABORT_PATH: Final = "/pause?mode=abort"


class Drains(Protocol):
    """A hold, a drain, and the note of a cut (Traffic.held, Traffic.drain, Traffic.mark_cut)."""

    def held(self, serve: str) -> contextlib.AbstractContextManager[None]: ...
    async def drain(self, serve: str, spec: ServeConfig, bound_s: float) -> Drain: ...
    def mark_cut(self, serve: str) -> None: ...


class Stops(Protocol):
    """A stop (gpud.life.supervisor.stop.StopJob)."""

    async def stop(self, serve: str, uid: int | None, *, keep_reservation: bool = False,
                   idle_s: float | None = None, drained: Drain | None = None) -> None: ...


async def drain_to_stop(drainer: Drains, serve: str, spec: ServeConfig, bound_s: float, *,
                        cut: bool, tell: Callable[[str], Awaitable[None]]) -> Drain:
    """Drain SERVE for a stop (the caller holds it: Traffic.held), at most BOUND_S, and end
    what is still in flight at the bound: refused (refuse_cut) unless CUT; else, on a serve
    that tells_abort, ended by TELL(ABORT_PATH) (a POST to the serve) so that each stream is
    told (its last chunk says finish_reason "abort", the router adds an error event) before
    the stop. A stop alone is no told end: vLLM 0.32 on SIGTERM leaves a stream in flight open
    with no last chunk (vllm/entrypoints/launchers/launcher.py handle_shutdown), and a serve
    that cannot be told is cut by its stop. Returns the drain's account."""
    drained = await drainer.drain(serve, spec, bound_s)
    if drained.outcome != Outcome.ABORTED:
        return drained
    if not cut:
        refuse_cut(serve, drained)
    if tells_abort(spec):
        drainer.mark_cut(serve)
        try:
            await tell(ABORT_PATH)
        except GpudError as exc:
            log.warning("serve %s: %s request(s) in flight not told their end (%s): its stop "
                        "ends them", serve, drained.after, exc.message)
    return drained


async def drain_and_stop(drainer: Drains | None, stopper: Stops, serve: str, spec: ServeConfig,
                         uid: int | None, bound_s: float, *, cut: bool,
                         tell: Callable[[str], Awaitable[None]], idle_s: float | None = None,
                         keep_reservation: bool = False) -> Drain | None:
    """Stop SERVE after its drain (drain_to_stop), held all the while so that the front lets
    nothing new through to it: the one way gpud stops a serve that may have requests in flight
    (a queue's eviction, a preemption, an idle stop, an operator's stop). Without a drainer
    (gpud runs without the in-flight reader), the stop alone. Returns the drain's account, said
    in the stop's event."""
    if drainer is None:
        await stopper.stop(serve, uid, keep_reservation=keep_reservation, idle_s=idle_s)
        return None
    with drainer.held(serve):
        drained = await drain_to_stop(drainer, serve, spec, bound_s, cut=cut, tell=tell)
        await stopper.stop(serve, uid, keep_reservation=keep_reservation, idle_s=idle_s,
                           drained=drained)
    return drained
