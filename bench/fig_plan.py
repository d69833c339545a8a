"""Figure 6: `gpuctl plan NEW.toml` on a config of 8 roles x 64 serves (512 serves), and the
plan in the daemon on 8 roles x 512 serves (4096).

Times `POST /v1/plan` on a gpud running the 8 x 64 config (all resident) with NEW growing every
other serve from 4096 to 8192 MiB, so half the serves change: the endpoint alone (raw HTTP, the
time in the daemon; target under 100 ms), and `gpuctl plan NEW.toml` as a whole against
`python3 -c pass` the way figure 1 does. Then the endpoint alone on a gpud running 4096 serves
(target under 250 ms).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from bench.common import PY, FigureResult, Row, call, median, spread, start_gpud, temp_dir
from bench.fig_startup import _spawn_time, console_script, environments

ROLES = 8
SERVES = ROLES * 64
PLAN_TARGET_MS = 100.0  # in the daemon
LARGE_SERVES = ROLES * 512
LARGE_TARGET_MS = 250.0


def big_config(grow: bool, serves: int = SERVES) -> str:
    lines = ['[daemon]', 'admission = "ledger"', ""]
    for r in range(ROLES):
        lines += [f"[roles.role{r}]", f'device = "{r}"', "capacity_mib = 81559",
                  "reserve_mib = 1024", ""]
    # Small enough that every role holds its share of the serves whole.
    small = 4096 if serves <= SERVES else 128
    vram = [small * 2 if grow and s % 2 else small for s in range(serves)]
    for s in range(serves):
        lines += [f"[serves.serve{s}]", f'role = "role{s % ROLES}"', f"vram_mib = {vram[s]}",
                  "resident = true", f"priority = {s}", f"port = {31000 + s}",
                  'command = ["/bin/true", "--port", "{port}"]', ""]
    return "\n".join(lines)


def run(quick: bool) -> FigureResult:
    fig = FigureResult("plan", "gpuctl plan on 8 roles x 64 serves")
    tmp = temp_dir("plan")
    daemon = start_gpud(tmp, big_config(False))
    try:
        new = tmp / "new.toml"
        new.write_text(big_config(True))
        status, body = call(daemon.socket, "POST", "/v1/plan",
                            {"config": new.read_text(), "source": str(new)}, timeout=60)
        if status == 404:
            print("plan: not measured (no plan endpoint yet)", flush=True)
            fig.notes.append("plan: not measured (no plan endpoint yet): POST /v1/plan answers 404")
            fig.rows.append(Row("6. gpuctl plan (8 roles x 64 serves)", "not measured", "-",
                                "no plan endpoint yet"))
            return fig
        fig.note(f"POST /v1/plan answers {status}; the answer has {len(json.dumps(body))} bytes")
        if status != 200:
            fig.problem(f"POST /v1/plan: {status} {json.dumps(body)[:500]}")
        _measure(fig, daemon.socket, new, quick)
    finally:
        daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    _measure_large(fig, quick)
    return fig


def _measure_large(fig: FigureResult, quick: bool) -> None:
    tmp = temp_dir("plan-large")
    daemon = start_gpud(tmp, big_config(False, LARGE_SERVES))
    try:
        body = {"config": big_config(True, LARGE_SERVES), "source": "large"}
        endpoint_ms = []
        for _ in range(5 if quick else 15):
            t = time.perf_counter()
            status, answer = call(daemon.socket, "POST", "/v1/plan", body, timeout=120)
            endpoint_ms.append((time.perf_counter() - t) * 1000)
            if status != 200:
                fig.problem(f"POST /v1/plan on {LARGE_SERVES} serves: {status} "
                            f"{json.dumps(answer)[:300]}")
                return
    finally:
        daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    fig.note(f"POST /v1/plan on {LARGE_SERVES} serves (raw HTTP) ms: {spread(endpoint_ms)}")
    in_daemon = median(endpoint_ms)
    verdict = "ok" if in_daemon < LARGE_TARGET_MS else "MISS"
    fig.rows.append(Row(f"6. plan in the daemon ({ROLES} roles x {LARGE_SERVES // ROLES} serves)",
                        f"{in_daemon:.0f} ms (max {max(endpoint_ms):.0f} ms)",
                        f"< {LARGE_TARGET_MS:.0f} ms",
                        f"{in_daemon / LARGE_TARGET_MS:.2f}x target, {verdict}"))


def _measure(fig: FigureResult, sock: Path, new: Path, quick: bool) -> None:
    """PLACEHOLDER: written before the endpoint existed; check the argv against gpuctl's."""
    out = subprocess.run([str(console_script()), "--socket", str(sock), "plan", str(new)],
                         capture_output=True, text=True, timeout=60)
    fig.note(f"gpuctl plan exits {out.returncode}, prints {len(out.stdout.splitlines())} lines; "
             f"first: {out.stdout.splitlines()[:1]}")
    if out.returncode not in (0, 1):
        fig.problem(f"gpuctl plan exited {out.returncode}: {out.stderr[-500:]}")
    rounds = 10 if quick else 30
    commands = {
        "python3 -c pass": [PY, "-c", "pass"],
        "gpuctl plan": [str(console_script()), "--socket", str(sock), "plan", str(new)],
    }
    times: dict[str, list[float]] = {name: [] for name in commands}
    devnull = os.open(os.devnull, os.O_WRONLY)
    env, _ = environments(new.parent)
    try:
        for i in range(rounds + 2):
            for name, argv in (commands.items() if i % 2 else reversed(commands.items())):
                elapsed = _spawn_time(argv, env, devnull, ok=(0, out.returncode))
                if i >= 2:
                    times[name].append(elapsed * 1000)
    finally:
        os.close(devnull)
    body = {"config": new.read_text(), "source": str(new)}
    endpoint_ms = []
    for _ in range(rounds):
        t = time.perf_counter()
        call(sock, "POST", "/v1/plan", body, timeout=60)
        endpoint_ms.append((time.perf_counter() - t) * 1000)
    for name, values in times.items():
        fig.note(f"{name:16s} ms: {spread(values)}")
    fig.note(f"POST /v1/plan alone (raw HTTP) ms: {spread(endpoint_ms)}")
    ratio = median(times["gpuctl plan"]) / median(times["python3 -c pass"])
    fig.raw = {"ms": times, "endpoint_ms": endpoint_ms}
    in_daemon = median(endpoint_ms)
    verdict = "ok" if in_daemon < PLAN_TARGET_MS else "MISS"
    fig.rows.append(Row("6. plan in the daemon (8 roles x 64 serves)",
                        f"{in_daemon:.0f} ms (p99 {sorted(endpoint_ms)[-1]:.0f} ms)",
                        f"< {PLAN_TARGET_MS:.0f} ms",
                        f"{in_daemon / PLAN_TARGET_MS:.2f}x target, {verdict}"))
    fig.rows.append(Row("6. gpuctl plan, whole command / python3 -c pass",
                        f"{ratio:.2f}x ({median(times['gpuctl plan']):.0f} ms)", "(info)", "info"))
