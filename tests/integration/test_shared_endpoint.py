"""The one endpoint is safe to share (docs/security.md): two local users, nobody to gpud,
each with a key of the router; one of them takes what they can, the other is served. Real
systemd, gpud, the front's nginx with the router, simulated GPU, stand-in serves."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.gpudctl import SandboxGpud, fronted_gpud, sim_config, standin_uds
from tests.waiting import wait_until

ROUTER = 30390
PORT = 30391
GREEDY, POLITE = "gpud-greedy", "gpud-polite"
KEYS = "/etc/gpud-router-keys.toml"
TOKENS = {GREEDY: "sk-greedy-0123456789abcdef", POLITE: "sk-polite-0123456789abcdef"}
PER_REQUESTER = 16


def shared_config() -> str:
    dev = 'environment = { VLLM_SERVER_DEV_MODE = "1" }\n'
    serves = (
        # the polite user's: asleep, woken by a request
        f'[serves.chat]\nrole = "r"\nvram_mib = 8000\nport = {PORT}\nsleep_level = 1\n'
        f'sleep_mib = 800\nmodels = ["chat"]\n{dev}'
        f"command = {standin_uds('--enable-sleep-mode', '--served-model-name', 'chat')}\n"
        # the greedy user's: on demand, slow to start (its requests wait), on the other GPU
        # (a start's window holds its device's locks: a wake on the same one waits for it)
        f'[serves.b]\nrole = "r1"\nvram_mib = 8000\nport = {PORT + 1}\non_demand = true\n'
        'start_timeout_s = 120\nmodels = ["b"]\n'
        f"command = {standin_uds('--startup-delay', '60', '--served-model-name', 'b')}\n"
    )
    role = ('[roles.r]\ndevice = "GPU-sim-0"\nreserve_mib = 1000\n'
            '[roles.r1]\ndevice = "GPU-sim-1"\nreserve_mib = 1000\n')
    daemon = f"ensure_waiting_per_requester = {PER_REQUESTER}\n"
    router = f'[router]\nlisten = "127.0.0.1:{ROUTER}"\napi_keys_file = "{KEYS}"\n'
    return sim_config(role, serves, daemon=daemon, devices=2) + router


@pytest.fixture
def shared(gpud: SandboxGpud) -> Iterator[SandboxGpud]:
    keys = (f'[keys.greedy]\ntoken = "{TOKENS[GREEDY]}"\nmodels = ["b"]\n'
            f'[keys.polite]\ntoken = "{TOKENS[POLITE]}"\nmodels = ["chat"]\n')
    gpud.sb.run(["bash", "-c", f"umask 077; cat > {KEYS}"], input=keys)
    try:
        with fronted_gpud(gpud, shared_config(), [GREEDY, POLITE]):
            yield gpud
    finally:
        gpud.sb.run(["rm", "-f", KEYS, "/tmp/greedy.out"], check=False)


def curl(gpud: SandboxGpud, user: str, *args: str,
         timeout: float = 60) -> tuple[int, dict[str, str], str]:
    out = gpud.sb.run(["curl", "-s", "-i", "-H", f"Authorization: Bearer {TOKENS[user]}",
                       *args], user=user, check=False, timeout=timeout
                      ).stdout.replace("\r\n", "\n")
    head, _, text = out.partition("\n\n")
    lines = head.splitlines()
    if not lines:
        return 0, {}, out
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), headers, text


def complete(gpud: SandboxGpud, user: str, model: str) -> tuple[int, dict[str, str], str]:
    body = json.dumps({"model": model, "prompt": "a b", "max_tokens": 2})
    return curl(gpud, user, "-d", body, f"http://127.0.0.1:{ROUTER}/v1/completions")


def models(gpud: SandboxGpud, user: str) -> dict[str, Any]:
    status, _h, body = curl(gpud, user, f"http://127.0.0.1:{ROUTER}/v1/models", timeout=20)
    assert status == 200, body
    return {m["id"]: m["gpud"]["state"] for m in json.loads(body)["data"]}


def test_one_users_waiting_requests_leave_anothers_bring_up_and_the_states(
        shared: SandboxGpud) -> None:
    """H1: the greedy user parks 80 requests for a serve slow to start (gpud's socket held
    64 connections of the front's uid in all: every ensure is the front's); the polite
    user's /v1/models still shows gpud's states and their sleeping serve is woken, while
    the greedy user's requests past their bound are refused at once, typed (429)."""
    gpud = shared
    assert gpud.call("POST", "/v1/serves/chat/start", {}).status == 200
    gpud.wait_state("chat", "running")
    assert gpud.call("POST", "/v1/serves/chat/sleep", {}).status == 200
    gpud.wait_state("chat", "sleeping")

    body = json.dumps({"model": "b", "prompt": "a", "max_tokens": 1})
    flood = gpud.sb.popen(
        f"for i in $(seq 80); do curl -s -o /dev/null -w '%{{http_code}}\\n' --max-time 150 "
        f"-H 'Authorization: Bearer {TOKENS[GREEDY]}' -d '{body}' "
        f"http://127.0.0.1:{ROUTER}/v1/completions >> /tmp/greedy.out & done; wait",
        user=GREEDY, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        gpud.wait_state("b", "starting", timeout=30)

        def answered() -> list[str]:
            return gpud.sb.run(["cat", "/tmp/greedy.out"], check=False).stdout.split()
        # the greedy user's requests past the bound are answered at once; those within it wait
        wait_until(lambda: len(answered()) >= 80 - PER_REQUESTER, timeout=30,
                   what="the greedy requests past the bound answered")
        time.sleep(1)
        assert answered() == ["429"] * (80 - PER_REQUESTER), answered()
        status, headers, text = complete(gpud, GREEDY, "b")
        error = json.loads(text)["error"]
        assert status == 429 and headers.get("Retry-After") == "5", (status, headers, text)
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
        assert "ensure_waiting_per_requester" in error["message"], error

        # the polite user: gpud's states, and their serve woken within bounds
        assert models(gpud, POLITE) == {"chat": "sleeping"}
        began = time.monotonic()
        status, _h, text = complete(gpud, POLITE, "chat")
        took = time.monotonic() - began
        assert status == 200 and json.loads(text)["model"] == "chat", text
        assert took < 15, took
        assert gpud.serve("b")["state"] == "starting"
        assert models(gpud, GREEDY) == {"b": "starting"}
    finally:
        gpud.sb.kill(flood)
