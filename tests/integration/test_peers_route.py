"""Two gpud hosts behind one URL (docs/peers.md): a model that lives only on host B, on demand,
started by a request that arrives at host A's router, streamed through the openai client with
B's loading feedback passing through; each host the other's peer, and no loop; B's gpud and
router stopped: A answers 503 at once with
Retry-After once the circuit is open, and serves again once B is back. Real systemd, nginx and
gpud in each of two sandboxes joined by a veth pair."""

from __future__ import annotations

import json
import time
from typing import Any

from tests.integration.gpudctl import PY, sim_config, standin_uds
from tests.integration.hosts import Host, Setup, hosts, peer_table
from tests.waiting import wait_until

ROUTER = 30420
TOKEN = "sk-host-a-presents-this-to-b-0123"
KEYS = "/etc/gpud/keys.toml"
PEER_KEY = "/etc/gpud/peer-b.key"
ROLE = '[roles.r]\ndevice = "GPU-sim-0"\nreserve_mib = 1000\n'
# A's router listens on its end of the link (B asks it for its models), as clients reach it
A_ADDRESS = "198.18.0.1"


def b_config(address: str, a: Host) -> str:
    serves = (
        f'[serves.ocr]\nrole = "r"\nvram_mib = 8000\nport = {ROUTER + 1}\non_demand = true\n'
        'start_timeout_s = 90\nmodels = ["ocr"]\n'
        f"command = {standin_uds('--startup-delay', '3', '--token-interval-s', '0.05', '--served-model-name', 'ocr')}\n")
    # and A is B's peer too: the two list each other's models, and never loop
    return (sim_config(ROLE, serves) + f'[router]\nlisten = "{address}:{ROUTER}"\n'
            f'api_keys_file = "{KEYS}"\nloading_feedback_s = 1\n'
            + peer_table("a", f"http://{a.addr}:{ROUTER}", "/etc/gpud/peer-a.key"))


def configs(hs: list[Host]) -> list[Setup]:
    a, b = hs
    # A's router takes no keys: B presents one anyway
    return [Setup(a_config(b), {PEER_KEY: TOKEN + "\n"}),
            Setup(b_config(b.addr, a),
                  {KEYS: f'[keys.front-a]\ntoken = "{TOKEN}"\nmodels = ["*"]\n',
                   "/etc/gpud/peer-a.key": "sk-b-presents-this-to-a-000\n"})]


def a_config(b: Host) -> str:
    # A's own serve, on demand (nothing runs until asked): a name of its own
    serves = (
        f'[serves.chat]\nrole = "r"\nvram_mib = 8000\nport = {ROUTER + 1}\non_demand = true\n'
        'start_timeout_s = 90\nmodels = ["chat"]\n'
        f"command = {standin_uds('--served-model-name', 'chat')}\n")
    return (sim_config(ROLE, serves) + f'[router]\nlisten = "{A_ADDRESS}:{ROUTER}"\n'
            + peer_table("b", f"http://{b.addr}:{ROUTER}", PEER_KEY))


# Inside A: the openai client streams a chat for "ocr" (cold on B), its raw lines kept: B's
# loading comments, then the chunks, then [DONE].
CLIENT = f'''
import json, openai
o = openai.OpenAI(base_url="http://{A_ADDRESS}:{ROUTER}/v1", api_key="unused", max_retries=0,
                  timeout=120)
with o.chat.completions.with_streaming_response.create(
        model="ocr", messages=[{{"role": "user", "content": "read it"}}], max_tokens=3,
        stream=True) as resp:
    lines = [line for line in resp.iter_lines() if line]
chunks = list(o.chat.completions.create(model="ocr", messages=[{{"role": "user", "content": "x"}}],
                                        max_tokens=3, stream=True))
print(json.dumps({{"status": resp.status_code, "lines": lines,
                  "chunks": [c.choices[0].delta.content for c in chunks if c.choices]}}))
'''


def post(host: Host, model: str) -> tuple[int, dict[str, str], Any, float]:
    """POST a chat for MODEL to HOST's router from inside HOST: status, headers, document,
    seconds taken."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "x"}],
                       "max_tokens": 2})
    started = time.monotonic()
    out = host.sandbox.run(["curl", "-s", "-i", "--max-time", "60", "-d", body,
                            "-H", "Content-Type: application/json",
                            f"http://{A_ADDRESS}:{ROUTER}/v1/chat/completions"],
                           timeout=90).stdout.replace("\r\n", "\n")
    took = time.monotonic() - started
    head, _, text = out.partition("\n\n")
    lines = head.split("\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in
               (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(text), took


def models(host: Host) -> dict[str, Any]:
    out = host.sandbox.run(["curl", "-s", f"http://{A_ADDRESS}:{ROUTER}/v1/models"]).stdout
    return {m["id"]: m["gpud"] for m in json.loads(out)["data"]}


def test_a_model_only_on_b_is_started_by_a_request_at_a_and_b_down_is_503_at_once() -> None:
    with hosts(2, configs) as (a, b):
        assert a.addr == A_ADDRESS
        # A's router lists B's model, with its host, once its poller has B's list
        try:
            listed = wait_until(lambda: models(a).get("ocr"), timeout=30,
                                what="A's router listing B's ocr")
        except AssertionError:
            raise AssertionError(json.dumps(a.gpud.get("/v1/peers")) + "\n"
                                 + json.dumps(models(a)) + "\n"
                                 + a.gpud.journal_tail()) from None
        assert listed["host"] == "b" and listed["via"] == "b", listed
        assert listed["state"] == "declared", listed   # as B reports it: not started
        assert models(a)["chat"]["host"] != "b"
        # B offers A's own model, never its own back through A (the hop marker)
        offered = wait_until(lambda: (p := b.gpud.get("/v1/peers")["peers"][0])[
            "reachable"] and p, timeout=30, what="B's poller reaching A")
        assert [m["id"] for m in offered["models"]] == ["chat"], offered
        # the key is in A's nginx.conf, which is root's and the front's group's only
        mode = a.sandbox.run(["stat", "-c", "%a %U", "/run/gpud/front/nginx.conf"]).stdout
        assert mode.split() == ["640", "root"], mode

        got = json.loads(a.sandbox.run([PY, "-c", CLIENT], timeout=150).stdout)
        assert got["status"] == 200, got
        assert got["lines"][0] == ": loading ocr", got["lines"]
        assert got["lines"][-1] == "data: [DONE]", got["lines"]
        assert any(line.startswith("data: {") for line in got["lines"]), got
        assert "".join(got["chunks"]), got
        # started on B by A's request, through B's router with A's key
        assert b.gpud.serve("ocr")["state"] == "running"
        assert b.gpud.wait_journal("MESSAGE=on-demand ocr: starting (request for "
                                   "model 'ocr' with key 'front-a' through the "
                                   "router)"), b.gpud.journal_tail()
        assert a.gpud.serve("chat")["state"] == "declared"   # A started nothing

        def forwarded() -> float:
            return sum(v for labels, v in a.gpud.metrics("gpud_peer_requests_total")
                       if labels == {"peer": "b", "code": "2xx"})
        wait_until(lambda: forwarded() >= 2, timeout=30,
                   what="A's forwarded requests counted")

        b.stop_gpud_and_router()
        wait_until(lambda: a.gpud.get("/v1/peers")["peers"][0]["circuit"] == "open",
                   timeout=30, what="A's circuit of b open")
        _, headers, doc, took = wait_until(
            lambda: (r := post(a, "ocr"))[0] == 503 and r, timeout=30,
            what="A answering 503 for b's model")
        assert took < 2, took      # at once: no connect, no wait
        assert headers["retry-after"] == "5", headers
        assert doc["error"]["code"] == "peer_unreachable", doc
        assert "host b (unreachable: " in doc["error"]["message"], doc
        assert models(a)["ocr"]["state"] == "unreachable"

        b.gpud.start()
        b.gpud.wait_front()
        _, _, doc, _ = wait_until(lambda: (r := post(a, "ocr"))[0] == 200 and r,
                                  timeout=60, what="A serving b's model again")
        assert doc["choices"], doc
