"""The ledger invariant under real systemd: config changes that remove running serves, units the
config no longer names, launches that fail before systemd is asked, interrupted applies, and a
serve's environment kept from other users."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from gpud.core.ledger import gpu_memory_utilization
from tests.integration.gpudctl import REPO, SandboxGpud, sim_config, standin

ROLE = '[roles.r]\ndevice = "GPU-sim-0"\nreserve_mib = 1000\n'


def serve(name: str, port: int, mib: int = 2000, *args: str, resident: bool = True,
          extra: str = "") -> str:
    return (f'[serves.{name}]\nrole = "r"\nvram_mib = {mib}\nresident = {str(resident).lower()}\n'
            f"port = {port}\ncommand = {standin(*args)}\n{extra}")


BOTH = sim_config(ROLE, serve("keep", 30101) + "\n" + serve("gone", 30102))
KEEP = sim_config(ROLE, serve("keep", 30101))


def gpuctl(gpud: SandboxGpud, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpud.ctl", "--socket", str(gpud.socket),
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
    # what the apply did is the plan's list of steps, in its order
    assert steps == ["validate"] + [s["kind"] for s in plan["steps"]]
    assert [(s["kind"], s["serve"]) for s in plan["steps"] if s["serve"]] == [("stop", "gone")]
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
    old = KEEP + "\n" + serve("gone", 30131, 500) + "\n" + serve("grow", 30132, 1000)
    gpud.configure(old)
    for name in ("keep", "gone", "grow"):
        gpud.wait_state(name, "running")
    # gone is stopped first, grow restarted bigger, then slow starts and gpud dies
    slow = (KEEP + "\n" + serve("grow", 30132, 1200) + "\n"
            + serve("slow", 30130, 1000, "--startup-delay", "30"))
    new = tmp_path / "slow.toml"
    new.write_text(slow)
    applying = threading.Thread(target=gpuctl, args=(gpud, "apply", str(new)), daemon=True)
    applying.start()
    deadline = time.monotonic() + 60
    while gpud.call("GET", "/v1/serves/slow").status == 404 and time.monotonic() < deadline:
        time.sleep(0.05)  # known once the apply has reloaded
    gpud.wait_state("slow", "starting", timeout=60)
    assert gpud.call("POST", "/v1/reload", {}).status == 409  # not during an apply
    assert "gpud-serve-gone.service" not in gpud.serve_units()
    assert gpud.serve("grow")["reserved_mib"] == 1200
    gpud.sb.run(["systemctl", "kill", "-s", "KILL", "gpud.service"])
    applying.join(30)
    gpud.sb.run(["systemctl", "reset-failed", "gpud.service"], check=False)
    gpud.start()
    deadline = time.monotonic() + 120
    recovered: list[dict] = []
    while not recovered and time.monotonic() < deadline:
        recovered = [e for e in gpud.events(kind="apply") if e["details"].get("step") == "recover"]
        time.sleep(0.1)
    assert recovered, gpud.journal_tail()
    ev = recovered[0]
    assert gpud.sb.host_path("/etc/gpud/serves.toml").read_text() == old
    assert gpud.get("/v1/status")["config_file"] == {"differs": False, "reason": None}
    assert "gpud-serve-slow.service" not in gpud.serve_units()
    assert "gpud-serve-gone.service" in gpud.serve_units()
    assert {n: gpud.serve(n)["state"] for n in ("keep", "gone", "grow")} == {
        "keep": "running", "gone": "running", "grow": "running"}
    assert held(gpud) == {"keep": 2000, "gone": 500, "grow": 1000}
    argv = gpud.sb.run(["cat", f"/proc/{gpud.serve('grow')['main_pid']}/cmdline"]).stdout
    assert gpu_memory_utilization(1000, 32607) in argv.split("\0")  # its old figures
    assert "apply interrupted" in ev["message"], ev["message"]
    # the rollback of a failed apply, over the steps it had begun
    assert "old config written back and reloaded" in ev["message"], ev["message"]
    assert "slow: back to declared" in ev["message"], ev["message"]
    assert "grow: back to running (1000 MiB)" in ev["message"], ev["message"]
    assert "gone: back to running (500 MiB)" in ev["message"], ev["message"]
    assert "FAILED" not in ev["message"], ev["message"]
    assert len([e for e in gpud.events(kind="apply") if e["details"].get("step") == "recover"]) == 1


def held(gpud: SandboxGpud) -> dict[str, int]:
    return {r["serve"]: r["mib"] for r in gpud.get("/v1/ledger")["roles"][0]["reservations"]}


def admitted_idle(gpud: SandboxGpud, **serves: int) -> None:
    for name, mib in serves.items():
        reply = gpud.call("POST", f"/v1/serves/{name}/admit", {"mib": mib})
        assert reply.status == 200, reply.body
        assert gpud.serve(name)["state"] == "admitted"


def test_apply_resizes_an_admitted_serve_to_the_size_its_plan_shows(
        gpud: SandboxGpud, tmp_path: Path) -> None:
    gpud.configure(sim_config(ROLE, serve("keep", 30101) + "\n"
                              + serve("lazy", 30170, 600, resident=False)))
    gpud.wait_state("keep", "running")
    admitted_idle(gpud, lazy=600)
    new = tmp_path / "lazy.toml"
    new.write_text(sim_config(ROLE, serve("keep", 30101) + "\n"
                              + serve("lazy", 30170, 800, resident=False)))
    plan = json.loads(gpuctl(gpud, "plan", str(new), "--json").stdout)
    lazy = next(s for s in plan["serves"] if s["name"] == "lazy")
    assert (lazy["mib_before"], lazy["mib_after"]) == (600, 800)
    applied = gpuctl(gpud, "apply", str(new))
    assert applied.returncode == 0, applied.stdout + applied.stderr
    # the ledger after the apply is the plan's
    assert held(gpud) == {s["name"]: s["mib_after"] for s in plan["serves"]
                          if s["mib_after"] is not None} == {"keep": 2000, "lazy": 800}
    # not resident: resized, still only admitted (an apply starts no serve that is not
    # resident)
    assert gpud.serve("lazy")["state"] == "admitted"
    assert "gpud-serve-lazy.service" not in gpud.serve_units()
    # and the steps say how
    assert [(s["kind"], s["serve"], s["mib_before"], s["mib_after"]) for s in plan["steps"]
            if s["serve"]] == [("resize", "lazy", 600, 800)]
    assert "lazy: resize done (600 MiB -> 800 MiB)" in applied.stdout


def test_a_resize_the_device_has_no_room_for_is_refused_by_plan_and_apply(
        gpud: SandboxGpud, tmp_path: Path) -> None:
    """The ledger would take 800 MiB for lazy, the device not: the plan checks the resize as
    the apply's strict admission would (lazy's own 600 MiB pending counted back), says so, and
    the apply is refused before it changes anything."""
    old = sim_config(ROLE, serve("keep", 30101) + "\n"
                     + serve("lazy", 30176, 600, resident=False))
    gpud.configure(old)
    gpud.wait_state("keep", "running")
    admitted_idle(gpud, lazy=600)
    # memory drawn outside the ledger: the ledger would take 800 MiB for lazy, the device not
    gpud.set_external([{"device": "GPU-sim-0", "label": "someone else", "mib": 32607 - 2700}])
    gpud.wait_event("reserve-exceeded")
    new = tmp_path / "new.toml"
    new.write_text(sim_config(ROLE, serve("keep", 30101) + "\n"
                              + serve("lazy", 30176, 800, resident=False)))
    planned = gpuctl(gpud, "plan", str(new), "--json")
    assert planned.returncode == 1, planned.stdout
    plan = json.loads(planned.stdout)
    assert not plan["resident_fits"] and plan["steps"] == []
    # the device's free is what neither the outside draw nor keep takes; lazy draws nothing
    free = 2700 - gpud.serve("keep")["observed_mib"]
    assert [(d["serve"], d["bound"], d["need_mib"], d["free_mib"]) for d in plan["denied"]] == [
        ("lazy", "physical", 800, free)]
    applied = gpuctl(gpud, "apply", str(new))
    assert applied.returncode == 1, applied.stdout
    assert ("apply refused, nothing changed: the resident set does not fit: lazy denied on r: "
            f"physical bound: need 800 MiB, free {free} MiB") in applied.stderr, applied.stderr
    assert not gpud.sb.host_path("/etc/gpud/backups").exists()
    assert gpud.sb.host_path("/etc/gpud/serves.toml").read_text() == old
    assert held(gpud) == {"keep": 2000, "lazy": 600}
    assert gpud.serve("lazy")["state"] == "admitted"
    assert "gpud-serve-lazy.service" not in gpud.serve_units()


def test_a_rolled_back_apply_gives_admitted_serves_their_reservations_back(
        gpud: SandboxGpud, tmp_path: Path) -> None:
    old = sim_config(ROLE, serve("keep", 30101) + "\n"
                     + serve("idle", 30171, 700, resident=False) + "\n"
                     + serve("lazy", 30172, 600, resident=False))
    gpud.configure(old)
    gpud.wait_state("keep", "running")
    admitted_idle(gpud, idle=700, lazy=600)
    # idle leaves the config, lazy grows, and a new serve never turns healthy
    new = tmp_path / "new.toml"
    new.write_text(sim_config(ROLE, serve("keep", 30101) + "\n"
                              + serve("lazy", 30172, 800, resident=False) + "\n"
                              + serve("sick", 30173, 500, "--never-healthy",
                                      extra="start_timeout_s = 3\n")))
    plan = json.loads(gpuctl(gpud, "plan", str(new), "--json").stdout)
    applied = gpuctl(gpud, "apply", str(new))
    assert applied.returncode == 1, applied.stdout
    assert "rolled back: sick did not become healthy" in applied.stderr
    assert gpud.sb.host_path("/etc/gpud/serves.toml").read_text() == old
    assert held(gpud) == {"keep": 2000, "idle": 700, "lazy": 600}
    assert {n: gpud.serve(n)["state"] for n in ("keep", "idle", "lazy")} == {
        "keep": "running", "idle": "admitted", "lazy": "admitted"}
    assert "gpud-serve-sick.service" not in gpud.serve_units()
    # the steps that changed them, and their undo
    assert [(s["kind"], s["serve"]) for s in plan["steps"] if s["serve"]][:2] == [
        ("release", "idle"), ("resize", "lazy")]
    assert "idle: release done (700 MiB -> none)" in applied.stdout
    assert "idle: back to admitted (700 MiB)" in applied.stdout
    assert "lazy: back to admitted (600 MiB)" in applied.stdout


def test_a_rollback_says_so_when_a_released_reservation_no_longer_fits(
        gpud: SandboxGpud, tmp_path: Path) -> None:
    old = sim_config(ROLE, serve("keep", 30101) + "\n"
                     + serve("idle", 30174, 700, resident=False))
    gpud.configure(old)
    gpud.wait_state("keep", "running")
    admitted_idle(gpud, idle=700)
    new = tmp_path / "new.toml"
    new.write_text(sim_config(ROLE, serve("keep", 30101) + "\n"
                              + serve("sick", 30175, 300, "--never-healthy",
                                      extra="start_timeout_s = 6\n")))
    result: list[subprocess.CompletedProcess[str]] = []
    applying = threading.Thread(target=lambda: result.append(gpuctl(gpud, "apply", str(new))))
    applying.start()
    deadline = time.monotonic() + 60
    while gpud.call("GET", "/v1/serves/sick").status == 404 and time.monotonic() < deadline:
        time.sleep(0.05)
    gpud.wait_state("sick", "starting")
    # meanwhile an external reservation takes all that is free: idle's 700 MiB are gone
    free = int(gpud.get("/v1/ledger")["roles"][0]["free_mib"])
    reply = gpud.call("POST", "/v1/serves/ext/admit", {"mib": free, "role": "r"})
    assert reply.status == 200, reply.body
    applying.join(120)
    [out] = result
    assert out.returncode == 1, out.stdout
    assert "[FAIL] rollback: idle: could not be restored: idle denied on r" in out.stdout, \
        out.stdout
    role = gpud.get("/v1/ledger")["roles"][0]
    assert {r["serve"]: r["mib"] for r in role["reservations"]} == {"keep": 2000, "ext": free}
    assert role["free_mib"] == 300 and not role["over_committed"]
    assert gpud.serve("idle")["state"] in ("declared", "denied")
    assert gpud.sb.host_path("/etc/gpud/serves.toml").read_text() == old


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


def test_a_failed_serve_shows_no_stale_pid_and_restarts_name_no_pid_zero(
        gpud: SandboxGpud) -> None:
    crashing = serve("crash", 30150, 500, "--crash-after", "0.5",
                     extra="restart_sec = 0.2\n")
    gpud.configure(sim_config(ROLE, crashing, daemon="crash_loop_restarts = 2"))
    failed = gpud.wait_state("crash", "failed", timeout=60)
    assert failed["main_pid"] is None
    restarts = gpud.events(kind="restart", serve="crash")
    assert restarts and not any("MainPID 0" in e["message"] for e in restarts)


def test_apply_on_a_full_config_directory_ends_its_stream_with_one_error_line(
        gpud: SandboxGpud, tmp_path: Path) -> None:
    gpud.configure(KEEP, start=False)
    # /etc/gpud on a tiny file system (mounted before gpud starts, so its namespace has it),
    # filled up: the backup and the write have no room.
    gpud.sb.run("cp /etc/gpud/serves.toml /run/serves.toml && "
                "mount -t tmpfs -o size=64k tmpfs /etc/gpud && "
                "cp /run/serves.toml /etc/gpud/serves.toml && chmod 600 /etc/gpud/serves.toml && "
                "(dd if=/dev/zero of=/etc/gpud/filler bs=4k 2>/dev/null || true)")
    try:
        gpud.start()
        gpud.wait_state("keep", "running")
        pid = gpud.serve("keep")["main_pid"]
        new = tmp_path / "new.toml"
        new.write_text(KEEP.replace("vram_mib = 2000", "vram_mib = 1800"))
        out = gpuctl(gpud, "apply", str(new), "--json")
        assert out.returncode == 1
        lines = [json.loads(line) for line in out.stdout.splitlines()]
        assert lines[-1]["result"] == "rolled-back"
        assert "No space left on device" in lines[-1]["error"]
        assert all("step" in line for line in lines[:-1])
        listing = gpud.sb.run(["ls", "-a", "/etc/gpud"]).stdout.split()
        assert not [name for name in listing if name.endswith(".tmp")], listing
        assert gpud.sb.run(["cat", "/etc/gpud/serves.toml"]).stdout == KEEP
        assert gpud.serve("keep")["main_pid"] == pid and committed(gpud) == 2000
    finally:
        gpud.sb.run(["systemctl", "stop", "gpud.service"], check=False)
        gpud.sb.run(["umount", "/etc/gpud"], check=False)


def test_a_rollback_never_writes_over_a_file_changed_during_the_apply(
        gpud: SandboxGpud, tmp_path: Path) -> None:
    gpud.configure(KEEP)
    gpud.wait_state("keep", "running")
    sick = KEEP + "\n" + serve("sick", 30160, 500, "--never-healthy",
                               extra="start_timeout_s = 4\n")
    new = tmp_path / "sick.toml"
    new.write_text(sick)
    result: list[subprocess.CompletedProcess[str]] = []
    applying = threading.Thread(target=lambda: result.append(gpuctl(gpud, "apply", str(new))))
    applying.start()
    deadline = time.monotonic() + 60
    while gpud.call("GET", "/v1/serves/sick").status == 404 and time.monotonic() < deadline:
        time.sleep(0.05)
    operators = KEEP.replace("reserve_mib = 1000", "reserve_mib = 1100")
    gpud.sb.write_file("/etc/gpud/serves.toml", operators, mode=0o600)  # by hand, meanwhile
    applying.join(120)
    [out] = result
    assert out.returncode == 1
    assert "changed on disk since the apply began: not written over" in out.stdout
    assert gpud.sb.host_path("/etc/gpud/serves.toml").read_text() == operators
    assert "gpud-serve-sick.service" not in gpud.serve_units()
