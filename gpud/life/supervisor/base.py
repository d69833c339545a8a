"""What the supervisor's jobs share (`Runtime`: the service, the units, the observer, the locks,
each serve's life, stepped only by `Runtime.step` into the serve's one record
(gpud.life.records), the handles of the work under way for each serve, the HTTP clients, the
few facts every job asks) and what each job asks of another, each a narrow protocol (`Failing`,
`Ending`, `Healthy`, `Starts`, `Prober`). gpud.life.supervisor.Supervisor makes each job once and
hands it the others it needs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from gpud.config import ServeConfig
from gpud.core.front import socket_path
from gpud.core.health import Answer
from gpud.core.launch import with_kv_cache
from gpud.core.lifecycle import (
    Input,
    LifeAction,
    RestartsCounted,
    ServeLife,
)
from gpud.core.serverecord import Stepped, StoreState
from gpud.core.unitstate import (
    ACTIVE,
    UnitState,
)
from gpud.core.vocab import EventKind
from gpud.errors import Conflict, NotFound, Unavailable
from gpud.host.observer import Observer
from gpud.host.units import SystemdUnits
from gpud.life.locks import Locks, Taken
from gpud.life.service import LedgerService, check_serve_name
from gpud.nginx.front import SocketSessions

log = logging.getLogger("gpud.supervisor")

# How long gpud waits on a job of systemd's (a unit's start, an orphan's stop).
UNIT_JOB_TIMEOUT_S = 60.0
# Health checks of running serves in flight at once. Each has its own timeout, so a round costs
# one timeout however many serves are slow or hung; the bound keeps a host with hundreds of
# serves from opening hundreds of connections at once.
HEALTH_CONCURRENCY = 64
# The reason a serve stopped by an operator's `systemctl stop` keeps: boot does not start it
# again until someone asks (gpuctl start).
OUTSIDE_STOP = "stopped (outside gpud)"


def pid_text(main_pid: int) -> str:
    # MainPID is 0 between a unit's processes (a restart on its way): no PID to name yet.
    return f"MainPID {main_pid}" if main_pid else "no MainPID yet"


@dataclass
class Handles:
    """The handles of the work under way for one serve: asyncio tasks and events, which its
    frozen record cannot hold. What the serve is (its state, its life: gpud.core.lifecycle,
    changed only through `Runtime.step`) is its one record (gpud.life.records.ServeRecord)."""

    launch_task: asyncio.Task[None] | None = None  # its launch, while it runs
    check: asyncio.Task[None] | None = None  # its health check in flight
    # Set when gpuctl's stop of it is done: a start on its devices waits for that.
    stop_done: asyncio.Event | None = None
    # A bring-up for requests through its front (gpud.life.ondemand), while it runs.
    bringup: asyncio.Task[None] | None = None

    def idle(self) -> bool:
        return (self.launch_task is None and self.check is None and self.stop_done is None
                and self.bringup is None)


class CalibrationSource(Protocol):
    """What calibration says of a serve (gpud.life.calibration.Calibrator)."""

    def sizing_problem(self, serve: str) -> str | None:
        """Why its calibrated figures do not fit its reservation, if they do not."""
        ...

    def kv_cache_figure(self, serve: str) -> int | None:
        """The KV cache its calibration gives (kv_cache_mib = "calibrated")."""
        ...

    def weights_mib(self, serve: str) -> int | None:
        """Its calibrated weights, per device."""
        ...

    def cudagraph_mib(self, serve: str) -> int | None:
        """Its calibrated CUDA graph pool, per device."""
        ...


class _Uncalibrated:
    def sizing_problem(self, serve: str) -> str | None:
        return None

    def kv_cache_figure(self, serve: str) -> int | None:
        return None

    def weights_mib(self, serve: str) -> int | None:
        return None

    def cudagraph_mib(self, serve: str) -> int | None:
        return None


UNCALIBRATED: CalibrationSource = _Uncalibrated()


class Failing(Protocol):
    """A serve's end as a failure (gpud.life.supervisor.stop.StopJob)."""

    async def failed(self, serve: str, reason: str, *, kind: EventKind, stop: bool = False,
                     **details: Any) -> None: ...
    async def ended(self, serve: str, reason: str) -> None: ...


class Ending(Failing, Protocol):
    """Every end of a serve its unit's signals may mean (gpud.life.supervisor.stop.StopJob)."""

    async def stopped(self, serve: str, uid: int | None, *, keep: bool) -> None: ...
    async def outside_stop(self, serve: str, st: UnitState) -> None: ...


class Healthy(Protocol):
    """Waiting for a serve to answer (gpud.life.supervisor.health.HealthJob)."""

    async def await_healthy(self, serve: str, spec: ServeConfig, *,
                            promote: bool = True) -> bool: ...
    async def promote(self, serve: str, *, was_failed: str | None = None) -> None: ...
    async def watch_restart(self, serve: str) -> None: ...


class Starts(Protocol):
    """A serve's start (gpud.life.supervisor.launch.LaunchJob)."""

    async def start(self, serve: str, uid: int | None, *, wait: bool = False,
                    preempt: bool = False) -> dict[str, Any] | None: ...


class Prober(Protocol):
    """One question to a serve's health endpoint (gpud.life.supervisor.health.HttpProbe)."""

    async def probe(self, serve: str, spec: ServeConfig) -> Answer: ...


class ServeClients:
    """The HTTP clients of the serves' own listeners: one over loopback, and one per fronted
    serve's Unix socket (its directory as the config in force says). Open between
    `__aenter__` and `__aexit__`: whoever makes them (the daemon, else the supervisor) enters
    them before anything asks a serve."""

    def __init__(self, socket_dir: Callable[[], str]) -> None:
        self.socket_dir = socket_dir
        self.client: aiohttp.ClientSession | None = None
        self.sockets = SocketSessions()

    async def __aenter__(self) -> ServeClients:
        self.client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2))
        return self

    async def __aexit__(self, *_exc: object) -> None:
        if self.client is not None:
            await self.client.close()
        await self.sockets.close()

    def serve_http(self, serve: str, spec: ServeConfig) -> aiohttp.ClientSession:
        """The client of a serve's own listener: its Unix socket when it is fronted."""
        if spec.front:
            return self.sockets.session(socket_path(self.socket_dir(), serve))
        assert self.client is not None
        return self.client


class Runtime:
    """What every job of the supervisor shares (made once by Supervisor.__init__)."""

    def __init__(self, svc: LedgerService, units: SystemdUnits, observer: Observer, *,
                 clients: ServeClients, clock: Callable[[], float],
                 calibrated: CalibrationSource) -> None:
        self.svc = svc
        self.clients = clients
        self.units = units
        self.observer = observer
        self.clock = clock
        self.calibrated = calibrated
        # Every lock of a serve's lifecycle and of a device's memory, in one order (gpud.life.locks).
        self.locks = Locks()
        # The handles of the work under way for each serve (none for a serve with none).
        self.serves: dict[str, Handles] = {}
        self.tasks: set[asyncio.Task[Any]] = set()

    def life(self, serve: str) -> ServeLife:
        return self.svc.records.life(serve)

    def handles(self, serve: str) -> Handles:
        """The handles of what runs for the serve (made when first asked)."""
        return self.serves.setdefault(serve, Handles())

    def step(self, serve: str, inp: Input) -> list[LifeAction]:
        """Change the serve's life by `inp`: the serve's one step (gpud.core.serverecord.step)
        on its whole record, kept by its one writer (gpud.life.records.ServeRecords.apply; a
        lifecycle input changes no state); what to do about it."""
        stepped = self.svc.records.apply(serve, inp)
        assert isinstance(stepped, Stepped)  # the supervisor's inputs are never refused
        # (the serve's life told to who listens: gpud.life.records.ServeRecords.watch_lives)
        return [e for e in stepped.effects if not isinstance(e, StoreState)]

    def returning(self, device: str) -> set[str]:
        """The serves whose memory is on its way back to DEVICE."""
        return {s for s, rec in self.svc.records.items() if device in rec.life.returning}

    def prune(self, serve: str) -> None:
        rec = self.serves.get(serve)
        if rec is not None and rec.idle():
            del self.serves[serve]

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def need_bus(self) -> None:
        if not self.units.available:
            raise Unavailable(f"launching is unavailable: system bus: {self.units.reason}",
                              {"reason": self.units.reason})

    def spec(self, serve: str) -> ServeConfig:
        check_serve_name(serve)
        spec = self.svc.serve_spec(serve)
        if spec is None:
            if serve in self.svc.ledger.reservations:
                raise Conflict(f"serve {serve!r} is an external reservation: gpud does not "
                               "launch it", {"serve": serve})
            raise NotFound(f"unknown serve {serve!r}: not in the config", {"serve": serve})
        return spec

    def sized(self, serve: str, spec: ServeConfig) -> ServeConfig:
        """The serve's config with its KV cache as calibration gives it, where it asks."""
        return with_kv_cache(spec, self.calibrated.kv_cache_figure(serve))

    def device_key(self, serve: str) -> str:
        return self.device_keys(serve)[0]

    def device_keys(self, serve: str) -> list[str]:
        """The devices the serve runs on (one per role), as UUIDs where observation knows them."""
        spec = self.svc.serve_spec(serve)
        if spec is None:
            return [""]
        keys: list[str] = []
        for role in spec.all_roles:
            budget = self.svc.ledger.roles.get(role)
            ref = budget.device if budget else ""
            dev = self.observer.device(ref)
            keys.append(dev.uuid if dev else ref)
        return keys

    def unit_active(self, serve: str) -> bool:
        last = self.life(serve).unit
        return last is not None and last.active_state in ACTIVE

    async def stop_unit(self, serve: str, timeout: float) -> None:
        """Stop the serve's unit and have systemd forget it: a transient unit that failed stays
        loaded (and listed, and its name taken) until its failed state is reset."""
        await self.units.stop(serve, timeout)
        await self.units.reset_failed(serve)

    async def say(self, serve: str, role: str, kind: EventKind, message: str) -> None:
        await self.svc.store_event(self.svc.event(kind, message, serve=serve, role=role))

    def serve_http(self, serve: str, spec: ServeConfig) -> aiohttp.ClientSession:
        return self.clients.serve_http(serve, spec)

    def serve_lock(self, serve: str) -> Taken:
        return self.locks.serve(serve)

    def device_locks(self, serve: str, *, shared: bool = False) -> Taken:
        """The locks of every device the serve uses: held for the part of an action that
        changes their memory; `shared` by a start that does not profile (gpud.life.locks)."""
        return self.locks.devices(self.device_keys(serve), shared=shared)

    def counted(self, count: int) -> RestartsCounted:
        daemon = self.svc.config.daemon
        return RestartsCounted(count, self.clock(), daemon.crash_loop_window_s,
                               daemon.crash_loop_restarts)
