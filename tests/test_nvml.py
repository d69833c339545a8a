"""The NVML adapter against a fake ``pynvml`` module that raises the real pynvml exceptions."""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass, field
from typing import Any

import pynvml
import pytest

from gpud.core.observation import ObservationBackend, ProcessDraw
from gpud.host.nvml import VALUE_NOT_AVAILABLE, NvmlBackend

MIB = 2**20


def test_real_binding_maps_codes_to_the_classes_the_backend_looks_up() -> None:
    # The backend finds error classes by these names; NVMLError(code) must build them.
    pairs = {
        pynvml.NVML_ERROR_NOT_SUPPORTED: "NVMLError_NotSupported",
        pynvml.NVML_ERROR_NO_PERMISSION: "NVMLError_NoPermission",
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND: "NVMLError_FunctionNotFound",
        pynvml.NVML_ERROR_GPU_IS_LOST: "NVMLError_GpuIsLost",
        pynvml.NVML_ERROR_RESET_REQUIRED: "NVMLError_ResetRequired",
        pynvml.NVML_ERROR_UNKNOWN: "NVMLError_Unknown",
        pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: "NVMLError_LibraryNotFound",
        pynvml.NVML_ERROR_DRIVER_NOT_LOADED: "NVMLError_DriverNotLoaded",
        pynvml.NVML_ERROR_UNINITIALIZED: "NVMLError_Uninitialized",
        pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: "NVMLError_LibRmVersionMismatch",
    }
    for code, name in pairs.items():
        assert type(pynvml.NVMLError(code)) is getattr(pynvml, name)
    assert pynvml.NVMLLibraryMismatchError is not None


# ---- the fake --------------------------------------------------------------------------------


@dataclass
class FakeDevice:
    uuid: str
    bus_id: bytes | str = b"00000000:01:00.0"
    name: str | bytes = "NVIDIA H200"
    total: int = 32607 * MIB
    reserved: int = 400 * MIB
    used: int = 0
    compute: list[tuple[int, int | None]] = field(default_factory=list)
    graphics: list[tuple[int, int | None]] = field(default_factory=list)
    # NVML function name -> error code it answers with for this device.
    errors: dict[str, int] = field(default_factory=dict)

    @property
    def free(self) -> int:
        return self.total - self.reserved - self.used


class FakeDriver:
    """What the C library would answer. ``missing``: functions the driver's library lacks."""

    def __init__(self, devices: list[FakeDevice], missing: set[str] | None = None) -> None:
        self.devices = devices
        self.missing = missing or set()
        self.init_error: int | None = None
        self.count_error: int | None = None
        self.calls: list[str] = []
        self.initialized = False

    def _enter(self, function: str, device: FakeDevice | None = None) -> None:
        self.calls.append(function)
        if function in self.missing:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        if device is not None and function in device.errors:
            raise pynvml.NVMLError(device.errors[function])

    def module(self, *, without: tuple[str, ...] = ()) -> Any:
        """A stand-in for the ``pynvml`` module: real exception classes, fake functions."""
        ns = types.SimpleNamespace()
        for name in dir(pynvml):
            if name.startswith(("NVMLError", "NVML_ERROR_")) or name == "NVMLLibraryMismatchError":
                setattr(ns, name, getattr(pynvml, name))
        ns.nvmlMemory_v2 = pynvml.nvmlMemory_v2
        for name in dir(self):
            if name.startswith("nvml"):
                setattr(ns, name, getattr(self, name))
        for name in without:
            delattr(ns, name)
        return ns

    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self.calls.append("nvmlShutdown")
        self.initialized = False

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        if self.count_error is not None:
            raise pynvml.NVMLError(self.count_error)
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeDevice:
        device = self.devices[index]
        self._enter("nvmlDeviceGetHandleByIndex", device)
        return device

    def nvmlDeviceGetUUID(self, handle: FakeDevice) -> str:
        self._enter("nvmlDeviceGetUUID", handle)
        return handle.uuid

    def nvmlDeviceGetName(self, handle: FakeDevice) -> str | bytes:
        self._enter("nvmlDeviceGetName", handle)
        return handle.name

    def nvmlDeviceGetPciInfo(self, handle: FakeDevice) -> Any:
        self._enter("nvmlDeviceGetPciInfo", handle)
        return types.SimpleNamespace(busId=handle.bus_id, domain=0, bus=1, device=0)

    def nvmlDeviceGetMemoryInfo(self, handle: FakeDevice, version: int | None = None) -> Any:
        if version:
            assert version == pynvml.nvmlMemory_v2
            self._enter("nvmlDeviceGetMemoryInfo_v2", handle)
            return types.SimpleNamespace(
                version=version,
                total=handle.total,
                reserved=handle.reserved,
                free=handle.free,
                used=handle.used,
            )
        self._enter("nvmlDeviceGetMemoryInfo", handle)
        # v1: "used" is allocated + reserved.
        return types.SimpleNamespace(
            total=handle.total, free=handle.free, used=handle.used + handle.reserved
        )

    def _procs(self, function: str, handle: FakeDevice, procs: list[tuple[int, int | None]]) -> Any:
        self._enter(function, handle)
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=mem) for pid, mem in procs]

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: FakeDevice) -> Any:
        return self._procs("nvmlDeviceGetComputeRunningProcesses_v3", handle, handle.compute)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: FakeDevice) -> Any:
        return self._procs("nvmlDeviceGetComputeRunningProcesses_v2", handle, handle.compute)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeDevice) -> Any:
        # The binding's unversioned call is v3 behind @throwOnVersionMismatch.
        try:
            return self._procs("nvmlDeviceGetComputeRunningProcesses", handle, handle.compute)
        except pynvml.NVMLError_FunctionNotFound as exc:
            raise pynvml.NVMLLibraryMismatchError("unversioned call") from exc

    def nvmlDeviceGetGraphicsRunningProcesses_v3(self, handle: FakeDevice) -> Any:
        return self._procs("nvmlDeviceGetGraphicsRunningProcesses_v3", handle, handle.graphics)

    def nvmlDeviceGetGraphicsRunningProcesses_v2(self, handle: FakeDevice) -> Any:
        return self._procs("nvmlDeviceGetGraphicsRunningProcesses_v2", handle, handle.graphics)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: FakeDevice) -> Any:
        try:
            return self._procs("nvmlDeviceGetGraphicsRunningProcesses", handle, handle.graphics)
        except pynvml.NVMLError_FunctionNotFound as exc:
            raise pynvml.NVMLLibraryMismatchError("unversioned call") from exc


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def backend(driver: FakeDriver, **kwargs: Any) -> tuple[NvmlBackend, Clock]:
    clock = Clock()
    module = driver.module(without=kwargs.pop("without", ()))
    return NvmlBackend(nvml=module, clock=clock, wall_clock=lambda: 42.0, **kwargs), clock


def two_devices() -> list[FakeDevice]:
    return [
        FakeDevice(
            uuid="GPU-aaaa",
            bus_id=b"00000000:01:00.0",
            used=20000 * MIB,
            compute=[(101, 14336 * MIB), (102, 5000 * MIB)],
        ),
        FakeDevice(uuid="GPU-bbbb", bus_id="00000000:41:00.0", name=b"NVIDIA H200", used=0),
    ]


# ---- tests -----------------------------------------------------------------------------------


def test_samples_identity_memory_and_processes() -> None:
    driver = FakeDriver(two_devices())
    nvml, _ = backend(driver)
    obs = nvml.sample()
    assert obs.available and obs.reason is None and obs.backend == "nvml"
    assert not obs.simulated and obs.taken_at == 42.0
    first, second = obs.devices
    assert (first.uuid, first.index, first.pci_bus_id, first.name) == (
        "GPU-aaaa",
        0,
        "00000000:01:00.0",
        "NVIDIA H200",
    )
    assert first.total_mib == 32607
    # used includes the driver's reserve (v1 meaning), so used + free == total.
    assert first.used_mib == 20400
    assert first.free_mib == 32607 - 20400
    assert first.processes == (ProcessDraw(101, 14336), ProcessDraw(102, 5000))
    assert first.healthy and first.problem is None
    assert second.index == 1 and second.processes == ()
    assert driver.initialized


def test_bus_id_and_name_as_bytes_or_str() -> None:
    driver = FakeDriver(two_devices())
    nvml, _ = backend(driver)
    first, second = nvml.sample().devices
    assert first.pci_bus_id == "00000000:01:00.0"  # bytes from the struct
    assert second.pci_bus_id == "00000000:41:00.0"  # str
    assert second.name == "NVIDIA H200"  # bytes from an older binding


def test_process_listing_not_supported_is_unknown_not_empty(
    caplog: pytest.LogCaptureFixture,
) -> None:
    devices = two_devices()
    devices[0].errors["nvmlDeviceGetComputeRunningProcesses_v3"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    driver = FakeDriver(devices)
    nvml, _ = backend(driver)
    with caplog.at_level(logging.INFO, logger="gpud.nvml"):
        first = nvml.sample().devices[0]
        again = nvml.sample().devices[0]
    assert first.processes is None and again.processes is None
    assert first.healthy and first.used_mib == 20400  # memory still observed
    # The other device still lists its processes through v3.
    assert nvml.sample().devices[1].processes == ()
    notices = [r for r in caplog.records if "not supported" in r.getMessage()]
    assert len(notices) == 1, [r.getMessage() for r in notices]


def test_no_permission_on_process_listing_is_unknown() -> None:
    devices = two_devices()
    devices[0].errors["nvmlDeviceGetComputeRunningProcesses_v3"] = pynvml.NVML_ERROR_NO_PERMISSION
    nvml, _ = backend(FakeDriver(devices))
    dev = nvml.sample().devices[0]
    assert dev.processes is None and dev.healthy


def test_used_memory_unknown_is_kept_as_none() -> None:
    devices = two_devices()
    devices[0].compute = [(101, None), (102, VALUE_NOT_AVAILABLE), (103, 1024 * MIB)]
    nvml, _ = backend(FakeDriver(devices))
    assert nvml.sample().devices[0].processes == (
        ProcessDraw(101, None),
        ProcessDraw(102, None),
        ProcessDraw(103, 1024),
    )


def test_pid_in_compute_and_graphics_counted_once() -> None:
    devices = two_devices()
    devices[0].compute = [(101, 14336 * MIB), (300, None)]
    devices[0].graphics = [(101, 14336 * MIB), (200, 900 * MIB), (300, 50 * MIB)]
    nvml, _ = backend(FakeDriver(devices))
    assert nvml.sample().devices[0].processes == (
        ProcessDraw(101, 14336),
        ProcessDraw(200, 900),
        ProcessDraw(300, 50),
    )


def test_v3_missing_falls_back_to_v2_probed_once() -> None:
    missing = {
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetGraphicsRunningProcesses_v3",
    }
    driver = FakeDriver(two_devices(), missing=missing)
    nvml, _ = backend(driver)
    for _ in range(3):
        assert nvml.sample().devices[0].processes == (
            ProcessDraw(101, 14336),
            ProcessDraw(102, 5000),
        )
    assert driver.calls.count("nvmlDeviceGetComputeRunningProcesses_v3") == 1
    # 3 samples x 2 devices
    assert driver.calls.count("nvmlDeviceGetComputeRunningProcesses_v2") == 6


def test_binding_without_v3_falls_back_to_v2() -> None:
    driver = FakeDriver(two_devices())
    nvml, _ = backend(
        driver,
        without=(
            "nvmlDeviceGetComputeRunningProcesses_v3",
            "nvmlDeviceGetGraphicsRunningProcesses_v3",
        ),
    )
    assert nvml.sample().devices[0].processes == (ProcessDraw(101, 14336), ProcessDraw(102, 5000))
    assert "nvmlDeviceGetComputeRunningProcesses_v2" in driver.calls


def test_only_unversioned_process_call_exists() -> None:
    missing = {
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetComputeRunningProcesses_v2",
    }
    driver = FakeDriver(two_devices(), missing=missing)
    nvml, _ = backend(driver)
    assert nvml.sample().devices[0].processes == (ProcessDraw(101, 14336), ProcessDraw(102, 5000))


def test_no_process_call_exists_is_unknown(caplog: pytest.LogCaptureFixture) -> None:
    missing = {
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetComputeRunningProcesses_v2",
        "nvmlDeviceGetComputeRunningProcesses",
    }
    driver = FakeDriver(two_devices(), missing=missing)
    nvml, _ = backend(driver)
    with caplog.at_level(logging.INFO, logger="gpud.nvml"):
        for _ in range(2):
            obs = nvml.sample()
            assert all(dev.processes is None and dev.healthy for dev in obs.devices)
    assert driver.calls.count("nvmlDeviceGetComputeRunningProcesses_v3") == 1
    assert len([r for r in caplog.records if "compute-processes" in r.getMessage()]) == 1


def test_memory_v2_missing_falls_back_to_v1() -> None:
    driver = FakeDriver(two_devices(), missing={"nvmlDeviceGetMemoryInfo_v2"})
    nvml, _ = backend(driver)
    nvml.sample()
    dev = nvml.sample().devices[0]
    assert (dev.total_mib, dev.used_mib, dev.free_mib) == (32607, 20400, 32607 - 20400)
    assert driver.calls.count("nvmlDeviceGetMemoryInfo_v2") == 1


def test_binding_without_memory_v2_uses_v1() -> None:
    driver = FakeDriver(two_devices())
    nvml, _ = backend(driver, without=("nvmlMemory_v2",))
    dev = nvml.sample().devices[0]
    assert (dev.total_mib, dev.used_mib, dev.free_mib) == (32607, 20400, 32607 - 20400)
    assert "nvmlDeviceGetMemoryInfo_v2" not in driver.calls


def test_memory_not_supported_is_none_device_still_healthy() -> None:
    devices = two_devices()
    devices[1].errors["nvmlDeviceGetMemoryInfo_v2"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    nvml, _ = backend(FakeDriver(devices))
    dev = nvml.sample().devices[1]
    assert (dev.total_mib, dev.used_mib, dev.free_mib) == (None, None, None)
    assert dev.healthy and dev.processes == ()


def test_library_not_found_at_init_then_retried_and_recovers() -> None:
    driver = FakeDriver(two_devices())
    driver.init_error = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    nvml, clock = backend(driver, retry_s=30.0)
    obs = nvml.sample()
    assert not obs.available and obs.devices == ()
    assert obs.reason is not None and "Library" in obs.reason
    clock.now += 10
    assert not nvml.sample().available
    assert driver.calls.count("nvmlInit") == 1  # not retried before retry_s
    driver.init_error = None
    clock.now += 10
    assert not nvml.sample().available
    assert driver.calls.count("nvmlInit") == 1
    clock.now += 10.5
    obs = nvml.sample()
    assert obs.available and obs.reason is None and len(obs.devices) == 2
    assert driver.calls.count("nvmlInit") == 2


@pytest.mark.parametrize(
    "code", [pynvml.NVML_ERROR_DRIVER_NOT_LOADED, pynvml.NVML_ERROR_UNINITIALIZED]
)
def test_driver_not_loaded_at_init_is_unavailable(code: int) -> None:
    driver = FakeDriver(two_devices())
    driver.init_error = code
    nvml, _ = backend(driver)
    obs = nvml.sample()
    assert not obs.available and obs.reason is not None and obs.reason.startswith("NVML init")


def test_library_lost_mid_run_reinitializes_on_next_sample() -> None:
    driver = FakeDriver(two_devices())
    nvml, _ = backend(driver)
    assert nvml.sample().available
    driver.count_error = pynvml.NVML_ERROR_UNINITIALIZED
    obs = nvml.sample()
    assert not obs.available and obs.reason is not None and "Uninitialized" in obs.reason
    driver.count_error = None
    assert nvml.sample().available  # no retry_s wait after a working library went away
    assert driver.calls.count("nvmlInit") == 2


@pytest.mark.parametrize(
    "code",
    [pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_RESET_REQUIRED, pynvml.NVML_ERROR_UNKNOWN],
)
def test_broken_device_is_unhealthy_other_still_observed(code: int) -> None:
    devices = two_devices()
    driver = FakeDriver(devices)
    nvml, _ = backend(driver)
    nvml.sample()
    devices[1].errors["nvmlDeviceGetMemoryInfo_v2"] = code
    obs = nvml.sample()
    assert obs.available
    good, bad = obs.devices
    assert good.healthy and good.used_mib == 20400
    assert not bad.healthy and bad.problem is not None and bad.problem.startswith("nvml:")
    assert (bad.total_mib, bad.used_mib, bad.free_mib, bad.processes) == (None, None, None, None)
    assert (bad.uuid, bad.index, bad.pci_bus_id) == ("GPU-bbbb", 1, "00000000:41:00.0")
    del devices[1].errors["nvmlDeviceGetMemoryInfo_v2"]
    assert nvml.sample().devices[1].healthy


def test_device_lost_before_ever_read_keeps_its_index() -> None:
    devices = two_devices()
    devices[0].errors["nvmlDeviceGetHandleByIndex"] = pynvml.NVML_ERROR_GPU_IS_LOST
    nvml, _ = backend(FakeDriver(devices))
    bad, good = nvml.sample().devices
    assert not bad.healthy and bad.index == 0 and bad.problem is not None
    assert "GpuIsLost" in bad.problem
    assert good.healthy and good.uuid == "GPU-bbbb"


def test_device_that_vanishes_from_the_count_is_reported_lost() -> None:
    devices = two_devices()
    driver = FakeDriver(devices)
    nvml, _ = backend(driver)
    assert [d.healthy for d in nvml.sample().devices] == [True, True]
    gone = devices.pop(1)  # fell off the bus: the driver lists one device
    good, lost = nvml.sample().devices
    assert good.healthy and good.uuid == "GPU-aaaa"
    assert (lost.uuid, lost.index, lost.healthy) == ("GPU-bbbb", 1, False)
    assert lost.problem is not None and "no longer listed" in lost.problem
    assert (lost.total_mib, lost.used_mib, lost.free_mib, lost.processes) == (None,) * 4
    devices.append(gone)
    assert [d.healthy for d in nvml.sample().devices] == [True, True]


def test_close_shuts_down_only_when_initialized() -> None:
    driver = FakeDriver(two_devices())
    nvml, _ = backend(driver)
    nvml.close()
    assert "nvmlShutdown" not in driver.calls
    nvml.sample()
    nvml.close()
    assert driver.calls.count("nvmlShutdown") == 1 and not driver.initialized
    nvml.close()
    assert driver.calls.count("nvmlShutdown") == 1


def test_foreign_exceptions_are_not_swallowed() -> None:
    driver = FakeDriver(two_devices())
    module = driver.module()

    def broken(handle: Any) -> Any:
        raise RuntimeError("a bug, not an NVML condition")

    module.nvmlDeviceGetUUID = broken
    nvml = NvmlBackend(nvml=module)
    with pytest.raises(RuntimeError):
        nvml.sample()


@pytest.mark.parametrize("function", ["nvmlDeviceGetComputeRunningProcesses_v3",
                                      "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetUUID"])
def test_an_attribute_error_inside_a_call_is_a_fault_not_not_supported(
        function: str, caplog: pytest.LogCaptureFixture) -> None:
    """A binding that has the function but fails inside it with AttributeError (a typo in it,
    or in gpud) propagates: only a name the module lacks, asked with getattr, is 'missing'."""
    driver = FakeDriver(two_devices())
    module = driver.module()

    def typo(*args: Any, **kwargs: Any) -> Any:
        return args[0].totl  # AttributeError, from inside the call

    setattr(module, function, typo)
    nvml = NvmlBackend(nvml=module)
    with caplog.at_level(logging.DEBUG, logger="gpud.nvml"), pytest.raises(AttributeError):
        nvml.sample()
    assert not [r for r in caplog.records if "not supported" in r.getMessage()
                or "is missing" in r.getMessage()]


def test_a_name_the_binding_lacks_is_asked_once_per_init() -> None:
    driver = FakeDriver(two_devices())
    module = driver.module(without=("nvmlDeviceGetComputeRunningProcesses_v3",))
    asked: list[str] = []

    class Counting:
        def __getattr__(self, name: str) -> Any:
            asked.append(name)
            return getattr(module, name)

    nvml = NvmlBackend(nvml=Counting())
    for _ in range(3):
        assert nvml.sample().devices[0].processes is not None
    assert asked.count("nvmlDeviceGetComputeRunningProcesses_v3") == 1
    assert asked.count("nvmlDeviceGetComputeRunningProcesses_v2") == 1


def test_is_an_observation_backend() -> None:
    nvml: ObservationBackend = NvmlBackend(nvml=FakeDriver([]).module())
    assert nvml.name == "nvml"
    obs = nvml.sample()
    assert obs.available and obs.devices == ()
