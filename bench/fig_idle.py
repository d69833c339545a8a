"""Figure 3: gpud's idle CPU and RSS while it observes 8 simulated devices x 16 processes at 1 Hz,
and the cost of one observation cycle.

The 128 processes are `sleep`s started here, registered in the simulated backend's procs dir
(`gpud.host.simulation.register_process`), 16 per device, so every cycle reads 128 registrations,
checks each PID is alive (/proc/PID/stat) and attributes it (/proc/PID/cgroup). They are not in
a serve unit's cgroup, so they stay unattributed: the reads are the same. One role per device.

CPU: utime + stime of gpud (all threads) from /proc/PID/stat over the window, nothing asking it
anything (no API call during the window), read every 5 s for the spread. RSS: VmRSS (and VmHWM)
at the end. The cycle cost: `observation.sample_ms` of GET /v1/status, read once per cycle after
the CPU window. Then, for reference, the same daemon alternates between the 128 registered
and none registered (shuffled 5 s windows): the difference is what the 128 processes cost.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import time
from pathlib import Path

from bench.common import (
    FigureResult,
    Row,
    cpu_seconds,
    get,
    median,
    pct,
    spread,
    start_gpud,
    status_kib,
    temp_dir,
    verdict,
)
from gpud.host.simulation import register_process, unregister_process

DEVICES = 8
PROCS_PER_DEVICE = 16
PROC_MIB = 1000
TOTAL_MIB = 81559
TARGET_CPU_PCT = 1.0
TARGET_RSS_MIB = 80.0


def config(state_file: str) -> str:
    roles = "".join(f'[roles.gpu{i}]\ndevice = "GPU-sim-{i}"\nreserve_mib = 1024\n\n'
                    for i in range(DEVICES))
    devices = "".join(f'[[simulation.devices]]\nuuid = "GPU-sim-{i}"\ntotal_mib = {TOTAL_MIB}\n'
                      for i in range(DEVICES))
    return (f'[daemon]\nobserve_interval_s = 1.0\n\n{roles}'
            f'[simulation]\nstate_file = "{state_file}"\n{devices}')


def _device(i: int) -> str:
    return f"GPU-sim-{i // PROCS_PER_DEVICE}"


def _sample_ms(sock: Path, cycles: int) -> list[float]:
    """observation.sample_ms of GET /v1/status, once per observation cycle."""
    values: list[float] = []
    seen: set[float] = set()
    deadline = time.monotonic() + cycles * 1.0 + 5
    while len(values) < cycles and time.monotonic() < deadline:
        obs = get(sock, "/v1/status")["observation"]
        if obs["taken_at"] not in seen:
            seen.add(obs["taken_at"])
            values.append(float(obs["sample_ms"]))
        time.sleep(0.25)
    return values


def run(quick: bool) -> FigureResult:
    fig = FigureResult("idle", "idle CPU and RSS, 8 simulated devices x 16 processes at 1 Hz")
    window, step = (5.0, 2.5) if quick else (20.0, 5.0)
    cycles = 3 if quick else 15
    settle = 2.0 if quick else 3.0
    pairs, pair_window = (0, 0.0) if quick else (3, 5.0)  # the reference: full runs only
    tmp = temp_dir("idle")
    state_file = tmp / "sim.json"
    state_file.write_text(json.dumps({"external": [
        {"device": f"GPU-sim-{i}", "label": "display", "mib": 512} for i in range(DEVICES)]}))
    procs_dir = tmp / "sim-procs"
    sleepers: list[subprocess.Popen[bytes]] = []
    daemon = None
    try:
        for i in range(DEVICES * PROCS_PER_DEVICE):
            proc = subprocess.Popen(["sleep", "100000"], stdin=subprocess.DEVNULL)
            sleepers.append(proc)
            register_process(procs_dir, proc.pid, _device(i), PROC_MIB)
        daemon = start_gpud(tmp, config(str(state_file)))
        time.sleep(settle)  # a few cycles first: imports and caches settle
        obs = get(daemon.socket, "/v1/status")["observation"]
        used = [d["used_mib"] for d in obs["devices"]]
        expect = PROCS_PER_DEVICE * PROC_MIB + 512
        if len(used) != DEVICES or any(u != expect for u in used):
            fig.problem(f"the simulated devices do not show the registered processes: used {used}, "
                        f"expected {DEVICES} x {expect}")
        else:
            fig.note(f"observation sees {DEVICES} devices x {PROCS_PER_DEVICE} processes "
                     f"(used {expect} MiB each)")
        pid = daemon.pid
        cpu_windows: list[float] = []
        t_start, c_start = time.monotonic(), cpu_seconds(pid)
        t_prev, c_prev = t_start, c_start
        rss_max = 0
        while time.monotonic() - t_start < window - 1e-3:
            time.sleep(step)
            t_now, c_now = time.monotonic(), cpu_seconds(pid)
            cpu_windows.append((c_now - c_prev) / (t_now - t_prev) * 100)
            t_prev, c_prev = t_now, c_now
            rss_max = max(rss_max, status_kib(pid, "VmRSS"))
        cpu_pct = (c_prev - c_start) / (t_prev - t_start) * 100
        rss_mib = status_kib(pid, "VmRSS") / 1024
        hwm_mib = status_kib(pid, "VmHWM") / 1024
        threads = len(list(Path(f"/proc/{pid}/task").iterdir()))
        # the cycle's cost, as gpud reports it: one reading per cycle (taken_at changes)
        sample_ms = _sample_ms(daemon.socket, cycles)
        # the same daemon with nothing registered, interleaved with the 128: what they cost
        with_procs: list[float] = []
        without: list[float] = []
        rng = random.Random(3)
        for _ in range(pairs):
            order = [True, False]
            rng.shuffle(order)
            for registered in order:
                for i, proc in enumerate(sleepers):
                    if registered:
                        register_process(procs_dir, proc.pid, _device(i), PROC_MIB)
                    else:
                        unregister_process(procs_dir, proc.pid)
                time.sleep(1.2)  # one cycle at the new size before the window opens
                t0, c0 = time.monotonic(), cpu_seconds(pid)
                time.sleep(pair_window)
                pct_cpu = (cpu_seconds(pid) - c0) / (time.monotonic() - t0) * 100
                (with_procs if registered else without).append(pct_cpu)
        empty_sample_ms: list[float] = []
        if pairs:
            for proc in sleepers:
                unregister_process(procs_dir, proc.pid)
            time.sleep(1.2)
            empty_sample_ms = _sample_ms(daemon.socket, 3)
    finally:
        if daemon is not None:
            daemon.stop()
        for proc in sleepers:
            proc.kill()
        for proc in sleepers:
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)

    fig.note(f"CPU over {t_prev - t_start:.1f} s: {cpu_pct:.2f}% of one core; per {step:g} s "
             f"window: {spread(cpu_windows, '{:.2f}')}")
    fig.note(f"RSS {rss_mib:.1f} MiB (max seen {rss_max / 1024:.1f}, VmHWM {hwm_mib:.1f}); "
             f"{threads} threads")
    fig.note(f"observation cycle (sample_ms): {spread(sample_ms, '{:.2f}')} ms, p99 "
             f"{pct(sample_ms, 99):.2f} ms")
    if pairs:
        _reference(fig, pair_window, with_procs, without, sample_ms, empty_sample_ms)
    fig.raw = {"cpu_pct": cpu_pct, "cpu_windows_pct": cpu_windows, "rss_mib": rss_mib,
               "vmhwm_mib": hwm_mib, "sample_ms": sample_ms, "cpu_with_pct": with_procs,
               "cpu_without_pct": without, "sample_ms_without": empty_sample_ms}
    fig.rows.append(Row("3. idle CPU (1 Hz, 8 dev x 16 procs)", f"{cpu_pct:.2f}% of a core",
                        f"< {TARGET_CPU_PCT:g}%", verdict(cpu_pct, TARGET_CPU_PCT)))
    fig.rows.append(Row("3. idle RSS", f"{rss_mib:.1f} MiB", f"< {TARGET_RSS_MIB:g} MiB",
                        verdict(rss_mib, TARGET_RSS_MIB)))
    if pairs:
        fig.rows.append(Row("3. idle CPU, nothing registered (reference)",
                            f"{median(without):.2f}% of a core", "(info)", "info"))
    fig.rows.append(Row("3. observation cycle (sample_ms)",
                        f"p50 {median(sample_ms):.2f} ms, p99 {pct(sample_ms, 99):.2f} ms",
                        "(info)", "info"))
    return fig


def _reference(fig: FigureResult, pair_window: float, with_procs: list[float], without: list[float],
               sample_ms: list[float], empty_sample_ms: list[float]) -> None:
    fig.note(f"interleaved {pair_window:g} s windows, same daemon: CPU with the 128 processes "
             f"{spread(with_procs, '{:.2f}')}%, with none registered {spread(without, '{:.2f}')}%; "
             f"sample_ms with none: {spread(empty_sample_ms, '{:.2f}')}")
    per_proc_us = (median(sample_ms) - median(empty_sample_ms)) / (DEVICES * PROCS_PER_DEVICE) * 1000
    fig.note(f"so one registered process costs about {per_proc_us:.0f} us per cycle, and the 128 "
             f"{median(with_procs) - median(without):.2f}% of a core at 1 Hz")
