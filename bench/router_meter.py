"""What the usage meter costs, and why (docs/router.md, "Who is asking"), side by side in one run.

    .venv/bin/python bench/router_meter.py [--rounds N] [--requests N]

Four routers (nginx with the config gpud renders, keys and both limits set, never reached), each
its own nginx before one stand-in, that differ only in the serve location's body filter:
    no filter     the meter left out
    meter         router.js `meter` (the serve's usage read as its answer passes)
    empty filter  a filter that passes each buffer on and reads nothing, in a module of its own
                  (js_import at the location: a VM of that module alone)
    meter apart   `meter` alone in a module of its own
--rounds rounds in a shuffled order of --requests non-streamed completions from one client on a
keep-alive connection; nginx's CPU per request (master and workers, schedstat) and the p50,
medians over rounds. If the empty filter costs what the meter does, the meter's cost is the VM
njs makes for a filter after the router's internal redirect (njs 0.7.9: ngx_http_js_body_filter
calls ngx_http_js_init_vm for a request whose context the redirect cleared; njs_vm_clone ->
njs_vm_init -> njs_builtin_objects_clone copies the built-in objects), not the reading.

Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import http.client
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fair import PLAIN, POLITE, REPO, Router, ask, keys_text, standin, wait_sock
from bench.front import NGINX, tree_cpu

METER = "js_body_filter router.meter buffer_type=buffer;"
EMPTY = "function meter(r, data, flags) {\n    r.sendBuffer(data, flags);\n}\n"


def apart(router: Router, module: Path) -> None:
    """ROUTER's serve locations with MODULE's `meter` as their filter, nginx started again."""
    conf = router.dir / "nginx.conf"
    conf.write_text(conf.read_text().replace(
        METER, f"js_import meter from {module};\n            "
               "js_body_filter meter.meter buffer_type=buffer;"))
    router.proc.terminate()
    router.proc.wait(timeout=10)
    router.proc = subprocess.Popen([str(NGINX), "-c", str(conf), "-p", f"{router.dir}/run/"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--requests", type=int, default=300)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gpud-meter-bench-"))
    tmp.chmod(0o755)
    sock = tmp / "s.sock"
    serve = standin(sock)
    limits = "max_concurrent = 65535\nrequests_per_minute = 1000000\n"
    keys = keys_text(greedy=limits, polite=limits)
    code = (REPO / "gpud" / "data" / "router.js").read_text()
    (tmp / "meter.js").write_text(
        code[code.index("var TOKENS_RE"):code.index("// The serve's answer to a stream")]
        + "\nexport default {meter};\n")
    (tmp / "empty.js").write_text(EMPTY + "\nexport default {meter};\n")
    sides: dict[str, Router] = {}
    try:
        wait_sock(sock)
        sides = {"no filter": Router(tmp, "none", sock, keys, meter=False),
                 "meter": Router(tmp, "meter", sock, keys),
                 "empty filter": Router(tmp, "empty", sock, keys),
                 "meter apart": Router(tmp, "apart", sock, keys)}
        apart(sides["empty filter"], tmp / "empty.js")
        apart(sides["meter apart"], tmp / "meter.js")
        for r in sides.values():
            r.ready(POLITE)
        cpu: dict[str, list[float]] = {n: [] for n in sides}
        p50: dict[str, list[float]] = {n: [] for n in sides}
        for _ in range(args.rounds):
            order = list(sides)
            random.shuffle(order)
            for name in order:
                r = sides[name]
                conn = http.client.HTTPConnection("127.0.0.1", r.port, timeout=60)
                ask(r.port, POLITE, PLAIN, conn)
                c0 = tree_cpu(r.proc.pid)
                lat = [ask(r.port, POLITE, PLAIN, conn)[1] for _ in range(args.requests)]
                cpu[name].append(1e6 * (tree_cpu(r.proc.pid) - c0) / args.requests)
                p50[name].append(statistics.median(lat) * 1000)
                conn.close()
        base = statistics.median(cpu["no filter"])
        print(f"1 client, {args.requests} non-streamed requests x {args.rounds} rounds "
              "(medians over rounds)")
        print(f"{'router':<14} {'p50 ms':>8} {'nginx CPU us/request':>21} {'vs no filter':>13}")
        for name in sides:
            c = statistics.median(cpu[name])
            print(f"{name:<14} {statistics.median(p50[name]):>8.3f} {c:>21.1f} "
                  f"{100 * (c - base) / base:>+12.1f}%")
    finally:
        for r in sides.values():
            r.stop()
        serve.terminate()
        serve.wait(timeout=10)
        shutil.rmtree(tmp)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
