"""The router's budget per request body (issue 41, H2/H3): old code and new side by side in
one run, each its own nginx (the config and script its tree's gpud renders) before the same
stand-in.

    .venv/bin/python bench/router_body.py [--old e8f41a4] [--mib 16] [--loop-s 6]

For each side: nginx's worker CPU per MiB of a body of small JSON objects with no top-level
`model` (the router reads it and answers 400 itself: no serve involved), the workers' peak
resident memory (VmHWM) after those bodies, and another client's median and 95th percentile
latency of a small completion alone and beside two clients each sending such a body every
second; the old side is `git archive` of --old unpacked in a temporary directory. Not a
test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.front import NGINX, free_port, revision_tree, standin, tree_cpu

REPO = Path(__file__).resolve().parents[1]
NJS = REPO / ".venv" / "lib" / "nginx" / "modules" / "ngx_http_js_module.so"
SMALL = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 1}).encode()

# Run in a tree: its gpud renders the router's nginx.conf and script into argv[1].
RENDER = """
import sys
from pathlib import Path
from gpud.core.front import FrontConfig, render
from gpud.core.router import RoutedServe, RouterFront
try:
    from gpud.core.routerconf import http_lines, main_lines
except ImportError:  # a tree from before gpud.core.routerconf
    from gpud.core.router import http_lines, main_lines
from gpud.nginx.front import front_workers
from gpud.nginx.router import script_text
out, port, sock, njs = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
router = RouterFront(f"127.0.0.1:{port}", (RoutedServe("m", ("m",), socket=sock),),
                     njs_module=njs, script=str(out / "router.js"),
                     gpud_socket=str(out / "no-gpud.sock"))
(out / "router.js").write_text(script_text(router))
(out / "nginx.conf").write_text(render(FrontConfig(
    serves=(), run_dir=str(out / "run"), workers=front_workers(),
    main_extra=tuple(main_lines(router)), http_extra=tuple(http_lines(router)))))
"""

# One client looping a body (argv[2]) to the router on port argv[1], one every second at
# most (the same load on both sides: unpaced, a side that answers sooner is sent more).
HOG = """
import http.client, sys, time
port, body = int(sys.argv[1]), open(sys.argv[2], "rb").read()
while True:
    began = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", body=body,
                 headers={"Content-Type": "application/json"})
    conn.getresponse().read()
    conn.close()
    time.sleep(max(0.0, 1.0 - (time.monotonic() - began)))
"""


def small_objects(mib: int) -> bytes:
    part = b'{"role":"user","content":"x"},'
    return b'{"messages":[' + part * ((mib << 20) // len(part)) + b'{}],"max_tokens":1}'


def post(port: int, body: bytes, timeout: float = 120) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body=body,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def workers(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def latency_ms(port: int, seconds: float) -> tuple[float, float]:
    """The median and the 95th percentile of a small completion's latency over SECONDS."""
    took: list[float] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        began = time.perf_counter()
        post(port, SMALL)
        took.append((time.perf_counter() - began) * 1000)
    return statistics.median(took), statistics.quantiles(took, n=20)[-1]


class Side:
    def __init__(self, name: str, tree: Path, sock: str) -> None:
        self.name = name
        self.dir = Path(tempfile.mkdtemp(prefix=f"gpud-bench-{name.split()[0]}-"))
        self.dir.chmod(0o755)
        for sub in ("run", "run/body", "run/proxy", "run/fastcgi", "run/uwsgi", "run/scgi"):
            (self.dir / sub).mkdir()
        self.port = free_port()
        subprocess.run([sys.executable, "-c", RENDER, str(self.dir), str(self.port), sock,
                        str(NJS)], cwd=tree, check=True)
        self.nginx = subprocess.Popen([str(NGINX), "-c", str(self.dir / "nginx.conf"),
                                       "-p", f"{self.dir / 'run'}/"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                if post(self.port, SMALL) == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{name}: the router does not answer")
            time.sleep(0.1)

    def close(self) -> None:
        self.nginx.terminate()
        self.nginx.wait(timeout=10)
        shutil.rmtree(self.dir)


def measure(side: Side, body: bytes, mib: int, loop_s: float) -> dict[str, float]:
    figures: dict[str, float] = {}
    alone = latency_ms(side.port, 3)
    cpu0 = tree_cpu(side.nginx.pid)
    statuses = [post(side.port, body) for _ in range(3)]
    figures["worker_cpu_ms_per_mib"] = (tree_cpu(side.nginx.pid) - cpu0) * 1000 / (3 * mib)
    figures["peak_rss_mib"] = max(hwm_mib(p) for p in workers(side.nginx.pid))
    # the large-body clients in processes of their own (not this one's threads: the GIL
    # would be measured with them)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        f.write(body)
        f.flush()
        hogs = [subprocess.Popen([sys.executable, "-c", HOG, str(side.port), f.name])
                for _ in range(2)]
        time.sleep(1)
        beside = latency_ms(side.port, loop_s)
        for hog in hogs:
            hog.terminate()
            hog.wait(timeout=30)
    figures["other_median_ms_alone"], figures["other_p95_ms_alone"] = alone
    figures["other_median_ms_beside"], figures["other_p95_ms_beside"] = beside
    figures["large_body_status"] = float(statuses[-1])
    return figures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", default="e8f41a4")
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--loop-s", type=float, default=6)
    args = ap.parse_args()
    old = revision_tree(args.old)
    serve_dir = Path(tempfile.mkdtemp(prefix="gpud-bench-serve-"))
    serve_dir.chmod(0o755)
    sock = str(serve_dir / "m.sock")
    serve = standin("--uds", sock)
    sides: list[Side] = []
    try:
        deadline = time.monotonic() + 20
        while not Path(sock).exists():
            if time.monotonic() > deadline:
                raise SystemExit("the stand-in did not start")
            time.sleep(0.1)
        Path(sock).chmod(0o777)
        sides = [Side(f"old ({args.old})", old, sock), Side("new", REPO, sock)]
        body = small_objects(args.mib)
        results = {side.name: measure(side, body, args.mib, args.loop_s) for side in sides}
    finally:
        for side in sides:
            side.close()
        serve.terminate()
        serve.wait(timeout=10)
        shutil.rmtree(old)
        shutil.rmtree(serve_dir)
    print(f"a body of {args.mib} MiB of small objects, no top-level model "
          f"({len(body)} bytes)")
    names = list(results)
    print(f"{'figure':28}" + "".join(f"{n:>20}" for n in names))
    for key in results[names[0]]:
        print(f"{key:28}" + "".join(f"{results[n][key]:>20.1f}" for n in names))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
