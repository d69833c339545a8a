"""Serves under systemd: launch, adopt, boot the resident set, watch health and crash loops.

A start that profiles memory has its devices to itself: vLLM instances that profile memory at
the same time on one GPU mis-size each other, so such a serve is started, waited on until
healthy (or its timeout), and only then the next. Serves sized exactly (vllm.kv_cache_mib:
--kv-cache-memory-bytes, no profiling) share their devices' locks and start together
(gpud.core.launch.start_sharing); different devices proceed in parallel. Unit state comes from D-Bus signals
(gpud.host.units), health from polling each serve's health endpoint.

One module per job, each job an object holding only what it asks of the others (the protocols
of `base`): `stop` (stops, failures, memory coming back: StopJob, MemoryReturn), `health`
(health checks and their verdicts: HealthJob, HttpProbe), `launch` (a start: LaunchJob), `watch`
(the units' signals: UnitWatch), `boot` (reconciliation, the resident set: BootJob); the sleeps
are gpud.life.sleeping's. `base` has what they all share (Runtime). `Supervisor` makes each once, in
that order, and holds them as named parts; the rest of gpud asks the part that does the work
(`sup.launch_job.start`, `sup.stop_job.stop`, `sup.boot_job.boot`, `sup.runtime.life`,
`sup.sleeps.wake`; the sleep controller and the reconciler by gpud.life.sleeping.SleepSupervisor).
What the supervisor itself does is a restart (a stop, then a start), the on-demand bring-up's
task, and what the service asks of its supervision (gpud.life.service.Supervision).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from types import TracebackType

from gpud.config import Config
from gpud.core.launch import stop_budget, tells_abort
from gpud.core.vocab import RUNNING
from gpud.host.hostmem import host_memory
from gpud.host.observer import Observer
from gpud.host.unit_journal import read_exit_lines
from gpud.host.unit_properties import host_home
from gpud.host.units import SystemdUnits
from gpud.life.reconciling import Reconciler
from gpud.life.service import LedgerService
from gpud.life.sleeping import Sleeps
from gpud.life.supervisor.base import (
    OUTSIDE_STOP,
    UNCALIBRATED,
    UNIT_JOB_TIMEOUT_S,
    CalibrationSource,
    Handles,
    Prober,
    Runtime,
    ServeClients,
)
from gpud.life.supervisor.boot import BootJob
from gpud.life.supervisor.health import HealthJob, HttpProbe
from gpud.life.supervisor.launch import LaunchJob
from gpud.life.supervisor.stop import MemoryReturn, StopJob
from gpud.life.supervisor.watch import UnitWatch
from gpud.life.traffic import Drains, drain_and_stop

__all__ = ["OUTSIDE_STOP", "UNCALIBRATED", "UNIT_JOB_TIMEOUT_S", "CalibrationSource", "Handles",
           "ServeClients", "Supervisor", "make_supervisor"]


class Supervisor:
    """The serves under systemd: every job of gpud.life.supervisor's modules, composed."""

    def __init__(self, svc: LedgerService, units: SystemdUnits, observer: Observer, *,
                 notify: Callable[[str], None] = lambda _m: None,
                 clock: Callable[[], float] = time.monotonic,
                 journal: Callable[[str, str | None], Awaitable[list[str]]] = read_exit_lines,
                 calibrated: CalibrationSource = UNCALIBRATED,
                 home_of: Callable[[str], str | None] = host_home,
                 prober: Prober | None = None,
                 clients: ServeClients | None = None,
                 traffic: Drains | None = None,
                 ) -> None:
        self.svc = svc
        self.units = units
        self.observer = observer
        # The serves' HTTP clients: the daemon's (which the in-flight reader shares), else the
        # supervisor's own, opened and closed with it.
        self._own_clients = clients is None
        self.clients = clients if clients is not None else ServeClients(
            lambda: svc.config.daemon.serve_socket_dir)
        self.runtime = rt = Runtime(svc, units, observer, clients=self.clients, clock=clock,
                                    calibrated=calibrated)
        # The sleep controller and the reconciler ask the supervisor's parts
        # (gpud.life.sleeping.SleepSupervisor); a preemption drains through `traffic` first.
        self.sleeps = Sleeps(self, svc, observer,
                             host_memory=host_memory(getattr(observer, "backend", None)),
                             weights=calibrated.weights_mib, graphs=calibrated.cudagraph_mib,
                             traffic=traffic)
        self.reconciler = Reconciler(self, svc, self.sleeps, observer)
        self.memory = MemoryReturn(rt)
        self.stop_job = StopJob(rt, self.memory, journal=journal)
        self.health_job = HealthJob(rt, self.stop_job, self.reconciler,
                                    prober if prober is not None else HttpProbe(rt))
        self.launch_job = LaunchJob(rt, self.health_job, self.stop_job, self.memory,
                                    self.sleeps, home_of=home_of)
        self.watch_job = UnitWatch(rt, self.health_job, self.stop_job)
        self.boot_job = BootJob(rt, self.launch_job, self.health_job, self.stop_job,
                                self.sleeps, self.reconciler, notify=notify)

    async def __aenter__(self) -> Supervisor:
        if self._own_clients:
            await self.clients.__aenter__()
        self.units.watch(self.watch_job.heard, self.watch_job.heard)
        await self.units.connect()
        self.svc.supervise(self)
        self.observer.listen(self.health_job.on_observation)
        self.runtime.spawn(self.watch_job.loop())
        self.runtime.spawn(self.health_job.loop())
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        tasks = self.runtime.tasks
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.units.close()
        if self._own_clients:
            await self.clients.__aexit__(exc_type, exc, tb)

    # What the supervisor itself does, beyond making its parts: a restart (a stop that keeps
    # the reservation, then a start), the on-demand bring-up's task, and what the service asks
    # of its supervision (gpud.life.service.Supervision). The rest of gpud asks the part that
    # does the work: `runtime` (the serves' handles, lives, locks, specs), `launch_job`,
    # `stop_job`, `health_job`, `boot_job`, `memory`, `sleeps`, `reconciler`.
    async def stop(self, serve: str, uid: int | None, *, keep_reservation: bool = False) -> None:
        """An operator's stop (`gpuctl stop`, a release that stops, a restart). A running serve
        that can be told the end of its requests (gpud.core.launch.tells_abort) is drained
        first for as long as its own shutdown would let them finish (`--shutdown-timeout`:
        stop_budget), and what is still in flight then is told its end (drain_to_stop) rather
        than cut by the stop: vLLM 0.32 on SIGTERM leaves a stream open with no last chunk.
        Any other serve is stopped at once, its own shutdown draining what it can."""
        spec = self.svc.serve_spec(serve)
        if spec is None or not tells_abort(spec) or self.svc.state_of(serve) != RUNNING:
            await self.stop_job.stop(serve, uid, keep_reservation=keep_reservation)
            return
        drain_s, _worker_s = stop_budget(spec.stop_timeout_s)
        await drain_and_stop(self.sleeps.traffic, self.stop_job, serve, spec, uid, drain_s,
                             cut=True, tell=functools.partial(self.sleeps.post, serve, spec),
                             keep_reservation=keep_reservation)

    async def restart(self, serve: str, uid: int | None) -> None:
        await self.stop(serve, uid, keep_reservation=True)
        await self.launch_job.start(serve, uid)

    def bringup(self, serve: str) -> asyncio.Task[None] | None:
        """The bring-up for requests through the serve's front under way, if one is
        (gpud.life.ondemand): a done one is kept until its callbacks have run."""
        handles = self.runtime.serves.get(serve)
        return handles.bringup if handles is not None else None

    def hold_bringup(self, serve: str, task: asyncio.Task[None]) -> None:
        """TASK is the serve's bring-up until it ends."""
        self.runtime.handles(serve).bringup = task

        def ended(done: asyncio.Task[None]) -> None:
            handles = self.runtime.serves.get(serve)
            if handles is not None and handles.bringup is done:
                handles.bringup = None
                self.runtime.prune(serve)

        task.add_done_callback(ended)

    def launch_under_way(self, serve: str) -> bool:
        return self.runtime.life(serve).launching

    def freed(self, role: str) -> None:
        self.sleeps.freed(role)

    def launching(self) -> tuple[bool, str | None]:
        if self.units.available:
            return True, None
        return False, f"system bus: {self.units.reason}"


def make_supervisor(svc: LedgerService, cfg: Config, *, observer: Observer,
                    notify: Callable[[str], None],
                    calibrated: CalibrationSource = UNCALIBRATED,
                    clients: ServeClients | None = None,
                    traffic: Drains | None = None) -> Supervisor:
    return Supervisor(svc, SystemdUnits(), observer, notify=notify, calibrated=calibrated,
                      clients=clients, traffic=traffic)
