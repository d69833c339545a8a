"""Figure 9: the resident set's boot on one GPU, exactly sized serves started together, under
real systemd in the disposable sandbox with stand-ins for vLLM (`gpud.testing.standin` as each
serve's `vllm`, loading for a configured time).

The seed's four resident serves (etc/serves.toml: fast, embeddings, reranker, ocr, 14336 + 3200 +
3456 + 5120 MiB on one 32607 MiB device), each a vllm serve whose stand-in takes a start time in
the proportions of a real GPU's (a 4B FP8 generator with CUDA graphs slowest, the two pooling
models quickest), scaled down. Three arms in one run, one after the other in one sandbox:

- exact: every serve sized in bytes (vllm.kv_cache_mib): no profiling, one shared device lock;
- util: every serve sized by profiling (today's default): one at a time;
- mixed: embeddings sized by profiling, the rest in bytes.

Boot wall: the first `start` event to the last `healthy` one. A serve's own start: its `healthy`
minus its `start`. Target: exact boot wall <= 1.3 x the slowest serve's own start.
"""

from __future__ import annotations

import json
import time
from typing import Any

from bench.common import PY, REPO, FigureResult, Row, call, verdict
from tools.sandbox import Sandbox

TARGET_RATIO = 1.3
# name, vram_mib, priority, start time (s; a real GPU's in these proportions, ~10x longer)
SEED: tuple[tuple[str, int, int, float], ...] = (
    ("fast", 14336, 10, 6.0), ("embeddings", 3200, 20, 2.5), ("reranker", 3456, 30, 3.0),
    ("ocr", 5120, 40, 4.0))
ARMS: dict[str, frozenset[str]] = {  # the serves sized by profiling
    "exact": frozenset(), "util": frozenset(n for n, *_ in SEED), "mixed": frozenset({"embeddings"})}
STANDIN = ["/usr/bin/env", f"PYTHONPATH={REPO}", PY, "-m", "gpud.testing.standin"]


def wrapper(name: str) -> str:
    return f"/usr/local/bin/vllm-standin-{name}"


def config(profiled: frozenset[str]) -> str:
    lines = ["[daemon]", 'admission = "ledger"', "health_interval_s = 0.5",
             "observe_interval_s = 0.5", "",
             "[roles.dark-fast]", 'device = "GPU-sim-0"', "reserve_mib = 4608", ""]
    for i, (name, mib, prio, _delay) in enumerate(SEED):
        lines += [f"[serves.{name}]", 'role = "dark-fast"', f"vram_mib = {mib}", "resident = true",
                  f"priority = {prio}", f"port = {30200 + i}", f"[serves.{name}.vllm]",
                  f'model = "org/{name}"', f'executable = "{wrapper(name)}"']
        if name not in profiled:
            lines.append(f"kv_cache_mib = {mib // 4}")
        lines.append("")
    lines += ["[simulation]", 'state_file = "/run/gpud/sim.json"', "[[simulation.devices]]",
              'uuid = "GPU-sim-0"', "total_mib = 32607"]
    return "\n".join(lines) + "\n"


def boot(sb: Sandbox, profiled: frozenset[str], scale: float) -> dict[str, Any]:
    sb.run(["systemctl", "stop", "gpud.service"], check=False, timeout=60)
    sb.run("systemctl stop 'gpud-serve-*'; systemctl reset-failed 'gpud-serve-*' gpud.service;"
           " rm -rf /var/lib/gpud /run/gpud/sim.json /run/gpud/sim-procs", check=False, timeout=60)
    sb.run(["mkdir", "-p", "/run/gpud"])
    sb.write_file("/run/gpud/sim.json", json.dumps({"external": []}))
    sb.install_gpud(REPO, config(profiled))
    for name, _mib, _prio, delay in SEED:
        sb.write_file(wrapper(name), f'#!/bin/sh\nexec {" ".join(STANDIN)} "$@" '
                      f"--startup-delay {delay * scale:g}\n", mode=0o755)
    started = sb.run(["systemctl", "start", "gpud.service"], timeout=60, check=False)
    if started.returncode != 0:
        raise RuntimeError("gpud did not start:\n" + str(sb.run(
            "journalctl -u gpud --no-pager | tail -15", check=False).stdout))
    sock = sb.host_path("/run/gpud/gpud.sock")
    deadline = time.monotonic() + 120
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        with_status = call(sock, "GET", "/v1/serves")
        if with_status[0] == 200:
            states = {s["name"]: s["state"] for s in with_status[1]["serves"]}
            if len(states) == len(SEED) and all(s == "running" for s in states.values()):
                break
            if "failed" in states.values():
                break
        time.sleep(0.1)
    else:
        raise RuntimeError(f"not all running: {states}")
    if any(s != "running" for s in states.values()):
        raise RuntimeError(f"a serve failed: {states}")
    events = call(sock, "GET", "/v1/events?limit=10000")[1]["events"]
    start = {e["serve"]: e["ts"] for e in events if e["kind"] == "start"}
    healthy = {e["serve"]: e["ts"] for e in events if e["kind"] == "healthy"}
    failed = [e for e in events if e["kind"] in ("exit", "restart", "crash-loop")]
    own = {n: healthy[n] - start[n] for n in start}
    return {"wall_s": max(healthy.values()) - min(start.values()), "own_s": own,
            "start_spread_s": max(start.values()) - min(start.values()),
            "locks": {e["serve"]: e["details"].get("device_lock") for e in events
                      if e["kind"] == "start"},
            "failures": len(failed)}


def expected(own: dict[str, float], profiled: frozenset[str]) -> float:
    """The boot's chain in priority order: a util-sized serve alone, each run of exactly sized
    ones between them as long as its slowest."""
    total, run_max = 0.0, 0.0
    for name, *_ in SEED:
        if name in profiled:
            total += run_max + own[name]
            run_max = 0.0
        else:
            run_max = max(run_max, own[name])
    return total + run_max


def run(quick: bool) -> FigureResult:
    fig = FigureResult("parallel", "resident set boot on one GPU: exactly sized serves together")
    from bench.fig_systemd import sandbox_unavailable
    reason = sandbox_unavailable()
    if reason is not None:
        fig.problem(f"not measured: {reason}")
        fig.rows.append(Row("9. parallel boot", "not measured", "", f"skipped: {reason}"))
        return fig
    scale = 0.5 if quick else 1.0
    sb = Sandbox(name="gpud-bench-parallel")
    results: dict[str, dict[str, Any]] = {}
    try:
        sb.boot()
        for arm, profiled in ARMS.items():
            results[arm] = boot(sb, profiled, scale)
            r = results[arm]
            print(f"  {arm}: boot wall {r['wall_s']:.2f} s, slowest own start "
                  f"{max(r['own_s'].values()):.2f} s, sum {sum(r['own_s'].values()):.2f} s",
                  flush=True)
        sb.run(["systemctl", "stop", "gpud.service"], check=False, timeout=60)
        sb.run("systemctl stop 'gpud-serve-*'", check=False, timeout=60)
    finally:
        sb.poweroff()
    delays = ", ".join(f"{n} {d * scale:g} s" for n, _m, _p, d in SEED)
    fig.note(f"the seed's resident set on one simulated device, stand-in start times: {delays}")
    for arm, r in results.items():
        own = r["own_s"]
        fig.note(f"{arm}: boot wall {r['wall_s']:.2f} s; own starts "
                 + ", ".join(f"{n} {v:.2f}" for n, v in own.items())
                 + f" s; starts spread over {r['start_spread_s']:.2f} s; device locks "
                 + json.dumps(r["locks"]) + f"; failures {r['failures']}")
    fig.raw = {"scale": scale, "arms": results}
    ex, ut, mx = results["exact"], results["util"], results["mixed"]
    slowest = max(ex["own_s"].values())
    ratio = ex["wall_s"] / slowest
    fig.rows.append(Row("9. exact: boot wall / slowest own start",
                        f"{ratio:.2f}x ({ex['wall_s']:.2f} s / {slowest:.2f} s)",
                        f"<= {TARGET_RATIO}x", verdict(ratio, TARGET_RATIO)))
    fig.rows.append(Row("9. util (today): boot wall / sum of own starts",
                        f"{ut['wall_s'] / sum(ut['own_s'].values()):.2f}x ({ut['wall_s']:.2f} s / "
                        f"{sum(ut['own_s'].values()):.2f} s)", "(info)", "info"))
    fig.rows.append(Row("9. exact vs util: boot wall", f"{ex['wall_s']:.2f} s vs {ut['wall_s']:.2f}"
                        f" s ({ut['wall_s'] / ex['wall_s']:.2f}x faster)", "(info)", "info"))
    chain = expected(mx["own_s"], ARMS["mixed"])
    fig.rows.append(Row("9. mixed: boot wall / its chain (each util-sized alone, the runs of "
                        "exact ones between them together)",
                        f"{mx['wall_s'] / chain:.2f}x ({mx['wall_s']:.2f} s / {chain:.2f} s)",
                        "(info)", "info"))
    # What the boot adds beyond the slowest serve's own start (queueing, hand-offs), per serve;
    # the own start itself is the stand-in's interpreter, the delay and health polling.
    over = (ex["wall_s"] - slowest) / len(SEED) * 1000
    fig.rows.append(Row("9. exact: boot wall beyond the slowest own start, per serve",
                        f"{over:.0f} ms", "<= 50 ms", verdict(max(over, 0.001), 50.0)))
    slow = max(ex["own_s"], key=lambda n: ex["own_s"][n])
    delay = next(d for n, _m, _p, d in SEED if n == slow) * scale
    fig.rows.append(Row(f"9. exact: {slow}'s own start beyond its configured load time",
                        f"{(slowest - delay) * 1000:.0f} ms", "(info)", "info"))
    return fig
