"""What an observation backend reports: plain values, no I/O.

Two backends produce these: NVML (``gpud.host.nvml``) and the simulated one (``gpud.host.simulation``).
Both are blocking and are sampled from a worker thread, never from the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

BackendName = Literal["nvml", "simulated"]


@dataclass(frozen=True, slots=True)
class ProcessDraw:
    pid: int
    # None: the driver could not say (NVML's usedGpuMemory is None under some drivers and in
    # containers). Such memory is still inside the device's "used": it counts as unattributed.
    mib: int | None


@dataclass(frozen=True, slots=True)
class DeviceSample:
    uuid: str
    index: int
    pci_bus_id: str
    name: str
    # None when the device could not be read (lost, reset required): see ``healthy``/``problem``.
    total_mib: int | None
    used_mib: int | None
    free_mib: int | None
    # None: the per-process list could not be read (not supported, no permission, device
    # unhealthy), so nothing on the device can be attributed. () means "read: no processes".
    processes: tuple[ProcessDraw, ...] | None = ()
    healthy: bool = True
    problem: str | None = None


@dataclass(frozen=True, slots=True)
class Observation:
    backend: BackendName
    available: bool
    # Why observation is unavailable (NVML missing, driver not loaded, ...), else None.
    reason: str | None
    devices: tuple[DeviceSample, ...]
    taken_at: float

    @property
    def simulated(self) -> bool:
        return self.backend == "simulated"


class ObservationBackend(Protocol):
    """A source of device samples. ``sample`` blocks; callers run it in a worker thread."""

    name: BackendName

    def sample(self) -> Observation: ...

    def close(self) -> None: ...


def normalize_bus_id(bus_id: str) -> str:
    """NVML spells bus ids "00000000:01:00.0"; people write "0000:01:00.0" or "01:00.0"."""
    text = bus_id.strip().lower()
    parts = text.split(":")
    if len(parts) == 2:
        parts.insert(0, "0")
    if len(parts) != 3:
        return text
    domain, bus, rest = parts
    try:
        return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{rest}"
    except ValueError:
        return text


def find_device(devices: tuple[DeviceSample, ...], ref: str) -> DeviceSample | None:
    """The device a role names: by UUID (preferred), PCI bus id, or index."""
    ref = ref.strip()
    for dev in devices:
        if dev.uuid.lower() == ref.lower():
            return dev
    if ":" in ref:
        want = normalize_bus_id(ref)
        for dev in devices:
            if normalize_bus_id(dev.pci_bus_id) == want:
                return dev
        return None
    if ref.isdigit():
        for dev in devices:
            if dev.index == int(ref):
                return dev
    return None


@dataclass(frozen=True)
class DeviceView:
    """The questions a ledger asks about devices, answered from one sample (None: nothing
    observed yet). A value: a plan made in another process reads the same answers."""

    latest: Observation | None

    def device(self, ref: str) -> DeviceSample | None:
        if self.latest is None or not self.latest.available:
            return None
        return find_device(self.latest.devices, ref)

    def device_uuid(self, ref: str) -> str | None:
        """The UUID of the device a reference names (index, bus id or UUID), where observed."""
        dev = self.device(ref)
        return dev.uuid if dev is not None else None

    def device_problem(self, ref: str) -> str | None:
        """Why the device is lost or unreadable (NVML or the simulation says so), else None.
        None too while observation is unavailable: then nothing is known either way."""
        dev = self.device(ref)
        if dev is None or dev.healthy:
            return None
        return dev.problem or "device unhealthy"

    def device_total(self, ref: str) -> int | None:
        dev = self.device(ref)
        return dev.total_mib if dev else None

    def present_devices(self) -> list[str] | None:
        """The devices observation sees, for messages; None when it sees nothing at all."""
        if self.latest is None or not self.latest.available:
            return None
        return [f"{d.uuid} (index {d.index})" for d in self.latest.devices]
