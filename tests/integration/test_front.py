"""The front under real systemd: a serve with `front = true` listens on a Unix socket only root
and the front reach; its port is nginx's (gpud-front.service), which forwards the client API
and answers 404 to vLLM's dev routes. Simulated GPU, stand-in serves."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from tests.integration.gpudctl import PY, REPO, STANDIN, SandboxGpud, sim_config
from tests.waiting import wait_until

PORT = 30181
SOCKET = "/run/gpud/serves/chat.sock"
USER = "gpud-front-client"  # a local user who is not in group gpud nor the front's group


def front_config() -> str:
    command = json.dumps([*STANDIN, "serve", "m", "--uds", "{socket}",
                          "--gpu-memory-utilization", "{gpu_memory_utilization}",
                          "--enable-sleep-mode", "--context-mib", "200", "--asleep-mib", "800",
                          "--token-interval-s", "0.2"])
    serve = (f'[serves.chat]\nrole = "r"\nvram_mib = 12000\nport = {PORT}\nfront = true\n'
             f"sleep_level = 1\nsleep_mib = 800\ncommand = {command}\n"
             'environment = { VLLM_SERVER_DEV_MODE = "1" }\n')
    role = '[roles.r]\ndevice = "GPU-sim-0"\nreserve_mib = 1000\n'
    return sim_config(role, serve, daemon=f'front_nginx = "{REPO}/.venv/bin/nginx"\n')


@pytest.fixture
def fronted(gpud: SandboxGpud) -> Iterator[SandboxGpud]:
    sb = gpud.sb
    sb.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
            "gpud-front"], check=False)
    sb.run(["useradd", "--no-create-home", USER], check=False)
    try:
        gpud.configure(front_config())
        yield gpud
    finally:
        gpud.reset()
        sb.run("systemctl stop gpud-front.service; systemctl reset-failed gpud-front.service; "
               f"rm -rf /run/gpud/front /run/gpud/serves; userdel {USER}; userdel gpud-front",
               check=False)


def curl(gpud: SandboxGpud, *args: str) -> str:
    """curl as a local user who is nobody to gpud: the status code, then the body."""
    out = gpud.sb.run(["curl", "-s", "-w", "\n%{http_code}", *args], user=USER, check=False)
    body, _, status = out.stdout.rpartition("\n")
    return f"{status} {body}"


def front_active(gpud: SandboxGpud) -> bool:
    return gpud.unit_prop("gpud-front.service", "ActiveState") == "active"


def test_only_the_client_api_reaches_a_fronted_serve(fronted: SandboxGpud) -> None:
    gpud = fronted
    try:
        wait_until(lambda: front_active(gpud), timeout=30, what="gpud-front.service active")
    except AssertionError:
        raise AssertionError(gpud.journal_tail() + gpud.sb.run(
            "journalctl -u gpud-front --no-pager | tail -20", check=False).stdout) from None
    assert gpud.unit_prop("gpud-front.service", "User") == "gpud-front"
    # Not started yet: the front answers, with 503.
    assert curl(gpud, f"http://127.0.0.1:{PORT}/v1/models").startswith("503")
    reply = gpud.call("POST", "/v1/serves/chat/start", {})
    assert reply.status == 200, reply.raw
    # running: gpud's health checks reached /health over the socket
    gpud.wait_state("chat", "running")
    assert gpud.unit_prop("gpud-serve-chat.service", "UMask") == "0007"

    base = f"http://127.0.0.1:{PORT}"
    for path in ("/wake_up", "/sleep?level=1", "/collective_rpc", "/is_sleeping"):
        assert curl(gpud, "-X", "POST", "-d", "{}", base + path).startswith("404"), path
    models = curl(gpud, base + "/v1/models")
    assert models.startswith("200") and '"id": "m"' in models, models

    # The serve's own socket: EACCES for the same user, at the directory.
    probe = gpud.sb.run([PY, "-c", "import socket; s = socket.socket(socket.AF_UNIX); "
                         f"s.connect({SOCKET!r})"], user=USER, check=False)
    assert probe.returncode != 0 and "PermissionError" in probe.stderr, probe.stderr
    mode = gpud.sb.run(["stat", "-c", "%a %U %G", "/run/gpud/serves", SOCKET]).stdout.split("\n")
    assert mode[:2] == ["750 root gpud-front", "770 root gpud-front"], mode

    # A stream comes through, token by token.
    started = time.monotonic()
    stream = gpud.sb.run(["curl", "-sN", "-d", json.dumps({"prompt": "a b c", "max_tokens": 3,
                                                           "stream": True}),
                          base + "/v1/completions"], user=USER)
    assert time.monotonic() - started >= 0.4
    events = [line for line in stream.stdout.splitlines() if line.startswith("data: ")]
    assert len(events) == 4 and events[-1] == "data: [DONE]", stream.stdout

    # gpud's own sleep and wake go over the socket.
    assert gpud.call("POST", "/v1/serves/chat/sleep", {}).status == 200
    assert gpud.serve("chat")["state"] == "sleeping"
    assert gpud.call("POST", "/v1/serves/chat/wake", {}).status == 200
    gpud.wait_state("chat", "running")

    # Restarting gpud leaves the front (and its connections) alone.
    pid = gpud.unit_prop("gpud-front.service", "MainPID")
    gpud.sb.run(["systemctl", "restart", "gpud.service"], timeout=60)
    gpud.wait_state("chat", "running")
    assert gpud.unit_prop("gpud-front.service", "MainPID") == pid
    assert curl(gpud, base + "/v1/models").startswith("200")
