"""Serves under systemd: launch, adopt, boot the resident set, watch health and crash loops.

A start that profiles memory has its devices to itself: vLLM instances that profile memory at
the same time on one GPU mis-size each other, so such a serve is started, waited on until
healthy (or its timeout), and only then the next. Serves sized exactly (vllm.kv_cache_mib:
--kv-cache-memory-bytes, no profiling) share their devices' locks and start together
(gpud.core.launch.start_sharing); different devices proceed in parallel. Unit state comes from D-Bus signals
(gpud.units), health from polling each serve's health endpoint.

One module per job: `boot` (reconciliation, the resident set), `launch` (a start), `health`
(health checks and their verdicts), `stop` (stops, failures, memory coming back), `watch` (the
units' signals); `base` what they share. `Supervisor` is all of them, and what the service
(gpud.service.Supervision), the sleep controller and the reconciler (gpud.sleeping.Serves) ask.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any

import aiohttp

from gpud.config import Config, ServeConfig
from gpud.core.lifecycle import Input, LifeAction
from gpud.core.unitstate import UnitState
from gpud.front import SocketSessions
from gpud.hostmem import host_memory
from gpud.locks import Locks
from gpud.observer import Observer
from gpud.reconciling import Reconciler
from gpud.service import LedgerService
from gpud.sleeping import Sleeps
from gpud.supervisor.base import (
    HEALTH_CONCURRENCY,
    OUTSIDE_STOP,
    UNCALIBRATED,
    UNIT_JOB_TIMEOUT_S,
    Calibrated,
    LifeRecord,
    read_exit_lines,
)
from gpud.supervisor.boot import BootJob
from gpud.supervisor.health import HealthJob
from gpud.supervisor.launch import LaunchJob
from gpud.supervisor.stop import StopJob
from gpud.supervisor.watch import UnitWatch
from gpud.unit_properties import host_home
from gpud.units import SystemdUnits

__all__ = ["OUTSIDE_STOP", "UNCALIBRATED", "UNIT_JOB_TIMEOUT_S", "Calibrated", "LifeRecord",
           "Supervisor", "make_supervisor", "read_exit_lines"]


class Supervisor(BootJob, LaunchJob, HealthJob, StopJob, UnitWatch):
    """The serves under systemd: every job of gpud.supervisor's modules, made one."""

    def __init__(self, svc: LedgerService, units: SystemdUnits, observer: Observer, *,
                 notify: Callable[[str], None] = lambda _m: None,
                 clock: Callable[[], float] = time.monotonic,
                 journal: Callable[[str, str | None], Awaitable[list[str]]] = read_exit_lines,
                 calibrated: Calibrated = UNCALIBRATED,
                 home_of: Callable[[str], str | None] = host_home,
                 ) -> None:
        self.svc = svc
        self.units = units
        self.observer = observer
        self.notify = notify
        self.clock = clock
        self.journal = journal
        self.home_of = home_of
        self.locks = Locks()
        self.serves: dict[str, LifeRecord] = {}
        self._health_slots = asyncio.Semaphore(HEALTH_CONCURRENCY)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._unit_events: asyncio.Queue[UnitState | list[UnitState]] = asyncio.Queue()
        self._http: aiohttp.ClientSession | None = None
        self._sockets = SocketSessions()
        self._life_listeners = []
        self.booted = asyncio.Event()
        self.calibrated = calibrated
        self.sleeps = Sleeps(self, svc, observer,
                             host_memory=host_memory(getattr(observer, "backend", None)),
                             weights=calibrated.weights_mib, graphs=calibrated.cudagraph_mib)
        self.reconciler = Reconciler(self, svc, self.sleeps, observer)

    async def __aenter__(self) -> Supervisor:
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2))
        self.units.watch(self._unit_events.put_nowait, self._unit_events.put_nowait)
        await self.units.connect()
        self.svc.supervise(self)
        self.observer.listen(self._on_observation)
        self._spawn(self._unit_loop())
        self._spawn(self._health_loop())
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.units.close()
        if self._http is not None:
            await self._http.close()
        await self._sockets.close()

    # What the service asks of its supervision (gpud.service.Supervision).
    def lifecycle(self, serve: str, inp: Input) -> list[LifeAction]:
        """Change the serve's life by `inp` (a sleep or a wake begun or ended)."""
        return self._step(serve, inp)

    def launch_under_way(self, serve: str) -> bool:
        return self.life(serve).launching

    def freed(self, role: str) -> None:
        self.sleeps.freed(role)

    # What gpud.sleeping and gpud.reconciling ask of the supervisor (gpud.sleeping.Serves).
    async def unit_state(self, serve: str) -> UnitState | None:
        return await self.units.state(serve)

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        return self._spawn(coro)

    def spec_of(self, serve: str) -> ServeConfig:
        return self._spec(serve)

    async def memory_back_for(self, serve: str) -> None:
        """Wait (bounded) until the stops in progress on the serve's devices are done and their
        memory shows as free (as a start does first)."""
        await self._memory_back_all(serve)

    def busy(self, serve: str) -> bool:
        return self.life(serve).busy

    def launching(self) -> tuple[bool, str | None]:
        if self.units.available:
            return True, None
        return False, f"system bus: {self.units.reason}"



def make_supervisor(svc: LedgerService, cfg: Config, *, observer: Observer,
                    notify: Callable[[str], None],
                    calibrated: Calibrated = UNCALIBRATED) -> Supervisor:
    return Supervisor(svc, SystemdUnits(), observer, notify=notify, calibrated=calibrated)
