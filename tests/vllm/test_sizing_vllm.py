"""gpud's weights figure, read from a checkpoint's headers (gpud.core.sizing), against what real
vLLM (its CPU build) holds once it loaded the same checkpoint: small Llama checkpoints made
offline in bf16, fp16 and fp32, and the bf16 one pre-quantized (W8A8 int8), within 2%. And gpud's
KV cache in tokens for a KV budget against what vLLM reports for five shapes (below).

The CPU build does not log `Model loading took X GiB` (the GPU runners' line:
vllm/v1/worker/gpu_model_runner.py:5150; vllm/v1/worker/cpu_model_runner.py:62 logs only
"Starting to load model"), so tests/vllm/sizing_probe.py counts the bytes of the model vLLM built
(parameters and buffers), as its loader left them: what that line measures on a GPU. The
pre-quantized layout is W8A8 int8, which the CPU build loads (an fp8 one was not tried); it
counts as stored, scales included.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gpud.core.sizing import kv_cache, weights
from gpud.core.vllm_versions import DEFAULT_VERSION, KvRules, behaviour
from gpud.vllm.checkpoint import read_checkpoint
from tests.vllm.servers import REAL_ENV, VENV

PROBE = Path(__file__).with_name("sizing_probe.py")
PYTHON = VENV / "bin" / "python"
DTYPES = ("bfloat16", "float16", "float32")
# the bf16 checkpoint pre-quantized as llm-compressor's W8A8 recipe writes it (compressed-tensors:
# int8 linear weights, an fp32 scale per row), which the CPU build loads
# (vllm/model_executor/layers/quantization/compressed_tensors/schemes/
# compressed_tensors_w8a8_int8.py)
INT8 = "w8a8-int8"


def _probe(*args: str, timeout: float, cpu_kv_space: bool = True) -> str:
    env = {**os.environ, **REAL_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.pop("PYTHONPATH", None)
    if not cpu_kv_space:  # the budget is given in bytes instead (it would override them)
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    done = subprocess.run([str(PYTHON), str(PROBE), *args], env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def loaded(real_vllm: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each dtype's checkpoint, and what real vLLM built from it (one vLLM process for all:
    a cold start's imports are most of its minute)."""
    base = tmp_path_factory.mktemp("sizing")
    _probe("make", *(a for d in DTYPES for a in (str(base / d), d)), timeout=300)
    _probe("make-int8", str(base / INT8), str(base / "bfloat16"), timeout=300)
    out = _probe("load", *(str(base / d) for d in (*DTYPES, INT8)), timeout=900)
    found = [json.loads(x.removeprefix("SIZING ")) for x in out.splitlines()
             if x.startswith("SIZING ")]
    return {Path(doc["model"]).name: doc for doc in found}


@pytest.mark.parametrize("dtype", (*DTYPES, INT8))
def test_the_weights_figure_matches_what_vllm_loaded(loaded: dict[str, Any],
                                                     dtype: str) -> None:
    measured = loaded[dtype]
    ckpt = read_checkpoint(Path(measured["model"]))
    predicted = weights(ckpt.tensors, ckpt.config)
    held = measured["params_bytes"] + measured["buffers_bytes"]
    print(f"{dtype}: predicted {predicted.bytes} bytes ({predicted.how}), vLLM holds {held} "
          f"(parameters {measured['params_bytes']}, buffers {measured['buffers_bytes']}, "
          f"{measured['dtype']}); on disk {predicted.stored_bytes}")
    assert measured["dtype"] == f"torch.{predicted.dtype}"  # the first parameter's: bf16
    assert abs(predicted.bytes - held) <= 0.02 * held


# --- The KV cache: gpud's tokens for a KV budget against what real vLLM says it holds ---------
#
# One vLLM process starts each shape in turn (tests/vllm/sizing_probe.py `kv`: one start's
# imports for all five) with the same KV budget, given in bytes (--kv-cache-memory-bytes: the CPU
# worker takes it as is, vllm/v1/worker/cpu_worker.py:213-233 of 0.32.0), and reads what vLLM
# logged as `CPU KV cache size: N tokens, Maximum concurrency ...` from the cache_config it set
# (update_kv_cache_capacity). gpud predicts it with the rules of the daemon's default release
# (0.33.0: the KV arithmetic is the same text in 0.32.0's kv_cache_utils.py), changed only where
# the CPU platform changes them, each cited:
# - blocks of 128 tokens on CPU, of 16 for its reference MLA kernel
#   (vllm/platforms/cpu.py:235-293 of 0.32.0);
# - no async scheduling on CPU (cpu.py:330-331), so one batch in flight, not two.
KV_BUDGET = 100_000_000  # bytes: not a whole number of blocks, so the floor shows
KV_MAX_MODEL_LEN = 16384
KV_BATCHED_TOKENS = 2048  # the API server's default on a GPU under 70 GiB, given explicitly
SHAPES = ("dense-gqa", "tied", "sliding", "hybrid-shared", "mla")


@pytest.fixture(scope="module")
def reported(real_vllm: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("kv")
    _probe("make-shapes", str(base), timeout=300)
    out = _probe("kv", str(KV_BUDGET), str(KV_MAX_MODEL_LEN), str(KV_BATCHED_TOKENS),
                 *(str(base / s) for s in SHAPES), timeout=900, cpu_kv_space=False)
    found = [json.loads(x.removeprefix("KV ")) for x in out.splitlines() if x.startswith("KV ")]
    return {Path(doc["model"]).name: doc for doc in found}


def cpu_rules(config: dict[str, Any]) -> KvRules:
    rules = behaviour(DEFAULT_VERSION).kv
    mla = "kv_lora_rank" in config
    return replace(rules, block_tokens=16 if mla else 128, in_flight_batches=1)


@pytest.mark.parametrize("shape", SHAPES)
def test_gpud_s_kv_tokens_are_what_vllm_reports(reported: dict[str, Any], shape: str) -> None:
    doc = reported[shape]
    ckpt = read_checkpoint(Path(doc["model"]))
    rules = cpu_rules(ckpt.config)
    kv = kv_cache(ckpt.config)
    cap = kv.capacity(KV_BUDGET, KV_MAX_MODEL_LEN, rules, batched_tokens=KV_BATCHED_TOKENS)
    gib = 1 << 30
    print(f"{shape}: predicted {cap.tokens} tokens ({cap.tokens * gib / KV_BUDGET:,.0f} per GiB), "
          f"{cap.blocks} blocks of {rules.block_tokens}, {cap.max_concurrency:.4f}x; vLLM "
          f"{doc['tokens']} ({doc['tokens'] * gib / KV_BUDGET:,.0f} per GiB), {doc['blocks']} "
          f"blocks of {doc['block_size']}, {doc['max_concurrency']:.4f}x; {kv.per_token_bytes} "
          f"bytes a token ({kv.note or 'all layers full attention'})")
    assert doc["block_size"] == rules.block_tokens
    assert (cap.blocks, cap.tokens) == (doc["blocks"], doc["tokens"])
    assert cap.max_concurrency == pytest.approx(doc["max_concurrency"], rel=1e-12)


def test_the_tied_head_is_counted_once(reported: dict[str, Any]) -> None:
    """The tied shape's LM head is its embedding: gpud's weights are what vLLM built."""
    doc = reported["tied"]
    ckpt = read_checkpoint(Path(doc["model"]))
    predicted = weights(ckpt.tensors, ckpt.config)
    held = doc["weights"]["params_bytes"] + doc["weights"]["buffers_bytes"]
    assert abs(predicted.bytes - held) <= 0.02 * held
