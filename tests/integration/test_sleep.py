"""Sleep, wake and preemption under real systemd in the sandbox: stand-ins speaking vLLM's sleep
endpoints (their simulated draw drops to their context on sleep and comes back on wake),
simulated GPU."""

from __future__ import annotations

import json
import threading
from typing import Any

from gpud.server.openapi import document
from tests.conftest import Reply
from tests.integration.gpudctl import REPO, SandboxGpud, sim_config, standin, standin_uds
from tests.schema import answer_errors

ROLE = """
[roles.r]
device = "GPU-sim-0"
reserve_mib = 1000
"""
# capacity 32607 - reserve 1000 = 31607 MiB to reserve


def serve(name: str, mib: int, priority: int, port: int, *, level: int = 0,
          sleeps: bool = True, context: int = 200, sleep_mib: int | None = 800,
          asleep: int = 800, front: bool = True) -> str:
    """A stand-in serve; one with a sleep `level` is fronted (the default for it: gpud and the
    front reach its socket, clients its port) unless `front` is False (it listens on its port,
    its dev routes open to every local user)."""
    # asleep, the stand-in draws `asleep` MiB: its sleep_mib
    args = ["--context-mib", str(context), "--asleep-mib", str(asleep)]
    args += ["--enable-sleep-mode"] if sleeps else []
    command = standin_uds(*args) if level and front else standin(*args)
    out = (f'[serves.{name}]\nrole = "r"\nvram_mib = {mib}\npriority = {priority}\n'
           f"port = {port}\ncommand = {command}\n"
           'environment = { VLLM_SERVER_DEV_MODE = "1" }\n')
    if level and not front:
        out += "front = false\n"
    if level:
        out += f"sleep_level = {level}\n"
    if level and sleep_mib is not None:
        out += f"sleep_mib = {sleep_mib}\n"
    return out


def two_sleepers(*, mid_sleeps: bool = True, daemon: str = "") -> str:
    return sim_config(ROLE, serve("lo", 12000, 50, 30101, level=1)
                      + serve("mid", 12000, 40, 30102, level=2, sleeps=mid_sleeps)
                      + serve("hi", 16000, 10, 30103) + serve("big", 26000, 10, 30104)
                      + serve("hi2", 16000, 20, 30105), daemon=daemon)


def checked(gpud: SandboxGpud, template: str, name: str, body: Any = None,
            status: int = 200) -> Any:
    """A POST whose answer is held to the served document."""
    reply = gpud.call("POST", template.replace("{name}", name), body or {})
    assert reply.status == status, reply.raw
    errors = answer_errors(document(), "POST", template, reply.status, reply.body)
    assert not errors, errors
    return reply.body


def running(gpud: SandboxGpud, *names: str) -> None:
    for name in names:
        reply = gpud.call("POST", f"/v1/serves/{name}/start", {})
        assert reply.status == 200, reply.raw
    for name in names:
        gpud.wait_state(name, "running")


def reserved(gpud: SandboxGpud) -> dict[str, int]:
    role = gpud.get("/v1/ledger")["roles"][0]
    assert role["committed_mib"] <= role["capacity_mib"] - role["reserve_mib"], role
    return {r["serve"]: r["mib"] for r in role["reservations"]}


def test_sleep_and_wake_by_hand(gpud: SandboxGpud) -> None:
    gpud.configure(two_sleepers())
    running(gpud, "lo")
    # A serve with a sleep_level is fronted unless it says otherwise: its port answers vLLM's
    # dev routes 404 (the front), gpud's sleep and wake go over its socket.
    assert gpud.serve("lo")["front"] is True and gpud.serve("hi")["front"] is False
    for path in ("/sleep?level=1", "/wake_up", "/collective_rpc"):
        status = gpud.sb.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-X",
                              "POST", f"http://127.0.0.1:30101{path}"], user="nobody").stdout
        assert status == "404", (path, status)
    view = checked(gpud, "/v1/serves/{name}/sleep", "lo")
    assert view["state"] == "sleeping"
    assert view["reserved_mib"] == 800
    assert view["parked_host_mib"] == 12000  # uncalibrated: its reservation
    assert view["sleep"]["level"] == 1
    assert gpud.standin_state("lo")["sleep_level"] == 1
    assert reserved(gpud) == {"lo": 800}
    entry = gpud.wait_journal("GPUD_SERVE=lo", "GPUD_EVENT=sleep", unit="gpud.service")[0]
    assert entry["GPUD_MIB"] == "800" and entry["GPUD_FROM_MIB"] == "12000"
    # observation saw the stand-in's draw drop to its sleep draw (a serve with an environment
    # table gets gpud's environment too: the simulation's registration among it)
    assert entry["GPUD_OBSERVED_MIB"] == "800"
    lines = [labels for labels, value in gpud.metrics("gpud_serve_state")
             if labels["serve"] == "lo" and value == 1]
    assert len(lines) == 1 and lines[0]["state"] == "sleeping", lines
    # sleeping twice, or waking a running serve, is a conflict
    assert gpud.call("POST", "/v1/serves/lo/sleep", {}).status == 409
    woken = checked(gpud, "/v1/serves/{name}/wake", "lo")
    assert woken["state"] == "running" and woken["reserved_mib"] == 12000
    assert gpud.standin_state("lo")["sleep_level"] is None
    assert gpud.call("POST", "/v1/serves/lo/wake", {}).status == 409
    kinds = [e["kind"] for e in gpud.events(serve="lo") if e["kind"] in ("sleep", "wake")]
    assert kinds == ["sleep", "wake"]
    # a serve without sleep_level does not sleep
    running(gpud, "hi")
    reply = gpud.call("POST", "/v1/serves/hi/sleep", {})
    assert reply.status == 409 and "no sleep_level" in reply.body["error"]["message"]


def test_a_level_two_wake_reloads_the_weights(gpud: SandboxGpud) -> None:
    # level 2 discards the weights: a bare /wake_up would leave the serve "healthy" on
    # uninitialised memory (the stand-in says so, as real vLLM's answers would show)
    gpud.configure(two_sleepers())
    running(gpud, "mid")
    assert checked(gpud, "/v1/serves/{name}/sleep", "mid")["sleep"]["level"] == 2
    state = gpud.standin_state("mid")
    assert (state["sleep_level"], state["weights"], state["sleep_mode"]) == (2, "discarded",
                                                                            "abort")
    woken = checked(gpud, "/v1/serves/{name}/wake", "mid")
    assert woken["state"] == "running"
    state = gpud.standin_state("mid")
    assert (state["sleep_level"], state["weights"]) == (None, "loaded")
    out = gpud.sb.run(["curl", "-s", "http://127.0.0.1:30102/v1/completions", "-H",
                       "content-type: application/json", "-d", '{"prompt": "hi"}']).stdout
    assert "garbage" not in out and "hi" in out, out


def test_host_ram_too_small_for_level_one(gpud: SandboxGpud) -> None:
    gpud.configure(two_sleepers())
    gpud.sb.write_file("/run/gpud/sim.json", json.dumps({"external": [],
                                                         "mem_available_mib": 5000}))
    running(gpud, "lo")
    reply = gpud.call("POST", "/v1/serves/lo/sleep", {})
    assert reply.status == 409, reply.raw
    message = reply.body["error"]["message"]
    assert "host RAM" in message and "MemAvailable is 5000 MiB" in message, message
    assert gpud.serve("lo")["state"] == "running"
    assert gpud.standin_state("lo")["sleep_level"] is None  # never asked to sleep
    # level 2 parks nothing
    reply = gpud.call("POST", "/v1/serves/lo/sleep", {"level": 2})
    assert reply.status == 200, reply.raw
    assert reply.body["parked_host_mib"] == 0


def test_preempt_one_then_wake_back_after_stop(gpud: SandboxGpud) -> None:
    gpud.configure(two_sleepers())
    running(gpud, "lo", "mid")
    # without --preempt: denied, naming what a preemption would do
    reply = gpud.call("POST", "/v1/serves/hi/start", {})
    assert reply.status == 409, reply.raw
    assert "with --preempt gpud would: put to sleep lo" in reply.body["error"]["message"]
    reply = gpud.call("POST", "/v1/serves/hi/admit", {"mib": 16000})
    assert reply.status == 409, reply.raw
    assert "with --preempt gpud would: put to sleep lo" in reply.body["error"]["message"]
    assert reply.body["error"]["details"]["preemption"]["steps"][0]["serve"] == "lo"
    # the dry run shows the plan and changes nothing
    dry = checked(gpud, "/v1/serves/{name}/start", "hi", {"preempt": True, "dry_run": True})
    assert [s["serve"] for s in dry["preemption"]["steps"]] == ["lo"]
    assert reserved(gpud) == {"lo": 12000, "mid": 12000}
    started = checked(gpud, "/v1/serves/{name}/start", "hi", {"preempt": True})
    assert [s["serve"] for s in started["preemption"]["steps"]] == ["lo"]
    gpud.wait_state("hi", "running")
    assert reserved(gpud) == {"lo": 800, "mid": 12000, "hi": 16000}
    assert gpud.serve("lo")["state"] == "sleeping"
    entry = gpud.wait_journal("GPUD_SERVE=lo", "GPUD_EVENT=preempt", unit="gpud.service")[0]
    assert entry["GPUD_PREEMPTED_BY"] == "hi"
    # hi stops: lo wakes back
    assert gpud.call("POST", "/v1/serves/hi/stop", {}).status == 200
    gpud.wait_state("lo", "running")
    assert reserved(gpud) == {"lo": 12000, "mid": 12000}


def test_preempt_two_wake_back_in_priority_order(gpud: SandboxGpud) -> None:
    gpud.configure(two_sleepers())
    running(gpud, "lo", "mid")
    reply = gpud.call("POST", "/v1/serves/big/start", {"preempt": True})
    assert reply.status == 200, reply.raw
    assert [s["serve"] for s in reply.body["preemption"]["steps"]] == ["lo", "mid"]
    gpud.wait_state("big", "running")
    assert reserved(gpud) == {"lo": 800, "mid": 800, "big": 26000}
    assert gpud.call("POST", "/v1/serves/big/stop", {}).status == 200
    gpud.wait_state("lo", "running")
    gpud.wait_state("mid", "running")
    woken = [e["serve"] for e in gpud.events(kind="wake")]
    assert woken == ["mid", "lo"]  # mid's priority (40) before lo's (50)


def test_failed_preemption_restores_everything(gpud: SandboxGpud) -> None:
    # mid says it sleeps (sleep_level) but its server was started without sleep mode: its
    # /sleep fails after lo was already put to sleep.
    gpud.configure(two_sleepers(mid_sleeps=False))
    running(gpud, "lo", "mid")
    failed = checked(gpud, "/v1/serves/{name}/start", "big", {"preempt": True}, status=409)
    message = failed["error"]["message"]
    assert "mid could not be preempted" in message and "undone: wake lo" in message, message
    assert gpud.serve("lo")["state"] == "running"
    assert gpud.serve("mid")["state"] == "running"
    assert gpud.serve("big")["state"] in ("declared", "denied")
    assert reserved(gpud) == {"lo": 12000, "mid": 12000}
    assert "gpud-serve-big.service" not in gpud.serve_units()
    assert gpud.standin_state("lo")["sleep_level"] is None


def test_gpud_restarted_during_sleep_adopts_it_asleep(gpud: SandboxGpud) -> None:
    gpud.configure(two_sleepers())
    running(gpud, "lo")
    assert gpud.call("POST", "/v1/serves/lo/sleep", {}).status == 200
    pid = gpud.unit_prop("gpud-serve-lo.service", "MainPID")
    gpud.sb.run(["systemctl", "restart", "gpud.service"], timeout=60)
    view = gpud.wait_state("lo", "sleeping")
    assert view["reserved_mib"] == 800
    assert gpud.unit_prop("gpud-serve-lo.service", "MainPID") == pid
    assert len(gpud.events(kind="adopt", serve="lo")) == 1
    reply = gpud.call("POST", "/v1/serves/lo/wake", {})
    assert reply.status == 200, reply.raw
    assert reserved(gpud) == {"lo": 12000}


def test_serve_that_dies_asleep(gpud: SandboxGpud) -> None:
    gpud.configure(two_sleepers())
    running(gpud, "lo")
    assert gpud.call("POST", "/v1/serves/lo/sleep", {}).status == 200
    gpud.sb.run(["systemctl", "kill", "--signal=KILL", "gpud-serve-lo.service"])
    view = gpud.wait_state("lo", "failed")
    assert "exited while asleep" in view["reason"]
    assert reserved(gpud) == {}
    # not restarted by systemd behind the ledger's back
    assert "gpud-serve-lo.service" not in gpud.serve_units()


def test_concurrent_preempting_starts_on_one_role(gpud: SandboxGpud) -> None:
    gpud.configure(two_sleepers())
    running(gpud, "lo", "mid")
    replies: dict[str, Reply] = {}

    def start(name: str) -> None:
        replies[name] = gpud.call("POST", f"/v1/serves/{name}/start", {"preempt": True})

    threads = [threading.Thread(target=start, args=(n,)) for n in ("hi", "hi2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = sorted(r.status for r in replies.values())
    # whichever came first took lo; the other would need mid and more: denied
    assert statuses == [200, 409], {n: r.raw for n, r in replies.items()}
    held = reserved(gpud)
    assert held["lo"] == 800 and held["mid"] == 12000
    sleeps = [e["serve"] for e in gpud.events(kind="sleep")]
    assert sorted(sleeps) == sorted(set(sleeps))  # no serve put to sleep twice


def test_gpuctl_sleep_wake_and_start_preempt(gpud: SandboxGpud) -> None:
    from tests.integration.test_invariant import gpuctl

    gpud.configure(two_sleepers())
    running(gpud, "lo", "mid")
    denied = gpuctl(gpud, "start", "hi")
    assert denied.returncode == 1, denied.stderr
    assert "with --preempt gpud would: put to sleep lo (priority 50)" in denied.stderr
    dry = gpuctl(gpud, "start", "hi", "--preempt", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines()[0].startswith("preempt for hi (priority 10): need 16000 MiB")
    assert "  1. put to sleep lo (priority 50): frees 11200 MiB; undo: wake" in dry.stdout
    assert dry.stdout.rstrip().endswith("dry run: nothing changed")
    started = gpuctl(gpud, "start", "hi", "--preempt")
    assert started.returncode == 0, started.stderr
    assert "1. put to sleep lo" in started.stdout and "hi: running" in started.stdout
    table = gpuctl(gpud, "serves").stdout
    assert "lo (sleeping): asleep (level 1, preempted by hi); 12000 MiB parked in host RAM" \
        in table, table
    # no room to wake lo while hi runs: denied, still asleep
    woken = gpuctl(gpud, "wake", "lo")
    assert woken.returncode == 1 and "denied" in woken.stderr, woken.stderr
    assert gpud.serve("lo")["state"] == "sleeping"
    assert gpuctl(gpud, "sleep", "mid", "--level", "2").returncode == 0
    assert gpud.serve("mid")["reserved_mib"] == 800


def test_boot_preemption_puts_lower_priorities_to_sleep(gpud: SandboxGpud) -> None:
    daemon = "preempt_at_boot = true"
    gpud.configure(two_sleepers(daemon=daemon))
    running(gpud, "lo", "mid")
    gpud.sb.run(["systemctl", "stop", "gpud.service"], timeout=60)
    # hi becomes resident while gpud is away; lo and mid keep running
    config = two_sleepers(daemon=daemon).replace(
        'priority = 10\nport = 30103\n', 'priority = 10\nport = 30103\nresident = true\n')
    assert "resident = true" in config
    gpud.sb.install_gpud(REPO, config)
    gpud.start()
    gpud.wait_state("hi", "running")
    assert gpud.serve("lo")["state"] == "sleeping"
    assert gpud.serve("mid")["state"] == "running"
    assert reserved(gpud) == {"lo": 800, "mid": 12000, "hi": 16000}
    preempt = gpud.events(kind="preempt")
    assert [(e["serve"], e["details"]["preempted_by"]) for e in preempt] == [("lo", "hi")]


def test_sleep_mib_measured_when_not_configured(gpud: SandboxGpud) -> None:
    config = sim_config(ROLE, serve("meas", 12000, 50, 30106, level=2, sleep_mib=None,
                                    asleep=600))
    gpud.configure(config)
    running(gpud, "meas")
    reply = gpud.call("POST", "/v1/serves/meas/sleep", {})
    assert reply.status == 200, reply.raw
    # measured after the sleep (600 MiB) plus the overdraw tolerance (256)
    assert reply.body["reserved_mib"] == 856
    ev = gpud.events(kind="sleep", serve="meas")[-1]
    assert ev["details"]["observed_mib"] == 600
    assert gpud.call("POST", "/v1/serves/meas/wake", {}).status == 200
    # the next sleep goes by the measurement kept in the store
    reply = gpud.call("POST", "/v1/serves/meas/sleep", {})
    assert reply.status == 200 and reply.body["reserved_mib"] == 856


def test_preemptible_stop_and_admit_with_preempt(gpud: SandboxGpud) -> None:
    config = sim_config(ROLE, serve("lo", 12000, 50, 30101, level=1)
                        + serve("st", 12000, 60, 30107) + 'preemptible = "stop"\n'
                        + serve("hi", 16000, 10, 30103))
    gpud.configure(config)
    running(gpud, "lo", "st")
    # admit alone (no launch) with preempt: st, the least important, is stopped
    dry = checked(gpud, "/v1/serves/{name}/admit", "hi", {"mib": 16000, "dry_run": True,
                                                            "preempt": True})
    assert dry["fits"] is True
    assert [(s["serve"], s["action"]) for s in dry["preemption"]["steps"]] == [("st", "stop")]
    admitted = checked(gpud, "/v1/serves/{name}/admit", "hi", {"mib": 16000, "preempt": True})
    assert admitted["mib"] == 16000 and admitted["figures"]["free_mib"] == 3607
    assert gpud.serve("st")["state"] == "declared"
    assert "gpud-serve-st.service" not in gpud.serve_units()
    assert reserved(gpud) == {"lo": 12000, "hi": 16000}
    ev = gpud.events(kind="preempt")[-1]
    assert (ev["serve"], ev["details"]["action"], ev["details"]["preempted_by"]) == (
        "st", "stop", "hi")
    assert gpud.metrics("gpud_preemptions_total") == [({}, 1)]


def test_preempted_serve_wakes_after_a_restart_once_its_preempter_is_gone(
        gpud: SandboxGpud) -> None:
    gpud.configure(two_sleepers())
    running(gpud, "lo", "mid")
    assert gpud.call("POST", "/v1/serves/hi/start", {"preempt": True}).status == 200
    gpud.wait_state("hi", "running")
    assert gpud.serve("lo")["state"] == "sleeping"
    gpud.sb.run(["systemctl", "stop", "gpud.service"], timeout=60)
    gpud.sb.run(["systemctl", "stop", "gpud-serve-hi.service"], timeout=60)
    gpud.start()
    # hi's unit ended while gpud was away: its reservation goes, and lo fits again
    view = gpud.wait_state("lo", "running")
    assert view["reserved_mib"] == 12000
    assert gpud.serve("hi")["state"] in ("failed", "declared")
    assert reserved(gpud) == {"lo": 12000, "mid": 12000}
    woken = [e for e in gpud.events(kind="wake", serve="lo")]
    assert woken and woken[-1]["details"]["by"] == "wake-back: memory released"


def test_restart_of_a_sleeping_serve_starts_it_at_its_vram_mib(gpud: SandboxGpud) -> None:
    # A restart keeps a reservation the launch is sized on; asleep that is its sleep one (800
    # MiB), which must not size the new process: it is admitted again at vram_mib.
    gpud.configure(two_sleepers())
    running(gpud, "lo")
    checked(gpud, "/v1/serves/{name}/sleep", "lo")
    assert reserved(gpud) == {"lo": 800}
    reply = gpud.call("POST", "/v1/serves/lo/restart", {})
    assert reply.status == 200, reply.raw
    gpud.wait_state("lo", "running")
    assert reserved(gpud) == {"lo": 12000}
    assert gpud.serve("lo")["parked_host_mib"] is None
    # asleep again, it is noted afresh (not what the earlier sleep noted)
    checked(gpud, "/v1/serves/{name}/sleep", "lo")
    woken = checked(gpud, "/v1/serves/{name}/wake", "lo")
    assert woken["reserved_mib"] == 12000
