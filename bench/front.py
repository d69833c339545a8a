"""The front's cost: latency it adds per request and streamed throughput through it vs direct,
at 1 and 64 concurrent clients, and its own memory and CPU at idle.

    .venv/bin/python bench/front.py [--rounds N] [--requests N] [--workers N]

Two stand-ins of the same code: one on a TCP port (direct, as clients reached a serve before
the front), one on a Unix socket behind nginx with the config gpud generates
(gpud.core.front.render) and as many workers as gpud gives the front on this host
(gpud.nginx.front.front_workers: the cores it may run on, at most 4; --workers to compare). Each
round runs both sides in a shuffled order; reported are medians over rounds of each round's p50
(latency: a non-streamed POST /v1/completions on a keep-alive connection per client) and of
each round's throughput (streamed completions of 200 tokens sent without pause, tokens per
second over all clients). Idle: VmRSS of nginx's master and workers and their CPU time (utime
+ stime) over 10 s with no request. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpud.core.front import MAX_WORKERS, FrontConfig, FrontServe, render
from gpud.nginx.front import front_workers

REPO = Path(__file__).resolve().parents[1]
NGINX = REPO / ".venv" / "bin" / "nginx"
BODY = json.dumps({"prompt": "hello there", "max_tokens": 1}).encode()
STREAM = json.dumps({"prompt": "a b c d e f g h", "max_tokens": 200, "stream": True}).encode()
TICKS = os.sysconf("SC_CLK_TCK")


def revision_tree(rev: str, into: Path | None = None) -> Path:
    """REV's files (`git archive`) in INTO, else a new temporary directory: an older gpud to
    measure beside this one in the same run."""
    tree = into if into is not None else Path(tempfile.mkdtemp(prefix="gpud-bench-old-"))
    tree.mkdir(exist_ok=True)
    archive = subprocess.run(["git", "archive", rev], cwd=REPO, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_health(port: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                conn.close()
                return
            conn.close()
        except OSError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"port {port}: no healthy answer in {timeout} s")


def standin(*listen: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "gpud.testing.standin", "serve", "m",
                             *listen], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def clients(port: int, n: int, requests: int, body: bytes, stream: bool = False, *,
            token: str | None = None, status: int = 200) -> tuple[list[float], int, float]:
    """N threads, each on its own keep-alive connection, REQUESTS each (with TOKEN, where
    given): the latencies (s), the data events read, and the wall time of all of them. Any
    answer but STATUS ends the run."""
    latencies: list[float] = []
    events = 0
    lock = threading.Lock()
    start = threading.Barrier(n + 1)
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    failed: list[str] = []

    def one() -> None:
        nonlocal events
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        mine: list[float] = []
        seen = 0
        start.wait()
        for _ in range(requests):
            t0 = time.perf_counter()
            conn.request("POST", "/v1/completions", body=body, headers=headers)
            resp = conn.getresponse()
            if stream:
                for line in resp:
                    if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                        seen += 1
            else:
                text = resp.read()
            if resp.status != status:
                failed.append(f"port {port}: status {resp.status}: {text[:300]!r}"
                              if not stream else f"port {port}: status {resp.status}")
                break
            mine.append(time.perf_counter() - t0)
            if resp.will_close:
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.close()
        with lock:
            latencies.extend(mine)
            events += seen

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    start.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    if failed:
        raise SystemExit(failed[0])
    return latencies, events, wall


def stop_all(procs: list[subprocess.Popen[bytes]], tmp: Path) -> None:
    """PROCS ended (all told first, then each waited for) and TMP removed."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(timeout=10)
    shutil.rmtree(tmp)


def proc_stat(pid: int) -> tuple[float, int]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / TICKS
    rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text()
               .splitlines() if line.startswith("VmRSS:"))
    return cpu, rss


def machine_cpu() -> tuple[int, int]:
    """(busy, all) clock ticks of every CPU since boot (/proc/stat's first line; idle and iowait
    are not busy)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def tree_cpu(pid: int) -> float:
    """CPU seconds of PID and its children, nginx's master and workers (single-threaded): the
    scheduler's count in nanoseconds (/proc/PID/schedstat), not stat's 10 ms ticks."""
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return sum(int(Path(f"/proc/{p}/schedstat").read_text().split()[0])
               for p in (pid, *map(int, kids))) / 1e9


Results = dict[tuple[str, str, int], list[float]]


def interleaved(sides: dict[str, int], rounds: int, requests: int, body: bytes = BODY,
                stream_body: bytes = STREAM, nginx: int | None = None) -> Results:
    """Each side (name -> port) measured in turn, in a shuffled order each round, at 1 and 64
    clients: the p50 latency of BODY's completion (ms) and STREAM_BODY's streamed tokens per second,
    by (figure, side, clients). Side by side in one run: the machine's noise falls on all.
    Beside each latency run: how busy the machine's CPUs were (cpu_busy_pct, of all of them,
    whoever used them) and, with NGINX (its master's pid), nginx's CPU per request
    (nginx_cpu_us)."""
    results: Results = {}
    for _ in range(rounds):
        for n in (1, 64):
            order = list(sides)
            random.shuffle(order)
            for side in order:
                count = max(5, requests // n)
                busy0, all0 = machine_cpu()
                cpu0 = tree_cpu(nginx) if nginx is not None else 0.0
                lat, _, _ = clients(sides[side], n, count, body, stream=False)
                busy1, all1 = machine_cpu()
                results.setdefault(("p50_ms", side, n), []).append(statistics.median(lat) * 1000)
                results.setdefault(("cpu_busy_pct", side, n), []).append(
                    100 * (busy1 - busy0) / max(1, all1 - all0))
                if nginx is not None:
                    results.setdefault(("nginx_cpu_us", side, n), []).append(
                        1e6 * (tree_cpu(nginx) - cpu0) / (n * count))
                t0 = time.perf_counter()
                _, events, _ = clients(sides[side], n, max(2, 20 // n), stream_body, stream=True)
                results.setdefault(("tokens_per_s", side, n), []).append(
                    events / (time.perf_counter() - t0))
    return results


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=200, help="per client at 1 client")
    p.add_argument("--workers", type=int, default=front_workers(),
                   choices=range(1, MAX_WORKERS + 1), metavar="N",
                   help="nginx's workers (default: what gpud gives the front on this host, "
                        "%(default)s)")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gpud-front-bench-"))
    tmp.chmod(0o755)  # nginx run by root serves from workers that run as nobody
    run = tmp / "run"
    run.mkdir()
    sock = tmp / "s.sock"
    direct_port, front_port = free_port(), free_port()
    (tmp / "nginx.conf").write_text(render(FrontConfig(
        serves=(FrontServe("s", front_port, str(sock)),), run_dir=str(run),
        workers=args.workers)))
    procs = [standin("--port", str(direct_port)), standin("--uds", str(sock))]
    nginx: subprocess.Popen[bytes] | None = None
    try:
        while not sock.exists():
            time.sleep(0.01)
        sock.chmod(0o777)
        nginx = subprocess.Popen([str(NGINX), "-c", str(tmp / "nginx.conf"), "-p", f"{run}/"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(nginx)
        wait_health(direct_port)
        wait_health(front_port)
        print(f"nginx: {args.workers} worker(s); {args.rounds} rounds", flush=True)
        sides = {"direct": direct_port, "front": front_port}
        results = interleaved(sides, args.rounds, args.requests)
        print(f"{'figure':<14} {'clients':>7} {'direct':>10} {'front':>10} {'front-direct':>13}")
        for metric in ("p50_ms", "tokens_per_s"):
            for n in (1, 64):
                d = statistics.median(results[(metric, "direct", n)])
                f = statistics.median(results[(metric, "front", n)])
                extra = f"{f - d:+.3f} ms" if metric == "p50_ms" else f"{100 * f / d:.1f} %"
                print(f"{metric:<14} {n:>7} {d:>10.3f} {f:>10.3f} {extra:>13}")
        # idle: master and its worker
        kids = [int(x) for x in Path(f"/proc/{nginx.pid}/task/{nginx.pid}/children")
                .read_text().split()]
        pids = [nginx.pid, *kids]
        before = [proc_stat(pid) for pid in pids]
        time.sleep(10)
        after = [proc_stat(pid) for pid in pids]
        cpu = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
        rss = sum(a[1] for a in after)
        print(f"front idle: {len(pids)} processes, RSS {rss / 1024:.1f} MiB, "
              f"CPU {100 * cpu / 10:.2f} % of one core over 10 s")
    finally:
        stop_all(procs, tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
