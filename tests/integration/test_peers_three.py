"""Three gpud hosts behind one URL (docs/peers.md): host a is the front door, with [peers.b] and
[peers.c]; b's keys file marks a's key `peer = true`. Through a's router, with a's own client
keys (alice, bob):

- a model that lives only on b, asleep, is woken by a request at a and streamed whole through
  the openai client;
- a memory denial on b (its gpud's typed 503) reaches the client as it came and leaves a's
  circuit of b closed;
- an on-demand model on b is started by requests at a that wait in b's queue named by the keys
  a forwarded, in its fair order between them (alice's forged X-Gpud-Requester ignored), all
  answered;
- b's gpud and router stopped: a lists b's models unreachable, answers a request for them at
  once (503, Retry-After), c's circuit stays closed, and b's closes once b is back.

The tests share one boot of the three hosts and run in this order (the last stops b and brings
it back). A client key sending X-Gpud-Requester straight to b is counted under its own name:
tests/integration/test_peer_requester.py. Real systemd, gpud, nginx and njs in each of three
sandboxes joined by veth pairs; simulated GPUs, stand-in serves."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gpud.testing.standin import PROGRAM
from tests.integration.gpudctl import PY, sim_config, standin_uds
from tests.integration.hosts import Host, Setup, hosts, peer_table
from tests.waiting import wait_until

ROUTER = 30640
KEYS = "/etc/gpud/keys.toml"
ROLE = '[roles.r]\ndevice = "GPU-sim-0"\nreserve_mib = 1000\n'
TOTAL_MIB = 32607
ALICE, BOB = "sk-alice-at-a-0123456789", "sk-bob-at-a-0123456789"
# hog may not be evicted for od while it is busy (b's min_awake_s): od's requests wait in b's
# queue until the test stops hog, by construction
MIN_AWAKE_S = 300
# a's poller asks every 5 s (gpud.host.peers DEFAULT_INTERVAL_S), a dead peer within its 3 s
# bound: a circuit opens or closes within one round, well inside this
WITHIN_S = 30


def token(host: str) -> str:
    return f"sk-a-presents-this-to-{host}-0123"


def serve(name: str, port: int, vram_mib: int, *args: str, extra: str = "") -> str:
    return (f'[serves.{name}]\nrole = "r"\nvram_mib = {vram_mib}\nport = {port}\n{extra}'
            f'start_timeout_s = 60\nmodels = ["{name}"]\n'
            f"command = {standin_uds(*args, '--served-model-name', name)}\n")


def b_serves() -> str:
    # sleepy (6000 MiB awake) and one of hog and od (20000 each) fit beside each other on 31607;
    # huge fits alone, but not beside the memory the test gives another process
    return (serve("sleepy", ROUTER + 1, 6000, "--enable-sleep-mode", "--token-interval-s",
                  "0.01", extra="sleep_level = 1\nsleep_mib = 800\n"
                  'environment = { VLLM_SERVER_DEV_MODE = "1" }\n')
            + serve("hog", ROUTER + 2, 20000, "--token-interval-s", "0.05",
                    extra="on_demand = true\n")
            + serve("od", ROUTER + 3, 20000, "--startup-delay", "1",
                    extra="on_demand = true\n")
            + serve("huge", ROUTER + 4, 12000, extra="on_demand = true\n"))


def configs(hs: list[Host]) -> list[Setup]:
    a, b, c = hs
    a_keys = (f'[keys.alice]\ntoken = "{ALICE}"\nmodels = ["*"]\n'
              f'[keys.bob]\ntoken = "{BOB}"\nmodels = ["*"]\n')
    out = [Setup(sim_config(ROLE, serve("a-chat", ROUTER + 1, 4000, extra="on_demand = true\n"))
                 + f'[router]\nlisten = "{a.addr}:{ROUTER}"\napi_keys_file = "{KEYS}"\n'
                 + "".join(peer_table(h.name, f"http://{h.addr_from(a)}:{ROUTER}",
                                      f"/etc/gpud/peer-{h.name}.key") for h in (b, c)),
                 {KEYS: a_keys,
                  **{f"/etc/gpud/peer-{h.name}.key": token(h.name) + "\n" for h in (b, c)}})]
    for h, serves in ((b, b_serves()),
                      (c, serve("c-chat", ROUTER + 1, 4000, extra="on_demand = true\n"))):
        keys = f'[keys.front-a]\ntoken = "{token(h.name)}"\nmodels = ["*"]\npeer = true\n'
        router = (f'[router]\nlisten = "{h.addr_from(a)}:{ROUTER}"\napi_keys_file = "{KEYS}"\n'
                  f"queue_timeout_s = 120\nmin_awake_s = {MIN_AWAKE_S}\n")
        out.append(Setup(sim_config(ROLE, serves, total_mib=TOTAL_MIB) + router, {KEYS: keys}))
    return out


@pytest.fixture(scope="module")
def three() -> Iterator[tuple[Host, Host, Host]]:
    with hosts(3, configs) as (a, b, c):
        # sleepy is started by its operator (it is not on demand)
        assert b.gpud.call("POST", "/v1/serves/sleepy/start", {}).status == 200
        b.gpud.wait_state("sleepy", "running")
        try:
            wait_until(lambda: {"sleepy", "od", "huge", "c-chat"} <= set(models(a)),
                       timeout=WITHIN_S, what="a's router listing b's and c's models")
        except AssertionError:
            raise AssertionError(json.dumps(a.gpud.get("/v1/peers")) + "\n"
                                 + a.gpud.journal_tail()) from None
        yield a, b, c


def url(a: Host, path: str) -> str:
    return f"http://{a.addr}:{ROUTER}{path}"


def models(a: Host) -> dict[str, Any]:
    """a's router's /v1/models (alice's key), by id: each one's gpud object."""
    out = a.sandbox.run(["curl", "-s", "-H", f"Authorization: Bearer {ALICE}",
                         url(a, "/v1/models")]).stdout
    return {m["id"]: m["gpud"] for m in json.loads(out)["data"]}


def curl(a: Host, key: str, model: str, *, tokens: int = 2, headers: tuple[str, ...] = (),
         to: str | None = None) -> list[str]:
    """A completion for MODEL through a's router (or the router at TO, host:port) with KEY; the
    output ends with the status and curl's own time to the answer's end."""
    body = json.dumps({"model": model, "prompt": "a b", "max_tokens": tokens,
                       "stream": tokens > 2})
    return ["curl", "-s", "-N", "-i", "--max-time", "300", "-w", "\n%{http_code} %{time_total}",
            "-H", f"Authorization: Bearer {key}", *[x for h in headers for x in ("-H", h)],
            "-d", body, f"http://{to}/v1/completions" if to else url(a, "/v1/completions")]


def answer(out: str) -> tuple[int, dict[str, str], Any, float]:
    """What curl() printed: status, headers, document, seconds."""
    text, _, tail = out.replace("\r\n", "\n").rpartition("\n")
    status, took = tail.split()
    head, _, body = text.partition("\n\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in
               (line.partition(":") for line in head.split("\n")[1:])}
    return int(status), headers, json.loads(body) if body.startswith("{") else body, float(took)


def peers_of(host: Host) -> dict[str, dict[str, Any]]:
    return {p["name"]: p for p in host.gpuctl_json("peers")["peers"]}


# Inside a: the openai client streams a chat for sleepy (asleep on b), alice's key.
PROMPT = "wake up and read this line"
TOKENS = 40
CLIENT = f'''
import json, openai
o = openai.OpenAI(base_url="{{url}}", api_key="{ALICE}", max_retries=0, timeout=120)
stream = o.chat.completions.create(model="sleepy", messages=[{{"role": "user",
    "content": "{PROMPT}"}}], max_tokens={TOKENS}, stream=True)
chunks = [c.choices[0] for c in stream if c.choices]
print(json.dumps({{"text": "".join(c.delta.content or "" for c in chunks),
                  "finish": [c.finish_reason for c in chunks if c.finish_reason]}}))
'''


def test_a_model_asleep_on_b_is_woken_by_a_request_at_a_and_streamed_whole(
        three: tuple[Host, Host, Host]) -> None:
    a, b, _ = three
    assert b.gpud.call("POST", "/v1/serves/sleepy/sleep", {}).status == 200
    assert b.gpud.serve("sleepy")["state"] == "sleeping"
    listed = wait_until(lambda: (m := models(a)["sleepy"])["state"] == "sleeping" and m,
                        timeout=WITHIN_S, what="a listing b's sleepy asleep")
    assert listed["host"] == "b", listed
    woken_before = len(b.gpud.events(kind="wake", serve="sleepy"))

    got = json.loads(a.sandbox.run([PY, "-c", CLIENT.replace("{url}", url(a, "/v1"))],
                                   timeout=150).stdout)
    # whole: every token, the stand-in's echo of the prompt (weights loaded: woken, not
    # garbage), repeated up to max_tokens, and its one finish
    words = f"[{PROGRAM} echo] {PROMPT}".split()
    assert got["text"].split() == (words * TOKENS)[:TOKENS], got
    assert got["finish"] == ["length"], got
    # woken on b, through b's router, by a's request
    assert b.gpud.serve("sleepy")["state"] == "running"
    assert len(b.gpud.events(kind="wake", serve="sleepy")) == woken_before + 1
    assert a.gpud.serve("a-chat")["state"] == "declared"   # a started nothing


def test_a_memory_denial_on_b_passes_as_it_came_and_leaves_the_circuit_closed(
        three: tuple[Host, Host, Host]) -> None:
    a, b, _ = three
    # another process takes b's memory: huge (12000 MiB) cannot fit, whatever b evicts
    b.gpud.set_external([{"device": "GPU-sim-0", "label": "someone else", "mib": 24000}])
    try:
        b.gpud.wait_polls(2)
        status, headers, doc, _ = answer(a.sandbox.run(curl(a, ALICE, "huge")).stdout)
        # the same request straight to b, with a's key: what b's gpud answers
        direct = b.sandbox.run(curl(a, token("b"), "huge", to=f"{b.addr}:{ROUTER}")).stdout
        d_status, d_headers, d_doc, _ = answer(direct)
    finally:
        b.gpud.set_external([])
    assert status == d_status == 503, (doc, d_doc)
    assert doc == d_doc, (doc, d_doc)
    assert doc["error"]["code"] == "model_unavailable", doc
    assert doc["error"]["gpud"]["details"]["class"] == "no-memory", doc
    assert headers.get("retry-after") == d_headers.get("retry-after"), (headers, d_headers)
    assert b.gpud.serve("huge")["state"] == "denied"   # b's own ledger said no

    # a counted the forwarded answer (read from its router's access log, where a failure on
    # the data path would have had its poller ask b at once), and a poll after that finds b
    # reachable, its circuit closed
    def denied() -> float:
        return sum(v for labels, v in a.gpud.metrics("gpud_peer_requests_total")
                   if labels == {"peer": "b", "code": "5xx"})
    wait_until(lambda: denied() >= 1, timeout=WITHIN_S, what="a counting b's 503")
    counted = time.time()
    got = wait_until(lambda: (p := peers_of(a)["b"])["checked_at"] > counted and p,
                     timeout=WITHIN_S, what="a's poll of b after the denial")
    assert (got["circuit"], got["reachable"], got["last_error"]) == ("closed", True, None), got
    assert "peer b: circuit opened" not in a.gpud.journal_tail(400)
    b.gpud.wait_polls(2)   # b has seen its memory back


def test_an_on_demand_model_on_b_started_from_a_queues_fairly_by_as_keys(
        three: tuple[Host, Host, Host]) -> None:
    a, b, _ = three
    # hog busy on b (a stream in flight, up for less than min_awake_s): od waits for it
    holder = a.sandbox.popen(curl(a, BOB, "hog", tokens=4000), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    waiting: list[subprocess.Popen[str]] = []
    try:
        wait_until(lambda: b.gpud.serve("hog")["in_flight"] == 1, timeout=WITHIN_S,
                   what="a stream of a's in flight on b's hog")
        # alice asks three times, forging a requester each time (a's router sends its own:
        # her key's name); then bob once
        def ask(key: str, *headers: str) -> subprocess.Popen[str]:
            return a.sandbox.popen(curl(a, key, "od", headers=headers), stdout=subprocess.PIPE,
                                   stderr=subprocess.DEVNULL)

        waiting = [ask(ALICE, "X-Gpud-Requester: mallory") for _ in range(3)]
        wait_until(lambda: b.gpud.serve("od")["queued"] == 3, timeout=WITHIN_S,
                   what="alice's three requests waiting for od on b")
        waiting.append(ask(BOB))
        wait_until(lambda: b.gpud.serve("od")["queued"] == 4, timeout=WITHIN_S,
                   what="bob's request waiting for od on b too")
        # b's queue tells a's two keys apart and is fair between them: bob, come last, goes
        # second (after alice's first, before her other two), where one requester "front-a"
        # would have had him fourth
        queue = b.gpud.serve("od")["queue"]
        assert queue == [{"requester": "front-a/alice", "waiting": 3, "position": 1},
                         {"requester": "front-a/bob", "waiting": 1, "position": 2}], queue
        assert queue == next(s for s in b.gpuctl_json("serves")["serves"]
                             if s["name"] == "od")["queue"]
    finally:
        a.sandbox.kill(holder)
    # hog stopped by b's operator: od is started for the four waiting, and all are answered
    assert b.gpud.call("POST", "/v1/serves/hog/stop", {}).status == 200
    try:
        outs = [proc.communicate(timeout=120)[0] for proc in waiting]
    finally:
        for proc in waiting:
            a.sandbox.kill(proc)
    for out in outs:
        status, _, doc, _ = answer(out)
        assert status == 200 and doc["choices"], out
    assert b.gpud.serve("od")["state"] == "running"
    assert len(b.gpud.events(kind="start", serve="od")) == 1

    def rows() -> dict[tuple[str, str], Any]:
        return {(r["key"], r["model"]): r for r in b.gpuctl_json("usage")["rows"]}

    wait_until(lambda: (r := rows()).get(("front-a/alice", "od"), {}).get("statuses") == {"200": 3}
               and ("front-a/bob", "od") in r, timeout=WITHIN_S,
               what="b's usage counting a's two keys")
    got = rows()
    assert got[("front-a/alice", "od")]["statuses"] == {"200": 3}, got
    assert got[("front-a/bob", "od")]["statuses"] == {"200": 1}, got
    # nobody counted under the forged name
    assert not {k for k, _ in got if "mallory" in k}, got


def test_b_stopped_is_unreachable_at_a_at_once_and_back_when_b_is(
        three: tuple[Host, Host, Host]) -> None:
    a, b, _ = three
    b.stop_gpud_and_router()
    stopped = time.monotonic()
    listed = wait_until(lambda: (m := models(a)["sleepy"])["state"] == "unreachable" and m,
                        timeout=WITHIN_S, what="a listing b's models unreachable")
    seen_s = time.monotonic() - stopped
    assert listed["host"] == "b", listed
    assert {models(a)[m]["state"] for m in ("od", "huge")} == {"unreachable"}
    # until a's router is rendered with b's circuit open (a reload, just after the list says
    # so), a request still goes to b and meets no connection: a 502 of a's own, at once too
    status, headers, doc, took = answer(a.sandbox.run(curl(a, ALICE, "sleepy")).stdout)
    assert status in (502, 503) and doc["error"]["code"] == "peer_unreachable", doc
    assert headers["retry-after"] == "5" and took < 1, (headers, took)
    status, headers, doc, took = wait_until(lambda: (r := answer(a.sandbox.run(
        curl(a, ALICE, "sleepy")).stdout))[0] == 503 and r, timeout=WITHIN_S,
        what="a answering 503 for b's model")
    assert doc["error"]["code"] == "peer_unreachable", doc
    assert headers["retry-after"] == "5", headers
    assert "host b (unreachable: " in doc["error"]["message"], doc
    assert took < 1, took   # curl's own time: no connection tried, no wait (ms: printed)
    got = peers_of(a)
    assert (got["b"]["circuit"], got["b"]["reachable"]) == ("open", False), got["b"]
    assert (got["c"]["circuit"], got["c"]["reachable"]) == ("closed", True), got["c"]

    b.gpud.start()
    b.gpud.wait_front()
    wait_until(lambda: peers_of(a)["b"]["circuit"] == "closed", timeout=WITHIN_S,
               what="a's circuit of b closed again")
    status, _, doc, _ = wait_until(lambda: (r := answer(a.sandbox.run(
        curl(a, ALICE, "sleepy")).stdout))[0] == 200 and r, timeout=WITHIN_S,
        what="a serving b's sleepy again")
    assert doc["choices"], doc
    print(f"b's models unreachable at a {seen_s:.1f} s after b stopped; 503 in {took:.4f} s")
