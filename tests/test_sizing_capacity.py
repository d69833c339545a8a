"""What a reservation leaves for the KV cache (gpud.core.sizing: KvCapacity, at_reservation,
smallest_reservation) through `gpuctl --json size DIR --vram-mib N`: its kv_tokens and
max_concurrency agree with its own kv_mib and bytes per token, for any reservation, sequence
length, release and shape (a property test); each release's block size; the seed's line."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpud.core.sizing import (
    MIB,
    KvCache,
    Overheads,
    at_reservation,
    kv_cache,
    smallest_reservation,
)
from gpud.core.vllm_versions import KNOWN_VERSIONS, V033, V034, behaviour
from gpud.ctl.size import DEFAULT_CONTEXT_MIB, size_doc
from tests.checkpoints import LLAMA_CONFIG, llama_tensors, write_checkpoint
from tests.test_model_size import gpuctl

# Shapes whose every layer keeps every token (their tokens follow from bytes alone), over
# different widths: grouped KV heads, one KV head, more layers.
FULL: dict[str, dict[str, Any]] = {
    "gqa": {**LLAMA_CONFIG, "max_position_embeddings": 32768},
    "mqa": {**LLAMA_CONFIG, "num_key_value_heads": 1, "num_hidden_layers": 3,
            "max_position_embeddings": 32768},
    "wide": {**LLAMA_CONFIG, "num_hidden_layers": 5, "num_key_value_heads": 4,
             "max_position_embeddings": 32768, "tie_word_embeddings": True},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("shapes")
    return {name: write_checkpoint(base / name, config=cfg, tensors=llama_tensors("BF16", cfg))
            for name, cfg in FULL.items()}


def args(model: Path, **kw: Any) -> argparse.Namespace:
    base: dict[str, Any] = {
        "model": str(model), "max_model_len": None, "quantization": None,
        "kv_cache_dtype": None, "dtype": None, "revision": None, "hf_home": "/nonexistent",
        "context_mib": DEFAULT_CONTEXT_MIB, "devices": 1, "vram_mib": None, "concurrency": 1,
        "vllm_version": V033, "device_mib": None}
    return argparse.Namespace(**{**base, **kw})


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=st.sampled_from(sorted(FULL)), version=st.sampled_from(KNOWN_VERSIONS),
       extra=st.integers(min_value=0, max_value=400_000),
       length=st.integers(min_value=1, max_value=32768))
def test_kv_tokens_agree_with_kv_mib_and_bytes_per_token(checkpoints: dict[str, Path],
                                                         shape: str, version: str, extra: int,
                                                         length: int) -> None:
    first = size_doc(args(checkpoints[shape], max_model_len=length, vllm_version=version))
    vram = first["weights_mib"] + extra
    d = size_doc(args(checkpoints[shape], max_model_len=length, vllm_version=version,
                      vram_mib=vram))
    block, per_token = d["block_tokens"], d["kv_bytes_per_token"]
    assert block == behaviour(version).kv.block_tokens
    # the KV cache is the reservation less its named deductions
    assert d["kv_bytes"] == max(0, vram - sum(x["mib"] for x in d["deductions"])) * MIB
    assert d["kv_mib"] == d["kv_bytes"] // MIB
    # blocks of `block` tokens of every layer, as many as the bytes hold
    assert d["block_bytes"] == block * per_token
    assert d["kv_blocks"] == d["kv_bytes"] // d["block_bytes"]
    # a sequence takes whole blocks; vLLM's tokens are blocks / blocks-a-sequence x length
    assert d["blocks_per_sequence"] == -(-length // block)
    assert d["kv_tokens"] == int(d["kv_blocks"] / d["blocks_per_sequence"] * length)
    # so: never more tokens than the bytes hold, and fewer only by the last partial block and
    # the rounding of a length to whole blocks
    held = d["kv_bytes"] // per_token
    assert d["kv_tokens"] <= held
    assert d["kv_tokens"] >= (held - block) * length / (d["blocks_per_sequence"] * block) - 1
    # rounded to 2 decimals; the tokens are its product with the length, floored
    assert d["max_concurrency"] == pytest.approx(d["kv_tokens"] / length, abs=0.005 + 1 / length)
    # sequences at once: whole ones, the null block kept back
    assert d["sequences"] == max(0, d["kv_blocks"] - 1) // d["blocks_per_sequence"]
    assert d["sequences"] <= d["max_concurrency"]
    # fits exactly when one sequence does (or the floor already says it cannot)
    assert d["fits"] == (d["sequences"] >= 1 and vram >= d["minimum_mib"])


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=st.sampled_from(sorted(FULL)), version=st.sampled_from(KNOWN_VERSIONS),
       n=st.integers(min_value=1, max_value=64),
       length=st.integers(min_value=16, max_value=32768))
def test_the_smallest_reservation_for_n_runs_n_and_one_less_does_not(
        checkpoints: dict[str, Path], shape: str, version: str, n: int, length: int) -> None:
    d = size_doc(args(checkpoints[shape], max_model_len=length, vllm_version=version,
                      concurrency=n))
    smallest = d["smallest_mib"][str(n)]
    assert d["reservation_mib"] == smallest and d["sequences"] >= n
    below = size_doc(args(checkpoints[shape], max_model_len=length, vllm_version=version,
                          vram_mib=smallest - 1))
    assert below["sequences"] < n


def test_a_release_s_block_and_its_extensible_margin() -> None:
    """The same budget in vLLM 0.33's blocks of 16 and 0.34's of 64: a 1000-token sequence takes
    63 blocks of 16 (1008 tokens) or 16 of 64 (1024)."""
    kv = KvCache(2, 0, None, 512, "bfloat16", "")
    over = Overheads(0, 0, 0)
    for version, blocks, tokens in ((V033, 63, 4 * MIB // 1024 // 16 * 16),
                                    (V034, 16, 4 * MIB // 1024 // 64 * 64)):
        rules = behaviour(version).kv
        at = at_reservation(4, 0, "checkpoint", kv, 1000, over, rules)
        assert at.capacity.blocks_per_request == blocks
        assert at.capacity.blocks * rules.block_tokens * 1024 == 4 * MIB
        assert at.capacity.tokens == int(at.capacity.blocks / blocks * 1000)
        assert at.capacity.blocks * rules.block_tokens == tokens
    assert behaviour(V033).kv.extensible_margin_bytes(10 * MIB) is None
    # max(1 GiB, 0.75 x the transient peak) of the device kept free
    assert behaviour(V034).kv.extensible_margin_bytes(4096 * MIB) == 3072 * MIB
    assert behaviour(V034).kv.extensible_margin_bytes(100 * MIB) == 1024 * MIB
    assert smallest_reservation(2, 100, kv, 1000, Overheads(7, 3, 512)) == (
        100 + 7 + 3 + 512 + 2, 2)  # 2 x 63 + 1 blocks of 16 KiB: 2 MiB, rounded up


def test_gpuctl_json_carries_the_reservation_s_kv(checkpoints: dict[str, Path]) -> None:
    out = gpuctl("--json", "size", str(checkpoints["gqa"]), "--max-model-len", "4096",
                 "--vram-mib", "2000")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert {"kv_mib", "kv_tokens", "max_concurrency", "sequences", "deductions"} <= set(d)
    assert [x["name"] for x in d["deductions"]] == ["weights", "context", "activation peak",
                                                   "CUDA graphs"]
    assert [x["source"] for x in d["deductions"]] == ["checkpoint", "configured", "estimated",
                                                     "estimated"]
    out = gpuctl("size", str(checkpoints["gqa"]), "--max-model-len", "4096", "--concurrency",
                 "3", "--vllm-version", "0.34.0")
    assert out.returncode == 0, out.stderr
    assert "vLLM 0.34.0: blocks of 64 tokens" in out.stdout
    assert "for 1 at once, " in out.stdout and " for 3 at once" in out.stdout
    assert "extensible KV cache would keep 1024 MiB of the device free" in out.stdout


@pytest.mark.parametrize(("argv", "said"), [
    (["--vram-mib", "1"], "--vram-mib 1 is below the weights alone: 8 MiB (bf16"),
    (["--max-model-len", "40000"], "max_model_len 40000 is over the model's context length "
                                   "32768 (max_position_embeddings in config.json)"),
    (["--quantization", "fp8"], "quantization 'fp8' does not apply to an unquantized "
                                "checkpoint"),
])
def test_bad_input_is_one_line_naming_what_fits(checkpoints: dict[str, Path], argv: list[str],
                                                said: str) -> None:
    out = gpuctl("size", str(checkpoints["gqa"]), *argv)
    assert out.returncode == 2, out.stdout + out.stderr
    line, = out.stderr.strip().splitlines()
    assert said in line
    assert any(fix in line for fix in ("--vram-mib >= ", "use --max-model-len <= 32768",
                                        "use fp8_per_tensor"))


# Gemma 4 E4B's text layers, as its model card and the public converters give them: 42 layers,
# 5 sliding (512 tokens, head_dim 256) to 1 full (global_head_dim 512), 2 KV heads, the last 18
# sharing earlier layers' cache.
E4B = {"model_type": "gemma4", "text_config": {
    "model_type": "gemma4_text", "num_hidden_layers": 42, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 256, "global_head_dim": 512, "hidden_size": 2560,
    "intermediate_size": 10240, "vocab_size": 262144, "sliding_window": 512,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 7,
    "num_kv_shared_layers": 18, "max_position_embeddings": 131072, "dtype": "bfloat16"}}


def test_the_seed_s_line_worked_through() -> None:
    """The seed: "0.8 GiB KV (43,708 tokens > the 32768 window, 1.33x max concurrency)". 24 of
    E4B's layers keep a cache (4 full of 4096 bytes a token, 20 sliding of 2048); the pages
    unified at 64 KiB (the sliding layers' blocks 32 tokens), groups of 4 layers: 256 KiB a
    block. 3272 blocks (818 MiB, which vLLM prints as 0.80 GiB) give exactly the seed's figures
    with one batch of 2048 in flight, as the seed's vLLM held; with 0.33's two batches (async
    scheduling) the sliding groups hold more and the same blocks give 38,664 tokens."""
    from dataclasses import replace

    kv = kv_cache(E4B)
    assert (kv.full_layers, kv.sliding_layers, kv.window) == (4, 20, 512)
    assert kv.per_token_bytes == 4 * 4096 + 20 * 2048
    assert kv.groups() == (4, 1, 5) and kv.pages() == (64 * 1024, 16, 32)
    rules = behaviour(V033).kv
    blocks = 3272
    budget = blocks * kv.block_bytes(rules)
    assert kv.block_bytes(rules) == 256 * 1024 and round(budget / (1 << 30), 2) == 0.80
    seed = kv.capacity(budget, 32768, replace(rules, in_flight_batches=1))
    # 1 full group x 2048 blocks + 5 sliding groups x (cdiv(511 + 2048, 32) + 1)
    assert seed.blocks_per_request == 2048 + 5 * 81
    assert (seed.blocks, seed.tokens, round(seed.max_concurrency, 2)) == (3272, 43708, 1.33)
    now = kv.capacity(budget, 32768, rules)
    assert now.blocks_per_request == 2048 + 5 * 145
    assert (now.tokens, round(now.max_concurrency, 2)) == (38664, 1.18)


def test_gpuctl_size_of_a_configured_serve_asks_the_daemon(tmp_path: Path,
                                                          checkpoints: dict[str, Path]) -> None:
    """`gpuctl size --serve NAME`: the daemon sizes the serve as configured (its vram_mib, its
    max_model_len, daemon.vllm_version's rules); before a calibration the activation peak and
    CUDA graphs are estimated, and said so (tests/test_calibration_vllm.py shows them measured
    once calibrated)."""
    import subprocess
    import sys

    from tests.conftest import REPO, start_gpud

    gp = start_gpud(tmp_path, f"""
[daemon]
admission = "ledger"
vllm_version = "0.34.0"
[roles.r]
device = "0"
capacity_mib = 40000
[serves.fast]
role = "r"
vram_mib = 2000
port = 30001
[serves.fast.vllm]
model = "{checkpoints['gqa']}"
max_model_len = 4096
[serves.other]
role = "r"
vram_mib = 100
port = 30002
command = ["/bin/true"]
""")
    try:
        def size(*argv: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "gpud.ctl", "--socket", str(gp.socket),
                                   *argv], capture_output=True, text=True, cwd=REPO, check=False)

        out = size("--json", "size", "--serve", "fast")
        assert out.returncode == 0, out.stderr
        kv = json.loads(out.stdout)["predicted"]["kv"]
        assert (kv["vram_mib"], kv["vllm_version"]) == (2000, "0.34.0")
        assert [d["source"] for d in kv["deductions"]][2:] == ["estimated", "estimated"]
        assert kv["kv_at_mib"] == 2000 - sum(d["mib"] for d in kv["deductions"])
        # 0.34's blocks of 64 tokens, 1024 bytes a token: 64 KiB a block, 64 a sequence
        assert kv["kv_tokens"] == kv["kv_at_mib"] * MIB // (64 * 1024) // 64 * 4096
        text = size("size", "--serve", "fast")
        assert text.returncode == 0, text.stderr
        assert "fast: uncalibrated" in text.stdout
        assert "activation peak" in text.stdout and "(estimated)" in text.stdout
        assert size("size", "--serve", "other").returncode == 2
        assert size("size", "--serve", "fast", str(checkpoints["gqa"])).returncode == 2
    finally:
        gp.stop()


def test_the_seed_s_reservation_estimated_then_measured() -> None:
    """14336 MiB for E4B FP8-Dynamic at util 0.4396 of 32607 MiB (vLLM's budget 14334 MiB):
    weights 11.49 GiB (11766 MiB, vLLM's figure), 0.80 GiB of KV. Before a start gpud
    estimates the activation peak and graphs (text-only: the vision tower's profile is not in
    its rule, so it leaves far more KV than vLLM did); once calibrated, the same reservation
    gives back vLLM's KV cache and its tokens."""
    from dataclasses import replace

    from gpud.core.sizing import IN_ACTIVATION, MEASURED, estimate_overheads, measured_overheads

    kv = kv_cache(E4B)
    seed_rules = replace(behaviour(V033).kv, in_flight_batches=1)
    est = estimate_overheads(E4B, "bfloat16", seed_rules, context_mib=0, device_mib=32607)
    assert (est.activation_mib, est.graphs_mib) == (624, 28)
    guess = at_reservation(14336, 11766, MEASURED, kv, 32768, est, seed_rules)
    assert guess.kv_mib == 14336 - 11766 - 624 - 28 == 1918
    figures = {"budget_mib": 14334, "weights_mib": 11766, "kv_cache_mib": 818,
               "cudagraph_mib": None, "context_mib": None}
    measured = replace(measured_overheads(figures, est, budget_mib=14336), context_mib=0)
    # what the reservation held besides weights and KV: activation, graphs, non-torch memory
    # and util's 2 MiB floor, in one figure (vLLM logged no graph figure here)
    assert (measured.activation_mib, measured.activation_from) == (1752, MEASURED)
    assert (measured.graphs_mib, measured.graphs_from) == (0, IN_ACTIVATION)
    at = at_reservation(14336, 11766, MEASURED, kv, 32768, measured, seed_rules)
    assert at.kv_mib == 818 and at.capacity.blocks == 3272
    assert (at.capacity.tokens, round(at.capacity.max_concurrency, 2)) == (43708, 1.33)
    # one sequence of 32768 beside the null block: 2454 blocks, 614 MiB
    assert smallest_reservation(1, 11766, kv, 32768, measured, seed_rules) == (14132, 614)
