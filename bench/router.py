"""The router's cost: latency it adds per request and streamed throughput through it, against
the same stand-in reached directly and through the front's plain proxy, at 1 and 64 clients;
then the first request to a sleeping model, through the router, against the serve's own wake.

    .venv/bin/python bench/router.py [--rounds N] [--requests N] [--workers N] [--wake-rounds N]

Latency and throughput (--rounds; 0 skips them): one stand-in on a TCP port (direct) and one of
the same code on a Unix socket, behind one nginx with the config gpud generates
(gpud.core.front.render, gpud.core.routerconf.http_lines) and as many workers as gpud gives the
front on this host (gpud.nginx.front.front_workers: the cores it may run on, at most 4; --workers
to compare): its front server (a plain proxy, as docs/front.md measures) and the router's
server (njs reads the body's `model`, then the same proxy). The router asks gpud nothing here
(an always-on serve). Each round runs the sides in a shuffled order; reported are medians over
rounds of each round's p50 (a non-streamed POST /v1/completions on a keep-alive connection per
client) and of each round's throughput (streamed completions of 200 tokens sent without pause,
tokens per second over all clients), then the p50 of a request with a 900 KiB body (one client:
the JSON the router parses; the stand-in takes at most 1 MiB). Beside each latency run: how
busy the machine's CPUs were (all of them, whoever used them: the clients, the stand-ins and
nginx share them) and nginx's own CPU per request (its master and workers).

The first request to a sleeping model (--wake-rounds; 0 skips it), under real systemd in a
sandbox (booted as gpud-router-bench, powered off at the end): gpud with one fronted stand-in
that sleeps (sleep_level 1) behind the router, and beside it a stand-in of the same code alone
on its own socket, no gpud, no nginx. Each round puts both to sleep (gpud's sleep; the other's
own /sleep), then in a shuffled order times, from a new connection: through the router, a
completion for the model (gpud wakes the serve: the router's ensure, admission, /wake_up and
its confirmation, then the request); directly, /wake_up, /is_sleeping until it says awake, and
the same completion. Their difference is gpud's and the router's share beyond the serve's own
wake. Then a second request each, awake (the router still asks gpud: the serve can sleep).
Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.front import clients, free_port, interleaved, standin, stop_all, tree_cpu, wait_health
from gpud.core.front import MAX_WORKERS, FrontConfig, FrontServe
from gpud.core.router import RoutedServe, RouterFront
from gpud.nginx.front import front_workers
from tests.routerrig import NJS, start_nginx, write_router

REPO = Path(__file__).resolve().parents[1]
BODY = json.dumps({"model": "m", "prompt": "hello there", "max_tokens": 1}).encode()
STREAM = json.dumps({"model": "m", "prompt": "a b c d e f g h", "max_tokens": 200,
                     "stream": True}).encode()
LARGE = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 1,
                    "user": "x" * (900 << 10)}).encode()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5, help="of latency and throughput (0: none)")
    p.add_argument("--requests", type=int, default=200, help="per client at 1 client")
    p.add_argument("--workers", type=int, default=front_workers(),
                   choices=range(1, MAX_WORKERS + 1), metavar="N",
                   help="nginx's workers (default: what gpud gives the front on this host, "
                        "%(default)s)")
    p.add_argument("--wake-rounds", type=int, default=10,
                   help="of the first request to a sleeping model (0: none)")
    args = p.parse_args()
    print(f"host: {os.cpu_count()} CPUs, {len(os.sched_getaffinity(0))} usable; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    if args.rounds:
        latency(args.rounds, args.requests, args.workers)
    if args.wake_rounds:
        wake(args.wake_rounds)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


def latency(rounds: int, requests: int, workers: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="gpud-router-bench-"))
    tmp.chmod(0o755)  # nginx run by root serves from workers that run as nobody
    sock = tmp / "s.sock"
    direct_port, front_port, router_port = free_port(), free_port(), free_port()
    # with its access log, as gpud's router writes it (docs/router.md, "Seeing it")
    router = RouterFront(f"127.0.0.1:{router_port}", (RoutedServe("s", ("m",), socket=str(sock)),),
                         njs_module=str(NJS), script=str(tmp / "router.js"),
                         access_log=str(tmp / "router.log"))
    write_router(router, tmp / "run", tmp / "nginx.conf",
                 FrontConfig(serves=(FrontServe("s", front_port, str(sock)),), workers=workers))
    procs = [standin("--port", str(direct_port)), standin("--uds", str(sock))]
    try:
        while not sock.exists():
            time.sleep(0.01)
        sock.chmod(0o777)
        nginx = start_nginx(tmp / "nginx.conf", tmp / "run", tmp / "nginx.log")
        procs.append(nginx)
        for port in (direct_port, front_port):
            wait_health(port)
        print(f"nginx: {workers} worker(s); {rounds} rounds", flush=True)
        sides = {"direct": direct_port, "front": front_port, "router": router_port}
        # every side gets the router's bodies (with a model): a serve ignores the field
        results = interleaved(sides, rounds, requests, BODY, STREAM, nginx=nginx.pid)
        for _ in range(rounds):
            for side in sides:
                cpu0 = tree_cpu(nginx.pid)
                lat, _, _ = clients(sides[side], 1, 10, LARGE, stream=False)
                results.setdefault(("p50_ms_900k", side, 1), []).append(
                    statistics.median(lat) * 1000)
                results.setdefault(("nginx_cpu_us_900k", side, 1), []).append(
                    1e6 * (tree_cpu(nginx.pid) - cpu0) / 10)
        print(f"{'figure':<17} {'clients':>7} {'direct':>10} {'front':>10} {'router':>10} "
              f"{'router-direct':>14} {'router-front':>13}")
        for metric, ns in (("p50_ms", (1, 64)), ("tokens_per_s", (1, 64)),
                           ("p50_ms_900k", (1,)), ("cpu_busy_pct", (1, 64)),
                           ("nginx_cpu_us", (1, 64)), ("nginx_cpu_us_900k", (1,))):
            for n in ns:
                d, f, r = (statistics.median(results[(metric, side, n)]) for side in sides)
                if metric == "tokens_per_s":
                    extra = f"{100 * r / d:.1f} %", f"{100 * r / f:.1f} %"
                else:
                    unit = {"cpu_busy_pct": "pt", "nginx_cpu_us": "us",
                            "nginx_cpu_us_900k": "us"}.get(metric, "ms")
                    extra = f"{r - d:+.3f} {unit}", f"{r - f:+.3f} {unit}"
                print(f"{metric:<17} {n:>7} {d:>10.3f} {f:>10.3f} {r:>10.3f} {extra[0]:>14} "
                      f"{extra[1]:>13}")
    finally:
        stop_all(procs, tmp)


# Run in the sandbox: the reference stand-in alone, then ROUNDS rounds of both sides.
WAKE_SNIPPET = r'''
import http.client, json, os, random, socket, subprocess, sys, time
repo, gpud_sock, router_port, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
REF = "/run/gpud-bench-ref.sock"
BODY = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 1}).encode()
class UDS(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("localhost", timeout=120)
        self.uds = path
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(self.uds)
def ask(conn, method, path, body=None):
    conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    assert resp.status == 200, (path, resp.status, data[:300])
    return data
def asleep(conn):
    return json.loads(ask(conn, "GET", "/is_sleeping"))["is_sleeping"]
env = dict(os.environ, PYTHONPATH=repo, VLLM_SERVER_DEV_MODE="1")
ref = subprocess.Popen([sys.executable, "-m", "gpud.testing.standin", "serve", "m", "--uds", REF,
                        "--gpu-memory-utilization", "0.1", "--enable-sleep-mode"], env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    deadline = time.monotonic() + 60
    while True:
        try:
            ask(UDS(REF), "GET", "/health")
            break
        except OSError:
            assert time.monotonic() < deadline, "the reference stand-in did not start"
            time.sleep(0.05)
    out = {"direct": [], "router": [], "direct_awake": [], "router_awake": []}
    for _ in range(rounds):
        ask(UDS(gpud_sock), "POST", "/v1/serves/s/sleep", b"{}")
        conn = UDS(REF)
        ask(conn, "POST", "/sleep?level=1")
        while not asleep(conn):
            time.sleep(0.01)
        conn.close()
        time.sleep(0.5)
        for side in random.sample(["direct", "router"], 2):
            if side == "direct":
                conn = UDS(REF)
                t0 = time.perf_counter()
                ask(conn, "POST", "/wake_up")
                while asleep(conn):
                    pass
            else:
                conn = http.client.HTTPConnection("127.0.0.1", router_port, timeout=120)
                t0 = time.perf_counter()
            ask(conn, "POST", "/v1/completions", BODY)
            out[side].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ask(conn, "POST", "/v1/completions", BODY)
            out[side + "_awake"].append(time.perf_counter() - t0)
            conn.close()
    print(json.dumps(out))
finally:
    ref.terminate()
    ref.wait()
'''
WAKE_ROUTER, WAKE_PORT = 30390, 30391


def wake(rounds: int) -> None:
    from tests.integration.gpudctl import PY, SandboxGpud, fronted_gpud, sim_config, standin_uds
    from tools.sandbox import Sandbox

    serves = (f'[serves.s]\nrole = "r"\nvram_mib = 4000\nresident = true\nport = {WAKE_PORT}\n'
              'sleep_level = 1\nsleep_mib = 800\nmodels = ["m"]\n'
              'environment = { VLLM_SERVER_DEV_MODE = "1" }\n'
              f"command = {standin_uds('--enable-sleep-mode')}\n")
    config = (sim_config('[roles.r]\ndevice = "GPU-sim-0"\nreserve_mib = 1000\n', serves)
              + f'[router]\nlisten = "127.0.0.1:{WAKE_ROUTER}"\n')
    sb = Sandbox(name="gpud-router-bench")
    sb.boot()
    try:
        with fronted_gpud(SandboxGpud(sb), config) as gpud:
            gpud.wait_state("s", "running", timeout=60)
            print(f"first request to a sleeping model: {rounds} rounds, in the sandbox; nginx "
                  f"workers as gpud gives them there ({front_workers()})", flush=True)
            out = sb.run([PY, "-c", WAKE_SNIPPET, str(REPO), "/run/gpud/gpud.sock",
                          str(WAKE_ROUTER), str(rounds)], timeout=60 + 10 * rounds).stdout
            ms = {k: [x * 1000 for x in v] for k, v in json.loads(out).items()}
            serve_ms = [float(e["details"]["serve_ms"])
                        for e in gpud.events(kind="wake", serve="s")][-rounds:]
        diffs = [r - d for r, d in zip(ms["router"], ms["direct"], strict=True)]

        def show(values: list[float]) -> str:
            return (f"median {statistics.median(values):.1f} ms (range {min(values):.1f}-"
                    f"{max(values):.1f}, n={len(values)})")

        print(f"  through the router, asleep (wake and request): {show(ms['router'])}")
        print(f"  directly, asleep (/wake_up, /is_sleeping, request): {show(ms['direct'])}")
        print(f"  gpud's and the router's share beyond the serve's own wake (router - direct, "
              f"per round): {show(diffs)}")
        print(f"  the serve's wake as gpud timed it, inside the first figure (its /wake_up and "
              f"confirmation; the wake event's serve_ms): {show(serve_ms)}")
        print(f"  then awake: through the router {show(ms['router_awake'])}, directly "
              f"{show(ms['direct_awake'])}")
    finally:
        sb.poweroff()


if __name__ == "__main__":
    sys.exit(main())
