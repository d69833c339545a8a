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
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import get, start_gpud, temp_dir
from bench.front import free_port
from gpud.core.router import RoutedPeer, RoutedServe, RouterFront
from tests.routerrig import (
    NJS,
    Handler,
    answering,
    key_file,
    router_running,
    serving,
    tcp_server,
    unix_server,
)

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


class _Peer(Handler):
    def do_GET(self) -> None:
        self.answer(200, MODELS)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=3000, help="of each model")
    args = ap.parse_args()
    tmp = temp_dir("choice")
    tmp.chmod(0o755)
    peer = tcp_server(_Peer)
    serve = unix_server(tmp / "serve.sock", answering(b'{"object": "list", "data": []}'))
    key = key_file(tmp / "node2.key", KEY)
    (tmp / "sim.json").write_text('{"external": []}')
    with serving(peer, serve):
        gpud = start_gpud(tmp, CONFIG.format(serve_port=free_port(), router_port=free_port(),
                                             peer_port=peer.server_address[1], key=key,
                                             state=tmp / "sim.json"))
        try:
            gpud.socket.chmod(0o777)
            deadline = time.monotonic() + 30
            while not all(p.get("reachable") for p in get(gpud.socket, "/v1/peers")["peers"]):
                if time.monotonic() > deadline:
                    raise SystemExit("the peer was not reached within 30 s")
                time.sleep(0.1)
            choice = get(gpud.socket, "/v1/route?model=shared")
            port = free_port()
            router = RouterFront(
                f"127.0.0.1:{port}",
                (RoutedServe("shared", ("shared", "alone"), socket=str(tmp / "serve.sock")),),
                njs_module=str(NJS), script=str(tmp / "router.js"),
                gpud_socket=str(gpud.socket), host="node1",
                peers=(RoutedPeer("node2", "http", "127.0.0.1", peer.server_address[1], KEY,
                                  ("shared",)),))
            with router_running(tmp, router):
                took = _timed(port, args.requests)
            print(f"gpud's choice for 'shared': {choice}")
            for model, what in (("alone", "this host only"), ("shared", "this host and a peer")):
                xs = sorted(took[model])
                print(f"{model:7} ({what}): median {statistics.median(xs) * 1e3:.3f} ms, "
                      f"p90 {xs[int(len(xs) * 0.9)] * 1e3:.3f} ms, n={len(xs)}")
            print(f"added by the question: "
                  f"{(statistics.median(took['shared']) - statistics.median(took['alone'])) * 1e3:.3f}"
                  " ms (median)")
        finally:
            gpud.stop()
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _timed(port: int, requests: int) -> dict[str, list[float]]:
    """REQUESTS of each model (and a tenth more first, to warm up), interleaved on one
    keep-alive connection: each one's time (s) by model."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    bodies = {m: json.dumps({"model": m, "input": "x"}).encode() for m in ("alone", "shared")}
    took: dict[str, list[float]] = {"alone": [], "shared": []}
    for i in range(requests + requests // 10):
        for model in ("alone", "shared") if i % 2 else ("shared", "alone"):
            began = time.perf_counter()
            conn.request("POST", "/v1/embeddings", body=bodies[model],
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            if resp.status != 200:
                raise SystemExit(f"{model}: {resp.status}")
            if i >= requests // 10:   # the first tenth warms up
                took[model].append(time.perf_counter() - began)
    return took


if __name__ == "__main__":
    sys.exit(main())
