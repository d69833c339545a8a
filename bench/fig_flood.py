"""Figure 8: `GET /v1/status` while 40 readers post 1 MiB plans — target p99 <= 100 ms.

A gpud running 8 roles x 64 serves; 40 client threads post, all at once, `POST /v1/plan` of a
config of 8 roles x 11,919 serves (about 0.9 MiB of JSON, the size of the report that found
it), wait for every answer, and do it again, round after round; meanwhile one more client asks
`GET /v1/status` in a loop (a new connection each time, as gpuctl does) and the latency of each
answer is the figure. Two gpuds are measured in the same run, one after the other: `inline`
(GPUD_EXPENSIVE_INLINE=1: parsing and planning on the event loop, no per-peer limit: gpud before
gpud.life.offload) and `offloaded` (as gpud runs: worker threads, at most 2 expensive requests per
uid, the rest answered 429 at once). All clients are one uid, like the one reader of the report.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import (
    FigureResult,
    Row,
    UnixHTTPConnection,
    median,
    pct,
    start_gpud,
    temp_dir,
    verdict,
)

ROLES = 8
RUNNING_SERVES = ROLES * 8
FLOOD_SERVES = 11_919
READERS = 40
TARGET_MS = 100.0
WATCHDOG_S = 30.0  # gpud.service's WatchdogSec=


def flood_config(serves: int) -> str:
    lines = ["[daemon]", 'admission = "ledger"', ""]
    for r in range(ROLES):
        lines += [f"[roles.role{r}]", f'device = "{r}"', "capacity_mib = 81559",
                  "reserve_mib = 1024", ""]
    for s in range(serves):
        lines += [f"[serves.s{s}]", f'role = "role{s % ROLES}"', "vram_mib = 64",
                  'command = ["/bin/true"]']
    return "\n".join(lines) + "\n"


def _post(sock: Path, body: bytes, answered: list[int]) -> None:
    conn = UnixHTTPConnection(sock, timeout=600)
    try:
        conn.request("POST", "/v1/plan", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        answered.append(resp.status)
    except OSError:
        answered.append(0)  # the connection was closed under the request
    finally:
        conn.close()


def _status_ms(sock: Path) -> float | None:
    t = time.perf_counter()
    conn = UnixHTTPConnection(sock, timeout=600)
    try:
        conn.request("GET", "/v1/status")
        resp = conn.getresponse()
        resp.read()
        return (time.perf_counter() - t) * 1000 if resp.status == 200 else None
    except OSError:
        return None
    finally:
        conn.close()


@dataclass
class Flood:
    mode: str
    latencies_ms: list[float] = field(default_factory=list)
    answers: Counter[int] = field(default_factory=Counter)
    round_s: list[float] = field(default_factory=list)
    failed_status: int = 0
    alive: bool = True
    body_bytes: int = 0


def measure(mode: str, rounds: int, min_s: float) -> Flood:
    """One gpud in MODE (inline or offloaded): ROUNDS rounds of READERS parallel plans (more
    while under MIN_S seconds have passed), the status latencies seen meanwhile."""
    tmp = temp_dir(f"flood-{mode}")
    env = {"GPUD_EXPENSIVE_INLINE": "1"} if mode == "inline" else {}
    daemon = start_gpud(tmp, flood_config(RUNNING_SERVES), env=env)
    body = json.dumps({"config": flood_config(FLOOD_SERVES), "source": "flood"}).encode()
    out = Flood(mode, body_bytes=len(body))
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            ms = _status_ms(daemon.socket)
            if ms is None:
                out.failed_status += 1
            else:
                out.latencies_ms.append(ms)

    poller = threading.Thread(target=poll)
    started = time.monotonic()
    try:
        poller.start()
        while len(out.round_s) < rounds or time.monotonic() - started < min_s:
            t = time.monotonic()
            answered: list[int] = []  # list.append, unlike Counter.update, is thread-safe
            readers = [threading.Thread(target=_post, args=(daemon.socket, body, answered))
                       for _ in range(READERS)]
            for r in readers:
                r.start()
            for r in readers:
                r.join()
            out.answers.update(answered)
            out.round_s.append(time.monotonic() - t)
        done.set()
        poller.join()
        out.alive = daemon.proc.poll() is None
    finally:
        done.set()
        daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def run(quick: bool) -> FigureResult:
    fig = FigureResult("flood", f"GET /v1/status while {READERS} readers post 1 MiB plans")
    results: dict[str, Flood] = {}
    # inline first, one round: its rounds take tens of seconds each
    for mode, rounds, min_s in (("inline", 1, 0.0),
                                ("offloaded", 3 if quick else 10, 5.0 if quick else 20.0)):
        print(f"  {mode}: {rounds}+ round(s) of {READERS} plans of {FLOOD_SERVES} serves ...",
              flush=True)
        results[mode] = r = measure(mode, rounds, min_s)
        lat = r.latencies_ms
        shown = ", ".join(f"{x:.1f}" for x in r.round_s[:5]) + (" ..." if len(r.round_s) > 5 else "")
        fig.note(f"{mode}: {len(r.round_s)} round(s) of {READERS} x POST /v1/plan "
                 f"({r.body_bytes} bytes each), answers {dict(r.answers)}, round s {shown}; "
                 f"GET /v1/status ms: p50 {median(lat):.1f}, p99 {pct(lat, 99):.1f}, "
                 f"max {max(lat, default=0):.1f}, n={len(lat)}")
        if not r.alive:
            fig.problem(f"{mode}: gpud died under the flood")
        if r.failed_status:
            fig.problem(f"{mode}: {r.failed_status} GET /v1/status failed")
        if max(lat, default=0) >= WATCHDOG_S * 1000:
            fig.note(f"{mode}: the loop was held {max(lat) / 1000:.1f} s: past gpud's "
                     f"{WATCHDOG_S:.0f} s watchdog, systemd would have killed it")
    fig.raw = {m: vars(r) for m, r in results.items()}
    before, after = results["inline"].latencies_ms, results["offloaded"].latencies_ms
    fig.rows.append(Row(f"8. status p99 under {READERS} x 1 MiB plans, inline (before)",
                        f"{pct(before, 99):.0f} ms (max {max(before, default=0):.0f} ms)",
                        "(info)", "info"))
    p99 = pct(after, 99)
    fig.rows.append(Row(f"8. status p99 under {READERS} x 1 MiB plans, offloaded",
                        f"{p99:.0f} ms (max {max(after, default=0):.0f} ms)",
                        f"<= {TARGET_MS:.0f} ms", verdict(p99, TARGET_MS)))
    return fig
