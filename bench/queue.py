"""The router's queue (docs/router.md, "Queue instead of thrash"), measured side by side in one run.

    .venv/bin/python bench/queue.py [--rounds N] [--changes N] [--old REV] [--no-sandbox]

1. Backfill, under real systemd in the sandbox (root; booted as gpud-queuebench, powered off at
   the end): a and b on demand at 20000 MiB each (one fits at a time, router.min_awake_s 300),
   chat on demand at 6000 MiB (fits beside either). Key u1 keeps a busy with one stream and
   has 16 requests waiting for b; then key u2 asks for chat. Printed per round: u2's latency
   (chat started and answered) beside the requests of u1's still waiting for b; then chat is
   stopped for the next round. (The layout of tests/integration/test_backfill.py, at the
   issue's scale; chat is started here, not woken.)
2. The cost of a change in gpud: OnDemand (gpud.server.ondemand) with a fake service and
   supervisor in this process (no I/O), W requests waiting for each of 10 serves: 1000 waiting
   (100 each) against 10 (1 each). --changes changes (`OnDemand.changed`, naming a serve as a
   stored state does where the code takes a name), each followed by the event loop running
   until idle; the process CPU per change, and their ratio. Two layouts: "one role", the 10
   serves on one device beside a (running, protected by min_awake_s), the change a's (it
   concerns every waiting serve); "ten roles", each serve wI on a device of its own beside aI,
   the change a5's (it concerns w5 alone). With --old REV, REV's gpud (`git archive`) is
   measured the same way in a child process, beside it.

Not a test: nothing is asserted.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this file's folder comes first on the path, and this file is bench/queue.py:
# the standard library's queue (which asyncio and hypothesis import) must not be this file.
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import asyncio
import importlib
import inspect
import json
import shlex
import statistics
import subprocess
import tempfile
import time
from dataclasses import replace
from types import ModuleType, SimpleNamespace
from typing import Any, cast

REPO = Path(__file__).resolve().parents[1]


# ---- 2. the cost of a change ---------------------------------------------------------------

def one_role(mod: ModuleType) -> tuple[Any, str]:
    """OnDemand, with a running on role r (protected) and w0..w9 waiting there; the change's
    serve (a)."""
    from gpud.core.serverecord import Put
    from gpud.core.vocab import ServeState

    # the fakes of tests/test_queue_waits.py (a role of 31607 MiB, starts that fit or are
    # refused for memory), loaded by name: the tests are no part of what is type-checked here
    fakes = importlib.import_module("tests.test_queue_waits")
    clock = importlib.import_module("tests.test_bringup").Clock
    Room, Admits, spec = fakes.Room, fakes.Admits, fakes.spec

    svc = Room(clock())
    serves = {"a": spec(20000), **{f"w{i}": spec(20000) for i in range(10)}}
    svc.config = SimpleNamespace(
        router=SimpleNamespace(max_queued=10000, queue_timeout_s=3600, min_awake_s=1e6),
        serves=serves)
    svc.serve_spec = lambda name: svc.config.serves[name]
    svc.set("a", ServeState.RUNNING)
    od = mod.OnDemand(cast(Any, svc), cast(Any, Admits(svc)), clock=time.monotonic)
    now = time.monotonic()
    svc.records.apply("a", Put(demand=replace(svc.records.demand("a"), up_at=now)))
    return od, "a"


def ten_roles(_mod: ModuleType) -> tuple[Any, str]:
    """OnDemand, with aI running on role rI (protected) and wI to wait there, I in 0..9 (the
    rig of tests/test_wakeups.py); the change's serve (a5)."""
    od, svc, _sup = importlib.import_module("tests.test_wakeups").rig(10)
    svc.config.router.max_queued, svc.config.router.queue_timeout_s = 10000, 3600
    return od, "a5"


LAYOUTS = {"one role": one_role, "ten roles": ten_roles}


async def cost_of_a_change(layout: str, per_serve: int, changes: int) -> tuple[float, float]:
    """CPU seconds per change with PER_SERVE requests waiting for each of 10 serves, and the
    waiting serves' looks per change (their waits on `changes` begun again)."""
    import gpud.server.ondemand as mod
    od, changing = LAYOUTS[layout](mod)
    # a change names its serve where the code takes a name (before: it named none)
    named = len(inspect.signature(od.changed).parameters) > 0
    waiting = [asyncio.ensure_future(od.ensure(f"w{i}"))
               for i in range(10) for _ in range(per_serve)]
    while sum(len(v) for v in od.queued.values()) < 10 * per_serve:
        await asyncio.sleep(0.01)
    await asyncio.sleep(1.5)  # past the first retry's hold: the waits settled

    async def idle() -> None:
        for _ in range(50):
            await asyncio.sleep(0)
    await idle()
    began, looks = time.process_time(), od.changes.looks
    for _ in range(changes):
        if named:
            od.changed((changing,))
        else:
            od.changed()
        await idle()
    cpu = (time.process_time() - began) / changes
    looked = (od.changes.looks - looks) / changes
    for w in waiting:
        w.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    return cpu, looked


def part2(changes: int, old: str | None, label: str = "now") -> None:
    for layout in LAYOUTS:
        many, many_looks = asyncio.run(cost_of_a_change(layout, 100, changes))
        few, few_looks = asyncio.run(cost_of_a_change(layout, 1, changes))
        print(f"cost of a change ({label}, {layout}): 1000 waiting across 10 serves "
              f"{many * 1e3:.3f} ms CPU ({many_looks:g} looks), 10 waiting {few * 1e3:.3f} ms "
              f"CPU ({few_looks:g} looks), ratio {many / few:.1f}", flush=True)
    if old is not None:
        # REV's gpud, unpacked beside this one, measured by this file in a child process (the
        # fakes, tests/, are this tree's)
        with tempfile.TemporaryDirectory() as tree:
            subprocess.run(f"git archive {shlex.quote(old)} gpud | tar -x -C {tree}",
                           shell=True, cwd=REPO, check=True)
            subprocess.run([sys.executable, __file__, "--no-sandbox", "--changes", str(changes),
                            "--gpud-from", tree, "--label", old], check=True)


# ---- 1. backfill in the sandbox --------------------------------------------------------------

def part1(rounds: int) -> None:
    from tests.integration.gpudctl import SandboxGpud, fronted_gpud
    from tests.integration.test_backfill import KEYS, ROUTER, TOKENS, U1, U2, config, curl
    from tests.waiting import wait_until
    from tools.sandbox import Sandbox

    waiting_n = 16
    sb = Sandbox(name="gpud-queuebench")
    sb.boot()
    try:
        gpud = SandboxGpud(sb)
        keys = (f'[keys.u1]\ntoken = "{TOKENS[U1]}"\nmodels = ["a", "b"]\n'
                f'[keys.u2]\ntoken = "{TOKENS[U2]}"\nmodels = ["chat"]\n')
        sb.run(["bash", "-c", f"umask 077; cat > {KEYS}"], input=keys)
        text = config().replace("min_awake_s = 120", "min_awake_s = 300").replace(
            "max_queued = 16", "max_queued = 32")
        with fronted_gpud(gpud, text, [U1, U2]):
            wait_until(lambda: sb.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                                       f"http://127.0.0.1:{ROUTER}/v1/models"],
                                      check=False).stdout == "401", timeout=30)
            stream = json.dumps({"model": "a", "prompt": "a b", "max_tokens": 100000,
                                 "stream": True})
            streaming = sb.popen(
                f"curl -sN --max-time 600 -H 'Authorization: Bearer {TOKENS[U1]}' "
                f"-d '{stream}' http://127.0.0.1:{ROUTER}/v1/completions", user=U1,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
            wait_until(lambda: gpud.serve("a")["state"] == "running"
                       and gpud.serve("a")["in_flight"], timeout=60)
            waiters = sb.popen(" ".join(f"( {shlex.join(curl(U1, 'b', 550))} ; echo ) &"
                                        for _ in range(waiting_n)) + " wait",
                               user=U1, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               text=True)
            try:
                wait_until(lambda: gpud.serve("b")["queued"] == waiting_n, timeout=30)
                took = []
                for i in range(rounds):
                    began = time.monotonic()
                    status = sb.run(curl(U2, "chat", 60), user=U2, check=False,
                                    timeout=90).stdout
                    took.append(time.monotonic() - began)
                    b = gpud.serve("b")
                    print(f"round {i + 1}: u2's chat {status} in {took[-1]:.2f} s; u1's "
                          f"{b['queued']} requests waiting for b ({b.get('waiting', {}).get('reason')})")
                    gpud.call("POST", "/v1/serves/chat/stop", {})
                    gpud.wait_state("chat", "declared", "denied")
                print(f"u2's chat: median {statistics.median(took):.2f} s over {rounds} rounds, "
                      f"beside {waiting_n} requests of u1's waiting for b")
            finally:
                for proc in (waiters, streaming):
                    if proc.poll() is None:
                        sb.kill(proc)
    finally:
        sb.run(f"rm -f {KEYS}", check=False)
        sb.poweroff()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--changes", type=int, default=200)
    p.add_argument("--old", default=None, metavar="REV")
    p.add_argument("--no-sandbox", action="store_true", help="part 2 only")
    p.add_argument("--gpud-from", default=None, help=argparse.SUPPRESS)
    p.add_argument("--label", default="now", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.gpud_from is not None:
        sys.path.insert(0, args.gpud_from)  # gpud from there, the fakes (tests/) from here
    if not args.no_sandbox:
        part1(args.rounds)
    part2(args.changes, args.old, args.label)


if __name__ == "__main__":
    main()
