"""A stand-in for a vLLM 0.33 (or, with ``--vllm-version 0.34.0``, 0.34) OpenAI server, for
tests and demos on machines without a GPU.

Not part of the shipped daemon (gpud.testing is left out of the package). Run as
``python -m gpud.testing.standin`` with a ``vllm serve``-shaped argv::

    python -m gpud.testing.standin serve MODEL --host 127.0.0.1 --port 30001 \\
        --gpu-memory-utilization 0.4396 --max-model-len 32768 --startup-delay 2

It starts the way vLLM 0.33 does (each point checked in vLLM's source; see the notes at the
functions that do it):

- an option the flag table of vLLM 0.33 (gpud/data) does not know exits 2, as argparse does
  (so does an abbreviation, which vLLM's argparse would take and gpud's config refuses);
  options it knows are accepted and ignored;
- the port is bound at once but not listened on until the model has "loaded": while loading, a
  connection is refused (never a 503);
- the GPU memory is held by an engine child titled ``VLLM::EngineCore`` (argv[0] and comm),
  which logs vLLM's start-up memory lines (``Model loading took X GiB memory ...``,
  ``Available KV cache memory: Y GiB``, ``Estimated CUDA graph memory: Z GiB total`` and the
  ``--kv-cache-memory=N`` recommendation) and then tells the server it is ready;
- ready: ``GET /health`` 200 with an empty body, ``GET /v1/models`` with the served names;
- the engine child dies: ``/health`` answers 503, and the server exits with status 0 (as
  vLLM's does: its watchdog sets uvicorn's ``should_exit``, a clean shutdown) after
  ``--exit-after-engine-death`` seconds (vLLM's watchdog: 5);
- with ``VLLM_SERVER_DEV_MODE=1`` only: ``POST /sleep?level=0|1|2[&mode=abort|wait|keep]``,
  ``POST /wake_up[?tags=weights|kv_cache]``, ``GET /is_sleeping``, ``POST /collective_rpc``
  (``reload_weights`` only), ``POST /pause[?mode=abort|wait|keep]`` (default abort),
  ``POST /resume``, ``GET /is_paused``; level 2 discards the weights: a wake without ``reload_weights``
  leaves them uninitialised (``/standin/state`` says ``"weights": "uninitialised"``, completions
  say their answer is garbage), as real vLLM's would be; asleep, the engine's draw drops to
  the context (``--context-mib``), or to ``--asleep-mib`` when given (what a serve's
  ``sleep_mib`` stands for).
- requests in flight, as vLLM's engine treats them across a sleep (vLLM 0.32's source,
  ``vllm/entrypoints/serve/dev/sleep/api_router.py:26-34``: ``/sleep`` takes ``mode`` of
  ``PauseMode``, default ``"abort"``; ``vllm/v1/engine/__init__.py:32`` ``PauseMode =
  Literal["abort", "wait", "keep"]``; ``vllm/v1/engine/core.py:2061-2103`` ``pause_scheduler``,
  which ``sleep`` (core.py:959-995) calls before it frees memory): ``mode=abort`` ends every
  request in flight at once (finish_requests FINISHED_ABORTED, their abort outputs sent: a
  stream gets a last chunk with ``finish_reason: "abort"`` and ``data: [DONE]``,
  ``vllm/entrypoints/openai/completion/serving.py:329-414,503``) and answers once they are
  sent; ``mode=wait`` keeps stepping the requests in flight and answers ``/sleep`` once they are
  done (the engine's idle callback); ``mode=keep`` freezes them (held until the wake). In every
  mode new requests queue (PAUSED_NEW / PAUSED_ALL): a request to a sleeping engine is held,
  counted as waiting, and answered after the wake (``wake_up`` resumes the scheduler once every
  tag is awake, core.py:997-1019);
- ``GET /metrics`` (always on, as vLLM's is): ``vllm:num_requests_running`` and
  ``vllm:num_requests_waiting`` (``vllm/v1/metrics/loggers.py:527-545``, gauges labelled
  ``model_name`` and ``engine``): requests being generated, and requests held (asleep, or in
  line for a place);
- under load, vLLM's scheduler (see ``_Engine``): ``--max-num-seqs N`` requests run at once
  (default 256), the rest wait first come first served, or with ``--scheduling-policy
  priority`` by the body's ``priority``, lower first; a generation takes its tokens' time
  (``--token-interval-s`` each), streamed or not;
- the client routes of vLLM 0.32 (paths under vllm/entrypoints/, cited at each handler), in
  its shapes and with ``usage`` as it gives it: a generator (``--runner generate``, the
  default) answers chat and completions (streams with ``stream_options.include_usage`` and
  ``continuous_usage_stats``, or ``--enable-force-include-usage``), ``/v1/responses`` (streamed
  or not), Anthropic's ``/v1/messages`` (streamed or not) and ``count_tokens``; a pooling
  serve (``--runner pooling``, or ``--convert embed|classify``) ``/v1/embeddings`` (float or
  base64, ``--embedding-width N`` wide; not for ``--convert classify``), ``/score`` and
  ``/rerank``; every serve ``/tokenize`` and ``/detokenize``; with ``--audio`` (a
  speech-to-text model) the multipart audio routes. Its tokenizer makes a token of each UTF-8
  byte, an image ``IMAGE_TOKENS``; its model echoes the prompt's last text (its embeddings
  are unit vectors drawn from the text). Errors are vLLM's ``{"error": {...}}`` (Anthropic's
  shape on its routes); a route the serve's kind lacks is FastAPI's 404. Bodies of any size
  are read, as vLLM's are.

``--vllm-version 0.34.0`` (or ``GPUD_STANDIN_VLLM_VERSION``; default 0.33.0) stands in for
vLLM 0.34.0 (paths under vllm/, 0.34.0's lines): its flag table; its start lines (no
``Estimated CUDA graph memory``, the V1 model runner being deleted; ``Graph capturing finished``;
with the extensible KV cache, on unless ``--no-enable-extensible-kv-cache`` or
``--kv-cache-memory-bytes``, the ``Memory after warmup`` and ``Extended KV cache to N blocks``
lines, v1/worker/extensible_kv_cache.py:694, :537); with ``--enable-sleep-mode``, dev mode or
not, ``POST /checkpoint/prepare``, ``POST /checkpoint/restore`` and ``GET /checkpoint/status``
(entrypoints/serve/checkpoint/api_router.py:39, :60, :80): prepared, it says ``is_sleeping:
true``, releases its KV cache (the draw drops by it), and answers 500 to ``/sleep`` and
``/wake_up`` until restored (v1/engine/core.py:1110, :1153); a sleep logs what it parks in host
RAM as CuMemAllocator does (device_allocator/cumem.py:302): at level 2 the CUDA graph pool.

It never pretends to be real: its first line says "STAND-IN", ``/v1/models`` says
``"owned_by": "gpud-standin"`` and every response carries ``X-Gpud-Standin: 1``. Unlike vLLM it
binds 127.0.0.1 without ``--host`` (tests must not listen beyond loopback).

Simulated memory: the budget is ``floor(util x GPUD_SIM_TOTAL_MIB)``, split into weights, peak
activation, CUDA graphs and KV cache as vLLM reports them; with ``--kv-cache-memory-bytes`` the
KV cache is that size instead and the budget is what the parts add up to. The engine draws the
budget plus ``--context-mib`` (the CUDA context vLLM's budget does not count), times
``1 + overdraw_pct/100``; ``--draw-mib N`` replaces all of it. When ``GPUD_SIM_PROCS_DIR`` and
``GPUD_SIM_DEVICE`` are set, the engine child registers ``PROCS_DIR/PID.json`` through
``gpud.host.simulation.register_process`` (atomic) and removes it when it exits; after a SIGKILL the
simulation drops the file of a dead PID. The simulated observation backend reads these files as
NVML's per-process list.

Fault injection: ``--raise-at-start MESSAGE`` (the model's load raises RuntimeError(MESSAGE):
a Python traceback on stderr and exit status 1, as ``vllm serve`` ends on a model it cannot
load), ``--crash-after S [--exit-code C]`` (the server process), ``--engine-dies-after
S`` (the engine child; vLLM's 503-then-exit follows), ``--never-healthy`` (never finishes
loading), ``--unhealthy-after S`` (503 with everything alive), ``--ignore-sigterm``.

Standard library only, and not even ``http.server``: it pulls in ``http.client`` and ``ssl``
(measured here: some 25 ms of imports and 6 MiB of RSS per process, more than the rest of this
program together), and a test host runs many of these at once. The HTTP/1.1 subset here is
what health pollers, curl and the OpenAI and Anthropic clients use: Content-Length bodies and
keep-alive.
"""

from __future__ import annotations

import argparse
import array
import binascii
import collections
import contextlib
import heapq
import io
import itertools
import json
import math
import os
import select
import signal
import socket
import socketserver
import sys
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from types import FrameType
from typing import Any, Final, NamedTuple

PROGRAM: Final = "gpud-standin"
VERSION: Final = "0.1.0"
OWNED_BY: Final = PROGRAM
STANDIN_HEADER: Final = "X-Gpud-Standin"

# The simulation's environment contract: copies of gpud.host.simulation's names (a test pins them
# equal), because importing that module at startup would double this program's import time.
GPUD_SIM_PROCS_DIR: Final = "GPUD_SIM_PROCS_DIR"
GPUD_SIM_DEVICE: Final = "GPUD_SIM_DEVICE"
GPUD_SIM_TOTAL_MIB: Final = "GPUD_SIM_TOTAL_MIB"
GPUD_SIM_DEVICES: Final = "GPUD_SIM_DEVICES"
GPUD_SIM_PIDNS: Final = "GPUD_SIM_PIDNS"
# Set inside a container by the CDI spec of simulated devices: a directory holding one device
# node per device the container was given, named by UUID (as /dev/nvidiaN are for real GPUs).
# Its first device is the one the serve draws on, as CUDA's device 0 is.
GPUD_SIM_DEVICES_DIR: Final = "GPUD_SIM_DEVICES_DIR"

ECHO_ENV: Final = ("HOME", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
# First argv word of the internal engine child; never part of a vllm-shaped argv.
DRAW_CHILD_TOKEN: Final = "__gpud_standin_draw_child__"
# vllm/utils/system_utils.py set_process_title: f"{VLLM_PROCESS_NAME_PREFIX}::{name}", prefix
# "VLLM", name "EngineCore" (vllm/v1/engine/core.py run_engine_core).
ENGINE_TITLE: Final = "VLLM::EngineCore"
# vllm/v1/engine/__init__.py: PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: Final = ("abort", "wait", "keep")
DEV_MODE_ENV: Final = "VLLM_SERVER_DEV_MODE"  # vllm/envs.py: bool(int(...)), default 0
VLLM_VERSION_ENV: Final = "GPUD_STANDIN_VLLM_VERSION"  # which release (default: gpud's)
V033: Final = "0.33.0"
V034: Final = "0.34.0"
STANDS_IN_FOR: Final = (V033, V034)
# vllm/v1/engine/__init__.py:44-55 of 0.34.0, CheckpointState
CHECKPOINT_RUNNING: Final = "running"
CHECKPOINT_PREPARED: Final = "prepared"

DEFAULT_UTILIZATION: Final = Fraction(92, 100)  # vllm/config/cache.py: CacheConfig default
# vllm/entrypoints/launchers/launcher.py watchdog_loop: VLLM_WATCHDOG_TIME_S
ENGINE_DEATH_EXIT_S: Final = 5.0
# vllm/v1/worker/gpu_worker.py: the buffer left out of the --kv-cache-memory recommendation
REDUNDANCY_BUFFER_MIB: Final = 150
MIB: Final = 1 << 20
DEFAULT_MAX_MODEL_LEN: Final = 4096
# vllm/engine/arg_utils.py:2949-2952 (vllm 0.32.0): max_num_seqs for the OpenAI server on a
# device under 70 GiB (1024 on larger ones), when --max-num-seqs is not given
DEFAULT_MAX_NUM_SEQS: Final = 256
# vllm/config/scheduler.py:21 SchedulerPolicy; vllm/config/model.py RunnerOption, ConvertOption
SCHEDULING_POLICIES: Final = ("fcfs", "priority")
RUNNERS: Final = ("auto", "generate", "pooling", "draft")
CONVERTS: Final = ("auto", "none", "embed", "classify")
MAX_HEADERS: Final = 100
MAX_LINE: Final = 65536
KEEPALIVE_TIMEOUT_S: Final = 75.0
CHILD_STOP_TIMEOUT_S: Final = 2.0

_REASONS: Final = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    411: "Length Required",
    413: "Payload Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
}


# ---------------------------------------------------------------------------------------------
# Logging: line-buffered stdout/stderr, which journald files under the unit's identifier.


def _log(message: str) -> None:
    print(f"{PROGRAM}[{os.getpid()}]: {message}", file=sys.stdout, flush=True)


def _warn(message: str) -> None:
    print(f"{PROGRAM}[{os.getpid()}]: WARNING: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Options and the pure parts: draw arithmetic and the health schedule.


class Options(NamedTuple):
    host: str
    port: int
    model: str
    served_model_names: tuple[str, ...]
    max_model_len: int
    gpu_memory_utilization: Fraction
    kv_cache_memory_bytes: int | None
    enable_sleep_mode: bool
    draw_mib: int | None
    weights_mib: int | None
    context_mib: int
    asleep_mib: int | None
    overdraw_pct: Fraction
    draw_after_s: float
    startup_delay_s: float
    crash_after_s: float | None
    exit_code: int
    raise_at_start: str | None
    never_healthy: bool
    unhealthy_after_s: float | None
    engine_dies_after_s: float | None
    exit_after_engine_death_s: float
    ignore_sigterm: bool
    echo_argv: bool
    vllm_args: tuple[str, ...]  # vLLM options the flag table knows: accepted, ignored
    # vLLM's --uds: listen on this Unix socket instead of host:port
    uds: str | None = None
    # `"stream": true` completions: one token every this many seconds
    token_interval_s: float = 0.0
    # the vLLM release it stands in for (its flag table, its log lines, its routes)
    vllm_version: str = "0.33.0"
    # vLLM 0.34's extensible KV cache: on unless --no-enable-extensible-kv-cache (or
    # --disable-...) or --kv-cache-memory-bytes (vllm/config/vllm.py:3180-3269 of 0.34.0)
    extensible_kv_cache: bool = False
    sleep_delay_s: float = 0.0
    # vLLM's scheduler: at most this many requests run at once, the rest wait in the policy's
    # order (vllm/config/scheduler.py: max_num_seqs, policy "fcfs" | "priority")
    max_num_seqs: int = 256
    scheduling_policy: str = "fcfs"
    # --enable-log-requests: "Added request ID." once a request is in the engine's queue, as
    # vllm/v1/engine/async_llm.py (0.32) logs it once it sent the request to its engine core
    log_requests: bool = False
    # vLLM's --runner ("generate" or "pooling"; "auto" is generate: the stand-in's model is
    # a generator unless told) and --convert ("embed" or "classify" for a pooling serve)
    runner: str = "generate"
    convert: str = "embed"
    # the width of a pooling serve's embeddings (a model's hidden size: 1024 for bge-m3)
    embedding_width: int = 256
    # the model is a speech-to-text one (Whisper's kind): the audio routes answer
    audio: bool = False
    # vLLM's --enable-force-include-usage: every stream carries usage, in every chunk
    force_include_usage: bool = False


def compute_draw_mib(
    *,
    draw_mib: int | None,
    utilization: Fraction,
    total_mib: int,
    overdraw_pct: Fraction,
) -> int:
    """MiB of a budget of ``util x total`` with its overdraw (``--draw-mib`` wins).

    Exact rational arithmetic: gpud passes ``util = floor(vram / total, 4 decimals)`` so that
    ``util x total <= vram``; binary floats would land one MiB off on some of those products.
    """
    base = Fraction(draw_mib) if draw_mib is not None else utilization * total_mib
    return math.floor(base * (1 + overdraw_pct / 100))


class MemoryPlan(NamedTuple):
    """What the engine holds, in MiB, in the parts vLLM logs at start."""

    requested: int  # util x total: vLLM's budget
    weights: int
    activation: int
    cudagraph: int
    kv_cache: int
    context: int  # outside vLLM's budget: CUDA context, NCCL and cuBLAS handles
    draw: int  # what NVML would show for the engine process
    recommended_kv_bytes: int | None  # vLLM's --kv-cache-memory=N to fit the budget


def memory_plan(opts: Options, total_mib: int) -> MemoryPlan:
    requested = math.floor(opts.gpu_memory_utilization * total_mib)
    weights = opts.weights_mib if opts.weights_mib is not None else requested * 3 // 5
    activation = requested // 50
    cudagraph = min(512, requested // 20)
    recommended: int | None = None
    if opts.kv_cache_memory_bytes is not None:
        # vLLM sizes the KV cache as told and skips KV profiling (and the recommendation).
        kv = math.ceil(opts.kv_cache_memory_bytes / MIB)
        budget = weights + activation + cudagraph + kv
    else:
        kv = max(0, requested - weights - activation - cudagraph)
        budget = requested
        recommended = (requested - weights - activation - cudagraph - REDUNDANCY_BUFFER_MIB) * MIB
    if opts.draw_mib is not None:
        draw = compute_draw_mib(draw_mib=opts.draw_mib, utilization=opts.gpu_memory_utilization,
                                total_mib=total_mib, overdraw_pct=opts.overdraw_pct)
    else:
        draw = math.floor((budget + opts.context_mib) * (1 + opts.overdraw_pct / 100))
    return MemoryPlan(requested, weights, activation, cudagraph, kv, opts.context_mib, draw,
                      recommended)


def _gib(mib: int) -> str:
    # vllm/utils/mem_utils.py format_gib: str(round(bytes / GiB, 2))
    return f"{round(mib * MIB / (1 << 30), 2)}"


def memory_log_lines(plan: MemoryPlan, opts: Options, total_mib: int,
                     load_s: float) -> list[str]:
    """vLLM's start-up memory lines, worded as the release it stands in for words them."""
    if opts.vllm_version == V034:
        return memory_log_lines_034(plan, opts, total_mib, load_s)
    lines = [
        # vllm/v1/worker/gpu_model_runner.py load_model
        f"Model loading took {_gib(plan.weights)} GiB memory and {load_s:.6f} seconds",
        # vllm/v1/worker/gpu_model_runner.py profile_cudagraph_memory
        f"Estimated CUDA graph memory: {plan.cudagraph / 1024:.2f} GiB total",
        # vllm/v1/worker/gpu_worker.py determine_available_memory
        f"Available KV cache memory: {_gib(plan.kv_cache)} GiB",
    ]
    if plan.recommended_kv_bytes is not None:
        # vllm/v1/worker/gpu_worker.py compile_or_warm_up_model, when KV memory was profiled
        non_kv = plan.weights + plan.activation + plan.cudagraph
        to_gpu = (total_mib - non_kv - REDUNDANCY_BUFFER_MIB) * MIB
        to_req = plan.recommended_kv_bytes
        lines.append(
            f"Free memory on device ({_gib(total_mib)}/{_gib(total_mib)} GiB) on startup. "
            f"Desired GPU memory utilization is ({float(opts.gpu_memory_utilization)}, "
            f"{_gib(plan.requested)} GiB). Actual usage is {_gib(plan.weights)} GiB for consumed "
            f"memory (weights + non-torch), {_gib(plan.activation)} GiB for peak activation, and "
            f"{_gib(plan.cudagraph)} GiB for CUDAGraph memory. Replace gpu_memory_utilization "
            f"config with `--kv-cache-memory={to_req}` ({_gib(to_req // MIB)} GiB) to fit into "
            f"requested memory, or `--kv-cache-memory={to_gpu}` ({_gib(to_gpu // MIB)} GiB) to "
            f"fully utilize gpu memory. Current kv cache memory in use is "
            f"{_gib(plan.kv_cache)} GiB.")
    return lines


class Health(NamedTuple):
    status: int  # 200 or 503
    state: str  # ready | unhealthy | engine-dead


def memory_log_lines_034(plan: MemoryPlan, opts: Options, total_mib: int,
                         load_s: float) -> list[str]:
    """vLLM 0.34.0's start-up memory lines (paths under vllm/, 0.34.0's line numbers): no
    "Estimated CUDA graph memory" (the V1 model runner is deleted); the graph pool as measured
    after capture; with the extensible KV cache, the warm-up account and the KV cache it was
    extended to. The stand-in knows no neighbour's draw, so the extended cache gets the
    profiled figure (measure_kv_cache_bytes with the device's headroom ample)."""
    lines = [
        # v1/worker/gpu/model_runner.py:441-445
        f"Model loading took {_gib(plan.weights)} GiB memory and {load_s:.6f} seconds",
        # v1/worker/gpu_worker.py:795-798 (only the profiling estimate when extensible)
        f"Available KV cache memory: {_gib(plan.kv_cache)} GiB",
        # v1/worker/gpu/model_runner.py:1216-1220
        f"Graph capturing finished in {max(1, round(load_s))} secs, took "
        f"{plan.cudagraph / 1024:.2f} GiB",
    ]
    if opts.extensible_kv_cache:
        blocks = plan.kv_cache * 4  # 256 KiB blocks: a figure, not a model's
        # v1/worker/extensible_kv_cache.py:693-705, then :536-540
        lines += [
            f"Memory after warmup: {_gib(total_mib - plan.draw)} GiB free, 0.0 GiB committed "
            f"to the KV cache, {_gib(plan.activation)} GiB kept for transient activations "
            f"({_gib(plan.activation)} GiB allocated at peak, 0.0 GiB of torch reservation "
            f"growth); {blocks} KV cache blocks ({_gib(plan.kv_cache)} GiB) fit within the "
            f"requested {_gib(plan.requested)} GiB. Torch may reserve up to "
            f"{_gib(plan.requested - plan.kv_cache)} GiB.",
            f"Extended KV cache to {blocks} blocks ({plan.kv_cache / 1024:.2f} GiB).",
        ]
    elif plan.recommended_kv_bytes is not None:
        lines += memory_log_lines(plan, opts._replace(vllm_version=V033), total_mib,
                                  load_s)[3:]
    return lines


def sleep_log_line(plan: MemoryPlan, opts: Options, level: int) -> str | None:
    """vLLM 0.34's account of a sleep (vllm/device_allocator/cumem.py:302-308): on 0.34 both
    levels offload the weights, runtime and cudagraph allocations but the discarded parameters
    (sleep_mode_backend.py:126-132, gpu_worker.py:320-328): level 1 parks the weights and the
    graph pool in host RAM, level 2 the graph pool. None on 0.33 (the stand-in says its own)."""
    if opts.vllm_version != V034 or level not in (1, 2):
        return None
    freed = plan.weights + plan.cudagraph + plan.kv_cache
    backed = plan.weights + plan.cudagraph if level == 1 else plan.cudagraph
    return (f"CuMemAllocator: sleep freed {freed / 1024:.2f} GiB memory in total, of which "
            f"{backed / 1024:.2f} GiB is backed up in CPU and the rest "
            f"{(freed - backed) / 1024:.2f} GiB is discarded directly.")


def health_at(opts: Options, elapsed_s: float, *, engine_dead: bool = False) -> Health:
    """/health of a listening stand-in (it listens only once loaded). vLLM's /health is 503
    exactly when the engine is dead (vllm/entrypoints/serve/instrumentator/health.py)."""
    if engine_dead:
        return Health(503, "engine-dead")
    if opts.unhealthy_after_s is not None and elapsed_s >= opts.unhealthy_after_s:
        return Health(503, "unhealthy")
    return Health(200, "ready")


def _fraction(text: str) -> Fraction:
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    return value


def _utilization(text: str) -> Fraction:
    value = _fraction(text)
    # 0 parses (vLLM's parser takes any float) and is refused at start, as vLLM's CacheConfig
    # does (gt=0): see main.
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def _non_negative_fraction(text: str) -> Fraction:
    value = _fraction(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = _non_negative_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _port(text: str) -> int:
    value = _non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"not a port: {text}")
    return value


def _exit_code(text: str) -> int:
    value = _non_negative_int(text)
    if value > 255:
        raise argparse.ArgumentTypeError(f"exit codes are 0..255, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: an unknown vLLM flag must never be taken for a prefix of ours
    # (``--gpu`` is not ``--gpu-memory-utilization``).
    p = argparse.ArgumentParser(
        prog="python -m gpud.testing.standin",
        allow_abbrev=False,
        description="A stand-in for a vLLM 0.33 or 0.34 OpenAI server (no model, no GPU) for gpud's "
        "tests. Usage: [serve [MODEL]] [options]; vLLM options its flag table knows are "
        "accepted and ignored, others exit 2.",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8000, help="0 picks a free port (logged)")
    p.add_argument("--model", default=None, help="as the positional MODEL of `serve MODEL`")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME")
    p.add_argument("--max-model-len", type=_non_negative_int, default=DEFAULT_MAX_MODEL_LEN)
    p.add_argument(
        "--gpu-memory-utilization",
        type=_utilization,
        default=DEFAULT_UTILIZATION,
        metavar="U",
        help="fraction of the device TOTAL (env GPUD_SIM_TOTAL_MIB) to draw, like vLLM",
    )
    p.add_argument("--kv-cache-memory-bytes", type=_non_negative_int, default=None, metavar="B")
    p.add_argument("--enable-sleep-mode", action="store_true")
    p.add_argument("--vllm-version", default=None, metavar="V",
                   help=f"the vLLM release to stand in for: 0.33.0 or 0.34.0 (default: "
                   f"${VLLM_VERSION_ENV}, else gpud's default)")
    # vllm/entrypoints/openai/api_server.py setup_server: with args.uds, a plain bind of a
    # Unix socket (create_server_unix_socket) instead of (host, port).
    p.add_argument("--uds", default=None, metavar="PATH")
    # vLLM's scheduler and model runner, honoured (see _Engine and App)
    p.add_argument("--max-num-seqs", type=_positive_int, default=DEFAULT_MAX_NUM_SEQS,
                   metavar="N")
    p.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs")
    p.add_argument("--enable-log-requests", action="store_true")
    p.add_argument("--runner", choices=RUNNERS, default="auto")
    p.add_argument("--convert", choices=CONVERTS, default="auto")
    p.add_argument("--enable-force-include-usage", action=argparse.BooleanOptionalAction,
                   default=False)
    sim = p.add_argument_group("simulation")
    sim.add_argument("--draw-mib", type=_non_negative_int, default=None, metavar="N")
    sim.add_argument("--weights-mib", type=_non_negative_int, default=None, metavar="N",
                     help="of the budget (default 3/5)")
    sim.add_argument("--context-mib", type=_non_negative_int, default=0, metavar="N",
                     help="drawn beyond util x total, as vLLM's CUDA context is")
    sim.add_argument("--asleep-mib", type=_non_negative_int, default=None, metavar="N",
                     help="drawn while asleep (default: the context)")
    sim.add_argument("--overdraw-pct", type=_non_negative_fraction, default=Fraction(0), metavar="P")
    sim.add_argument("--draw-after-s", type=_seconds, default=0.0, metavar="S")
    sim.add_argument("--draw-in-child", action="store_true",
                     help="accepted for older commands: the engine child always holds the draw")
    sim.add_argument("--token-interval-s", type=_seconds, default=0.0, metavar="S",
                     help='between the tokens of a "stream": true completion')
    sim.add_argument("--sleep-delay-s", type=_seconds, default=0.0, metavar="S",
                     help="how long a sleep of level 1 or 2 takes once the engine is paused "
                          "(vLLM's copies or drops the weights: seconds for a large model)")
    sim.add_argument("--embedding-width", type=_positive_int, default=256, metavar="N",
                     help="of a pooling serve's embeddings (its model's hidden size)")
    sim.add_argument("--audio", action="store_true",
                     help="a speech-to-text model: /v1/audio/transcriptions and "
                          "/v1/audio/translations answer")
    sim.add_argument("--startup-delay", type=_seconds, default=0.0, metavar="S",
                     help="the model's load time: no listening socket until it is over")
    faults = p.add_argument_group("fault injection")
    faults.add_argument("--crash-after", type=_seconds, default=None, metavar="S")
    faults.add_argument(
        "--exit-code", type=_exit_code, default=1, metavar="C", help="with --crash-after (default 1)"
    )
    faults.add_argument("--never-healthy", action="store_true", help="never finishes loading")
    faults.add_argument("--raise-at-start", default=None, metavar="MESSAGE",
                        help="the model's load raises RuntimeError(MESSAGE): a traceback, exit 1")
    faults.add_argument("--unhealthy-after", type=_seconds, default=None, metavar="S",
                        help="/health 503 from S on, with the engine alive")
    faults.add_argument("--engine-dies-after", type=_seconds, default=None, metavar="S",
                        help="the engine child exits at S: 503, then the server exits")
    faults.add_argument("--exit-after-engine-death", type=_seconds, default=ENGINE_DEATH_EXIT_S,
                        metavar="S", help="vLLM's watchdog period (default %(default)s)")
    faults.add_argument("--ignore-sigterm", action="store_true")
    p.add_argument(
        "--echo-argv",
        action="store_true",
        help="print argv and selected env as JSON at start and serve them at /standin/argv",
    )
    p.add_argument("--note", nargs=argparse.REMAINDER, default=[], metavar="ARG",
                   help="the rest of the argv, kept verbatim and ignored (for --echo-argv)")
    return p


def parse_args(argv: Sequence[str]) -> Options:
    """Parse a ``vllm serve``-shaped argv; exits 2 with usage on a bad known option and, like
    vLLM's own parser, on an option vLLM does not know."""
    args = list(argv)
    positional_model: str | None = None
    if args and args[0] == "serve":
        args.pop(0)
        if args and not args[0].startswith("-"):
            positional_model = args.pop(0)
    parser = _parser()
    ns, rest = parser.parse_known_args(args)
    from gpud.vllm.vllm_flags import DEFAULT_VERSION

    version = ns.vllm_version or os.environ.get(VLLM_VERSION_ENV) or DEFAULT_VERSION
    if version not in STANDS_IN_FOR:
        parser.error(f"--vllm-version {version!r}: one of {', '.join(STANDS_IN_FOR)}")
    problems = _vllm_problems(rest, version)
    if problems:
        # argparse's words (vllm/utils/argparse_utils.py FlexibleArgumentParser.error adds the
        # --task hint to them), then what the flag table says about each.
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: unrecognized arguments: {' '.join(rest)}", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        raise SystemExit(2)
    model: str = positional_model or ns.model or "standin"
    served = tuple(ns.served_model_name) if ns.served_model_name else (model,)
    return Options(
        host=ns.host,
        port=ns.port,
        model=model,
        served_model_names=served,
        max_model_len=ns.max_model_len,
        gpu_memory_utilization=ns.gpu_memory_utilization,
        kv_cache_memory_bytes=ns.kv_cache_memory_bytes,
        enable_sleep_mode=ns.enable_sleep_mode,
        draw_mib=ns.draw_mib,
        weights_mib=ns.weights_mib,
        context_mib=ns.context_mib,
        asleep_mib=ns.asleep_mib,
        overdraw_pct=ns.overdraw_pct,
        draw_after_s=ns.draw_after_s,
        startup_delay_s=ns.startup_delay,
        crash_after_s=ns.crash_after,
        exit_code=ns.exit_code,
        raise_at_start=ns.raise_at_start,
        never_healthy=ns.never_healthy,
        uds=ns.uds,
        token_interval_s=ns.token_interval_s,
        sleep_delay_s=ns.sleep_delay_s,
        unhealthy_after_s=ns.unhealthy_after,
        engine_dies_after_s=ns.engine_dies_after,
        exit_after_engine_death_s=ns.exit_after_engine_death,
        ignore_sigterm=ns.ignore_sigterm,
        echo_argv=ns.echo_argv,
        vllm_args=tuple(rest),
        vllm_version=version,
        max_num_seqs=ns.max_num_seqs,
        scheduling_policy=ns.scheduling_policy,
        log_requests=ns.enable_log_requests,
        runner="pooling" if ns.runner == "pooling" or ns.convert in ("embed", "classify")
        else "generate",
        convert="classify" if ns.convert == "classify" else "embed",
        embedding_width=ns.embedding_width,
        audio=ns.audio,
        force_include_usage=ns.enable_force_include_usage,
        extensible_kv_cache=(version == V034 and ns.kv_cache_memory_bytes is None
                             and _last_extensible_flag(rest) != "off"),
    )


def _last_extensible_flag(rest: Sequence[str]) -> str | None:
    """"on"/"off" as the last --[no-]enable-extensible-kv-cache / --disable-... says (argparse
    keeps the last), None when none is given."""
    said = None
    for arg in rest:
        name = arg.partition("=")[0].replace("_", "-")
        if name == "--enable-extensible-kv-cache":
            said = "on"
        elif name in ("--no-enable-extensible-kv-cache", "--disable-extensible-kv-cache"):
            said = "off"
    return said


def _vllm_problems(rest: Sequence[str], version: str) -> list[str]:
    """What vLLM's parser would refuse among the arguments the stand-in does not use itself:
    the flag table of `version` (--vllm-version, GPUD_STANDIN_VLLM_VERSION, or the one gpud
    checks configs with)."""
    if not rest:
        return []
    from gpud.vllm.vllm_flags import check_serve_args, load_table

    table = load_table(version)
    # A stray positional is checked as vLLM would: after the model, there is none.
    return [p.message for p in check_serve_args(["MODEL", *rest], table)]


# ---------------------------------------------------------------------------------------------
# Registration files: the simulated NVML per-process list.


class SimTarget(NamedTuple):
    procs_dir: str
    device: str
    host_pidns: int | None = None
    # A tensor-parallel stand-in: the other devices it draws on (GPUD_SIM_DEVICES), the same
    # MiB on each, as vLLM's workers draw one share per GPU.
    also: tuple[str, ...] = ()


def visible_devices(env: Mapping[str, str]) -> list[str] | None:
    """The simulated devices a container was given (GPUD_SIM_DEVICES_DIR), None outside one."""
    folder = env.get(GPUD_SIM_DEVICES_DIR, "")
    if not folder:
        return None
    try:
        return sorted(os.listdir(folder))
    except OSError:
        return []


def sim_target_from_env(env: Mapping[str, str]) -> SimTarget | None:
    procs_dir = env.get(GPUD_SIM_PROCS_DIR, "")
    device = env.get(GPUD_SIM_DEVICE, "")
    every = [d for d in env.get(GPUD_SIM_DEVICES, "").split(",") if d]
    visible = visible_devices(env)
    if visible is not None:
        # In a container the devices are what it was given, whatever the unit's variables say.
        device = visible[0] if visible else ""
        every = visible
    pidns = env.get(GPUD_SIM_PIDNS, "")
    if procs_dir and device:
        return SimTarget(procs_dir, device, int(pidns) if pidns.isdigit() else None,
                         tuple(d for d in every if d != device))
    return None


def sim_total_from_env(env: Mapping[str, str]) -> int:
    text = env.get(GPUD_SIM_TOTAL_MIB, "").strip()
    if not text:
        return 0
    value = int(text)  # ValueError: reported by main as a usage error
    if value < 0:
        raise ValueError(f"{GPUD_SIM_TOTAL_MIB} must be >= 0, got {text}")
    return value


def register(target: SimTarget, pid: int, mib: int) -> str:
    # Imported here, not at the top: gpud.host.simulation brings pathlib, tempfile, logging and
    # dataclasses (some 40 modules, doubling this program's import time), and only a process
    # that registers needs it, after its port already listens.
    from pathlib import Path

    from gpud.host.simulation import register_process

    return str(register_process(Path(target.procs_dir), pid, target.device, mib,
                                host_pidns=target.host_pidns, also=target.also))


def unregister(target: SimTarget, pid: int) -> None:
    from pathlib import Path

    from gpud.host.simulation import unregister_process

    unregister_process(Path(target.procs_dir), pid)


# ---------------------------------------------------------------------------------------------
# HTTP: a small HTTP/1.1 server (Content-Length bodies, keep-alive), one thread per connection.


class Request(NamedTuple):
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    query: str = ""


class Response(NamedTuple):
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()
    # A streamed body (server-sent events): its pieces, sent chunked, `interval_s` apart.
    events: tuple[bytes, ...] | None = None
    interval_s: float = 0.0
    # A generation's place in the engine: the stream ends early when the engine aborts it, and
    # the request stops counting as running once its last byte is sent.
    flight: _Flight | None = None


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _read_request(rfile: io.BufferedIOBase) -> tuple[Request, bool] | None:
    """One request and whether the connection stays open; None at a clean end of stream."""
    line = rfile.readline(MAX_LINE + 1)
    if line in (b"\r\n", b"\n"):  # RFC 9112 2.2: ignore one empty line before a request
        line = rfile.readline(MAX_LINE + 1)
    if not line:
        return None
    if len(line) > MAX_LINE:
        raise _BadRequest(400, "request line too long")
    parts = line.decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise _BadRequest(400, "malformed request line")
    method, target, version = parts
    headers: dict[str, str] = {}
    while True:
        hline = rfile.readline(MAX_LINE + 1)
        if not hline:
            raise _BadRequest(400, "end of stream inside the headers")
        if hline in (b"\r\n", b"\n"):
            break
        if len(headers) >= MAX_HEADERS or len(hline) > MAX_LINE:
            raise _BadRequest(431, "too many or too long header fields")
        name, sep, value = hline.decode("latin-1").partition(":")
        if not sep or not name or name != name.strip():
            raise _BadRequest(400, "malformed header field")
        headers[name.lower()] = value.strip()
    if "transfer-encoding" in headers:
        raise _BadRequest(501, "Transfer-Encoding is not supported by the stand-in")
    length_text = headers.get("content-length", "0")
    if not (length_text.isascii() and length_text.isdigit()):
        raise _BadRequest(400, "bad Content-Length")
    # No limit on the body's size, as vLLM has none (vllm 0.32.0): its uvicorn's h11 bounds an
    # incomplete event, the header block, at --h11-max-incomplete-event-size (4 MiB,
    # vllm/entrypoints/launchers/utils/constants.py:6, set in launchers/launcher.py:209-222),
    # while a Content-Length body comes as Data events of any total; FastAPI reads it whole.
    # An OCR page in base64 (a few MiB) or an audio file is an ordinary request.
    length = int(length_text)
    body = rfile.read(length) if length else b""
    if len(body) != length:
        return None
    connection = headers.get("connection", "").lower()
    keep_alive = version == "HTTP/1.1" and "close" not in connection
    path, _, query = target.partition("?")
    return Request(method, path, headers, body, query), keep_alive


def _encode_response(resp: Response, *, keep_alive: bool, head: bool) -> bytes:
    lines = [
        f"HTTP/1.1 {resp.status} {_REASONS.get(resp.status, 'Unknown')}",
        f"Date: {time.strftime('%a, %d %b %Y %H:%M:%S GMT', time.gmtime())}",
        f"Server: {PROGRAM}/{VERSION}",
        f"{STANDIN_HEADER}: 1",
        (f"Content-Length: {len(resp.body)}" if resp.events is None
         else "Transfer-Encoding: chunked"),
        f"Connection: {'keep-alive' if keep_alive else 'close'}",
    ]
    if resp.body or resp.events is not None:
        lines.append(f"Content-Type: {resp.content_type}")
    lines.extend(f"{name}: {value}" for name, value in resp.headers)
    head_bytes = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head_bytes if head else head_bytes + resp.body


def _json(status: int, payload: object, headers: tuple[tuple[str, str], ...] = ()) -> Response:
    return Response(status, json.dumps(payload).encode("utf-8"), headers=headers)


class _Handler(socketserver.StreamRequestHandler):
    timeout = KEEPALIVE_TIMEOUT_S
    server: _Server | _UnixServer

    def setup(self) -> None:
        # asyncio, and so vLLM's uvicorn, sets TCP_NODELAY on every TCP connection (Python 3.7
        # and later): a streamed token is sent at once, not held by Nagle's algorithm.
        if self.request.family != socket.AF_UNIX:
            self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().setup()

    def handle(self) -> None:
        app = self.server.app
        while True:
            try:
                parsed = _read_request(self.rfile)
            except _BadRequest as exc:
                self._send(_json(exc.status, {"detail": str(exc)}), keep_alive=False, head=False)
                return
            except (OSError, ValueError):  # timeout, reset, undecodable junk
                return
            if parsed is None:
                return
            request, keep_alive = parsed
            response = app.respond(request)
            if not self._send(response, keep_alive=keep_alive, head=request.method == "HEAD"):
                return
            if request.path != "/health":
                _log(f'"{request.method} {request.path}" {response.status}')
            if not keep_alive:
                return

    def _send(self, resp: Response, *, keep_alive: bool, head: bool) -> bool:
        try:
            self.wfile.write(_encode_response(resp, keep_alive=keep_alive, head=head))
            if resp.events is not None and not head:
                for i, event in enumerate(resp.events):
                    if i and resp.interval_s:
                        time.sleep(resp.interval_s)
                    if resp.flight is not None and resp.flight.aborted():
                        # the engine aborted it (a sleep's or a pause's mode=abort): its last
                        # events say so, after the I events sent
                        event = resp.flight.abort_after(i)
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                        event = resp.flight.last
                        if event:
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                        break
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
        except OSError:
            return False
        finally:
            if resp.flight is not None:
                resp.flight.end()
        return True


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, address: tuple[str, int], app: App) -> None:
        self.app = app
        # Bound now, listening only once loaded (server_activate): vLLM binds its port before
        # the engine starts and serves HTTP after it is ready
        # (vllm/entrypoints/launchers/launcher.py setup_server, create_server_socket), so a
        # connection during the load is refused.
        super().__init__(address, _Handler, bind_and_activate=False)
        try:
            self.server_bind()
        except BaseException:
            self.server_close()
            raise


class _Server6(_Server):
    address_family = socket.AF_INET6


class _UnixServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    request_queue_size = 64

    def __init__(self, path: str, app: App) -> None:
        self.app = app
        super().__init__(path, _Handler, bind_and_activate=False)
        try:
            self.server_bind()
        except BaseException:
            self.server_close()
            raise


# ---------------------------------------------------------------------------------------------
# Requests in flight, as vLLM's engine holds them (see the module's docstring for the source).


class _Engine:
    """The engine's scheduler as far as requests go: running (at most ``--max-num-seqs``),
    waiting (in line for a place, or held while paused), and the pause a sleep puts it in.

    vLLM's scheduler (vllm 0.32.0, vllm/v1/core/sched/scheduler.py): a waiting request enters
    RUNNING only while ``len(self.running) < self.max_num_running_reqs`` (= max_num_seqs, :129);
    the waiting queue is ``create_request_queue(policy)`` (v1/core/sched/request_queue.py:200):
    ``FCFSRequestQueue`` (a deque, appended: arrival order, the request's priority ignored) or
    ``PriorityRequestQueue`` (a heap ordered by ``Request.__lt__``, v1/request.py:357: lower
    ``priority`` first, then earlier arrival). A running request is preempted only when the KV
    cache runs out (scheduler.py:795), which the stand-in's never does: a place once taken is
    kept to the request's end."""

    def __init__(self, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                 policy: str = "fcfs", log_requests: bool = False) -> None:
        self.cond = threading.Condition()
        self.log_requests = log_requests
        self.max_num_seqs = max_num_seqs
        self.policy = policy
        self.running = 0
        # (priority, arrival): the head is the next to run (priority 0 for all under fcfs)
        self.queue: list[tuple[int, int]] = []
        self._arrivals = itertools.count()
        self.paused = False
        self.abort_epoch = 0  # raised by each mode=abort: every request begun before it ends

    def admit(self, priority: int = 0) -> int:
        """A request enters the engine: it waits for a place (in its policy's order), and is
        held while paused. Returns its epoch."""
        with self.cond:
            ticket = (priority if self.policy == "priority" else 0, next(self._arrivals))
            heapq.heappush(self.queue, ticket)
            if self.log_requests:
                print(f"(APIServer pid={os.getpid()}) INFO Added request req-{ticket[1]}.",
                      file=sys.stdout, flush=True)
            while self.paused or self.running >= self.max_num_seqs or self.queue[0] != ticket:
                self.cond.wait()
            heapq.heappop(self.queue)
            self.running += 1
            self.cond.notify_all()  # the next in line may have a place too
            return self.abort_epoch

    def end(self) -> None:
        with self.cond:
            self.running -= 1
            self.cond.notify_all()

    def pause(self, mode: str) -> None:
        """vLLM's pause_scheduler: new requests queue from now on; `abort` ends those in
        flight, `wait` lets them finish, `keep` freezes them. Returns once the requests in flight
        are done (abort, wait) at once for keep."""
        with self.cond:
            self.paused = True
            if mode == "abort":
                self.abort_epoch += 1
            if mode in ("abort", "wait"):
                while self.running:
                    self.cond.wait()

    def resume(self) -> None:
        with self.cond:
            self.paused = False
            self.cond.notify_all()

    def counts(self) -> tuple[int, int]:
        with self.cond:
            return self.running, len(self.queue)


def _query_value(query: str, name: str, default: str) -> str:
    """NAME's value in a query string (its last, as FastAPI reads a scalar), else DEFAULT."""
    value = default
    for item in query.split("&"):
        key, _, given = item.partition("=")
        if key == name:
            value = given
    return value


def _mode_refused(mode: str) -> Response | None:
    """FastAPI's answer to a `mode` that is no PauseMode (vllm/v1/engine/__init__.py)."""
    if mode in PAUSE_MODES:
        return None
    return _json(422, {"detail": [{"loc": ["query", "mode"], "msg":
                                   "Input should be 'abort', 'wait' or 'keep'", "input": mode}]})


class _Flight:
    """One streamed generation in the engine."""

    def __init__(self, engine: _Engine, epoch: int,
                 abort_event: bytes | Callable[[int], bytes],
                 last: bytes = b"data: [DONE]\n\n") -> None:
        self.engine = engine
        self.epoch = epoch
        # what the stream's end is when the engine aborts it: the same whenever it comes, or
        # made from how many events were sent (a route whose end carries what was made)
        self.abort_event = abort_event
        self.last = last  # what follows the abort event (OpenAI's [DONE]; nothing for Anthropic)
        self._ended = False

    def aborted(self) -> bool:
        return self.engine.abort_epoch != self.epoch

    def abort_after(self, sent: int) -> bytes:
        return self.abort_event(sent) if callable(self.abort_event) else self.abort_event

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self.engine.end()


# ---------------------------------------------------------------------------------------------
# The application: what each endpoint answers, from the options and the clock.


_Route = tuple[tuple[str, ...], Callable[["Request"], "Response"]]


class App:
    def __init__(self, opts: Options, *, draw_mib: int, echo: dict[str, Any] | None) -> None:
        self.opts = opts
        self.draw_mib = draw_mib
        self.echo = echo
        self.started_monotonic = time.monotonic()
        self.created = int(time.time())
        # Written by the main thread, read by request threads (single attribute stores).
        self.draw_pid: int | None = None
        self.registration: str | None = None
        self.engine_dead = False
        self.sleep_level: int | None = None
        self.sleep_mode: str | None = None
        self.sleeping_tags: set[str] = set()
        # vLLM 0.34's process-checkpoint state (running or prepared)
        self.checkpoint = CHECKPOINT_RUNNING
        # Set by the main process: tells the engine child to drop its KV cache (True) or
        # bring it back (False).
        self.on_checkpoint: Callable[[bool], None] | None = None
        # "loaded"; "discarded" by a level-2 sleep; "uninitialised" when woken without a
        # reload (real vLLM then answers from garbage weights)
        self.weights = "loaded"
        # Set by the main process: tells the engine child to sleep (level) or wake (None).
        self.on_sleep: Callable[[int | None], None] | None = None
        self.engine = _Engine(opts.max_num_seqs, opts.scheduling_policy, opts.log_requests)
        self._ids = itertools.count(1)
        Route = tuple[tuple[str, ...], Callable[[Request], Response]]
        self._routes: dict[str, Route] = {
            "/health": (("GET", "HEAD"), self._health),
            "/ping": (("GET", "HEAD", "POST"), self._health),
            "/version": (("GET", "HEAD"), self._version),
            "/v1/models": (("GET", "HEAD"), self._models),
            # the tokenizer's routes, on every serve (serve/__init__.py:36-40)
            "/tokenize": (("POST",), self._tokenize),
            "/detokenize": (("POST",), self._detokenize),
            "/standin/state": (("GET", "HEAD"), self._state),
            "/metrics": (("GET",), self._metrics),
        }
        self._routes.update(self._client_routes(opts))
        if echo is not None:
            self._routes["/standin/argv"] = (("GET", "HEAD"), lambda _req: _json(200, echo))
        if dev_mode(os.environ):
            # vllm/entrypoints/launchers/api_server/routers.py registers the dev routers, the
            # sleep ones among them (vllm/entrypoints/serve/dev/sleep/api_router.py), only
            # when VLLM_SERVER_DEV_MODE is set.
            self._routes["/sleep"] = (("POST",), self._sleep)
            self._routes["/wake_up"] = (("POST",), self._wake_up)
            self._routes["/is_sleeping"] = (("GET",), self._is_sleeping)
            self._routes["/collective_rpc"] = (("POST",), self._collective_rpc)
            # vllm/entrypoints/rl/online/api_router.py (register_rl_api_routers, same branch)
            self._routes["/pause"] = (("POST",), self._pause)
            self._routes["/resume"] = (("POST",), self._resume)
            self._routes["/is_paused"] = (("GET",), self._is_paused)
        if opts.vllm_version == V034 and opts.enable_sleep_mode:
            # vllm/entrypoints/launchers/api_server/routers.py:68-73 of 0.34.0: with sleep mode,
            # dev mode or not (entrypoints/serve/checkpoint/api_router.py:39, :60, :80)
            self._routes["/checkpoint/prepare"] = (("POST",), self._checkpoint_prepare)
            self._routes["/checkpoint/restore"] = (("POST",), self._checkpoint_restore)
            self._routes["/checkpoint/status"] = (("GET",), self._checkpoint_status)

    def _client_routes(self, opts: Options) -> dict[str, _Route]:
        """The routes of the serve's kind (see the note above _open)."""
        post: tuple[str, ...] = ("POST",)
        routes: dict[str, _Route]
        if opts.runner == "pooling":
            routes = {path: (post, self._score) for path in ("/score", "/v1/score")}
            routes.update({path: (post, self._rerank)
                           for path in ("/rerank", "/v1/rerank", "/v2/rerank")})
            if opts.convert == "embed":
                routes["/v1/embeddings"] = (post, self._embeddings)
            return routes
        routes = {
            "/v1/completions": (post, self._completions),
            "/v1/chat/completions": (post, self._chat),
            "/v1/responses": (post, self._responses),
            "/v1/messages": (post, self._messages),
            "/v1/messages/count_tokens": (post, self._count_tokens),
        }
        if opts.audio:
            routes["/v1/audio/transcriptions"] = (post, self._transcription)
            routes["/v1/audio/translations"] = (
                post, lambda req: self._transcription(req, translate=True))
        return routes

    def elapsed(self) -> float:
        return time.monotonic() - self.started_monotonic

    def respond(self, req: Request) -> Response:
        route = self._routes.get(req.path)
        if route is None:
            return _json(404, {"detail": "Not Found"})
        methods, handler = route
        if req.method not in methods:
            return _json(405, {"detail": "Method Not Allowed"}, (("Allow", ", ".join(methods)),))
        return handler(req)

    def health(self) -> Health:
        return health_at(self.opts, self.elapsed(), engine_dead=self.engine_dead)

    def _health(self, _req: Request) -> Response:
        # vLLM answers an empty body either way; the state name travels in a header.
        h = self.health()
        return Response(h.status, headers=(("X-Gpud-Standin-State", h.state),))

    def _sleep(self, req: Request) -> Response:
        level_text = _query_value(req.query, "level", "1")
        mode = _query_value(req.query, "mode", "abort")
        if not (level_text.isascii() and level_text.isdigit() and int(level_text) <= 2):
            # FastAPI's answer to Query(ge=0, le=2)
            return _json(422, {"detail": [{"loc": ["query", "level"], "msg":
                                           "Input should be 0, 1 or 2", "input": level_text}]})
        if (refused := _mode_refused(mode)) is not None:
            return refused
        if not self.opts.enable_sleep_mode:
            return _openai_error(500, "InternalServerError",
                                 "sleep mode is not enabled: start with --enable-sleep-mode")
        if self.checkpoint != CHECKPOINT_RUNNING:
            # vllm/v1/engine/core.py:1110-1113 of 0.34.0, a RuntimeError: FastAPI's 500
            return _openai_error(500, "InternalServerError", "Cannot sleep while the checkpoint "
                                 f"state is {self.checkpoint}")
        level = int(level_text)
        # Paused first (its mode decides the requests in flight), then the memory goes.
        self.engine.pause(mode)
        self.sleep_mode = mode
        if level and self.opts.sleep_delay_s:
            time.sleep(self.opts.sleep_delay_s)  # its memory going: still awake meanwhile
        self.sleep_level = level
        # level 1 parks the weights in host RAM and drops the KV cache; level 2 drops both
        # (vLLM's docs/features/sleep_mode.md, "Sleep levels"); level 0 only pauses.
        self.sleeping_tags = {"weights", "kv_cache"} if level else set()
        if level == 2:
            self.weights = "discarded"
        if self.on_sleep is not None:
            self.on_sleep(level)
        return _json(200, {"status": "sleeping", "level": level})

    def _pause(self, req: Request) -> Response:
        # vllm/entrypoints/rl/online/api_router.py pause_generation: `mode` a PauseMode, default
        # "abort" (clear_cache is deprecated there and ignored here); answered once the requests
        # in flight are aborted (abort) or done (wait), at once for keep
        # (vllm/v1/engine/async_llm.py pause_generation)
        mode = _query_value(req.query, "mode", "abort")
        if (refused := _mode_refused(mode)) is not None:
            return refused
        self.engine.pause(mode)
        return _json(200, {"status": "paused"})

    def _resume(self, _req: Request) -> Response:
        self.engine.resume()
        return _json(200, {"status": "resumed"})

    def _is_paused(self, _req: Request) -> Response:
        return _json(200, {"is_paused": self.engine.paused})

    def _wake_up(self, req: Request) -> Response:
        # vllm/entrypoints/serve/dev/sleep/api_router.py wake_up: repeated `tags`, none = all;
        # the answer says "awake" once no tag sleeps, else "sleeping".
        tags = [v for k, _, v in (i.partition("=") for i in req.query.split("&") if i)
                if k == "tags"]
        unknown = [t for t in tags if t not in ("weights", "kv_cache")]
        if unknown:
            return _openai_error(500, "InternalServerError", f"unknown memory tags {unknown}")
        if self.checkpoint != CHECKPOINT_RUNNING:
            # vllm/v1/engine/core.py:1153-1156 of 0.34.0
            return _openai_error(500, "InternalServerError", "Cannot wake up while the "
                                 f"checkpoint state is {self.checkpoint}")
        waking = set(tags) if tags else set(self.sleeping_tags)
        if "weights" in waking and "weights" in self.sleeping_tags and self.weights == "discarded":
            # level 2 dropped them: their memory comes back, their content does not (vLLM's
            # restore reloads them: collective_rpc reload_weights)
            self.weights = "uninitialised"
        self.sleeping_tags -= waking
        if not self.sleeping_tags:
            if self.sleep_level is not None and self.on_sleep is not None:
                self.on_sleep(None)
            self.sleep_level = None
            self.engine.resume()  # fully awake: the requests held run
        return _json(200, {"status": "sleeping" if self.sleep_level is not None else "awake",
                           "tags": tags or None})

    def _collective_rpc(self, req: Request) -> Response:
        # vllm/entrypoints/serve/dev/rpc/api_router.py: {"method": ...} run on every worker
        try:
            payload = json.loads(req.body or b"{}")
        except ValueError:
            return _json(400, {"detail": "JSON decode error"})
        method = payload.get("method") if isinstance(payload, dict) else None
        if method is None:
            return _json(400, {"detail": "Missing 'method' in request body"})
        if method != "reload_weights":
            return _openai_error(500, "InternalServerError",
                                 f"the stand-in's workers have no method {method!r}")
        if "weights" in self.sleeping_tags:
            return _openai_error(500, "InternalServerError",
                                 "reload_weights while the weights sleep: wake_up?tags=weights "
                                 "first")
        self.weights = "loaded"
        return _json(200, {"results": [None]})

    def _is_sleeping(self, _req: Request) -> Response:
        # a prepared engine's scheduler is paused: vllm/v1/engine/core.py:1202-1204 of 0.34.0
        return _json(200, {"is_sleeping": self.sleep_level is not None
                           or self.checkpoint != CHECKPOINT_RUNNING})

    def _checkpoint_prepare(self, req: Request) -> Response:
        # api_router.py:39-57 and core.py:2471-2496 of 0.34.0 (the drain is instant here: no
        # request outlives it, so the state goes straight to prepared, KV cache released)
        mode = _query_value(req.query, "mode", "wait")
        if (refused := _mode_refused(mode)) is not None:
            return refused
        if self.checkpoint == CHECKPOINT_RUNNING:
            if self.sleep_level is not None:
                return _json(400, {"state": self.checkpoint, "error": "Preparing for a "
                                   "checkpoint requires an awake engine"})
            self.checkpoint = CHECKPOINT_PREPARED
            if self.on_checkpoint is not None:
                self.on_checkpoint(True)
        return _json(200, {"state": self.checkpoint})

    def _checkpoint_restore(self, _req: Request) -> Response:
        # api_router.py:60-77, core.py:2498-2513: a restore done (or not needed) answers 200
        if self.checkpoint == CHECKPOINT_PREPARED:
            self.checkpoint = CHECKPOINT_RUNNING
            if self.on_checkpoint is not None:
                self.on_checkpoint(False)
        return _json(200, {"state": self.checkpoint})

    def _checkpoint_status(self, _req: Request) -> Response:
        # api_router.py:80-97: 200 once prepared, 503 until then
        status = 200 if self.checkpoint == CHECKPOINT_PREPARED else 503
        return _json(status, {"state": self.checkpoint})

    def _metrics(self, _req: Request) -> Response:
        running, waiting = self.engine.counts()
        labels = f'engine="0",model_name="{self.opts.served_model_names[0]}"'
        lines = []
        for name, value, doc in (
                ("vllm:num_requests_running", running,
                 "Number of requests in model execution batches."),
                ("vllm:num_requests_waiting", waiting,
                 "Number of requests waiting to be processed.")):
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} gauge",
                      f"{name}{{{labels}}} {float(value)}"]
        return Response(200, ("\n".join(lines) + "\n").encode(),
                        content_type="text/plain; version=0.0.4; charset=utf-8")

    def _version(self, _req: Request) -> Response:
        return _json(200, {"version": f"{PROGRAM}-{VERSION}"})

    def _models(self, _req: Request) -> Response:
        cards: list[dict[str, Any]] = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": OWNED_BY,
                "root": self.opts.model,
                "parent": None,
                "max_model_len": self.opts.max_model_len,
                "permission": [],
            }
            for name in self.opts.served_model_names
        ]
        return _json(200, {"object": "list", "data": cards})

    def _state(self, _req: Request) -> Response:
        h = self.health()
        return _json(
            200,
            {
                "standin": True,
                "pid": os.getpid(),
                "state": h.state,
                "health_status": h.status,
                "elapsed_s": round(self.elapsed(), 3),
                "draw_mib": self.draw_mib,
                "draw_pid": self.draw_pid,
                "registration": self.registration,
                "sleep_level": self.sleep_level,
                "sleep_mode": self.sleep_mode,
                "weights": self.weights,
                "vllm_version": self.opts.vllm_version,
                "checkpoint": self.checkpoint,
                "model": self.opts.model,
                "served_model_names": list(self.opts.served_model_names),
            },
        )

    # ---- the client routes, in vLLM 0.32.0's shapes (paths under vllm/entrypoints/) -------
    # Which routes a serve has follows vLLM's launchers/api_server/routers.py
    # register_api_routers: the tokenizer's always (serve/__init__.py:36-40); a generator's
    # chat, completions, responses and messages (generate/api_router.py
    # register_generate_api_routers); a pooling serve's embeddings (an "embed" model) and score
    # and rerank (pooling/factories.py register_pooling_api_routers, pooling/utils.py:232
    # enable_scoring_api: embed models and cross-encoders); the audio routes for a
    # speech-to-text model only. A route the serve does not have is FastAPI's 404.

    def _open(self, req: Request, error: Callable[[int, str, str], Response] | None = None
              ) -> dict[str, Any] | Response:
        """The request's JSON object, its `model` one served here (vLLM's check_model,
        serve/engine/serving.py:213) and its `priority` an integer; else the error vLLM
        answers, in the route's error shape."""
        fail = error or _openai_error
        if self.health().status != 200:
            return fail(503, "ServiceUnavailableError", "the stand-in is not ready")
        try:
            payload = json.loads(req.body or b"{}")
        except ValueError:
            return fail(400, "BadRequestError", "the body is not JSON")
        if not isinstance(payload, dict):
            return fail(400, "BadRequestError", "the body must be a JSON object")
        if payload.get("model") is None:
            payload["model"] = self.opts.served_model_names[0]
        model = payload["model"]
        if model not in self.opts.served_model_names:
            return fail(404, "NotFoundError", f"The model `{model}` does not exist.")
        priority = payload.get("priority", 0)
        if not isinstance(priority, int) or isinstance(priority, bool):
            return fail(400, "BadRequestError", "priority must be an integer")
        return payload

    def _completions(self, req: Request) -> Response:
        return self._generate(req, chat=False)

    def _chat(self, req: Request) -> Response:
        return self._generate(req, chat=True)

    def _generate(self, req: Request, *, chat: bool) -> Response:
        payload = self._open(req)
        if isinstance(payload, Response):
            return payload
        count = _max_tokens(payload, "max_tokens")
        if count is None:
            return _openai_error(400, "BadRequestError", "max_tokens must be a positive integer")
        prompt = _chat_prompt(payload.get("messages")) if chat else _completion_prompt(payload)
        if isinstance(prompt, str):
            return _openai_error(400, "BadRequestError", prompt)
        model = payload["model"]
        # serve/utils/api_utils.py:289 should_include_usage: --enable-force-include-usage
        # gives both; else stream_options.include_usage, and continuous_usage_stats with it
        options = payload.get("stream_options")
        options = options if isinstance(options, dict) else {}
        usage_on = self.opts.force_include_usage or options.get("include_usage") is True
        continuous = self.opts.force_include_usage or (
            usage_on and options.get("continuous_usage_stats") is True)
        # held here while the engine is paused (asleep) or full, as vLLM's scheduler holds it
        epoch = self.engine.admit(payload.get("priority", 0))
        stream = bool(payload.get("stream"))
        words, finish = self._answer(prompt, count,
                                     fill=stream or payload.get("ignore_eos") is True)
        if stream:
            return self._stream(model, words, prompt, chat=chat, epoch=epoch, usage=usage_on,
                                continuous=continuous)
        self._spend(words)
        text = " ".join(words)
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish,
            }
            kind, prefix = "chat.completion", "chatcmpl"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            kind, prefix = "text_completion", "cmpl"
        return _json(
            200,
            {
                "id": f"{prefix}-standin-{os.getpid()}-{next(self._ids)}",
                "object": kind,
                "created": int(time.time()),
                "model": model,
                "choices": [choice],
                "usage": _usage(prompt.tokens, len(words)),
            },
        )

    def _answer(self, prompt: Prompt, count: int, *, fill: bool = False) -> tuple[list[str], str]:
        """What the stand-in's model generates, a word a token, and its finish_reason: its echo
        of the prompt's last text, then its end of sequence ("stop"), cut at `count` tokens
        ("length"); with `fill` (a stream, or `ignore_eos`: vLLM's SamplingParams) the echo
        repeated up to `count` tokens, as a model that never ends would ("length")."""
        text = f"[{PROGRAM} echo] {prompt.last}"
        if self.weights != "loaded":
            text = f"[{PROGRAM}: weights {self.weights}, the answer is garbage]"
        words = text.split()
        if fill:
            return (words * count)[:count], "length"
        return words[:count], "stop" if len(words) <= count else "length"

    def _spend(self, words: list[str]) -> None:
        """A non-streamed answer: its tokens' time in the engine (--token-interval-s each),
        its place held meanwhile, then the place freed."""
        try:
            if self.opts.token_interval_s:
                time.sleep(self.opts.token_interval_s * len(words))
        finally:
            self.engine.end()

    def _stream(self, model: str, words: list[str], prompt: Prompt, *, chat: bool, epoch: int,
                usage: bool, continuous: bool = False) -> Response:
        """vLLM's streamed answer: `data: {chunk}` events, one per token, the last one with its
        finish_reason; with stream_options.include_usage, a last chunk with no choices and the
        usage (openai/chat_completion/serving.py, completion/serving.py), with
        continuous_usage_stats the usage so far in every chunk too; then `data: [DONE]`.
        Aborted by the engine: a last chunk with finish_reason "abort", then `data: [DONE]`."""
        kind, prefix = ("chat.completion.chunk", "chatcmpl") if chat else ("text_completion", "cmpl")
        ident = f"{prefix}-standin-{os.getpid()}-{next(self._ids)}"
        created = int(time.time())
        events = []
        for i, word in enumerate(words):
            finish = "length" if i == len(words) - 1 else None
            choice: dict[str, Any] = ({"index": 0, "delta": {"content": word + " "},
                                       "finish_reason": finish} if chat else
                                      {"index": 0, "text": word + " ", "logprobs": None,
                                       "finish_reason": finish})
            chunk = {"id": ident, "object": kind, "created": created, "model": model,
                     "choices": [choice]}
            if continuous:
                chunk["usage"] = _usage(prompt.tokens, i + 1)
            events.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if usage:
            chunk = {"id": ident, "object": kind, "created": created, "model": model,
                     "choices": [], "usage": _usage(prompt.tokens, len(words))}
            events.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        events.append(b"data: [DONE]\n\n")
        last: dict[str, Any] = ({"index": 0, "delta": {}, "finish_reason": "abort"} if chat else
                                {"index": 0, "text": "", "logprobs": None,
                                 "finish_reason": "abort"})
        abort = b"data: " + json.dumps({"id": ident, "object": kind, "created": created,
                                        "model": model, "choices": [last]}).encode() + b"\n\n"
        return Response(200, content_type="text/event-stream", events=tuple(events),
                        interval_s=self.opts.token_interval_s,
                        flight=_Flight(self.engine, epoch, abort))

    def _responses(self, req: Request) -> Response:
        """POST /v1/responses (openai/responses/api_router.py:48): ResponsesResponse
        (openai/responses/protocol.py:789, from_request :882) with ResponseUsage (:102),
        built as serving.py:879 builds it; streamed, its events as serving.py:1360-1425 and
        streaming_events.py send them (`event: TYPE` then `data: JSON`, numbered by
        sequence_number; no [DONE]: api_router.py:34)."""
        payload = self._open(req)
        if isinstance(payload, Response):
            return payload
        count = _max_tokens(payload, "max_output_tokens")
        if count is None:
            return _openai_error(400, "BadRequestError",
                                 "max_output_tokens must be a positive integer")
        given = payload.get("input")
        messages: Any = [{"role": "user", "content": given}] if isinstance(given, str) else given
        if isinstance(payload.get("instructions"), str):
            messages = [{"role": "system", "content": payload["instructions"]},
                        *(messages if isinstance(messages, list) else [])]
        prompt = _chat_prompt(messages)
        if isinstance(prompt, str):
            return _openai_error(400, "BadRequestError", prompt)
        stream = bool(payload.get("stream"))
        epoch = self.engine.admit(payload.get("priority", 0))
        words, finish = self._answer(prompt, count, fill=stream)
        ident = next(self._ids)
        item_id = f"msg_standin{os.getpid()}x{ident}"
        text = " ".join(words) if not stream else "".join(w + " " for w in words)
        part: dict[str, Any] = {"annotations": [], "text": text, "type": "output_text",
                                "logprobs": None}
        final = self._response_doc(payload, ident, count, prompt.tokens, len(words),
                                   finish == "length", [{
                                       "id": item_id, "content": [part], "role": "assistant",
                                       "status": "completed", "type": "message"}])
        if not stream:
            self._spend(words)
            return _json(200, final)
        begun = {**final, "output": [], "status": "in_progress", "usage": None,
                 "incomplete_details": None}
        place = {"output_index": 0, "item_id": item_id, "content_index": 0}
        kinds: list[tuple[str, dict[str, Any]]] = [
            ("response.created", {"response": begun}),
            ("response.in_progress", {"response": begun}),
            ("response.output_item.added", {"output_index": 0, "item": {
                "id": item_id, "type": "message", "role": "assistant", "content": [],
                "status": "in_progress"}}),
            ("response.content_part.added", {**place, "part": {
                "type": "output_text", "text": "", "annotations": [], "logprobs": []}}),
            *(("response.output_text.delta", {**place, "delta": word + " ", "logprobs": []})
              for word in words),
            ("response.output_text.done", {**place, "text": text, "logprobs": []}),
            ("response.content_part.done", {**place, "part": {
                "type": "output_text", "text": text, "annotations": []}}),
            ("response.output_item.done", {"output_index": 0, "item": final["output"][0]}),
            ("response.completed", {"response": final}),
        ]
        def numbered(kinds: Sequence[tuple[str, dict[str, Any]]], first: int) -> bytes:
            return b"".join(
                f"event: {kind}\ndata: "
                f"{json.dumps({'type': kind, 'sequence_number': n, **data})}\n\n".encode()
                for n, (kind, data) in enumerate(kinds, first))

        def aborted(sent: int) -> bytes:
            # vLLM 0.32 ends an aborted stream (a model without Harmony) as a whole one: the
            # done events with what was made, then response.completed, its status "completed"
            # (openai/responses/serving.py: "cancelled" only for Harmony; tests/vllm/
            # test_contract.py test_an_aborted_responses_stream_ends_as_a_whole_one)
            made = words[:max(0, min(len(words), sent - 4))]
            said = "".join(w + " " for w in made)
            cut_part = {**part, "text": said}
            doc = self._response_doc(payload, ident, count, prompt.tokens, len(made), False, [{
                "id": item_id, "content": [cut_part], "role": "assistant",
                "status": "completed", "type": "message"}])
            return numbered([
                ("response.output_text.done", {**place, "text": said, "logprobs": []}),
                ("response.content_part.done", {**place, "part": {
                    "type": "output_text", "text": said, "annotations": []}}),
                ("response.output_item.done", {"output_index": 0, "item": doc["output"][0]}),
                ("response.completed", {"response": doc})], sent)

        events = tuple(numbered([kind], n) for n, kind in enumerate(kinds))
        return Response(200, content_type="text/event-stream", events=events,
                        interval_s=self.opts.token_interval_s,
                        flight=_Flight(self.engine, epoch, aborted, last=b""))

    def _response_doc(self, payload: dict[str, Any], ident: int, count: int, prompt: int,
                      made: int, cut: bool, output: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": f"resp_standin{os.getpid()}x{ident}",
            "created_at": int(time.time()),
            # status "incomplete" with this reason when max_output_tokens ended it
            # (protocol.py:897-899)
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "instructions": payload.get("instructions"),
            "metadata": payload.get("metadata"),
            "model": payload["model"],
            "object": "response",
            "output": output,
            "parallel_tool_calls": payload.get("parallel_tool_calls", True),
            "temperature": payload.get("temperature") or 1.0,
            "tool_choice": payload.get("tool_choice", "auto"),
            "tools": payload.get("tools", []),
            "top_p": payload.get("top_p") or 1.0,
            "background": bool(payload.get("background", False)),
            "max_output_tokens": count,
            "max_tool_calls": None,
            "previous_response_id": payload.get("previous_response_id"),
            "prompt": None,
            "reasoning": None,
            "service_tier": payload.get("service_tier", "auto"),
            "status": "incomplete" if cut else "completed",
            "text": None,
            "top_logprobs": None,
            "truncation": payload.get("truncation", "disabled"),
            "usage": {
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0,
                                         "input_tokens_per_turn": [],
                                         "cached_tokens_per_turn": []},
                "output_tokens": made,
                "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                          "output_tokens_per_turn": [],
                                          "tool_output_tokens_per_turn": []},
                "total_tokens": prompt + made,
            },
            "user": payload.get("user"),
        }

    def _messages(self, req: Request) -> Response:
        """POST /v1/messages (anthropic/api_router.py:51): AnthropicMessagesResponse
        (anthropic/protocol.py:380) dumped with exclude_none (api_router.py:82), AnthropicUsage
        (:31); streamed as serving.py's events (message_start, content_block_start, a
        content_block_delta a token, content_block_stop, message_delta with the stop reason and
        usage, message_stop: `event: NAME` then `data: JSON`, no [DONE]); errors in Anthropic's
        shape (api_router.py:39 translate_error_response)."""
        payload = self._open(req, _anthropic_error)
        if isinstance(payload, Response):
            return payload
        count = _max_tokens(payload, "max_tokens", required=True)
        if count is None:
            return _anthropic_error(400, "BadRequestError",
                                    "max_tokens: a positive integer is required")
        prompt = _anthropic_prompt(payload)
        if isinstance(prompt, str):
            return _anthropic_error(400, "BadRequestError", prompt)
        model = payload["model"]
        epoch = self.engine.admit(payload.get("priority", 0))
        words, finish = self._answer(prompt, count, fill=bool(payload.get("stream")))
        # anthropic/serving.py _to_anthropic_stop_reason: "stop" is end_turn, "length" max_tokens
        stop = "max_tokens" if finish == "length" else "end_turn"
        ident = f"msg_standin{os.getpid()}x{next(self._ids)}"
        usage = {"input_tokens": prompt.tokens, "output_tokens": len(words)}
        if not payload.get("stream"):
            self._spend(words)
            return _json(200, {"id": ident, "type": "message", "role": "assistant",
                               "content": [{"type": "text", "text": " ".join(words)}],
                               "model": model, "stop_reason": stop, "usage": usage})

        def event(name: str, data: dict[str, Any]) -> bytes:
            # anthropic/serving.py:142 wrap_data_with_event
            return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()

        events = [
            event("message_start", {"type": "message_start", "message": {
                "id": ident, "type": "message", "role": "assistant", "content": [],
                "model": model, "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": prompt.tokens, "output_tokens": 0}}}),
            event("content_block_start", {"type": "content_block_start", "index": 0,
                                          "content_block": {"type": "text", "text": ""}}),
            *(event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                            "delta": {"type": "text_delta",
                                                      "text": word + " "}})
              for word in words),
            event("content_block_stop", {"type": "content_block_stop", "index": 0}),
            event("message_delta", {"type": "message_delta",
                                    "delta": {"stop_reason": stop,
                                              "stop_sequence": None}, "usage": usage}),
            event("message_stop", {"type": "message_stop"}),
        ]
        def aborted(sent: int) -> bytes:
            # vLLM 0.32: an aborted stream's usual last events, its message_delta's stop_reason
            # null (anthropic/serving.py _to_anthropic_stop_reason maps "abort" to None; tests/
            # vllm/test_contract.py test_an_aborted_messages_stream_ends_with_no_stop_reason)
            made = max(0, min(len(words), sent - 2))
            return (event("content_block_stop", {"type": "content_block_stop", "index": 0})
                    + event("message_delta", {"type": "message_delta",
                                              "delta": {"stop_reason": None,
                                                        "stop_sequence": None},
                                              "usage": {**usage, "output_tokens": made}})
                    + event("message_stop", {"type": "message_stop"}))

        return Response(200, content_type="text/event-stream", events=tuple(events),
                        interval_s=self.opts.token_interval_s,
                        flight=_Flight(self.engine, epoch, aborted, last=b""))

    def _count_tokens(self, req: Request) -> Response:
        """POST /v1/messages/count_tokens (anthropic/api_router.py:89):
        AnthropicCountTokensResponse (protocol.py:447): input_tokens, and context_management's
        original_input_tokens (serving.py:1263, the same count: no context was edited)."""
        payload = self._open(req, _anthropic_error)
        if isinstance(payload, Response):
            return payload
        prompt = _anthropic_prompt(payload)
        if isinstance(prompt, str):
            return _anthropic_error(400, "BadRequestError", prompt)
        return _json(200, {"input_tokens": prompt.tokens,
                           "context_management": {"original_input_tokens": prompt.tokens}})

    def _tokenize(self, req: Request) -> Response:
        """POST /tokenize (serve/tokenize/api_router.py:35): a `prompt` or chat `messages`
        (TokenizeCompletionRequest, TokenizeChatRequest, protocol.py:20, :46); TokenizeResponse
        (:157). The stand-in's tokenizer: a token per UTF-8 byte, ids 0..255 (the chat template
        `role: content` lines, then `assistant:`, the tiny test model's)."""
        payload = self._open(req)
        if isinstance(payload, Response):
            return payload
        if "messages" in payload:
            prompt = _chat_prompt(payload["messages"],
                                  generation=payload.get("add_generation_prompt", True))
            if isinstance(prompt, str):
                return _openai_error(400, "BadRequestError", prompt)
            tokens = list(prompt.text.encode())
        elif isinstance(payload.get("prompt"), str):
            tokens = list(payload["prompt"].encode())
        else:
            return _openai_error(400, "BadRequestError",
                                 'give a "prompt" (a string) or chat "messages"')
        strs = ([bytes([t]).decode("latin-1") for t in tokens]
                if payload.get("return_token_strs") else None)
        return _json(200, {"count": len(tokens), "max_model_len": self.opts.max_model_len,
                           "tokens": tokens, "token_strs": strs})

    def _detokenize(self, req: Request) -> Response:
        """POST /detokenize (serve/tokenize/api_router.py:61): DetokenizeRequest `tokens`
        (protocol.py:164), DetokenizeResponse `prompt` (:179)."""
        payload = self._open(req)
        if isinstance(payload, Response):
            return payload
        tokens = payload.get("tokens")
        if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
            return _openai_error(400, "BadRequestError", "tokens: a list of token ids")
        unknown = [t for t in tokens if t > 255]
        if unknown:
            return _openai_error(400, "BadRequestError",
                                 f"token id {unknown[0]} is out of the vocabulary (0..255)")
        return _json(200, {"prompt": bytes(tokens).decode("utf-8", "replace")})

    def _embeddings(self, req: Request) -> Response:
        """POST /v1/embeddings (pooling/embed/api_router.py:28): `input` a string, strings or
        token ids (EmbeddingCompletionRequest, embed/protocol.py:35), `encoding_format` "float"
        or "base64" (pooling/base/protocol.py:318: float32, native byte order, as the openai
        library reads it: pooling/utils.py:86), `dimensions` refused for a model without
        Matryoshka embeddings (vllm/pooling_params.py:175); EmbeddingResponse (embed/protocol.py
        :180) with UsageInfo of the prompt tokens alone (pooling/utils.py:154)."""
        payload = self._open(req)
        if isinstance(payload, Response):
            return payload
        texts = _inputs(payload.get("input"))
        if isinstance(texts, str):
            return _openai_error(400, "BadRequestError", texts)
        form = payload.get("encoding_format", "float")
        if form not in ("float", "base64"):
            return _openai_error(400, "BadRequestError",
                                 f"encoding_format {form!r}: 'float' or 'base64'")
        dims = payload.get("dimensions")
        if dims is not None:
            return _openai_error(400, "BadRequestError", (
                f"Model {payload['model']!r} does not support Matryoshka embeddings; dimensions "
                f"must be unset (received dimensions={dims})."))
        self.engine.admit(payload.get("priority", 0))
        self.engine.end()
        data = []
        for index, text in enumerate(texts):
            vector = _embedding(text, self.opts.embedding_width)
            value: list[float] | str = vector
            if form == "base64":
                value = binascii.b2a_base64(array.array("f", vector).tobytes(),
                                            newline=False).decode()
            data.append({"index": index, "object": "embedding", "embedding": value})
        tokens = sum(len(t.encode()) for t in texts)
        return _json(200, {"id": f"embd-standin-{os.getpid()}-{next(self._ids)}",
                           "object": "list", "created": int(time.time()),
                           "model": payload["model"], "data": data,
                           "usage": _usage(tokens, 0)})

    def _pairs(self, payload: dict[str, Any]) -> list[tuple[str, str]] | str:
        """The (query, document) pairs of a score request: text_1/text_2, queries/documents,
        queries/items or data_1/data_2 (pooling/scoring/protocol.py:84-135); one against each,
        or pairwise when both are lists of one length."""
        for first, second in (("queries", "documents"), ("queries", "items"),
                              ("data_1", "data_2"), ("text_1", "text_2")):
            if first in payload and second in payload:
                break
        else:
            return "give text_1 and text_2 (or queries and documents)"
        left, right = _inputs(payload[first]), _inputs(payload[second])
        if isinstance(left, str) or isinstance(right, str):
            return f"{first} and {second}: a string or a list of strings"
        if len(left) == 1:
            return [(left[0], r) for r in right]
        if len(left) != len(right):
            return f"{first} and {second} must be of one length, or {first} a single input"
        return list(zip(left, right, strict=True))

    def _score(self, req: Request) -> Response:
        """POST /score and /v1/score (pooling/scoring/api_router.py:37, :52): ScoreResponse
        (scoring/protocol.py:178), a score a pair, UsageInfo of the prompt tokens
        (scoring/serving.py:128). The stand-in's score is the cosine of its embeddings (a
        bi-encoder's, serving's "bi-encoder" score type)."""
        payload = self._open(req)
        if isinstance(payload, Response):
            return payload
        pairs = self._pairs(payload)
        if isinstance(pairs, str):
            return _openai_error(400, "BadRequestError", pairs)
        self.engine.admit(payload.get("priority", 0))
        self.engine.end()
        data = [{"index": i, "object": "score", "score": self._similarity(q, d)}
                for i, (q, d) in enumerate(pairs)]
        tokens = sum(len(q.encode()) + len(d.encode()) for q, d in pairs)
        return _json(200, {"id": f"score-standin-{os.getpid()}-{next(self._ids)}",
                           "object": "list", "created": int(time.time()),
                           "model": payload["model"], "data": data, "usage": _usage(tokens, 0)})

    def _rerank(self, req: Request) -> Response:
        """POST /rerank, /v1/rerank, /v2/rerank (pooling/scoring/api_router.py:69-102):
        RerankResponse (scoring/protocol.py:165) with the documents sorted by relevance, the
        first top_n when given (serving.py:175-186), RerankUsage (:160)."""
        payload = self._open(req)
        if isinstance(payload, Response):
            return payload
        query, documents = payload.get("query"), _inputs(payload.get("documents"))
        top_n = payload.get("top_n", 0)
        if not isinstance(query, str) or isinstance(documents, str):
            return _openai_error(400, "BadRequestError",
                                 "query: a string; documents: a list of strings")
        if not isinstance(top_n, int) or top_n < 0:
            return _openai_error(400, "BadRequestError", "top_n must be an integer >= 0")
        self.engine.admit(payload.get("priority", 0))
        self.engine.end()
        results = sorted(({"index": i, "document": {"text": d, "multi_modal": None},
                           "relevance_score": self._similarity(query, d)}
                          for i, d in enumerate(documents)),
                         key=lambda r: -float(r["relevance_score"]))  # type: ignore[arg-type]
        tokens = sum(len(query.encode()) + len(d.encode()) for d in documents)
        return _json(200, {"id": f"rerank-standin-{os.getpid()}-{next(self._ids)}",
                           "model": payload["model"],
                           "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                           "results": results[:top_n] if top_n else results})

    def _similarity(self, a: str, b: str) -> float:
        width = self.opts.embedding_width
        return sum(x * y for x, y in zip(_embedding(a, width), _embedding(b, width),
                                         strict=True))

    def _transcription(self, req: Request, *, translate: bool = False) -> Response:
        """POST /v1/audio/transcriptions and /translations
        (speech_to_text/transcription/api_router.py:31): a multipart form with `file` and
        `model`; files over VLLM_MAX_AUDIO_CLIP_FILESIZE_MB (25, vllm/envs.py:83) refused
        (speech_to_text/base/utils.py:45); TranscriptionResponse `text` and `usage` {"type":
        "duration", "seconds": the audio's length rounded up} (transcription/protocol.py:331,
        base/serving.py:642-646); a translation has no usage (:688). The stand-in reads the
        length of a WAV file only (its header); other formats are refused, saying so."""
        if self.health().status != 200:
            return _openai_error(503, "ServiceUnavailableError", "the stand-in is not ready")
        form = _multipart(req.headers.get("content-type", ""), req.body)
        if isinstance(form, str):
            return _openai_error(400, "BadRequestError", form)
        model = form.get("model", self.opts.served_model_names[0].encode()).decode()
        if model not in self.opts.served_model_names:
            return _openai_error(404, "NotFoundError", f"The model `{model}` does not exist.")
        audio = form.get("file")
        if audio is None:
            return _openai_error(400, "BadRequestError", "the form has no file")
        if len(audio) > 25 * MIB:
            return _openai_error(400, "BadRequestError", "Maximum file size exceeded "
                                 f"(parameter=audio_filesize_mb, value={len(audio) / MIB})")
        seconds = _wav_seconds(audio)
        if seconds is None:
            return _openai_error(400, "BadRequestError",
                                 "the stand-in reads WAV files only (RIFF/WAVE, PCM)")
        self.engine.admit()
        self.engine.end()
        text = f"[{PROGRAM} heard {seconds:.2f} s of audio]"
        if form.get("response_format", b"json") == b"text":
            return Response(200, text.encode(), content_type="text/plain; charset=utf-8")
        if translate:
            return _json(200, {"text": text})
        return _json(200, {"text": text,
                           "usage": {"type": "duration", "seconds": math.ceil(seconds)}})


class Prompt(NamedTuple):
    """A request's prompt as the stand-in's model reads it: its text (as tokenized), its
    token count (a token per UTF-8 byte, IMAGE_TOKENS an image) and its last text (echoed)."""

    text: str
    tokens: int
    last: str


# What an image costs in the prompt (a figure, not any vision encoder's: vLLM's depends on
# the model and the image's size; the seed's OCR page was 1234 tokens).
IMAGE_TOKENS: Final = 256
IMAGE_PLACEHOLDER: Final = "<image>"


def _max_tokens(payload: dict[str, Any], name: str, *, required: bool = False) -> int | None:
    count = payload.get(name)
    if count is None and not required:
        return 16
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        return None
    return count


def _completion_prompt(payload: dict[str, Any]) -> Prompt | str:
    prompt = payload.get("prompt", "")
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt else ""
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return Prompt("", len(prompt), json.dumps(prompt))
    if not isinstance(prompt, str):
        return "prompt: a string, strings or token ids"
    return Prompt(prompt, len(prompt.encode()), prompt)


def _image_ok(url: Any) -> bool:
    """A data URL's base64 decodes (vLLM decodes the image; an http URL it would fetch: the
    stand-in takes it as it is)."""
    if not isinstance(url, str):
        return False
    if not url.startswith("data:"):
        return True
    _, _, data = url.partition(",")
    try:
        binascii.a2b_base64(data, strict_mode=True)
    except binascii.Error:
        return False
    return True


def _chat_prompt(messages: Any, *, generation: bool = True) -> Prompt | str:
    """Chat messages through the stand-in's chat template (`role: content` lines, then
    `assistant:`); content a string or parts: text, image_url (a data URL's base64 checked),
    input_text/input_image (the Responses API's)."""
    if not isinstance(messages, list) or not messages:
        return "messages: a non-empty list of messages"
    lines, images, last = [], 0, ""
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return "each message is an object with a role"
        content = message.get("content", "")
        if isinstance(content, str):
            text = content
        elif isinstance(content, list):
            pieces = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in ("text", "input_text", "output_text"):
                    pieces.append(str(part.get("text", "")))
                elif kind == "image_url":
                    image = part.get("image_url")
                    if not _image_ok(image.get("url") if isinstance(image, dict) else image):
                        return "image_url: the image's data URL is not valid base64"
                    pieces.append(IMAGE_PLACEHOLDER)
                    images += 1
                elif kind == "input_image":
                    if not _image_ok(part.get("image_url")):
                        return "input_image: the image's data URL is not valid base64"
                    pieces.append(IMAGE_PLACEHOLDER)
                    images += 1
                else:
                    return f"a content part of type {kind!r} is not read by the stand-in"
            text = " ".join(pieces)
        else:
            return "content: a string or a list of parts"
        lines.append(f"{message['role']}: {text}\n")
        last = text
    rendered = "".join(lines) + ("assistant:" if generation else "")
    tokens = len(rendered.encode()) + images * (IMAGE_TOKENS - len(IMAGE_PLACEHOLDER))
    return Prompt(rendered, tokens, last)


def _anthropic_prompt(payload: dict[str, Any]) -> Prompt | str:
    """An Anthropic request's system and messages as chat messages (vLLM converts them to a
    chat completion request: anthropic/serving.py), image blocks as images."""
    messages: list[dict[str, Any]] = []
    system = payload.get("system")
    if isinstance(system, list):
        system = " ".join(str(b.get("text", "")) for b in system if isinstance(b, dict))
    if isinstance(system, str):
        messages.append({"role": "system", "content": system})
    for message in payload.get("messages") or []:
        if not isinstance(message, dict):
            return "each message is an object with a role"
        content = message.get("content", "")
        if isinstance(content, list):
            parts: list[dict[str, Any]] = []
            for block in content:
                kind = block.get("type") if isinstance(block, dict) else None
                if kind == "text":
                    parts.append({"type": "text", "text": block.get("text", "")})
                elif kind == "image":
                    source = block.get("source") or {}
                    url = (f"data:{source.get('media_type')};base64,{source.get('data')}"
                           if source.get("type") == "base64" else source.get("url"))
                    parts.append({"type": "image_url", "image_url": {"url": url}})
                else:
                    return f"a content block of type {kind!r} is not read by the stand-in"
            content = parts
        messages.append({"role": message.get("role"), "content": content})
    return _chat_prompt(messages)


def _inputs(value: Any) -> list[str] | str:
    """The texts of an embedding or score input: a string, strings, token ids (read as the
    stand-in's byte tokens) or lists of them; else what is wrong."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= 255 for t in value):
            return [bytes(value).decode("utf-8", "replace")]
        texts = []
        for item in value:
            one = _inputs(item)
            if isinstance(one, str) or len(one) != 1:
                return "input: a string, a list of strings, or token ids"
            texts.append(one[0])
        return texts
    return "input: a string, a list of strings, or token ids"


def _embedding(text: str, width: int) -> list[float]:
    """The stand-in's embedding of a text: a unit vector drawn from its CRC-32 (one text, one
    vector; two texts' cosine is their score), normalized as vLLM's embed pooler normalizes
    (pooling_params.py: use_activation True for embed)."""
    seed = zlib.crc32(text.encode()) + 1
    raw = [math.sin(seed * (i + 1) * 0.6180339887) for i in range(width)]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [x / norm for x in raw]


def _usage(prompt: int, completion: int) -> dict[str, Any]:
    # UsageInfo (serve/engine/protocol.py:135), dumped whole by vLLM's JSONResponse
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion, "prompt_tokens_details": None}


def _multipart(content_type: str, body: bytes) -> dict[str, bytes] | str:
    """A multipart/form-data body's fields by name (the last of a name), or what is wrong."""
    kind, _, params = content_type.partition(";")
    if kind.strip().lower() != "multipart/form-data":
        return "the body must be multipart/form-data"
    boundary = ""
    for param in params.split(";"):
        key, _, value = param.strip().partition("=")
        if key.lower() == "boundary":
            boundary = value.strip('"')
    if not boundary:
        return "multipart/form-data without a boundary"
    fields: dict[str, bytes] = {}
    for part in body.split(b"--" + boundary.encode())[1:]:
        if part.startswith(b"--"):
            break
        head, sep, content = part.partition(b"\r\n\r\n")
        if not sep:
            return "a form part without a blank line after its headers"
        name = None
        for line in head.decode("latin-1").split("\r\n"):
            if line.lower().startswith("content-disposition:"):
                for item in line.split(";")[1:]:
                    key, _, val = item.strip().partition("=")
                    if key == "name":
                        name = val.strip('"')
        if name is not None:
            fields[name] = content.removesuffix(b"\r\n")
    return fields


def _wav_seconds(data: bytes) -> float | None:
    """A RIFF/WAVE file's length in seconds (its data chunk over its byte rate), else None."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    at, rate, size = 12, 0, None
    while at + 8 <= len(data):
        chunk, length = data[at:at + 4], int.from_bytes(data[at + 4:at + 8], "little")
        if chunk == b"fmt " and length >= 12:
            rate = int.from_bytes(data[at + 16:at + 20], "little")
        elif chunk == b"data":
            size = min(length, len(data) - at - 8)
        at += 8 + length + (length & 1)
    if not rate or size is None:
        return None
    return size / rate


def _openai_error(status: int, kind: str, message: str) -> Response:
    # vLLM's ErrorResponse (serve/engine/protocol.py:79-87): {"error": {message, type, param,
    # code}}, made by create_error_response (serve/exception_handling/error_response.py)
    return _json(status, {"error": {"message": message, "type": kind, "param": None,
                                    "code": status}})


def _anthropic_error(status: int, kind: str, message: str) -> Response:
    # anthropic/api_router.py:39-48 translate_error_response: AnthropicErrorResponse
    # (anthropic/protocol.py:24)
    return _json(status, {"type": "error", "error": {"type": kind, "message": message}})


# ---------------------------------------------------------------------------------------------
# The engine child: holds the draw, logs vLLM's memory lines, says when it is ready.


def dev_mode(env: Mapping[str, str]) -> bool:
    try:
        return bool(int(env.get(DEV_MODE_ENV, "0") or "0"))
    except ValueError:
        return False


class _EngineChild:
    """vLLM's memory sits in its engine-core child (VLLM::EngineCore): gpud must attribute by
    cgroup, not PID.

    Two pipes: the parent's commands (a byte each: ``1``/``2``/``0`` sleep at that level, ``w``
    wake, ``x`` die) reach the child's stdin-like read end, whose only write end the parent
    holds, so when the parent dies by any signal, SIGKILL included, the child sees EOF,
    unregisters and exits (no PR_SET_PDEATHSIG: it fires on the death of the forking *thread*
    and would need ctypes). The child writes ``r`` on the other pipe once "loaded".
    """

    def __init__(self, spec: dict[str, Any]) -> None:
        import subprocess

        cmd_read, self._cmd_write = os.pipe()  # both close-on-exec; passed explicitly
        self.ready_fd, ready_write = os.pipe()
        # argv[0] is the title vLLM's engine process carries (setproctitle). Python finds its
        # own library from argv[0], which no longer names it: PYTHONHOME and PYTHONPATH give the
        # child the parent's library and module path instead.
        env = dict(os.environ, PYTHONHOME=f"{sys.base_prefix}:{sys.base_exec_prefix}",
                   PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        try:
            self.proc = subprocess.Popen(
                [ENGINE_TITLE, "-m", "gpud.testing.standin", DRAW_CHILD_TOKEN, json.dumps(spec),
                 str(cmd_read), str(ready_write)],
                executable=sys.executable,
                pass_fds=(cmd_read, ready_write),
                stdin=subprocess.DEVNULL,
                env=env,
            )
        finally:
            os.close(cmd_read)
            os.close(ready_write)
        self.pid = self.proc.pid
        self.pidfd: int | None = os.pidfd_open(self.pid)
        self.reaped = False

    def send(self, command: bytes) -> None:
        if self._cmd_write >= 0:
            # OSError: the child is gone; its death is seen through the pidfd.
            with contextlib.suppress(OSError):
                os.write(self._cmd_write, command)

    def reap(self) -> int:
        """Collect the exited child (its pidfd was readable); returns its status."""
        code = self.proc.wait()
        self.reaped = True
        self._close_pidfd()
        return code

    def stop(self) -> None:
        if self._cmd_write >= 0:
            os.close(self._cmd_write)  # EOF: the child unregisters and exits
            self._cmd_write = -1
        if not self.reaped:
            import subprocess

            try:
                self.proc.wait(CHILD_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.reaped = True
        self._close_pidfd()
        if self.ready_fd >= 0:
            os.close(self.ready_fd)
            self.ready_fd = -1

    def _close_pidfd(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def _set_comm(title: str) -> None:
    # What setproctitle does besides argv: the kernel's comm (15 bytes kept: VLLM::EngineCor).
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as f:
        f.write(title)


def _engine_log(message: str) -> None:
    # vLLM prefixes what its engine process logs with "(EngineCore pid=N)".
    print(f"(EngineCore pid={os.getpid()}) INFO {message}", file=sys.stdout, flush=True)


def _draw_child_main(args: Sequence[str]) -> int:
    spec = json.loads(args[0])
    cmd_fd, ready_fd = int(args[1]), int(args[2])
    _set_comm(ENGINE_TITLE)
    # Ctrl-C and hangups reach the whole process group: the parent decides, the child follows
    # through EOF on its pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_zero)
    target = sim_target_from_env(os.environ)
    pid = os.getpid()
    draw, asleep = int(spec["draw"]), int(spec["asleep"])
    started = time.monotonic()
    # (when, what): the draw appears during the load; the load ends at startup_delay.
    schedule = sorted([(float(spec["draw_after_s"]), "draw")]
                      + ([] if spec["never_ready"] else [(float(spec["startup_delay_s"]), "ready")])
                      + ([] if spec["dies_after_s"] is None else [(float(spec["dies_after_s"]), "die")]))
    registered = False
    code = 0
    loading = _loading_begin(target, pid, draw)
    try:
        while True:
            now = time.monotonic() - started
            while schedule and schedule[0][0] <= now:
                _, what = schedule.pop(0)
                if what == "draw":
                    registered = _hold(target, pid, draw)
                elif what == "ready":
                    others = _loading_end(loading, profiles=bool(spec.get("profiles")))
                    if others:
                        return _mis_sized(int(spec["kv_cache"]), others)
                    for line in spec["log_lines"]:
                        _engine_log(line)
                    os.write(ready_fd, b"r")
                elif what == "die":
                    print(f"(EngineCore pid={pid}) ERROR simulated engine death "
                          "(--engine-dies-after)", file=sys.stderr, flush=True)
                    return 1
            timeout = max(0.0, schedule[0][0] - now) if schedule else None
            readable, _, _ = select.select([cmd_fd], [], [], timeout)
            if not readable:
                continue
            data = os.read(cmd_fd, 64)
            if not data:
                _log("engine child: parent gone, exiting")
                return code
            for command in data:
                if command in b"12":
                    registered = _hold(target, pid, asleep)
                    said = spec.get("sleep_lines", {}).get(chr(command))
                    if said:
                        _engine_log(said)
                    _engine_log(f"sleep level {chr(command)}: holding {asleep} MiB")
                elif command == ord("k"):
                    # prepared for a checkpoint: the KV cache released (core.py:1008-1010)
                    prepared = max(0, draw - int(spec["kv_cache"]))
                    registered = _hold(target, pid, prepared)
                    _engine_log(f"prepared for a process checkpoint: holding {prepared} MiB")
                elif command == ord("w"):
                    registered = _hold(target, pid, draw)
                    _engine_log(f"woken up: holding {draw} MiB")
                elif command == ord("x"):
                    return 1
    finally:
        _loading_gone(loading)
        if target is not None and registered:
            unregister(target, pid)
    return code


# The hazard of vLLM #55827: an engine sizing its KV cache by profiling (vllm/v1/worker/
# gpu_worker.py, Worker.determine_available_memory: requested memory minus what it measured
# besides the KV cache) counts a neighbour loading on its GPU at the same time as its own, and
# its KV cache shrinks or goes negative; one sized by --kv-cache-memory-bytes skips that
# profiling. Each engine child on a simulated device notes its load window in
# PROCS_DIR/loading/PID.json while it lives (the simulation reads only PID.json files there, not
# this folder); a profiling one whose window met another's on one of its devices fails as vLLM
# fails on a negative figure (vLLM runs on with a KV cache that only shrank: here both fail).
LOADING_DIR: Final = "loading"


class _Loading(NamedTuple):
    path: str
    record: dict[str, Any]


def _loading_begin(target: SimTarget | None, pid: int, draw: int) -> _Loading | None:
    if target is None:
        return None
    folder = os.path.join(target.procs_dir, LOADING_DIR)
    os.makedirs(folder, exist_ok=True)
    loading = _Loading(os.path.join(folder, f"{pid}.json"),
                       {"pid": pid, "devices": [target.device, *target.also], "draw": draw,
                        "start": time.time(), "end": None})
    _write_loading(loading)
    # Whoever is loading there now is disturbed by this load even if this one is gone when it
    # looks (a failed neighbour exits at once): said in PID.disturbed, which it reads.
    for other in _others(loading):
        if other.get("end") is None and _alive(int(other.get("pid", 0))) \
                and set(other.get("devices", ())) & set(loading.record["devices"]):
            # ... and this one by it, even if it is gone by the end of this load
            with contextlib.suppress(OSError), open(_disturbed(loading), "a") as f:
                f.write(f"{other['pid']} {other.get('draw', 0)}\n")
            with contextlib.suppress(OSError), \
                    open(os.path.join(folder, f"{other['pid']}.disturbed"), "a") as f:
                f.write(f"{pid} {draw}\n")
    return loading


def _others(loading: _Loading) -> list[dict[str, Any]]:
    folder = os.path.dirname(loading.path)
    found: list[dict[str, Any]] = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".json") or name == os.path.basename(loading.path):
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                found.append(json.load(f))
        except (OSError, ValueError):
            continue  # gone meanwhile
    return found


def _write_loading(loading: _Loading) -> None:
    tmp = f"{loading.path}.tmp"
    with open(tmp, "w") as f:
        json.dump(loading.record, f)
    os.replace(tmp, loading.path)


def _loading_end(loading: _Loading | None, *, profiles: bool) -> list[dict[str, Any]]:
    """Close the load window; for a profiling engine, the neighbours whose windows met it."""
    if loading is None or loading.record["end"] is not None:
        return []
    loading.record["end"] = time.time()
    _write_loading(loading)
    if not profiles:
        return []
    found = [o for o in _others(loading)
             if profile_overlaps(loading.record, o, alive=_alive(int(o.get("pid", 0))))]
    seen = {int(o.get("pid", 0)) for o in found}
    with contextlib.suppress(OSError), open(_disturbed(loading)) as f:
        for line in f:
            pid, draw = (int(x) for x in line.split())
            if pid not in seen:
                seen.add(pid)
                found.append({"pid": pid, "draw": draw})
    return found


def _disturbed(loading: _Loading) -> str:
    return loading.path.removesuffix(".json") + ".disturbed"


def _loading_gone(loading: _Loading | None) -> None:
    """The engine exits: its note goes, and the folder with the last one."""
    if loading is None:
        return
    for path in (loading.path, _disturbed(loading)):
        with contextlib.suppress(OSError):
            os.unlink(path)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(loading.path))


def profile_overlaps(mine: dict[str, Any], other: dict[str, Any], *, alive: bool) -> bool:
    """Whether `other`'s load window met `mine` on a device of both (an open window counts
    while its process lives)."""
    if not set(mine["devices"]) & set(other.get("devices", ())):
        return False
    end = other.get("end")
    if end is None and not alive:
        return False
    return bool(other["start"] <= mine["end"] and (end is None or end >= mine["start"]))


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _mis_sized(kv_mib: int, others: list[dict[str, Any]]) -> int:
    """Fail as vLLM does when its profiled KV cache is negative (vllm/v1/core/kv_cache_utils.py,
    check_enough_kv_cache_memory)."""
    kv = kv_mib - sum(int(o.get("draw", 0)) for o in others)
    _engine_log(f"Available KV cache memory: {kv / 1024:.2f} GiB")
    pids = ", ".join(str(o.get("pid")) for o in others)
    print(f"(EngineCore pid={os.getpid()}) ERROR ValueError: No available memory for the cache "
          "blocks. Try increasing `gpu_memory_utilization` when initializing the engine. "
          f"(STAND-IN: profiled while {pids} loaded on its device: vLLM #55827)",
          file=sys.stderr, flush=True)
    return 1


def _hold(target: SimTarget | None, pid: int, mib: int) -> bool:
    if target is None:
        _engine_log(f"holding {mib} MiB (simulation env unset: not registered)")
        return False
    path = register(target, pid, mib)
    _engine_log(f"registered {mib} MiB at {path}")
    return True


def _exit_zero(_signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(0)


# ---------------------------------------------------------------------------------------------
# The main process.


def _echo_payload(args: Sequence[str]) -> dict[str, Any]:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            raw = f.read()
        cmdline: list[str] | None = [os.fsdecode(a) for a in raw.split(b"\0")[:-1]]
    except OSError:
        cmdline = None
    return {
        "pid": os.getpid(),
        "argv": [sys.argv[0], *args],
        "cmdline": cmdline,
        "env": {name: os.environ.get(name) for name in ECHO_ENV},
        "visible_devices": visible_devices(os.environ),
    }


class _Signals:
    """Signals become a queue drained by the main loop, woken through set_wakeup_fd.

    The handler only appends: it never takes a lock (an ``Event.set`` from a handler can
    deadlock against the interrupted main thread) and never raises into cleanup code.
    """

    def __init__(self) -> None:
        self.pending: collections.deque[int] = collections.deque()
        self.read_fd, write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.pending.append(signum)

    def drain_wakeups(self) -> None:
        try:
            while os.read(self.read_fd, 512):
                pass
        except BlockingIOError:
            pass


def _bind(opts: Options, app: App) -> _Server | _UnixServer:
    if opts.uds is not None:
        return _UnixServer(opts.uds, app)
    cls = _Server6 if ":" in opts.host else _Server
    return cls((opts.host, opts.port), app)


def _load_model(message: str) -> None:
    """--raise-at-start: a load that fails as a Python exception, uncaught."""
    raise RuntimeError(message)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)
    if args[:1] == [DRAW_CHILD_TOKEN]:
        return _draw_child_main(args[1:])

    opts = parse_args(args)
    if opts.gpu_memory_utilization == 0:
        # vllm/config/cache.py: gpu_memory_utilization Field(gt=0, le=1), checked when vLLM
        # builds its config (a pydantic ValidationError, exit status 1).
        print(f"{PROGRAM}: gpu_memory_utilization: Input should be greater than 0 "
              "[type=greater_than, input_value=0.0]", file=sys.stderr)
        return 1
    try:
        total_mib = sim_total_from_env(os.environ)
    except ValueError as exc:
        print(f"{PROGRAM}: bad {GPUD_SIM_TOTAL_MIB}: {exc}", file=sys.stderr)
        return 2
    plan = memory_plan(opts, total_mib)
    target = sim_target_from_env(os.environ)
    _log(
        f"{PROGRAM} {VERSION}: a STAND-IN for a vLLM OpenAI server (no model, no GPU); "
        f"model={opts.model!r} served={list(opts.served_model_names)} "
        f"host={opts.host} port={opts.port} "
        f"gpu_memory_utilization={float(opts.gpu_memory_utilization)} "
        f"draw={plan.draw} MiB (total {total_mib} MiB, context {plan.context} MiB, overdraw "
        f"{float(opts.overdraw_pct)}%) registration={'off' if target is None else target.procs_dir}"
    )
    if opts.vllm_args:
        _log(f"vLLM options accepted and ignored: {json.dumps(list(opts.vllm_args))}")
    if target is None and (os.environ.get(GPUD_SIM_PROCS_DIR) or os.environ.get(GPUD_SIM_DEVICE)):
        _warn(f"set both {GPUD_SIM_PROCS_DIR} and {GPUD_SIM_DEVICE} to register the draw")
    echo = _echo_payload(args) if opts.echo_argv else None
    if echo is not None:
        _log(f"argv-echo {json.dumps(echo)}")
    if opts.crash_after_s == 0:
        print(f"{PROGRAM}: simulated crash at start, exit code {opts.exit_code}", file=sys.stderr)
        return opts.exit_code
    if opts.raise_at_start is not None:
        _load_model(opts.raise_at_start)  # raises: the interpreter prints the traceback

    app = App(opts, draw_mib=plan.draw, echo=echo)
    try:
        server = _bind(opts, app)
    except OSError as exc:
        print(f"{PROGRAM}: cannot listen on {opts.host}:{opts.port}: {exc}", file=sys.stderr)
        return 1
    process = _MainProcess(opts, app, server, plan, total_mib)
    try:
        return process.run()
    finally:
        process.cleanup()


class _MainProcess:
    """The main thread: the engine child, listening once it is ready, signals, the crash and
    the engine's death."""

    def __init__(self, opts: Options, app: App, server: _Server | _UnixServer, plan: MemoryPlan,
                 total_mib: int) -> None:
        self.opts = opts
        self.app = app
        self.server = server
        self.plan = plan
        self.total_mib = total_mib
        self.signals = _Signals()
        self.child: _EngineChild | None = None
        self.listening = False

    def _start_engine(self) -> None:
        opts, plan = self.opts, self.plan
        spec = {
            "draw": plan.draw,
            "asleep": plan.context if opts.asleep_mib is None else opts.asleep_mib,
            "draw_after_s": min(opts.draw_after_s, opts.startup_delay_s)
            if not opts.never_healthy else opts.draw_after_s,
            "startup_delay_s": opts.startup_delay_s,
            "never_ready": opts.never_healthy,
            "dies_after_s": opts.engine_dies_after_s,
            "log_lines": memory_log_lines(plan, opts, self.total_mib, opts.startup_delay_s),
            # Sized by profiling (no --kv-cache-memory-bytes): a neighbour loading meanwhile
            # mis-sizes it (see _profile_overlaps).
            "profiles": opts.kv_cache_memory_bytes is None and opts.draw_mib is None,
            "kv_cache": plan.kv_cache,
            "sleep_lines": {str(level): line for level in (1, 2)
                            if (line := sleep_log_line(plan, opts, level)) is not None},
        }
        self.child = _EngineChild(spec)
        self.app.draw_pid = self.child.pid
        target = sim_target_from_env(os.environ)
        if target is not None:
            self.app.registration = os.path.join(target.procs_dir, f"{self.child.pid}.json")
        child = self.child
        self.app.on_sleep = lambda level: child.send(b"w" if level is None else
                                                     (b"0" if level == 0 else str(level).encode()))
        self.app.on_checkpoint = lambda prepared: child.send(b"k" if prepared else b"w")
        _log(f"engine {ENGINE_TITLE} pid {child.pid}: loading, draw {plan.draw} MiB")

    def _listen(self) -> None:
        self.server.server_activate()
        # serve_forever wakes every poll_interval only to look for a shutdown request; none
        # comes (the process exits under the daemon thread), so a long interval keeps idle CPU
        # at zero.
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 3600.0},
                         daemon=True).start()
        self.listening = True
        # vllm/entrypoints/launchers/api_server/entry.py: "Starting vLLM server on %s"
        # (listen_address: f"unix:{args.uds}" with --uds)
        if isinstance(self.server, _UnixServer):
            _log(f"Starting vLLM server on unix:{self.server.server_address} (stand-in)")
        else:
            host, port = self.server.socket.getsockname()[:2]
            url_host = f"[{host}]" if ":" in host else host
            _log(f"Starting vLLM server on http://{url_host}:{port} (stand-in)")
        _log("loading done: /health answers 200")

    def run(self) -> int:
        opts = self.opts
        self._start_engine()
        schedule: list[tuple[float, str]] = []
        if opts.unhealthy_after_s is not None:
            schedule.append((opts.unhealthy_after_s, "unhealthy"))
        if opts.crash_after_s is not None:
            schedule.append((opts.crash_after_s, "crash"))
        schedule.sort(key=lambda item: item[0])
        exit_at: float | None = None
        while True:
            while self.signals.pending:
                signum = self.signals.pending.popleft()
                if signum == signal.SIGTERM and opts.ignore_sigterm:
                    _warn("SIGTERM received and ignored (--ignore-sigterm)")
                    continue
                _log(f"{signal.Signals(signum).name} received: [shutdown] API server: shutdown "
                     "triggered; stopping the engine")
                return 0
            now = self.app.elapsed()
            if exit_at is not None and now >= exit_at:
                # vllm/entrypoints/launchers/launcher.py terminate_if_errored: the watchdog
                # sets uvicorn's should_exit, and the server shuts down cleanly: status 0
                # (seen on real vLLM). Restart=on-failure takes that for a clean exit.
                _warn("engine dead: the API server exits (status 0)")
                return 0
            while schedule and schedule[0][0] <= now:
                _, what = schedule.pop(0)
                if what == "unhealthy":
                    _warn("turning unhealthy: /health answers 503 (--unhealthy-after)")
                elif what == "crash":
                    print(
                        f"{PROGRAM}: simulated crash after {opts.crash_after_s}s, exit code {opts.exit_code}",
                        file=sys.stderr,
                        flush=True,
                    )
                    return opts.exit_code
            child = self.child
            fds = [self.signals.read_fd]
            if child is not None and child.pidfd is not None:
                fds.append(child.pidfd)
            if child is not None and child.ready_fd >= 0 and not self.listening:
                fds.append(child.ready_fd)
            deadlines = [t for t, _ in schedule[:1]] + ([exit_at] if exit_at is not None else [])
            timeout = max(0.0, min(deadlines) - self.app.elapsed()) if deadlines else None
            ready, _, _ = select.select(fds, [], [], timeout)
            if self.signals.read_fd in ready:
                self.signals.drain_wakeups()
            if child is not None and child.ready_fd in ready and not self.listening:
                if os.read(child.ready_fd, 1):
                    self._listen()
                else:  # EOF: the child died before it was ready (seen through its pidfd)
                    os.close(child.ready_fd)
                    child.ready_fd = -1
            if child is not None and child.pidfd is not None and child.pidfd in ready:
                status = child.reap()
                self.app.draw_pid = None
                self.app.registration = None
                self._unregister_if_present(child.pid)
                if not self.listening:
                    # vLLM: "Engine core initialization failed", and the server never starts
                    print(f"{PROGRAM}: engine core initialization failed (status {status})",
                          file=sys.stderr, flush=True)
                    return 1
                self.app.engine_dead = True
                exit_at = self.app.elapsed() + opts.exit_after_engine_death_s
                _warn(f"engine {child.pid} died (status {status}): /health answers 503; exiting "
                      f"in {opts.exit_after_engine_death_s:g} s")

    def cleanup(self) -> None:
        if self.child is not None:
            self.child.stop()
            # The child removes its own file; this covers a child that was killed.
            self._unregister_if_present(self.child.pid)
        self.app.registration = None
        self.server.server_close()

    def _unregister_if_present(self, pid: int) -> None:
        # Checked first so that a process that never registered exits without importing
        # gpud.host.simulation.
        target = sim_target_from_env(os.environ)
        if target is not None and os.path.exists(os.path.join(target.procs_dir, f"{pid}.json")):
            unregister(target, pid)
        if target is not None:  # a killed engine's note of its load window
            _loading_gone(_Loading(os.path.join(target.procs_dir, LOADING_DIR, f"{pid}.json"), {}))


if __name__ == "__main__":
    sys.exit(main())
