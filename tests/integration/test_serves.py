"""gpud under real systemd in the sandbox: the resident set, adoption, arguments, restarts,
crash loops, per-device serialization, stop/release. Stand-in serves, simulated GPU."""

from __future__ import annotations

import time

from tests.integration.gpudctl import STANDIN, SandboxGpud, sim_config, standin

DARK_FAST = """
[roles.dark-fast]
device = "GPU-sim-0"
reserve_mib = 7168
"""


def t015_serves(**extra: str) -> str:
    out = []
    for prio, (name, mib, port) in enumerate((("fast", 18432, 30001), ("embeddings", 3200, 30003),
                                              ("reranker", 3456, 30004), ("ocr", 5120, 30007))):
        out.append(f'[serves.{name}]\nrole = "dark-fast"\nvram_mib = {mib}\nresident = true\n'
                   f"priority = {(prio + 1) * 10}\nport = {port}\n"
                   f"command = {standin(*extra.get(name, '').split())}\n")
    return "\n".join(out)


def test_resident_set_fourth_denied(gpud: SandboxGpud) -> None:
    gpud.configure(sim_config(DARK_FAST, t015_serves()))
    for name in ("fast", "embeddings", "reranker"):
        gpud.wait_state(name, "running")
    ocr = gpud.wait_state("ocr", "denied")
    assert ocr["reason"] == "ledger bound: need 5120 MiB, free 351 MiB, short 4769 MiB"
    assert gpud.serve_units() == ["gpud-serve-embeddings.service", "gpud-serve-fast.service",
                                  "gpud-serve-reranker.service"]
    entries = gpud.wait_journal("GPUD_SERVE=ocr", "GPUD_EVENT=deny", unit="gpud.service")
    assert entries[0]["GPUD_NEED_MIB"] == "5120"
    assert entries[0]["GPUD_FREE_MIB"] == "351"
    assert entries[0]["GPUD_SHORTFALL_MIB"] == "4769"
    status = gpud.unit_prop("gpud.service", "StatusText")
    assert "3 running" in status and "1 denied" in status


def test_restart_gpud_keeps_serves(gpud: SandboxGpud) -> None:
    gpud.configure(sim_config(DARK_FAST, t015_serves()))
    for name in ("fast", "embeddings", "reranker"):
        gpud.wait_state(name, "running")
    gpud.wait_state("ocr", "denied")
    pids = {u: gpud.unit_prop(u, "MainPID") for u in gpud.serve_units()}
    ledger = gpud.get("/v1/ledger")["roles"][0]
    gpud.sb.run(["systemctl", "restart", "gpud.service"], timeout=60)
    for name in ("fast", "embeddings", "reranker"):
        gpud.wait_state(name, "running")
    assert {u: gpud.unit_prop(u, "MainPID") for u in gpud.serve_units()} == pids
    after = gpud.get("/v1/ledger")["roles"][0]
    assert [(r["serve"], r["mib"]) for r in after["reservations"]] == \
        [(r["serve"], r["mib"]) for r in ledger["reservations"]]
    assert after["committed_mib"] == 25088
    assert len(gpud.events(kind="adopt")) == 3
    assert len(gpud.events(kind="start")) == 3  # nothing was started a second time


def test_arguments_reach_the_process_literally(gpud: SandboxGpud) -> None:
    # "{{x}}" is the config's escape for literal braces (placeholders use {port} etc).
    hostile = ["$HOME", "a;b", "%n", "two words", "it's \"quoted\"", "$(id)", "`id`", "{{x}}"]
    expected = [*hostile[:-1], "{x}"]
    cmd = standin("--echo-argv", "--note")[:-1] + ", " + ", ".join(
        '"' + h.replace("\\", "\\\\").replace('"', '\\"') + '"' for h in hostile) + "]"
    serves = f'[serves.lit]\nrole = "dark-fast"\nvram_mib = 1000\nport = 30010\ncommand = {cmd}\n'
    gpud.configure(sim_config(DARK_FAST, serves))
    reply = gpud.call("POST", "/v1/serves/lit/start", {})
    assert reply.status == 200, reply.raw
    gpud.wait_state("lit", "running")
    out = gpud.sb.run(["curl", "-s", "http://127.0.0.1:30010/standin/argv"]).stdout
    import json

    argv = json.loads(out)["argv"]
    assert argv[-len(expected):] == expected
    env = json.loads(out)["env"]
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    # systemd re-reads transient units at daemon-reload; the next restart must run the same argv.
    pid = gpud.unit_prop("gpud-serve-lit.service", "MainPID")
    gpud.sb.run(["systemctl", "daemon-reload"])
    gpud.sb.run(["kill", "-9", pid])
    gpud.wait_event("restart", serve="lit")
    gpud.wait_state("lit", "running")
    out = gpud.sb.run(["curl", "-s", "http://127.0.0.1:30010/standin/argv"]).stdout
    assert json.loads(out)["argv"][-len(expected):] == expected


def test_killed_serve_restarts_and_crash_loop_stops(gpud: SandboxGpud) -> None:
    serves = (f'[serves.steady]\nrole = "dark-fast"\nvram_mib = 1000\nport = 30011\n'
              f'restart_sec = 0.2\ncommand = {standin()}\n'
              f'[serves.flaky]\nrole = "dark-fast"\nvram_mib = 1000\nport = 30012\n'
              f'restart_sec = 0.2\ncommand = {standin("--crash-after", "0.5")}\n')
    gpud.configure(sim_config(DARK_FAST, serves, daemon="crash_loop_restarts = 3\n"
                                                       "crash_loop_window_s = 30"))
    assert gpud.call("POST", "/v1/serves/steady/start", {}).status == 200
    gpud.wait_state("steady", "running")
    pid = gpud.unit_prop("gpud-serve-steady.service", "MainPID")
    t0 = time.monotonic()
    gpud.sb.run(["kill", "-9", pid])
    ev = gpud.wait_event("restart", serve="steady")
    detected = time.monotonic() - t0
    assert ev["details"]["n_restarts"] == 1
    assert gpud.wait_state("steady", "running")["main_pid"] != int(pid)
    assert detected < 5

    assert gpud.call("POST", "/v1/serves/flaky/start", {}).status == 200
    failed = gpud.wait_state("flaky", "failed", timeout=40)
    assert failed["reason"].startswith("crash-loop:")
    assert "gpud-serve-flaky.service" not in gpud.serve_units()
    loop = gpud.events(kind="crash-loop", serve="flaky")
    assert len(loop) == 1 and loop[0]["details"]["reservation"] == "released"
    assert failed["reserved_mib"] is None


def test_starts_serialized_per_device_parallel_across(gpud: SandboxGpud) -> None:
    roles = DARK_FAST + '\n[roles.other]\ndevice = "GPU-sim-1"\nreserve_mib = 0\n'
    serves = ""
    for name, role, prio, port in (("a1", "dark-fast", 1, 30021), ("a2", "dark-fast", 2, 30022),
                                   ("b1", "other", 1, 30023)):
        serves += (f'[serves.{name}]\nrole = "{role}"\nvram_mib = 1000\nresident = true\n'
                   f"priority = {prio}\nport = {port}\n"
                   f"command = {standin('--startup-delay', '1.5')}\n")
    gpud.configure(sim_config(roles, serves, devices=2))
    for name in ("a1", "a2", "b1"):
        gpud.wait_state(name, "running")
    ts = {(e["kind"], e["serve"]): e["ts"] for e in gpud.events()
          if e["kind"] in ("start", "healthy")}
    # a2 starts only once a1 answered its health check: same device.
    assert ts[("healthy", "a1")] <= ts[("start", "a2")]
    # b1, on the other device, did not wait for a1.
    assert ts[("start", "b1")] < ts[("healthy", "a1")]


def test_stop_releases_and_unfit_start_launches_nothing(gpud: SandboxGpud) -> None:
    gpud.configure(sim_config(DARK_FAST, t015_serves()))
    for name in ("fast", "embeddings", "reranker"):
        gpud.wait_state(name, "running")
    gpud.wait_state("ocr", "denied")
    reply = gpud.call("POST", "/v1/serves/ocr/start", {})
    assert reply.status == 409 and reply.body["error"]["code"] == "denied"
    assert "gpud-serve-ocr.service" not in gpud.serve_units()
    # Release of a running serve is refused unless it is stopped in the same request.
    reply = gpud.call("POST", "/v1/serves/reranker/release", {})
    assert reply.status == 409 and "--stop" in reply.body["error"]["message"]
    reply = gpud.call("POST", "/v1/serves/reranker/stop", {})
    assert reply.status == 200, reply.raw
    assert "gpud-serve-reranker.service" not in gpud.serve_units()
    assert gpud.serve("reranker")["reserved_mib"] is None
    assert gpud.get("/v1/ledger")["roles"][0]["free_mib"] == 351 + 3456
    reply = gpud.call("POST", "/v1/serves/embeddings/release", {"stop": True})
    assert reply.status == 200 and reply.body["released_mib"] == 3200
    assert "gpud-serve-embeddings.service" not in gpud.serve_units()
    # Now ocr fits: start admits and launches it.
    assert gpud.call("POST", "/v1/serves/ocr/start", {}).status == 200
    gpud.wait_state("ocr", "running")


def test_running_serve_that_fails_health_is_restarted_then_crash_loops(gpud: SandboxGpud) -> None:
    serves = (f'[serves.wobbly]\nrole = "dark-fast"\nvram_mib = 1000\nresident = true\n'
              f'port = 30013\ncommand = {standin("--unhealthy-after", "3")}\n')
    gpud.configure(sim_config(DARK_FAST, serves, daemon="health_failures = 2\n"
                                                       "crash_loop_restarts = 1\n"
                                                       "crash_loop_window_s = 60"))
    gpud.wait_state("wobbly", "running")
    # Unhealthy: restarted through its unit (not left running as `failed`), reservation kept.
    first = gpud.wait_event("unhealthy", serve="wobbly")
    assert first["message"].startswith("wobbly: unhealthy: 2 health checks in a row failed")
    assert first["details"]["reservation"] == "kept (restarting)"
    # Unhealthy again within the window: a crash loop; the unit is stopped.
    failed = gpud.wait_state("wobbly", "failed", timeout=30)
    assert failed["reason"].startswith("crash-loop: 2 restarts"), failed
    # A resident serve keeps its reservation when it fails; the event says so.
    assert failed["reserved_mib"] == 1000
    assert "gpud-serve-wobbly.service" not in gpud.serve_units()
    ev = gpud.events(kind="crash-loop", serve="wobbly")
    assert len(ev) == 1 and ev[0]["details"]["reservation"] == "kept (resident)"


def test_socket_activation_and_memory_back_after_stop(gpud: SandboxGpud) -> None:
    """gpud.socket holds the socket; gpud takes it from LISTEN_FDS when started by it."""
    serves = (f'[serves.one]\nrole = "dark-fast"\nvram_mib = 2000\nport = 30014\n'
              f'stop_timeout_s = 5\ncommand = {standin("--draw-in-child")}\n')
    gpud.configure(sim_config(DARK_FAST, serves), start=False)
    gpud.sb.run(["systemctl", "start", "gpud.socket"])
    try:
        assert gpud.unit_prop("gpud.service", "ActiveState") == "inactive"
        # The first connection starts gpud (socket activation).
        assert gpud.get("/v1/status")["version"]
        deadline = time.monotonic() + 20
        while not gpud.get("/v1/status")["ready"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gpud.unit_prop("gpud.service", "ActiveState") == "active"
        mode = gpud.sb.run(["stat", "-c", "%a %U %G", "/run/gpud/gpud.sock"]).stdout.split()
        assert mode == ["660", "root", "gpud"]
        assert gpud.call("POST", "/v1/serves/one/start", {}).status == 200
        gpud.wait_state("one", "running")
        assert gpud.call("POST", "/v1/serves/one/stop", {}).status == 200
        assert gpud.serve("one")["reserved_mib"] is None
        # Start again at once: gpud waits until observation shows the memory back. gpuctl
        # start waits until the serve is healthy.
        import subprocess
        import sys

        out = subprocess.run([sys.executable, "-m", "gpud.ctl", "--socket", str(gpud.socket),
                              "start", "one"], capture_output=True, text=True, check=False,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("one: running on dark-fast")
        starts = gpud.events(kind="start", serve="one")
        assert len(starts) == 2
    finally:
        gpud.sb.run(["systemctl", "stop", "gpud.socket"], check=False)


def test_a_vllm_serve_whose_engine_died_is_restarted_after_its_exit_0(gpud: SandboxGpud) -> None:
    # vLLM's server exits 0 once its engine died: Restart=on-failure took that for a clean
    # exit and left the serve exited, its reservation held. Here the exit comes before any
    # health check sees the 503 (--exit-after-engine-death 0): the unit restarts it (always).
    wrapper = "/usr/local/bin/vllm-standin-dies"
    serves = ('[serves.gen]\nrole = "dark-fast"\nvram_mib = 4096\nport = 30034\n'
              'restart_sec = 0.2\n[serves.gen.vllm]\nmodel = "org/gen"\n')
    gpud.configure(sim_config(DARK_FAST, serves, daemon=f'vllm_executable = "{wrapper}"\n'
                              "health_failures = 100"), start=False)
    gpud.sb.write_file(wrapper, f'#!/bin/sh\nexec {" ".join(STANDIN)} "$@" '
                                "--exit-after-engine-death 0\n", mode=0o755)
    gpud.start()
    assert gpud.call("POST", "/v1/serves/gen/start", {}).status == 200
    gpud.wait_state("gen", "running")
    assert gpud.unit_prop("gpud-serve-gen.service", "Restart") == "always"
    pid = gpud.unit_prop("gpud-serve-gen.service", "MainPID")
    engine = gpud.sb.run(["pgrep", "-P", pid, "-x", "VLLM::EngineCor"]).stdout.split()
    assert len(engine) == 1
    gpud.sb.run(["kill", "-9", engine[0]])
    gpud.wait_event("restart", serve="gen")
    view = gpud.wait_state("gen", "running")
    assert view["main_pid"] != int(pid) and view["reserved_mib"] == 4096
    assert gpud.unit_prop("gpud-serve-gen.service", "NRestarts") == "1"
