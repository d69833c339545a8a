"""The hop to a peer (docs/peers.md, "Forwarding"): what host A's router adds to a request for a
model that lives on host B, against the same request sent to B's router directly, side by side in
one run; and what a request for a dead peer's model costs once A's circuit of it is open.

    .venv/bin/python bench/peers.py [--rounds N] [--requests N] [--clients N] [--workers N]
                                    [--pin]

Two routers on loopback, each its own nginx with the config gpud generates
(gpud.core.front.render, gpud.core.routerconf.http_lines and the script of gpud.nginx.router)
and as many workers as gpud gives the front on this host (gpud.nginx.front.front_workers;
--workers to compare), each with its access log as gpud's router writes it:

- B's router: one always-on stand-in serve of model `m` on a Unix socket (the router asks gpud
  nothing for it), and a keys file of two keys: `front-a` (`peer = true`: the key A presents)
  and `carol` (a client of B's own).
- A's router: no serve of `m`; peer b (B's router) offering `m`, and peer d, whose circuit is
  open (nobody listens at its address) offering `gone`; a keys file with the client key
  `alice`.

The two sides of each round, in a shuffled order: `a->b` (alice's key at A, forwarded with A's
peer key and her requester) and `b` (carol's key at B directly). Per side and round: the p50 and
p99 latency at one client (a non-streamed POST /v1/completions of one token, on a keep-alive
connection), then at --clients clients (32) the requests answered per second and the streamed
tokens per second (completions of 200 tokens sent without pause). Reported: the median over
rounds of each, and A->B's difference (latency) or ratio (throughput) to B's. Then, at one
client and at --clients clients: the time to the 503 for `gone` (peer d's circuit open: no
connection tried) and, for reference, to A's own 404 for a model nobody offers. Beside the
32 clients' requests: each nginx's CPU per request (its master and workers), what the hop costs
in CPU where A and B are two machines; here both share this host's CPUs with the clients and
the stand-in, so at 32 clients A's share is taken from B's throughput. With --pin, A's nginx and
the clients run on one CPU, B's nginx and the stand-in on another: each host its own CPU, as two
machines (on a host of two CPUs, still shared with whatever else runs there). A real host
pair adds the network between them (a tailnet's round trip), which loopback does not have.
Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.front import clients, free_port, standin, stop_all, tree_cpu
from gpud.core.front import MAX_WORKERS, FrontConfig
from gpud.core.keys import ApiKey, token_digest
from gpud.core.router import RoutedPeer, RoutedServe, RouterFront
from gpud.nginx.front import front_workers
from tests.routerrig import NJS, need_nginx, start_nginx, write_router

PEER_KEY = "sk-a-presents-this-to-b-0123456789"
ALICE, CAROL = "sk-alice-at-a-0123456789", "sk-carol-at-b-0123456789"
BODY = json.dumps({"model": "m", "prompt": "hello there", "max_tokens": 1}).encode()
STREAM = json.dumps({"model": "m", "prompt": "a b c d e f g h", "max_tokens": 200,
                     "stream": True}).encode()


def until_answered(port: int, token: str, tmp: Path, timeout: float = 20) -> None:
    """Until the router on PORT answers a completion of `m` 200 (its nginx listening, the
    stand-in up); the nginx logs in TMP in the error."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("POST", "/v1/completions", body=BODY, headers={
                "Content-Type": "application/json", "Authorization": f"Bearer {token}"})
            resp = conn.getresponse()
            last = f"{resp.status} {resp.read()[:300]!r}"
            conn.close()
            if resp.status == 200:
                return
        except OSError as exc:
            last = str(exc)
        time.sleep(0.05)
    logs = "".join(f.read_text() for f in sorted(tmp.glob("*-nginx.log")))
    raise SystemExit(f"port {port}: no 200 in {timeout} s (last: {last})\n{logs}")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--requests", type=int, default=400, help="at one client, per side and round")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--pin", action="store_true",
                   help="A's nginx and the clients on the first usable CPU, B's nginx and the "
                        "stand-in on the second: each host its own CPU, as two machines")
    p.add_argument("--workers", type=int, default=front_workers(),
                   choices=range(1, MAX_WORKERS + 1), metavar="N",
                   help="each nginx's workers (default: what gpud gives the front on this "
                        "host, %(default)s)")
    args = p.parse_args()
    need_nginx()
    print(f"host: {os.cpu_count()} CPUs, {len(os.sched_getaffinity(0))} usable; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="gpud-peers-bench-"))
    tmp.chmod(0o755)  # nginx run by root serves from workers that run as nobody
    sock = tmp / "m.sock"
    a_port, b_port, nobody = free_port(), free_port(), free_port()
    b = RouterFront(f"127.0.0.1:{b_port}", (RoutedServe("s", ("m",), socket=str(sock)),),
                    njs_module=str(NJS), script=str(tmp / "b.js"),
                    gpud_socket=str(tmp / "b-gpud.sock"), access_log=str(tmp / "b.log"),
                    host="b", keys=(ApiKey("front-a", token_digest(PEER_KEY), ("*",), peer=True),
                                    ApiKey("carol", token_digest(CAROL), ("*",))))
    a = RouterFront(f"127.0.0.1:{a_port}", (), njs_module=str(NJS), script=str(tmp / "a.js"),
                    gpud_socket=str(tmp / "a-gpud.sock"), access_log=str(tmp / "a.log"),
                    host="a", keys=(ApiKey("alice", token_digest(ALICE), ("*",)),),
                    peers=(RoutedPeer("b", "http", "127.0.0.1", b_port, PEER_KEY, ("m",)),
                           RoutedPeer("d", "http", "127.0.0.1", nobody, PEER_KEY, ("gone",),
                                      open_reason="cannot connect: refused",
                                      open_since=time.time())))
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin and len(cpus) < 2:
        raise SystemExit("--pin: fewer than two usable CPUs")
    on = ({"a": cpus[0], "b": cpus[1]} if args.pin else {})
    procs: list[subprocess.Popen[bytes]] = [standin("--uds", str(sock))]
    if args.pin:
        os.sched_setaffinity(procs[0].pid, {on["b"]})
        os.sched_setaffinity(0, {on["a"]})
    nginx: dict[str, int] = {}
    try:
        for name, router in (("a", a), ("b", b)):
            run = tmp / f"run-{name}"
            write_router(router, run, run / "nginx.conf",
                         FrontConfig(serves=(), workers=args.workers))
            pin = ("taskset", "-c", str(on[name])) if args.pin else ()
            procs.append(start_nginx(run / "nginx.conf", run, tmp / f"{name}-nginx.log", pin))
            nginx[name] = procs[-1].pid
        while not sock.exists():
            time.sleep(0.01)
        sock.chmod(0o777)
        for port, token in ((b_port, CAROL), (a_port, ALICE)):
            until_answered(port, token, tmp)
        # the first answers of each side (nginx's workers, the stand-in) before any is timed
        for port, token in ((a_port, ALICE), (b_port, CAROL)):
            clients(port, 2, 20, BODY, token=token)
        sides = {"a->b": (a_port, ALICE), "b": (b_port, CAROL)}
        n = args.clients
        print(f"nginx: {args.workers} worker(s) each; {args.rounds} rounds; {n} clients"
              + (f"; A and the clients on CPU {on['a']}, B and the stand-in on CPU {on['b']}"
                 if args.pin else ""), flush=True)
        got: dict[tuple[str, str], list[float]] = {}

        def keep(figure: str, side: str, value: float) -> None:
            got.setdefault((figure, side), []).append(value)

        for i in range(args.rounds):
            order = list(sides)
            random.shuffle(order)
            for side in order:
                port, token = sides[side]
                lat, _, _ = clients(port, 1, args.requests, BODY, token=token)
                keep("p50_ms", side, 1000 * statistics.median(lat))
                keep("p99_ms", side, 1000 * pct(lat, 0.99))
                cpu0 = {name: tree_cpu(pid) for name, pid in nginx.items()}
                lat, _, wall = clients(port, n, max(5, 2 * args.requests // n), BODY, token=token)
                keep("requests_per_s", side, len(lat) / wall)
                for name, pid in nginx.items():
                    keep(f"nginx_{name}_cpu_us", side, 1e6 * (tree_cpu(pid) - cpu0[name])
                         / len(lat))
                _, events, wall = clients(port, n, 2, STREAM, stream=True, token=token)
                keep("tokens_per_s", side, events / wall)
            print(f"round {i + 1}: " + "; ".join(
                f"{side} p50 {got[('p50_ms', side)][-1]:.3f} ms, "
                f"{got[('requests_per_s', side)][-1]:.0f} req/s" for side in sides), flush=True)

        print(f"\n{'figure':<16} {'clients':>7} {'b direct':>10} {'a->b':>10} {'a->b vs b':>12}")
        for figure, count in (("p50_ms", 1), ("p99_ms", 1), ("requests_per_s", n),
                              ("tokens_per_s", n), ("nginx_a_cpu_us", n),
                              ("nginx_b_cpu_us", n)):
            direct, hop = (statistics.median(got[(figure, side)]) for side in ("b", "a->b"))
            vs = (f"{hop / direct:.3f}x" if figure.endswith("_per_s")
                  else f"{hop - direct:+.3f} {figure.rpartition('_')[2]}")
            print(f"{figure:<16} {count:>7} {direct:>10.3f} {hop:>10.3f} {vs:>12}")

        print("\nanswered at A without forwarding (its own answer, no connection tried):")
        body_gone = json.dumps({"model": "gone", "prompt": "x", "max_tokens": 1}).encode()
        body_none = json.dumps({"model": "nowhere", "prompt": "x", "max_tokens": 1}).encode()
        conn = http.client.HTTPConnection("127.0.0.1", a_port, timeout=10)
        conn.request("POST", "/v1/completions", body=body_gone, headers={
            "Authorization": f"Bearer {ALICE}", "Content-Type": "application/json"})
        resp = conn.getresponse()
        print(f"  gone: {resp.status}, Retry-After {resp.getheader('Retry-After')}: "
              f"{resp.read().decode()[:200]}")
        conn.close()
        for what, body, status in (("peer d's circuit open: 503", body_gone, 503),
                                   ("no such model: 404", body_none, 404)):
            for count in (1, n):
                lat, _, wall = clients(a_port, count, max(5, args.requests // count) * args.rounds,
                                       body, token=ALICE, status=status)
                print(f"  {what:<28} {count:>3} client(s): p50 "
                      f"{1000 * statistics.median(lat):.3f} ms, p99 {1000 * pct(lat, 0.99):.3f} "
                      f"ms, {len(lat) / wall:.0f} answers/s")
    finally:
        stop_all(procs, tmp)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
