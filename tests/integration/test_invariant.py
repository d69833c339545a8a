"""The ledger invariant under real systemd: config changes that remove running serves, units the
config no longer names, launches that fail before systemd is asked, interrupted applies, and a
serve's environment kept from other users."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.gpudctl import REPO, SandboxGpud, sim_config, standin
from tools.sandbox import Sandbox

pytestmark = pytest.mark.sandbox

ROLE = '[roles.r]\ndevice = "GPU-sim-0"\nreserve_mib = 1000\n'


def serve(name: str, port: int, mib: int = 2000, *args: str, resident: bool = True,
          extra: str = "") -> str:
    return (f'[serves.{name}]\nrole = "r"\nvram_mib = {mib}\nresident = {str(resident).lower()}\n'
            f"port = {port}\ncommand = {standin(*args)}\n{extra}")


BOTH = sim_config(ROLE, serve("keep", 30101) + "\n" + serve("gone", 30102))
KEEP = sim_config(ROLE, serve("keep", 30101))


@pytest.fixture
def gpud(sandbox: Sandbox) -> Iterator[SandboxGpud]:
    ctl = SandboxGpud(sandbox)
    yield ctl
    ctl.reset()


def gpuctl(gpud: SandboxGpud, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpud.gpuctl", "--socket", str(gpud.socket),
                           *args], capture_output=True, text=True, cwd=REPO, timeout=timeout,
                          check=False)


def committed(gpud: SandboxGpud) -> int:
    return int(gpud.get("/v1/ledger")["roles"][0]["committed_mib"])


def test_apply_that_removes_a_running_serve_stops_it_first_and_releases_it(
        gpud: SandboxGpud, tmp_path: Path) -> None:
    gpud.configure(BOTH)
    gpud.wait_state("keep", "running")
    gpud.wait_state("gone", "running")
    new = tmp_path / "keep.toml"
    new.write_text(KEEP)
    plan = json.loads(gpuctl(gpud, "plan", str(new), "--json").stdout)
    assert plan["stop_first"] == ["gone"] and plan["blocked"] == []
    applied = gpuctl(gpud, "apply", str(new))
    assert applied.returncode == 0, applied.stdout + applied.stderr
    steps = [line.split("]")[1].split(":")[0].strip() for line in applied.stdout.splitlines()
             if line.startswith("[")]
    assert steps.index("stop") < steps.index("write") < steps.index("reload")
    assert "gpud-serve-gone.service" not in gpud.serve_units()
    assert committed(gpud) == 2000
    assert gpud.call("GET", "/v1/serves/gone").status == 404


def test_reload_that_removes_a_running_serve_is_refused_and_stop_still_works(
        gpud: SandboxGpud) -> None:
    gpud.configure(BOTH)
    gpud.wait_state("gone", "running")
    gpud.sb.write_file("/etc/gpud/serves.toml", KEEP, mode=0o600)
    refused = gpuctl(gpud, "reload")
    assert refused.returncode == 1
    assert "gone (2000 MiB on r): is running and leaves the config: stop it first" \
        in refused.stderr
    assert gpud.get("/v1/status")["config_file"]["differs"] is True
    stopped = gpuctl(gpud, "stop", "gone")
    assert stopped.returncode == 0, stopped.stderr
    assert committed(gpud) == 2000
    assert gpuctl(gpud, "reload").returncode == 0
    assert gpud.get("/v1/status")["config_file"] == {"differs": False, "reason": None}
    # SIGHUP takes the same path: refused changes leave the config in force.
    gpud.sb.write_file("/etc/gpud/serves.toml", sim_config(ROLE, ""), mode=0o600)
    gpud.sb.run(["systemctl", "kill", "-s", "HUP", "gpud.service"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "refused" not in gpud.journal_tail(80):
        time.sleep(0.1)
    assert "reload refused" in gpud.journal_tail(80)
    assert gpud.serve("keep")["state"] == "running" and committed(gpud) == 2000


def test_a_unit_the_config_no_longer_names_is_an_orphan_that_gpuctl_stops(
        gpud: SandboxGpud) -> None:
    gpud.configure(BOTH)
    gpud.wait_state("gone", "running")
    # gpud and its state gone while the serve runs on; it comes back with a config without it.
    gpud.sb.run(["systemctl", "stop", "gpud.service"])
    gpud.sb.run(["rm", "-rf", "/var/lib/gpud"])
    gpud.sb.write_file("/etc/gpud/serves.toml", KEEP, mode=0o600)
    gpud.start()
    orphan = gpud.wait_state("gone", "orphan")
    assert "the config does not name the serve" in orphan["reason"]
    assert "gpud-serve-gone.service" in gpud.serve_units()
    stopped = gpuctl(gpud, "stop", "gone")
    assert stopped.returncode == 0, stopped.stderr
    assert "gpud-serve-gone.service" not in gpud.serve_units()
    assert gpud.serve("keep")["state"] == "running"


def test_a_launch_that_fails_before_systemd_is_asked_fails_the_serve_at_once(
        gpud: SandboxGpud) -> None:
    cfg = sim_config(ROLE, '[serves.v]\nrole = "r"\nvram_mib = 3000\nport = 30110\n'
                           '[serves.v.vllm]\nmodel = "m"\n',
                     daemon='vllm_executable = "vllm-not-installed"')
    gpud.configure(cfg)
    began = time.monotonic()
    out = gpuctl(gpud, "start", "v", timeout=60)
    assert time.monotonic() - began < 10
    assert out.returncode == 1
    assert "'vllm-not-installed' not found in PATH" in out.stderr
    v = gpud.serve("v")
    assert v["state"] == "failed" and "vllm-not-installed" in v["reason"]
    assert v["reserved_mib"] is None and committed(gpud) == 0
    assert "Task exception was never retrieved" not in gpud.journal_tail(200)


def test_a_serves_environment_reaches_it_but_not_systemctl_show(gpud: SandboxGpud) -> None:
    secret = "hf_s3cr3t $HOME ${X} 'q' \"dq\" `b` \\ end"
    extra = f"environment = {{ HF_TOKEN = {json.dumps(secret)} }}\n"
    gpud.configure(sim_config(ROLE, serve("tok", 30120, extra=extra)))
    pid = gpud.wait_state("tok", "running")["main_pid"]
    shown = gpud.sb.run(["systemctl", "show", "gpud-serve-tok.service"]).stdout
    assert "s3cr3t" not in shown
    environ = gpud.sb.run(["cat", f"/proc/{pid}/environ"]).stdout.split("\0")
    assert f"HF_TOKEN={secret}" in environ
    listing = gpud.sb.run(["stat", "-c", "%a %U", "/var/lib/gpud/env",
                           "/var/lib/gpud/env/tok.env"]).stdout.split("\n")
    assert listing[:2] == ["700 root", "600 root"]


def test_an_apply_cut_short_by_a_crash_is_rolled_back_at_the_next_start(
        gpud: SandboxGpud, tmp_path: Path) -> None:
    gpud.configure(KEEP)
    gpud.wait_state("keep", "running")
    slow = KEEP + "\n" + serve("slow", 30130, 1000, "--startup-delay", "30")
    new = tmp_path / "slow.toml"
    new.write_text(slow)
    applying = threading.Thread(target=gpuctl, args=(gpud, "apply", str(new)), daemon=True)
    applying.start()
    deadline = time.monotonic() + 60
    while gpud.call("GET", "/v1/serves/slow").status == 404 and time.monotonic() < deadline:
        time.sleep(0.05)  # known once the apply has reloaded
    gpud.wait_state("slow", "starting")
    assert gpud.call("POST", "/v1/reload", {}).status == 409  # not during an apply
    gpud.sb.run(["systemctl", "kill", "-s", "KILL", "gpud.service"])
    applying.join(30)
    gpud.sb.run(["systemctl", "reset-failed", "gpud.service"], check=False)
    gpud.start()
    deadline = time.monotonic() + 60
    recovered: list[dict] = []
    while not recovered and time.monotonic() < deadline:
        recovered = [e for e in gpud.events(kind="apply") if e["details"].get("step") == "recover"]
        time.sleep(0.1)
    assert recovered, gpud.journal_tail()
    ev = recovered[0]
    assert "apply interrupted" in ev["message"]
    assert "the old config was written back" in ev["message"]
    assert "stopped slow" in ev["message"] and "old config reloaded" in ev["message"]
    assert gpud.sb.host_path("/etc/gpud/serves.toml").read_text() == KEEP
    assert gpud.get("/v1/status")["config_file"] == {"differs": False, "reason": None}
    assert "gpud-serve-slow.service" not in gpud.serve_units()
    assert gpud.serve("keep")["state"] == "running" and committed(gpud) == 2000


def test_apply_while_the_resident_set_boots_is_refused(gpud: SandboxGpud, tmp_path: Path) -> None:
    cfg = sim_config(ROLE, serve("late", 30140, 1000, "--startup-delay", "20"))
    gpud.configure(cfg)
    gpud.wait_state("late", "starting")
    new = tmp_path / "new.toml"
    new.write_text(cfg.replace("vram_mib = 1000", "vram_mib = 900"))
    out = gpuctl(gpud, "apply", str(new))
    assert out.returncode == 1
    assert "the resident set is still starting" in out.stderr and "late" in out.stderr
    assert gpud.sb.host_path("/etc/gpud/serves.toml").read_text() == cfg
