"""The simulated backend: state file and stand-in registrations, re-read at every sample."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpud.core.observation import ObservationBackend, ProcessDraw, find_device
from gpud.host.simulation import (
    GPUD_SIM_DEVICE,
    GPUD_SIM_PIDNS,
    GPUD_SIM_PROCS_DIR,
    GPUD_SIM_TOTAL_MIB,
    LOADING_DIR_NAME,
    LOST_PROBLEM,
    SimulatedBackend,
    SimulatedDevice,
    register_process,
    unregister_process,
)
from gpud.testing.standin import LOADING_DIR

DEVICES = [
    SimulatedDevice(uuid="GPU-sim-0", total_mib=32607),
    SimulatedDevice(uuid="GPU-sim-1", total_mib=16384, name="Small GPU"),
]


@pytest.fixture
def state_file(tmp_path: Path) -> Path:
    path = tmp_path / "sim.json"
    path.write_text("{}")  # a missing file is a different case (unknown draw)
    return path


@pytest.fixture
def sim(state_file: Path) -> SimulatedBackend:
    return SimulatedBackend(DEVICES, state_file, wall_clock=lambda: 7.0)


def write_state(path: Path, data: object) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_missing_file_from_the_start_is_unknown_draw(sim: SimulatedBackend,
                                                     state_file: Path) -> None:
    state_file.unlink()
    obs = sim.sample()
    assert not obs.available and obs.devices == ()
    assert obs.reason is not None and "is missing and no good state was read before" in obs.reason


def test_defaults_and_empty_state(sim: SimulatedBackend, state_file: Path) -> None:
    obs = sim.sample()
    assert obs.available and obs.reason is None and obs.simulated and obs.taken_at == 7.0
    first, second = obs.devices
    assert (first.index, first.pci_bus_id, first.name) == (0, "00000000:01:00.0", "Simulated GPU")
    assert (second.index, second.pci_bus_id, second.name) == (1, "00000000:02:00.0", "Small GPU")
    assert (first.total_mib, first.used_mib, first.free_mib) == (32607, 0, 32607)
    assert first.processes == () and first.healthy
    assert find_device(obs.devices, "0000:02:00.0") == second
    assert sim.procs_dir == state_file.parent / "sim-procs"


def test_explicit_identity(tmp_path: Path) -> None:
    dev = SimulatedDevice(uuid="GPU-x", total_mib=100, index=3, pci_bus_id="00000000:81:00.0")
    write_state(tmp_path / "s.json", {})
    sample = SimulatedBackend([dev], tmp_path / "s.json").sample().devices[0]
    assert (sample.index, sample.pci_bus_id) == (3, "00000000:81:00.0")


def test_duplicate_uuid_refused(state_file: Path) -> None:
    with pytest.raises(ValueError, match="duplicate uuid"):
        SimulatedBackend([DEVICES[0], DEVICES[0]], state_file)


def test_external_draw_changed_between_samples_is_seen(
    sim: SimulatedBackend, state_file: Path
) -> None:
    write_state(
        state_file, {"external": [{"device": "GPU-sim-0", "label": "display", "mib": 5837}]}
    )
    dev = sim.sample().devices[0]
    assert (dev.used_mib, dev.free_mib, dev.processes) == (5837, 32607 - 5837, ())
    write_state(
        state_file,
        {
            "external": [
                {"device": "GPU-sim-0", "label": "display", "mib": 4000},
                {"device": "GPU-sim-1", "label": "x", "mib": 20000},
            ]
        },
    )
    first, second = sim.sample().devices
    assert first.used_mib == 4000
    assert (second.used_mib, second.free_mib) == (20000, 0)  # free never negative
    # A deleted file is not "no external draw": the last good state stays, and the reason says so.
    state_file.unlink()
    obs = sim.sample()
    assert obs.available and obs.devices[0].used_mib == 4000
    assert obs.reason is not None and "is missing: using the last good state" in obs.reason


def test_external_with_pid_is_a_process(sim: SimulatedBackend, state_file: Path) -> None:
    write_state(
        state_file,
        {
            "external": [
                {"device": "GPU-sim-0", "label": "display", "mib": 1000},
                {"device": "GPU-sim-0", "label": "stt", "mib": 900, "pid": 4242},
            ]
        },
    )
    dev = sim.sample().devices[0]
    assert dev.used_mib == 1900
    assert dev.processes == (ProcessDraw(4242, 900),)


def test_live_registration_counted(sim: SimulatedBackend, state_file: Path) -> None:
    write_state(state_file, {"external": [{"device": "GPU-sim-0", "mib": 500}]})
    path = register_process(sim.procs_dir, os.getpid(), "GPU-sim-0", 14336)
    assert path == sim.procs_dir / f"{os.getpid()}.json"
    assert [p.name for p in sim.procs_dir.iterdir()] == [path.name]  # no temporaries left
    dev = sim.sample().devices[0]
    assert dev.used_mib == 14836 and dev.free_mib == 32607 - 14836
    assert dev.processes == (ProcessDraw(os.getpid(), 14336),)
    # The stand-in changes its draw (overdraw): seen at the next sample.
    register_process(sim.procs_dir, os.getpid(), "GPU-sim-0", 16000)
    assert sim.sample().devices[0].processes == (ProcessDraw(os.getpid(), 16000),)
    unregister_process(sim.procs_dir, os.getpid())
    unregister_process(sim.procs_dir, os.getpid())  # twice is fine
    assert sim.sample().devices[0].used_mib == 500


def test_live_child_process_counted(sim: SimulatedBackend) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        register_process(sim.procs_dir, child.pid, "GPU-sim-1", 2048)
        assert sim.sample().devices[1].processes == (ProcessDraw(child.pid, 2048),)
        child.kill()
        child.wait()
        dev = sim.sample().devices[1]
        assert dev.processes == () and dev.used_mib == 0
    finally:
        child.kill()
        child.wait()


def test_dead_registration_ignored_and_removed(sim: SimulatedBackend) -> None:
    pid = dead_pid()
    path = register_process(sim.procs_dir, pid, "GPU-sim-0", 8192)
    obs = sim.sample()
    assert obs.devices[0].used_mib == 0 and obs.devices[0].processes == ()
    assert obs.reason is None
    assert not path.exists()


def test_zombie_registration_ignored(sim: SimulatedBackend) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        register_process(sim.procs_dir, child.pid, "GPU-sim-0", 8192)
        stat = Path(f"/proc/{child.pid}/stat")
        deadline = time.monotonic() + 10
        while stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert sim.sample().devices[0].processes == ()
    finally:
        child.wait()


def test_reused_pid_ignored(sim: SimulatedBackend) -> None:
    # A registration of this PID made by a process that started at another time.
    sim.procs_dir.mkdir(parents=True)
    record = {"pid": os.getpid(), "device": "GPU-sim-0", "mib": 1000, "starttime": 1}
    (sim.procs_dir / f"{os.getpid()}.json").write_text(json.dumps(record))
    assert sim.sample().devices[0].processes == ()


def test_bad_registration_noted_not_fatal(sim: SimulatedBackend) -> None:
    sim.procs_dir.mkdir(parents=True)
    (sim.procs_dir / "12.json").write_text("{not json")
    register_process(sim.procs_dir, os.getpid(), "GPU-nope", 10)
    obs = sim.sample()
    assert obs.available
    assert obs.reason is not None and "12.json" in obs.reason and "GPU-nope" in obs.reason
    assert all(dev.used_mib == 0 for dev in obs.devices)


def test_lost_device(sim: SimulatedBackend, state_file: Path) -> None:
    write_state(state_file, {"external": [], "lost": ["GPU-sim-1"]})
    good, lost = sim.sample().devices
    assert good.healthy
    assert not lost.healthy and lost.problem == LOST_PROBLEM
    assert (lost.total_mib, lost.used_mib, lost.free_mib, lost.processes) == (None,) * 4
    assert (lost.uuid, lost.index) == ("GPU-sim-1", 1)
    write_state(state_file, {})
    assert sim.sample().devices[1].healthy


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "[]",
        json.dumps({"external": [{"device": "GPU-typo", "mib": 1}]}),
        json.dumps({"external": [{"device": "GPU-sim-0", "mib": -1}]}),
        json.dumps({"external": [{"device": "GPU-sim-0", "mib": "5"}]}),
        json.dumps({"external": [{"device": "GPU-sim-0", "mib": True}]}),
        json.dumps({"external": [{"device": "GPU-sim-0", "mib": 1, "extra": 1}]}),
        json.dumps({"lost": ["GPU-typo"]}),
        json.dumps({"external": [], "surprise": 1}),
    ],
)
def test_broken_state_keeps_last_good_and_says_so(
    sim: SimulatedBackend, state_file: Path, content: str
) -> None:
    write_state(state_file, {"external": [{"device": "GPU-sim-0", "mib": 5837}]})
    assert sim.sample().devices[0].used_mib == 5837
    state_file.write_text(content)
    obs = sim.sample()
    assert obs.available
    assert obs.reason is not None and "broken" in obs.reason and "last good" in obs.reason
    assert obs.devices[0].used_mib == 5837
    write_state(state_file, {"external": [{"device": "GPU-sim-0", "mib": 100}]})
    obs = sim.sample()
    assert obs.reason is None and obs.devices[0].used_mib == 100


def test_broken_state_without_good_one_is_unavailable(
    sim: SimulatedBackend, state_file: Path
) -> None:
    state_file.write_text('{"external": [')
    obs = sim.sample()
    assert not obs.available and obs.devices == ()
    assert obs.reason is not None and "broken" in obs.reason


def test_environment_registers_on_its_device(sim: SimulatedBackend) -> None:
    env = sim.environment_for("GPU-sim-1")
    assert env == {
        GPUD_SIM_PROCS_DIR: str(sim.procs_dir),
        GPUD_SIM_DEVICE: "GPU-sim-1",
        GPUD_SIM_TOTAL_MIB: "16384",
        GPUD_SIM_PIDNS: os.readlink("/proc/self/ns/pid").partition("[")[2].rstrip("]"),
    }
    assert register_process(Path(env[GPUD_SIM_PROCS_DIR]), os.getpid(), env[GPUD_SIM_DEVICE],
                            3000, host_pidns=int(env[GPUD_SIM_PIDNS])) == (
        sim.procs_dir / f"{os.getpid()}.json")
    assert sim.sample().devices[1].processes == (ProcessDraw(os.getpid(), 3000),)


def test_registration_helpers_import_without_daemon_dependencies() -> None:
    code = (
        "import sys; import gpud.host.simulation; "
        "bad = [m for m in ('pydantic', 'aiohttp', 'pynvml', 'dbus_fast') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


def test_is_an_observation_backend(state_file: Path) -> None:
    sim: ObservationBackend = SimulatedBackend(DEVICES, state_file)
    assert sim.name == "simulated"
    sim.close()


def test_registration_cache_follows_changes_and_deaths(tmp_path: Path) -> None:
    import subprocess

    from gpud.host.simulation import SimulatedBackend, SimulatedDevice, register_process

    (tmp_path / "sim.json").write_text("{}")
    backend = SimulatedBackend([SimulatedDevice("GPU-sim-0", 10000)], tmp_path / "sim.json")
    child = subprocess.Popen(["sleep", "30"])
    try:
        register_process(backend.procs_dir, child.pid, "GPU-sim-0", 100)
        assert backend.sample().devices[0].used_mib == 100
        assert backend.sample().devices[0].used_mib == 100  # cached
        register_process(backend.procs_dir, child.pid, "GPU-sim-0", 300)
        assert backend.sample().devices[0].used_mib == 300  # the file changed: read again
        child.kill()
        child.wait()
        assert backend.sample().devices[0].used_mib == 0  # gone: dropped at once
    finally:
        child.kill()
        child.wait()


def test_mem_available_from_the_state_file(sim: SimulatedBackend, state_file: Path) -> None:
    assert sim.mem_available_mib() is None  # not set: the host's own
    write_state(state_file, {"mem_available_mib": 4096})
    assert sim.mem_available_mib() == 4096
    write_state(state_file, {"mem_available_mib": -1})
    obs = sim.sample()
    assert obs.reason is not None and "mem_available_mib: must be an integer >= 0" in obs.reason
    assert sim.mem_available_mib() == 4096  # the last good state stays in force


@pytest.mark.parametrize(("process_memory", "processes"), [
    ("reported", (ProcessDraw(4242, 900),)),
    # WDDM: every process listed, its memory NVML_VALUE_NOT_AVAILABLE
    ("not-available", (ProcessDraw(4242, None),)),
    # WSL2: no process listed at all
    ("none", ()),
])
def test_a_device_that_reports_no_process_memory(state_file: Path, process_memory: str,
                                                 processes: tuple[ProcessDraw, ...]) -> None:
    sim = SimulatedBackend([SimulatedDevice("GPU-sim-0", 32607, process_memory=process_memory)],
                           state_file)
    write_state(state_file, {"external": [
        {"device": "GPU-sim-0", "label": "display", "mib": 1000},
        {"device": "GPU-sim-0", "label": "stt", "mib": 900, "pid": 4242}]})
    dev = sim.sample().devices[0]
    assert (dev.used_mib, dev.free_mib) == (1900, 32607 - 1900)  # totals as ever
    assert dev.processes == processes


def test_an_unknown_process_memory_mode_is_refused(state_file: Path) -> None:
    with pytest.raises(ValueError, match="process_memory must be one of reported, "
                                         "not-available, none, not 'some'"):
        SimulatedBackend([SimulatedDevice("GPU-sim-0", 100, process_memory="some")], state_file)


def test_the_procs_folders_are_open_to_stand_ins_of_any_user(sim: SimulatedBackend) -> None:
    sim.procs_dir.mkdir(mode=0o755)  # as an older gpud or a stand-in running as root left it
    sim.open_procs_dir()
    for folder in (sim.procs_dir, sim.procs_dir / LOADING_DIR_NAME):
        assert folder.stat().st_mode & 0o7777 == 0o1777, folder
    assert LOADING_DIR_NAME == LOADING_DIR  # the stand-in spells the name itself


def test_a_procs_folder_that_cannot_be_made_is_logged(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "file").write_text("")
    sim = SimulatedBackend(DEVICES, tmp_path / "sim.json", procs_dir=tmp_path / "file" / "procs")
    sim.open_procs_dir()
    assert "simulation: cannot open" in caplog.text
