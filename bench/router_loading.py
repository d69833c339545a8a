"""What the loading feedback's ensure costs a stream whose serve is up (issue 41, L8): old code
and new side by side in one run, each its own nginx (the config and script its tree's gpud
renders) before the same stand-in serve and the same stand-in gpud, whose ensure answers 204
at once.

    .venv/bin/python bench/router_loading.py [--old 310a618] [--rounds 5] [--requests 200]

A stream (`"stream": true`) for a serve gpud may bring up goes through the script's own ensure
(router.js `loading`): at --old the script waited on the subrequest's promise; now it looks
for the answer a detached subrequest leaves in a variable (every millisecond at first). Each
round asks both sides in a shuffled order, one request at a time on a new connection, and
times the first line of each answer; reported are the medians over rounds of each round's
median and 90th percentile (ms). Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import os
import random
import shutil
import socketserver
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.front import NGINX, free_port, revision_tree, standin

REPO = Path(__file__).resolve().parents[1]
NJS = REPO / ".venv" / "lib" / "nginx" / "modules" / "ngx_http_js_module.so"
STREAM = json.dumps({"model": "m", "prompt": "x", "max_tokens": 1, "stream": True}).encode()

# Run in a tree: its gpud renders the router's nginx.conf and script into argv[1], the serve
# on demand (asked about through gpud's socket argv[5]).
RENDER = """
import sys
from pathlib import Path
from gpud.core.front import FrontConfig, render
from gpud.core.router import RoutedServe, RouterFront
try:
    from gpud.core.routerconf import http_lines, main_lines
except ImportError:  # a tree from before gpud.core.routerconf
    from gpud.core.router import http_lines, main_lines
from gpud.nginx.router import script_text
out, port, sock, njs, gpud = (Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4],
                              sys.argv[5])
router = RouterFront(f"127.0.0.1:{port}",
                     (RoutedServe("m", ("m",), socket=sock, ensure_timeout_s=30),),
                     njs_module=njs, script=str(out / "router.js"), gpud_socket=gpud)
(out / "router.js").write_text(script_text(router))
(out / "nginx.conf").write_text(render(FrontConfig(
    serves=(), run_dir=str(out / "run"), workers=1,
    main_extra=tuple(main_lines(router)), http_extra=tuple(http_lines(router)))))
"""


class _Gpud(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class _Ensure(http.server.BaseHTTPRequestHandler):
    """gpud's ensure, the serve up: 204 at once."""

    def do_POST(self) -> None:
        self.send_response(204)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


def first_line_ms(port: int) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        began = time.perf_counter()
        conn.request("POST", "/v1/completions", body=STREAM,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.readline()
        took = (time.perf_counter() - began) * 1000
        resp.read()
        if resp.status != 200:
            raise SystemExit(f"port {port}: {resp.status}")
        return took
    finally:
        conn.close()


class Side:
    def __init__(self, name: str, tree: Path, sock: str, gpud: str) -> None:
        self.name = name
        self.dir = Path(tempfile.mkdtemp(prefix="gpud-bench-loading-"))
        self.dir.chmod(0o755)
        for sub in ("run", "run/body", "run/proxy", "run/fastcgi", "run/uwsgi", "run/scgi"):
            (self.dir / sub).mkdir()
        self.port = free_port()
        subprocess.run([sys.executable, "-c", RENDER, str(self.dir), str(self.port), sock,
                        str(NJS), gpud], cwd=tree, check=True)
        self.nginx = subprocess.Popen([str(NGINX), "-c", str(self.dir / "nginx.conf"),
                                       "-p", f"{self.dir / 'run'}/"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                first_line_ms(self.port)
                break
            except (OSError, SystemExit):
                if time.monotonic() > deadline:
                    raise SystemExit(f"{name}: the router does not answer") from None
                time.sleep(0.1)

    def close(self) -> None:
        self.nginx.terminate()
        self.nginx.wait(timeout=10)
        shutil.rmtree(self.dir)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", default="310a618")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=200)
    args = ap.parse_args()
    old = revision_tree(args.old)
    tmp = Path(tempfile.mkdtemp(prefix="gpud-bench-serve-"))
    tmp.chmod(0o755)
    sock, gpud_sock = str(tmp / "m.sock"), str(tmp / "gpud.sock")
    gpud = _Gpud(gpud_sock, _Ensure)
    os.chmod(gpud_sock, 0o777)
    threading.Thread(target=gpud.serve_forever, daemon=True).start()
    serve = standin("--uds", sock)
    sides: list[Side] = []
    figures: dict[str, list[tuple[float, float]]] = {}
    try:
        deadline = time.monotonic() + 20
        while not Path(sock).exists():
            if time.monotonic() > deadline:
                raise SystemExit("the stand-in did not start")
            time.sleep(0.1)
        Path(sock).chmod(0o777)
        sides = [Side(f"old ({args.old})", old, sock, gpud_sock),
                 Side("new", REPO, sock, gpud_sock)]
        figures = {side.name: [] for side in sides}
        for _ in range(args.rounds):
            for side in random.sample(sides, len(sides)):
                took = sorted(first_line_ms(side.port) for _ in range(args.requests))
                figures[side.name].append((statistics.median(took),
                                           took[int(len(took) * 0.9)]))
    finally:
        for side in sides:
            side.close()
        serve.terminate()
        serve.wait(timeout=10)
        gpud.shutdown()
        gpud.server_close()
        shutil.rmtree(old)
        shutil.rmtree(tmp)
    print(f"a stream for a serve that is up, gpud's ensure answering at once; {args.rounds} "
          f"rounds of {args.requests} requests a side, one nginx worker")
    print(f"{'side':20}{'median ms':>12}{'p90 ms':>12}")
    for name, rounds in figures.items():
        print(f"{name:20}{statistics.median(r[0] for r in rounds):>12.2f}"
              f"{statistics.median(r[1] for r in rounds):>12.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
