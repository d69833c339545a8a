"""vLLM 0.34.0 beside 0.33.0: its flag table, what gpud adds to and refuses in a serve's argv on
it, and the version-dependent behaviour chosen by daemon.vllm_version (gpud.core.vllm_versions)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpud.config import config_warnings, parse_config
from gpud.core.launch import vllm_argv
from gpud.core.vllm_versions import BEHAVIOURS, EXTENSIBLE_KV_OFF, V033, V034, behaviour
from gpud.errors import ConfigError
from gpud.vllm.vllm_flags import available_versions, check_serve_args, load_table
from tests.conftest import REPO, example_toml

V34 = '[daemon]\nvllm_version = "0.34.0"\n'
BASE = """
[roles.gpu]
device = "0"
capacity_mib = 32607
reserve_mib = 4608
"""
SERVE = """
[serves.chat]
role = "gpu"
vram_mib = 14336
port = 30001
"""
VLLM = """
[serves.chat.vllm]
model = "org/model"
"""


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(text, "test.toml")
    return info.value.problems


def test_both_tables_are_there_and_differ_as_0_34_s_parser_does() -> None:
    assert {V033, V034} <= set(available_versions())
    t33, t34 = load_table(V033), load_table(V034)
    assert t34.version == V034
    # the ten options 0.34 added (walked from its parser), none removed
    added = set(t34.options) - set(t33.options)
    assert {"--enable-extensible-kv-cache", "--disable-extensible-kv-cache",
            "--checkpoint-prepare-on-startup", "--shuffle-safetensors-files"} <= added
    assert set(t33.options) <= set(t34.options)
    # --quantization lost fp_quant
    q33, q34 = t33.options["--quantization"].choices, t34.options["--quantization"].choices
    assert q33 is not None and q34 is not None
    assert "fp_quant" in q33 and "fp_quant" not in q34
    # the negation gpud passes is the hidden BooleanOptionalAction spelling
    assert check_serve_args(["m", EXTENSIBLE_KV_OFF], t34) == []
    assert check_serve_args(["m", EXTENSIBLE_KV_OFF], t33) != []


def test_check_config_passes_the_example_on_0_34(tmp_path: Path) -> None:
    text = example_toml().replace(
        "[daemon]\n", '[daemon]\nvllm_version = "0.34.0"\n', 1)
    assert 'vllm_version = "0.34.0"' in text
    path = tmp_path / "serves.toml"
    path.write_text(text)
    path.chmod(0o600)
    run = subprocess.run([sys.executable, "-m", "gpud.daemon", "--check-config", str(path)],
                         capture_output=True, text=True, cwd=REPO, check=False)
    assert run.returncode == 0, run.stderr
    assert "fast 14336 MiB" in run.stdout


def test_check_config_refuses_a_flag_0_34_does_not_have(tmp_path: Path) -> None:
    # an unknown option, and --quantization fp_quant, which only 0.33 has
    text = V34 + BASE + SERVE + VLLM + 'quantization = "fp_quant"\nextra_args = ["--no-such-flag"]\n'
    found = problems(text)
    assert any(p.startswith("serves.chat.vllm.quantization: --quantization 'fp_quant': not one of")
               for p in found), found
    assert any(p.startswith("serves.chat.vllm.extra_args[0]: --no-such-flag is not an option of "
                            "vllm serve in vLLM 0.34.0") for p in found), found
    # the same quantization is one 0.33 knows
    parse_config(BASE + SERVE + VLLM + 'quantization = "fp_quant"\n', "t")
    path = tmp_path / "bad.toml"
    path.write_text(text)
    path.chmod(0o600)
    run = subprocess.run([sys.executable, "-m", "gpud.daemon", "--check-config", str(path)],
                         capture_output=True, text=True, cwd=REPO, check=False)
    assert run.returncode == 2 and "--no-such-flag is not an option" in run.stderr


def test_a_release_without_a_table_anywhere_is_refused_saying_what_was_tried(
        tmp_path: Path) -> None:
    # no table shipped, none in vllm_flags_dir or learned, and no vllm to learn it from
    found = problems(f'[daemon]\nvllm_version = "0.35.0"\nvllm_flags_dir = "{tmp_path}"\n'
                     f'state_dir = "{tmp_path / "state"}"\n'
                     'vllm_executable = "/nonexistent/bin/vllm"\n' + BASE + SERVE + VLLM)
    assert found[0].startswith("daemon.vllm_version: no vllm serve flag table for vLLM '0.35.0'")
    assert str(tmp_path / "vllm-serve-flags-0.35.0.json") in found[0]
    assert "'/nonexistent/bin/vllm' is not found (daemon.vllm_executable)" in found[0]
    # its sizing and sleep rules are the newest known release's, not a refusal
    assert behaviour("0.35.0").rules_from == V034
    assert behaviour("0.35.0").kv == behaviour(V034).kv
    with pytest.raises(KeyError, match=r"'0\.35/\.\.' is not a vLLM version"):
        behaviour("0.35/..")


def test_on_0_34_the_extensible_kv_cache_is_turned_off_and_0_33_is_unchanged() -> None:
    cfg33 = parse_config(BASE + SERVE + VLLM, "t")
    cfg34 = parse_config(V34 + BASE + SERVE + VLLM, "t")
    argv33 = vllm_argv(cfg33.serves["chat"], executable="vllm", util="0.4396",
                       vllm_version=cfg33.daemon.vllm_version)
    argv34 = vllm_argv(cfg34.serves["chat"], executable="vllm", util="0.4396",
                       vllm_version=cfg34.daemon.vllm_version)
    assert EXTENSIBLE_KV_OFF not in argv33
    assert argv34 == [*argv33, EXTENSIBLE_KV_OFF]
    assert cfg33.daemon.vllm_version == V033  # still the default


@pytest.mark.parametrize("flag", ["--enable-extensible-kv-cache", "--disable-extensible-kv-cache",
                                  "--no-enable-extensible-kv-cache"])
def test_the_extensible_kv_cache_is_gpud_s_on_0_34(flag: str) -> None:
    assert problems(V34 + BASE + SERVE + VLLM + f'extra_args = ["{flag}"]\n') == [
        f"serves.chat.vllm.extra_args[0]: {flag}: gpud passes --no-enable-extensible-kv-cache "
        "on vLLM 0.34.0, so that the reservation is checked at start and the KV cache profiled "
        "(docs/vllm.md, \"vLLM 0.34\")"]


def test_checkpoint_prepare_on_startup_is_refused() -> None:
    text = SERVE.replace("port = 30001", "port = 30001\nsleep_level = 1") + VLLM
    found = problems(V34 + BASE + text + 'extra_args = ["--checkpoint-prepare-on-startup"]\n')
    assert len(found) == 1 and found[0].startswith(
        "serves.chat.vllm.extra_args[0]: --checkpoint-prepare-on-startup: the serve would start "
        "prepared for a process checkpoint and serve nothing until POST /checkpoint/restore")
    # its negation is vLLM's default: fine
    parse_config(V34 + BASE + text + 'extra_args = ["--no-checkpoint-prepare-on-startup"]\n', "t")
    # 0.33 does not have the option at all
    assert "is not an option of vllm serve in vLLM 0.33.0" in problems(
        BASE + text + 'extra_args = ["--checkpoint-prepare-on-startup"]\n')[0]


@pytest.mark.parametrize("version", ["", V34])
@pytest.mark.parametrize("args", ['"--load-format", "ipc_cache"', '"--load-format=ipc_cache"',
                                  '"--load_format", "ipc_cache"'])
def test_ipc_cache_is_refused_with_the_reason(version: str, args: str) -> None:
    found = problems(version + BASE + SERVE + VLLM + f"extra_args = [{args}]\n")
    assert len(found) == 1, found
    assert found[0].startswith("serves.chat.vllm.extra_args[0]: --load-format ipc_cache maps "
                               "weights that `vllm preload` holds in a per-GPU daemon outside "
                               "the serve's unit")
    parse_config(version + BASE + SERVE + VLLM + 'extra_args = ["--load-format", "safetensors"]\n',
                 "t")


DRAFT = '"--speculative-config", "{\\"method\\": \\"draft_model\\", \\"model\\": \\"org/small\\"}"'


def test_a_draft_model_at_level_2_on_0_34_must_keep_its_weights() -> None:
    level2 = SERVE.replace("port = 30001", "port = 30001\nsleep_level = 2") + VLLM
    found = problems(V34 + BASE + level2 + f"extra_args = [{DRAFT}]\n")
    assert len(found) == 1 and found[0].startswith(
        "serves.chat.vllm.extra_args[0]: a draft model at sleep_level 2: vLLM 0.34.0 discards "
        "the draft's weights at level 2 and reload_weights restores only the target")
    # kept as vLLM's warning says (gpu_worker.py:313-317)
    parse_config(V34 + BASE + level2 + f'extra_args = [{DRAFT}, '
                 '"--sleep-preserve-parameter-names", "draft.*"]\n', "t")
    # level 1 keeps the weights; ngram has no draft model; 0.33 is as it was
    parse_config(V34 + BASE + level2.replace("sleep_level = 2", "sleep_level = 1")
                 + f"extra_args = [{DRAFT}]\n", "t")
    parse_config(V34 + BASE + level2 + 'extra_args = ["--speculative-config.method", "ngram"]\n',
                 "t")
    parse_config(BASE + level2 + f"extra_args = [{DRAFT}]\n", "t")


def test_front_false_sleep_serve_warning_names_the_checkpoint_routes_on_0_34() -> None:
    sleeper = SERVE.replace("port = 30001", "port = 30001\nsleep_level = 1\nfront = false") + VLLM
    [w34] = config_warnings(parse_config(V34 + BASE + sleeper, "t"))
    assert "/checkpoint/prepare, /checkpoint/restore, /checkpoint/status" in w34
    assert w34.startswith("serves.chat.front: a serve with sleep_level runs with vLLM's dev routes "
                          "(/sleep, /wake_up, /collective_rpc); on vLLM 0.34.0 also")
    assert "open to every local user on port 30001" in w34
    [w33] = config_warnings(parse_config(BASE + sleeper, "t"))
    assert "/checkpoint" not in w33


def test_parked_host_ram_by_version_and_level() -> None:
    b33, b34 = BEHAVIOURS[V033], BEHAVIOURS[V034]
    assert b33.parked_host_mib(1, weights_mib=8000, cudagraph_mib=300) == 8000
    assert b33.parked_host_mib(2, weights_mib=8000, cudagraph_mib=300) == 0
    # 0.34 offloads the weights, runtime and cudagraph tags at either level; level 2 discards
    # only the parameters (sleep_mode_backend.py:126-132, gpu_worker.py:320-328)
    assert b34.parked_host_mib(1, weights_mib=8000, cudagraph_mib=300) == 8300
    assert b34.parked_host_mib(2, weights_mib=8000, cudagraph_mib=300) == 300
    assert b34.parked_host_mib(2, weights_mib=None, cudagraph_mib=None) is None
    assert b34.parked_host_mib(0, weights_mib=8000, cudagraph_mib=300) == 0


def test_gpuctl_calibrate_shows_the_extended_kv_cache_and_the_parked_ram() -> None:
    from gpud.ctl.format import format_calibration
    from gpud.vllm.vllm_log import parse_memory_lines
    from tests.test_vllm_log import V034_PARKED, journal_034

    vllm = parse_memory_lines([*journal_034(extended=True), V034_PARKED % (12.5, 0.75, 11.75)])
    doc: Any = {"serve": "chat", "status": "calibrated", "fingerprint": "f",
                "vllm": {**vllm.to_json(), "context_mib": 500}}
    text = format_calibration(doc)
    assert "KV cache extended after warm-up to 1490 blocks (594 MiB; profiling estimated " \
           "819 MiB)" in text
    assert "its last sleep parked 768 MiB in host RAM" in text
