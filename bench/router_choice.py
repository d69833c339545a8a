"""What asking gpud which host takes a request costs the router (docs/peers.md, "Which host"):
a request through the router (real nginx and njs, the config and script this tree's gpud
renders) for a model this host serves alone against one this host and a peer both offer (its
one subrequest to a real gpud's GET /v1/route), interleaved on one keep-alive connection, each
answered by the same stand-in serve here (gpud chooses this host: a tie).

    .venv/bin/python bench/router_choice.py [--requests 3000]

Prints each side's median and 90th percentile and the difference of the medians. Not a test:
nothing is asserted.
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import os
import shutil
import socket
import socketserver
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import get, start_gpud, temp_dir
from bench.front import NGINX, free_port
from gpud.core.front import FrontConfig, render
from gpud.core.router import RoutedPeer, RoutedServe, RouterFront
from gpud.core.routerconf import http_lines, main_lines
from gpud.nginx.router import script_text

REPO = Path(__file__).resolve().parents[1]
NJS = REPO / ".venv" / "lib" / "nginx" / "modules" / "ngx_http_js_module.so"
KEY = "sk-bench-peer-0123456789"
# the peer lists "shared" asleep: no fresher host there than here
MODELS = json.dumps({"object": "list", "data": [
    {"id": "shared", "object": "model", "created": 1, "owned_by": "gpud",
     "gpud": {"serve": "shared", "state": "sleeping"}}]}).encode()
CONFIG = """
[roles.r]
device = "0"
capacity_mib = 32607
reserve_mib = 0

[serves.shared]
role = "r"
vram_mib = 1024
port = {serve_port}
command = ["/bin/true"]
models = ["shared", "alone"]

[router]
listen = "127.0.0.1:{router_port}"

[peers.node2]
url = "http://127.0.0.1:{peer_port}"
key_file = "{key}"

[simulation]
state_file = "{state}"
[[simulation.devices]]
uuid = "GPU-sim-0"
total_mib = 32607
"""


class _Peer(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(MODELS)))
        self.end_headers()
        self.wfile.write(MODELS)

    def log_message(self, format: str, *args: object) -> None:
        pass


class _Serve(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        data = b'{"object": "list", "data": []}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        pass


class _Unix(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def _connects(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=3000, help="of each model")
    args = ap.parse_args()
    tmp = temp_dir("choice")
    tmp.chmod(0o755)
    peer = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Peer)
    serve = _Unix(str(tmp / "serve.sock"), _Serve)
    (tmp / "serve.sock").chmod(0o777)
    for server in (peer, serve):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    key = tmp / "node2.key"
    key.write_text(KEY + "\n")
    key.chmod(0o600)
    (tmp / "sim.json").write_text('{"external": []}')
    gpud = start_gpud(tmp, CONFIG.format(serve_port=free_port(), router_port=free_port(),
                                         peer_port=peer.server_address[1], key=key,
                                         state=tmp / "sim.json"))
    nginx: subprocess.Popen[bytes] | None = None
    try:
        os.chmod(gpud.socket, 0o777)
        deadline = time.monotonic() + 30
        while not all(p.get("reachable") for p in get(gpud.socket, "/v1/peers")["peers"]):
            if time.monotonic() > deadline:
                raise SystemExit("the peer was not reached within 30 s")
            time.sleep(0.1)
        choice = get(gpud.socket, "/v1/route?model=shared")
        run = tmp / "run"
        for name in ("", "body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (run / name).mkdir(exist_ok=True)
        port = free_port()
        router = RouterFront(
            f"127.0.0.1:{port}",
            (RoutedServe("shared", ("shared", "alone"), socket=str(tmp / "serve.sock")),),
            njs_module=str(NJS), script=str(tmp / "router.js"), gpud_socket=str(gpud.socket),
            host="node1", peers=(RoutedPeer("node2", "http", "127.0.0.1",
                                            peer.server_address[1], KEY, ("shared",)),))
        (tmp / "router.js").write_text(script_text(router))
        (tmp / "nginx.conf").write_text(render(FrontConfig(
            serves=(), run_dir=str(run), main_extra=tuple(main_lines(router)),
            http_extra=tuple(http_lines(router)))))
        nginx = subprocess.Popen([str(NGINX), "-c", str(tmp / "nginx.conf"), "-p", f"{run}/"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while not _connects(port):
            time.sleep(0.05)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        bodies = {m: json.dumps({"model": m, "input": "x"}).encode() for m in ("alone", "shared")}
        took: dict[str, list[float]] = {"alone": [], "shared": []}
        for i in range(args.requests + args.requests // 10):
            for model in ("alone", "shared") if i % 2 else ("shared", "alone"):
                began = time.perf_counter()
                conn.request("POST", "/v1/embeddings", body=bodies[model],
                             headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                if resp.status != 200:
                    raise SystemExit(f"{model}: {resp.status}")
                if i >= args.requests // 10:   # the first tenth warms up
                    took[model].append(time.perf_counter() - began)
        print(f"gpud's choice for 'shared': {choice}")
        for model, what in (("alone", "this host only"), ("shared", "this host and a peer")):
            xs = sorted(took[model])
            print(f"{model:7} ({what}): median {statistics.median(xs) * 1e3:.3f} ms, "
                  f"p90 {xs[int(len(xs) * 0.9)] * 1e3:.3f} ms, n={len(xs)}")
        print(f"added by the question: "
              f"{(statistics.median(took['shared']) - statistics.median(took['alone'])) * 1e3:.3f}"
              " ms (median)")
    finally:
        if nginx is not None:
            nginx.terminate()
            nginx.wait(10)
        gpud.stop()
        for server in (peer, serve):
            server.shutdown()
            server.server_close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
