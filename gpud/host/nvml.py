"""Observation through NVML (NVIDIA's ``pynvml`` module from the nvidia-ml-py package).

Every NVML call goes through one choke point, ``NvmlBackend._call``, which sorts NVML's errors:

- the capability is absent: ``NotSupported``, ``NoPermission``, ``FunctionNotFound`` (the
  driver's library is older than the binding) and the binding's ``NVMLLibraryMismatchError`` →
  the value is ``None`` ("not supported" is data), logged once per capability and device;
- the device is broken: ``GpuIsLost``, ``ResetRequired``, ``Unknown`` and any other error while
  reading a device → that device is reported unhealthy with the reason; the others are still read;
- the library is gone: ``LibraryNotFound``, ``DriverNotLoaded``, ``Uninitialized``,
  ``LibRmVersionMismatch`` (and any error from ``nvmlInit``) → the whole observation is
  ``available=False`` with the reason, and ``nvmlInit`` is retried on a later sample, at most once
  every ``retry_s`` seconds.

Versioned calls are probed once, newest first (processes v3 → v2 → unversioned, memory v2 → v1),
and the first one that exists is remembered. Whether the binding has a function or constant is
asked explicitly (``getattr`` on the module, once per name and init), never read from an
``AttributeError``: one raised inside a call is a fault and propagates.

Sampling blocks (NVML calls into the driver); callers run ``sample`` in a worker thread. A lock
makes concurrent ``sample``/``close`` calls safe.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpud.core.observation import BackendName, DeviceSample, Observation, ProcessDraw

log = logging.getLogger("gpud.nvml")

MIB = 2**20
# NVML_VALUE_NOT_AVAILABLE for unsigned long long fields: "the driver cannot say". Recent
# bindings turn it into None themselves; older ones hand the raw sentinel through.
VALUE_NOT_AVAILABLE = 2**64 - 1

DEFAULT_RETRY_S = 30.0

# Error class names as nvidia-ml-py generates them from NVML_ERROR_* (NVMLError(code) builds the
# matching subclass). Looked up on the injected module, so a fake module carries the real classes.
_ABSENT_ERRORS = ("NVMLError_NotSupported", "NVMLError_NoPermission")
_MISSING_ERRORS = ("NVMLError_FunctionNotFound",)
_LIBRARY_ERRORS = (
    "NVMLError_LibraryNotFound",
    "NVMLError_DriverNotLoaded",
    "NVMLError_Uninitialized",
    "NVMLError_LibRmVersionMismatch",
)


class _Missing(Exception):
    """The function does not exist in this binding or in the driver's library."""


class _Absent(Exception):
    """The device or driver does not support the query (or refuses it to us)."""


class _DeviceFailure(Exception):
    """Reading the device failed: it is lost, needs a reset, or answered with an error."""


class _LibraryFailure(Exception):
    """NVML as a whole is not usable: library missing, driver not loaded, not initialized."""


@dataclass(frozen=True, slots=True)
class _Identity:
    uuid: str
    index: int
    pci_bus_id: str
    name: str


_ABSENT = object()


@dataclass(frozen=True)
class _Variant:
    """One way of making a versioned query: a pynvml function, its arguments, and the pynvml
    constants it takes as keywords (``version=nvmlMemory_v2``)."""

    function: str
    args: tuple[Any, ...] = ()
    constants: tuple[tuple[str, str], ...] = ()  # (keyword, constant name)

    @property
    def label(self) -> str:
        keywords = ", ".join(f"{k}={c}" for k, c in self.constants)
        return f"{self.function}({keywords})" if keywords else self.function


class NvmlBackend:
    """The real observation backend. ``nvml`` is the ``pynvml`` module, or a fake in tests."""

    name: BackendName = "nvml"

    def __init__(
        self,
        nvml: Any = None,
        *,
        retry_s: float = DEFAULT_RETRY_S,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._nvml = nvml
        self._import_error: str | None = None
        if nvml is None:
            try:
                import pynvml
            except ImportError as exc:
                self._import_error = f"nvidia-ml-py is not installed: {exc}"
            else:
                self._nvml = pynvml
        self._retry_s = retry_s
        self._clock = clock
        self._wall_clock = wall_clock
        self._lock = threading.Lock()
        self._initialized = False
        self._last_init_attempt: float | None = None
        self._unavailable_reason: str | None = self._import_error
        # capability -> index of the first variant that exists; len(variants): none exists.
        self._probed: dict[str, int] = {}
        # pynvml name -> the module's attribute, or _ABSENT: asked once per init.
        self._names: dict[str, Any] = {}
        self._logged_absent: set[tuple[str, str]] = set()
        # Last identity read per index, so a device that is lost later is still named.
        self._identities: dict[int, _Identity] = {}
        # Every device read once, by UUID, and the ones no longer listed (with the reason).
        self._seen: dict[str, _Identity] = {}
        self._vanished: dict[str, str] = {}
        # Last problem logged per index: a broken device is logged when it breaks, not per sample.
        self._problems: dict[int, str] = {}

    # ---- the choke point ------------------------------------------------------------------

    def _error_class(self, name: str) -> type[BaseException] | None:
        cls = getattr(self._nvml, name, None)
        return cls if isinstance(cls, type) and issubclass(cls, BaseException) else None

    def _is(self, exc: BaseException, names: tuple[str, ...]) -> bool:
        for name in names:
            cls = self._error_class(name)
            if cls is not None and isinstance(exc, cls):
                return True
        return False

    def _name(self, name: str) -> Any:
        """The binding's function or constant ``name``; raises _Missing when this nvidia-ml-py
        has none by that name (an older binding)."""
        value = self._names.get(name)
        if value is None:
            value = self._names[name] = getattr(self._nvml, name, _ABSENT)
        if value is _ABSENT:
            raise _Missing(f"nvidia-ml-py has no {name}")
        return value

    def _bind(self, variant: _Variant) -> Callable[[], Any]:
        """The call ``variant`` makes; raises _Missing when the binding lacks its function or
        one of its constants."""
        func = self._name(variant.function)
        keywords = {k: self._name(c) for k, c in variant.constants}
        return lambda: func(*variant.args, **keywords)

    def _fn(self, function: str, *args: Any) -> Callable[[], Any]:
        return self._bind(_Variant(function, args))

    def _call(self, func: Callable[[], Any]) -> Any:
        """Run one NVML call; sort what it raises into the kinds described above."""
        nvml_error = self._error_class("NVMLError")
        mismatch = self._error_class("NVMLLibraryMismatchError")
        try:
            return func()
        except Exception as exc:
            if mismatch is not None and isinstance(exc, mismatch):
                raise _Missing(str(exc)) from exc
            if nvml_error is None or not isinstance(exc, nvml_error):
                raise
            if self._is(exc, _MISSING_ERRORS):
                raise _Missing(_describe(exc)) from exc
            if self._is(exc, _ABSENT_ERRORS):
                raise _Absent(_describe(exc)) from exc
            if self._is(exc, _LIBRARY_ERRORS):
                raise _LibraryFailure(_describe(exc)) from exc
            # GpuIsLost, ResetRequired, Unknown and the rest: this device, this sample.
            raise _DeviceFailure(_describe(exc)) from exc

    def _query(self, capability: str, device: str, variants: list[_Variant]) -> Any | None:
        """The first variant that exists, probed once and remembered. ``None``: not supported."""
        start = self._probed.get(capability, 0)
        for position in range(start, len(variants)):
            label = variants[position].label
            try:
                value = self._call(self._bind(variants[position]))
            except _Missing as exc:
                log.debug("NVML: %s is missing (%s), trying the next variant", label, exc)
                continue
            except _Absent as exc:
                self._probed[capability] = position
                self._log_absent(capability, device, str(exc))
                return None
            if self._probed.get(capability) != position:
                self._probed[capability] = position
                log.debug("NVML: %s through %s", capability, label)
            return value
        if self._probed.get(capability) != len(variants):
            self._probed[capability] = len(variants)
            self._log_absent(capability, "all devices", "no variant exists in this NVML")
        return None

    def _log_absent(self, capability: str, device: str, why: str) -> None:
        key = (capability, device)
        if key not in self._logged_absent:
            self._logged_absent.add(key)
            log.info(
                "NVML: %s not supported on %s (%s): reported as unknown", capability, device, why
            )

    # ---- the backend ----------------------------------------------------------------------

    def sample(self) -> Observation:
        with self._lock:
            if not self._ensure_initialized():
                return self._unavailable()
            try:
                devices = self._sample_devices()
            except _LibraryFailure as exc:
                self._lose_library(str(exc))
                return self._unavailable()
            return Observation(
                backend="nvml",
                available=True,
                reason=None,
                devices=devices,
                taken_at=self._wall_clock(),
            )

    def close(self) -> None:
        with self._lock:
            if not self._initialized:
                return
            self._initialized = False
            try:
                self._call(self._fn("nvmlShutdown"))
            except (_Missing, _Absent, _DeviceFailure, _LibraryFailure) as exc:
                log.warning("NVML: nvmlShutdown failed: %s", exc)

    def _unavailable(self) -> Observation:
        return Observation(
            backend="nvml",
            available=False,
            reason=self._unavailable_reason or "NVML is not initialized",
            devices=(),
            taken_at=self._wall_clock(),
        )

    def _ensure_initialized(self) -> bool:
        if self._initialized:
            return True
        if self._nvml is None:
            return False
        now = self._clock()
        if self._last_init_attempt is not None and now - self._last_init_attempt < self._retry_s:
            return False
        self._last_init_attempt = now
        try:
            self._call(self._fn("nvmlInit"))
        except (_Missing, _Absent, _DeviceFailure, _LibraryFailure) as exc:
            reason = f"NVML init failed: {exc}"
            if reason != self._unavailable_reason:
                log.warning("%s; retrying every %gs", reason, self._retry_s)
            self._unavailable_reason = reason
            return False
        if self._unavailable_reason is not None:
            log.info("NVML initialized (was unavailable: %s)", self._unavailable_reason)
        self._initialized = True
        self._unavailable_reason = None
        # A new init may meet a different driver (upgraded while NVML was gone): probe again.
        self._probed.clear()
        self._names.clear()
        return True

    def _lose_library(self, why: str) -> None:
        """NVML went away mid-sample: drop it; the next sample tries ``nvmlInit`` at once."""
        self._unavailable_reason = f"NVML became unavailable: {why}"
        log.warning("%s", self._unavailable_reason)
        self._initialized = False
        self._last_init_attempt = None
        with contextlib.suppress(_Missing, _Absent, _DeviceFailure, _LibraryFailure):
            self._call(self._fn("nvmlShutdown"))

    def _sample_devices(self) -> tuple[DeviceSample, ...]:
        try:
            count = self._call(self._fn("nvmlDeviceGetCount"))
        except (_Missing, _Absent, _DeviceFailure) as exc:
            raise _LibraryFailure(f"cannot count devices: {exc}") from exc
        samples = [self._sample_device(int(index)) for index in range(int(count))]
        # A device that fell off the bus (Xid 79) may vanish from the count instead of
        # answering GPU_IS_LOST: one seen before is still reported, as lost, not forgotten
        # (a role naming it would otherwise just stop matching anything).
        listed = {d.uuid for d in samples}
        for uuid, identity in sorted(self._seen.items()):
            if uuid in listed:
                continue
            problem = "nvml: device no longer listed by the driver (fell off the bus?)"
            if self._vanished.get(uuid) != problem:
                self._vanished[uuid] = problem
                log.warning("NVML: device %s (index %d) %s", uuid, identity.index, problem[6:])
            samples.append(DeviceSample(
                uuid=uuid, index=identity.index, pci_bus_id=identity.pci_bus_id,
                name=identity.name, total_mib=None, used_mib=None, free_mib=None,
                processes=None, healthy=False, problem=problem))
        for uuid in listed & self._vanished.keys():
            log.info("NVML: device %s listed again", uuid)
            del self._vanished[uuid]
        return tuple(samples)

    def _sample_device(self, index: int) -> DeviceSample:
        """One device; a ``_DeviceFailure`` anywhere makes just this device unhealthy."""
        identity = self._identities.get(index) or _Identity(
            uuid=f"unknown-gpu-{index}", index=index, pci_bus_id="", name="unknown GPU"
        )
        try:
            handle = self._call(self._fn("nvmlDeviceGetHandleByIndex", index))
            identity = self._read_identity(index, handle, identity)
            self._identities[index] = identity
            self._seen[identity.uuid] = identity
            total, used, free = self._read_memory(handle, identity.uuid)
            processes = self._read_processes(handle, identity.uuid)
        except (_Missing, _Absent, _DeviceFailure) as exc:
            problem = f"nvml: {exc}"
            if self._problems.get(index) != problem:
                self._problems[index] = problem
                log.warning("NVML: device %d (%s) unhealthy: %s", index, identity.uuid, exc)
            return DeviceSample(
                uuid=identity.uuid,
                index=identity.index,
                pci_bus_id=identity.pci_bus_id,
                name=identity.name,
                total_mib=None,
                used_mib=None,
                free_mib=None,
                processes=None,
                healthy=False,
                problem=problem,
            )
        if self._problems.pop(index, None) is not None:
            log.info("NVML: device %d (%s) readable again", index, identity.uuid)
        return DeviceSample(
            uuid=identity.uuid,
            index=identity.index,
            pci_bus_id=identity.pci_bus_id,
            name=identity.name,
            total_mib=total,
            used_mib=used,
            free_mib=free,
            processes=processes,
        )

    def _read_identity(self, index: int, handle: Any, known: _Identity) -> _Identity:
        where = f"device {index}"
        uuid = self._query("uuid", where, [_Variant("nvmlDeviceGetUUID", (handle,))])
        where = _text(uuid) if uuid is not None else where
        pci = self._query("pci-info", where, [_Variant("nvmlDeviceGetPciInfo", (handle,))])
        name = self._query("name", where, [_Variant("nvmlDeviceGetName", (handle,))])
        bus_id = getattr(pci, "busId", None) if pci is not None else None
        return _Identity(
            uuid=_text(uuid) if uuid is not None else known.uuid,
            index=index,
            pci_bus_id=_text(bus_id) if bus_id is not None else known.pci_bus_id,
            name=_text(name) if name is not None else known.name,
        )

    def _read_memory(self, handle: Any, uuid: str) -> tuple[int | None, int | None, int | None]:
        memory = self._query(
            "memory",
            uuid,
            [
                _Variant("nvmlDeviceGetMemoryInfo", (handle,), (("version", "nvmlMemory_v2"),)),
                _Variant("nvmlDeviceGetMemoryInfo", (handle,)),
            ],
        )
        if memory is None:
            return None, None, None
        total = int(memory.total)
        free = int(memory.free)
        # v1's "used" is allocated + driver-reserved; v2 splits the reserve out. Both report the
        # v1 meaning (used + free == total), so a figure does not change with the driver version:
        # the driver's own reserve is memory no serve can have.
        used = int(memory.used) + int(getattr(memory, "reserved", 0) or 0)
        return total // MIB, used // MIB, free // MIB

    def _read_processes(self, handle: Any, uuid: str) -> tuple[ProcessDraw, ...] | None:
        compute = self._read_process_list("compute", handle, uuid)
        graphics = self._read_process_list("graphics", handle, uuid)
        # Serves are CUDA compute contexts: without the compute list the attribution is unknown.
        if compute is None:
            return None
        draws: dict[int, int | None] = {}
        for proc in (*compute, *(graphics or ())):
            pid = int(proc.pid)
            mib = _process_mib(getattr(proc, "usedGpuMemory", None))
            if pid in draws:
                # One process in both lists (a CUDA + graphics context) is one draw, not two.
                known = [m for m in (draws[pid], mib) if m is not None]
                draws[pid] = max(known) if known else None
            else:
                draws[pid] = mib
        return tuple(ProcessDraw(pid, mib) for pid, mib in sorted(draws.items()))

    def _read_process_list(self, kind: str, handle: Any, uuid: str) -> list[Any] | None:
        base = "nvmlDeviceGetComputeRunningProcesses"
        if kind == "graphics":
            base = "nvmlDeviceGetGraphicsRunningProcesses"
        variants = [_Variant(f"{base}{suffix}", (handle,)) for suffix in ("_v3", "_v2", "")]
        result = self._query(f"{kind}-processes", uuid, variants)
        return None if result is None else list(result)


def _describe(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:
        text = ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace").rstrip("\x00")
    return str(value)


def _process_mib(raw: Any) -> int | None:
    if raw is None:
        return None
    used = int(raw)
    if used >= VALUE_NOT_AVAILABLE or used < 0:
        return None
    return used // MIB
