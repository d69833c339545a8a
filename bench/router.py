"""The router's cost: latency it adds per request and streamed throughput through it, against
the same stand-in reached directly and through the front's plain proxy, at 1 and 64 clients.

    .venv/bin/python bench/router.py [--rounds N] [--requests N]

One stand-in on a TCP port (direct) and one of the same code on a Unix socket, behind one nginx
with the config gpud generates (gpud.core.front.render, gpud.core.router.http_lines): its
front server (a plain proxy, as docs/front.md measures) and the router's server (njs reads the
body's `model`, then the same proxy). The router asks gpud nothing here (an always-on serve;
an on-demand or sleeping serve adds the front's ensure round trip, bench/front_ondemand.py).
Each round runs the sides in a shuffled order; reported are medians over rounds of each round's
p50 (a non-streamed POST /v1/completions on a keep-alive connection per client) and of each
round's throughput (streamed completions of 200 tokens sent without pause, tokens per second
over all clients), then the p50 of a request with a 900 KiB body (one client: the JSON the
router parses; the stand-in takes at most 1 MiB). Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.front import NGINX, clients, free_port, interleaved, standin, wait_health
from gpud.core.front import FrontConfig, FrontServe, render
from gpud.core.router import RoutedServe, RouterFront, http_lines, main_lines
from gpud.router import script_text

REPO = Path(__file__).resolve().parents[1]
NJS = REPO / ".venv" / "lib" / "nginx" / "modules" / "ngx_http_js_module.so"
BODY = json.dumps({"model": "m", "prompt": "hello there", "max_tokens": 1}).encode()
STREAM = json.dumps({"model": "m", "prompt": "a b c d e f g h", "max_tokens": 200,
                     "stream": True}).encode()
LARGE = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 1,
                    "user": "x" * (900 << 10)}).encode()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=200, help="per client at 1 client")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gpud-router-bench-"))
    tmp.chmod(0o755)  # nginx run by root serves from workers that run as nobody
    run = tmp / "run"
    run.mkdir()
    sock = tmp / "s.sock"
    direct_port, front_port, router_port = free_port(), free_port(), free_port()
    # with its access log, as gpud's router writes it (docs/router.md, "Seeing it")
    router = RouterFront(f"127.0.0.1:{router_port}", (RoutedServe("s", ("m",), socket=str(sock)),),
                         njs_module=str(NJS), script=str(tmp / "router.js"),
                         access_log=str(tmp / "router.log"))
    (tmp / "router.js").write_text(script_text(router))
    (tmp / "nginx.conf").write_text(render(FrontConfig(
        serves=(FrontServe("s", front_port, str(sock)),), run_dir=str(run),
        main_extra=tuple(main_lines(router)), http_extra=tuple(http_lines(router)))))
    procs = [standin("--port", str(direct_port)), standin("--uds", str(sock))]
    try:
        while not sock.exists():
            time.sleep(0.01)
        sock.chmod(0o777)
        procs.append(subprocess.Popen(
            [str(NGINX), "-c", str(tmp / "nginx.conf"), "-p", f"{run}/"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for port in (direct_port, front_port):
            wait_health(port)
        sides = {"direct": direct_port, "front": front_port, "router": router_port}
        # every side gets the router's bodies (with a model): a serve ignores the field
        results = interleaved(sides, args.rounds, args.requests, BODY, STREAM)
        for _ in range(args.rounds):
            for side in sides:
                lat, _ = clients(sides[side], 1, 10, LARGE, stream=False)
                results.setdefault(("p50_ms_900k", side, 1), []).append(
                    statistics.median(lat) * 1000)
        print(f"{'figure':<14} {'clients':>7} {'direct':>10} {'front':>10} {'router':>10} "
              f"{'router-direct':>14} {'router-front':>13}")
        for metric, ns in (("p50_ms", (1, 64)), ("tokens_per_s", (1, 64)),
                           ("p50_ms_900k", (1,))):
            for n in ns:
                d, f, r = (statistics.median(results[(metric, side, n)]) for side in sides)
                if metric.startswith("p50"):
                    extra = f"{r - d:+.3f} ms", f"{r - f:+.3f} ms"
                else:
                    extra = f"{100 * r / d:.1f} %", f"{100 * r / f:.1f} %"
                print(f"{metric:<14} {n:>7} {d:>10.3f} {f:>10.3f} {r:>10.3f} {extra[0]:>14} "
                      f"{extra[1]:>13}")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)
        shutil.rmtree(tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
