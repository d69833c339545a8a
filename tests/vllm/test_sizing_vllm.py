"""gpud's weights figure, read from a checkpoint's headers (gpud.core.sizing), against what real
vLLM (its CPU build) holds once it loaded the same checkpoint: small Llama checkpoints made
offline in bf16, fp16 and fp32, and the bf16 one pre-quantized (W8A8 int8), within 2%.

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
from pathlib import Path
from typing import Any

import pytest

from gpud.checkpoint import read_checkpoint
from gpud.core.sizing import weights
from tests.vllm.servers import REAL_ENV, VENV

PROBE = Path(__file__).with_name("sizing_probe.py")
PYTHON = VENV / "bin" / "python"
DTYPES = ("bfloat16", "float16", "float32")
# the bf16 checkpoint pre-quantized as llm-compressor's W8A8 recipe writes it (compressed-tensors:
# int8 linear weights, an fp32 scale per row), which the CPU build loads
# (vllm/model_executor/layers/quantization/compressed_tensors/schemes/
# compressed_tensors_w8a8_int8.py)
INT8 = "w8a8-int8"


def _probe(*args: str, timeout: float) -> str:
    env = {**os.environ, **REAL_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.pop("PYTHONPATH", None)
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
