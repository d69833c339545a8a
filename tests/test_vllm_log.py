"""vLLM's start-up memory lines, as vLLM 0.33 words them, read back into figures."""

from __future__ import annotations

from gpud.testing import standin
from gpud.vllm_log import budget_mib, context_mib, parse_memory_lines

# As a journal shows them: vLLM's logger prefix, then the message built in
# vllm/v1/worker/gpu_model_runner.py and gpu_worker.py.
JOURNAL = [
    "(EngineCore pid=4242) INFO 12-01 07:00:01 [gpu_model_runner.py:5089] Model loading took "
    "11.49 GiB memory and 18.250000 seconds",
    "(EngineCore pid=4242) INFO 12-01 07:00:09 [gpu_model_runner.py:6410] Estimated CUDA graph "
    "memory: 0.61 GiB total",
    "(EngineCore pid=4242) INFO 12-01 07:00:10 [gpu_worker.py:773] Available KV cache memory: "
    "0.8 GiB",
    "(EngineCore pid=4242) INFO 12-01 07:00:30 [gpu_worker.py:1066] Free memory on device "
    "(30.91/31.84 GiB) on startup. Desired GPU memory utilization is (0.4396, 14.0 GiB). Actual "
    "usage is 11.69 GiB for consumed memory (weights + non-torch), 0.9 GiB for peak activation, "
    "and 0.61 GiB for CUDAGraph memory. Replace gpu_memory_utilization config with "
    "`--kv-cache-memory=762353664` (0.71 GiB) to fit into requested memory, or "
    "`--kv-cache-memory=17994944512` (16.76 GiB) to fully utilize gpu memory. Current kv cache "
    "memory in use is 0.8 GiB.",
]


def test_figures_from_a_journal() -> None:
    got = parse_memory_lines(["unrelated", *JOURNAL, "INFO: 127.0.0.1 GET /health 200"])
    assert (got.weights_mib, got.cudagraph_mib, got.kv_cache_mib) == (11766, 625, 819)
    assert got.recommended_kv_cache_bytes == 762353664
    assert got.recommended_kv_cache_mib == 727  # rounded down: never above vLLM's figure
    assert got.found


def test_the_last_start_wins() -> None:
    second = [JOURNAL[0].replace("11.49", "9.0"), JOURNAL[2].replace("0.8 GiB", "2.5 GiB")]
    got = parse_memory_lines([*JOURNAL, *second])
    assert (got.weights_mib, got.kv_cache_mib) == (9216, 2560)
    # What only the first start said is not carried into the second.
    assert got.cudagraph_mib is None and got.recommended_kv_cache_bytes is None


def test_nothing_found() -> None:
    got = parse_memory_lines(["INFO Starting vLLM server on http://127.0.0.1:8000"])
    assert not got.found and got.recommended_kv_cache_mib is None


def test_the_stand_ins_lines_read_back_to_its_plan() -> None:
    opts = standin.parse_args(["--gpu-memory-utilization", "0.4396"])
    plan = standin.memory_plan(opts, 32607)
    got = parse_memory_lines(standin.memory_log_lines(plan, opts, 32607, 2.0))
    assert abs(got.weights_mib - plan.weights) <= 6  # GiB with 2 decimals: +-5.12 MiB
    assert abs(got.kv_cache_mib - plan.kv_cache) <= 6
    assert abs(got.cudagraph_mib - plan.cudagraph) <= 6
    assert got.recommended_kv_cache_bytes == plan.recommended_kv_bytes


def test_context_is_what_nvml_shows_beyond_the_budget() -> None:
    assert budget_mib("0.4396", 32607) == 14334  # exact: 0.4396 x 32607 = 14334.04
    assert budget_mib("0.29", 100) == 29  # not 28 (binary floats)
    assert context_mib(14334 + 412, 14334) == 412
    assert context_mib(14000, 14334) == 0
