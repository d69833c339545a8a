"""Sleeping serves: vLLM's sleep mode under the ledger, and preemption by priority.

A serve with `sleep_level` is put to sleep with `POST /sleep?level=N`, confirmed with
`GET /is_sleeping` (`{"is_sleeping": true}`), and only then its reservation shrinks to its sleep
reservation, in the same transaction as its state (`sleeping`) and the `sleep` event. A wake is
admitted first (strict admission: the physical bound counts), then `POST /wake_up`. Endpoints as
vLLM registers them in dev mode: vllm/entrypoints/serve/dev/sleep/api_router.py (`/sleep` reads
the `level` query parameter, default 1; `/wake_up`; `/is_sleeping`); vLLM's own FIXME there says
the answer to /sleep may come before the sleep is done, hence the confirmation.

Preemption (gpud.life.preemption, planned by gpud/core/preempt.py) runs under the coordination
lock (one for all of gpud, taken before any serve's lock: gpud.life.locks), its serves put to
sleep and woken here. Wake-back (after memory is released on a role) takes the same
lock, so it never wakes a serve a preemption in progress has just put to sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import aiohttp

from gpud.config import ServeConfig
from gpud.core.launch import fingerprint
from gpud.core.ledger import Reservation, sleep_reservation
from gpud.core.lifecycle import Input, LifeAction, SleepAsked, SlumberEnded, WakeAsked
from gpud.core.reconcile import Reconcile, reconcile
from gpud.core.serverecord import Happened, Record, Report, next_state
from gpud.core.traffic import Drain
from gpud.core.unitstate import UnitState
from gpud.core.vllm_versions import VllmBehaviour, behaviour
from gpud.core.vocab import (
    RUNNING,
    SLEEPING,
    DenialBound,
    EventKind,
    ServeState,
)
from gpud.errors import Conflict, GpudError, Refused, StoreError, Unavailable
from gpud.host.observer import Observer
from gpud.life.locks import Locks, Rank, Taken
from gpud.life.preemption import Preemption, ServesRuntime, SupervisorParts
from gpud.life.service import LedgerService
from gpud.life.traffic import Drains, refuse_cut

log = logging.getLogger("gpud.sleeping")


CONFIRM_TIMEOUT_S = 60.0
# GET /is_sleeping answers from the API server at once (no engine work): a serve that does not
# answer within this is "no answer", never waited on.
IS_SLEEPING_TIMEOUT_S = 2.0
# After vLLM says it sleeps, how long gpud waits for observation to show the memory back.
DRAW_TIMEOUT_S = 10.0
POLL_FIRST_S = 0.005
POLL_MAX_S = 0.25


def meta_key(serve: str) -> str:
    """The store's note on a sleeping serve: level, who preempted it, host RAM parked."""
    return f"sleep:{serve}"


def measured_key(serve: str) -> str:
    """The sleep draw measured after a serve's sleep (with its fingerprint)."""
    return f"sleep-measured:{serve}"


class SleepRuntime(ServesRuntime, Protocol):
    """What the sleeps and the reconciler ask of the serves' runtime
    (gpud.life.supervisor.base.Runtime): the locks (in their order, gpud.life.locks), a serve's
    life and a change of it (gpud.core.lifecycle.step: a sleep or a wake begun and ended), its
    spec, its HTTP client, a task of its own."""

    @property
    def locks(self) -> Locks: ...
    def serve_lock(self, serve: str) -> Taken: ...
    def device_locks(self, serve: str, *, shared: bool = False) -> Taken: ...
    def step(self, serve: str, inp: Input) -> list[LifeAction]: ...
    def serve_http(self, serve: str, spec: ServeConfig) -> aiohttp.ClientSession: ...
    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]: ...


class UnitStates(Protocol):
    """A unit as systemd has it now (gpud.host.units.SystemdUnits)."""

    async def state(self, serve: str) -> UnitState | None: ...


class Rewatching(Protocol):
    """The health checks a wake asks for (gpud.life.supervisor.health.HealthJob)."""

    async def watch_restart(self, serve: str) -> None: ...
    async def wake_failed(self, serve: str, spec: ServeConfig, reason: str) -> None: ...


class SleepSupervisor(SupervisorParts, Protocol):
    """The supervisor's parts the sleep controller and the reconciler ask (gpud.life.supervisor
    .Supervisor): its runtime, the units, a start, a stop, memory coming back, health checks."""

    @property
    def runtime(self) -> SleepRuntime: ...
    @property
    def units(self) -> UnitStates: ...
    @property
    def health_job(self) -> Rewatching: ...


class Sleeps:
    def __init__(self, serves: SleepSupervisor, svc: LedgerService, observer: Observer, *,
                 host_memory: Callable[[], int | None],
                 weights: Callable[[str], int | None] = lambda _serve: None,
                 graphs: Callable[[str], int | None] = lambda _serve: None,
                 traffic: Drains | None = None) -> None:
        self.serves = serves
        # What is in flight on a serve: a preemption drains it first (gpud.life.traffic, from
        # gpud.daemon; None in tests that run without it).
        self.traffic = traffic
        self.svc = svc
        self.observer = observer
        self.host_memory = host_memory
        # The calibrated weights of a serve, MiB (Calibrator.weights_mib).
        self.weights = weights
        # The calibrated CUDA graph pool of a serve, MiB (Calibrator.cudagraph_mib).
        self.graphs = graphs
        # Every preemption and wake-back holds the supervisor's coordination lock (gpud.life.locks).
        self._wake_back: dict[str, asyncio.Task[None]] = {}
        self._wake_again: set[str] = set()
        # Admissions that put serves of lower priority to sleep, or stop them, to make room.
        self.preemption = Preemption(self)

    # ---- facts about a serve ---------------------------------------------------------------

    def note(self, serve: str) -> dict[str, Any]:
        text = self.svc.store.meta(meta_key(serve)) if serve in self.svc.records else None
        try:
            value = json.loads(text) if text else {}
        except ValueError:
            value = {}
        return value if isinstance(value, dict) else {}

    def parked_mib(self, serve: str) -> int | None:
        """Host RAM a sleeping serve's weights are parked in (level 1), else None."""
        if self.svc.state_of(serve) != SLEEPING:
            return None
        parked = self.note(serve).get("parked_host_mib")
        return parked if isinstance(parked, int) else None

    def sleep_mib(self, serve: str, spec: ServeConfig) -> int | None:
        """The reservation kept asleep: serves.NAME.sleep_mib, else the draw measured after an
        earlier sleep of the same serve (fingerprint) plus the overdraw tolerance."""
        if spec.sleep_mib is not None:
            return spec.sleep_mib
        text = self.svc.store.meta(measured_key(serve))
        with contextlib.suppress(ValueError, TypeError, KeyError):
            rec = json.loads(text or "")
            if rec["fingerprint"] == fingerprint(spec):
                return min(spec.vram_mib, int(rec["mib"])
                           + self.svc.config.daemon.overdraw_tolerance_mib)
        return None

    def awake_mib(self, serve: str, spec: ServeConfig) -> int:
        """What a serve wakes to: the reservation it had awake (its launch was sized on it),
        its vram_mib unless it was admitted at another size."""
        mib = self.note(serve).get("awake_mib")
        return mib if isinstance(mib, int) and mib > 0 else spec.vram_mib

    def _host_weights(self, serve: str) -> int:
        """What a level-1 sleep parks in host RAM: the calibrated weights, else the
        reservation (all of it could be weights); on several devices, that of each device
        times their number (each of vLLM's workers backs up its own shard in CPU memory)."""
        res = self.svc.ledger.reservations.get(serve)
        spec = self.svc.serve_spec(serve)
        devices = len(res.all_roles) if res else len(spec.all_roles) if spec else 1
        weights = self.weights(serve)  # per device, as calibration measures a serve
        if weights is not None:
            return weights * devices
        return (res.mib if res else spec.vram_mib if spec else 0) * devices

    @property
    def vllm(self) -> VllmBehaviour:
        """What the serves' vLLM release does (daemon.vllm_version, which the config check
        holds to a release gpud knows)."""
        return behaviour(self.svc.config.daemon.vllm_version)

    def _host_need(self, serve: str, level: int) -> int:
        """What a sleep at `level` parks in host RAM, as the serves' vLLM release parks it
        (gpud.core.vllm_versions: the weights at level 1, nothing at level 2 on 0.33; on 0.34
        the CUDA graph pool besides, at either level); per device times the devices."""
        if level == 1 and not self.vllm.level2_parks_host:
            return self._host_weights(serve)
        res = self.svc.ledger.reservations.get(serve)
        spec = self.svc.serve_spec(serve)
        devices = len(res.all_roles) if res else len(spec.all_roles) if spec else 1
        weights = self.weights(serve)
        if weights is None:
            weights = res.mib if res else spec.vram_mib if spec else 0
        parked = self.vllm.parked_host_mib(level, weights_mib=weights,
                                           cudagraph_mib=self.graphs(serve))
        return (parked or 0) * devices

    def url(self, serve: str, spec: ServeConfig, path: str) -> str:
        """Where gpud reaches one of the serve's routes (its socket when fronted)."""
        return self._url(serve, spec, path)

    async def post(self, serve: str, spec: ServeConfig, path: str) -> None:
        """POST to one of the serve's control routes, bounded as _post bounds it."""
        await self._post(serve, spec, path)

    def _url(self, serve: str, spec: ServeConfig, path: str) -> str:
        if spec.front:
            return f"http://localhost{path}"  # over the serve's socket (Supervisor.serve_http)
        if spec.port is None:
            raise Conflict("a serve without a port cannot be put to sleep: its sleep endpoints "
                           "are HTTP", {})
        return f"http://127.0.0.1:{spec.port}{path}"

    def role_lock(self, _role: str) -> Taken:
        """The coordination lock, whatever the role: one for all of gpud (a serve on several
        roles, and wake-backs across roles, are planned under it; gpud.life.locks orders it first)."""
        return self.serves.runtime.locks.coordination()

    @property
    def coordination(self) -> asyncio.Lock:
        """The lock of preemptions, sleeps' and wakes' coordination: taken before any serve's
        lock, never after one (gpud.life.locks)."""
        return self.serves.runtime.locks.lock(Rank.COORDINATION)

    # ---- HTTP to the serve -----------------------------------------------------------------

    async def _post(self, serve: str, spec: ServeConfig, path: str,
                    body: dict[str, Any] | None = None, timeout_s: float | None = None) -> None:
        """POST to the serve, bounded: daemon.sleep_timeout_s for /sleep, wake_timeout_s for
        everything else (a wake's requests); past it, Unavailable with `no_answer`."""
        http = self.serves.runtime.serve_http(serve, spec)
        daemon = self.svc.config.daemon
        if timeout_s is None:
            timeout_s = daemon.sleep_timeout_s if path.startswith("/sleep") else \
                daemon.wake_timeout_s
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        try:
            async with http.post(self._url(serve, spec, path), json=body,
                                 timeout=timeout) as resp:
                if resp.status != 200:
                    said = (await resp.text())[:300]
                    raise Conflict(f"serve {serve!r} answered {resp.status} to POST {path}: "
                                   f"{said}", {"serve": serve, "status": resp.status})
        except TimeoutError as exc:
            raise Unavailable(f"serve {serve!r}: POST {path} got no answer within "
                              f"{timeout_s:g} s", {"serve": serve, "no_answer": True}) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise Unavailable(f"serve {serve!r}: POST {path} failed: {exc or type(exc).__name__}",
                              {"serve": serve}) from exc

    async def is_sleeping(self, serve: str, spec: ServeConfig) -> bool | None:
        """vLLM's GET /is_sleeping, `{"is_sleeping": bool}`; None when it does not answer
        that."""
        try:
            async with self.serves.runtime.serve_http(serve, spec).get(
                    self._url(serve, spec, "/is_sleeping"),
                    timeout=aiohttp.ClientTimeout(total=IS_SLEEPING_TIMEOUT_S)) as resp:
                if resp.status != 200:
                    return None
                body = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, GpudError):
            return None
        value = body.get("is_sleeping") if isinstance(body, dict) else None
        return value if isinstance(value, bool) else None

    async def ask_to_sleep(self, serve: str, spec: ServeConfig, level: int) -> None:
        """POST /sleep?level=N and wait until the serve confirms it (the ledger untouched:
        the caller holds the serve's lock and knows what it reserves)."""
        await self._post(serve, spec, f"/sleep?level={level}")
        await self._confirm(serve, spec, asleep=True)

    async def _confirm(self, serve: str, spec: ServeConfig, asleep: bool) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CONFIRM_TIMEOUT_S
        pause = POLL_FIRST_S
        while True:
            answer = await self.is_sleeping(serve, spec)
            if answer is asleep:
                return
            if loop.time() > deadline:
                said = "no answer" if answer is None else f"is_sleeping {answer}"
                raise Unavailable(f"serve {serve!r} did not confirm it is "
                                  f"{'asleep' if asleep else 'awake'} within "
                                  f"{CONFIRM_TIMEOUT_S:g} s ({said})", {"serve": serve})
            await asyncio.sleep(pause)
            pause = min(POLL_MAX_S, pause * 2)

    async def _draw_down(self, serve: str, at_most: int | None) -> int | None:
        """After the sleep: wait (bounded) until observation shows the serve at `at_most` or
        less on each of its devices, so the next admission sees the memory back. Returns its
        observed draw: the most on any one device (its reservation is held on each)."""
        obs = self.observer
        if not obs.available:
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DRAW_TIMEOUT_S
        pause = POLL_FIRST_S
        last: int | None = None
        while True:
            await obs.sample()
            seen = obs.observed_each_mib(serve)
            if at_most is None:
                if seen is not None and seen == last:
                    return seen  # steady over two samples: what it keeps asleep
                last = seen
            elif seen is None or seen <= at_most:
                return seen
            if loop.time() > deadline:
                return seen
            await asyncio.sleep(pause)
            pause = min(POLL_MAX_S, pause * 2)

    # ---- sleep and wake ----------------------------------------------------------------------

    def _sleeper(self, serve: str) -> ServeConfig:
        spec = self.serves.runtime.spec(serve)
        if not spec.sleep_level:
            raise Conflict(f"serve {serve!r} has no sleep_level: it does not sleep "
                           f"(set serves.{serve}.sleep_level = 1 or 2)", {"serve": serve})
        return spec

    async def sleep(self, serve: str, uid: int | None, level: int | None = None, *,
                    preempted_by: str | None = None, idle_s: float | None = None,
                    uncut: bool = False, evicted_for: str | None = None) -> dict[str, Any]:
        """Put SERVE to sleep: by an operator, for a preemption (`preempted_by`), or idle for
        `idle_s` seconds without a request through its front (on demand). UNCUT (the router
        queue's eviction, router.evict_busy false): refused (Conflict, details.busy) when
        requests are still in flight at the drain's bound, rather than aborting them. The
        answer carries the drain's account (`in_flight`) when there was one. EVICTED_FOR: the
        serve a queued request evicts it for (gpud.life.ondemand): drained like a preemption's
        victim, but never woken back when memory is released (it comes back by its own next
        request; woken back, it would take the memory its evictor was to have)."""
        spec = self._sleeper(serve)
        level = level or spec.sleep_level
        if level not in (1, 2):
            raise Refused(f"sleep level must be 1 or 2, not {level}", {"level": level})
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(self.serves.runtime.serve_lock(serve))
            state = self.svc.state_of(serve)
            # refused (a Refuse action) while a launch or a job on its unit is under way
            if state != RUNNING or self.serves.runtime.step(serve, SleepAsked()):
                raise Conflict(f"serve {serve!r} is {state}: only a running serve is put to "
                               "sleep", {"serve": serve, "state": state})
            stack.callback(self.serves.runtime.step, serve, SlumberEnded())
            res = self.svc.ledger.reservations[serve]
            target, awake_seen = await self._sleep_target(serve, spec)
            parked = self._host_need(serve, level)
            if level == 1 or (level == 2 and self.vllm.level2_parks_host):
                self._check_host_ram(serve, parked, level)
            # gpud's own sleeps (a preemption's, an idle one's) drain the requests in flight
            # first, within daemon.drain_timeout_s; an operator's sleep is the operator's call.
            drained: Drain | None = None
            mode = "abort"
            if self.traffic is not None and (preempted_by is not None or idle_s is not None
                                             or evicted_for is not None):
                stack.enter_context(self.traffic.held(serve))
                drained = await self.traffic.drain(serve, spec,
                                                   self.svc.config.daemon.drain_timeout_s)
                if uncut:
                    refuse_cut(serve, drained)
                mode = drained.sleep_mode
            loop = asyncio.get_running_loop()
            asked = await self._process(serve)
            if asked is None:
                raise Unavailable(f"serve {serve!r} not put to sleep: systemd names no process "
                                  "of its unit now, so a sleep could not be told apart from a "
                                  "restart", {"serve": serve})
            async with self.serves.runtime.device_locks(serve):  # its memory changes: no start's window
                began = loop.time()
                # After a drain, mode=wait: what is in flight now (a request that came since the
                # drain's last read) finishes before the memory goes; vLLM's pause_scheduler
                # (vllm/v1/engine/core.py:2061-2103 in 0.32) keeps stepping them and sleeps once
                # they are done. Past the drain's bound, and for an operator's sleep, mode=abort
                # (vLLM's default, said here so it is a choice): the requests in flight end at
                # once, their clients told (finish_reason "abort"), where "wait" would hold the
                # sleep (and a preemption's waiting serve) for as long as its longest request,
                # and "keep" would freeze them until a wake nobody has promised. Requests
                # arriving while it sleeps queue (all modes).
                if mode == "abort" and self.traffic is not None:
                    self.traffic.mark_cut(serve)  # what is in flight ends now: the router's note
                await self._post(serve, spec, f"/sleep?level={level}&mode={mode}")
                try:
                    await self._confirm(serve, spec, asleep=True)
                except GpudError:
                    with contextlib.suppress(GpudError):
                        await self._post(serve, spec, "/wake_up")
                    raise
                asleep_at = loop.time()
                seen = await self._draw_down(serve, target)
            # Asleep now: what follows records it. A record that cannot be committed (a full or
            # read-only store) leaves the ledger holding its full size, so the sleep is undone:
            # the ledger never says less than what runs.
            try:
                now = await self._process(serve)
                if now != asked:
                    # The process asked is not the serve's any more (restarted meanwhile): the new
                    # one is awake and loads at its full size, which it still holds.
                    await self._restarted_in_sleep(serve, spec, asked, now)
                # The serve's own time (its answer to /sleep and the confirmation), and how long
                # observation took to show its memory back: gpud's overhead is the rest.
                timing = {"serve_ms": round((asleep_at - began) * 1000, 1),
                          "draw_ms": round((loop.time() - asleep_at) * 1000, 1)}
                target = await self._record_sleep(
                    serve, spec, uid, level, res, target=target, awake_seen=awake_seen,
                    seen=seen, parked=parked, timing=timing, preempted_by=preempted_by,
                    idle_s=idle_s, drained=drained, evicted_for=evicted_for)
            except StoreError as exc:
                raise await self._undo_sleep(serve, spec, level, exc) from exc
        return {"level": level, "from_mib": res.mib, "sleep_mib": target,
                "parked_host_mib": parked, **timing,
                **({"in_flight": drained.details()} if drained is not None else {})}

    async def _sleep_target(self, serve: str, spec: ServeConfig) -> tuple[int | None, int | None]:
        """The sleep reservation configured or measured (None: to be measured by this sleep)
        and what observation sees the serve draw awake; refused when neither is known."""
        target = self.sleep_mib(serve, spec)
        if target is None and not self.observer.available:
            raise Refused(f"serve {serve!r} not put to sleep: no sleep_mib (set serves."
                          f"{serve}.sleep_mib, or let gpud measure it after a sleep, which "
                          "needs observation)", {"serve": serve})
        if target is None:
            await self.observer.sample()  # what it draws awake, now
        awake_seen = self.observer.observed_each_mib(serve)
        if target is None and not awake_seen:
            raise Refused(f"serve {serve!r} not put to sleep: no sleep_mib, and observation "
                          f"attributes none of its memory to it ({awake_seen} MiB seen "
                          f"awake), so its sleep draw cannot be measured (set serves."
                          f"{serve}.sleep_mib)", {"serve": serve})
        return target, awake_seen

    async def _record_sleep(self, serve: str, spec: ServeConfig, uid: int | None, level: int,
                            res: Reservation, *, target: int | None, awake_seen: int | None,
                            seen: int | None, parked: int, timing: dict[str, float],
                            preempted_by: str | None, idle_s: float | None,
                            drained: Drain | None = None, evicted_for: str | None = None) -> int:
        """Record a sleep done: the shrink to its sleep reservation (never less than it holds),
        its state, event and note in one transaction, with what became of the requests in
        flight (DRAINED, for gpud's own sleeps). Returns the sleep reservation."""
        # Never less than it holds: the ledger must not say memory is free that is not.
        target = sleep_reservation(
            res.mib, configured_mib=target, awake_seen_mib=awake_seen, asleep_seen_mib=seen,
            tolerance_mib=self.svc.config.daemon.overdraw_tolerance_mib)
        if seen is not None and awake_seen:
            await self.svc.put_meta(measured_key(serve), json.dumps(
                {"fingerprint": fingerprint(spec), "mib": seen}))
        why = (f"preempted by {preempted_by}" if preempted_by
               else f"evicted for {evicted_for}" if evicted_for
               else f"idle {idle_s:g} s without a request" if idle_s is not None
               else "put to sleep")
        note = {"level": level, "preempted_by": preempted_by, "parked_host_mib": parked,
                "awake_mib": res.mib}
        message = (f"{serve} asleep (level {level}, {why}): reservation {res.mib} -> "
                   f"{target} MiB" + (f", {parked} MiB parked in host RAM" if parked else "")
                   + (f"; {drained.line()}" if drained is not None else ""))
        await self.svc.admit(
            serve, target, uid=uid, happened=Happened.ASLEEP, shrink=True,
            state_reason=f"asleep (level {level}, {why})",
            event=(EventKind.SLEEP, message, {"level": level, "from_mib": res.mib,
                                              "parked_host_mib": parked, "observed_mib": seen,
                                              **timing,
                                              **({"preempted_by": preempted_by}
                                                 if preempted_by else {}),
                                              **({"evicted_for": evicted_for}
                                                 if evicted_for else {}),
                                              **({"idle_s": idle_s}
                                                 if idle_s is not None else {}),
                                              **({"in_flight": drained.details()}
                                                 if drained is not None else {})}),
            meta={meta_key(serve): json.dumps(note)})
        return target

    async def _undo_sleep(self, serve: str, spec: ServeConfig, level: int,
                          exc: StoreError) -> StoreError:
        """The sleep of `serve` could not be recorded (`exc`): wake it back, so that it runs at
        the size the ledger still holds for it; the error to answer, saying which it is."""
        log.error("%s: its sleep could not be recorded (%s): waking it back", serve, exc.message)
        try:
            await self._wake_up(serve, spec, level)
            await self._confirm(serve, spec, asleep=False)
        except GpudError as woke:
            log.error("%s: could not be woken back (%s): asleep, its full reservation kept",
                      serve, woke.message)
            return StoreError(f"serve {serve!r}: its sleep could not be recorded "
                              f"({exc.message}), and waking it back failed ({woke.message}): "
                              "it sleeps holding its full reservation", {"serve": serve})
        return StoreError(f"serve {serve!r} not put to sleep: its sleep could not be recorded "
                          f"({exc.message}); woken back, it runs at its full reservation",
                          {"serve": serve})

    async def _wake_up(self, serve: str, spec: ServeConfig, level: int | None = None) -> None:
        """Level 1: `POST /wake_up` (the weights come back from host RAM). Level 2 discarded
        them: a bare wake would answer from uninitialised memory, so the weights' memory comes
        back first, then the weights are loaded again in place, then the KV cache (vLLM's own
        restore: docs/features/sleep_mode.md, "Online Serving", level 2). `level`: the sleep's
        (default: the one its note records)."""
        if (level if level is not None else self.note(serve).get("level")) != 2:
            await self._post(serve, spec, "/wake_up")
            return
        await self._post(serve, spec, "/wake_up?tags=weights")
        await self._post(serve, spec, "/collective_rpc", {"method": "reload_weights"})
        await self._post(serve, spec, "/wake_up?tags=kv_cache")

    async def _process(self, serve: str) -> tuple[int, str] | None:
        """The serve's process as systemd says now: (MainPID, unit InvocationID); None when it
        has none or it cannot be read."""
        try:
            st = await self.serves.units.state(serve)
        except GpudError:
            return None
        if st is None or not st.main_pid or st.gone:
            return None
        return st.main_pid, st.invocation_id

    async def _restarted_in_sleep(self, serve: str, spec: ServeConfig,
                                  asked: tuple[int, str] | None,
                                  now: tuple[int, str] | None) -> None:
        def who(p: tuple[int, str] | None) -> str:
            return f"MainPID {p[0]}, invocation {p[1][:12]}" if p else "no process"

        res = self.svc.ledger.reservations.get(serve)
        reason = (f"restarted while it was put to sleep (asked {who(asked)}, now {who(now)}): "
                  "awake at its full size")
        await self.svc.store_event(self.svc.event(
            EventKind.RESTART, f"{serve}: {reason}; the sleep is not committed, reservation "
            f"{res.mib if res else 0} MiB kept", serve=serve, role=spec.role,
            mib=res.mib if res else None, main_pid=now[0] if now else None),
            report=self.svc.report(serve, Happened.RESTARTING, reason))
        self.serves.runtime.spawn(self.serves.health_job.watch_restart(serve))
        raise Conflict(f"serve {serve!r} not put to sleep: {reason}", {"serve": serve})

    def _check_host_ram(self, serve: str, parked: int, level: int = 1) -> None:
        available = self.host_memory()
        margin = self.svc.config.daemon.sleep_host_margin_mib
        if self.vllm.level2_parks_host:
            # vLLM 0.34: vllm/device_allocator/sleep_mode_backend.py:126-132, cumem.py:261-306
            what = ("its weights and CUDA graphs" if level == 1 else
                    "its CUDA graphs and runtime allocations (all but the parameters)")
            said = f"(vLLM {self.vllm.version} parks them at level {level})"
            unreadable = f"level {level} parks {what} in host RAM on vLLM {self.vllm.version}"
        else:
            what, said = "its weights", "(level 2 parks nothing)"
            unreadable = "level 1 parks the weights in host RAM; level 2 needs none"
        if available is None:
            raise Refused(f"serve {serve!r} not put to sleep at level {level}: MemAvailable "
                          f"cannot be read ({unreadable})", {"serve": serve})
        if available < parked + margin:
            raise Refused(
                f"serve {serve!r} not put to sleep at level {level}: host RAM: {what} "
                f"({parked} MiB) plus the margin ({margin} MiB) need {parked + margin} MiB, "
                f"MemAvailable is {available} MiB, short {parked + margin - available} MiB "
                f"{said}",
                {"serve": serve, "bound": DenialBound.HOST_RAM, "need_mib": parked + margin,
                 "free_mib": available})

    async def wake(self, serve: str, uid: int | None, *, locked: bool = False,
                   by: str = "gpuctl wake", preempt: bool = False) -> dict[str, Any]:
        """Wake SERVE: re-admitted at its awake reservation, then vLLM's /wake_up. With
        `preempt`, serves of lower priority on its roles are put to sleep (or stopped) to make
        room, as a start with preempt does (the same planner, admit_preempting): the plan is in
        the wake's events and its answer."""
        spec = self._sleeper(serve)
        async with contextlib.AsyncExitStack() as stack:
            if not locked:
                await stack.enter_async_context(self.role_lock(spec.role))
            await stack.enter_async_context(self.serves.runtime.serve_lock(serve))
            state = self.svc.state_of(serve)
            if state != SLEEPING:
                raise Conflict(f"serve {serve!r} is {state}, not sleeping", {"serve": serve,
                                                                           "state": state})
            self.serves.runtime.step(serve, WakeAsked())
            stack.callback(self.serves.runtime.step, serve, SlumberEnded())
            asleep = self.svc.ledger.reservations[serve].mib
            awake = self.awake_mib(serve, spec)
            # Denied: it stays asleep, the denial recorded with its reason.
            readmit = (EventKind.ADMIT, f"{serve} re-admitted to wake: {awake} MiB (was {asleep} "
                       "MiB asleep)", {"waking": True})
            plan: dict[str, Any] | None = None
            if preempt:
                carried = await self.preemption.admit_preempting(serve, awake, uid, locked=True,
                                                                 happened=Happened.WAKE_ADMITTED,
                                                                 event=readmit)
                plan = carried.get("preemption")
            else:
                await self.svc.admit(serve, awake, uid=uid, happened=Happened.WAKE_ADMITTED,
                                     event=readmit)
            loop = asyncio.get_running_loop()
            began = loop.time()
            try:
                async with self.serves.runtime.device_locks(serve):  # its memory grows: no start's window
                    await self._wake_up(serve, spec)
                    await self._confirm(serve, spec, asleep=False)
            except GpudError as exc:
                said = await self.is_sleeping(serve, spec)
                if said is None:
                    # No answer: it may be waking, or half awake. It keeps its full
                    # reservation and is restarted or stopped, as its restart policy says.
                    await self.serves.health_job.wake_failed(serve, spec, f"the wake failed: {exc.message}")
                    raise
                if said:
                    # Still asleep, as it says: back to its sleep reservation.
                    await self.svc.admit(serve, asleep, uid=uid, happened=Happened.ASLEEP,
                                         shrink=True,
                                         event=(EventKind.SLEEP, f"{serve} did not wake "
                                                f"({exc.message}): back to {asleep} MiB",
                                                {"wake_failed": True}))
                    raise
                # awake after all (it says so): the wake is done
            took = loop.time() - began
            steps = "; ".join(plan["lines"][1:-1]).strip() if plan else ""
            await self.svc.store_event(self.svc.event(
                EventKind.WAKE, f"{serve} awake ({by}): {awake} MiB; the serve took "
                f"{took * 1000:.0f} ms" + (f"; preempted: {steps}" if plan else ""),
                serve=serve, role=spec.role, mib=awake, uid=uid,
                by=by, serve_ms=round(took * 1000, 1),
                **({"preemption": plan} if plan else {})),
                # awake, and its sleep's note gone, in one commit (last_said reads the note)
                report=self.svc.report(serve, Happened.WOKEN), meta={meta_key(serve): None})
        out: dict[str, Any] = {"mib": awake, "serve_ms": round(took * 1000, 1)}
        if preempt:
            out["preemption"] = plan
        return out

    # ---- wake-back ---------------------------------------------------------------------------

    def freed(self, role: str) -> None:
        """Memory was released on `role`: wake its preempted serves by priority while they fit
        (unless daemon.auto_wake is off)."""
        if not self.svc.config.daemon.auto_wake:
            return
        task = self._wake_back.get(role)
        if task is not None and not task.done():
            self._wake_again.add(role)
            return
        self._wake_back[role] = self.serves.runtime.spawn(self._wake_back_role(role))

    async def _wake_back_role(self, role: str) -> None:
        while True:
            self._wake_again.discard(role)
            try:
                async with self.role_lock(role):
                    await self._wake_fitting(role)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("waking serves back on %s failed", role)
            if role not in self._wake_again:
                return

    async def _wake_fitting(self, role: str) -> None:
        sleepers = sorted(
            (spec.priority, name) for name, spec in self.svc.config.serves.items()
            if role in spec.all_roles and self.svc.state_of(name) == SLEEPING
            and self.note(name).get("preempted_by"))
        if sleepers:
            # what a stop released shows as free on the device only once its process is gone
            await self.serves.memory.back_all(sleepers[0][1])
        for _, name in sleepers:
            spec = self.svc.config.serves[name]
            awake = self.awake_mib(name, spec)
            if any(self.svc.free_for(name, r) < awake for r in spec.all_roles):
                return  # by priority: a lower one does not jump the queue
            try:
                await self.wake(name, None, locked=True, by="wake-back: memory released")
            except GpudError as exc:
                log.warning("wake-back of %s: %s", name, exc.message)
                return

    # ---- adoption after a restart ------------------------------------------------------------

    async def adopt(self, serve: str, spec: ServeConfig, recorded: ServeState, *,
                    overdrawn: bool = False) -> ServeState:
        """The state a serve found running after a restart takes (`found`, decided by its one
        step, gpud.core.serverecord)."""
        state = next_state(Record(recorded), Report(
            await self.found(serve, spec, recorded, overdrawn=overdrawn)))
        assert state is not None  # a found-* report always leads to a state
        return state

    def last_said(self, serve: str, spec: ServeConfig, recorded: ServeState) -> ServeState | None:
        """What a serve found running after a restart was last known to be, to ask it about
        (`found`): asleep when recorded so, or when a stop or start gpud began while it slept
        was cut short (recorded stopping or starting, its sleep's note still kept: only the
        wake's commit and a stop's end drop it), though its reservation is then still its
        sleep reservation; running when recorded so and it can sleep; None when there is no
        sleep to ask about (it is found active, its health asked)."""
        if recorded == SLEEPING or (recorded != RUNNING and self.note(serve)):
            return SLEEPING
        if recorded == RUNNING and spec.sleep_level:
            return RUNNING
        return None

    async def found(self, serve: str, spec: ServeConfig, recorded: ServeState, *,
                    overdrawn: bool = False) -> Happened:
        """What is found of a serve running after a restart, recorded `recorded` (sleeping,
        or running with a sleep_level), decided by the rule the health check's reconciliation
        follows (gpud.core.reconcile): asleep it stays so, its reservation unchanged (a gpud
        stopped between vLLM's sleep and the shrink kept the full one: more than it holds,
        never less). A serve recorded asleep that is awake again (`overdrawn`: observation sees
        it draw over its sleep reservation, whatever it answers) is re-admitted at its awake
        size only when that fits, as a serve woken outside gpud is, and starts over; when it
        does not fit it stays recorded asleep, and the first health check puts it back to
        sleep or stops it (gpud.life.reconciling), as it would any serve woken outside gpud."""
        asleep = await self.is_sleeping(serve, spec)
        awake = self.awake_mib(serve, spec)
        fits = all(self.svc.free_for(serve, r) >= awake for r in spec.all_roles)
        decision = reconcile(recorded, asleep, overdrawn=overdrawn, awake_fits=fits,
                             preemptible=spec.preemptible)
        if decision is Reconcile.SHOW_ASLEEP:
            log.warning("%s is asleep though recorded running: adopted asleep at its "
                        "reservation", serve)
            return Happened.FOUND_ASLEEP
        if decision is Reconcile.AGREE:
            return Happened.FOUND_AS_RECORDED
        if decision is not Reconcile.ADMIT_AWAKE:
            log.warning("%s was asleep when gpud stopped and is awake (is_sleeping %s), but "
                        "its %d MiB awake do not fit: adopted asleep; the first health check "
                        "%s", serve, asleep, awake,
                        "stops it" if decision is Reconcile.STOP else "puts it back to sleep")
            return Happened.FOUND_ASLEEP
        log.warning("%s was asleep when gpud stopped and says is_sleeping %s: adopted as "
                    "awake at %d MiB", serve, asleep, awake)
        await self.svc.adopt(serve, spec.all_roles, awake)
        await self.svc.put_meta(meta_key(serve), None)
        return Happened.FOUND_AWAKE
