"""Figure 7, under real systemd in the disposable sandbox: preemption and wake, with stand-in
serves speaking vLLM's sleep endpoints on a simulated GPU.

7a. `start hi --preempt` to hi healthy: one serve of lower priority (lo) must be put to sleep
    for hi to fit. Split into the serves' own time and gpud's. gpud's own work is the request
    to hi's `start` event (recorded once systemd reports hi's transient unit started) less
    lo's own answer to /sleep with its /is_sleeping confirmation (`serve_ms` of the sleep
    event, measured by gpud around the HTTP calls): the plan, the events, the shrink, waiting
    for observation to show lo's memory back, the admission and the unit's start job. The
    rest, hi's `start` event to its `healthy` event, is hi's own start under systemd plus
    health polling; beside it, for reference, a stand-in alone (spawned inside the sandbox
    without systemd or gpud, same start-up delay) until its first 200.
7b. `wake lo` (POST /v1/serves/lo/wake, timed at the client): the request minus the serve's
    own answer to /wake_up and its confirmation (`serve_ms` of the wake event).

Target for both: gpud adds <= 50 ms beyond the serves' own time.
"""

from __future__ import annotations

import json
import time
from typing import Any

from bench.common import PY, REPO, FigureResult, Row, call, median, spread, verdict
from bench.fig_systemd import STANDIN_ALONE, sandbox_unavailable
from tools.sandbox import Sandbox

TARGET_MS = 50.0
HI_DELAY_S = 0.3


def config() -> str:
    def command(*extra: str) -> str:
        return json.dumps(["/usr/bin/env", f"PYTHONPATH={REPO}", PY, "-m",
                           "gpud.testing.standin", "--port", "{port}",
                           "--gpu-memory-utilization", "{gpu_memory_utilization}", *extra])

    return "\n".join([
        "[daemon]", "observe_interval_s = 0.5", "health_interval_s = 0.5", "",
        "[roles.r]", 'device = "GPU-sim-0"', "reserve_mib = 1000", "",
        "[serves.lo]", 'role = "r"', "vram_mib = 14000", "priority = 50", "port = 30201",
        # on its port (front = false): the figure is gpud's sleep and wake, not the front's
        "sleep_level = 2", "sleep_mib = 800", "front = false",
        f"command = {command('--enable-sleep-mode', '--context-mib', '200')}",
        'environment = { VLLM_SERVER_DEV_MODE = "1" }', "",
        "[serves.hi]", 'role = "r"', "vram_mib = 20000", "priority = 10", "port = 30202",
        f"command = {command('--startup-delay', str(HI_DELAY_S))}", "",
        "[simulation]", 'state_file = "/run/gpud/sim.json"',
        "[[simulation.devices]]", 'uuid = "GPU-sim-0"', "total_mib = 32607", ""])


class SleepBench:
    def __init__(self, sb: Sandbox) -> None:
        self.sb = sb
        self.sock = sb.host_path("/run/gpud/gpud.sock")

    def post(self, path: str, body: Any = None, expect: int = 200) -> Any:
        status, answer = call(self.sock, "POST", path, body if body is not None else {},
                              timeout=120)
        if status != expect:
            raise RuntimeError(f"POST {path}: {status} {answer}")
        return answer

    def get(self, path: str) -> Any:
        status, body = call(self.sock, "GET", path)
        if status != 200:
            raise RuntimeError(f"GET {path}: {status} {body}")
        return body

    def wait(self, serve: str, state: str, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        view: dict[str, Any] = {}
        while time.monotonic() < deadline:
            view = self.get(f"/v1/serves/{serve}")
            if view["state"] == state:
                return view
            time.sleep(0.02)
        raise RuntimeError(f"{serve} not {state} after {timeout:.0f} s: {view}")

    def event(self, kind: str, serve: str, after: int) -> dict[str, Any]:
        for ev in self.get(f"/v1/events?serve={serve}&kind={kind}&after={after}&limit=10")["events"]:
            return dict(ev)
        raise RuntimeError(f"no {kind} event of {serve} after event {after}")

    def last_id(self) -> int:
        events = self.get("/v1/events?limit=1")["events"]
        return int(events[-1]["id"]) if events else 0

    def preempt_once(self) -> dict[str, float]:
        after = self.last_id()
        t0 = time.time()
        self.post("/v1/serves/hi/start", {"preempt": True})
        self.wait("hi", "running")
        sleep = self.event("sleep", "lo", after)
        start = self.event("start", "hi", after)
        healthy = self.event("healthy", "hi", after)
        return {"total_ms": (healthy["ts"] - t0) * 1000,
                "sleep_serve_ms": float(sleep["details"]["serve_ms"]),
                "draw_ms": float(sleep["details"]["draw_ms"]),
                "to_start_event_ms": (start["ts"] - t0) * 1000,
                "start_to_healthy_ms": (healthy["ts"] - start["ts"]) * 1000}

    def wake_once(self) -> dict[str, float]:
        after = self.last_id()
        t0 = time.monotonic()
        self.post("/v1/serves/lo/wake")
        took = (time.monotonic() - t0) * 1000
        wake = self.event("wake", "lo", after)
        return {"total_ms": took, "serve_ms": float(wake["details"]["serve_ms"])}


def run(quick: bool) -> FigureResult:
    fig = FigureResult("preempt", "preemption and wake: gpud's own work beside the serves'")
    reason = sandbox_unavailable()
    if reason is not None:
        fig.problem(f"not measured: {reason}")
        fig.rows.append(Row(f"7. {fig.title}", "not measured", "", f"skipped: {reason}"))
        return fig
    rounds = 3 if quick else 10
    sb = Sandbox(name="gpud-bench-sleep")
    preempts: list[dict[str, float]] = []
    wakes: list[dict[str, float]] = []
    alone: list[float] = []
    try:
        sb.boot()
        sb.run(["mkdir", "-p", "/run/gpud"])
        sb.write_file("/run/gpud/sim.json", json.dumps({"external": []}))
        sb.install_gpud(REPO, config())
        sb.run(["systemctl", "start", "gpud.service"], timeout=60)
        bench = SleepBench(sb)
        bench.post("/v1/serves/lo/start")
        bench.wait("lo", "running")
        script = STANDIN_ALONE.replace('"0.05"]', f'"0.05", "--startup-delay", "{HI_DELAY_S}"]')
        for i in range(rounds):
            out = sb.run([PY, "-c", script, "1"], timeout=120, env={"PYTHONPATH": str(REPO)})
            alone += list(json.loads(out.stdout))
            preempts.append(bench.preempt_once())
            bench.post("/v1/serves/hi/stop")
            bench.wait("lo", "running")  # woken back by gpud once hi's memory is released
            # and a wake by hand: put lo to sleep, then time its wake
            bench.post("/v1/serves/lo/sleep")
            wakes.append(bench.wake_once())
            p = preempts[-1]
            print(f"  round {i + 1}/{rounds}: preempt -> healthy {p['total_ms']:.0f} ms, "
                  f"wake {wakes[-1]['total_ms']:.1f} ms", flush=True)
        sb.run(["systemctl", "stop", "gpud.service"], check=False, timeout=60)
        sb.run("systemctl stop 'gpud-serve-*'", check=False, timeout=60)
    finally:
        sb.poweroff()
    own_start = median(alone)
    gpud_preempt = [p["to_start_event_ms"] - p["sleep_serve_ms"] for p in preempts]
    residual = [p["start_to_healthy_ms"] - own_start for p in preempts]
    gpud_wake = [w["total_ms"] - w["serve_ms"] for w in wakes]
    fig.note(f"{rounds} rounds: lo (14000 MiB, sleep_level 2, sleep_mib 800) running, hi "
             f"(20000 MiB, start-up delay {HI_DELAY_S:g} s) started with preempt on a role of "
             "31607 MiB")
    fig.note(f"start --preempt -> hi healthy: {spread([p['total_ms'] for p in preempts], '{:.0f}')} ms")
    fig.note(f"  lo's own /sleep + confirmation: "
             f"{spread([p['sleep_serve_ms'] for p in preempts])} ms")
    fig.note(f"  hi's own start (a stand-in alone, same delay): {spread(alone, '{:.0f}')} ms")
    fig.note(f"  observation showing lo's memory back after its sleep: "
             f"{spread([p['draw_ms'] for p in preempts])} ms (counted as gpud's)")
    fig.note(f"  request -> hi's start event (plan, sleep, admission, unit): "
             f"{spread([p['to_start_event_ms'] for p in preempts], '{:.0f}')} ms")
    fig.note(f"  hi's start event -> healthy event: "
             f"{spread([p['start_to_healthy_ms'] for p in preempts], '{:.0f}')} ms")
    fig.note(f"gpud's own part of a preempting start (request -> start event, less lo's own "
             f"sleep): {spread(gpud_preempt)} ms")
    fig.note(f"hi's start event -> healthy beyond a stand-in alone (systemd's exec of the unit, "
             f"the argv shim, health polling): {spread(residual, '{:.0f}')} ms")
    fig.note(f"wake by hand: {spread([w['total_ms'] for w in wakes])} ms at the client, of which "
             f"the serve's own /wake_up + confirmation {spread([w['serve_ms'] for w in wakes])} ms")
    fig.raw = {"preempts": preempts, "wakes": wakes, "standin_alone_ms": alone}
    fig.rows.append(Row("7a. start --preempt: gpud beyond the serves' own time",
                        f"{median(gpud_preempt):.0f} ms (range {min(gpud_preempt):.0f}-"
                        f"{max(gpud_preempt):.0f})", f"<= {TARGET_MS:g} ms",
                        verdict(median(gpud_preempt), TARGET_MS)))
    fig.rows.append(Row("7a. hi's start under systemd beyond a stand-in alone",
                        f"{median(residual):.0f} ms", "(info)", "info"))
    fig.rows.append(Row("7b. wake: gpud beyond the serve's own time",
                        f"{median(gpud_wake):.1f} ms (range {min(gpud_wake):.1f}-"
                        f"{max(gpud_wake):.1f})", f"<= {TARGET_MS:g} ms",
                        verdict(median(gpud_wake), TARGET_MS)))
    return fig
