"""A vLLM release gpud ships no flag table or sizing rules for: its table from an operator's
directory (daemon.vllm_flags_dir) or learned from the installed vLLM (tests/vllm/
test_learned_flags.py runs that against the real vLLM CPU build), the newest known release's
sizing rules, said in --check-config and gpuctl size, never a refusal for that alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpud.config import config_warnings, parse_config
from gpud.core.launch import vllm_argv
from gpud.core.vllm_versions import EXTENSIBLE_KV_OFF, NEWEST_KNOWN, behaviour
from gpud.errors import ConfigError
from gpud.vllm.learn import LearnError, interpreter_of
from gpud.vllm.vllm_flags import available_versions
from tests.conftest import REPO, start_gpud
from tests.test_model_size import big as big  # the fixture
from tests.test_model_size import gpuctl

BASE = """
[roles.gpu]
device = "0"
capacity_mib = 32607

[serves.chat]
role = "gpu"
vram_mib = 14336
port = 30001
[serves.chat.vllm]
model = "org/model"
"""


def daemon(tmp_path: Path, version: str) -> str:
    """A [daemon] whose table directories are TMP_PATH's and whose vllm cannot be run: nothing
    is learned, the tables come from the operator's directory or nowhere."""
    return (f'[daemon]\nvllm_version = "{version}"\nvllm_flags_dir = "{tmp_path / "etc"}"\n'
            f'state_dir = "{tmp_path / "state"}"\nvllm_executable = "/nonexistent/vllm"\n')


def operator_table(tmp_path: Path, version: str, like: str = NEWEST_KNOWN) -> Path:
    """The operator's table of VERSION in vllm_flags_dir: the shipped table of LIKE, relabelled
    (what `scripts/vllm-flags VERSION` would write for a release with the same options)."""
    data = json.loads((REPO / "gpud" / "data" / f"vllm-serve-flags-{like}.json").read_text())
    data["vllm"] = version
    path = tmp_path / "etc" / f"vllm-serve-flags-{version}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(text, "test.toml")
    return info.value.problems


def test_a_release_with_an_operators_table_runs_by_the_newest_rules(tmp_path: Path) -> None:
    assert "0.35.0" not in available_versions()
    table = operator_table(tmp_path, "0.35.0")
    cfg = parse_config(daemon(tmp_path, "0.35.0") + BASE, "t")
    said = config_warnings(cfg)
    assert (f"daemon.vllm_version: gpud has no sizing rules of vLLM 0.35.0's own: it sizes its "
            f"KV cache and its sleep by vLLM {NEWEST_KNOWN}'s, the newest it knows "
            "(docs/vllm.md)") in said
    assert f"daemon.vllm_version: vLLM 0.35.0's serve flags are read from {table}" in said
    # its argv is checked against that table: an option it lacks is refused, naming the release
    found = problems(daemon(tmp_path, "0.35.0") + BASE + 'extra_args = ["--no-such-flag"]\n')
    assert found == ["serves.chat.vllm.extra_args[0]: --no-such-flag is not an option of vllm "
                     "serve in vLLM 0.35.0"]
    # a release from 0.34 on has the extensible KV cache gpud turns off
    argv = vllm_argv(cfg.serves["chat"], executable="vllm", util="0.4396",
                     vllm_version="0.35.0")
    assert argv[-1] == EXTENSIBLE_KV_OFF


def test_a_release_before_0_34_borrows_the_rules_but_not_the_extensible_flag(
        tmp_path: Path) -> None:
    # 0.32's parser has no --enable-extensible-kv-cache (its table: tests/vllm); an argv with
    # --no-enable-extensible-kv-cache would be refused by that vLLM
    operator_table(tmp_path, "0.32.0", like="0.33.0")
    cfg = parse_config(daemon(tmp_path, "0.32.0") + BASE, "t")
    b = behaviour("0.32.0")
    assert (b.rules_from, b.kv, b.extensible_kv_off_arg) == (NEWEST_KNOWN,
                                                             behaviour(NEWEST_KNOWN).kv, False)
    argv = vllm_argv(cfg.serves["chat"], executable="vllm", util="0.4396",
                     vllm_version="0.32.0")
    assert EXTENSIBLE_KV_OFF not in argv


def test_the_releases_gpud_knows_are_said_nothing_of(tmp_path: Path) -> None:
    for version in ("0.33.0", "0.34.0"):
        cfg = parse_config(daemon(tmp_path, version) + BASE, "t")
        assert not [w for w in config_warnings(cfg) if w.startswith("daemon.vllm_version")]
        assert behaviour(version).rules_from is None


def test_a_table_that_is_not_one_is_named(tmp_path: Path) -> None:
    path = operator_table(tmp_path, "0.35.0")
    path.write_text("{not json")
    found = problems(daemon(tmp_path, "0.35.0") + BASE)
    assert len(found) == 1 and found[0].startswith(f"daemon.vllm_version: {path}: not a "
                                                   "readable flag table"), found
    operator_table(tmp_path, "0.36.0")
    path.write_text((tmp_path / "etc" / "vllm-serve-flags-0.36.0.json").read_text())
    assert problems(daemon(tmp_path, "0.35.0") + BASE) == [
        f"daemon.vllm_version: {path}: the table of vLLM 0.36.0, not 0.35.0"]
    path.write_text(json.dumps({"vllm": "0.35.0", "options": "none"}))
    found = problems(daemon(tmp_path, "0.35.0") + BASE)
    assert found[0].startswith(f"daemon.vllm_version: {path}: not a flag table of vllm serve"), \
        found


def test_a_version_that_could_name_a_path_is_refused(tmp_path: Path) -> None:
    assert problems(daemon(tmp_path, "../../etc/x") + BASE) == [
        "daemon.vllm_version: '../../etc/x' is not a vLLM version (like 0.34.0)"]


def test_the_interpreter_of_a_console_script(tmp_path: Path) -> None:
    direct = tmp_path / "vllm"
    direct.write_text(f"#!{sys.executable}\nimport sys\n")
    direct.chmod(0o755)
    assert interpreter_of(str(direct)) == sys.executable
    via_env = tmp_path / "vllm-env"
    via_env.write_text("#!/usr/bin/env python3\n")
    via_env.chmod(0o755)
    assert Path(interpreter_of(str(via_env))).name.startswith("python3")
    binary = tmp_path / "vllm-bin"
    binary.write_bytes(b"\x7fELF")
    binary.chmod(0o755)
    with pytest.raises(LearnError, match="not a script with a #! line"):
        interpreter_of(str(binary))
    with pytest.raises(LearnError, match="is not found"):
        interpreter_of(str(tmp_path / "missing"))


def test_check_config_says_whose_rules_and_whose_flags(tmp_path: Path) -> None:
    table = operator_table(tmp_path, "0.35.0")
    path = tmp_path / "serves.toml"
    path.write_text(daemon(tmp_path, "0.35.0") + BASE)
    path.chmod(0o600)
    out = subprocess.run([sys.executable, "-m", "gpud.daemon", "--check-config", str(path)],
                         capture_output=True, text=True, cwd=REPO, check=False)
    assert out.returncode == 0, out.stderr
    assert (f"warning: daemon.vllm_version: gpud has no sizing rules of vLLM 0.35.0's own: it "
            f"sizes its KV cache and its sleep by vLLM {NEWEST_KNOWN}'s") in out.stdout
    assert f"warning: daemon.vllm_version: vLLM 0.35.0's serve flags are read from {table}" \
        in out.stdout


def test_gpuctl_size_says_whose_rules_size_a_release_it_does_not_know(
        big: Path) -> None:
    out = gpuctl("size", str(big), "--max-model-len", "8192", "--vllm-version", "0.35.0")
    assert out.returncode == 0, out.stderr
    assert "vLLM 0.35.0: blocks of 64 tokens" in out.stdout
    assert (f"(gpud has no sizing rules of vLLM 0.35.0's own: it sizes its KV cache and its "
            f"sleep by vLLM {NEWEST_KNOWN}'s, the newest it knows (docs/vllm.md))") in out.stdout
    doc = json.loads(gpuctl("--json", "size", str(big), "--vllm-version", "0.35.0").stdout)
    assert (doc["vllm_version"], doc["rules_from"]) == ("0.35.0", NEWEST_KNOWN)
    known = json.loads(gpuctl("--json", "size", str(big), "--vllm-version", "0.34.0").stdout)
    assert known["rules_from"] is None and known["rules_note"] is None


def test_the_journal_says_it_when_gpud_starts_or_reloads_to_such_a_release(
        tmp_path: Path) -> None:
    """gpud's own log (the journal under systemd; stderr here): the borrowed rules, at start
    and at a reload that changes the release."""
    operator_table(tmp_path, "0.35.0")
    note = (f"gpud has no sizing rules of vLLM 0.35.0's own: it sizes its KV cache and its "
            f"sleep by vLLM {NEWEST_KNOWN}'s")
    gp = start_gpud(tmp_path, daemon(tmp_path, "0.35.0") + BASE)
    try:
        assert note in gp.output()
    finally:
        gp.stop()
    again = tmp_path / "again"
    again.mkdir()
    operator_table(again, "0.35.0")
    gp = start_gpud(again, daemon(again, "0.34.0") + BASE)
    try:
        assert note not in gp.output()
        gp.config.write_text(daemon(again, "0.35.0") + BASE)
        reply = gp.call("POST", "/v1/reload")
        assert reply.status == 200, reply.body
        assert note in gp.output()
    finally:
        gp.stop()
