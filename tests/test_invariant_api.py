"""The ledger invariant and the privilege line against a real gpud process (no system bus):
config changes decided whole, one writer per state directory, figures-only for the admin group,
bounded history."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, GpudProcess, call, start_gpud, write_config
from tests.test_api import _as_user

TWO_ROLES = """
[daemon]
admission = "ledger"
admin_group = "users"

[roles.r1]
device = "0"
capacity_mib = 10000

[roles.r2]
device = "1"
capacity_mib = 10000

[serves.a]
role = "r1"
vram_mib = 1000
command = ["/bin/true"]
"""


def apply(gp: GpudProcess, text: str) -> list[dict]:
    """POST /v1/apply; the NDJSON lines."""
    reply = call(gp.socket, "POST", "/v1/apply", {"config": text, "source": "test"})
    if reply.status != 200:  # answered before the stream began
        return [{"result": "refused", **reply.body}]
    return [json.loads(line) for line in reply.raw.decode().splitlines() if line.strip()]


@pytest.fixture
def two_roles(tmp_path: Path) -> GpudProcess:
    gp = start_gpud(tmp_path, TWO_ROLES)
    yield gp
    gp.stop()


def ledger_of(gp: GpudProcess, role: str) -> dict:
    return next(r for r in gp.call("GET", "/v1/ledger").body["roles"] if r["name"] == role)


def reservations(gp: GpudProcess) -> dict[str, tuple[str, int]]:
    doc = gp.call("GET", "/v1/ledger").body
    return {r["serve"]: (role["name"], r["mib"]) for role in doc["roles"]
            for r in role["reservations"]}


def test_removing_a_role_under_an_external_reservation_is_refused_by_plan_and_apply(
        two_roles: GpudProcess, tmp_path: Path) -> None:
    gp = two_roles
    assert gp.call("POST", "/v1/serves/router/admit", {"mib": 54, "role": "r2"}).status == 200
    without_r2 = TWO_ROLES.replace('[roles.r2]\ndevice = "1"\ncapacity_mib = 10000\n', "")
    plan = gp.call("POST", "/v1/plan", {"config": without_r2}).body
    assert [b["what"] for b in plan["blocked"]] == ["router"]
    new = tmp_path / "new.toml"
    new.write_text(without_r2)
    shown = subprocess.run([sys.executable, "-m", "gpud.ctl", "--socket", str(gp.socket),
                            "plan", str(new)], capture_output=True, text=True, cwd=REPO,
                           check=False)
    assert shown.returncode == 1
    assert "BLOCKED: router (54 MiB on r2): external reservation on role 'r2'" in shown.stdout
    lines = apply(gp, without_r2)
    assert lines[-1]["result"] == "refused" and lines[-1]["error"]["code"] == "conflict"
    assert "router" in lines[-1]["error"]["message"]
    assert gp.config.read_text() == TWO_ROLES
    assert reservations(gp) == {"router": ("r2", 54)}
    assert not (tmp_path / "backups").exists()  # refused before anything was touched


def test_reload_refuses_what_the_ledger_cannot_follow_and_keeps_the_old_config(
        two_roles: GpudProcess) -> None:
    gp = two_roles
    assert gp.call("POST", "/v1/serves/b/admit", {"mib": 500, "role": "r1"}).status == 200
    # b, an external reservation on r1, configured as a serve on r2: refused.
    gp.config.write_text(TWO_ROLES + '\n[serves.b]\nrole = "r2"\nvram_mib = 500\n'
                                     'command = ["/bin/true"]\n')
    reply = gp.call("POST", "/v1/reload", {})
    assert reply.status == 409, reply.body
    [blocker] = reply.body["error"]["details"]["blockers"]
    assert (blocker["what"], blocker["role"], blocker["mib"]) == ("b", "r1", 500)
    assert "b" not in {s["name"] for s in gp.call("GET", "/v1/serves").body["serves"]
                       if s["configured"]}
    status = gp.call("GET", "/v1/status").body["config_file"]
    assert status["differs"] is True and "gpuctl plan" in status["reason"]
    # Shrinking r1 below what it holds: refused too, naming the role and what it holds.
    gp.config.write_text(TWO_ROLES.replace("capacity_mib = 10000", "capacity_mib = 400", 1)
                         .replace("vram_mib = 1000", "vram_mib = 300"))
    reply = gp.call("POST", "/v1/reload", {})
    assert reply.status == 409
    assert ("roles.r1: committed 500 MiB would exceed capacity - reserve = 400 MiB (held: b "
            "500 MiB)") in reply.body["error"]["message"]
    assert ledger_of(gp, "r1")["capacity_mib"] == 10000


def test_a_removed_serve_gives_back_what_it_held(two_roles: GpudProcess) -> None:
    gp = two_roles
    assert gp.call("POST", "/v1/serves/a/admit", {"mib": 1000}).status == 200
    lines = apply(gp, TWO_ROLES.replace('[serves.a]\nrole = "r1"\nvram_mib = 1000\n'
                                        'command = ["/bin/true"]\n', ""))
    assert lines[-1]["result"] == "applied", lines
    assert reservations(gp) == {}
    assert ledger_of(gp, "r1")["free_mib"] == 10000
    released = gp.call("GET", "/v1/events?kind=release").body["events"]
    assert [e["serve"] for e in released] == ["a"]
    assert "the serve leaves the config" in released[0]["message"]  # the apply's release step


def test_a_second_gpud_on_the_same_state_directory_exits_naming_the_holder(
        two_roles: GpudProcess, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    second = start_gpud(other, TWO_ROLES, wait=False, state_dir=two_roles.state_dir,
                        sock=other / "second.sock")
    try:
        assert second.proc.wait(20) == 1
    finally:
        second.stop()
    out = second.output()
    assert f"the state directory {two_roles.state_dir} is in use by another gpud " \
           f"(pid {two_roles.proc.pid})" in out
    assert not (other / "second.sock").exists()
    assert two_roles.alive()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users")
def test_the_admin_group_changes_figures_only() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="gpud-test-"))
    tmp.chmod(0o755)  # the peer check, not the file mode, is what refuses
    gp = start_gpud(tmp, TWO_ROLES)
    gp.socket.chmod(0o666)
    try:
        _admin_group_cases(gp)
    finally:
        gp.stop()
        subprocess.run(["rm", "-rf", str(tmp)], check=False)


def _admin_group_cases(gp: GpudProcess) -> None:
    users = 100
    evil = TWO_ROLES + ('\n[serves.evil]\nrole = "r1"\nvram_mib = 10\n'
                        'command = ["/bin/sh", "-c", "id > /tmp/owned"]\n')
    changed_command = TWO_ROLES.replace('command = ["/bin/true"]', 'command = ["/bin/sh"]')
    with_env = TWO_ROLES + 'environment = { LD_PRELOAD = "/tmp/x.so" }\n'
    daemon_key = TWO_ROLES.replace('admin_group = "users"', 'admin_group = "nogroup"')
    for text, paths in ((evil, ["serves.evil"]), (changed_command, ["serves.a.command"]),
                        (with_env, ["serves.a.environment.LD_PRELOAD"]),
                        (daemon_key, ["daemon.admin_group"])):
        status, body = _as_user(gp.socket, "POST", "/v1/apply", {"config": text}, 65534, [users])
        assert status == 403, body
        assert body["error"]["details"]["needs_root"] == paths
        assert gp.config.read_text() == TWO_ROLES
    figures = TWO_ROLES.replace("vram_mib = 1000", "vram_mib = 900").replace(
        "capacity_mib = 10000", "capacity_mib = 9000\nreserve_mib = 100", 1)
    status, body = _as_user(gp.socket, "POST", "/v1/apply", {"config": figures}, 65534, [users])
    assert status == 200, body
    assert gp.config.read_text() == figures
    assert ledger_of(gp, "r1")["reserve_mib"] == 100


def test_events_are_kept_to_events_keep(tmp_path: Path) -> None:
    gp = start_gpud(tmp_path, TWO_ROLES.replace('admission = "ledger"',
                                                'admission = "ledger"\nevents_keep = 100'))
    try:
        for i in range(1100):
            assert gp.call("POST", "/v1/serves/x/admit", {"mib": 1 + i % 50,
                                                           "role": "r1"}).status == 200
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            events = gp.call("GET", "/v1/events?limit=5000").body["events"]
            if len(events) <= 200:
                break
            time.sleep(0.1)
        assert len(events) <= 200  # events_keep, plus what came after the last batch
        assert events[-1]["kind"] == "admit" and events[-1]["mib"] == 1 + 1099 % 50
        assert [e["id"] for e in events] == sorted(e["id"] for e in events)
    finally:
        gp.stop()


def test_a_role_on_a_device_the_simulation_lacks_is_a_config_error(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, """
        [roles.r]
        device = "GPU-sim-7"
        [simulation]
        state_file = "/nonexistent/sim.json"
        [[simulation.devices]]
        uuid = "GPU-sim-0"
        total_mib = 1000
        """)
    out = subprocess.run([sys.executable, "-m", "gpud.daemon", "--check-config", str(cfg)],
                         capture_output=True, text=True, cwd=REPO, check=False)
    assert out.returncode == 2
    assert "roles.r.device: no device 'GPU-sim-7' on this host (present: GPU-sim-0 (index 0))" \
        in out.stderr


def test_calibrate_window_must_be_finite(gpud_t015: GpudProcess) -> None:
    out = subprocess.run([sys.executable, "-m", "gpud.ctl", "--socket", str(gpud_t015.socket),
                          "calibrate", "fast", "--window", "1e400"], capture_output=True,
                         text=True, cwd=REPO, check=False)
    assert out.returncode == 2
    assert "--window: must be a positive, finite duration" in out.stderr



def test_a_config_of_4096_serves_arrives_whole(two_roles: GpudProcess) -> None:
    """A body larger than one socket read (here about 400 KB) is read to its end."""
    serves = "".join(f'[serves.s{i}]\nrole = "r2"\nvram_mib = 2\nport = {20000 + i}\n'
                     f'command = ["/bin/true", "--port", "{{port}}"]\n' for i in range(4096))
    text = TWO_ROLES + serves
    assert len(text) > 300_000
    reply = two_roles.call("POST", "/v1/plan", {"config": text})
    assert reply.status == 200, reply.body
    assert len(reply.body["serves"]) == 4097
