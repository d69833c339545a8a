"""Observation in the daemon: samples a backend off the event loop, attributes processes to
serves through their cgroup, and answers the ledger's questions about physical memory.

The arithmetic lives in gpud.core.ledger (device_draw); this module only gathers the inputs and keeps
the latest answer. Threshold events (reserve-exceeded / reserve-ok, overdraw) fire once per
crossing, not once per poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from gpud.config import Config
from gpud.core import answers
from gpud.core.ledger import (
    DRAWING_STATES,
    DeviceDraw,
    Ledger,
    PhysicalView,
    device_draw,
    pending_share,
    serve_draws,
)
from gpud.core.observation import (
    DeviceSample,
    DeviceView,
    Observation,
    ObservationBackend,
)
from gpud.core.vocab import ServeState
from gpud.host.cgroups import CachedAttribution, container_of_pid

log = logging.getLogger("gpud.observer")

# A crossing back below the threshold must clear it by this much before it can fire again, so a
# draw hovering at the line does not log an event on every poll.
HYSTERESIS_MIB = 64


def make_backend(cfg: Config) -> ObservationBackend:
    if cfg.simulation is not None:
        from gpud.host.simulation import SimulatedBackend, SimulatedDevice

        devices = [SimulatedDevice(d.uuid, d.total_mib, d.index, d.pci_bus_id, d.name,
                                   d.process_memory)
                   for d in cfg.simulation.devices]
        backend = SimulatedBackend(devices, Path(cfg.simulation.state_file))
        backend.open_procs_dir()
        return backend
    from gpud.host.nvml import NvmlBackend

    return NvmlBackend()


def make_observer(cfg: Config) -> Observer:
    return Observer(make_backend(cfg), interval=cfg.daemon.observe_interval_s)


@dataclass
class Crossings:
    """Edge detection with hysteresis: which keys crossed above their limit, which came back."""

    above: set[str] = field(default_factory=set)

    def update(self, values: Mapping[str, int]) -> tuple[list[str], list[str]]:
        """`values` are amounts over the limit (> 0 means over). Returns (rose, fell)."""
        rose = [k for k, v in values.items() if v > 0 and k not in self.above]
        fell = [k for k in list(self.above) if values.get(k, -math.inf) <= -HYSTERESIS_MIB
                or k not in values]
        self.above.update(rose)
        self.above.difference_update(fell)
        return rose, fell


class Observer:
    def __init__(self, backend: ObservationBackend, *, interval: float = 1.0,
                 proc_root: Path = Path("/proc"),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backend = backend
        self.interval = interval
        self.proc_root = proc_root
        self.clock = clock
        self._attribute = CachedAttribution(proc_root)
        self.latest: Observation | None = None
        self.owners: dict[int, str] = {}
        self.draws: dict[str, dict[str, int]] = {}  # device uuid -> serve -> MiB
        self.sample_seconds = 0.0
        # GPU processes in a container's cgroup that no serve unit holds: pid -> (container,
        # cgroup path); read once per PID (a process does not leave its container)
        self.strays: dict[int, tuple[str, str]] = {}
        self._stray_seen: dict[int, tuple[str, str] | None] = {}
        self._listeners: list[Callable[[Observation], Awaitable[None]]] = []
        self._task: asyncio.Task[None] | None = None
        self._sampled = asyncio.Event()

    @property
    def simulated(self) -> bool:
        return self.backend.name == "simulated"

    @property
    def available(self) -> bool:
        return self.latest is not None and self.latest.available

    async def __aenter__(self) -> Observer:
        await self.sample()
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.get_running_loop().run_in_executor(None, self.backend.close)

    def listen(self, callback: Callable[[Observation], Awaitable[None]]) -> None:
        self._listeners.append(callback)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                obs = await self.sample()
            except Exception:  # a broken sample must not end observation for good
                log.exception("observation sample failed")
                continue
            for listener in self._listeners:
                try:
                    await listener(obs)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("observation listener failed")

    def _sample_blocking(self) -> tuple[Observation, dict[int, str], float]:
        start = time.perf_counter()
        obs = self.backend.sample()
        pids = {p.pid for d in obs.devices for p in (d.processes or ())}
        owners = self._attribute(pids)
        unowned = pids - owners.keys()
        for pid in set(self._stray_seen) - unowned:
            del self._stray_seen[pid]
        for pid in unowned - self._stray_seen.keys():
            self._stray_seen[pid] = container_of_pid(pid, self.proc_root)
        self.strays = {pid: c for pid, c in self._stray_seen.items() if c is not None}
        return obs, owners, time.perf_counter() - start

    async def sample(self) -> Observation:
        """One observation, taken in a worker thread (NVML calls and /proc reads block)."""
        loop = asyncio.get_running_loop()
        obs, owners, seconds = await loop.run_in_executor(None, self._sample_blocking)
        was = self.latest.available if self.latest else None
        self.latest, self.owners, self.sample_seconds = obs, owners, seconds
        self.draws = {
            d.uuid: serve_draws(((p.pid, p.mib) for p in (d.processes or ())), owners)
            for d in obs.devices
        }
        if was is not None and was != obs.available:
            if obs.available:
                log.info("observation available again (%s)", obs.backend)
            else:
                log.warning("observation unavailable: %s", obs.reason)
        self._sampled.set()
        self._sampled = asyncio.Event()
        return obs

    async def next_sample(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._sampled.wait(), timeout)

    # ---- questions the ledger asks ---------------------------------------------------------

    def view(self) -> DeviceView:
        """The latest sample's answers, as a value (see DeviceView)."""
        return DeviceView(self.latest)

    def device(self, ref: str) -> DeviceSample | None:
        return self.view().device(ref)

    def device_problem(self, ref: str) -> str | None:
        return self.view().device_problem(ref)

    def device_total(self, ref: str) -> int | None:
        return self.view().device_total(ref)

    def present_devices(self) -> list[str] | None:
        return self.view().present_devices()

    def device_index(self, ref: str) -> int | None:
        dev = self.device(ref)
        if dev is not None:
            return dev.index
        return int(ref) if ref.isdigit() else None

    def status(self) -> answers.Observation:
        obs = self.latest
        devices = []
        for d in obs.devices if obs else ():
            devices.append({"uuid": d.uuid, "index": d.index, "pci_bus_id": d.pci_bus_id,
                            "name": d.name, "total_mib": d.total_mib, "used_mib": d.used_mib,
                            "free_mib": d.free_mib, "healthy": d.healthy, "problem": d.problem})
        return {
            "backend": self.backend.name,
            "simulated": self.simulated,
            "available": bool(obs and obs.available),
            "reason": obs.reason if obs else "not sampled yet",
            "taken_at": obs.taken_at if obs else None,
            "sample_ms": round(self.sample_seconds * 1000, 3),
            "devices": devices,
        }

    def _roles_on(self, ref: str, ledger: Ledger) -> list[str]:
        dev = self.device(ref)
        if dev is None:
            return []
        return [name for name, b in ledger.roles.items()
                if not b.missing and (d := self.device(b.device)) is not None and d.uuid == dev.uuid]

    def draw_for(self, ref: str, ledger: Ledger, states: Mapping[str, ServeState]) -> DeviceDraw | None:
        dev = self.device(ref)
        if dev is None or not dev.healthy or dev.total_mib is None or dev.used_mib is None \
                or dev.free_mib is None:
            return None
        if dev.processes is None:
            # The driver would not list processes: nothing can be attributed, and calling all
            # of "used" non-ledger draw would raise false alarms. No split rather than a wrong one.
            return None
        roles = self._roles_on(ref, ledger)
        reservations = [r for r in ledger.reservations.values()
                        if any(r.on(role) for role in roles)]
        return device_draw(
            total_mib=dev.total_mib, used_mib=dev.used_mib, free_mib=dev.free_mib,
            draws=self.draws.get(dev.uuid, {}), reservations=reservations, states=states,
            reserve_mib=sum(ledger.roles[r].reserve_mib for r in roles),
            per_process=reports_process_memory(dev, serves_draw=any(
                states.get(r.serve) in DRAWING_STATES for r in reservations)),
        )

    def physical_view(self, ref: str, serve: str, ledger: Ledger,
                      states: Mapping[str, ServeState]) -> PhysicalView | None:
        draw = self.draw_for(ref, ledger, states)
        if draw is None:
            return None
        own = draw.by_serve.get(serve, 0)
        res = ledger.reservations.get(serve)
        return PhysicalView(draw.physical_free_mib, draw.pending_mib, own,
                            pending_share(res, states.get(serve), own))

    def observed_mib(self, serve: str) -> int | None:
        if not self.available:
            return None
        total = None
        for per_device in self.draws.values():
            if serve in per_device:
                total = (total or 0) + per_device[serve]
        return total if total is not None else 0

    def observed_each_mib(self, serve: str) -> int | None:
        """The most the serve draws on any one of its devices: what a reservation (held the
        same on each of its roles) must cover. For a serve on one device, its draw there."""
        by_device = self.observed_by_device(serve)
        if by_device is None:
            return None
        return max(by_device.values(), default=0)

    def observed_by_device(self, serve: str) -> dict[str, int] | None:
        """The serve's draw on each device it draws on (device UUID -> MiB); None while
        observation is unavailable."""
        if not self.available:
            return None
        return {uuid: per[serve] for uuid, per in self.draws.items() if serve in per}


def reports_process_memory(dev: DeviceSample, *, serves_draw: bool) -> bool:
    """Whether the driver says what each process on the device holds. Under WDDM (a Windows
    desktop's GPU, WSL2 among them) NVML reports NVML_VALUE_NOT_AVAILABLE as every process's
    usedGpuMemory ("Windows KMD manages all the memory and not the NVIDIA driver": NVML API
    reference, nvmlProcessInfo_t), or lists no process at all. A list whose processes all lack
    a figure is that; so is an empty list while serves of the device run (`serves_draw`): a
    running serve's engine would be listed."""
    procs = dev.processes
    if procs is None or any(p.mib is not None for p in procs):
        return True
    return not (procs or serves_draw)


def overdraws(observed: Mapping[str, int], reserved: Mapping[str, int],
              tolerance_mib: int) -> dict[str, int]:
    """MiB each serve draws over its reservation plus the tolerance (> 0: overdraw)."""
    return {s: observed.get(s, 0) - (mib + tolerance_mib) for s, mib in reserved.items()}


def all_draws(draws: Iterable[Mapping[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for per_device in draws:
        for serve, mib in per_device.items():
            out[serve] = out.get(serve, 0) + mib
    return out
