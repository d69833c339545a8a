"""The one endpoint is safe to share (docs/security.md): two local users, nobody to gpud,
each with a key of the router; one of them takes what they can, the other is served. Real
systemd, gpud, the front's nginx with the router, simulated GPU, stand-in serves."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.gpudctl import REPO, SandboxGpud, fronted_gpud, sim_config, standin_uds
from tests.integration.test_page import page_forwarded, shown_page
from tests.waiting import wait_until

ROUTER = 30390
PORT = 30391
GREEDY, POLITE = "gpud-greedy", "gpud-polite"
KEYS = "/etc/gpud-router-keys.toml"
TOKENS = {GREEDY: "sk-greedy-0123456789abcdef", POLITE: "sk-polite-0123456789abcdef"}
PER_REQUESTER = 16  # daemon.ensure_waiting_per_requester's default


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
    # daemon.ensure_waiting_per_requester left at its default (PER_REQUESTER): the same
    # config runs on a gpud that has no such bound
    router = f'[router]\nlisten = "127.0.0.1:{ROUTER}"\napi_keys_file = "{KEYS}"\n'
    return sim_config(role, serves, devices=2) + router


@pytest.fixture
def shared(gpud: SandboxGpud) -> Iterator[SandboxGpud]:
    keys = (f'[keys.greedy]\ntoken = "{TOKENS[GREEDY]}"\nmodels = ["b"]\n'
            f'[keys.polite]\ntoken = "{TOKENS[POLITE]}"\nmodels = ["chat"]\n')
    with gpud.keys_file(KEYS, keys, "/tmp/greedy.out"), \
            fronted_gpud(gpud, shared_config(), [GREEDY, POLITE]):
        yield gpud


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
        # the router's one 429 (a key's limits answer the same): OpenAI's, the bound named
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests", error
        assert "ensure_waiting_per_requester" in error["message"], error
        assert {k: error["gpud"][k] for k in ("limit", "value", "retry_after_s")} == {
            "limit": "daemon.ensure_waiting_per_requester", "value": PER_REQUESTER,
            "retry_after_s": 5}, error

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


def test_without_keys_one_users_waiting_requests_refuse_no_request_for_a_serve_that_is_up(
        gpud: SandboxGpud) -> None:
    """Issue 50 item 5: without keys, one local user parks more requests than the bound for a
    serve slow to start, from several loopback addresses: past the bound they are refused
    from every address (all of loopback is one requester); another local user's request for
    an on-demand serve that is up is answered, not refused by that bound."""
    serves = (
        f'[serves.up]\nrole = "r"\nvram_mib = 8000\nport = {PORT}\non_demand = true\n'
        'models = ["up"]\n'
        f"command = {standin_uds('--served-model-name', 'up')}\n"
        f'[serves.b]\nrole = "r1"\nvram_mib = 8000\nport = {PORT + 1}\non_demand = true\n'
        'start_timeout_s = 120\nmodels = ["b"]\n'
        f"command = {standin_uds('--startup-delay', '60', '--served-model-name', 'b')}\n")
    role = ('[roles.r]\ndevice = "GPU-sim-0"\nreserve_mib = 1000\n'
            '[roles.r1]\ndevice = "GPU-sim-1"\nreserve_mib = 1000\n')
    config = (sim_config(role, serves, devices=2)
              + f'[router]\nlisten = "127.0.0.1:{ROUTER}"\n')

    def ask(user: str, model: str, source: str = "127.0.0.1") -> str:
        body = json.dumps({"model": model, "prompt": "a", "max_tokens": 1})
        return gpud.sb.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                            "--interface", source, "--max-time", "60", "-d", body,
                            f"http://127.0.0.1:{ROUTER}/v1/completions"],
                           user=user, check=False, timeout=90).stdout

    with fronted_gpud(gpud, config, [GREEDY, POLITE]):
        wait_until(lambda: ask(POLITE, "up") == "200", timeout=60, what="up brought up")
        b_body = json.dumps({"model": "b", "prompt": "a", "max_tokens": 1})

        def park(count: int, sources: str) -> subprocess.Popen[str]:
            return gpud.sb.popen(
                f"for i in $(seq {count}); do curl -s -o /dev/null -w '%{{http_code}}\\n' "
                f"--max-time 150 --interface {sources} -d '{b_body}' "
                f"http://127.0.0.1:{ROUTER}/v1/completions >> /tmp/greedy.out & done; wait",
                user=GREEDY, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def answered() -> list[str]:
            return gpud.sb.run(["cat", "/tmp/greedy.out"], check=False).stdout.split()

        floods = [park(PER_REQUESTER, "127.0.0.1")]
        try:
            gpud.wait_state("b", "starting", timeout=30)
            # the bound full: one more from 127.0.0.1 is refused at once
            wait_until(lambda: ask(GREEDY, "b") == "429", timeout=30,
                       what="the greedy user's requests at the bound")
            # the other user's request for the serve that is up: answered, from any address
            for source in ("127.0.0.1", "127.0.0.5"):
                assert ask(POLITE, "up", source) == "200"
            # more from other loopback addresses: the same requester, refused at once
            floods.append(park(8, "127.0.0.$(( i % 4 + 2 ))"))
            wait_until(lambda: len(answered()) >= 8, timeout=30,
                       what="the requests from other addresses answered")
            assert answered() == ["429"] * 8, answered()
            assert gpud.serve("b")["state"] == "starting"
        finally:
            for flood in floods:
                gpud.sb.kill(flood)
            gpud.sb.run(["rm", "-f", "/tmp/greedy.out"], check=False)


# --- a change that would leave the router or a front dark (H4, H5) -------------------------

LIT = 30395
KEYS_CI = f'[keys.ci]\ntoken = "{TOKENS[POLITE]}"\nmodels = ["chat"]\n'


def lit_config(listen: int = LIT, chat: bool = True) -> str:
    serves = (f'[serves.chat]\nrole = "r"\nvram_mib = 4000\nport = {LIT + 1}\n'
              'resident = true\nfront = true\nmodels = ["chat"]\n'
              f"command = {standin_uds('--served-model-name', 'chat')}\n" if chat else "")
    serves += (f'[serves.ocr]\nrole = "r"\nvram_mib = 4000\nport = {LIT + 2}\n'
               'resident = true\nfront = true\n'
               f"command = {standin_uds('--served-model-name', 'ocr')}\n")
    role = '[roles.r]\ndevice = "GPU-sim-0"\nreserve_mib = 1000\n'
    router = f'[router]\nlisten = "127.0.0.1:{listen}"\napi_keys_file = "{KEYS}"\n'
    return sim_config(role, serves) + router


@pytest.fixture
def lit(gpud: SandboxGpud) -> Iterator[SandboxGpud]:
    with gpud.keys_file(KEYS, KEYS_CI), fronted_gpud(gpud, lit_config(), [GREEDY, POLITE]):
        gpud.wait_state("chat", "running")
        gpud.wait_state("ocr", "running")
        yield gpud


def gpuctl(gpud: SandboxGpud, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpud.ctl", "--socket", str(gpud.socket),
                           *args], capture_output=True, text=True, cwd=REPO, timeout=120,
                          check=False)


def listening(gpud: SandboxGpud, port: int) -> bool:
    return gpud.sb.run(["bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{port}"],
                       check=False).returncode == 0


def routed_ok(gpud: SandboxGpud, port: int = LIT) -> bool:
    body = json.dumps({"model": "chat", "prompt": "a", "max_tokens": 1})
    status, _h, _t = curl(gpud, POLITE, "-d", body, f"http://127.0.0.1:{port}/v1/completions")
    return status == 200


def test_a_change_that_would_leave_the_router_dark_is_refused_before_it_is_made(
        lit: SandboxGpud, tmp_path: Path) -> None:
    """H5, H4: an apply that drops a serve a key names, an apply that moves the router to a
    port another user holds, a reload of a keys file with a bad token: each refused naming
    its cause, nothing changed, the router serving on (at e8f41a4: "[ok] applied" or
    "reloaded", and the router off)."""
    gpud = lit
    assert routed_ok(gpud)
    # the front's memory is its unit's to bound (H3)
    assert gpud.unit_prop("gpud-front.service", "MemoryMax") == str(4 << 30)
    config = "/etc/gpud/serves.toml"
    (tmp_path / "dropped.toml").write_text(lit_config(chat=False))
    out = gpuctl(gpud, "apply", str(tmp_path / "dropped.toml"))
    assert out.returncode != 0, out.stdout
    assert f"router.api_keys_file: {KEYS}: keys.ci.models: no serve answers to 'chat'" in \
        out.stdout + out.stderr, out.stdout + out.stderr
    plan = json.loads(gpuctl(gpud, "--json", "plan", str(tmp_path / "dropped.toml")).stdout)
    assert [b["what"] for b in plan["blocked"]] == ["router.api_keys_file"], plan["blocked"]
    assert gpud.serve("chat")["state"] == "running" and routed_ok(gpud)

    # another local user holds the port the router would move to
    holder = gpud.sb.popen(["python3", "-c", "import socket, time; s = socket.socket(); "
                            f"s.bind(('127.0.0.1', {LIT + 3})); s.listen(); time.sleep(600)"],
                           user=GREEDY, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: listening(gpud, LIT + 3), what="the other user's listener")
        (tmp_path / "moved.toml").write_text(lit_config(listen=LIT + 3))
        out = gpuctl(gpud, "apply", str(tmp_path / "moved.toml"))
        assert out.returncode != 0, out.stdout
        assert f"router.listen: 127.0.0.1:{LIT + 3} is in use by another process" in \
            out.stdout + out.stderr, out.stdout + out.stderr
        assert routed_ok(gpud)
        assert gpud.sb.run(["cat", config]).stdout == lit_config()
    finally:
        gpud.sb.kill(holder)

    # a bad token in the keys file, and a reload
    gpud.sb.run(["bash", "-c", f"umask 077; cat > {KEYS}"],
                input='[keys.ci]\ntoken = "short"\nmodels = ["chat"]\n')
    out = gpuctl(gpud, "reload")
    assert out.returncode != 0, out.stdout
    assert "router.api_keys_file" in out.stdout + out.stderr and "keys.ci.token" in \
        out.stdout + out.stderr, out.stdout + out.stderr
    assert routed_ok(gpud)


def test_a_world_changed_under_a_running_config_keeps_the_last_good_and_says_degraded(
        lit: SandboxGpud) -> None:
    """H4: the keys file turned bad, and a fronted port taken by another user while the
    front was down: at gpud's next start the router keeps the keys last read, the other
    ports and the router stay lit, and /v1/status, gpuctl status and a metric say what is
    dark and why (at e8f41a4: the router off, or every port dark while gpud logged "front
    started")."""
    gpud = lit
    gpud.sb.run(["bash", "-c", f"umask 077; cat > {KEYS}"],
                input='[keys.ci]\ntoken = "short"\nmodels = ["chat"]\n')
    gpud.sb.run(["systemctl", "stop", "gpud.service", "gpud-front.service"])
    holder = gpud.sb.popen(["python3", "-c", "import socket, time; s = socket.socket(); "
                            f"s.bind(('127.0.0.1', {LIT + 2})); s.listen(); time.sleep(600)"],
                           user=GREEDY, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: listening(gpud, LIT + 2), what="the other user's listener")
        gpud.start()
        gpud.wait_front()
        gpud.wait_state("chat", "running")
        # the router, with the key it had; chat's own port
        wait_until(lambda: routed_ok(gpud), timeout=30, what="the router serving")
        assert curl(gpud, POLITE, f"http://127.0.0.1:{LIT + 1}/v1/models")[0] == 200
        degraded = gpud.get("/v1/status")["front"]["degraded"]
        assert len(degraded) == 2, degraded
        assert degraded[0].startswith(f"router.api_keys_file: {KEYS}: keys.ci.token") and \
            degraded[0].endswith("(keeping the keys last read)"), degraded
        assert degraded[1].startswith(f"serves.ocr.port: 127.0.0.1:{LIT + 2} is in use by "
                                      "another process"), degraded
        assert gpud.metrics("gpud_front_degraded") == [({}, 2.0)]
        router = gpud.get("/v1/status")["router"]
        assert router == {"listen": f"127.0.0.1:{LIT}", "listening": True,
                          "degraded": degraded[:1]}, router
        status = gpuctl(gpud, "status").stdout
        rows = dict(line.split(":", 1) for line in status.splitlines())
        # the router's own line: listening, on the keys last read, and why; the front's
        # line keeps the rest
        assert rows["router"].strip() == (f"listening on 127.0.0.1:{LIT}; !! DEGRADED: "
                                          + degraded[0]), status
        assert rows["front"].strip() == "!! DEGRADED: " + degraded[1], status
        # the status page says both, the router's as the router's
        with page_forwarded(gpud):
            shown = shown_page(gpud)
        assert shown.by_id["router"] == f"router: listening on 127.0.0.1:{LIT} (degraded)"
        assert shown.problems == [f"router degraded: {degraded[0]}",
                                  f"front degraded: {degraded[1]}"], shown.problems
    finally:
        gpud.sb.kill(holder)
