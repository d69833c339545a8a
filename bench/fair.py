"""Who is asking (docs/router.md), measured side by side in one run.

    .venv/bin/python bench/fair.py [--polite N] [--rounds N] [--requests N]

1. Fairness through the engine: one stand-in with vLLM's scheduler (--max-num-seqs 8,
   --scheduling-policy priority: gpud.testing.standin's _Engine, as vllm 0.32's), streams of 20
   tokens 0.01 s apart, behind three routers (nginx with the config gpud generates, each its
   own instance, all before the same stand-in) that differ only in their keys file:
     fcfs      greedy and polite keys, no limits, equal priority, the router not told of the
               serve's priority policy: vLLM's first come first served
     share     the same keys, no setting, the router told of the policy: each requester's
               first request in flight goes ahead of everyone's others (gpud.core.router
               FAIR_BODY)
     limit     the greedy key with max_concurrent = 7 (a place is always left)
     priority  the polite key with priority = -1 (the router sets the body's priority)
   A greedy key keeps 64 streams going (one after another on each of 64 connections; a 429 is
   asked again 50 ms later); a polite key sends one stream at a time, --polite of them. Printed:
   the polite key's median latency (to the stream's end) alone and beside the greedy key under
   each router, and their ratio to alone (target <= 2x); the greedy key's answers.
2. The cost of limits and usage: a router with keys, both limits set (never reached) and the
   usage meter, against the router without keys and without the meter (as before them); and
   the share of a serve under --scheduling-policy priority (no keys: the body's priority one
   step behind past a requester's first request in flight) against the same, each
   its own nginx before one stand-in (no --max-num-seqs bound). --rounds rounds in a shuffled
   order of --requests non-streamed completions from one client on a keep-alive connection:
   the p50 of each round, and nginx's CPU per request (its master and workers, schedstat);
   medians over rounds. Target: <= 0.1 ms p50 added, <= 5 % CPU per request. With --old REV,
   the keyed sides as REV's gpud renders them too (`git archive` of REV unpacked in a temporary
   directory), in the same rounds: before and after side by side.

Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.front import NGINX, free_port, revision_tree, tree_cpu

REPO = Path(__file__).resolve().parents[1]
NJS = REPO / ".venv" / "lib" / "nginx" / "modules" / "ngx_http_js_module.so"
GREEDY, POLITE = "sk-greedy-0123456789", "sk-polite-0123456789"
STREAM = {"model": "m", "prompt": "a b c d e f g h", "max_tokens": 20, "stream": True}
PLAIN = json.dumps({"model": "m", "prompt": "hello there", "max_tokens": 1}).encode()


# The router's config and script as the gpud of a tree renders them (run there: cwd, so that a
# tree of another revision renders its own): argv out dir, port, the serve's socket, the njs
# module, the keys file ("" none), "meter" or "", "priority" or "".
RENDER = """
import sys
from pathlib import Path
from gpud.core.front import FrontConfig, render
from gpud.core.router import RoutedServe, RouterFront
try:
    from gpud.core.keys import parse_keys
    from gpud.core.routerconf import METER, http_lines, main_lines
except ImportError:  # a tree from before gpud.core.routerconf
    from gpud.core.router import METER, http_lines, main_lines, parse_keys
from gpud.nginx.router import script_text
out, port, sock, njs, keys, meter, priority = sys.argv[1:]
parsed = None
if keys:
    found, problems = parse_keys(Path(keys).read_text(), ["m"])
    assert not problems, problems
    parsed = tuple(found)
router = RouterFront(f"127.0.0.1:{port}", (RoutedServe("s", ("m",), socket=sock,
                                                      priority_scheduling=bool(priority)),),
                     njs_module=njs, script=str(Path(out) / "router.js"), keys=parsed,
                     access_log=str(Path(out) / "router.log"))
lines = [line for line in http_lines(router) if meter or line != METER]
(Path(out) / "router.js").write_text(script_text(router))
(Path(out) / "nginx.conf").write_text(render(FrontConfig(
    serves=(), run_dir=str(Path(out) / "run"), workers=2,
    main_extra=tuple(main_lines(router)), http_extra=tuple(lines))))
"""


def keys_text(greedy: str = "", polite: str = "") -> str:
    return (f'[keys.greedy]\ntoken = "{GREEDY}"\nmodels = ["*"]\n{greedy}'
            f'[keys.polite]\ntoken = "{POLITE}"\nmodels = ["*"]\n{polite}')


class Router:
    """One nginx with the router gpud renders, before the stand-in on SOCK."""

    def __init__(self, tmp: Path, name: str, sock: Path, keys: str | None,
                 meter: bool = True, priority: bool = False, tree: Path = REPO) -> None:
        self.dir = tmp / name
        run = self.dir / "run"
        run.mkdir(parents=True)
        self.dir.chmod(0o755)
        self.port = free_port()
        keys_file = ""
        if keys is not None:
            (self.dir / "keys.toml").write_text(keys)
            keys_file = str(self.dir / "keys.toml")
        subprocess.run([sys.executable, "-c", RENDER, str(self.dir), str(self.port), str(sock),
                        str(NJS), keys_file, "meter" if meter else "",
                        "priority" if priority else ""], cwd=tree, check=True)
        self.proc = subprocess.Popen([str(NGINX), "-c", str(self.dir / "nginx.conf"), "-p",
                                      f"{run}/"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)

    def ready(self, token: str) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if ask(self.port, token, PLAIN)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise SystemExit(f"router on {self.port} not answering")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def ask(port: int, token: str | None, body: bytes,
        conn: http.client.HTTPConnection | None = None) -> tuple[int, float]:
    """(status, seconds to the answer's end) of one POST /v1/completions."""
    own = conn is None
    c = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", body=body, headers=headers)
    resp = c.getresponse()
    resp.read()
    took = time.perf_counter() - t0
    if own:
        c.close()
    return resp.status, took


def standin(sock: Path, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "gpud.testing.standin", "serve", "m",
                             "--uds", str(sock), *args], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_sock(sock: Path) -> None:
    while not sock.exists():
        time.sleep(0.01)
    sock.chmod(0o777)


def polite_run(port: int, n: int) -> list[float]:
    body = json.dumps(STREAM).encode()
    out = []
    for _ in range(n):
        status, took = ask(port, POLITE, body)
        if status != 200:
            raise SystemExit(f"polite: status {status}")
        out.append(took)
    return out


def greedy_load(port: int, stop: threading.Event, answers: Counter[int]) -> list[threading.Thread]:
    body = json.dumps(STREAM).encode()
    lock = threading.Lock()

    def one() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        while not stop.is_set():
            try:
                status, _ = ask(port, GREEDY, body, conn)
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
                continue
            with lock:
                answers[status] += 1
            if status == 429:
                time.sleep(0.05)
        conn.close()

    threads = [threading.Thread(target=one) for _ in range(64)]
    for t in threads:
        t.start()
    return threads


def fairness(n_polite: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="gpud-fair-bench-"))
    tmp.chmod(0o755)
    sock = tmp / "s.sock"
    serve = standin(sock, "--max-num-seqs", "8", "--scheduling-policy", "priority",
                    "--token-interval-s", "0.01")
    routers: dict[str, Router] = {}
    try:
        wait_sock(sock)
        routers = {"fcfs": Router(tmp, "fcfs", sock, keys_text()),
                   "share": Router(tmp, "share", sock, keys_text(), priority=True),
                   "limit": Router(tmp, "limit", sock, keys_text(greedy="max_concurrent = 7\n")),
                   "priority": Router(tmp, "priority", sock, keys_text(polite="priority = -1\n"),
                                      priority=True)}
        for r in routers.values():
            r.ready(POLITE)
        alone = polite_run(routers["fcfs"].port, n_polite)
        rows = []
        order = list(routers)
        random.shuffle(order)
        for name in order:
            stop, answers = threading.Event(), Counter[int]()
            threads = greedy_load(routers[name].port, stop, answers)
            time.sleep(2)  # the engine full, its queue long
            began = time.monotonic()
            beside = polite_run(routers[name].port, n_polite)
            took = time.monotonic() - began
            stop.set()
            for t in threads:
                t.join(timeout=120)
            rows.append((name, beside, dict(answers), took))
        base = statistics.median(alone)
        print(f"\n1. fairness: stand-in --max-num-seqs 8, streams of {STREAM['max_tokens']} "
              f"tokens; greedy 64 streams, polite {n_polite} one at a time")
        print(f"{'router':<10} {'polite p50 s':>12} {'x alone':>8} {'target':>7} "
              f"{'greedy answers (in the same time)':>34}")
        print(f"{'alone':<10} {base:>12.3f} {1.0:>8.2f} {'':>7}")
        for name, beside, counted, took in sorted(rows):
            p50 = statistics.median(beside)
            verdict = "ok" if p50 <= 2 * base else "MISS"
            shown = ", ".join(f"{k}: {v}" for k, v in sorted(counted.items()))
            print(f"{name:<10} {p50:>12.3f} {p50 / base:>8.2f} {'<= 2x':>7} {verdict:>5}  "
                  f"{shown} in {took:.1f} s")
    finally:
        for r in routers.values():
            r.stop()
        serve.terminate()
        serve.wait(timeout=10)
        shutil.rmtree(tmp)


def overhead(rounds: int, requests: int, old: str | None) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="gpud-fair-bench-"))
    tmp.chmod(0o755)
    sock = tmp / "s.sock"
    serve = standin(sock)
    sides: dict[str, Router] = {}
    trees = {"": REPO}
    if old is not None:
        trees[f" ({old})"] = revision_tree(old, tmp / "old")
    try:
        wait_sock(sock)
        limits = "max_concurrent = 65535\nrequests_per_minute = 1000000\n"
        sides = {"without keys": Router(tmp, "plain", sock, None, meter=False),
                 # the serve under --scheduling-policy priority: each requester's share first
                 "share (no keys)": Router(tmp, "share", sock, None, meter=False,
                                           priority=True)}
        for tag, tree in trees.items():
            d = "-old" if tag else ""
            sides |= {
                f"keys{tag}": Router(tmp, f"keys{d}", sock, keys_text(), meter=False,
                                     tree=tree),
                f"keys+limits{tag}": Router(tmp, f"limits{d}", sock,
                                            keys_text(greedy=limits, polite=limits),
                                            meter=False, tree=tree),
                f"keys+limits+usage{tag}": Router(tmp, f"keyed{d}", sock,
                                                  keys_text(greedy=limits, polite=limits),
                                                  tree=tree)}
        tokens = {name: POLITE if name.startswith("keys") else None for name in sides}
        for name, r in sides.items():
            r.ready(tokens[name] or POLITE)
        p50: dict[str, list[float]] = {n: [] for n in sides}
        cpu: dict[str, list[float]] = {n: [] for n in sides}
        for _ in range(rounds):
            order = list(sides)
            random.shuffle(order)
            for name in order:
                r = sides[name]
                conn = http.client.HTTPConnection("127.0.0.1", r.port, timeout=60)
                ask(r.port, tokens[name], PLAIN, conn)  # the connection up
                c0 = tree_cpu(r.proc.pid)
                lat = [ask(r.port, tokens[name], PLAIN, conn)[1] for _ in range(requests)]
                cpu[name].append(1e6 * (tree_cpu(r.proc.pid) - c0) / requests)
                conn.close()
                p50[name].append(statistics.median(lat) * 1000)
        print(f"\n2. limits and usage: 1 client, {requests} non-streamed requests x {rounds} "
              "rounds (medians over rounds; each router its own nginx, 2 workers)")
        print(f"{'router':<28} {'p50 ms':>8} {'nginx CPU us/request':>21} "
              f"{'p50 vs without keys':>20} {'CPU vs without keys':>20}")
        b50, bcpu = statistics.median(p50["without keys"]), statistics.median(cpu["without keys"])
        for name in sides:
            m50, mcpu = statistics.median(p50[name]), statistics.median(cpu[name])
            print(f"{name:<28} {m50:>8.3f} {mcpu:>21.1f} {m50 - b50:>+17.3f} ms "
                  f"{100 * (mcpu - bcpu) / bcpu:>+18.1f} %")
        if old is not None:
            # each round measures both trees one after the other: the median of the rounds'
            # ratios leaves out the machine's drift between rounds
            print(f"\nthis tree against {old}, CPU per request, median of the {rounds} rounds' "
                  "ratios (min-max)")
            for name in ("keys", "keys+limits", "keys+limits+usage"):
                ratios = [a / b for a, b in zip(cpu[name], cpu[f"{name} ({old})"], strict=True)]
                print(f"{name:<28} {statistics.median(ratios):>6.3f}x "
                      f"({min(ratios):.3f}-{max(ratios):.3f})")
        added = statistics.median(p50["keys+limits+usage"]) - b50
        more = 100 * (statistics.median(cpu["keys+limits+usage"]) - bcpu) / bcpu
        print(f"keys+limits+usage against the router without keys: p50 {added:+.3f} ms "
              f"(target <= 0.1 ms: {'ok' if added <= 0.1 else 'MISS'}); CPU per request "
              f"{more:+.1f} % (target <= 5 %: {'ok' if more <= 5 else 'MISS'})")
    finally:
        for r in sides.values():
            r.stop()
        serve.terminate()
        serve.wait(timeout=10)
        shutil.rmtree(tmp)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--polite", type=int, default=10, help="polite requests per side")
    p.add_argument("--rounds", type=int, default=5, help="of the overhead (0: none)")
    p.add_argument("--requests", type=int, default=300, help="per round of the overhead")
    p.add_argument("--old", help="a revision whose keyed routers are measured beside these")
    args = p.parse_args()
    print(f"host: {os.cpu_count()} CPUs; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    if args.polite:
        fairness(args.polite)
    if args.rounds:
        overhead(args.rounds, args.requests, args.old)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
