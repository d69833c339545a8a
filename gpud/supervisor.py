"""Serves under systemd: launch, adopt, boot the resident set, watch health and crash loops.

Starts are serialized per device: vLLM instances that profile memory at the same time on one GPU
mis-size each other, so one serve is started, waited on until healthy (or its timeout), and only
then the next; different devices proceed in parallel. Unit state comes from D-Bus signals
(gpud.units), health from polling each serve's health endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp

from gpud import containers, ports
from gpud.config import Config, ServeConfig
from gpud.core.front import socket_path
from gpud.core.health import Answer, Probe, healthy_at_start, judge_running
from gpud.core.launch import (
    serve_argv,
    serve_environment,
    smallest_total,
    start_sharing,
    through_shim,
    unit_restart,
    with_kv_cache,
)
from gpud.core.unitstate import (
    ACTIVE,
    Action,
    AdoptOutsideStart,
    AskShutdown,
    CountRestarts,
    Fail,
    OrphanEnded,
    OutsideStop,
    ReleaseEnded,
    Restarting,
    SeenExit,
    ServeRuntime,
    StopEnded,
    UnitState,
    WatchRestart,
    on_unit,
)
from gpud.core.vocab import (
    ADMITTED,
    DECLARED,
    FAILED,
    LIVE_STATES,
    ORPHAN,
    RUNNING,
    SLEEPING,
    STARTING,
    STOPPING,
    serve_unit,
)
from gpud.errors import Conflict, Denied, GpudError, NotFound, Unavailable
from gpud.files import write_atomically
from gpud.front import SERVE_UMASK, SocketSessions, open_to_front, prepare_socket_dir
from gpud.hostmem import host_memory
from gpud.locks import Locks, Taken
from gpud.observer import Observer
from gpud.reconciling import Reconciler
from gpud.service import LedgerService, check_serve_name
from gpud.sleeping import Sleeps, meta_key
from gpud.unit_properties import UnitSpec, environment_file_text, host_home, host_identity
from gpud.units import SystemdUnits
from gpud.vllm_log import exit_reason

log = logging.getLogger("gpud.supervisor")

# How often a starting serve's health endpoint is asked while gpud waits on it: soon at first
# (a small serve is up in a fraction of a second, and the next start on the device waits for
# it), then less and less often (vLLM loading weights takes minutes).
START_POLL_FIRST_S = 0.02
START_POLL_FAST_FOR_S = 3.0
START_POLL_MAX_S = 1.0
UNIT_JOB_TIMEOUT_S = 60.0
# Health checks of running serves in flight at once. Each has its own timeout, so a round costs
# one timeout however many serves are slow or hung; the bound keeps a host with hundreds of
# serves from opening hundreds of connections at once.
HEALTH_CONCURRENCY = 64
# The reason a serve stopped by an operator's `systemctl stop` keeps: boot does not start it
# again until someone asks (gpuctl start).
OUTSIDE_STOP = "stopped (outside gpud)"
# A serve's own listener, once found, is trusted this long for the same main process before
# /proc is read again (reading /proc/net/tcp at every check of every serve would not be cheap
# on a host with many connections). A foreign holder is looked up again at every check.
PORT_RECHECK_S = 10.0


async def read_exit_lines(unit: str, invocation: str | None) -> list[str]:
    """The last lines of `unit` (of its `invocation`, when known) in the journal, oldest first
    ([] when journalctl cannot say).
    `--sync` first: a serve's last words may still be on their way to journald when systemd
    reports its exit."""
    try:
        sync = await asyncio.create_subprocess_exec(
            "journalctl", "--sync", stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL)
        await asyncio.wait_for(sync.wait(), 5)
        # what the serve's process wrote in this run of the unit alone, where it is known
        match = [f"_SYSTEMD_INVOCATION_ID={invocation}"] if invocation else ["-u", unit]
        proc = await asyncio.create_subprocess_exec(
            "journalctl", "--no-pager", "-b", "-o", "cat", "-n", "60", *match,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        out, _ = await asyncio.wait_for(proc.communicate(), 10)
    except (OSError, TimeoutError) as exc:
        log.warning("cannot read the journal of %s: %s", unit, exc)
        return []
    return out.decode("utf-8", "replace").splitlines()


def make_supervisor(svc: LedgerService, cfg: Config, *, observer: Observer,
                    notify: Callable[[str], None]) -> Supervisor:
    return Supervisor(svc, SystemdUnits(), observer, notify=notify)


class Supervisor:
    def __init__(self, svc: LedgerService, units: SystemdUnits, observer: Observer, *,
                 notify: Callable[[str], None] = lambda _m: None,
                 clock: Callable[[], float] = time.monotonic,
                 journal: Callable[[str, str | None], Awaitable[list[str]]] = read_exit_lines,
                 home_of: Callable[[str], str | None] = host_home,
                 ) -> None:
        self.svc = svc
        self.units = units
        self.observer = observer
        self.notify = notify
        self.clock = clock
        # The last lines of a serve's unit, read when it exits: why it said it did.
        self.journal = journal
        # The user database: as whom a serve may run (unit_properties.host_identity).
        self.home_of = home_of
        # Every lock of a serve's lifecycle and of a device's memory, in one order (gpud.locks).
        self.locks = Locks()
        self._launching: set[str] = set()
        self._launch_tasks: dict[str, asyncio.Task[None]] = {}
        self._stopping: set[str] = set()
        self._returning: dict[str, set[str]] = {}
        self._last: dict[str, UnitState] = {}
        self._restarts: dict[str, deque[float]] = {}
        self._health_failures: dict[str, int] = {}
        self._checks: dict[str, asyncio.Task[None]] = {}
        self._health_slots = asyncio.Semaphore(HEALTH_CONCURRENCY)
        # Per serve: the main PID and time its own listener was last confirmed.
        self._port_owner: dict[str, tuple[int, float]] = {}
        # Stops in progress, by serve: a start on the same device waits for them.
        self._stop_done: dict[str, asyncio.Event] = {}
        self._watching: set[str] = set()
        self._exit_seen: dict[str, str] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._unit_events: asyncio.Queue[UnitState | list[UnitState]] = asyncio.Queue()
        self._http: aiohttp.ClientSession | None = None
        self._sockets = SocketSessions()
        self.booted = asyncio.Event()
        # Why a serve's calibrated figures do not fit its reservation, if they do not (set by
        # the daemon: Calibrator.sizing_problem).
        self.sizing: Callable[[str], str | None] = lambda _serve: None
        # The KV cache a serve's calibration gives (kv_cache_mib = "calibrated"; set by the
        # daemon: Calibrator.kv_cache_figure).
        self.kv_figure: Callable[[str], int | None] = lambda _serve: None
        self.sleeps = Sleeps(self, host_memory=host_memory(getattr(observer, "backend", None)))
        self.reconciler = Reconciler(self)

    # ---- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> Supervisor:
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2))
        self.units.watch(self._unit_events.put_nowait, self._unit_events.put_nowait)
        await self.units.connect()
        self.svc.launching = self.launching
        self.svc.busy = self._launching.__contains__
        self.svc.freed = self.sleeps.freed
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

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # What gpud.sleeping uses of the supervisor.
    @property
    def http(self) -> aiohttp.ClientSession:
        assert self._http is not None
        return self._http

    def serve_http(self, serve: str, spec: ServeConfig) -> aiohttp.ClientSession:
        """The client of a serve's own listener: its Unix socket when it is fronted."""
        if spec.front:
            return self._sockets.session(
                socket_path(self.svc.config.daemon.serve_socket_dir, serve))
        return self.http

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        return self._spawn(coro)

    def spec_of(self, serve: str) -> ServeConfig:
        return self._spec(serve)

    def serve_lock(self, serve: str) -> Taken:
        return self.locks.serve(serve)

    def device_locks(self, serve: str, *, shared: bool = False) -> Taken:
        """The locks of every device the serve uses: held for the part of an action that
        changes their memory; `shared` by a start that does not profile (gpud.locks)."""
        return self.locks.devices(self._device_keys(serve), shared=shared)

    async def memory_back_for(self, serve: str) -> None:
        """Wait (bounded) until the stops in progress on the serve's devices are done and their
        memory shows as free (as a start does first)."""
        await self._memory_back_all(serve)

    def busy(self, serve: str) -> bool:
        return serve in self._launching or serve in self._stopping

    def launching(self) -> tuple[bool, str | None]:
        if self.units.available:
            return True, None
        return False, f"system bus: {self.units.reason}"

    def _need_bus(self) -> None:
        if not self.units.available:
            raise Unavailable(f"launching is unavailable: system bus: {self.units.reason}",
                              {"reason": self.units.reason})

    # ---- reconciliation and boot -----------------------------------------------------------

    async def reconcile(self) -> None:
        """Adopt running gpud-serve-* units (never a second copy), keep their reservations, and
        mark serves that died while gpud was away."""
        if not self.units.available:
            log.warning("reconciliation skipped: system bus unavailable (%s)", self.units.reason)
            return
        if any(spec.container is not None for spec in self.svc.config.serves.values()):
            # A pull a gpud that ended mid-start left: nothing waits for it any more.
            problem = await containers.stop_leftovers()
            if problem is not None:
                log.warning("image pulls left by an earlier gpud may still run: %s", problem)
        live = {st.serve: st for st in await self.units.list_serves() if st.active_state in ACTIVE}
        for serve, st in sorted(live.items()):
            self._last[serve] = st
            spec = self.svc.serve_spec(serve)
            rec_state = self.svc.state_of(serve)
            res = self.svc.ledger.reservations.get(serve)
            if spec is None:
                # Not gpud's to run any more, still gpud's to stop: an orphan, said loudly.
                reason = f"its unit {st.unit} runs but the config does not name the serve"
                log.warning("%s: %s; gpuctl stop %s stops it", serve, reason, serve)
                await self.svc.record(self.svc.event(
                    "adopt", f"{serve}: {reason}: adopted as an orphan ({_pid(st.main_pid)}); "
                    f"gpuctl stop {serve} stops it", serve=serve, main_pid=st.main_pid or None,
                    orphan=True), state=self.svc.state_row(serve, ORPHAN, reason))
                self.svc.set_main_pid(serve, st.main_pid or None)
                continue
            if res is None:
                await self.svc.adopt(serve, spec.all_roles, spec.vram_mib)
            state = rec_state if rec_state in (RUNNING, STARTING) else STARTING
            if rec_state == SLEEPING or (rec_state == RUNNING and spec.sleep_level):
                # Asked, not assumed: asleep it keeps its reservation unchanged.
                state = await self.sleeps.adopt(serve, spec, rec_state)
            self.svc.set_main_pid(serve, st.main_pid or None)
            self.svc.set_restart_count(serve, st.n_restarts)
            await self.svc.record(self.svc.event(
                "adopt", f"{serve}: adopted running unit {st.unit} ({_pid(st.main_pid)})",
                serve=serve, role=spec.role if spec else None,
                mib=self.svc.ledger.reservations[serve].mib, main_pid=st.main_pid),
                # asleep, it keeps the reason it sleeps (who preempted it)
                state=self.svc.state_row(serve, state, self._sleep_reason(serve, state)))
            if state == STARTING:
                self._spawn(self._watch_restart(serve))  # promoted once its health answers
        for serve, rec in list(self.svc.records.items()):
            if rec.state in LIVE_STATES and serve not in live:
                await self._ended(serve, "its unit ended while gpud was not running")

    def _sleep_reason(self, serve: str, state: str) -> str | None:
        rec = self.svc.records.get(serve)
        return rec.reason if rec is not None and state == SLEEPING else None

    async def boot(self) -> None:
        """Start the resident set: by priority, serialized per device, devices in parallel."""
        try:
            if not self.units.available:
                log.warning("resident set not started: launching unavailable (%s)",
                            self.units.reason)
                return
            by_device: dict[str, list[str]] = {}
            order = sorted((s.priority, name) for name, s in self.svc.config.serves.items()
                           if s.resident)
            # Admission first, in priority order over all devices: the whole set's outcome is in
            # the ledger at once (denials with their reasons), and starts need not wait on it.
            for _, name in order:
                if self.svc.state_of(name) in LIVE_STATES or name in self.svc.ledger.reservations:
                    continue
                if self._stopped_outside(name):
                    continue
                with contextlib.suppress(Denied):  # recorded with its reason; it stays denied
                    if self.svc.config.daemon.preempt_at_boot:
                        await self.sleeps.admit_preempting(
                            name, self.svc.config.serves[name].vram_mib, None)
                    else:
                        await self.svc.admit(name, self.svc.config.serves[name].vram_mib)
            self.notify(f"STATUS=starting resident set: {self.svc.summary()}")
            for _, name in order:
                if name in self.svc.ledger.reservations and not self._stopped_outside(name):
                    # A serve on several devices goes in the queue of its first; its launch
                    # waits for every one of them (see _launch).
                    by_device.setdefault(self._device_key(name), []).append(name)
            await asyncio.gather(*(self._boot_device(names) for names in by_device.values()))
        finally:
            self.booted.set()
            log.info("resident set done: %s", self.svc.summary())
            # Serves a preemption put to sleep before this gpud started (one cut short by its
            # stop, say) wake now if they fit, as after any release.
            for role in sorted(self.svc.ledger.roles):
                self.sleeps.freed(role)

    def _stopped_outside(self, serve: str) -> bool:
        """An operator stopped the serve's unit by hand: it stays down until asked."""
        rec = self.svc.records.get(serve)
        if rec is not None and rec.state not in LIVE_STATES and rec.reason == OUTSIDE_STOP:
            log.info("boot: %s not started: %s; gpuctl start %s starts it", serve, OUTSIDE_STOP,
                     serve)
            return True
        return False

    async def _boot_device(self, names: list[str]) -> None:
        """The device's serves in priority order: each util-sized one alone, each run of exactly
        sized ones between them launched at once (their device locks shared: gpud.locks,
        gpud.core.launch.start_sharing). A serve alone waits for the ones before it to be up
        before it is started: the locks alone do not keep the order, since a launch may reach
        its devices' locks after a serve started later (one on several devices) reached them."""
        log.info("boot on %s: %s", self._device_key(names[0]) or "the device", "; ".join(
            f"{name} {start_sharing(with_kv_cache(self._spec(name), self.kv_figure(name)))[1]}"
            for name in names))
        launches: list[asyncio.Task[Any]] = []

        async def settle() -> None:
            if launches:
                # Not gathered: a stop that cancels a launch must not cancel the boot.
                await asyncio.wait(launches)
                launches.clear()

        for name in names:
            if self.svc.state_of(name) in LIVE_STATES or name in self._launching:
                continue
            shared, _why = start_sharing(with_kv_cache(self._spec(name), self.kv_figure(name)))
            if not shared:
                await settle()
            try:
                await self.start(name, None)
            except GpudError as exc:
                log.log(logging.WARNING if exc.http_status < 500 else logging.ERROR,
                        "boot: %s not started: %s", name, exc.message)
                continue
            task = self._launch_tasks.get(name)
            if task is not None:
                task.add_done_callback(lambda _t: self.notify(
                    f"STATUS=starting resident set: {self.svc.summary()}"))
                launches.append(task)
            if not shared:
                await settle()
        await settle()

    # ---- start / stop ----------------------------------------------------------------------

    def _spec(self, serve: str) -> ServeConfig:
        check_serve_name(serve)
        spec = self.svc.serve_spec(serve)
        if spec is None:
            if serve in self.svc.ledger.reservations:
                raise Conflict(f"serve {serve!r} is an external reservation: gpud does not "
                               "launch it", {"serve": serve})
            raise NotFound(f"unknown serve {serve!r}: not in the config", {"serve": serve})
        return spec

    def _device_key(self, serve: str) -> str:
        return self._device_keys(serve)[0]

    def _device_keys(self, serve: str) -> list[str]:
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

    async def _memory_back_all(self, serve: str) -> None:
        for device in self._device_keys(serve):
            await self._memory_back(device)

    def _returning_on(self, serve: str) -> None:
        """The serve is stopping or ended: the next start on any of its devices waits for its
        memory to come back there."""
        for device in self._device_keys(serve):
            self._returning.setdefault(device, set()).add(serve)

    async def start(self, serve: str, uid: int | None, *, wait: bool = False,
                    preempt: bool = False) -> dict[str, Any] | None:
        """Admit the serve at its vram_mib if it holds no reservation, then launch it. Returns
        once admitted (the launch goes on in the background) unless `wait`. With `preempt`,
        serves of lower priority on its role are put to sleep (or stopped) to make room; the
        plan carried out is returned."""
        spec = self._spec(serve)
        self._need_bus()
        carried: dict[str, Any] | None = None
        async with contextlib.AsyncExitStack() as locks:
            # One lock order everywhere (gpud.locks): preemption's coordination before a
            # serve's, a serve's before its devices'.
            if preempt:
                await locks.enter_async_context(self.locks.coordination())
            await locks.enter_async_context(self.serve_lock(serve))
            state = self.svc.state_of(serve)
            if state in LIVE_STATES or serve in self._launching:
                hint = f" (gpuctl wake {serve})" if state == SLEEPING else ""
                raise Conflict(f"serve {serve!r} is already {state}{hint}",
                               {"serve": serve, "state": state})
            problem = self.sizing(serve)
            if problem is not None:
                raise Conflict(f"serve {serve!r} not started: {problem}", {"serve": serve})
            held = self.svc.ledger.reservations.get(serve)
            if held is not None and (held.external or held.all_roles != spec.all_roles):
                configured = ", ".join(spec.all_roles)
                raise Conflict(f"serve {serve!r} holds {held.mib} MiB on role "
                               f"{held.roles_text!r} but is configured on {configured!r}: "
                               "release it first",
                               {"serve": serve, "role": held.role, "configured_role": spec.role})
            for role in spec.all_roles:
                lost = self.svc.lost_device(role)
                if lost is not None:
                    raise Denied(f"serve {serve!r} not started: {lost}",
                                 {"serve": serve, "role": role, "bound": "device"})
            await self._port_free(serve, spec)
            await self._memory_back_all(serve)
            if held is None and preempt:
                carried = await self.sleeps.admit_preempting(serve, spec.vram_mib, uid,
                                                             locked=True)
            elif held is None:
                try:
                    await self.svc.admit(serve, spec.vram_mib, uid=uid)
                except Denied as exc:
                    if exc.details.get("bound") == "device":
                        raise
                    would, details = self.sleeps.what_preemption_would_do(serve, spec.vram_mib)
                    raise Denied(exc.message + would, {**exc.details, **details}) from exc
            try:
                unit_spec = self._unit_spec(serve, with_kv_cache(spec, self.kv_figure(serve)))
            except GpudError as exc:
                # Refused before systemd is asked: the serve fails with the reason, now.
                await self._failed(serve, f"launch failed: {exc.message}", kind="exit")
                raise Conflict(f"serve {serve!r} cannot be launched: {exc.message}",
                               {"serve": serve, **exc.details}) from exc
            self._launching.add(serve)
            task = self._spawn(self._launch(serve, uid, unit_spec))
            self._launch_tasks[serve] = task
        if wait:
            # Not `await task`: a stop that cancels the launch must not cancel this caller.
            await asyncio.wait({task})
        return carried

    async def _launch(self, serve: str, uid: int | None, unit_spec: UnitSpec) -> None:
        spec = self._spec(serve)
        try:
            if spec.container is not None:
                # Before the start locks: a pull (up to an hour) holds up no other start on the
                # serve's devices; the serve stays admitted, its reservation held, and a stop
                # meanwhile cancels this task, which ends the pull's unit.
                image = await containers.ensure_image(serve, spec.container, functools.partial(
                    self._say, serve, spec.role, "pull"))
                if not image.ok:
                    await self._failed(serve, f"launch failed: {image.detail}", kind="exit")
                    return
            # Serialized starts: the serve holds every device it uses while it loads (no
            # neighbour's start, stop, sleep or wake in its load-and-profile window), taken at
            # once in one order so that two serves sharing devices never deadlock.
            # A start that does not profile shares them with other such starts (gpud.locks).
            shared, why = start_sharing(with_kv_cache(spec, self.kv_figure(serve)))
            async with self.device_locks(serve, shared=shared):
                await self._memory_back_all(serve)  # a stop begun while queued
                try:
                    state = await self.units.start(unit_spec, UNIT_JOB_TIMEOUT_S)
                except GpudError as exc:
                    await self._failed(serve, f"launch failed: {exc.message}", kind="exit")
                    return
                self._last[serve] = state
                self.svc.set_main_pid(serve, state.main_pid or None)
                self.svc.set_restart_count(serve, 0)
                self._restarts.pop(serve, None)
                await self.svc.record(self.svc.event(
                    "start", f"{serve}: started {state.unit} ({_pid(state.main_pid)}): "
                    f"{' '.join(unit_spec.argv)}", serve=serve, role=spec.role,
                    mib=self.svc.ledger.reservations[serve].mib if serve in
                    self.svc.ledger.reservations else None, uid=uid, main_pid=state.main_pid,
                    device_lock="shared" if shared else "exclusive", device_lock_why=why),
                    state=self.svc.state_row(serve, STARTING))
                healthy = await self._await_healthy(serve, spec, promote=False)
            # Recorded after the device is free: the next start there need not wait on the
            # write (the serve is healthy either way).
            if healthy and self.svc.state_of(serve) == STARTING:
                await self._promote(serve)
        finally:
            self._launching.discard(serve)
            if self._launch_tasks.get(serve) is asyncio.current_task():
                del self._launch_tasks[serve]

    def _unit_spec(self, serve: str, spec: ServeConfig) -> UnitSpec:
        devs = []
        for role_name in spec.all_roles:
            role = self.svc.ledger.roles[role_name]
            dev = self.observer.device(role.device)
            if dev is None:
                # Without observation gpud cannot tell that the device exists:
                # CUDA_VISIBLE_DEVICES naming a device that is not there would hand the serve
                # another GPU, or none.
                present = self.observer.present_devices()
                why = (f"no device {role.device!r} on this host (present: {', '.join(present)})"
                       if present is not None else
                       f"observation is unavailable, so gpud cannot tell that device "
                       f"{role.device!r} exists")
                raise Unavailable(f"role {role_name!r}: {why}", {"device": role.device,
                                                                 "role": role_name})
            devs.append(dev)
        dev = devs[0]
        index = dev.index
        indexes = [d.index for d in devs]
        # The device's own total, never the role's capacity: utilization is a fraction of the
        # total, and a guess would let util x total pass the reservation. On several devices,
        # the smallest total: util x total then stays within the reservation on each.
        total = smallest_total([d.total_mib for d in devs])
        res = self.svc.ledger.reservations.get(serve)
        # What gpud sets (vLLM's settings) in Environment=; the serve's own environment in its
        # root-only file, whose values win over Environment= (systemd.exec, EnvironmentFile=).
        env = {k: v for k, v in serve_environment(spec).items() if k not in spec.environment}
        environment_for = getattr(self.observer.backend, "environment_for", None)
        if callable(environment_for):
            # A stand-in on several devices draws on each, as vLLM's workers do, one per GPU.
            env.update(environment_for(*(d.uuid for d in devs)))
        ident = host_identity(serve, spec, self.svc.config.daemon, env, fronted=spec.front,
                              home_of=self.home_of)
        env = {k: v for k, v in {**ident.environment, **env}.items() if k not in spec.environment}
        # A container gets every device of the serve through CDI, in the order of its roles.
        cdi = ([name for d in devs for name in containers.cdi_devices(serve, d.uuid, d.index)]
               if spec.container is not None else [])
        sock = (socket_path(prepare_socket_dir(self.svc.config.daemon), serve)
                if spec.front else None)
        argv = serve_argv(spec, total_mib=total, device_index=index,
                          vllm_executable=self.svc.config.daemon.vllm_executable,
                          vram_mib=res.mib if res else None, name=serve,
                          device_indexes=indexes,
                          cdi_devices=cdi, forward_env=[*env, *spec.environment], socket=sock)
        if not argv[0].startswith("/"):
            found = shutil.which(argv[0])
            if found is None:
                raise Unavailable(f"serve {serve}: executable {argv[0]!r} not found in PATH",
                                  {"serve": serve, "executable": argv[0]})
            argv[0] = found
        argv = through_shim(argv, sys.executable, self.units.systemd_version)
        daemon = self.svc.config.daemon
        mib = res.mib if res else spec.vram_mib
        return UnitSpec(
            serve=serve, argv=tuple(argv), device_index=index,
            device_indexes=tuple(indexes) if len(indexes) > 1 else (),
            # With a file, Environment= carries only the device pinning (unit_properties): what
            # gpud sets goes into the file too, the serve's own values after it (they win).
            environment_file=self._environment_file(
                serve, {**env, **spec.environment} if spec.environment else {}),
            description=(f"gpud serve {serve} ({spec.role}, {mib} MiB)" if len(devs) == 1 else
                         f"gpud serve {serve} ({', '.join(spec.all_roles)}, {mib} MiB each)"),
            environment=env, user=ident.user, restart=unit_restart(spec), restart_sec=spec.restart_sec,
            # systemd's own start limit stays above gpud's crash-loop limit, so gpud is the
            # one that notices, says why, and decides about the reservation.
            start_limit_burst=daemon.crash_loop_restarts + 3,
            start_limit_interval_sec=daemon.crash_loop_window_s,
            timeout_start_sec=90.0, timeout_stop_sec=spec.stop_timeout_s,
            container=spec.container is not None,
            umask=SERVE_UMASK if sock else None, socket=sock, hardening=ident.hardening,
        )

    async def _say(self, serve: str, role: str, kind: str, message: str) -> None:
        await self.svc.record(self.svc.event(kind, message, serve=serve, role=role))

    def _environment_file(self, serve: str, environment: Mapping[str, str]) -> str | None:
        """Write the serve's own environment where only root reads it (state_dir/env)."""
        if not environment:
            return None
        folder = Path(self.svc.config.daemon.state_dir) / "env"
        path = folder / f"{serve}.env"
        try:
            folder.mkdir(mode=0o700, exist_ok=True)
            os.chmod(folder, 0o700)
        except OSError as exc:
            raise Unavailable(f"serve {serve}: cannot make {folder}: {exc.strerror or exc}",
                              {"serve": serve}) from exc
        try:
            write_atomically(path, environment_file_text(environment))
        except GpudError as exc:
            raise Unavailable(f"serve {serve}: {exc.message}", {"serve": serve}) from exc
        return str(path)

    async def _await_healthy(self, serve: str, spec: ServeConfig, *,
                             promote: bool = True) -> bool:
        """Poll until health answers 200 (True; recorded as running when `promote`), or the
        start timeout (the serve fails), or the serve left `starting` some other way."""
        started = self.clock()
        deadline = started + spec.start_timeout_s
        pause = START_POLL_FIRST_S
        foreign: str | None = None
        while self.clock() < deadline:
            state = self.svc.state_of(serve)
            if state != STARTING:
                return False  # failed, stopped or promoted elsewhere
            # vLLM listens only once loaded: a refused connection means "loading" until the
            # start timeout, as does a 503 or an answer from someone else's socket.
            answer = await self._probe(serve, spec)
            if healthy_at_start(answer):
                if promote:
                    await self._promote(serve)
                return True
            if answer.probe is Probe.FOREIGN:
                foreign = answer.detail
            await asyncio.sleep(pause)
            if self.clock() - started > START_POLL_FAST_FOR_S:
                pause = min(START_POLL_MAX_S, pause * 1.5)
        if foreign is None and spec.port is not None:
            # Someone else's listener that does not answer 200 (taken during a restart
            # window, say): named all the same.
            last = self._last.get(serve)
            holder = await asyncio.to_thread(_foreign, serve, spec.port,
                                             last.control_group if last else "")
            if holder is not None:
                foreign = f"port {spec.port} is held by {holder}, not by the serve's unit"
        why = f"; {foreign}" if foreign else ""
        await self._failed(serve, f"unhealthy: no 200 from {spec.health_path} within "
                                  f"{spec.start_timeout_s:g} s{why}", kind="unhealthy", stop=True)
        return False

    async def _probe(self, serve: str, spec: ServeConfig) -> Answer:
        """Ask the serve's health endpoint once (on the session's 2 s timeout)."""
        if spec.port is None:
            return Answer(Probe.OK, "no port: an active unit is all there is")
        assert self._http is not None
        url = (f"http://localhost{spec.health_path}" if spec.front else
               f"http://127.0.0.1:{spec.port}{spec.health_path}")
        if spec.front:
            open_to_front(self.svc.config.daemon, serve)
        try:
            async with self.serve_http(serve, spec).get(url) as resp:
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
        last = self._last.get(serve)
        pid = last.main_pid if last is not None else 0
        cached = self._port_owner.get(serve)
        if cached is not None and pid and cached[0] == pid \
                and self.clock() - cached[1] < PORT_RECHECK_S:
            return None
        group = last.control_group if last is not None else ""
        holder = await asyncio.to_thread(_foreign, serve, port, group)
        if holder is None and pid:
            self._port_owner[serve] = (pid, self.clock())
        else:
            self._port_owner.pop(serve, None)
        return holder

    async def _port_free(self, serve: str, spec: ServeConfig) -> None:
        """Refuse to start a serve whose port another process holds: its health answers would
        be that process's."""
        if spec.port is None or spec.front:
            return
        held = await asyncio.to_thread(_holders, spec.port)
        if held is None:
            return
        who = ", ".join(h.describe() for h in held) or "a process gpud cannot see"
        await self.svc.record(self.svc.event(
            "start", f"{serve}: not started: port {spec.port} is already held by {who}",
            serve=serve, role=spec.role, ok=False, port=spec.port,
            holders=[h.describe() for h in held]))
        raise Conflict(f"serve {serve!r}: port {spec.port} is already held by {who}; not started",
                       {"serve": serve, "port": spec.port,
                        "holders": [{"pid": h.pid, "unit": h.unit} for h in held]})

    async def _promote(self, serve: str, *, was_failed: str | None = None) -> None:
        self._health_failures.pop(serve, None)
        res = self.svc.ledger.reservations.get(serve)
        message = (f"{serve}: healthy again (was failed: {was_failed})" if was_failed
                   else f"{serve}: healthy")
        await self.svc.record(self.svc.event(
            "healthy", message, serve=serve, role=res.role if res else None,
            mib=res.mib if res else None, recovered=was_failed is not None),
            state=self.svc.state_row(serve, RUNNING))

    async def stop(self, serve: str, uid: int | None, *,
                   keep_reservation: bool = False) -> None:
        """Stop the unit and release the reservation (kept only for a restart, and not for a
        sleeping serve: asleep it holds its sleep reservation, which no launch may be sized on;
        its restart is admitted again at vram_mib)."""
        check_serve_name(serve)
        if self.svc.state_of(serve) == ORPHAN and self.svc.serve_spec(serve) is None:
            await self._stop_orphan(serve, uid)
            return
        spec = self._spec(serve)
        state = self.svc.state_of(serve)
        if state in LIVE_STATES or serve in self._launching:
            self._need_bus()
        failed: GpudError | None = None
        check = self._checks.get(serve)
        if check is not None and check is not asyncio.current_task() and not check.done():
            # A health check restarting the serve holds its lock while the new process loads
            # (minutes for vLLM): a stop does not wait for that, it ends it.
            check.cancel()
            await asyncio.wait({check})
        async with self.serve_lock(serve):
            self._stopping.add(serve)
            # A start on the device from now on waits for this stop and for the memory to come
            # back (a serve ignoring SIGTERM takes its stop timeout to go).
            self._stop_done[serve] = asyncio.Event()
            self._returning_on(serve)
            try:
                launch = self._launch_tasks.get(serve)
                if launch is not None and not launch.done():
                    # Queued behind another start on the device, or starting: it must not go on
                    # to run a unit whose reservation this stop releases.
                    launch.cancel()
                    await asyncio.wait({launch})
                    # A launch cancelled before it began never ran its own clean-up.
                    self._launching.discard(serve)
                    if self._launch_tasks.get(serve) is launch:
                        del self._launch_tasks[serve]
                res = self.svc.ledger.reservations.get(serve)
                asleep = self.svc.state_of(serve) == SLEEPING
                await self.svc.record(self.svc.event(
                    "stop", f"{serve}: stopping (was {state})", serve=serve, role=spec.role,
                    mib=res.mib if res else None, uid=uid), state=self.svc.state_row(serve, STOPPING))
                if self.units.available:
                    try:
                        async with contextlib.AsyncExitStack() as memory:
                            if self._unit_active(serve) or state in LIVE_STATES:
                                # its memory comes back: not inside a neighbour's start window
                                await memory.enter_async_context(self.device_locks(serve))
                            await self.units.stop(serve, spec.stop_timeout_s + 15)
                        await self.units.reset_failed(serve)
                    except GpudError as exc:
                        if not await self._unit_ended(serve):
                            failed = exc
                if failed is None:
                    await self._stopped(serve, uid, keep=keep_reservation and not asleep)
                else:
                    await self.svc.record(self.svc.event(
                        "stop", f"{serve}: the stop failed ({failed.message}) and its unit has "
                        "not ended: it stays stopping, its reservation held, until the unit ends "
                        "(gpuctl stop tries again)", serve=serve, role=spec.role,
                        mib=res.mib if res else None, uid=uid, ok=False),
                        state=self.svc.state_row(serve, STOPPING, f"stop failed: {failed.message}"))
            finally:
                self._stopping.discard(serve)
                self._stop_done.pop(serve).set()
                self._last.pop(serve, None)
                self._port_owner.pop(serve, None)
        if failed is not None:
            # Its unit's end, had it come while the stop was under way, went unheeded: read once
            # more. Later ends complete the stop through the unit's signal (StopEnded).
            if self.svc.state_of(serve) == STOPPING and await self._unit_ended(serve):
                await self._stopped(serve, uid, keep=False)
            raise failed

    async def _unit_ended(self, serve: str) -> bool:
        """The serve's unit is gone or has ended, as systemd says now (False when it cannot be
        read)."""
        try:
            st = await self.units.state(serve)
        except GpudError:
            return False
        return st is None or st.gone

    async def _stopped(self, serve: str, uid: int | None, *, keep: bool) -> None:
        """A stop's end: the unit has ended; its reservation released (unless `keep`: a restart
        keeps it), and what a sleep noted of it (level, awake size) is over."""
        spec = self.svc.serve_spec(serve)
        role = spec.role if spec else None
        res = self.svc.ledger.reservations.get(serve)
        if res is not None and not keep:
            await self.svc.release(serve, uid=uid, reason="stopped", allow_live=True,
                                   next_state=DECLARED)
        else:
            await self.svc.record(self.svc.event(
                "exit", f"{serve}: stopped", serve=serve, role=role),
                state=self.svc.state_row(serve, ADMITTED if res else DECLARED))
        if self.svc.store.meta(meta_key(serve)) is not None:
            await self.svc.put_meta(meta_key(serve), None)

    async def _stop_orphan(self, serve: str, uid: int | None) -> None:
        self._need_bus()
        async with self.serve_lock(serve):
            self._stopping.add(serve)
            try:
                await self.units.stop(serve, UNIT_JOB_TIMEOUT_S)
                await self.units.reset_failed(serve)
                await self.svc.record(self.svc.event(
                    "stop", f"{serve}: orphan unit stopped", serve=serve, uid=uid),
                    state=self.svc.state_row(serve, DECLARED))
            finally:
                self._stopping.discard(serve)
                self._last.pop(serve, None)

    async def restart(self, serve: str, uid: int | None) -> None:
        await self.stop(serve, uid, keep_reservation=True)
        await self.start(serve, uid)

    async def _memory_back(self, device: str) -> None:
        """Before a start: wait (bounded by memory_return_timeout_s) until the stops in progress
        on the device have ended and observation no longer sees the stopped serves' memory
        there, so the next admission and vLLM's own check see it free."""
        waiting = set(self._returning.get(device, ()))
        timeout = self.svc.config.daemon.memory_return_timeout_s
        if not waiting or timeout <= 0:
            return
        deadline = self.clock() + timeout
        held: set[str] = set()
        while (left := deadline - self.clock()) > 0:
            stopping = [self._stop_done[s] for s in sorted(waiting) if s in self._stop_done]
            if stopping:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping[0].wait(), left)
                continue
            if not self.observer.available:
                break
            held = waiting & set(self.observer.draws.get(device, {}))
            if not held:
                break
            await self.observer.next_sample(min(1.0, left))
        else:
            still = sorted(held | {s for s in waiting if s in self._stop_done})
            log.warning("memory of %s on %s not back after %g s; starting anyway", still,
                        device, timeout, extra={"journal": {
                            "GPUD_EVENT": "memory-not-back", "GPUD_SERVES": ",".join(still)}})
        left_over = self._returning.get(device)
        if left_over is not None:
            left_over.difference_update(waiting - set(self._stop_done))
            if not left_over:
                del self._returning[device]

    # ---- failures --------------------------------------------------------------------------

    async def _failed(self, serve: str, reason: str, *, kind: str, stop: bool = False,
                      **details: Any) -> None:
        """A serve ends `failed`. With `stop` its unit is stopped first. A serve whose unit may
        still be active (the stop failed, the bus is down) keeps its reservation: its process
        may still hold the memory. Otherwise a resident serve keeps it (it is meant to run) and
        any other releases it. The event says which."""
        spec = self.svc.serve_spec(serve)
        # A serve that was asleep holds its sleep reservation, not what it starts with: kept,
        # a later start would launch it on too little.
        resident = bool(spec and spec.resident) and self.svc.state_of(serve) != SLEEPING
        still_active = not stop and self._unit_active(serve)
        if stop:
            still_active = True
            if self.units.available:
                self._stopping.add(serve)
                try:
                    await self.units.stop(serve, (spec.stop_timeout_s if spec else 30) + 15)
                    await self.units.reset_failed(serve)
                    still_active = False
                except GpudError as exc:
                    log.error("could not stop %s: %s", serve, exc.message)
                finally:
                    self._stopping.discard(serve)
            else:
                reason += f"; not stopped: system bus unavailable ({self.units.reason})"
        if kind in ("exit", "crash-loop"):
            last = self._last.get(serve)
            said = exit_reason(await self.journal(serve_unit(serve),
                                                  last.invocation_id if last else None))
            if said is not None:
                reason += f"; its log: {said}"
        res = self.svc.ledger.reservations.get(serve)
        policy = "kept (resident)" if resident else "released"
        if still_active and not resident:
            policy = "kept (its unit may still be active)"
        if res is None:
            policy = "none held"
        if res is not None and not resident and not still_active:
            # Released before the failure is recorded: the release's own transaction makes the
            # serve failed, so nobody reads it failed while it still holds what it released.
            await self.svc.release(serve, reason=f"failed: {reason}", allow_live=True,
                                   next_state=FAILED, state_reason=reason)
        await self.svc.record(self.svc.event(
            kind, f"{serve} failed: {reason}; reservation {policy}", serve=serve,
            role=spec.role if spec else None, mib=res.mib if res else None,
            reservation=policy, **details), state=self.svc.state_row(serve, FAILED, reason))
        self._returning_on(serve)

    async def _ended(self, serve: str, reason: str) -> None:
        await self._failed(serve, reason, kind="exit")

    def _unit_active(self, serve: str) -> bool:
        last = self._last.get(serve)
        return last is not None and last.active_state in ACTIVE

    async def _unhealthy(self, serve: str, spec: ServeConfig, reason: str) -> None:
        """A running serve failed its health checks. It is restarted through its unit (counted
        toward the crash-loop limit, reservation kept) unless its restart policy is "no" or the
        crash-loop limit is reached: then it is stopped and `failed`. Never left running as
        `failed` while its reservation is gone."""
        res = self.svc.ledger.reservations.get(serve)
        if spec.restart == "no" or not self.units.available:
            await self._failed(serve, reason, kind="unhealthy", stop=True)
            return
        loop = self._count_restarts(serve, 1)
        if loop is not None:
            await self._failed(serve, f"{loop}; last: {reason}", kind="crash-loop", stop=True)
            return
        await self.svc.record(self.svc.event(
            "unhealthy", f"{serve}: {reason}; restarting it through its unit (reservation kept)",
            serve=serve, role=spec.role, mib=res.mib if res else None,
            reservation="kept (restarting)" if res else "none held"),
            state=self.svc.state_row(serve, STARTING, f"restarting: {reason}"))
        # Its devices are held from the stop of the old process to the health of the new one,
        # as for a start: the new process loads and profiles alone on them.
        async with self.device_locks(serve):
            self._stopping.add(serve)
            try:
                fresh = await self.units.restart(serve, spec.stop_timeout_s + UNIT_JOB_TIMEOUT_S)
            except GpudError as exc:
                self._stopping.discard(serve)
                await self._failed(serve, f"{reason}; the restart failed: {exc.message}",
                                   kind="unhealthy", stop=True)
                return
            finally:
                self._stopping.discard(serve)
            self._port_owner.pop(serve, None)
            if fresh is None or fresh.active_state not in ACTIVE:
                await self._failed(serve, f"{reason}; its unit did not come back after the "
                                   "restart", kind="exit")
                return
            self._last[serve] = fresh
            self.svc.set_main_pid(serve, fresh.main_pid or None)
            await self.svc.record(self.svc.event(
                "restart", f"{serve}: restarted through its unit after failing its health checks "
                f"(MainPID {fresh.main_pid})", serve=serve, main_pid=fresh.main_pid, by="gpud"))
            await self._watch_restart(serve)

    async def wake_failed(self, serve: str, spec: ServeConfig, reason: str) -> None:
        """A wake got no answer (the caller holds the serve's lock): the serve may be half
        awake, so it keeps the full reservation its wake was admitted at, and is restarted
        through its unit (its restart policy allowing) or stopped and failed, in the
        background: the caller is answered now."""
        res = self.svc.ledger.reservations.get(serve)
        restart = spec.restart != "no" and self.units.available
        what = "restarted through its unit" if restart else "stopped"
        await self.svc.record(self.svc.event(
            "unhealthy", f"{serve}: {reason}; it keeps its full reservation "
            f"({res.mib if res else 0} MiB) and is {what}", serve=serve, role=spec.role,
            mib=res.mib if res else None, wake_failed=True),
            state=self.svc.state_row(serve, STARTING, f"restarting: {reason}") if restart
            else None)
        self._spawn(self._after_failed_wake(serve, spec, reason, restart))

    async def _after_failed_wake(self, serve: str, spec: ServeConfig, reason: str,
                                 restart: bool) -> None:
        async with self.serve_lock(serve):
            if self.svc.state_of(serve) not in (STARTING, SLEEPING) or serve in self._stopping:
                return  # stopped or restarted meanwhile
            if restart:
                await self._unhealthy(serve, spec, reason)
            else:
                await self._failed(serve, reason, kind="unhealthy", stop=True)

    async def _outside_stop(self, serve: str, st: UnitState) -> None:
        """An operator stopped the unit (`systemctl stop`): recorded as such, not as a failure.
        The reservation goes as with `gpuctl stop`, unless the serve is resident and
        daemon.keep_resident_on_outside_stop; boot does not start it again until asked."""
        spec = self.svc.serve_spec(serve)
        keep = bool(spec and spec.resident
                    and self.svc.config.daemon.keep_resident_on_outside_stop)
        res = self.svc.ledger.reservations.get(serve)
        policy = "none held" if res is None else "kept (resident)" if keep else "released"
        await self.svc.record(self.svc.event(
            "exit", f"{serve}: {OUTSIDE_STOP}: its unit {st.unit} was stopped by a job gpud did "
            f"not start ({st.how}, result {st.result}); reservation {policy}", serve=serve,
            role=spec.role if spec else None, mib=res.mib if res else None, reservation=policy,
            outside=True, exit_status=st.exec_main_status),
            # "stopping" until the release below is committed too: never "declared" while a
            # reservation is still held.
            state=self.svc.state_row(serve, STOPPING if res is not None and not keep
                                     else ADMITTED if res else DECLARED, OUTSIDE_STOP))
        if res is not None and not keep:
            await self.svc.release(serve, reason=OUTSIDE_STOP, allow_live=True,
                                   next_state=DECLARED, state_reason=OUTSIDE_STOP)
        self._returning_on(serve)
        self._port_owner.pop(serve, None)

    # ---- unit state from D-Bus signals -----------------------------------------------------

    async def _unit_loop(self) -> None:
        while True:
            item = await self._unit_events.get()
            try:
                if isinstance(item, list):
                    await self._resync(item)
                else:
                    await self._on_unit(item)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("handling a unit state change failed")

    async def _resync(self, states: list[UnitState]) -> None:
        """After a bus reconnect: the state is re-read from systemd, not kept from before."""
        live = {s.serve for s in states if s.active_state in ACTIVE}
        for st in states:
            await self._on_unit(st)
            rec = self.svc.records.get(st.serve)
            if (rec is not None and rec.state == FAILED and st.active_state in ACTIVE
                    and st.serve not in self._stopping and self.svc.serve_spec(st.serve)):
                # Marked failed while the bus was down (it could not be stopped or restarted),
                # and its unit runs: it is starting again until its health says otherwise.
                await self.svc.record(self.svc.event(
                    "restart", f"{st.serve}: its unit {st.unit} is active (re-read from systemd "
                    f"after the bus came back; was failed: {rec.reason})", serve=st.serve,
                    main_pid=st.main_pid, n_restarts=st.n_restarts),
                    state=self.svc.state_row(st.serve, STARTING, "re-read after the bus came back"))
                self._spawn(self._watch_restart(st.serve))
        for serve, rec in list(self.svc.records.items()):
            if rec.state in LIVE_STATES and serve not in live and serve not in self._stopping:
                # systemd has no unit of it: what was last seen of the unit is past.
                self._last.pop(serve, None)
                await self._ended(serve, "its unit is gone (seen after the bus came back)")

    async def _on_unit(self, st: UnitState) -> None:
        """Carry out what the change of a serve's unit means (gpud.core.unitstate.on_unit)."""
        serve = st.serve
        prev = self._last.get(serve)
        self._last[serve] = st
        if st.main_pid and serve not in self._stopping:
            self.svc.set_main_pid(serve, st.main_pid)
        rec = self.svc.records.get(serve)
        spec = self.svc.serve_spec(serve)
        rt = ServeRuntime(state=rec.state if rec else DECLARED,
                          holds=serve in self.svc.ledger.reservations, configured=spec is not None,
                          resident=bool(spec and spec.resident),
                          restart=unit_restart(spec) if spec else "no",
                          launching=serve in self._launching, stopping=serve in self._stopping,
                          prev=prev, exit_seen=self._exit_seen.get(serve))
        actions = on_unit(rt, st)
        if actions and isinstance(actions[-1], AskShutdown):
            actions = on_unit(replace(rt, shutting_down=await self.units.shutting_down()), st)
        for action in actions:
            if not await self._carry_out(serve, st, action):
                return

    async def _carry_out(self, serve: str, st: UnitState, action: Action) -> bool:
        """One action of on_unit; False when the rest is not to be done (a crash loop)."""
        rec = self.svc.records.get(serve)
        if isinstance(action, CountRestarts):
            self.svc.set_restart_count(serve, st.n_restarts)
            return not await self._restarted(serve, st, action.count)
        if isinstance(action, OrphanEnded):
            await self.svc.record(self.svc.event(
                "exit", f"{serve}: orphan unit ended ({action.how})", serve=serve),
                state=self.svc.state_row(serve, DECLARED))
        elif isinstance(action, ReleaseEnded):
            await self.svc.release(serve, reason="failed, and its unit has now ended",
                                   allow_live=True, next_state=FAILED,
                                   state_reason=rec.reason if rec else None)
        elif isinstance(action, StopEnded):
            await self.svc.record(self.svc.event(
                "exit", f"{serve}: its unit {st.unit} has ended ({action.how}) since its stop "
                "gave up waiting: the stop is complete", serve=serve, exit_status=st.exec_main_status))
            await self._stopped(serve, None, keep=False)
        elif isinstance(action, OutsideStop):
            await self._outside_stop(serve, st)
        elif isinstance(action, SeenExit):
            self._exit_seen[serve] = action.invocation
        elif isinstance(action, Restarting):
            await self.svc.record(self.svc.event(
                "exit", f"{serve}: process exited ({action.how}); systemd restarts it",
                serve=serve, exit_status=st.exec_main_status, result=st.result),
                state=self.svc.state_row(serve, STARTING, "restarting"))
            self._spawn(self._confirm_restart(serve, action.invocation))
        elif isinstance(action, Fail):
            await self._failed(serve, action.reason, kind="exit", stop=action.stop,
                               exit_status=st.exec_main_status)
        elif isinstance(action, WatchRestart):
            self._spawn(self._watch_restart(serve))
        elif isinstance(action, AdoptOutsideStart):
            await self._adopt_outside_start(serve, st)
        return True

    async def _confirm_restart(self, serve: str, invocation: str) -> None:
        spec = self.svc.serve_spec(serve)
        await asyncio.sleep((spec.restart_sec if spec else 2.0) + 5.0)
        if self.svc.state_of(serve) != STARTING or serve in self._stopping:
            return
        last = self._last.get(serve)
        if last is not None and last.invocation_id != invocation and last.active_state in ACTIVE:
            return
        fresh = await self.units.state(serve)
        if fresh is not None and fresh.active_state in ACTIVE:
            return
        await self._failed(serve, "exited and systemd did not restart it", kind="exit")

    async def watch_restart(self, serve: str) -> None:
        """Wait for a serve that is starting again to answer (see _watch_restart)."""
        await self._watch_restart(serve)

    async def _watch_restart(self, serve: str) -> None:
        """Wait for a serve that is starting again to answer (one watcher per serve: the
        unit's signals and gpud's own restart both ask for one)."""
        spec = self.svc.serve_spec(serve)
        if spec is None or serve in self._watching:
            return
        self._watching.add(serve)
        try:
            await self._await_healthy(serve, spec)
        finally:
            self._watching.discard(serve)

    def _count_restarts(self, serve: str, count: int) -> str | None:
        """Count restarts (systemd's or gpud's) in the crash-loop window; the crash-loop reason
        once there are more than daemon.crash_loop_restarts in it."""
        daemon = self.svc.config.daemon
        now = self.clock()
        times = self._restarts.setdefault(serve, deque())
        for _ in range(count):
            times.append(now)
        while times and now - times[0] > daemon.crash_loop_window_s:
            times.popleft()
        if len(times) > daemon.crash_loop_restarts:
            self._restarts.pop(serve, None)
            return (f"crash-loop: {len(times)} restarts in {daemon.crash_loop_window_s:g} s "
                    f"(limit {daemon.crash_loop_restarts})")
        return None

    async def _restarted(self, serve: str, st: UnitState, count: int) -> bool:
        """Record a restart; True when it made a crash loop (the unit is then stopped)."""
        loop = self._count_restarts(serve, count)
        await self.svc.record(self.svc.event(
            "restart", f"{serve}: restarted by systemd (restart #{st.n_restarts}, "
            f"{_pid(st.main_pid)})", serve=serve, n_restarts=st.n_restarts,
            main_pid=st.main_pid or None))
        if loop is not None:
            await self._failed(serve, loop, kind="crash-loop", stop=True,
                               n_restarts=st.n_restarts)
            return True
        return False

    async def _adopt_outside_start(self, serve: str, st: UnitState) -> None:
        """The unit runs again though gpud did not start it (`systemctl start` or `restart` by
        hand): it holds memory, so it gets its reservation back, as at adoption."""
        spec = self.svc.serve_spec(serve)
        if spec is None:
            return
        if serve not in self.svc.ledger.reservations:
            await self.svc.adopt(serve, spec.all_roles, spec.vram_mib)
        await self.svc.record(self.svc.event(
            "adopt", f"{serve}: its unit {st.unit} was started outside gpud (MainPID "
            f"{st.main_pid}): adopted", serve=serve, role=spec.role,
            mib=self.svc.ledger.reservations[serve].mib, main_pid=st.main_pid),
            state=self.svc.state_row(serve, STARTING))
        self._spawn(self._watch_restart(serve))

    # ---- health of running serves ----------------------------------------------------------

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.svc.config.daemon.health_interval_s)
            try:
                await self._check_running()
            except asyncio.CancelledError:
                raise
            except Exception:  # a failed store write must not end health checking for good
                log.exception("health check round failed; next round in %.1f s",
                              self.svc.config.daemon.health_interval_s)

    async def _check_running(self) -> None:
        """Begin this round's checks: one per running or sleeping serve (and per failed serve
        whose unit is still active, which may come back), none for a serve whose last check is
        still in flight. Checks run concurrently, each on its own timeout: a slow or hung serve
        delays no other serve's verdict."""
        for serve, rec in list(self.svc.records.items()):
            if rec.state in (RUNNING, SLEEPING) or (rec.state == FAILED
                                                     and self._unit_active(serve)):
                self._begin_check(serve)

    def _begin_check(self, serve: str) -> None:
        spec = self.svc.serve_spec(serve)
        if serve in self._checks or serve in self._stopping or spec is None:
            return
        task = self._spawn(self._check_one(serve, spec))
        self._checks[serve] = task
        task.add_done_callback(functools.partial(self._check_done, serve))

    async def _on_observation(self, _obs: Any) -> None:
        """A sleeping serve drawing over its reservation may have been woken outside gpud:
        it is checked now, not at the next round."""
        for serve, rec in list(self.svc.records.items()):
            if rec.state == SLEEPING and self.reconciler.overdrawn(serve):
                self._begin_check(serve)

    def _check_done(self, serve: str, _task: asyncio.Task[None]) -> None:
        self._checks.pop(serve, None)

    async def _check_one(self, serve: str, spec: ServeConfig) -> None:
        try:
            async with self._health_slots:
                answer = await self._probe(serve, spec)
            state = self.svc.state_of(serve)
            if serve in self._stopping or self.serve_lock(serve).locked():
                return  # a lifecycle action of the serve is under way: it decides, not this
            if state == FAILED:
                if answer.probe is Probe.OK and self._unit_active(serve):
                    rec = self.svc.records.get(serve)
                    await self._promote(serve, was_failed=rec.reason if rec else "?")
                return
            if state not in (RUNNING, SLEEPING):
                return
            verdict = judge_running(answer, self._health_failures.get(serve, 0),
                                    self.svc.config.daemon.health_failures,
                                    vllm=spec.vllm is not None, health_path=spec.health_path)
            if verdict.unhealthy is None:
                if verdict.failures:
                    self._health_failures[serve] = verdict.failures
                else:
                    self._health_failures.pop(serve, None)
                    # What it says it is, against the ledger (woken or slept outside gpud).
                    await self.reconciler.check(serve, spec)
                return
            self._health_failures.pop(serve, None)
            async with self.serve_lock(serve):  # a restart is a lifecycle action like any
                if self.svc.state_of(serve) != state or serve in self._stopping:
                    return
                if state == SLEEPING:
                    # Restarted, it would load at its full size on its sleep reservation.
                    await self._failed(serve, f"{verdict.unhealthy} while asleep",
                                       kind="unhealthy", stop=True)
                    return
                await self._unhealthy(serve, spec, verdict.unhealthy)
        except asyncio.CancelledError:
            raise
        except Exception:  # a failed store write must not end checking this serve for good
            log.exception("health check of %s failed", serve)


def _holders(port: int) -> list[ports.Holder] | None:
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


def _foreign(serve: str, port: int, control_group: str) -> str | None:
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
        held = _holders(port) or []
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


def _pid(main_pid: int) -> str:
    # MainPID is 0 between a unit's processes (a restart on its way): no PID to name yet.
    return f"MainPID {main_pid}" if main_pid else "no MainPID yet"


