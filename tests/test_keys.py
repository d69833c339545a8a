"""Keys from the command line: the keys file's edits (gpud.core.keyfile), a token's SHA-256 in
place of the token (gpud.core.keys.parse_keys), and `gpuctl keys` against an in-memory gpud
with real files (the whole result checked before it replaces the old file, then a reload; the
old file back when gpud refuses it)."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from gpud.core.keyfile import KeyEntry, KeyFileError, keys_in, set_key
from gpud.core.keys import parse_keys
from gpud.ctl.client import MemoryTransport
from gpud.ctl.errors import EXIT_OK, EXIT_REFUSED, EXIT_USAGE
from gpud.ctl.main import main
from gpud.nginx.router import load_keys
from tests.test_gpuctl import RELOADED, SERVE_FAST, SERVE_OCR, STATUS, answer_problems

DIGEST = hashlib.sha256(b"sk-new-0123456789abcdef").hexdigest()

FILE = """\
# the router's keys: root's, 0600
[keys.alice]  # the chat team
token = "sk-alice-0123456789"
models = ["chat"]
max_concurrent = 2

# batch jobs, nightly
[keys."bob@ci"]
token = "sk-bob-0123456789ab"
models = ["*"]
"""


def test_a_key_may_be_given_by_its_tokens_sha256() -> None:
    text = f'[keys.carol]\nsha256 = "{DIGEST.upper()}"\nmodels = ["chat"]\n'
    keys, problems = parse_keys(text, ["chat"])
    assert problems == [] and keys[0].sha256 == DIGEST  # as the router compares it
    same = parse_keys(text + '[keys.dan]\ntoken = "sk-new-0123456789abcdef"\nmodels = ["*"]\n',
                      ["chat"])[1]
    assert same == ["keys.dan.token: the same token as keys.carol"]
    both = parse_keys(f'[keys.e]\nsha256 = "{DIGEST}"\ntoken = "sk-new-0123456789abcdef"\n'
                      'models = ["*"]\n', [])[1]
    assert both == ["keys.e: token or sha256, not both"]
    short = parse_keys('[keys.e]\nsha256 = "abc"\nmodels = ["*"]\n', [])[1]
    assert short == ["keys.e.sha256: the token's SHA-256, 64 hex digits"]


def test_adding_a_key_keeps_the_rest_of_the_file_as_written() -> None:
    out = set_key(FILE, "carol", KeyEntry(DIGEST, ("chat", "ocr"), {"requests_per_minute": 60,
                                                                     "weight": 2.5}))
    assert out == FILE + (f'\n[keys.carol]\nsha256 = "{DIGEST}"\nmodels = ["chat", "ocr"]\n'
                          "requests_per_minute = 60\nweight = 2.5\n")
    keys, problems = parse_keys(out, ["chat", "ocr"])
    assert problems == [] and [k.name for k in keys] == ["alice", "bob@ci", "carol"]
    # a name that is no bare TOML key is quoted; a file that does not end in a newline
    assert set_key('[keys.a]\ntoken = "sk-a-0123456789abcd"\nmodels = ["*"]', "x.y",
                   KeyEntry(DIGEST, ("*",), {})).endswith(
        f'models = ["*"]\n\n[keys."x.y"]\nsha256 = "{DIGEST}"\nmodels = ["*"]\n')
    assert set_key("", "a", KeyEntry(DIGEST, ("*",), {})) == \
        f'[keys.a]\nsha256 = "{DIGEST}"\nmodels = ["*"]\n'


def test_replacing_and_removing_a_key_touch_its_table_only() -> None:
    rotated = set_key(FILE, "alice", KeyEntry(DIGEST, ("chat",), {"max_concurrent": 2}))
    assert rotated == FILE.replace(
        '[keys.alice]  # the chat team\ntoken = "sk-alice-0123456789"\n',
        f'[keys.alice]\nsha256 = "{DIGEST}"\n')
    # the comment and blank line before the next table are that table's
    assert set_key(FILE, "alice", None) == (
        "# the router's keys: root's, 0600\n\n# batch jobs, nightly\n" + FILE.split(
            "# batch jobs, nightly\n")[1])
    # a comment above a table is outside it: kept (it may be the file's own)
    assert set_key(FILE, "bob@ci", None) == FILE.split("[keys.\"bob")[0]
    assert set(keys_in(set_key(FILE, "bob@ci", None))) == {"alice"}


@pytest.mark.parametrize("text", [
    '[keys]\nalice = { token = "sk-alice-0123456789", models = ["*"] }\n',
    '[keys]\nalice.token = "sk-alice-0123456789"\nalice.models = ["*"]\n',
    '[keys.alice]\ntoken = "sk-alice-0123456789"\nmodels = ["*"]\n[keys.alice.more]\nx = 1\n',
])
def test_a_layout_that_cannot_be_edited_line_by_line_is_refused(text: str) -> None:
    with pytest.raises(KeyFileError, match=r"keys\.alice"):
        set_key(text, "alice", KeyEntry(DIGEST, ("*",), {}))


def test_removing_a_key_that_is_not_there_is_refused() -> None:
    with pytest.raises(KeyFileError, match="no key 'carol'"):
        set_key(FILE, "carol", None)


# ---- gpuctl keys, with real files ------------------------------------------------------------


@pytest.fixture
def host(tmp_path: Path) -> tuple[MemoryTransport, Path, Path]:
    """An in-memory gpud (answers held to its document) whose config names a keys file."""
    keys = tmp_path / "keys.toml"
    keys.write_text(FILE)
    keys.chmod(0o600)
    config = tmp_path / "serves.toml"
    config.write_text(f'[router]\napi_keys_file = "{keys}"\n')

    def check(req: Any, status: int, doc: Any) -> None:
        assert answer_problems(req.method, req.target, status, doc) == []

    memory = MemoryTransport("/run/gpud/gpud.sock", check=check)
    memory.answer("GET", "/v1/status", 200, dict(STATUS, config=str(config)))
    memory.answer("GET", "/v1/serves", 200, {"simulated": True, "serves": [
        dict(SERVE_FAST, models=["chat"]), dict(SERVE_OCR, models=["ocr"])]})
    memory.answer("POST", "/v1/reload", 200, RELOADED)
    return memory, config, keys


def keys_cmd(memory: MemoryTransport, *argv: str) -> int:
    return main(["keys", *argv], transport=memory)


def reloads(memory: MemoryTransport) -> int:
    return sum(1 for r in memory.requests if r.target == "/v1/reload")


def test_add_rotate_revoke_through_gpuctl(host: tuple[MemoryTransport, Path, Path],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    memory, _config, keys = host
    assert keys_cmd(memory, "add", "carol", "--models", "chat", "ocr",
                    "--requests-per-minute", "60", "--priority", "-5",
                    "--tokens-per-day", "5000", "--tokens-per-month", "0") == EXIT_OK
    out = capsys.readouterr().out.splitlines()
    token = out[1].removeprefix("token: ")
    assert out[0] == f"key carol added in {keys}; gpud reloaded" and token.startswith("sk-gpud-")
    text = keys.read_text()
    assert token not in text and hashlib.sha256(token.encode()).hexdigest() in text
    assert stat.S_IMODE(keys.stat().st_mode) == 0o600 and reloads(memory) == 1
    # what gpud itself reads: the token's digest, the models and limits given
    carol = {k.name: k for k in load_keys(str(keys), ["chat", "ocr"])}["carol"]
    assert (carol.sha256, carol.models, carol.requests_per_minute, carol.priority) == (
        hashlib.sha256(token.encode()).hexdigest(), ("chat", "ocr"), 60, -5)
    assert (carol.tokens_per_day, carol.tokens_per_month) == (5000, 0)
    assert text.startswith(FILE)  # the rest as written

    assert keys_cmd(memory, "--json", "rotate", "carol") == EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    assert doc["token"] != token and doc["action"] == "rotate"
    rotated = {k.name: k for k in load_keys(str(keys), ["chat", "ocr"])}["carol"]
    assert rotated.sha256 == hashlib.sha256(doc["token"].encode()).hexdigest()
    assert (rotated.models, rotated.requests_per_minute, rotated.priority,
            rotated.tokens_per_day, rotated.tokens_per_month) == (("chat", "ocr"), 60, -5, 5000, 0)

    assert keys_cmd(memory, "revoke", "carol") == EXIT_OK
    assert keys.read_text() == FILE and reloads(memory) == 3
    assert keys_cmd(memory, "list") == EXIT_OK
    listed = capsys.readouterr().out.splitlines()
    assert listed[-3:] == [
        "KEY     MODELS  STORED  MAX_CONC  RPM  PRIORITY  WEIGHT  TOKENS/DAY  TOKENS/MONTH  PEER",
        "alice   chat    token   2         -    -         -       -           -             -",
        "bob@ci  *       token   -         -    -         -       -           -             -"]
    assert "sk-" not in "\n".join(listed)  # no token shown


def test_a_peer_key_is_added_marked_and_keeps_its_mark_when_rotated(
        host: tuple[MemoryTransport, Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """`gpuctl keys add NAME --peer`: the key another gpud host presents (docs/peers.md)."""
    memory, _config, keys = host
    assert keys_cmd(memory, "add", "front-ws", "--peer", "--max-concurrent", "8") == EXIT_OK
    capsys.readouterr()
    assert keys.read_text().endswith('models = ["*"]\nmax_concurrent = 8\npeer = true\n')
    got = {k.name: k for k in load_keys(str(keys), ["chat", "ocr"])}
    assert got["front-ws"].peer and not got["alice"].peer
    assert keys_cmd(memory, "rotate", "front-ws") == EXIT_OK
    capsys.readouterr()
    assert {k.name: k for k in load_keys(str(keys), ["chat", "ocr"])}["front-ws"].peer
    assert keys_cmd(memory, "--json", "list") == EXIT_OK
    rows = {k["name"]: k for k in json.loads(capsys.readouterr().out)["keys"]}
    assert (rows["front-ws"]["peer"], rows["alice"]["peer"]) == (True, False)
    # --peer goes with add only
    assert keys_cmd(memory, "rotate", "alice", "--peer") == EXIT_USAGE
    assert "--peer" in capsys.readouterr().err


def test_peer_is_a_boolean_and_anything_else_is_refused_with_the_key_named() -> None:
    base = '[keys.front-ws]\ntoken = "sk-front-0123456789"\nmodels = ["*"]\n'
    keys, problems = parse_keys(base + "peer = true\n", [])
    assert problems == [] and keys[0].peer is True
    assert parse_keys(base + "peer = false\n", [])[0][0].peer is False
    assert parse_keys(base, [])[0][0].peer is False  # the default: an ordinary key
    for wrong in ('"yes"', "1", "[true]"):
        _, problems = parse_keys(base + f"peer = {wrong}\n", [])
        assert len(problems) == 1 and problems[0].startswith(
            "keys.front-ws.peer: true or false (got "), problems


def test_a_change_gpud_would_refuse_changes_nothing(host: tuple[MemoryTransport, Path, Path],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    memory, _config, keys = host
    assert keys_cmd(memory, "add", "carol", "--models", "nope") == EXIT_USAGE
    assert "keys.carol.models: no serve answers to 'nope'" in capsys.readouterr().err
    assert keys_cmd(memory, "add", "carol", "--max-concurrent", "70000") == EXIT_USAGE
    assert "keys.carol.max_concurrent: an integer from 1 to 65535" in capsys.readouterr().err
    assert keys_cmd(memory, "add", "carol", "--tokens-per-month", "-1") == EXIT_USAGE
    assert ("keys.carol.tokens_per_month: an integer from 0 to 1000000000000000 (got -1)"
            in capsys.readouterr().err)
    assert keys_cmd(memory, "add", "alice") == EXIT_REFUSED
    assert "key 'alice' exists" in capsys.readouterr().err
    assert keys_cmd(memory, "rotate", "carol") == EXIT_USAGE
    assert keys_cmd(memory, "add", "no spaces") == EXIT_USAGE
    assert keys_cmd(memory, "rotate", "alice", "--models", "chat") == EXIT_USAGE
    assert keys.read_text() == FILE and reloads(memory) == 0


def test_a_refused_reload_puts_the_old_file_back(host: tuple[MemoryTransport, Path, Path],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    memory, _config, keys = host
    memory.answer("POST", "/v1/reload", 400, {"error": {
        "code": "config-invalid", "message": "serves.toml: router.listen: in use",
        "details": {}}})
    assert keys_cmd(memory, "revoke", "alice") == EXIT_USAGE
    assert "gpud refused the reload" in capsys.readouterr().err
    assert keys.read_text() == FILE and reloads(memory) == 1


def test_a_config_on_disk_not_in_force_is_not_reloaded_behind_the_operators_back(
        host: tuple[MemoryTransport, Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    memory, config, keys = host
    memory.answer("GET", "/v1/status", 200, dict(
        STATUS, config=str(config), config_file={"differs": True, "reason": "changed on disk"}))
    assert keys_cmd(memory, "add", "carol") == EXIT_REFUSED
    assert "not the config in force" in capsys.readouterr().err
    assert keys.read_text() == FILE and reloads(memory) == 0
    assert keys_cmd(memory, "list") == EXIT_OK  # reading is fine


def test_the_first_key_makes_the_file_and_a_missing_directory_is_said(
        host: tuple[MemoryTransport, Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    memory, config, keys = host
    keys.unlink()
    assert keys_cmd(memory, "list") == EXIT_OK
    assert capsys.readouterr().out == f"no keys in {keys} (no such file yet)\n"
    assert keys_cmd(memory, "add", "carol") == EXIT_OK
    assert keys.read_text().startswith('[keys.carol]\nsha256 = "')
    assert stat.S_IMODE(keys.stat().st_mode) == 0o600
    config.write_text(f'[router]\napi_keys_file = "{keys.parent}/none/keys.toml"\n')
    assert keys_cmd(memory, "add", "dan") == EXIT_REFUSED
    assert "cannot open " in capsys.readouterr().err


def test_without_a_keys_file_in_the_config(host: tuple[MemoryTransport, Path, Path],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    memory, config, _keys = host
    config.write_text('[router]\nlisten = "127.0.0.1:8000"\n')
    assert keys_cmd(memory, "list") == EXIT_REFUSED
    assert "has no router.api_keys_file" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another uid")
def test_a_user_who_may_not_read_the_keys_gets_a_clear_error(
        host: tuple[MemoryTransport, Path, Path], capfd: pytest.CaptureFixture[str]) -> None:
    memory, config, _keys = host
    config.chmod(0o600)
    pid = os.fork()
    if pid == 0:  # as nobody: the config and the keys file are root's
        code = 99
        try:
            os.setgid(65534)
            os.setuid(65534)
            code = keys_cmd(memory, "list")
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == EXIT_REFUSED
    assert "permission denied (uid 65534)" in capfd.readouterr().err
