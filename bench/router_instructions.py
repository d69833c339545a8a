"""The router's instructions per request (valgrind's callgrind), this tree beside another.

    .venv/bin/python bench/router_instructions.py [--old REV] [--requests N]

Each router of bench/fair.py's second part (without keys, keys, keys+limits, keys+limits+usage)
as this tree's gpud renders it and as REV's (`git archive` of REV), one nginx at a time in one
process (master_process off) under callgrind, before one stand-in: N non-streamed completions
from one client on a keep-alive connection after 30 to warm it, the count zeroed before them
and dumped after (callgrind_control). Printed: the instructions nginx ran per request, and this
tree's over REV's. A count, not a time: the same on a busy host, where the CPU time per request
of bench/fair.py moves by a few percent between runs; it leaves out the kernel's share and the
cost of cache misses. Needs valgrind.

Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import http.client
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fair import NJS, PLAIN, POLITE, RENDER, ask, keys_text, standin, wait_sock
from bench.front import NGINX, free_port, revision_tree

REPO = Path(__file__).resolve().parents[1]
LIMITS = "max_concurrent = 65535\nrequests_per_minute = 1000000\n"
# name -> (keys file, the meter)
KINDS = {"without keys": (None, False), "keys": (keys_text(), False),
         "keys+limits": (keys_text(greedy=LIMITS, polite=LIMITS), False),
         "keys+limits+usage": (keys_text(greedy=LIMITS, polite=LIMITS), True)}


def instructions(tree: Path, out: Path, sock: Path, keys: str | None, meter: bool,
                 requests: int) -> float:
    """Instructions per request of the router TREE renders (its files in OUT)."""
    (out / "run").mkdir(parents=True)
    out.chmod(0o755)
    port = free_port()
    keys_file = ""
    if keys is not None:
        (out / "keys.toml").write_text(keys)
        keys_file = str(out / "keys.toml")
    subprocess.run([sys.executable, "-c", RENDER, str(out), str(port), str(sock), str(NJS),
                    keys_file, "meter" if meter else "", ""], cwd=tree, check=True)
    conf = out / "nginx.conf"
    text = conf.read_text()
    assert "worker_processes 2;" in text
    conf.write_text(text.replace("worker_processes 2;", "master_process off;"))
    dump = out / "callgrind.out"
    proc = subprocess.Popen(["valgrind", "--tool=callgrind", f"--callgrind-out-file={dump}",
                             str(NGINX), "-c", str(conf), "-p", f"{out}/run/"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    token = None if keys is None else POLITE
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if ask(port, token, PLAIN)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"router of {tree} not answering")
            time.sleep(0.3)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        for _ in range(30):
            ask(port, token, PLAIN, conn)
        subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True,
                       capture_output=True)
        for _ in range(requests):
            if ask(port, token, PLAIN, conn)[0] != 200:
                raise SystemExit("a request was not answered 200")
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True,
                       capture_output=True)
        conn.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    # the dump asked for (callgrind_control -d): the file's first part, ".1"
    lines = Path(f"{dump}.1").read_text(errors="replace").splitlines()
    total = next(int(line.split()[1]) for line in lines
                 if line.startswith(("summary:", "totals:")))
    return total / requests


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--old", default="3647af2", help="the revision measured beside this tree")
    p.add_argument("--requests", type=int, default=1000)
    args = p.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("valgrind (callgrind) is needed")
    tmp = Path(tempfile.mkdtemp(prefix="gpud-router-instructions-"))
    tmp.chmod(0o755)
    sock = tmp / "s.sock"
    serve = standin(sock)
    try:
        wait_sock(sock)
        old = revision_tree(args.old, tmp / "old")
        print(f"{args.requests} non-streamed completions per router, instructions per request")
        print(f"{'router':<20} {'this tree':>12} {args.old:>12} {'ratio':>7}")
        for i, (name, (keys, meter)) in enumerate(KINDS.items()):
            this = instructions(REPO, tmp / f"this{i}", sock, keys, meter, args.requests)
            then = instructions(old, tmp / f"old{i}", sock, keys, meter, args.requests)
            print(f"{name:<20} {this:>12,.0f} {then:>12,.0f} {this / then:>7.3f}", flush=True)
    finally:
        serve.terminate()
        serve.wait(timeout=10)
        shutil.rmtree(tmp)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
