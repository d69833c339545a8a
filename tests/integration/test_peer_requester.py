"""Who is asking, across hosts (docs/peers.md): a key the keys file marks `peer = true` is another
gpud host's, and the requester it forwards in X-Gpud-Requester is taken, as PEER/NAME: what
gpud's queue sees and what gpuctl usage counts. From any other key the header is ignored, and a
value that is no requester is refused with the header named. One host: real systemd, gpud, the
front's nginx with the router, simulated GPU, stand-in serves."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.gpudctl import ROLE_R, SandboxGpud, fronted_gpud, on_demand, sim_config
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
ROUTER = 30500
PORT = 30501
KEYS = "/etc/gpud-router-keys.toml"
PEER_TOKEN = "sk-front-ws-0123456789abcdef"
BOB_TOKEN = "sk-bob-0123456789abcdef"
# b may not evict a busy a before it (the premise of the queue's part, by construction)
MIN_AWAKE_S = 300


def config() -> str:
    # a and b on demand, one at a time (20000 MiB each on 32607, 1000 reserved): while a is up
    # and busy for less than min_awake_s, a request for b waits in gpud's queue
    serves = "".join(on_demand(name, PORT + i, "--token-interval-s", "0.05")
                     for i, name in enumerate(("a", "b")))
    router = (f'[router]\nlisten = "127.0.0.1:{ROUTER}"\napi_keys_file = "{KEYS}"\n'
              f"queue_timeout_s = 120\nmin_awake_s = {MIN_AWAKE_S}\n")
    return sim_config(ROLE_R, serves) + router


@pytest.fixture
def peered(gpud: SandboxGpud) -> Iterator[SandboxGpud]:
    keys = (f'[keys.bob]\ntoken = "{BOB_TOKEN}"\nmodels = ["*"]\n'
            f'[keys.front-ws]\ntoken = "{PEER_TOKEN}"\nmodels = ["*"]\npeer = true\n')
    with gpud.keys_file(KEYS, keys), fronted_gpud(gpud, config()):
        yield gpud


def gpuctl(gpud: SandboxGpud, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpud.ctl", "--socket", str(gpud.socket),
                           *args], capture_output=True, text=True, cwd=REPO, timeout=60,
                          check=False)


def curl(token: str, requester: str, model: str, tokens: int = 2) -> list[str]:
    body = json.dumps({"model": model, "prompt": "a b", "max_tokens": tokens,
                       "stream": tokens > 2})
    return ["curl", "-s", "-N", "--max-time", "300", "-w", "\n%{http_code}", "-H",
            f"Authorization: Bearer {token}", "-H", f"X-Gpud-Requester: {requester}", "-d", body,
            f"http://127.0.0.1:{ROUTER}/v1/completions"]


def test_a_peer_keys_forwarded_requester_is_the_requester_and_no_one_elses_is(
        peered: SandboxGpud) -> None:
    gpud = peered
    # a client's own header names no one: bob is counted as bob (its request brings a up)
    assert gpud.sb.run(curl(BOB_TOKEN, "alice", "a"), timeout=90).stdout.endswith("\n200")
    # the peer key's: its client alice, as front-ws/alice
    assert gpud.sb.run(curl(PEER_TOKEN, "alice", "a")).stdout.endswith("\n200")
    # a value that is no requester is refused, the header named, nothing counted for it
    out = gpud.sb.run(curl(PEER_TOKEN, "x/alice", "a")).stdout
    text, _, status = out.rpartition("\n")
    error = json.loads(text)["error"]
    assert status == "400" and error["code"] == "invalid_requester", out
    assert error["param"] == "X-Gpud-Requester", error
    assert "X-Gpud-Requester \"x/alice\" from peer key front-ws" in error["message"], error

    # what gpud's queue sees: a busy (a stream in flight, up for less than min_awake_s), so
    # requests for b wait; one named by the peer, one by its own key
    holder = gpud.sb.popen(curl(BOB_TOKEN, "x", "a", tokens=4000), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    waiting = [holder]
    try:
        wait_until(lambda: gpud.serve("a")["in_flight"] == 1, timeout=10,
                   what="a stream in flight on a")
        waiting += [gpud.sb.popen(curl(token, who, "b"), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
                    for token, who in ((PEER_TOKEN, "alice"), (BOB_TOKEN, "mallory"))]
        wait_until(lambda: gpud.serve("b")["queued"] == 2, timeout=30, what="two waiting for b")
        queue = gpud.serve("b")["queue"]
        assert sorted(p["requester"] for p in queue) == ["bob", "front-ws/alice"], queue
    finally:
        for proc in waiting:
            gpud.sb.kill(proc)

    def rows() -> list[dict[str, object]]:
        return list(json.loads(gpuctl(gpud, "--json", "usage").stdout)["rows"])

    wait_until(lambda: {(r["key"], r["model"]) for r in rows()} >= {
        ("bob", "a"), ("front-ws/alice", "a")}, timeout=30, what="both in gpuctl usage")
    got = {(r["key"], r["model"]): r for r in rows()}
    assert got[("front-ws/alice", "a")]["statuses"] == {"200": 1}, got
    assert got[("bob", "a")]["statuses"]["200"] >= 1, got
    # nobody is counted under a name a client or a peer wrote by itself
    assert not {k for k, _ in got} & {"alice", "mallory", "x/alice", "front-ws/x/alice"}, got
    text = gpuctl(gpud, "usage").stdout
    assert ["front-ws/alice", "a", "1"] in [line.split()[:3] for line in text.splitlines()], text
