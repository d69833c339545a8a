"""Figures 4 and 5, under real systemd in the disposable sandbox (tools/sandbox.py), with stand-in
serves (`python -m gpud.testing.standin`) on a simulated GPU.

4. Boot overhead per serve: 8 resident stand-ins, 4 per device on 2 simulated devices, each with
   a configured `--startup-delay`. From `systemctl start gpud` (the time `date` prints inside the
   sandbox just before it execs systemctl) to the last `healthy` event gpud records, minus the
   delays of the longest device chain (starts are serialized per device: 4 x delay), divided by
   8. It includes everything that is not the serves' own configured delay: systemd starting gpud,
   gpud's start-up and reconciliation, the transient units, each stand-in's interpreter start,
   health polling (0.1 s while starting) and the hand-off to the next serve on the device.
5. Detection latency: `kill -9` of a serve's MainPID inside the sandbox (the time is read by the
   killing process right before kill(2)) to the ts of the first `exit`/`restart` event gpud
   records for it. The sandbox shares the host kernel's clock, and gpud's ts is time.time().
"""

from __future__ import annotations

import itertools
import json
import os
import time
from typing import Any

from bench.common import PY, REPO, FigureResult, Row, call, median, pct, spread, verdict
from tools.sandbox import SYSTEMD, Sandbox

DEVICES = 2
SERVES = 8
STARTUP_DELAY_S = 0.5
TARGET_WORK_MS = 75.0  # per serve, once gpud runs
TARGET_BOOT_MS = 150.0
TARGET_DETECT_S = 1.0
KILL = ("import os, sys, time\n"
        "pid = int(sys.argv[1])\n"
        "t = time.time()\n"
        "os.kill(pid, 9)\n"
        "print(repr(t))\n")
# Run inside the sandbox: how long a stand-in alone takes from spawn to its first 200 on /health
# (no systemd, no gpud), so that part of the boot overhead can be told apart from gpud's.
STANDIN_ALONE = """
import json, os, socket, subprocess, sys, time
out = []
for _ in range(int(sys.argv[1])):
    probe = socket.socket(); probe.bind(("127.0.0.1", 0)); port = probe.getsockname()[1]; probe.close()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUD_SIM_")}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "gpud.testing.standin", "--port", str(port),
                             "--gpu-memory-utilization", "0.05"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while time.monotonic() - t0 < 20:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as c:
                c.sendall(b"GET /health HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n")
                if c.recv(64).split()[1:2] == [b"200"]:
                    break
        except OSError:
            pass
        time.sleep(0.005)
    out.append((time.monotonic() - t0) * 1000)
    proc.terminate(); proc.wait()
print(json.dumps(out))
"""


def sandbox_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "the systemd sandbox needs root (namespaces, mounts, cgroups)"
    if not os.path.exists(SYSTEMD):
        return f"no systemd at {SYSTEMD}"
    return None


def config() -> str:
    lines = ["[daemon]", "crash_loop_restarts = 1000", "crash_loop_window_s = 60", ""]
    for d in range(DEVICES):
        lines += [f"[roles.dev{d}]", f'device = "GPU-sim-{d}"', "reserve_mib = 0", ""]
    # PYTHONPATH: a serve unit runs from /, where `import gpud` finds the interpreter's checkout.
    command = json.dumps(["/usr/bin/env", f"PYTHONPATH={REPO}", PY, "-m", "gpud.testing.standin",
                          "--port", "{port}", "--gpu-memory-utilization",
                          "{gpu_memory_utilization}", "--startup-delay", str(STARTUP_DELAY_S)])
    for k in range(SERVES):
        lines += [f"[serves.s{k}]", f'role = "dev{k % DEVICES}"', "vram_mib = 2000",
                  "resident = true", f"priority = {10 + k}", f"port = {30100 + k}",
                  "restart_sec = 0.2", f"command = {command}", ""]
    lines += ["[simulation]", 'state_file = "/run/gpud/sim.json"']
    for d in range(DEVICES):
        lines += ["[[simulation.devices]]", f'uuid = "GPU-sim-{d}"', "total_mib = 32607"]
    return "\n".join(lines) + "\n"


class Bench:
    def __init__(self, sb: Sandbox) -> None:
        self.sb = sb
        self.sock = sb.host_path("/run/gpud/gpud.sock")

    def get(self, path: str) -> Any:
        status, body = call(self.sock, "GET", path)
        if status != 200:
            raise RuntimeError(f"GET {path}: {status} {body}")
        return body

    def reset(self) -> None:
        self.sb.run(["systemctl", "stop", "gpud.service"], check=False, timeout=60)
        self.sb.run("systemctl stop 'gpud-serve-*'; systemctl reset-failed 'gpud-serve-*' gpud.service;"
                    " rm -rf /var/lib/gpud /run/gpud/sim.json /run/gpud/sim-procs", check=False,
                    timeout=60)
        self.sb.run(["mkdir", "-p", "/run/gpud"])
        self.sb.write_file("/run/gpud/sim.json", json.dumps({"external": []}))

    def journal_tail(self) -> str:
        return str(self.sb.run("journalctl -u gpud -u 'gpud-serve-*' --no-pager | tail -30",
                               check=False).stdout)

    def wait_all(self, state: str, timeout: float) -> dict[str, dict[str, Any]]:
        deadline = time.monotonic() + timeout
        serves: dict[str, dict[str, Any]] = {}
        while time.monotonic() < deadline:
            serves = {s["name"]: s for s in self.get("/v1/serves")["serves"]}
            if len(serves) == SERVES and all(s["state"] == state for s in serves.values()):
                return serves
            time.sleep(0.1)
        states = {n: s["state"] for n, s in serves.items()}
        raise RuntimeError(f"not all {state} after {timeout:.0f} s: {states}\n{self.journal_tail()}")

    def boot_once(self) -> dict[str, Any]:
        self.reset()
        out = self.sb.run("date +%s.%N && exec systemctl start gpud.service", timeout=60,
                          check=False)
        if out.returncode != 0:
            raise RuntimeError(f"gpud did not start: {out.stderr}\n{self.journal_tail()}")
        t0 = float(out.stdout.split()[0])
        self.wait_all("running", 60)
        events = self.get("/v1/events?limit=10000")["events"]
        started_at = float(self.get("/v1/status")["started_at"])
        start = {e["serve"]: e["ts"] for e in events if e["kind"] == "start"}
        healthy = {e["serve"]: e["ts"] for e in events if e["kind"] == "healthy"}
        if len(healthy) != SERVES or len(start) != SERVES:
            raise RuntimeError(f"expected {SERVES} start and healthy events, got {len(start)} "
                               f"and {len(healthy)}")
        chain = (SERVES // DEVICES) * STARTUP_DELAY_S
        total = max(healthy.values()) - t0
        launch = [healthy[s] - start[s] - STARTUP_DELAY_S for s in start]
        handoff = []
        for d in range(DEVICES):
            names = sorted((s for s in start if int(s[1:]) % DEVICES == d), key=lambda name: start[name])
            handoff += [start[b] - healthy[a] for a, b in itertools.pairwise(names)]
        return {
            "total_s": total,
            "per_serve_ms": (total - chain) / SERVES * 1000,
            # Without gpud's own start (interpreter, imports, reconciliation): what each serve
            # adds once gpud runs.
            "per_serve_work_ms": (total - (min(start.values()) - t0) - chain) / SERVES * 1000,
            "to_gpud_started_s": started_at - t0,
            "to_first_start_s": min(start.values()) - t0,
            "launch_to_healthy_minus_delay_ms": [x * 1000 for x in launch],
            "handoff_ms": [x * 1000 for x in handoff],
        }

    def standin_alone(self, n: int) -> list[float]:
        out = self.sb.run([PY, "-c", STANDIN_ALONE, str(n)], timeout=120,
                          env={"PYTHONPATH": str(REPO)})
        return list(json.loads(out.stdout))

    def kill_once(self, serve: str) -> dict[str, Any]:
        unit = f"gpud-serve-{serve}.service"
        pid = self.sb.run(["systemctl", "show", "-p", "MainPID", "--value", unit]).stdout.strip()
        if not pid or pid == "0":
            raise RuntimeError(f"{unit} has no MainPID")
        newest = self.get("/v1/events?limit=1")["events"]
        last_id = newest[-1]["id"] if newest else 0
        t_kill = float(self.sb.run([PY, "-c", KILL, pid]).stdout.strip())
        deadline = time.monotonic() + 10
        seen: dict[str, float] = {}
        while time.monotonic() < deadline and "restart" not in seen:
            for ev in self.get(f"/v1/events?serve={serve}&kind=exit&kind=restart&limit=20")["events"]:
                if ev["id"] > last_id and ev["kind"] not in seen:
                    seen[ev["kind"]] = ev["ts"] - t_kill
            time.sleep(0.02)
        if not seen:
            raise RuntimeError(f"no exit/restart event for {serve} 10 s after kill -9 {pid}\n"
                               f"{self.journal_tail()}")
        # back to running (a new MainPID) before the next kill
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            st = self.get(f"/v1/serves/{serve}")
            if st["state"] == "running" and st["main_pid"] not in (None, int(pid)):
                break
            time.sleep(0.05)
        else:
            raise RuntimeError(f"{serve} did not come back after the kill: {st}")
        return {"pid": int(pid), "first_s": min(seen.values()), **{f"{k}_s": v for k, v in seen.items()}}


def run(quick: bool, only: set[str]) -> list[FigureResult]:
    boot_fig = FigureResult("boot", "boot overhead per serve under real systemd")
    detect_fig = FigureResult("detection", "detection latency of a killed serve")
    wanted = [f for f in (boot_fig, detect_fig) if f.name in only]
    reason = sandbox_unavailable()
    if reason is not None:
        for fig in wanted:
            fig.problem(f"not measured: {reason}")
            fig.rows.append(Row(f"{'4' if fig is boot_fig else '5'}. {fig.title}", "not measured",
                                "", f"skipped: {reason}"))
        return wanted
    boots = 1 if quick else 5
    kills = 5 if quick else 10
    sb = Sandbox(name="gpud-bench")
    try:
        t = time.monotonic()
        sb.boot()
        print(f"  sandbox booted in {time.monotonic() - t:.1f} s", flush=True)
        bench = Bench(sb)
        bench.reset()
        sb.install_gpud(REPO, config())
        boot_runs: list[dict[str, Any]] = []
        alone: list[float] = []
        if "boot" in only:
            for i in range(boots):
                alone += bench.standin_alone(2)
                result = bench.boot_once()
                boot_runs.append(result)
                print(f"  boot {i + 1}/{boots}: all {SERVES} healthy {result['total_s']:.2f} s after "
                      f"systemctl start; {result['per_serve_ms']:.0f} ms/serve overhead", flush=True)
        kill_runs: list[dict[str, Any]] = []
        if "detection" in only:
            if not boot_runs:
                bench.boot_once()
            for k in range(kills):
                serve = f"s{(k * 3) % SERVES}"
                result = bench.kill_once(serve)
                kill_runs.append(result)
                print(f"  kill {k + 1}/{kills} ({serve}, pid {result['pid']}): first event after "
                      f"{result['first_s'] * 1000:.0f} ms", flush=True)
        bench.reset()
    finally:
        sb.poweroff()

    if boot_runs:
        per = [r["per_serve_ms"] for r in boot_runs]
        chain = (SERVES // DEVICES) * STARTUP_DELAY_S
        boot_fig.note(f"{boots} boot(s) of {SERVES} resident stand-ins on {DEVICES} devices, "
                      f"startup delay {STARTUP_DELAY_S:g} s each (chain {chain:g} s)")
        totals = [r["total_s"] for r in boot_runs]
        to_started = [r["to_gpud_started_s"] * 1000 for r in boot_runs]
        to_first = [r["to_first_start_s"] * 1000 for r in boot_runs]
        launch = [x for r in boot_runs for x in r["launch_to_healthy_minus_delay_ms"]]
        handoff = [x for r in boot_runs for x in r["handoff_ms"]]
        boot_fig.note(f"systemctl start -> last healthy: {spread(totals, '{:.2f}')} s")
        boot_fig.note(f"overhead per serve: {spread(per, '{:.0f}')} ms")
        boot_fig.note(f"breakdown: systemctl start -> gpud's started_at {spread(to_started, '{:.0f}')} ms")
        boot_fig.note(f"breakdown: systemctl start -> first serve start {spread(to_first, '{:.0f}')} ms")
        boot_fig.note(f"breakdown: start event -> healthy event, minus the delay: "
                      f"{spread(launch, '{:.0f}')} ms")
        boot_fig.note(f"breakdown: healthy -> next start on the same device: "
                      f"{spread(handoff, '{:.1f}')} ms")
        boot_fig.note(f"reference: a stand-in alone (spawned inside the sandbox without systemd or "
                      f"gpud, delay 0) answers 200 on /health after {spread(alone, '{:.0f}')} ms")
        boot_fig.note(f"so per serve, the stand-ins' own start accounts for about "
                      f"{median(alone) * (SERVES // DEVICES) / SERVES:.0f} ms of the "
                      f"{median(per):.0f} ms (the longest chain starts {SERVES // DEVICES} of them "
                      "one after the other)")
        work = [r["per_serve_work_ms"] for r in boot_runs]
        boot_fig.note(f"per serve without gpud's own start (first serve start -> last healthy, "
                      f"minus the chain, / {SERVES}): {spread(work, '{:.0f}')} ms")
        boot_fig.raw = {"runs": boot_runs, "standin_alone_ms": alone}
        boot_fig.rows.append(Row(f"4. boot overhead per serve (N={SERVES}, {DEVICES} devices)",
                                 f"{median(per):.0f} ms (range {min(per):.0f}-{max(per):.0f})",
                                 f"<= {TARGET_BOOT_MS:g} ms", verdict(median(per), TARGET_BOOT_MS)))
        boot_fig.rows.append(Row("4. gpud's own start (systemctl start -> first serve start)",
                                 f"{median(to_first):.0f} ms", "(info)", "info"))
        boot_fig.rows.append(Row("4. per-serve work, gpud's own start apart",
                                 f"{median(work):.0f} ms (range {min(work):.0f}-{max(work):.0f})",
                                 f"<= {TARGET_WORK_MS:g} ms", verdict(median(work), TARGET_WORK_MS)))
    if kill_runs:
        first = [r["first_s"] * 1000 for r in kill_runs]
        exits = [r["exit_s"] * 1000 for r in kill_runs if "exit_s" in r]
        restarts = [r["restart_s"] * 1000 for r in kill_runs if "restart_s" in r]
        detect_fig.note(f"{kills} kill -9 of MainPID, rotating over the serves; restart_sec 0.2")
        detect_fig.note(f"kill -> first exit/restart event: {spread(first, '{:.0f}')} ms, "
                        f"max {max(first):.0f} ms")
        detect_fig.note(f"kill -> exit event: {spread(exits, '{:.0f}')} ms")
        detect_fig.note(f"kill -> restart event: {spread(restarts, '{:.0f}')} ms "
                        "(includes restart_sec and the new process's start)")
        if any(x < 0 for x in first):
            detect_fig.problem("an event is older than its kill: the clocks differ")
        detect_fig.raw = {"kills": kill_runs}
        worst = max(first)
        detect_fig.rows.append(Row("5. detection (kill -9 -> exit/restart event)",
                                   f"median {median(first):.0f} ms, max {worst:.0f} ms, "
                                   f"p99 {pct(first, 99):.0f} ms",
                                   f"<= {TARGET_DETECT_S * 1000:g} ms",
                                   verdict(worst / 1000, TARGET_DETECT_S) + " (max)"))
    return wanted
