"""gpud's weights figure, read from a checkpoint's headers (gpud.core.sizing), against what real
vLLM (its CPU build) holds once it loaded the same checkpoint: small Llama checkpoints made
offline in bf16, fp16 and fp32, within 2%.

The CPU build does not log `Model loading took X GiB` (the GPU runners' line:
vllm/v1/worker/gpu_model_runner.py:5150; vllm/v1/worker/cpu_model_runner.py:62 logs only
"Starting to load model"), so tests/vllm/sizing_probe.py counts the bytes of the model vLLM built
(parameters and buffers), as its loader left them: what that line measures on a GPU. A
pre-quantized fp8 layout is not tried: the CPU build has no fp8 linear method to load one.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from gpud.checkpoint import read_checkpoint
from gpud.core.sizing import weights
from tests.vllm.servers import REAL_ENV, VENV

PROBE = Path(__file__).with_name("sizing_probe.py")
PYTHON = VENV / "bin" / "python"
DTYPES = ("bfloat16", "float16", "float32")


def _probe(*args: str, timeout: float) -> str:
    env = {**os.environ, **REAL_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.pop("PYTHONPATH", None)
    done = subprocess.run([str(PYTHON), str(PROBE), *args], env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_weights_figure_matches_what_vllm_loaded(real_vllm: None, dtype: str,
                                                     tmp_path: Path) -> None:
    model = tmp_path / dtype
    _probe("make", str(model), dtype, timeout=300)
    ckpt = read_checkpoint(model)
    predicted = weights(ckpt.tensors, ckpt.config)
    line = next(x for x in _probe("load", str(model), timeout=600).splitlines()
                if x.startswith("SIZING "))
    measured = json.loads(line.removeprefix("SIZING "))
    held = measured["params_bytes"] + measured["buffers_bytes"]
    print(f"{dtype}: predicted {predicted.bytes} bytes ({predicted.how}), vLLM holds {held} "
          f"(parameters {measured['params_bytes']}, buffers {measured['buffers_bytes']}, "
          f"{measured['dtype']}); on disk {predicted.stored_bytes}")
    assert measured["dtype"] == f"torch.{predicted.dtype}"
    assert abs(predicted.bytes - held) <= 0.02 * held
