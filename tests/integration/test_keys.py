"""Keys from the command line under real systemd: `gpuctl keys` run as root inside the
sandbox edits the router's keys file, gpud reloads, and the front's real nginx takes the new
key, refuses a rotated key's old token and a revoked key. Simulated GPU, a stand-in serve."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.gpudctl import PY, REPO, SandboxGpud, fronted_gpud, sim_config, standin_uds
from tests.waiting import wait_until

ROUTER = 30295
PORT = 30296
KEYS = "/etc/gpud/keys.toml"
OPS = "sk-ops-0123456789abcdef"
USER = "gpud-keys-client"  # a local user who is nobody to gpud


def keys_config() -> str:
    serves = (f'[serves.chat]\nrole = "r"\nvram_mib = 2000\nport = {PORT}\nfront = true\nmodels = ["chat"]\n'
              f"command = {standin_uds('--served-model-name', 'chat')}\n")
    role = '[roles.r]\ndevice = "GPU-sim-0"\nreserve_mib = 1000\n'
    return sim_config(role, serves) + (f'[router]\nlisten = "127.0.0.1:{ROUTER}"\n'
                                       f'api_keys_file = "{KEYS}"\n')


@pytest.fixture
def keyed(gpud: SandboxGpud) -> Iterator[SandboxGpud]:
    gpud.sb.run(["mkdir", "-p", "/etc/gpud"])
    keys = f'# operators\n[keys.ops]\ntoken = "{OPS}"\nmodels = ["*"]\n'
    with gpud.keys_file(KEYS, keys), fronted_gpud(gpud, keys_config(), [USER]):
        yield gpud


def gpuctl(gpud: SandboxGpud, *argv: str, check: bool = True) -> tuple[int, Any, str]:
    """gpuctl --json as root inside the sandbox (the keys file is root's there): its exit
    code, JSON answer (or error) and stderr."""
    out = gpud.sb.run(["/usr/bin/env", f"PYTHONPATH={REPO}", PY, "-m", "gpud.ctl", "--json",
                       *argv], check=check, timeout=60)
    return out.returncode, json.loads(out.stdout), out.stderr


def ask(gpud: SandboxGpud, token: str) -> int:
    """The status of a request for chat through the router, as a local user, with TOKEN."""
    body = json.dumps({"model": "chat", "prompt": "a b", "max_tokens": 2})
    out = gpud.sb.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-H",
                       f"Authorization: Bearer {token}", "-d", body,
                       f"http://127.0.0.1:{ROUTER}/v1/completions"], user=USER, timeout=60)
    return int(out.stdout)


def test_a_key_added_rotated_and_revoked_from_gpuctl(keyed: SandboxGpud) -> None:
    gpud = keyed
    assert gpud.call("POST", "/v1/serves/chat/start", {}).status == 200
    gpud.wait_state("chat", "running")
    assert ask(gpud, OPS) == 200

    _, added, _ = gpuctl(gpud, "keys", "add", "carol", "--models", "chat",
                         "--requests-per-minute", "600")
    token = added["token"]
    text = gpud.sb.run(["cat", KEYS]).stdout
    assert token not in text and text.startswith("# operators\n[keys.ops]\n")
    mode = gpud.sb.run(["stat", "-c", "%a %U", KEYS]).stdout.split()
    assert mode == ["600", "root"]
    # gpud's reload answers once nginx has its SIGHUP; its new workers take the new keys
    # a moment later (nginx's graceful reload)
    wait_until(lambda: ask(gpud, token) == 200, what="the router takes the new key")
    assert [k["name"] for k in gpuctl(gpud, "keys", "list")[1]["keys"]] == ["carol", "ops"]

    rotated = gpuctl(gpud, "keys", "rotate", "carol")[1]["token"]
    assert rotated != token
    wait_until(lambda: ask(gpud, token) == 401, what="the rotated key's old token refused")
    assert ask(gpud, rotated) == 200

    gpuctl(gpud, "keys", "revoke", "carol")
    wait_until(lambda: ask(gpud, rotated) == 401, what="the revoked key refused")
    assert ask(gpud, OPS) == 200
    # a key no serve can use is refused before the file changes, and the router keeps its keys
    code, refused, _ = gpuctl(gpud, "keys", "add", "dan", "--models", "nope", check=False)
    assert code == 2 and "no serve answers to 'nope'" in refused["error"]["message"], refused
    assert "dan" not in gpud.sb.run(["cat", KEYS]).stdout
    reloads = gpud.events(kind="reload")
    assert len(reloads) == 3, reloads  # one each: add, rotate, revoke
