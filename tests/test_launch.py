"""How serves are run: the vllm argv (golden), placeholders, the execv shim, fingerprints,
and calibration's recommendation."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpud.calibration import recommend
from gpud.config import parse_config
from gpud.execv import decode, encode
from gpud.launch import fingerprint, serve_argv, through_shim
from tests.conftest import REPO


def example_serves():  # type: ignore[no-untyped-def]
    return parse_config((REPO / "etc" / "serves.toml").read_text(), "etc/serves.toml").serves


def test_vllm_argv_golden() -> None:
    argv = serve_argv(example_serves()["fast"], total_mib=32607, device_index=0,
                      vllm_executable="/opt/vllm/bin/vllm")
    assert argv == [
        "/opt/vllm/bin/vllm", "serve", "leon-se/gemma-4-E4B-it-FP8-Dynamic",
        "--revision", "56e30bf6", "--port", "30001", "--gpu-memory-utilization", "0.4396",
        "--max-model-len", "32768", "--quantization", "fp8",
    ]


def test_vllm_argv_uses_the_current_reservation_and_extra_args() -> None:
    argv = serve_argv(example_serves()["embeddings"], total_mib=32607, device_index=0,
                      vllm_executable="vllm", vram_mib=4096)
    assert argv == ["vllm", "serve", "BAAI/bge-m3", "--port", "30003",
                    "--gpu-memory-utilization", "0.1256", "--task", "embed"]


def test_command_placeholders() -> None:
    argv = serve_argv(example_serves()["ocr"], total_mib=32607, device_index=1,
                      vllm_executable="vllm")
    assert argv == ["/opt/serves/bin/ocr-serve", "--port", "30007",
                    "--gpu-memory-utilization", "0.1570"]


def test_shim_only_for_arguments_systemd_252_alters() -> None:
    plain = ["/bin/x", "--a", "%n", "two words"]
    assert through_shim(plain, "/usr/bin/python3", 252) == plain
    fragile = ["/bin/x", "$HOME", "a;b"]
    wrapped = through_shim(fragile, "/usr/bin/python3", 252)
    assert wrapped[:4] == ["/usr/bin/python3", "-I", "-m", "gpud.execv"]
    assert all(c.isalnum() or c in "-_" for c in wrapped[4])
    assert decode(wrapped[4]) == fragile
    assert through_shim(fragile, "/usr/bin/python3", 256) == fragile


def test_execv_shim_execs_the_command_literally() -> None:
    argv = [sys.executable, "-c", "import sys; print(sys.argv[1:])", "$HOME", "a;b", "%n"]
    out = subprocess.run([sys.executable, "-m", "gpud.execv", encode(argv)], capture_output=True,
                         text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "['$HOME', 'a;b', '%n']"
    with pytest.raises(ValueError):
        decode(encode([]))


def test_fingerprint_follows_what_defines_the_serve() -> None:
    serves = example_serves()
    fast = serves["fast"]
    same = fast.model_copy(update={"vram_mib": 10000, "priority": 1, "port": 1234})
    assert fingerprint(same) == fingerprint(fast)  # reservation and placement are not identity
    for change in ({"revision": "ffffffff"}, {"quantization": None}, {"max_model_len": 8192},
                   {"model": "other/model"}):
        changed = fast.model_copy(update={"vllm": fast.vllm.model_copy(update=change)})
        assert fingerprint(changed) != fingerprint(fast), change
    ocr = serves["ocr"]
    assert fingerprint(ocr.model_copy(update={"command": [*ocr.command, "--x"]})) != \
        fingerprint(ocr)


@pytest.mark.parametrize(("samples", "expected"), [
    ([3197, 3197, 3197], (3197, 3197, 3584)),
    ([11000, 11500, 11766], (11500, 11766, 12544)),  # 5% margin beats 256
    ([100], (100, 100, 512)),
])
def test_recommendation(samples: list[int], expected: tuple[int, int, int]) -> None:
    assert recommend(samples) == expected
    _steady, peak, rec = recommend(samples)
    assert rec % 256 == 0 and rec >= peak + 256


def test_recommendation_needs_samples() -> None:
    with pytest.raises(ValueError):
        recommend([])
