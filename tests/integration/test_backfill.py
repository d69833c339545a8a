"""The queue backfills (docs/router.md, "Queue instead of thrash"): u1 keeps a up (for
router.min_awake_s) and requests b, which waits for a's memory; u2's request for chat, which
fits in what is free beside a and takes nothing b will need once a may be evicted, is answered
at once, while u1's requests for b still wait. Real systemd, gpud, the front's nginx with the
router and its keys, simulated GPU, stand-in serves."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.gpudctl import ROLE_R, SandboxGpud, fronted_gpud, on_demand, sim_config
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
ROUTER = 30500
PORT = 30501
U1, U2 = "gpud-backfill-u1", "gpud-backfill-u2"
KEYS = "/etc/gpud-router-keys.toml"
TOKENS = {U1: "sk-backfill-u1-0123456789abcdef", U2: "sk-backfill-u2-0123456789abcdef"}
# b may not evict a while the test runs, however slow the machine
MIN_AWAKE_S = 120
WAITING = 8


def config() -> str:
    # a and b: 20000 MiB each on 32607 (1000 reserved): one at a time; chat: 6000, fits beside
    # either (11607 free)
    serves = "".join(on_demand(name, PORT + i, "--token-interval-s", "0.02", mib=mib)
                     for i, (name, mib) in enumerate((("a", 20000), ("b", 20000), ("chat", 6000))))
    router = (f'[router]\nlisten = "127.0.0.1:{ROUTER}"\napi_keys_file = "{KEYS}"\n'
              f"queue_timeout_s = 60\nmax_queued = 16\nmin_awake_s = {MIN_AWAKE_S}\n")
    return sim_config(ROLE_R, serves) + router


@pytest.fixture
def layout(gpud: SandboxGpud) -> Iterator[SandboxGpud]:
    keys = (f'[keys.u1]\ntoken = "{TOKENS[U1]}"\nmodels = ["a", "b"]\n'
            f'[keys.u2]\ntoken = "{TOKENS[U2]}"\nmodels = ["chat"]\n')
    with gpud.keys_file(KEYS, keys), fronted_gpud(gpud, config(), [U1, U2]):
        gpud.wait_router(ROUTER)
        yield gpud


def curl(user: str, model: str, max_time: float) -> list[str]:
    body = json.dumps({"model": model, "prompt": "a b", "max_tokens": 2})
    return ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", str(max_time),
            "-H", f"Authorization: Bearer {TOKENS[user]}", "-d", body,
            f"http://127.0.0.1:{ROUTER}/v1/completions"]


def test_a_request_that_fits_now_goes_past_a_head_that_waits(layout: SandboxGpud) -> None:
    """u1 streams from a and has 8 requests waiting for b (a busy, up for less than
    min_awake_s); u2's request for chat joined behind them and waited (9 s with 4 waiting,
    past its client's 30 s with 8): it is answered once chat is up."""
    gpud = layout
    # u1 keeps a busy with one stream (a is not idle: only min_awake_s frees it)
    stream = json.dumps({"model": "a", "prompt": "a b", "max_tokens": 3000, "stream": True})
    streaming = gpud.sb.popen(
        f"curl -sN --max-time 90 -H 'Authorization: Bearer {TOKENS[U1]}' -d '{stream}' "
        f"http://127.0.0.1:{ROUTER}/v1/completions", user=U1, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, text=True)
    wait_until(lambda: gpud.serve("a")["state"] == "running" and gpud.serve("a")["in_flight"],
               timeout=60, what="a up and streaming")
    waiting = gpud.sb.popen(" ".join(f"( {shlex.join(curl(U1, 'b', 50))} ; echo ) &"
                                     for _ in range(WAITING)) + " wait",
                            user=U1, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            text=True)
    try:
        wait_until(lambda: gpud.serve("b")["queued"] == WAITING, timeout=20,
                   what=f"{WAITING} requests of u1's waiting for b")
        began = time.monotonic()
        chat = gpud.sb.run(curl(U2, "chat", 30), user=U2, check=False, timeout=60).stdout
        took = time.monotonic() - began
        print(f"u2's chat: {chat} in {took:.1f} s, b's queue {gpud.serve('b')['queued']}")
        # answered as soon as chat is up (a stand-in's start: about a second), not behind b's
        # queue (9 s with 4 waiting, past the client's 30 s with 8), nor after a's min_awake_s
        assert chat == "200" and took < 5, (chat, took, gpud.journal_tail(80))
        # u1's requests still wait for b: a is protected, and chat took nothing b needs
        assert gpud.serve("b")["queued"] == WAITING
        states = {n: gpud.serve(n)["state"] for n in ("a", "b", "chat")}
        assert states["a"] == "running" and states["b"] != "running", states
    finally:
        for proc in (waiting, streaming):
            if proc.poll() is None:
                gpud.sb.kill(proc)


def gpuctl(gpud: SandboxGpud, *args: str) -> str:
    return subprocess.run([sys.executable, "-m", "gpud.ctl", "--socket", str(gpud.socket),
                           *args], capture_output=True, text=True, cwd=REPO, timeout=60,
                          check=False).stdout


def test_a_serve_with_requests_waiting_is_shown_waiting_and_told_once(
        layout: SandboxGpud) -> None:
    """b, with u1's requests waiting for a's memory, is shown as waiting (not denied), with
    what it waits for and until when, in GET /v1/serves, gpuctl serves and gpuctl models; the
    journal says once that b waits, not once per try."""
    gpud = layout
    # the sandbox's journal outlives a test's gpud: count from here
    told, tried = (gpud.journal_tail(2000).count(line) for line in (
        "on-demand b: waiting for memory", "on-demand b: starting"))
    stream = json.dumps({"model": "a", "prompt": "a b", "max_tokens": 3000, "stream": True})
    streaming = gpud.sb.popen(
        f"curl -sN --max-time 90 -H 'Authorization: Bearer {TOKENS[U1]}' -d '{stream}' "
        f"http://127.0.0.1:{ROUTER}/v1/completions", user=U1, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, text=True)
    waiting = None
    try:
        wait_until(lambda: gpud.serve("a")["state"] == "running" and gpud.serve("a")["in_flight"],
                   timeout=60, what="a up and streaming")
        waiting = gpud.sb.popen(" ".join(f"( {shlex.join(curl(U1, 'b', 50))} ; echo ) &"
                                         for _ in range(WAITING)) + " wait",
                                user=U1, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                text=True)
        wait_until(lambda: gpud.serve("b")["queued"] == WAITING, timeout=20,
                   what=f"{WAITING} requests of u1's waiting for b")
        time.sleep(3)  # three retries' worth: each would have been a journal line before
        b = gpud.serve("b")
        said = b.get("waiting")
        assert said is not None, b
        assert said["requests"] == WAITING and said["reason"].startswith("a may be evicted in "), b
        assert said["reason"].endswith(" s (min_awake_s)"), b
        assert 0 < said["in_s"] <= MIN_AWAKE_S, b
        serves = gpuctl(gpud, "serves")
        row = next(line.split() for line in serves.splitlines() if line.split()[:1] == ["b"])
        assert "waiting" in row and "denied" not in row, serves
        assert f"b (waiting): {WAITING} requests; a may be evicted in " in serves, serves
        models = gpuctl(gpud, "models")
        assert any(line.split()[:4] == ["b", "local", "b", "waiting"]
                   for line in models.splitlines()), models
        journal = gpud.journal_tail(2000)
        assert journal.count("on-demand b: waiting for memory") == told + 1, journal
        # the first request's own try, before it waited; none of the queue's tries since
        assert journal.count("on-demand b: starting") <= tried + 1, journal
    finally:
        for proc in (waiting, streaming):
            if proc is not None and proc.poll() is None:
                gpud.sb.kill(proc)
