"""Health: a starting serve waited on until it answers, running and sleeping serves checked each
round (concurrently, each on its own timeout), the listener on a serve's port told apart from
someone else's, and an unhealthy serve restarted through its unit or failed."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import aiohttp

from gpud.config import ServeConfig
from gpud.core.health import Answer, Probe, healthy_at_start, judge_running
from gpud.core.lifecycle import (
    CrashLoop,
    HealthCounted,
    Job,
    JobBegan,
    JobEnded,
    PortChecked,
    UnitSeen,
    Watch,
    WatchAsked,
    WatchEnded,
    own_listener_trusted,
)
from gpud.core.serverecord import Happened, UnitPid
from gpud.core.unitstate import ACTIVE
from gpud.core.vocab import (
    FAILED,
    RUNNING,
    SLEEPING,
    STARTING,
    EventKind,
)
from gpud.errors import GpudError, StoreError
from gpud.host import ports
from gpud.life.reconciling import Reconciler
from gpud.life.supervisor.base import (
    HEALTH_CONCURRENCY,
    UNIT_JOB_TIMEOUT_S,
    Failing,
    Prober,
    Runtime,
    log,
)
from gpud.nginx.front import open_to_front

# How often a starting serve's health endpoint is asked while gpud waits on it: soon at first
# (a small serve is up in a fraction of a second, and the next start on the device waits for
# it), then less and less often (vLLM loading weights takes minutes).
START_POLL_FIRST_S = 0.02
START_POLL_FAST_FOR_S = 3.0
START_POLL_MAX_S = 1.0
# A serve's own listener, once found, is trusted this long for the same main process before
# /proc is read again (reading /proc/net/tcp at every check of every serve would not be cheap
# on a host with many connections). A foreign holder is looked up again at every check.
PORT_RECHECK_S = 10.0


class HttpProbe:
    """A serve's health endpoint asked over HTTP (its socket when fronted), and the listener on
    its port told apart from someone else's."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.svc = rt.svc

    async def probe(self, serve: str, spec: ServeConfig) -> Answer:
        """Ask the serve's health endpoint once (on the session's 2 s timeout)."""
        if spec.port is None:
            return Answer(Probe.OK, "no port: an active unit is all there is")
        url = (f"http://localhost{spec.health_path}" if spec.front else
               f"http://127.0.0.1:{spec.port}{spec.health_path}")
        if spec.front:
            open_to_front(self.svc.config.daemon, serve)
        try:
            async with self.rt.serve_http(serve, spec).get(url) as resp:
                status = resp.status
        except aiohttp.ClientConnectorError as exc:
            return Answer(Probe.REFUSED, f"cannot connect ({exc.os_error.strerror or exc})")
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return Answer(Probe.FAILED, str(exc) or type(exc).__name__)
        if status == 503:
            return Answer(Probe.ENGINE_DEAD, "503")
        if status != 200:
            return Answer(Probe.FAILED, f"status {status}")
        # A fronted serve's port is the front's; its socket only root and the front reach.
        holder = None if spec.front else await self._foreign_holder(serve, spec.port)
        if holder is not None:
            return Answer(Probe.FOREIGN, f"port {spec.port} is held by {holder}, not by the "
                                         f"serve's unit")
        return Answer(Probe.OK, "200")

    async def _foreign_holder(self, serve: str, port: int) -> str | None:
        """Who other than the serve's own unit listens on its port (None: the serve itself, or
        nobody can tell). The serve's own listener is trusted for PORT_RECHECK_S."""
        last = self.rt.life(serve).unit
        pid = last.main_pid if last is not None else 0
        if own_listener_trusted(self.rt.life(serve), pid, self.rt.clock(), PORT_RECHECK_S):
            return None
        group = last.control_group if last is not None else ""
        holder = await asyncio.to_thread(foreign_listener, serve, port, group)
        self.rt.step(serve, PortChecked(own=holder is None, pid=pid, at=self.rt.clock()))
        return holder


class HealthJob:
    """Health checks, and what their verdicts lead to."""

    def __init__(self, rt: Runtime, stops: Failing, reconciler: Reconciler,
                 prober: Prober) -> None:
        self.rt = rt
        self.svc = rt.svc
        self.stops = stops
        self.reconciler = reconciler
        self.prober = prober
        self._slots = asyncio.Semaphore(HEALTH_CONCURRENCY)

    async def await_healthy(self, serve: str, spec: ServeConfig, *,
                            promote: bool = True) -> bool:
        """Poll until health answers 200 (True; recorded as running when `promote`), or the
        start timeout (the serve fails), or the serve left `starting` some other way."""
        started = self.rt.clock()
        deadline = started + spec.start_timeout_s
        pause = START_POLL_FIRST_S
        foreign: str | None = None
        while self.rt.clock() < deadline:
            state = self.svc.state_of(serve)
            if state != STARTING:
                return False  # failed, stopped or promoted elsewhere
            # vLLM listens only once loaded: a refused connection means "loading" until the
            # start timeout, as does a 503 or an answer from someone else's socket.
            answer = await self.prober.probe(serve, spec)
            if healthy_at_start(answer):
                if promote:
                    await self.promote(serve)
                return True
            if answer.probe is Probe.FOREIGN:
                foreign = answer.detail
            await asyncio.sleep(pause)
            if self.rt.clock() - started > START_POLL_FAST_FOR_S:
                pause = min(START_POLL_MAX_S, pause * 1.5)
        if foreign is None and spec.port is not None and not spec.front:
            # Someone else's listener that does not answer 200 (taken during a restart
            # window, say): named all the same. A fronted serve's port is the front's, its
            # own listener (nginx): naming it would blame the front for a serve that never
            # answered on its socket (issue 41, L5).
            last = self.rt.life(serve).unit
            holder = await asyncio.to_thread(foreign_listener, serve, spec.port,
                                             last.control_group if last else "")
            if holder is not None:
                foreign = f"port {spec.port} is held by {holder}, not by the serve's unit"
        why = f"; {foreign}" if foreign else ""
        await self.stops.failed(serve, f"unhealthy: no 200 from {spec.health_path} within "
                                  f"{spec.start_timeout_s:g} s{why}", kind=EventKind.UNHEALTHY, stop=True)
        return False

    async def promote(self, serve: str, *, was_failed: str | None = None) -> None:
        self.rt.step(serve, HealthCounted(0))
        res = self.svc.ledger.reservations.get(serve)
        message = (f"{serve}: healthy again (was failed: {was_failed})" if was_failed
                   else f"{serve}: healthy")
        await self.svc.store_event(self.svc.event(
            EventKind.HEALTHY, message, serve=serve, role=res.role if res else None,
            mib=res.mib if res else None, recovered=was_failed is not None),
            report=self.svc.report(serve, Happened.HEALTHY))

    async def _unhealthy(self, serve: str, spec: ServeConfig, reason: str) -> None:
        """A running serve failed its health checks. It is restarted through its unit (counted
        toward the crash-loop limit, reservation kept) unless its restart policy is "no" or the
        crash-loop limit is reached: then it is stopped and `failed`. Never left running as
        `failed` while its reservation is gone."""
        res = self.svc.ledger.reservations.get(serve)
        if spec.restart == "no" or not self.rt.units.available:
            await self.stops.failed(serve, reason, kind=EventKind.UNHEALTHY, stop=True)
            return
        for loop in self.rt.step(serve, self.rt.counted(1)):
            if isinstance(loop, CrashLoop):
                await self.stops.failed(serve, f"{loop.reason}; last: {reason}", kind=EventKind.CRASH_LOOP,
                                   stop=True)
                return
        await self.svc.store_event(self.svc.event(
            EventKind.UNHEALTHY, f"{serve}: {reason}; restarting it through its unit (reservation kept)",
            serve=serve, role=spec.role, mib=res.mib if res else None,
            reservation="kept (restarting)" if res else "none held"),
            report=self.svc.report(serve, Happened.RESTARTING, f"restarting: {reason}"))
        # Its devices are held from the stop of the old process to the health of the new one,
        # as for a start: the new process loads and profiles alone on them.
        async with self.rt.device_locks(serve):
            self.rt.step(serve, JobBegan(Job.RESTART))
            try:
                fresh = await self.rt.units.restart(serve, spec.stop_timeout_s + UNIT_JOB_TIMEOUT_S)
            except GpudError as exc:
                self.rt.step(serve, JobEnded(Job.RESTART))
                await self.stops.failed(serve, f"{reason}; the restart failed: {exc.message}",
                                   kind=EventKind.UNHEALTHY, stop=True)
                return
            finally:
                self.rt.step(serve, JobEnded(Job.RESTART))
            if fresh is None or fresh.active_state not in ACTIVE:
                await self.stops.failed(serve, f"{reason}; its unit did not come back after the "
                                   "restart", kind=EventKind.EXIT)
                return
            self.rt.step(serve, UnitSeen(fresh))
            self.svc.records.apply(serve, UnitPid(fresh.main_pid or None))
            await self.svc.store_event(self.svc.event(
                EventKind.RESTART, f"{serve}: restarted through its unit after failing its health checks "
                f"(MainPID {fresh.main_pid})", serve=serve, main_pid=fresh.main_pid, by="gpud"))
            await self.watch_restart(serve)

    async def watch_restart(self, serve: str) -> None:
        """Wait for a serve that is starting again to answer (one watcher per serve: the
        unit's signals and gpud's own restart both ask for one)."""
        spec = self.svc.serve_spec(serve)
        if spec is None or Watch() not in self.rt.step(serve, WatchAsked()):
            return
        try:
            await self.await_healthy(serve, spec)
        finally:
            self.rt.step(serve, WatchEnded())

    async def wake_failed(self, serve: str, spec: ServeConfig, reason: str) -> None:
        """A wake got no answer (the caller holds the serve's lock): the serve may be half
        awake, so it keeps the full reservation its wake was admitted at, and is restarted
        through its unit (its restart policy allowing) or stopped and failed, in the
        background: the caller is answered now."""
        res = self.svc.ledger.reservations.get(serve)
        restart = spec.restart != "no" and self.rt.units.available
        what = "restarted through its unit" if restart else "stopped"
        await self.svc.store_event(self.svc.event(
            EventKind.UNHEALTHY, f"{serve}: {reason}; it keeps its full reservation "
            f"({res.mib if res else 0} MiB) and is {what}", serve=serve, role=spec.role,
            mib=res.mib if res else None, wake_failed=True),
            report=self.svc.report(serve, Happened.RESTARTING, f"restarting: {reason}")
            if restart else None)
        self.rt.spawn(self._after_failed_wake(serve, spec, reason, restart))

    async def _after_failed_wake(self, serve: str, spec: ServeConfig, reason: str,
                                 restart: bool) -> None:
        async with self.rt.serve_lock(serve):
            if self.svc.state_of(serve) not in (STARTING, SLEEPING) or self.svc.records.of(serve).stopping:
                return  # stopped or restarted meanwhile
            if restart:
                await self._unhealthy(serve, spec, reason)
            else:
                await self.stops.failed(serve, reason, kind=EventKind.UNHEALTHY, stop=True)

    async def loop(self) -> None:
        """The health checks, one round each health_interval_s, until cancelled."""
        while True:
            await asyncio.sleep(self.svc.config.daemon.health_interval_s)
            try:
                await self.check_running()
            except asyncio.CancelledError:
                raise
            except StoreError:
                pass  # the service says the store fails, once per interval: not every round
            except Exception:  # a failure must not end health checking for good
                log.exception("health check round failed; next round in %.1f s",
                              self.svc.config.daemon.health_interval_s)

    async def check_running(self) -> None:
        """Begin this round's checks: one per running or sleeping serve (and per failed serve
        whose unit is still active, which may come back), none for a serve whose last check is
        still in flight. Checks run concurrently, each on its own timeout: a slow or hung serve
        delays no other serve's verdict."""
        for serve, rec in list(self.svc.records.items()):
            if rec.state in (RUNNING, SLEEPING) or (rec.state == FAILED
                                                     and self.rt.unit_active(serve)):
                self._begin_check(serve)

    def _begin_check(self, serve: str) -> None:
        spec = self.svc.serve_spec(serve)
        if (self.rt.handles(serve).check is not None or self.svc.records.of(serve).stopping
                or spec is None):
            self.rt.prune(serve)
            return
        task = self.rt.spawn(self._check_one(serve, spec))
        self.rt.handles(serve).check = task
        task.add_done_callback(functools.partial(self._check_done, serve))

    async def on_observation(self, _obs: Any) -> None:
        """A sleeping serve drawing over its reservation may have been woken outside gpud:
        it is checked now, not at the next round."""
        for serve, rec in list(self.svc.records.items()):
            if rec.state == SLEEPING and self.reconciler.overdrawn(serve):
                self._begin_check(serve)

    def _check_done(self, serve: str, _task: asyncio.Task[None]) -> None:
        rec = self.rt.serves.get(serve)
        if rec is not None:
            rec.check = None
            self.rt.prune(serve)

    async def _check_one(self, serve: str, spec: ServeConfig) -> None:
        try:
            async with self._slots:
                answer = await self.prober.probe(serve, spec)
            state = self.svc.state_of(serve)
            if self.svc.records.of(serve).stopping or self.rt.serve_lock(serve).locked():
                return  # a lifecycle action of the serve is under way: it decides, not this
            if state == FAILED:
                if answer.probe is Probe.OK and self.rt.unit_active(serve):
                    rec = self.svc.records.get(serve)
                    await self.promote(serve, was_failed=rec.reason if rec else "?")
                return
            if state not in (RUNNING, SLEEPING):
                return
            verdict = judge_running(answer, self.rt.life(serve).health_failures,
                                    self.svc.config.daemon.health_failures,
                                    vllm=spec.vllm is not None, health_path=spec.health_path)
            if verdict.unhealthy is None:
                self.rt.step(serve, HealthCounted(verdict.failures))
                if not verdict.failures:
                    # What it says it is, against the ledger (woken or slept outside gpud).
                    await self.reconciler.check(serve, spec)
                return
            self.rt.step(serve, HealthCounted(0))
            async with self.rt.serve_lock(serve):  # a restart is a lifecycle action like any
                if self.svc.state_of(serve) != state or self.svc.records.of(serve).stopping:
                    return
                if state == SLEEPING:
                    # Restarted, it would load at its full size on its sleep reservation.
                    await self.stops.failed(serve, f"{verdict.unhealthy} while asleep",
                                       kind=EventKind.UNHEALTHY, stop=True)
                    return
                await self._unhealthy(serve, spec, verdict.unhealthy)
        except asyncio.CancelledError:
            raise
        except StoreError:
            pass  # the service says the store fails, once per interval: not once per check
        except Exception:  # a failure must not end checking this serve for good
            log.exception("health check of %s failed", serve)



def port_holders(port: int) -> list[ports.Holder] | None:
    """Who listens on `port` (None: nobody); blocking."""
    found = ports.listeners(port)
    if found is not None:
        if not found:
            return None
        held: list[ports.Holder] = []
        for cgroup in sorted({item.cgroup_id for item in found if item.cgroup_id is not None}):
            held.extend(ports.cgroup_holders(cgroup))
        return held
    inodes = ports.listening_inodes(port)
    return ports.holders(inodes) if inodes else None


def foreign_listener(serve: str, port: int, control_group: str) -> str | None:
    """Who listens on `port`, when it is not the serve's own unit (blocking). Socket
    diagnostics name each listener's cgroup; without them /proc is read (the serve's own
    cgroup first, every process only otherwise)."""
    found = ports.listeners(port)
    if found is not None:
        if not found:
            return None  # the listener closed since it answered
        own = ports.cgroup_ids(control_group) if control_group else set()
        if any(item.cgroup_id in own for item in found):
            return None
        held = port_holders(port) or []
        if any(h.serve == serve for h in held):
            return None
        return ", ".join(h.describe() for h in held) or "a process gpud cannot see"
    inodes = ports.listening_inodes(port)
    if not inodes:
        return None  # no /proc/net/tcp, or the listener closed since it answered
    pids = ports.cgroup_pids(control_group) if control_group else None
    if pids is not None and any(h.serve == serve for h in ports.holders(inodes, pids)):
        return None
    everyone = ports.holders(inodes)
    if any(h.serve == serve for h in everyone):
        return None
    return ", ".join(h.describe() for h in everyone) or "a process gpud cannot see"

