"""A stand-in for NVML on machines without a GPU.

Two sources make up what the simulated devices hold, both re-read at every ``sample``:

- the **state file** (JSON, may be rewritten at any time by a test or an operator): the draw
  nobody declared, and devices to report as lost::

      {"external": [{"device": "GPU-sim-0", "label": "display", "mib": 5837},
                    {"device": "GPU-sim-0", "label": "stt", "mib": 900, "pid": 4242}],
       "lost": ["GPU-sim-1"], "mem_available_mib": 65536}

  External draw is not a process (like a desktop display) unless the entry carries ``"pid"``: then
  it is also reported as that process's draw (a sidecar). ``{}`` means no external draw and no
  lost device. ``mem_available_mib``, when given, is the host's MemAvailable as gpud sees it
  (what a level-1 sleep parks weights in), instead of ``/proc/meminfo``.
- the **procs directory** (``state_file.parent / "sim-procs"`` unless given): stand-in serves
  register their own live processes there, one ``<pid>.json`` each
  (``{"pid": 1234, "device": "GPU-sim-0", "mib": 14336}``), written atomically with
  ``register_process``. A file whose process is gone (or whose PID now belongs to a different
  process) is ignored and removed.

A device's used = registered draws + external draws on it; free = max(0, total - used).

A broken state file (bad JSON, wrong shape, unknown device) or a missing one is never
half-applied: the last good state stays in force and the observation stays available, with
``reason`` saying the file is broken or missing (``gpuctl status`` shows it). Dropping the external
draw instead would make admission optimistic. When no good state
was ever read, nothing is known about the external draw, so the observation is unavailable
(strict admission then falls back to the ledger bound and says so).

This module uses the standard library only: the stand-in serve imports ``register_process``
without pulling in the daemon's dependencies.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeGuard

from gpud.core.observation import BackendName, DeviceSample, Observation, ProcessDraw

log = logging.getLogger("gpud.simulation")

# What a stand-in serve reads from its environment (set by whoever launches it).
GPUD_SIM_PROCS_DIR = "GPUD_SIM_PROCS_DIR"
GPUD_SIM_DEVICE = "GPUD_SIM_DEVICE"
GPUD_SIM_TOTAL_MIB = "GPUD_SIM_TOTAL_MIB"
# A serve on several devices: all of them, comma-separated, GPUD_SIM_DEVICE first. The stand-in
# registers its draw on each (vLLM's tensor-parallel workers hold the same share on every GPU).
GPUD_SIM_DEVICES = "GPUD_SIM_DEVICES"
# gpud's own PID namespace: a stand-in in another one (a container) names its registration with
# its own namespace, and the simulation finds the host PID that NVML would report.
GPUD_SIM_PIDNS = "GPUD_SIM_PIDNS"

PROCS_DIR_NAME = "sim-procs"
# The stand-ins' load windows, a folder in the procs directory (gpud.testing.standin.LOADING_DIR:
# that program imports this module only when it registers, so it spells the name itself).
LOADING_DIR_NAME = "loading"
# Sticky and writable by all, like /tmp: serves run as their own users (not root), each
# registers its own draw and cannot remove another's; gpud, the owner, removes the dead ones.
SHARED_DIR_MODE = 0o1777
# A cached registration's process is fully checked (zombie, PID reuse) this often; in between,
# only that /proc/PID still exists.
FULL_CHECK_S = 10.0
DEFAULT_NAME = "Simulated GPU"
LOST_PROBLEM = "simulated: device lost"

# PID.json, or PID.nsINODE.json from a process in another PID namespace (a container's).
_PROC_FILE = re.compile(r"^([0-9]+)(?:\.ns([0-9]+))?\.json$")


@dataclass(frozen=True, slots=True)
class SimulatedDevice:
    uuid: str
    total_mib: int
    index: int | None = None  # default: position in the device list
    pci_bus_id: str | None = None  # default: 00000000:<index+1>:00.0
    name: str | None = None  # default: "Simulated GPU"
    # What NVML says of each process's memory: "reported"; "not-available" (WDDM: every
    # process listed, its usedGpuMemory NVML_VALUE_NOT_AVAILABLE); "none" (WSL2: no process
    # listed at all). Device totals and used memory are reported either way.
    process_memory: str = "reported"


@dataclass(frozen=True, slots=True)
class ExternalDraw:
    device: str
    label: str
    mib: int
    pid: int | None = None


@dataclass(frozen=True, slots=True)
class SimulationState:
    """What the state file says."""

    external: tuple[ExternalDraw, ...] = ()
    lost: frozenset[str] = frozenset()
    mem_available_mib: int | None = None


class StateFileError(ValueError):
    """The state file cannot be used; the message says where and why."""


@dataclass(frozen=True, slots=True)
class _Registered:
    pid: int
    device: str
    mib: int
    # Further devices the process draws `mib` on, too (a stand-in for a tensor-parallel serve).
    also: tuple[str, ...] = ()

    def draws_on(self, uuid: str) -> bool:
        return uuid == self.device or uuid in self.also


class SimulatedBackend:
    name: BackendName = "simulated"

    def __init__(
        self,
        devices: Sequence[SimulatedDevice],
        state_file: Path,
        procs_dir: Path | None = None,
        *,
        proc_root: Path = Path("/proc"),
        remove_dead: bool = True,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._devices = tuple(_resolve(position, dev) for position, dev in enumerate(devices))
        uuids = [dev.uuid for dev in self._devices]
        if len(set(uuids)) != len(uuids):
            raise ValueError(f"simulated devices: duplicate uuid in {uuids}")
        indexes = [dev.index for dev in self._devices]
        if len(set(indexes)) != len(indexes):
            raise ValueError(f"simulated devices: duplicate index in {indexes}")
        self.state_file = state_file
        self.procs_dir = procs_dir if procs_dir is not None else state_file.parent / PROCS_DIR_NAME
        self._proc_root = proc_root
        self._remove_dead = remove_dead
        self._wall_clock = wall_clock
        self._lock = threading.Lock()
        self._last_good: SimulationState | None = None
        self._last_problem: str | None = None
        # Registrations parsed before, by file name: (mtime_ns, size) -> entry, start time and
        # when its process was last fully checked. Saves a JSON parse and a /proc/PID/stat read
        # per process per sample (observation runs every second).
        self._parsed: dict[str, tuple[tuple[int, int], _Registered, int | None, float]] = {}

    @property
    def devices(self) -> tuple[SimulatedDevice, ...]:
        return self._devices

    def open_procs_dir(self) -> None:
        """Make the procs directory and its load-window folder, writable by the stand-ins
        whatever user their serve runs as (SHARED_DIR_MODE); a failure is logged, and the
        stand-ins that cannot register draw nothing the simulation sees."""
        for folder in (self.procs_dir, self.procs_dir / LOADING_DIR_NAME):
            try:
                folder.mkdir(parents=True, exist_ok=True)
                if folder.stat().st_mode & 0o7777 != SHARED_DIR_MODE:
                    os.chmod(folder, SHARED_DIR_MODE)
            except OSError as exc:
                log.warning("simulation: cannot open %s to the serves: %s", folder,
                            exc.strerror or exc)

    def environment_for(self, device_uuid: str, *also: str) -> dict[str, str]:
        """The environment a stand-in serve on ``device_uuid`` (and on each of ``also``, a
        serve on several devices) needs to register its draw. GPUD_SIM_TOTAL_MIB is the
        smallest total, the one gpud computed the utilization against."""
        by_uuid = {dev.uuid: dev for dev in self._devices}
        for uuid in (device_uuid, *also):
            if uuid not in by_uuid:
                raise KeyError(uuid)
        total = min(by_uuid[u].total_mib for u in (device_uuid, *also))
        env = standin_environment(self.procs_dir, device_uuid, total, also)
        pidns = _pid_namespace(self._proc_root, "self")
        if pidns is not None:
            env[GPUD_SIM_PIDNS] = str(pidns)
        return env

    def sample(self) -> Observation:
        with self._lock:
            notes: list[str] = []
            state = self._read_state(notes)
            taken_at = self._wall_clock()
            if state is None:
                return Observation(
                    backend="simulated",
                    available=False,
                    reason="; ".join(notes),
                    devices=(),
                    taken_at=taken_at,
                )
            registered = self._read_registrations(notes)
            devices = tuple(self._device_sample(dev, state, registered) for dev in self._devices)
            return Observation(
                backend="simulated",
                available=True,
                reason="; ".join(notes) or None,
                devices=devices,
                taken_at=taken_at,
            )

    def close(self) -> None:
        pass

    def mem_available_mib(self) -> int | None:
        """The host's MemAvailable the state file sets, if it sets one (else /proc/meminfo's
        is the host's)."""
        state = self._read_state([])
        return state.mem_available_mib if state is not None else None

    def _read_state(self, notes: list[str]) -> SimulationState | None:
        """The state in force: this read, else the last good one (with a note), else None."""
        state: SimulationState | None
        problem: str | None
        try:
            text = self.state_file.read_text(encoding="utf-8")
        except FileNotFoundError:
            # Not "no external draw": a file deleted by mistake (or not written yet) says
            # nothing about the draw, and reading it as zero would make admission optimistic.
            state, problem = None, "missing"
        except OSError as exc:
            state, problem = None, f"cannot read: {exc.strerror or exc}"
        else:
            try:
                state = parse_state(text, {dev.uuid for dev in self._devices})
                problem = None
            except StateFileError as exc:
                state, problem = None, str(exc)
        if problem != self._last_problem:
            if problem is None:
                log.info("simulation state file %s is readable again", self.state_file)
            else:
                log.warning("simulation state file %s is %s", self.state_file, _what(problem))
            self._last_problem = problem
        if state is not None:
            self._last_good = state
            return state
        if self._last_good is None:
            notes.append(
                f"simulation state file {self.state_file} is {_what(problem)} and no good "
                "state was read before: external draw unknown"
            )
            return None
        notes.append(
            f"simulation state file {self.state_file} is {_what(problem)}: "
            "using the last good state"
        )
        return self._last_good

    def _read_registrations(self, notes: list[str]) -> list[_Registered]:
        try:
            entries = sorted(self.procs_dir.iterdir())
        except FileNotFoundError:
            return []
        except OSError as exc:
            notes.append(f"simulation procs dir {self.procs_dir} unreadable: {exc.strerror or exc}")
            return []
        known = {dev.uuid for dev in self._devices}
        found: list[_Registered] = []
        now = time.monotonic()
        seen: set[str] = set()
        for path in entries:
            match = _PROC_FILE.match(path.name)
            if match is None:
                continue  # temporaries of register_process, strays
            try:
                st = path.stat()
            except FileNotFoundError:
                continue  # unregistered while we looked
            except OSError as exc:
                notes.append(f"{path.name}: unreadable ({exc})")
                continue
            seen.add(path.name)
            version = (st.st_mtime_ns, st.st_size)
            cached = self._parsed.get(path.name)
            if cached is not None and cached[0] == version:
                _, entry, starttime, checked = cached
                if now - checked < FULL_CHECK_S:
                    if (self._proc_root / str(entry.pid)).exists():
                        if entry.device in known and known.issuperset(entry.also):
                            found.append(entry)
                        continue
                    starttime = -1  # gone: the full check below says so
            else:
                try:
                    data = json.loads(path.read_text(encoding="utf-8"))
                except FileNotFoundError:
                    continue  # unregistered while we looked
                except (OSError, ValueError) as exc:
                    notes.append(f"{path.name}: unreadable ({exc})")
                    continue
                try:
                    entry, starttime = _parse_registration(data, int(match.group(1)))
                except StateFileError as exc:
                    notes.append(f"{path.name}: {exc}")
                    continue
                if match.group(2) is not None:
                    host_pid = self._host_pid(int(match.group(2)), entry.pid, starttime)
                    if host_pid is None:  # its namespace is gone: so is the process
                        self._parsed.pop(path.name, None)
                        if self._remove_dead:
                            path.unlink(missing_ok=True)
                        continue
                    entry = replace(entry, pid=host_pid)  # every device kept
            self._parsed[path.name] = (version, entry, starttime, now)
            if not _alive(self._proc_root, entry.pid, starttime):
                self._parsed.pop(path.name, None)
                if self._remove_dead:
                    path.unlink(missing_ok=True)
                continue
            unknown = [d for d in (entry.device, *entry.also) if d not in known]
            if unknown:
                notes.append(f"{path.name}: unknown device {unknown[0]!r}")
                continue
            found.append(entry)
        for name in set(self._parsed) - seen:
            del self._parsed[name]
        return found

    def _host_pid(self, pidns: int, pid: int, starttime: int | None) -> int | None:
        """The PID, as this /proc numbers it, of the process that is `pid` in the PID namespace
        `pidns` (a container's): NVML reports host PIDs, so the simulation does too. Found by
        the last NSpid of /proc/P/status and the start time in /proc/P/stat (both readable by
        anyone; /proc/P/ns/pid is not: reading it takes ptrace access, which gpud.service does
        not have to a container's processes)."""
        if _pid_namespace(self._proc_root, "self") == pidns:
            return pid
        for entry in self._proc_root.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                status = (entry / "status").read_text(encoding="ascii", errors="replace")
            except OSError:
                continue
            for line in status.splitlines():
                if line.startswith("NSpid:"):
                    ids = line.split()[1:]
                    if len(ids) > 1 and ids[-1] == str(pid):
                        stat = _proc_stat(self._proc_root, int(entry.name))
                        if stat is not None and starttime in (None, stat[1]):
                            return int(entry.name)
                    break
        return None

    def _device_sample(
        self, dev: SimulatedDevice, state: SimulationState, registered: list[_Registered]
    ) -> DeviceSample:
        index = dev.index if dev.index is not None else 0
        bus_id = dev.pci_bus_id if dev.pci_bus_id is not None else ""
        name = dev.name if dev.name is not None else DEFAULT_NAME
        if dev.uuid in state.lost:
            return DeviceSample(
                uuid=dev.uuid,
                index=index,
                pci_bus_id=bus_id,
                name=name,
                total_mib=None,
                used_mib=None,
                free_mib=None,
                processes=None,
                healthy=False,
                problem=LOST_PROBLEM,
            )
        draws: dict[int, int] = {}
        used = 0
        for reg in registered:
            if reg.draws_on(dev.uuid):
                used += reg.mib
                draws[reg.pid] = draws.get(reg.pid, 0) + reg.mib
        for ext in state.external:
            if ext.device == dev.uuid:
                used += ext.mib
                if ext.pid is not None:
                    draws[ext.pid] = draws.get(ext.pid, 0) + ext.mib
        return DeviceSample(
            uuid=dev.uuid,
            index=index,
            pci_bus_id=bus_id,
            name=name,
            total_mib=dev.total_mib,
            used_mib=used,
            free_mib=max(0, dev.total_mib - used),
            processes=_as_reported(dev.process_memory, draws),
        )


PROCESS_MEMORY = ("reported", "not-available", "none")


def _as_reported(process_memory: str, draws: dict[int, int]) -> tuple[ProcessDraw, ...]:
    if process_memory == "none":
        return ()
    return tuple(ProcessDraw(pid, mib if process_memory == "reported" else None)
                 for pid, mib in sorted(draws.items()))


def _what(problem: str | None) -> str:
    return "missing" if problem == "missing" else f"broken ({problem})"


def _resolve(position: int, dev: SimulatedDevice) -> SimulatedDevice:
    if dev.total_mib < 0:
        raise ValueError(f"simulated device {dev.uuid}: total_mib must be >= 0")
    index = dev.index if dev.index is not None else position
    bus_id = dev.pci_bus_id if dev.pci_bus_id is not None else f"00000000:{index + 1:02x}:00.0"
    name = dev.name if dev.name else DEFAULT_NAME
    if dev.process_memory not in PROCESS_MEMORY:
        raise ValueError(f"simulated device {dev.uuid}: process_memory must be one of "
                         f"{', '.join(PROCESS_MEMORY)}, not {dev.process_memory!r}")
    return SimulatedDevice(
        uuid=dev.uuid, total_mib=dev.total_mib, index=index, pci_bus_id=bus_id, name=name,
        process_memory=dev.process_memory,
    )


def parse_state(text: str, known_devices: set[str] | frozenset[str]) -> SimulationState:
    """The state file's content, checked whole; ``StateFileError`` names the first problem."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise StateFileError(f"not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise StateFileError("top level must be an object")
    unknown = set(data) - {"external", "lost", "mem_available_mib"}
    if unknown:
        raise StateFileError(f"unknown keys {sorted(unknown)} (allowed: external, lost, "
                             "mem_available_mib)")
    host_mib = data.get("mem_available_mib")
    if host_mib is not None and (not _is_int(host_mib) or host_mib < 0):
        raise StateFileError(f"mem_available_mib: must be an integer >= 0, not {host_mib!r}")
    raw_external = data.get("external", [])
    if not isinstance(raw_external, list):
        raise StateFileError("external: must be a list")
    external: list[ExternalDraw] = []
    for position, item in enumerate(raw_external):
        where = f"external[{position}]"
        if not isinstance(item, dict):
            raise StateFileError(f"{where}: must be an object")
        extra = set(item) - {"device", "label", "mib", "pid"}
        if extra:
            raise StateFileError(f"{where}: unknown keys {sorted(extra)}")
        device = item.get("device")
        if not isinstance(device, str) or device not in known_devices:
            raise StateFileError(f"{where}.device: {device!r} is not a simulated device")
        label = item.get("label", "external")
        if not isinstance(label, str):
            raise StateFileError(f"{where}.label: must be a string")
        mib = item.get("mib")
        if not _is_int(mib) or mib < 0:
            raise StateFileError(f"{where}.mib: must be an integer >= 0, not {mib!r}")
        pid = item.get("pid")
        if pid is not None and (not _is_int(pid) or pid <= 0):
            raise StateFileError(f"{where}.pid: must be a positive integer, not {pid!r}")
        external.append(ExternalDraw(device=device, label=label, mib=mib, pid=pid))
    raw_lost = data.get("lost", [])
    if not isinstance(raw_lost, list):
        raise StateFileError("lost: must be a list")
    for item in raw_lost:
        if not isinstance(item, str) or item not in known_devices:
            raise StateFileError(f"lost: {item!r} is not a simulated device")
    return SimulationState(external=tuple(external), lost=frozenset(raw_lost),
                           mem_available_mib=host_mib)


def _parse_registration(data: Any, file_pid: int) -> tuple[_Registered, int | None]:
    if not isinstance(data, dict):
        raise StateFileError("must be an object")
    pid, device, mib = data.get("pid"), data.get("device"), data.get("mib")
    if not _is_int(pid) or pid != file_pid:
        raise StateFileError(f"pid {pid!r} does not match the file name")
    if not isinstance(device, str):
        raise StateFileError("device: must be a string")
    if not _is_int(mib) or mib < 0:
        raise StateFileError(f"mib: must be an integer >= 0, not {mib!r}")
    also = data.get("also_devices", [])
    if not isinstance(also, list) or not all(isinstance(d, str) for d in also):
        raise StateFileError("also_devices: must be an array of strings")
    starttime = data.get("starttime")
    return (_Registered(pid=pid, device=device, mib=mib, also=tuple(also)),
            starttime if _is_int(starttime) else None)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _proc_stat(proc_root: Path, pid: int) -> tuple[str, int] | None:
    """(state, starttime) from /proc/PID/stat, None when the process is gone."""
    try:
        text = (proc_root / str(pid) / "stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = text[text.rfind(")") + 1 :].split()
    try:
        return fields[0], int(fields[19])  # field 3: state, field 22: starttime
    except (IndexError, ValueError):
        return None


def _pid_namespace(proc_root: Path, pid: str) -> int | None:
    """The inode of PID's PID namespace (``pid:[4026531836]``), or None once it is gone."""
    try:
        link = os.readlink(proc_root / pid / "ns" / "pid")
    except OSError:
        return None
    inner = link.partition("[")[2].rstrip("]")
    return int(inner) if inner.isdigit() else None


def _alive(proc_root: Path, pid: int, starttime: int | None) -> bool:
    stat = _proc_stat(proc_root, pid)
    if stat is None:
        return False
    state, started = stat
    if state in ("Z", "X"):
        return False
    # A recorded start time that differs: the PID was reused by another process.
    return starttime is None or starttime == started


# ---- used by stand-in serves (standard library only) -------------------------------------


def standin_environment(procs_dir: Path, device_uuid: str, total_mib: int,
                        also: Sequence[str] = ()) -> dict[str, str]:
    env = {
        GPUD_SIM_PROCS_DIR: str(procs_dir),
        GPUD_SIM_DEVICE: device_uuid,
        GPUD_SIM_TOTAL_MIB: str(total_mib),
    }
    if also:
        env[GPUD_SIM_DEVICES] = ",".join((device_uuid, *also))
    return env


def register_process(
    procs_dir: Path, pid: int, device: str, mib: int, *, proc_root: Path = Path("/proc"),
    host_pidns: int | None = None, also: Sequence[str] = (),
) -> Path:
    """Record (or update) that ``pid`` draws ``mib`` on ``device`` (and on each of ``also``);
    atomic (tmp + rename). ``host_pidns``: the simulation's PID namespace (GPUD_SIM_PIDNS); a
    ``pid`` in another one is recorded with its own namespace, so that the simulation reports
    the host PID."""
    if mib < 0:
        raise ValueError("mib must be >= 0")
    procs_dir = Path(procs_dir)
    procs_dir.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"pid": pid, "device": device, "mib": mib}
    if also:
        record["also_devices"] = list(also)
    stat = _proc_stat(proc_root, pid)
    if stat is not None:
        record["starttime"] = stat[1]
    # Named with its PID namespace: a process in a container registers the PID it sees, which
    # the simulation turns into the host's (two containers' PIDs may be the same number).
    pidns = _pid_namespace(proc_root, str(pid))
    foreign = host_pidns is not None and pidns is not None and pidns != host_pidns
    target = procs_dir / (f"{pid}.ns{pidns}.json" if foreign else f"{pid}.json")
    fd, tmp = tempfile.mkstemp(prefix=f".{pid}.", suffix=".tmp", dir=procs_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(record, handle)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def unregister_process(procs_dir: Path, pid: int, *, proc_root: Path = Path("/proc")) -> None:
    pidns = _pid_namespace(proc_root, str(pid))
    if pidns is not None:
        (Path(procs_dir) / f"{pid}.ns{pidns}.json").unlink(missing_ok=True)
    (Path(procs_dir) / f"{pid}.json").unlink(missing_ok=True)
