"""A serve's start: its checks, its admission, its unit's properties and the launch itself,
under its devices' locks: exclusive for a start that profiles memory (vLLM instances profiling
at the same time on one GPU mis-size each other), shared among exactly sized starts, which do
not profile (gpud.core.launch.start_sharing)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gpud.config import ServeConfig, routed
from gpud.core.front import socket_path
from gpud.core.launch import (
    serve_argv,
    serve_environment,
    smallest_total,
    start_sharing,
    through_shim,
    unit_restart,
)
from gpud.core.lifecycle import (
    LaunchEnded,
    StartAsked,
    UnitStarted,
    start_refused,
)
from gpud.core.serverecord import Happened, UnitPid, UnitRestarts
from gpud.core.vocab import (
    LIVE_STATES,
    SLEEPING,
    STARTING,
    DenialBound,
    EventKind,
)
from gpud.errors import Conflict, Denied, GpudError, Unavailable
from gpud.files import write_atomically
from gpud.host import containers
from gpud.host.unit_properties import UnitSpec, environment_file_text, host_identity
from gpud.life.sleeping import Sleeps
from gpud.life.supervisor.base import (
    UNIT_JOB_TIMEOUT_S,
    Failing,
    Healthy,
    Runtime,
    pid_text,
)
from gpud.life.supervisor.health import port_holders
from gpud.life.supervisor.stop import MemoryReturn
from gpud.nginx.front import SERVE_UMASK, front_group, prepare_socket_dir


class LaunchJob:
    """Starting a serve."""

    def __init__(self, rt: Runtime, health: Healthy, stops: Failing, memory: MemoryReturn,
                 sleeps: Sleeps, *, home_of: Callable[[str], str | None]) -> None:
        self.rt = rt
        self.svc = rt.svc
        self.health = health
        self.stops = stops
        self.memory = memory
        self.sleeps = sleeps
        # The user database: as whom a serve may run (unit_properties.host_identity).
        self.home_of = home_of

    async def start(self, serve: str, uid: int | None, *, wait: bool = False,
                    preempt: bool = False) -> dict[str, Any] | None:
        """Admit the serve at its vram_mib if it holds no reservation, then launch it. Returns
        once admitted (the launch goes on in the background) unless `wait`. With `preempt`,
        serves of lower priority on its role are put to sleep (or stopped) to make room; the
        plan carried out is returned."""
        spec = self.rt.spec(serve)
        self.rt.need_bus()
        carried: dict[str, Any] | None = None
        async with contextlib.AsyncExitStack() as locks:
            # One lock order everywhere (gpud.life.locks): preemption's coordination before a
            # serve's, a serve's before its devices'.
            if preempt:
                await locks.enter_async_context(self.rt.locks.coordination())
            await locks.enter_async_context(self.rt.serve_lock(serve))
            state = self.svc.state_of(serve)
            if state in LIVE_STATES or start_refused(self.rt.life(serve)) is not None:
                hint = f" (gpuctl wake {serve})" if state == SLEEPING else ""
                raise Conflict(f"serve {serve!r} is already {state}{hint}",
                               {"serve": serve, "state": state})
            problem = self.rt.calibrated.sizing_problem(serve)
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
                                 {"serve": serve, "role": role, "bound": DenialBound.DEVICE})
            await self._port_free(serve, spec)
            await self.memory.back_all(serve)
            if held is None and preempt:
                carried = await self.sleeps.preemption.admit_preempting(serve, spec.vram_mib, uid,
                                                                        locked=True)
            elif held is None:
                with self.sleeps.preemption.preemption_hint(serve, spec.vram_mib):
                    await self.svc.admit(serve, spec.vram_mib, uid=uid)
            try:
                unit_spec = self.unit_spec(serve, self.rt.sized(serve, spec))
            except GpudError as exc:
                # Refused before systemd is asked: the serve fails with the reason, now.
                await self.stops.failed(serve, f"launch failed: {exc.message}", kind=EventKind.EXIT)
                raise Conflict(f"serve {serve!r} cannot be launched: {exc.message}",
                               {"serve": serve, **exc.details}) from exc
            refused = self.rt.step(serve, StartAsked())
            # the serve's lock is held, and it was free a moment ago: never refused here
            assert not refused, refused
            task = self.rt.spawn(self._launch(serve, uid, unit_spec))
            self.rt.handles(serve).launch_task = task
        if wait:
            # Not `await task`: a stop that cancels the launch must not cancel this caller.
            await asyncio.wait({task})
        return carried

    async def _launch(self, serve: str, uid: int | None, unit_spec: UnitSpec) -> None:
        spec = self.rt.spec(serve)
        try:
            if spec.container is not None:
                # Before the start locks: a pull (up to an hour) holds up no other start on the
                # serve's devices; the serve stays admitted, its reservation held, and a stop
                # meanwhile cancels this task, which ends the pull's unit.
                image = await containers.ensure_image(serve, spec.container, functools.partial(
                    self.rt.say, serve, spec.role, EventKind.PULL))
                if not image.ok:
                    await self.stops.failed(serve, f"launch failed: {image.detail}", kind=EventKind.EXIT)
                    return
            # Serialized starts: the serve holds every device it uses while it loads (no
            # neighbour's start, stop, sleep or wake in its load-and-profile window), taken at
            # once in one order so that two serves sharing devices never deadlock.
            # A start that does not profile shares them with other such starts (gpud.life.locks).
            shared, why = start_sharing(self.rt.sized(serve, spec))
            async with self.rt.device_locks(serve, shared=shared):
                await self.memory.back_all(serve)  # a stop begun while queued
                try:
                    state = await self.rt.units.start(unit_spec, UNIT_JOB_TIMEOUT_S)
                except GpudError as exc:
                    await self.stops.failed(serve, f"launch failed: {exc.message}", kind=EventKind.EXIT)
                    return
                self.rt.step(serve, UnitStarted(state))
                self.svc.records.apply(serve, UnitPid(state.main_pid or None))
                self.svc.records.apply(serve, UnitRestarts(0))
                await self.svc.store_event(self.svc.event(
                    EventKind.START, f"{serve}: started {state.unit} ({pid_text(state.main_pid)}): "
                    f"{' '.join(unit_spec.argv)}", serve=serve, role=spec.role,
                    mib=self.svc.ledger.reservations[serve].mib if serve in
                    self.svc.ledger.reservations else None, uid=uid, main_pid=state.main_pid,
                    device_lock="shared" if shared else "exclusive", device_lock_why=why),
                    report=self.svc.report(serve, Happened.LAUNCHED))
                healthy = await self.health.await_healthy(serve, spec, promote=False)
            # Recorded after the device is free: the next start there need not wait on the
            # write (the serve is healthy either way).
            if healthy and self.svc.state_of(serve) == STARTING:
                await self.health.promote(serve)
        finally:
            self.rt.step(serve, LaunchEnded())
            rec = self.rt.handles(serve)
            if rec.launch_task is asyncio.current_task():
                rec.launch_task = None
            self.rt.prune(serve)

    def unit_spec(self, serve: str, spec: ServeConfig) -> UnitSpec:
        devs = []
        for role_name in spec.all_roles:
            role = self.svc.ledger.roles[role_name]
            dev = self.rt.observer.device(role.device)
            if dev is None:
                # Without observation gpud cannot tell that the device exists:
                # CUDA_VISIBLE_DEVICES naming a device that is not there would hand the serve
                # another GPU, or none.
                present = self.rt.observer.present_devices()
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
        environment_for = getattr(self.rt.observer.backend, "environment_for", None)
        if callable(environment_for):
            # A stand-in on several devices draws on each, as vLLM's workers do, one per GPU.
            env.update(environment_for(*(d.uuid for d in devs)))
        ident = host_identity(serve, spec, self.svc.config.daemon, env,
                              front_group=front_group(self.svc.config.daemon) if spec.front
                              else None, home_of=self.home_of)
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
                          cdi_devices=cdi, forward_env=[*env, *spec.environment], socket=sock,
                          vllm_version=self.svc.config.daemon.vllm_version,
                          behind_router=serve in routed(self.svc.config))
        if not argv[0].startswith("/"):
            found = shutil.which(argv[0])
            if found is None:
                raise Unavailable(f"serve {serve}: executable {argv[0]!r} not found in PATH",
                                  {"serve": serve, "executable": argv[0]})
            argv[0] = found
        argv = through_shim(argv, sys.executable, self.rt.units.systemd_version)
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

    async def _port_free(self, serve: str, spec: ServeConfig) -> None:
        """Refuse to start a serve whose port another process holds: its health answers would
        be that process's."""
        if spec.port is None or spec.front:
            return
        held = await asyncio.to_thread(port_holders, spec.port)
        if held is None:
            return
        who = ", ".join(h.describe() for h in held) or "a process gpud cannot see"
        await self.svc.store_event(self.svc.event(
            EventKind.START, f"{serve}: not started: port {spec.port} is already held by {who}",
            serve=serve, role=spec.role, ok=False, port=spec.port,
            holders=[h.describe() for h in held]))
        raise Conflict(f"serve {serve!r}: port {spec.port} is already held by {who}; not started",
                       {"serve": serve, "port": spec.port,
                        "holders": [{"pid": h.pid, "unit": h.unit} for h in held]})

