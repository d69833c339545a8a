"""What the loading feedback costs a request that does not stream on an on-demand serve's own
fronted port: with the router's loading feedback (loading_feedback_s = 1), the router's
script reads the body of each routed path there to tell a stream (router.js `fronted`);
without it (0), the port proxies the body as it comes. Both sides are this tree's front
(gpud.core.front.render with the router's lines and policy) before the same stand-in serve
and a stand-in gpud whose ensure answers 204 at once.

    .venv/bin/python bench/front_loading.py [--rounds 5] [--requests 200]

Each round starts each side's nginx in turn and sends it REQUESTS sequential
`POST /v1/completions` (max_tokens 1) on one kept connection, after 20 unmeasured ones;
reported are the median and 90th percentile over all rounds' requests (ms). Not a test:
nothing is asserted.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpud.core.front import FrontConfig, FrontServe, render
from gpud.core.router import RoutedServe, RouterFront
from gpud.core.routerconf import front_policy, http_lines, main_lines
from gpud.nginx.router import script_text
from tests.ports import connects, free_port
from tests.routerrig import (
    NGINX,
    NJS,
    TEMP_DIRS,
    Handler,
    router_dir,
    serving,
    unix_server,
)
from tests.waiting import wait_until

BODY = json.dumps({"model": "a", "prompt": "x", "max_tokens": 1}).encode()
WARM = 20


class Ensure(Handler):
    """gpud's ensure: the serve is up (204 at once)."""

    def do_POST(self) -> None:
        self.send_response(204)
        self.send_header("Content-Length", "0")
        self.end_headers()


def side(feedback_s: int, requests: int) -> list[float]:
    """The times of REQUESTS requests (s) through a fronted port whose router gives loading
    feedback every FEEDBACK_S (0: none)."""
    with router_dir("gpud-bench-front-loading-") as tmp:
        sock, gpud_sock, run = tmp / "a.sock", tmp / "gpud.sock", tmp / "run"
        for name in TEMP_DIRS:
            (run / name).mkdir(parents=True, exist_ok=True)
        port, fport = free_port(), free_port()
        router = RouterFront(f"127.0.0.1:{port}",
                             (RoutedServe("a", ("a",), socket=str(sock), ensure_timeout_s=60),),
                             njs_module=str(NJS), script=str(tmp / "router.js"),
                             gpud_socket=str(gpud_sock), loading_feedback_s=feedback_s)
        (tmp / "router.js").write_text(script_text(router))
        (tmp / "nginx.conf").write_text(render(FrontConfig(
            serves=(FrontServe("a", fport, str(sock), ensure_timeout_s=60),),
            run_dir=str(run), gpud_socket=str(gpud_sock),
            main_extra=tuple(main_lines(router)), http_extra=tuple(http_lines(router)),
            policies=(("a", front_policy(router, "a")),))))
        serve = subprocess.Popen([sys.executable, "-m", "gpud.testing.standin", "serve", "m",
                                  "--uds", str(sock), "--served-model-name", "a"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        nginx = subprocess.Popen([str(NGINX), "-c", str(tmp / "nginx.conf"), "-p", f"{run}/"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            with serving(unix_server(gpud_sock, Ensure)):
                wait_until(sock.exists, what="the stand-in's socket")
                sock.chmod(0o777)
                wait_until(lambda: connects(fport), what="the fronted port")
                return _time(fport, requests)
        finally:
            for proc in (nginx, serve):
                proc.terminate()
                proc.wait(timeout=10)


def _time(port: int, requests: int) -> list[float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        def ask() -> int:
            conn.request("POST", "/v1/completions", body=BODY,
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            return resp.status

        wait_until(lambda: ask() == 200, what="the serve answering")
        for _ in range(WARM):
            ask()
        times = []
        for _ in range(requests):
            began = time.perf_counter()
            if ask() != 200:
                raise SystemExit("a request was not answered 200")
            times.append(time.perf_counter() - began)
        return times
    finally:
        conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args()
    got: dict[int, list[float]] = {0: [], 1: []}
    for _ in range(args.rounds):
        for feedback_s in got:
            got[feedback_s] += side(feedback_s, args.requests)
    for feedback_s, times in got.items():
        times.sort()
        print(f"loading_feedback_s = {feedback_s}: p50 {statistics.median(times) * 1000:.3f} ms"
              f", p90 {times[int(len(times) * 0.9)] * 1000:.3f} ms ({len(times)} requests)")


if __name__ == "__main__":
    main()
