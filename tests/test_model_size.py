"""A vllm serve's reservation checked against its checkpoint on disk at config load
(gpud.vllm.model_size through gpud.config.parse_config), and `gpuctl size` on the same checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpud.config import parse_config
from gpud.core.sizing import MIB
from gpud.errors import ConfigError
from tests.checkpoints import LLAMA_CONFIG, llama_tensors, write_checkpoint
from tests.conftest import REPO

# 2 layers of hidden 2048 under a vocabulary of 256000, a context of 8192: weights 2237 MiB in
# bf16 (embedding and LM head 1000 MiB each, layers 232 MiB, the RoPE cache 4 MiB); KV 4096 bytes
# a token: 8192 tokens and the null block of 16 (vLLM's pool keeps it) are 33 MiB, rounded up.
BIG: dict[str, Any] = {**LLAMA_CONFIG, "vocab_size": 256000, "hidden_size": 2048,
                       "intermediate_size": 8192, "num_attention_heads": 8,
                       "num_key_value_heads": 2, "head_dim": 256,
                       "max_position_embeddings": 8192}
WEIGHTS_MIB = 2237
KV_8192_MIB = 33


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "big", config=BIG,
                            tensors=llama_tensors("BF16", BIG), sparse=True)


def config(model: str, vram_mib: int, extra: str = "", serve_extra: str = "") -> str:
    return f"""
[roles.gpu]
device = "0"
capacity_mib = 32607

[serves.fast]
role = "gpu"
vram_mib = {vram_mib}
port = 30001
{serve_extra}
[serves.fast.vllm]
model = "{model}"
max_model_len = 8192
{extra}
"""


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(text, "test.toml")
    return info.value.problems


def test_below_the_weights_is_an_error_with_the_arithmetic(big: Path) -> None:
    found = problems(config(str(big), 2000))
    assert found == [f"serves.fast.vram_mib: 2000 MiB is below the weights alone: "
                     f"{WEIGHTS_MIB} MiB (bf16; RoPE cache 4.0 MiB), read from {big} (21 "
                     "tensors in model.safetensors)"]


def test_below_the_minimum_says_what_fits_instead(big: Path) -> None:
    minimum = WEIGHTS_MIB + KV_8192_MIB + 512
    (found,) = problems(config(str(big), minimum - 16))
    assert found.startswith(
        f"serves.fast.vram_mib: {minimum - 16} MiB is below the minimum weights {WEIGHTS_MIB} "
        f"+ KV for one 8192-token sequence {KV_8192_MIB} + context 512 = {minimum} MiB: set "
        f"vram_mib >= {minimum}, or max_model_len <= 4336 fits")
    assert "context from daemon.vllm_start_context_mib" in found
    (found,) = problems(config(str(big), minimum - 300, "context_mib = 256"))
    assert "context 256 = " in found and "context from vllm.context_mib" in found
    parse_config(config(str(big), minimum), "t")
    parse_config(config(str(big), minimum - 256, "context_mib = 256"), "t")


def test_a_kv_cache_that_cannot_hold_one_sequence(big: Path) -> None:
    assert problems(config(str(big), 4000, "kv_cache_mib = 16")) == [
        f"serves.fast.vllm.kv_cache_mib: 16 MiB does not hold one sequence of max_model_len "
        f"8192 ({KV_8192_MIB} MiB of KV cache): vLLM refuses to start "
        "(vllm/v1/core/kv_cache_utils.py:1104)"]


def test_online_quantization_and_tensor_parallel_shrink_the_weights(big: Path) -> None:
    """The seed's lesson: online fp8 halves the linear layers (232 -> 116 MiB), the bf16
    embedding and LM head (2000 MiB) survive it."""
    (found,) = problems(config(str(big), 2000, 'quantization = "fp8_per_tensor"'))
    assert found.startswith("serves.fast.vram_mib: 2000 MiB is below the weights alone: 2121 "
                            "MiB (online fp8_per_tensor (estimate)")
    parse_config(config(str(big), 2121 + KV_8192_MIB + 512, 'quantization = "fp8_per_tensor"'),
                 "t")
    two = config(str(big), 1500).replace('role = "gpu"', 'roles = ["gpu", "gpu2"]')
    two = two.replace("[serves.fast]", '[roles.gpu2]\ndevice = "1"\n\n[serves.fast]')
    (found,) = problems(two)
    # over 2 devices: half the weights and half the KV heads on each (16 MiB of KV and a null
    # block of 32 KiB: 17 MiB)
    assert found.startswith(f"serves.fast.vram_mib: 1500 MiB is below the minimum weights "
                            f"{-(-WEIGHTS_MIB // 2)} + KV for one 8192-token sequence "
                            "17 + context 512")


def test_a_model_not_on_disk_is_unknown_never_an_error(tmp_path: Path) -> None:
    parse_config(config(str(tmp_path / "absent"), 100), "t")
    parse_config(config("org/absent", 100), "t")
    parse_config(config("org/absent", 100, serve_extra=f'environment = {{ HF_HOME = '
                        f'"{tmp_path}" }}'), "t")


def test_the_serves_hub_cache_at_the_pinned_revision(tmp_path: Path, big: Path) -> None:
    commit = "c" * 40
    repo = tmp_path / "hub" / "models--org--big"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in big.iterdir():
        (snap / f.name).symlink_to(f)
    env = f'environment = {{ HF_HOME = "{tmp_path}" }}'
    pinned = f'revision = "{commit}"'
    (found,) = problems(config("org/big", 2000, pinned, env))
    assert f"read from {snap}" in found
    # main is another commit not in the cache: unknown
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("d" * 40)
    parse_config(config("org/big", 2000, "", env), "t")
    # a shard the cache lacks is downloaded by vLLM: unknown, not an error
    (snap / "model.safetensors").unlink()
    parse_config(config("org/big", 2000, pinned, env), "t")


def test_a_broken_local_checkpoint_is_an_error_naming_the_file(tmp_path: Path) -> None:
    d = write_checkpoint(tmp_path / "m", shards=2)
    (d / "model-00002-of-00002.safetensors").unlink()
    assert problems(config(str(d), 4000)) == [
        f"serves.fast.vllm.model: {d}/model-00002-of-00002.safetensors: missing"]
    (d / "model-00002-of-00002.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    (found,) = problems(config(str(d), 4000))
    assert found.startswith(f"serves.fast.vllm.model: {d}/model-00002-of-00002.safetensors: "
                            "header of")


def test_check_config_refuses_and_passes(tmp_path: Path, big: Path) -> None:
    path = tmp_path / "serves.toml"
    for vram, code in ((2000, 2), (WEIGHTS_MIB + KV_8192_MIB + 512, 0)):
        path.write_text(config(str(big), vram))
        path.chmod(0o600)
        out = subprocess.run([sys.executable, "-m", "gpud.daemon", "--check-config", str(path)],
                             capture_output=True, text=True, cwd=REPO, check=False)
        assert out.returncode == code, out.stderr
        if code:
            assert "serves.fast.vram_mib: 2000 MiB is below the weights alone" in out.stderr


def gpuctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpud.ctl", *args], capture_output=True,
                          text=True, cwd=REPO, check=False)


def test_gpuctl_size_answers_before_a_config_exists(big: Path) -> None:
    out = gpuctl("size", str(big), "--max-model-len", "8192")
    assert out.returncode == 0, out.stderr
    minimum = WEIGHTS_MIB + KV_8192_MIB + 512
    assert f"weights    {WEIGHTS_MIB} MiB (bf16" in out.stdout
    assert "KV cache   4096 bytes per token (bfloat16)" in out.stdout
    assert f"{KV_8192_MIB} MiB for one sequence of max_model_len 8192" in out.stdout
    # what it suggests is the smallest reservation it names, never the bare minimum below it
    smallest = int(out.stdout.split("smallest reservation: ")[1].split(" MiB")[0])
    assert smallest > minimum
    assert (f"  vram_mib = {smallest}      # the smallest reservation for 1 at once (the "
            f"minimum {minimum} MiB and the estimated overheads)") in out.stdout
    many = gpuctl("size", str(big), "--max-model-len", "8192", "--concurrency", "4")
    at_four = int(many.stdout.split(" MiB for 4 at once")[0].split()[-1])
    assert f"  vram_mib = {at_four}      # the smallest reservation for 4 at once" in many.stdout
    assert f"vllm.kv_cache_mib = {KV_8192_MIB}" in out.stdout
    out = gpuctl("--json", "size", str(big), "--max-model-len", "8192", "--vram-mib", "2758")
    assert out.returncode == 1
    doc = json.loads(out.stdout)
    assert (doc["fits"], doc["minimum_mib"], doc["weights_mib"]) == (False, minimum,
                                                                      WEIGHTS_MIB)
    assert "max_model_len <= 2288" in doc["reason"]
    out = gpuctl("size", str(big), "--kv-cache-dtype", "fp8", "--quantization",
                 "fp8_per_tensor", "--vram-mib", "4000")
    assert out.returncode == 0, out.stderr
    assert "online fp8_per_tensor (estimate)" in out.stdout
    assert "2048 bytes per token (fp8)" in out.stdout
    assert "vram_mib 4000: fits" in out.stdout


def test_gpuctl_size_says_why_it_cannot(tmp_path: Path) -> None:
    out = gpuctl("size", "org/absent", "--hf-home", str(tmp_path))
    assert out.returncode == 2
    assert "not in the model cache" in out.stderr and "unknown until its first start" in out.stderr
    d = write_checkpoint(tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    out = gpuctl("size", str(d))
    assert out.returncode == 2
    assert f"{d}/model.safetensors: truncated" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_plan_shows_each_serves_minimum_and_headroom(big: Path, tmp_path: Path) -> None:
    from gpud.ctl.format import format_plan
    from gpud.life.planning import plan_sizes

    minimum = WEIGHTS_MIB + KV_8192_MIB + 512
    text = config(str(big), minimum + 100) + f"""
[serves.other]
role = "gpu"
vram_mib = 4000
port = 30002
[serves.other.vllm]
model = "{tmp_path / 'absent'}"
"""
    sizes = plan_sizes(parse_config(text, "t"))
    kv = sizes[0].pop("kv")
    # what the reservation leaves for the KV cache: vLLM's budget is all of it (no
    # vllm.context_mib), less the weights and the estimated activation peak and CUDA graphs:
    # 30 MiB, short of one 8192-token sequence (33 MiB): the floor passes, the estimate warns
    assert [(d["name"], d["source"]) for d in kv["deductions"]] == [
        ("weights", "checkpoint"), ("context", "configured"), ("activation peak", "estimated"),
        ("CUDA graphs", "estimated")]
    assert kv["kv_at_mib"] == minimum + 100 - sum(d["mib"] for d in kv["deductions"]) == 30
    assert (kv["sequences"], kv["kv_tokens"]) == (0, 30 * MIB // 4096)
    assert sizes[0] == {"serve": "fast", "vram_mib": minimum + 100, "minimum_mib": minimum,
                        "headroom_mib": 100,
                        "how": f"weights {WEIGHTS_MIB} + KV for one 8192-token sequence "
                               f"{KV_8192_MIB} + context 512 = {minimum} MiB"}
    assert sizes[1]["serve"] == "other" and sizes[1]["minimum_mib"] is None
    assert "unknown until its first start" in sizes[1]["how"]
    shown = format_plan({"source": "t", "roles": [], "serves": [], "restart": [],
                         "resident_fits": True, "denied": [], "blocked": [], "stop_first": [],
                         "steps": [], "sizes": [{**sizes[0], "kv": kv}, sizes[1]]})
    assert f"fast: minimum {minimum} MiB (weights {WEIGHTS_MIB} + " in shown
    assert "headroom 100 MiB" in shown
    assert "leave a KV cache of 30 MiB: 7,680 tokens, 0.94x max concurrency (0 sequences" in shown
    assert "other:" not in shown  # nothing known: the plan says nothing of it


def test_a_config_gpud_cannot_size_is_unknown_not_an_error(tmp_path: Path) -> None:
    """No layers or heads it knows (an encoder-decoder): the KV cache is unknown, never an
    error; the weights, read all the same, still bound the reservation."""
    whisper = {"model_type": "whisper", "encoder_layers": 4, "decoder_layers": 4,
               "d_model": 384, "dtype": "float16"}
    d = write_checkpoint(tmp_path / "w", config=whisper,
                         tensors={"model.decoder.embed_tokens.weight": ("F16", [51865, 384])})
    parse_config(config(str(d), 100), "t")
    (found,) = problems(config(str(d), 10))
    assert found.startswith("serves.fast.vram_mib: 10 MiB is below the weights alone: 38 MiB")


def test_a_setting_vllm_would_refuse_is_an_error_at_its_key(big: Path) -> None:
    """A max_model_len over the model's window and a quantization that does not apply: one
    problem each, at the key, naming what fits (the config check: --check-config exits 2,
    POST /v1/plan and /v1/apply answer 400)."""
    (found,) = problems(config(str(big), 4000).replace("max_model_len = 8192",
                                                        "max_model_len = 16384"))
    assert found.startswith("serves.fast.vllm.max_model_len: max_model_len 16384 is over the "
                            "model's context length 8192 (max_position_embeddings in "
                            "config.json)")
    assert "use max_model_len <= 8192" in found
    (found,) = problems(config(str(big), 4000, 'quantization = "fp8"'))
    assert found.startswith("serves.fast.vllm.quantization: quantization 'fp8' does not apply "
                            "to an unquantized checkpoint")
    assert "use fp8_per_tensor" in found
