"""A serve on several devices under real systemd with a simulated 2-device host: its unit sees
every device (CUDA_VISIBLE_DEVICES in role order), its start holds every device, its draw is
attributed per device, overdraw is judged per device, and adoption keeps the whole reservation."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.integration.gpudctl import (
    REPO,
    SERVE_SOCKETS,
    SandboxGpud,
    sim_config,
    standin,
    standin_uds,
)

ROLES = """
[roles.g0]
device = "GPU-sim-0"
reserve_mib = 1000
[roles.g1]
device = "GPU-sim-1"
reserve_mib = 1000
"""
TOTAL = 40960


def big(*extra: str, resident: bool = False, priority: int = 50, mib: int = 20000) -> str:
    return (f'[serves.big]\nroles = ["g1", "g0"]\nvram_mib = {mib}\nport = 30200\n'
            f"resident = {'true' if resident else 'false'}\npriority = {priority}\n"
            f"command = {standin('--echo-argv', *extra)}\n")


def until(predicate: Callable[[], bool], timeout: float = 20) -> bool:
    """Whether `predicate` came true within `timeout` (checked at the observer's pace)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def managed(gpud: SandboxGpud) -> dict[str, int]:
    return {r["name"]: (r["observed"] or {}).get("managed_draw_mib")
            for r in gpud.get("/v1/ledger")["roles"]}


def test_a_two_device_serve_runs_on_both_and_its_draw_is_attributed_per_device(
        gpud: SandboxGpud) -> None:
    gpud.configure(sim_config(ROLES, big(), devices=2, total_mib=TOTAL))
    reply = gpud.call("POST", "/v1/serves/big/start", {})
    assert reply.status == 200, reply.raw
    gpud.wait_state("big", "running")
    echo = json.loads(gpud.sb.run(["curl", "-s", "http://127.0.0.1:30200/standin/argv"]).stdout)
    # Role order: g1 then g0, so device 1 is CUDA's device 0 for this serve.
    assert echo["env"]["CUDA_VISIBLE_DEVICES"] == "1,0"
    assert echo["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    util = echo["argv"][echo["argv"].index("--gpu-memory-utilization") + 1]
    assert util == "0.4882"  # floor(20000 / 40960, 4 decimals)
    draw = int(float(util) * TOTAL)  # the stand-in draws util x total on each device
    assert until(lambda: managed(gpud) == {"g0": draw, "g1": draw}), managed(gpud)
    ledger = {r["name"]: r for r in gpud.get("/v1/ledger")["roles"]}
    assert [(x["serve"], x["part"]) for x in ledger["g1"]["reservations"]] == [("big", "1/2")]
    assert [(x["serve"], x["part"]) for x in ledger["g0"]["reservations"]] == [("big", "2/2")]
    # Nothing of it counts as non-ledger draw on either device.
    assert all(r["observed"]["non_ledger_draw_mib"] == 0 for r in ledger.values())
    observed = [value for labels, value in gpud.metrics("gpud_serve_observed_mib")
                if labels["serve"] == "big"]
    assert observed == [draw, draw], observed
    # Every event of the serve names both roles, and is found by either.
    for kind in ("admit", "start", "healthy"):
        (ev,) = gpud.events(kind=kind, serve="big")
        assert ev["details"]["roles"] == ["g1", "g0"], ev
    assert {e["kind"] for e in gpud.events(serve="big", role="g0")} >= {"admit", "start",
                                                                        "healthy"}
    assert gpud.call("POST", "/v1/serves/big/stop", {}).status == 200
    gpud.wait_state("big", "declared")
    assert {r["name"]: r["committed_mib"] for r in gpud.get("/v1/ledger")["roles"]} == \
        {"g0": 0, "g1": 0}


def test_its_start_holds_every_device_it_uses(gpud: SandboxGpud) -> None:
    serves = big("--startup-delay", "1.5", resident=True, priority=2, mib=8000)
    for name, role, prio, port in (("a1", "g0", 1, 30201), ("b1", "g1", 1, 30202),
                                   ("c1", "g1", 3, 30203)):
        serves += (f'[serves.{name}]\nrole = "{role}"\nvram_mib = 1000\nresident = true\n'
                   f"priority = {prio}\nport = {port}\n"
                   f"command = {standin('--startup-delay', '1.5')}\n")
    gpud.configure(sim_config(ROLES, serves, devices=2, total_mib=TOTAL))
    for name in ("a1", "b1", "big", "c1"):
        gpud.wait_state(name, "running", timeout=60)
    ts = {(e["kind"], e["serve"]): e["ts"] for e in gpud.events()
          if e["kind"] in ("start", "healthy")}
    # big waited for the loads on both of its devices ...
    assert ts[("start", "big")] >= ts[("healthy", "a1")]
    assert ts[("start", "big")] >= ts[("healthy", "b1")]
    # ... and nothing started on either while it loaded.
    for other in ("a1", "b1", "c1"):
        assert not ts[("start", "big")] < ts[("start", other)] < ts[("healthy", "big")], other
    # a1 and b1, on different devices, loaded side by side.
    assert ts[("start", "b1")] < ts[("healthy", "a1")]


def test_overdraw_is_judged_on_each_device(gpud: SandboxGpud) -> None:
    gpud.configure(sim_config(ROLES, big("--overdraw-pct", "20", mib=4000), devices=2,
                              total_mib=TOTAL, daemon="overdraw_tolerance_mib = 256"))
    assert gpud.call("POST", "/v1/serves/big/start", {}).status == 200
    gpud.wait_state("big", "running")
    gpud.wait_event("overdraw", serve="big", role="g0")
    gpud.wait_event("overdraw", serve="big", role="g1")
    events = gpud.events(kind="overdraw", serve="big")
    assert sorted(e["role"] for e in events) == ["g0", "g1"]
    # Per device: 4000 MiB reserved there, about 4799 drawn there (not the 9598 of both).
    assert all(e["details"]["reservation_mib"] == 4000 and 4700 <= e["mib"] < 5000
               for e in events), events


def test_gpud_restart_adopts_the_whole_reservation(gpud: SandboxGpud) -> None:
    gpud.configure(sim_config(ROLES, big(resident=True), devices=2, total_mib=TOTAL))
    gpud.wait_state("big", "running")
    pid = gpud.unit_prop("gpud-serve-big.service", "MainPID")
    # kill -9: no graceful anything; the store must hold both rows or none.
    gpud.sb.run(["systemctl", "kill", "-s", "KILL", "gpud.service"], check=False)
    gpud.sb.run(["systemctl", "restart", "gpud.service"], timeout=60)
    gpud.wait_state("big", "running")
    assert gpud.unit_prop("gpud-serve-big.service", "MainPID") == pid
    roles = {r["name"]: r for r in gpud.get("/v1/ledger")["roles"]}
    assert [(x["serve"], x["mib"], x["part"]) for x in roles["g1"]["reservations"]] == \
        [("big", 20000, "1/2")]
    assert [(x["serve"], x["mib"], x["part"]) for x in roles["g0"]["reservations"]] == \
        [("big", 20000, "2/2")]
    assert len(gpud.events(kind="start", serve="big")) == 1  # never started a second time


def test_apply_moves_a_running_serve_from_one_device_to_two_and_back(
        gpud: SandboxGpud, tmp_path: Path) -> None:
    def with_roles(where: str) -> str:
        serve = (f'[serves.big]\n{where}\nvram_mib = 12000\nresident = true\nport = 30200\n'
                 f"command = {standin('--echo-argv')}\n")
        return sim_config(ROLES, serve, devices=2, total_mib=TOTAL)

    one, two = with_roles('role = "g0"'), with_roles('roles = ["g0", "g1"]')
    gpud.configure(one)
    gpud.wait_state("big", "running")

    def visible() -> str:
        echo = gpud.sb.run(["curl", "-s", "http://127.0.0.1:30200/standin/argv"]).stdout
        return str(json.loads(echo)["env"]["CUDA_VISIBLE_DEVICES"])

    def committed() -> dict[str, int]:
        return {r["name"]: r["committed_mib"] for r in gpud.get("/v1/ledger")["roles"]}

    assert visible() == "0" and committed() == {"g0": 12000, "g1": 0}
    for text, devices, held in ((two, "0,1", {"g0": 12000, "g1": 12000}),
                                (one, "0", {"g0": 12000, "g1": 0})):
        new = tmp_path / "new.toml"
        new.write_text(text)
        applied = subprocess.run([sys.executable, "-m", "gpud.ctl", "--socket",
                                  str(gpud.socket), "apply", str(new)], capture_output=True,
                                 text=True, cwd=REPO, timeout=300, check=False)
        assert applied.returncode == 0, applied.stdout + applied.stderr
        gpud.wait_state("big", "running")
        assert visible() == devices
        assert committed() == held


def sleeper(name: str, role: str, port: int) -> str:
    """A serve of low priority on one device that sleeps (level 2) down to 800 MiB; fronted,
    as a serve that sleeps is by default (it listens on its socket)."""
    return (f'[serves.{name}]\nrole = "{role}"\nvram_mib = 30000\npriority = 50\n'
            f"port = {port}\nsleep_level = 2\nsleep_mib = 800\nresident = false\n"
            'environment = { VLLM_SERVER_DEV_MODE = "1" }\n'
            f"command = {standin_uds('--context-mib', '200', '--asleep-mib', '800', '--enable-sleep-mode')}\n")


def test_a_preemption_for_a_serve_on_two_devices_makes_room_on_both(gpud: SandboxGpud) -> None:
    # big needs 20000 MiB on g1 and on g0; each holds a 30000 MiB sleeper of lower priority:
    # one victim on each device, both put to sleep, big admitted on both.
    gpud.configure(sim_config(ROLES, big(priority=10) + sleeper("lo0", "g0", 30210)
                              + sleeper("lo1", "g1", 30211), devices=2, total_mib=TOTAL))
    for name in ("lo0", "lo1"):
        assert gpud.call("POST", f"/v1/serves/{name}/start", {}).status == 200
    for name in ("lo0", "lo1"):
        gpud.wait_state(name, "running")
    dry = gpud.call("POST", "/v1/serves/big/start", {"preempt": True, "dry_run": True})
    assert dry.status == 200, dry.raw
    plan = dry.body["preemption"]
    assert sorted(s["serve"] for s in plan["steps"]) == ["lo0", "lo1"], plan
    assert {r["role"]: r["free_after_mib"] for r in plan["roles"]} == {"g0": 39160,
                                                                     "g1": 39160}
    reply = gpud.call("POST", "/v1/serves/big/start", {"preempt": True})
    assert reply.status == 200, reply.raw
    gpud.wait_state("big", "running")
    assert gpud.serve("lo0")["state"] == gpud.serve("lo1")["state"] == "sleeping"
    held = {r["name"]: sorted((x["serve"], x["mib"]) for x in r["reservations"])
            for r in gpud.get("/v1/ledger")["roles"]}
    assert held == {"g0": [("big", 20000), ("lo0", 800)], "g1": [("big", 20000), ("lo1", 800)]}
    # Gone again, its victims wake back on both devices.
    assert gpud.call("POST", "/v1/serves/big/stop", {}).status == 200
    for name in ("lo0", "lo1"):
        gpud.wait_state(name, "running", timeout=30)
    # A reservation alone, with preempt: the same plan, and the answer names both roles.
    reply = gpud.call("POST", "/v1/serves/big/admit", {"mib": 20000, "preempt": True})
    assert reply.status == 200, reply.raw
    assert reply.body["roles"] == ["g1", "g0"]
    assert {r: f["committed_mib"] for r, f in reply.body["figures_by_role"].items()} == \
        {"g0": 20800, "g1": 20800}
    assert sorted(s["serve"] for s in reply.body["preemption"]["steps"]) == ["lo0", "lo1"]


def test_a_sleeping_serve_on_two_devices_across_gpud_kills(gpud: SandboxGpud) -> None:
    # Asleep, its reservation shrinks on both devices at once; gpud killed (-9) while it sleeps,
    # and killed between vLLM's sleep and the shrink, adopts it asleep on both, whole.
    tp = ('[serves.tp]\nroles = ["g1", "g0"]\nvram_mib = 20000\nport = 30220\nsleep_level = 1\n'
          'sleep_mib = 800\nenvironment = { VLLM_SERVER_DEV_MODE = "1" }\n'
          f"command = {standin_uds('--context-mib', '200', '--asleep-mib', '800', '--enable-sleep-mode')}\n")
    gpud.configure(sim_config(ROLES, tp, devices=2, total_mib=TOTAL))

    def held() -> dict[str, list[tuple[str, int]]]:
        return {r["name"]: [(x["serve"], x["mib"]) for x in r["reservations"]]
                for r in gpud.get("/v1/ledger")["roles"]}

    def kill_gpud() -> None:
        gpud.sb.run(["systemctl", "kill", "--signal=KILL", "gpud.service"], timeout=60)
        gpud.sb.run(["systemctl", "stop", "gpud.service"], timeout=60, check=False)

    assert gpud.call("POST", "/v1/serves/tp/start", {}).status == 200
    gpud.wait_state("tp", "running")
    # level 1: each of its two workers backs up its shard in host RAM, 2 x 20000 MiB
    gpud.sb.write_file("/run/gpud/sim.json", json.dumps({"external": [],
                                                         "mem_available_mib": 30000}))
    short = gpud.call("POST", "/v1/serves/tp/sleep", {})
    assert short.status == 409 and short.body["error"]["details"]["need_mib"] == 41024, short.raw
    gpud.sb.write_file("/run/gpud/sim.json", json.dumps({"external": [],
                                                         "mem_available_mib": 60000}))
    try:
        slept = gpud.call("POST", "/v1/serves/tp/sleep", {})
    except TimeoutError:
        raise AssertionError(gpud.journal_tail(60)) from None
    assert slept.status == 200, slept.raw
    assert slept.body["parked_host_mib"] == 40000
    assert slept.body["sleep"]["draw_ms"] < 5000  # its draw judged per device, not summed
    assert held() == {"g0": [("tp", 800)], "g1": [("tp", 800)]}
    kill_gpud()
    gpud.start()
    assert gpud.wait_state("tp", "sleeping")["reserved_mib"] == 800
    assert held() == {"g0": [("tp", 800)], "g1": [("tp", 800)]}
    reply = gpud.call("POST", "/v1/serves/tp/wake", {})
    assert reply.status == 200, reply.raw
    assert held() == {"g0": [("tp", 20000)], "g1": [("tp", 20000)]}
    # Between vLLM's sleep and the shrink: gpud gone, the serve asleep, recorded running.
    kill_gpud()
    # (root asks the serve on its socket: through its port, the front answers /sleep 404)
    gpud.sb.run(["curl", "-s", "-X", "POST", "--unix-socket", f"{SERVE_SOCKETS}/tp.sock",
                 "http://localhost/sleep?level=1"])
    gpud.start()
    assert gpud.wait_state("tp", "sleeping")["reserved_mib"] == 20000  # more, never less
    assert held() == {"g0": [("tp", 20000)], "g1": [("tp", 20000)]}
    reply = gpud.call("POST", "/v1/serves/tp/wake", {})
    assert reply.status == 200, reply.raw
    assert gpud.serve("tp")["state"] == "running"
    assert held() == {"g0": [("tp", 20000)], "g1": [("tp", 20000)]}
