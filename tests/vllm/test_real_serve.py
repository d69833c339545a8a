"""gpud launching real `vllm serve` (the CPU build, tiny model) as transient units under real
systemd in the sandbox, on a simulated device: start to running, health, the engine's processes in
the unit's cgroup, calibration from the lines the CPU build prints, adoption across a gpud
restart, the engine killed (restarted by its unit), a SIGTERM stop within its budget, and a start
that fails with vLLM's own reason.

One serve is started once and reused by the checks that leave it running, in the order below; two
more real starts follow (after the engine is killed, and the bad model path). Cost on this 2-core
machine, shared: about 50 s a start, 3 to 4 minutes for the module.
"""

from __future__ import annotations

import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

from tests.integration.conftest import booted_sandbox
from tests.integration.gpudctl import REPO, SandboxGpud, sim_config
from tests.vllm.servers import MODEL, REAL_ENV, REAL_START_S, VLLM
from tools.sandbox import Sandbox

pytestmark = [pytest.mark.sandbox, pytest.mark.usefixtures("real_vllm")]

ROLE = """
[roles.cpu]
device = "GPU-sim-0"
"""
STOP_TIMEOUT_S = 30


def serves() -> str:
    env = ", ".join(f'{k} = "{v}"' for k, v in REAL_ENV.items())
    return textwrap.dedent(f"""
        [serves.tiny]
        role = "cpu"
        vram_mib = 4096
        port = 30101
        start_timeout_s = {REAL_START_S:g}
        stop_timeout_s = {STOP_TIMEOUT_S}
        restart_sec = 0.5
        environment = {{ {env} }}
        [serves.tiny.vllm]
        model = "{MODEL}"
        max_model_len = 512
        extra_args = ["--enforce-eager"]

        [serves.broken]
        role = "cpu"
        vram_mib = 2048
        port = 30102
        restart = "no"
        environment = {{ {env} }}
        [serves.broken.vllm]
        model = "/nonexistent/model"
        extra_args = ["--enforce-eager"]
        """)


@pytest.fixture(scope="module")
def sandbox(real_vllm: None) -> Iterator[Sandbox]:
    yield from booted_sandbox("gpud-vllm")


@pytest.fixture(scope="module")
def gpud(sandbox: Sandbox) -> Iterator[SandboxGpud]:
    ctl = SandboxGpud(sandbox)
    ctl.configure(sim_config(ROLE, serves(), daemon=f'vllm_executable = "{VLLM}"'))
    began = time.monotonic()
    reply = ctl.call("POST", "/v1/serves/tiny/start", {})
    assert reply.status == 200, reply.raw
    ctl.wait_state("tiny", "running", timeout=REAL_START_S)
    print(f"\nreal vllm serve: running {time.monotonic() - began:.0f} s after its start")
    yield ctl
    ctl.reset()


def engine_processes(gpud: SandboxGpud, serve: str) -> dict[int, str]:
    """The processes of the serve's unit, by PID (inside the sandbox), with their comm."""
    cgroup = gpud.unit_prop(f"gpud-serve-{serve}.service", "ControlGroup")
    out = gpud.sb.run(f"for p in $(cat /sys/fs/cgroup{cgroup}/cgroup.procs); do "
                      "printf '%s %s\\n' $p \"$(cat /proc/$p/comm)\"; done").stdout
    return {int(pid): comm for pid, _, comm in
            (line.partition(" ") for line in out.splitlines() if line.strip())}


def engine_pid(gpud: SandboxGpud, serve: str) -> int:
    found = [pid for pid, comm in engine_processes(gpud, serve).items()
             if comm == "VLLM::EngineCor"]
    assert len(found) == 1, engine_processes(gpud, serve)
    return found[0]


def test_running_and_healthy(gpud: SandboxGpud) -> None:
    out = gpud.sb.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                       "http://127.0.0.1:30101/health"]).stdout
    assert out == "200"
    models = gpud.sb.run(["curl", "-s", "http://127.0.0.1:30101/v1/models"]).stdout
    assert f'"id":"{MODEL}"' in models and '"owned_by":"vllm"' in models
    view = gpud.serve("tiny")
    assert view["reserved_mib"] == 4096
    argv = gpud.unit_prop("gpud-serve-tiny.service", "ExecStart")
    assert f"{VLLM} serve {MODEL}" in argv or str(VLLM) in argv


def test_the_engines_processes_are_the_units(gpud: SandboxGpud) -> None:
    procs = engine_processes(gpud, "tiny")
    comms = sorted(procs.values())
    assert "VLLM::EngineCor" in comms and "VLLM::Worker" in comms, procs
    # gpud's own attribution (by /proc/PID/cgroup) names the serve for each of them
    code = ("import json, sys; from gpud.host.cgroups import CachedAttribution; "
            "print(json.dumps(CachedAttribution()([int(p) for p in sys.argv[1:]])))")
    out = gpud.sb.run([sys.executable, "-c", code, *map(str, procs)],
                      env={"PYTHONPATH": str(REPO)}).stdout
    import json

    assert set(json.loads(out).values()) == {"tiny"}
    assert len(json.loads(out)) == len(procs)


def test_calibration_reads_the_cpu_builds_lines(gpud: SandboxGpud) -> None:
    from gpud.vllm.vllm_log import parse_memory_lines

    lines = gpud.sb.run(["journalctl", "--no-pager", "-o", "cat", "-u",
                         "gpud-serve-tiny.service"]).stdout.splitlines()
    assert any("for KV cache on node" in line for line in lines)
    memory = parse_memory_lines(lines)
    # VLLM_CPU_KVCACHE_SPACE=1: a 1 GiB KV cache, as the CPU worker says; no GPU lines
    assert memory.kv_cache_mib == 1024
    assert memory.weights_mib is None and memory.cudagraph_mib is None


def test_adopted_across_a_gpud_restart(gpud: SandboxGpud) -> None:
    pid = gpud.unit_prop("gpud-serve-tiny.service", "MainPID")
    starts = len(gpud.events(kind="start", serve="tiny"))
    gpud.sb.run(["systemctl", "restart", "gpud.service"], timeout=60)
    assert gpud.wait_state("tiny", "running")["main_pid"] == int(pid)
    assert gpud.unit_prop("gpud-serve-tiny.service", "MainPID") == pid
    assert gpud.events(kind="adopt", serve="tiny")
    assert len(gpud.events(kind="start", serve="tiny")) == starts


def test_engine_killed_the_serve_is_restarted(gpud: SandboxGpud) -> None:
    # /health answers 503 once the engine died, and vLLM's server exits 0 some seconds later
    # (its watchdog): gpud's health check sees the 503 first and restarts the serve through
    # its unit, its reservation kept. (Were the exit first, the unit's Restart=always would
    # restart it: on-failure takes that exit 0 for a clean one; tests/integration/test_serves.py
    # holds that case with the stand-in.)
    pid = int(gpud.unit_prop("gpud-serve-tiny.service", "MainPID"))
    assert gpud.unit_prop("gpud-serve-tiny.service", "Restart") == "always"
    mark = max((e["id"] for e in gpud.events(serve="tiny")), default=0)
    gpud.sb.run(["kill", "-9", str(engine_pid(gpud, "tiny"))])
    gpud.wait_event("restart", serve="tiny", timeout=60)
    view = gpud.wait_state("tiny", "running", timeout=REAL_START_S)
    assert view["main_pid"] != pid
    assert view["reserved_mib"] == 4096
    after = [(e["kind"], e["message"]) for e in gpud.events(serve="tiny") if e["id"] > mark]
    assert ("unhealthy", "tiny: unhealthy: engine died (/health answered 503 after the serve "
            "was healthy); restarting it through its unit (reservation kept)") in after, after
    assert [k for k, _ in after if k in ("release", "exit")] == [], after
    journal = gpud.sb.run(["journalctl", "--no-pager", "-o", "cat", "-u",
                           "gpud-serve-tiny.service"]).stdout
    assert "EngineDeadError" in journal
    assert "VLLM::EngineCor" in engine_processes(gpud, "tiny").values()


def test_sigterm_stop_within_its_budget(gpud: SandboxGpud) -> None:
    since = time.time()
    began = time.monotonic()
    reply = gpud.call("POST", "/v1/serves/tiny/stop", {})
    took = time.monotonic() - began
    assert reply.status == 200, reply.raw
    assert took < STOP_TIMEOUT_S
    print(f"\nreal vllm serve: stopped in {took:.1f} s")
    assert "gpud-serve-tiny.service" not in gpud.serve_units()
    assert gpud.serve("tiny")["reserved_mib"] is None
    left = gpud.sb.run("pgrep -c VLLM || true").stdout.strip()
    assert left == "0", gpud.sb.run("ps -eo pid,comm,args").stdout
    # graceful: vLLM's server shut itself down, systemd did not have to kill it
    journal = gpud.sb.run(["journalctl", "--no-pager", "-o", "cat", "--since", f"@{since:.3f}",
                           "-u", "gpud-serve-tiny.service"]).stdout
    assert "timed out" not in journal.lower(), journal[-3000:]
    assert "Deactivated successfully" in journal, journal[-3000:]


def test_a_bad_model_path_fails_with_vllms_reason(gpud: SandboxGpud) -> None:
    reply = gpud.call("POST", "/v1/serves/broken/start", {})
    assert reply.status == 200, reply.raw
    failed = gpud.wait_state("broken", "failed", timeout=120)
    assert "its log: " in failed["reason"], failed
    assert "/nonexistent/model" in failed["reason"], failed
    assert failed["reserved_mib"] is None
