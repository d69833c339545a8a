"""The router under real systemd: one address for every serve, routed by the body's `model`
through the front's nginx (gpud-front.service, njs), on-demand and sleeping serves brought up
through gpud's ensure, and serving on while gpud is down. Simulated GPU, stand-in serves."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.gpudctl import PY, REPO, SandboxGpud, fronted_gpud, sim_config, standin_uds
from tests.waiting import wait_until

ROUTER = 30290
PORT = 30291
USER = "gpud-router-client"  # a local user who is nobody to gpud


def router_config() -> str:
    dev = 'environment = { VLLM_SERVER_DEV_MODE = "1" }\n'
    serves = (
        # fronted, sleeps: the router wakes it
        f'[serves.chat]\nrole = "r"\nvram_mib = 12000\nport = {PORT}\nsleep_level = 1\n'
        f'sleep_mib = 800\nmodels = ["chat", "chat-fast"]\n{dev}'
        f"command = {standin_uds('--enable-sleep-mode', '--token-interval-s', '0.2', '--served-model-name', 'chat', 'chat-fast')}\n"
        # on demand: started by its first request
        f'[serves.od]\nrole = "r"\nvram_mib = 8000\nport = {PORT + 1}\non_demand = true\n'
        f"start_timeout_s = 60\nsleep_level = 1\nsleep_mib = 800\n{dev}"
        'models = ["ocr"]\n'
        f"command = {standin_uds('--startup-delay', '1', '--enable-sleep-mode', '--served-model-name', 'ocr')}\n"
        # does not fit beside chat: refused
        f'[serves.huge]\nrole = "r"\nvram_mib = 30000\nport = {PORT + 2}\non_demand = true\n'
        f"command = {standin_uds('--served-model-name', 'huge')}\n"
        # not fronted: the router reaches it on its port
        f'[serves.plain]\nrole = "r"\nvram_mib = 2000\nport = {PORT + 3}\n'
        f'command = {json.dumps([PY, "-m", "gpud.testing.standin", "serve", "m", "--port", "{port}", "--gpu-memory-utilization", "{gpu_memory_utilization}", "--served-model-name", "plain"])}\n'
    )
    role = '[roles.r]\ndevice = "GPU-sim-0"\nreserve_mib = 1000\n'
    router = f'[router]\nlisten = "127.0.0.1:{ROUTER}"\n'
    return sim_config(role, serves) + router


@pytest.fixture
def routed(gpud: SandboxGpud) -> Iterator[SandboxGpud]:
    with fronted_gpud(gpud, router_config(), [USER]):
        yield gpud


def ask(gpud: SandboxGpud, model: str, path: str = "/v1/completions",
        extra: dict[str, Any] | None = None) -> tuple[int, dict[str, str], str]:
    """A request through the router as a local user: status, headers, body."""
    body = json.dumps({"model": model, "prompt": "a b", "max_tokens": 2, **(extra or {})})
    out = gpud.sb.run(["curl", "-s", "-i", "-d", body, f"http://127.0.0.1:{ROUTER}{path}"],
                      user=USER, check=False, timeout=90).stdout.replace("\r\n", "\n")
    head, _, text = out.partition("\n\n")
    lines = head.splitlines()
    if not lines:
        return 0, {}, out
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), headers, text


def models(gpud: SandboxGpud) -> dict[str, dict[str, Any]]:
    out = gpud.sb.run(["curl", "-s", f"http://127.0.0.1:{ROUTER}/v1/models"], user=USER,
                      timeout=30).stdout
    return {m["id"]: m for m in json.loads(out)["data"]}


def test_one_address_routes_by_model_and_brings_serves_up(routed: SandboxGpud) -> None:
    gpud = routed
    for name in ("chat", "plain"):
        assert gpud.call("POST", f"/v1/serves/{name}/start", {}).status == 200
        gpud.wait_state(name, "running")
    listed = models(gpud)
    assert {n: (m["gpud"]["serve"], m["gpud"]["state"]) for n, m in listed.items()} == {
        "chat": ("chat", "running"), "chat-fast": ("chat", "running"),
        "ocr": ("od", "declared"), "huge": ("huge", "declared"), "plain": ("plain", "running")}
    # gpuctl models: the same names, from gpud
    table = subprocess.run([sys.executable, "-m", "gpud.ctl", "--socket", str(gpud.socket),
                            "models"], capture_output=True, text=True, cwd=REPO, timeout=60,
                           check=True).stdout.splitlines()
    assert table[0].split() == ["MODEL", "HOST", "SERVE", "STATE", "PORT", "FRONT", "IN",
                                "FLIGHT", "QUEUED"], table
    assert [line.split()[:4] for line in table[1:]] == [
        ["chat", "local", "chat", "running"], ["chat-fast", "local", "chat", "running"],
        ["huge", "local", "huge", "declared"], ["ocr", "local", "od", "declared"],
        ["plain", "local", "plain", "running"]], table
    for model in ("chat", "chat-fast", "plain"):
        status, _h, body = ask(gpud, model)
        assert status == 200 and json.loads(body)["model"] == model, (model, body)

    # The on-demand serve: ten first requests at once share one start.
    body = json.dumps({"model": "ocr", "prompt": "a", "max_tokens": 1})
    out = gpud.sb.run(
        f"for i in $(seq 10); do curl -s -o /dev/null -w '%{{http_code}}\\n' -d '{body}' "
        f"http://127.0.0.1:{ROUTER}/v1/completions & done; wait", user=USER, timeout=90).stdout
    assert out.split() == ["200"] * 10, out
    assert gpud.serve("od")["state"] == "running"
    assert len(gpud.events(kind="start", serve="od")) == 1

    # A sleeping serve, asked for by one of its names, is woken.
    assert gpud.call("POST", "/v1/serves/chat/sleep", {}).status == 200
    assert models(gpud)["chat-fast"]["gpud"]["state"] == "sleeping"
    status, _h, body = ask(gpud, "chat-fast")
    assert status == 200, body
    assert gpud.serve("chat")["state"] == "running"
    wake, = gpud.events(kind="wake", serve="chat")
    # the journal says which request brought it up
    assert "request for model 'chat-fast' through the router" in wake["message"], wake

    # Refused (30000 MiB does not fit beside chat and od): 503, the reason's class (no ledger
    # figures or other serves' names: any local user reads it), Retry-After as gpud holds it.
    status, headers, body = ask(gpud, "huge")
    error = json.loads(body)["error"]
    assert error["gpud"]["code"] == "denied", error
    retry = error["gpud"]["details"]["retry_after_s"]
    assert status == 503 and headers.get("Retry-After") == str(retry) and retry > 0, (headers,
                                                                                      body)
    assert error["code"] == "model_unavailable", error
    assert "not enough GPU memory" in error["message"] and "30000" not in error["message"], error
    assert "chat" not in error["message"], error

    # Unknown: 404 naming the close names.
    status, _h, body = ask(gpud, "chat-fats")
    assert status == 404 and '"chat-fast"' in json.loads(body)["error"]["message"], body

    # A stopped serve that is not on demand is not started by a request.
    assert gpud.call("POST", "/v1/serves/chat/stop", {}).status == 200
    status, _h, body = ask(gpud, "chat")
    assert status == 503 and "not on_demand" in json.loads(body)["error"]["message"], body
    assert gpud.serve("chat")["state"] in ("declared", "admitted")


def test_the_router_serves_on_while_gpud_is_down_and_a_restart_cuts_no_stream(
        routed: SandboxGpud) -> None:
    gpud = routed
    assert gpud.call("POST", "/v1/serves/chat/start", {}).status == 200
    gpud.wait_state("chat", "running")
    body = json.dumps({"model": "chat", "prompt": "a b", "max_tokens": 60, "stream": True})
    script = (
        "rm -rf /tmp/rstreams; mkdir /tmp/rstreams; "
        f"for i in $(seq 16); do curl -sN -d '{body}' http://127.0.0.1:{ROUTER}/v1/completions"
        " > /tmp/rstreams/$i & done; "
        "until [ $(find /tmp/rstreams -type f -size +0 | wc -l) -eq 16 ]; do sleep 0.05; done; "
        "systemctl restart gpud.service; "
        "echo done-before-restart-ended $(grep -l '\\[DONE\\]' /tmp/rstreams/* | wc -l); "
        "wait; echo complete $(grep -l 'data: \\[DONE\\]' /tmp/rstreams/* | wc -l)")
    pid = gpud.unit_prop("gpud-front.service", "MainPID")
    started = time.monotonic()
    out = gpud.sb.run(["bash", "-c", script], timeout=120).stdout.split()
    assert out == ["done-before-restart-ended", "0", "complete", "16"], out
    assert time.monotonic() - started >= 11  # 60 tokens 0.2 s apart: the restart was inside
    assert gpud.unit_prop("gpud-front.service", "MainPID") == pid
    gpud.wait_state("chat", "running")

    # gpud down: a running serve answers through the router, states are unknown
    gpud.sb.run(["systemctl", "stop", "gpud.service"], timeout=60)
    status, _h, text = ask(gpud, "chat-fast")
    assert status == 200, text
    assert models(gpud)["chat"]["gpud"]["state"] == "unknown"
    # and a serve that is not up answers 503 naming it
    status, _h, text = ask(gpud, "ocr")
    assert status == 503 and "serve od is not running" in text, text


# --- loading feedback, the journal's request and metrics by model ----------------------------

KEYS = "/etc/gpud-router-keys.toml"
TOKEN = "sk-ci-0123456789abcdef"


def slow_config() -> str:
    """An on-demand serve slow to start (4 s), behind the router with a key; loading feedback
    every 2 s."""
    serves = (
        f'[serves.slow]\nrole = "r"\nvram_mib = 8000\nport = {PORT + 5}\non_demand = true\n'
        'start_timeout_s = 90\nmodels = ["slow"]\n'
        f"command = {standin_uds('--startup-delay', '4', '--token-interval-s', '0.1', '--served-model-name', 'slow')}\n"
    )
    role = '[roles.r]\ndevice = "GPU-sim-0"\nreserve_mib = 1000\n'
    router = (f'[router]\nlisten = "127.0.0.1:{ROUTER}"\napi_keys_file = "{KEYS}"\n'
              "loading_feedback_s = 2\n")
    return sim_config(role, serves) + router


@pytest.fixture
def slow(gpud: SandboxGpud) -> Iterator[SandboxGpud]:
    keys = f'[keys.ci]\ntoken = "{TOKEN}"\nmodels = ["*"]\n'
    with gpud.keys_file(KEYS, keys), fronted_gpud(gpud, slow_config(), [USER]):
        yield gpud


def test_a_cold_start_streams_loading_comments_and_is_journaled_and_measured(
        slow: SandboxGpud) -> None:
    gpud = slow
    body = json.dumps({"model": "slow", "prompt": "a b c", "max_tokens": 3, "stream": True})
    out = gpud.sb.run(["curl", "-sN", "-i", "-H", f"Authorization: Bearer {TOKEN}", "-d", body,
                       f"http://127.0.0.1:{ROUTER}/v1/completions"], user=USER,
                      timeout=150).stdout.replace("\r\n", "\n")
    head, _, text = out.partition("\n\n")
    assert head.startswith("HTTP/1.1 200") and "Content-Type: text/event-stream" in head, out
    events = [e for e in text.split("\n\n") if e.strip()]
    # the start takes 4 s and more: a comment at 1 s, then every 2 s, until the serve's
    # stream, token by token, to its end
    assert events[0] == ": loading slow", events
    first = next(i for i, e in enumerate(events) if e.startswith("data: "))
    assert all(e == ": loading slow" for e in events[:first]) and first >= 2, events
    tokens = [json.loads(e[6:]) for e in events[first:-1]]
    assert [t["choices"][0]["text"] for t in tokens if t["choices"][0]["text"]], events
    assert events[-1] == "data: [DONE]", events
    assert gpud.serve("slow")["state"] == "running"
    # the journal names the request that started it, and its key
    start = gpud.wait_journal("MESSAGE=on-demand slow: starting (request for model 'slow' "
                              "with key 'ci' through the router)")
    assert start, gpud.journal_tail()

    # metrics by model: requests by status class, the router's own latency
    for _ in range(3):
        status, _h, _b = ask_keyed(gpud, "slow")
        assert status == 200
    assert ask_keyed(gpud, "slwo")[0] == 404

    def counted() -> dict[tuple[str, str], float]:
        return {(labels["model"], labels["code"]): value
                for labels, value in gpud.metrics("gpud_router_requests_total")}
    wait_until(lambda: counted().get(("slow", "2xx")) == 4 and counted().get(("", "4xx")) == 1,
               timeout=30, what="the router's requests counted")
    assert counted()[("slow", "5xx")] == 0
    overhead = {labels["model"]: value
                for labels, value in gpud.metrics("gpud_router_overhead_seconds_count")}
    # the three that a running serve answered (the stream went through the loading feedback)
    assert overhead == {"slow": 3}, overhead


def test_a_cold_start_through_the_serves_own_port_streams_loading_comments(
        slow: SandboxGpud) -> None:
    """The same stream on the serve's own fronted port, with the key: the router's loading
    feedback there too (before, it waited silently for the whole start)."""
    gpud = slow
    body = json.dumps({"model": "slow", "prompt": "a b c", "max_tokens": 3, "stream": True})
    out = gpud.sb.run(["curl", "-sN", "-i", "-H", f"Authorization: Bearer {TOKEN}", "-d", body,
                       f"http://127.0.0.1:{PORT + 5}/v1/completions"], user=USER,
                      timeout=150).stdout.replace("\r\n", "\n")
    head, _, text = out.partition("\n\n")
    assert head.startswith("HTTP/1.1 200") and "Content-Type: text/event-stream" in head, out
    events = [e for e in text.split("\n\n") if e.strip()]
    first = next(i for i, e in enumerate(events) if e.startswith("data: "))
    assert all(e == ": loading slow" for e in events[:first]) and first >= 2, events
    assert events[-1] == "data: [DONE]", events
    assert gpud.serve("slow")["state"] == "running"


def ask_keyed(gpud: SandboxGpud, model: str) -> tuple[int, dict[str, str], str]:
    body = json.dumps({"model": model, "prompt": "a", "max_tokens": 1})
    out = gpud.sb.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-H",
                       f"Authorization: Bearer {TOKEN}", "-d", body,
                       f"http://127.0.0.1:{ROUTER}/v1/completions"], user=USER,
                      timeout=90).stdout
    return int(out or 0), {}, ""
