"""What changes with the vLLM release the serves run (`daemon.vllm_version`): chosen here, in one
place, as data. Pure.

gpud knows two releases exactly, each checked in its own source (paths under `vllm/`; 0.34.0's
line numbers are those of the vllm-0.34.0 wheel on PyPI):

- **0.33.0**: the KV cache is profiled before the engine serves; at start vLLM refuses when free
  memory is below ceil(util x total). Level 1 parks the weights in host RAM, level 2 parks
  nothing. No checkpoint routes.
- **0.34.0**:
  - The extensible KV cache is on by default on CUDA (`config/vllm.py:3180-3269`,
    `_resolve_extensible_kv_cache`): sized after warm-up from the memory measured then
    (`v1/worker/extensible_kv_cache.py:592-618`), and the start check is skipped
    (`v1/worker/utils.py:783-797`: `free < requested and not enable_extensible_kv_cache`).
    gpud passes `--no-enable-extensible-kv-cache` (`EXTENSIBLE_KV_OFF`) so that 0.33's start
    check, KV profiling and `--kv-cache-memory` recommendation hold: docs/vllm.md gives the
    arithmetic and why. The flag is a BooleanOptionalAction (`engine/arg_utils.py`;
    the 0.34.0 flag table lists `--enable-extensible-kv-cache`/`--disable-...`) and a requested
    False never raises (`config/vllm.py:3262-3263` raise only for a requested True).
  - `/checkpoint/prepare|restore|status` are registered on every serve with sleep mode
    (`entrypoints/launchers/api_server/routers.py:68-73`; `entrypoints/serve/checkpoint/
    api_router.py:39,60,80`), outside dev mode and `--api-key`. A prepared engine pauses its
    scheduler, so `/is_sleeping` says true (`v1/engine/core.py:1202-1204`), drops its KV cache
    (`core.py:1008-1010`), and refuses `/sleep` (`core.py:1110`) and `/wake_up` (`core.py:1153`)
    until `/checkpoint/restore`. `--checkpoint-prepare-on-startup` (`config/model.py:405`,
    `core.py:1455`) starts a serve that answers nothing until restored.
  - Both sleep levels go through `CuMemBackend.suspend` with the tags weights, runtime and
    cudagraph offloaded (`device_allocator/sleep_mode_backend.py:126-132`); level 2 discards only
    allocations holding nothing but parameters (`v1/worker/gpu_worker.py:297-318, 320-328`), so
    it still parks the CUDA graph pool and every other allocation in host RAM
    (`device_allocator/cumem.py:261-306`), and it discards a draft model's weights unless
    `--sleep-preserve-parameter-names 'draft.*'` keeps them (`gpu_worker.py:309-317`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

V033 = "0.33.0"
V034 = "0.34.0"
# The release `daemon.vllm_version` names when the config does not (gpud.core.config.DaemonConfig,
# gpud.vllm.vllm_flags, gpud.core.launch take it from here).
DEFAULT_VERSION = V033

# The 0.34 option gpud adds to every vllm serve, and the spellings of the option it overrides.
EXTENSIBLE_KV_OFF = "--no-enable-extensible-kv-cache"
EXTENSIBLE_KV_OPTIONS = ("--enable-extensible-kv-cache", "--disable-extensible-kv-cache",
                         "--no-enable-extensible-kv-cache")
CHECKPOINT_ROUTES = ("/checkpoint/prepare", "/checkpoint/restore", "/checkpoint/status")
PREPARE_ON_STARTUP = "--checkpoint-prepare-on-startup"
# vllm/config/load.py:40 and model_executor/model_loader/__init__.py:39,56 (0.33 and 0.34).
IPC_CACHE = "ipc_cache"
# What keeps a draft model's weights through a level-2 sleep (gpu_worker.py:313-317 of 0.34.0).
DRAFT_PRESERVE = "draft.*"


GIB = 1 << 30


@dataclass(frozen=True)
class KvRules:
    """How a release sizes its KV cache on CUDA, as data (gpud.core.sizing applies it). The
    arithmetic itself is the same text in 0.32.0, 0.33.0 and 0.34.0 (paths under `vllm/`; 0.32's
    `v1/core/kv_cache_utils.py` became `v1/core/kv_cache_planning.py` in 0.33):

    - a layer's page is block_tokens x 2 x KV heads x head_dim x the cache dtype's bytes (MLA: one
      latent of kv_lora_rank + qk_rope_head_dim) (`v1/kv_cache_interface.py` AttentionSpec.
      page_size_bytes);
    - layers of one kind share a group; a hybrid model's kinds are split into groups of equal
      size (the smaller kind's count, or the larger's when it is under 1.5 times it), padded
      (`_get_kv_cache_groups_uniform_page_size`); a block spans one group's layers, and the
      cache holds available // bytes_per_block blocks (`get_kv_cache_config_from_groups`);
    - one request of max_model_len takes cdiv(max_model_len, block) blocks in a full-attention
      group and cdiv(min(window - 1 + in-flight tokens, max_model_len), block) + 1 in a sliding
      one (`SlidingWindowSpec.max_admission_blocks_per_request`), in-flight tokens being
      max_concurrent_batches x max_num_batched_tokens (`config/vllm.py`
      max_in_flight_tokens: 2 batches with async scheduling, on by default for generation
      models on CUDA);
    - vLLM logs `KV cache size: N tokens` with N = int(blocks / blocks per request x
      max_model_len), the null block counted in (`get_kv_cache_capacity`,
      `update_kv_cache_capacity`), and refuses to start unless blocks - 1 hold one request
      (`check_enough_kv_cache_memory`: "Reserve the null block").
    - its budget for the KV cache is util x total less the weights, the profile run's peak and
      non-torch memory, and its own CUDA-graph estimate (`v1/worker/gpu_worker.py`
      determine_available_memory: `available_kv_cache_memory_bytes`; VLLM_MEMORY_PROFILER_
      ESTIMATE_CUDAGRAPHS on by default in all three).
    """

    # CacheConfig.DEFAULT_BLOCK_SIZE (vllm/config/cache.py): 16 up to 0.33, 64 in 0.34
    block_tokens: int
    # max_concurrent_batches with async scheduling (config/vllm.py): 2 with one pipeline stage
    in_flight_batches: int
    # the API server's max_num_batched_tokens and max_num_seqs on a device under 70 GiB, and on
    # one of 70 GiB and more (not an A100) (engine/arg_utils.py get_batch_defaults)
    batched_tokens: tuple[int, int]
    max_num_seqs: tuple[int, int]
    # the largest CUDA graph captured: min(2 x max_num_seqs, 512) tokens
    # (config/vllm.py _set_cudagraph_sizes)
    max_graph_tokens: int
    # 0.34's extensible KV cache, when on, sizes the cache after warm-up: min(budget - what is
    # used, device headroom - max(1 GiB, 0.75 x the transient peak)) less the transient peak
    # (v1/worker/extensible_kv_cache.py:64-65 KV_CACHE_MARGIN_FLOOR_BYTES / _FRACTION, 592-618
    # measure_kv_cache_bytes): (floor, fraction) of that headroom margin; None where the release
    # has none. gpud turns it off (extensible_kv_off_arg).
    extensible_margin: tuple[int, float] | None
    # where each figure was read (gpuctl size --json carries it as rules_source)
    source: str

    def batch_defaults(self, device_mib: int | None) -> tuple[int, int]:
        """(max_num_batched_tokens, max_num_seqs) of the API server on a device of that size
        (under 70 GiB when unknown)."""
        big = device_mib is not None and device_mib >= 70 * 1024
        return self.batched_tokens[big], self.max_num_seqs[big]

    def extensible_margin_bytes(self, transient_peak_bytes: int) -> int | None:
        """The device headroom the extensible cache keeps free: max(floor, fraction x the
        transient peak); None without one."""
        if self.extensible_margin is None:
            return None
        floor, share = self.extensible_margin
        return max(floor, int(share * transient_peak_bytes))


KV_033 = KvRules(block_tokens=16, in_flight_batches=2, batched_tokens=(2048, 8192),
                 max_num_seqs=(256, 1024), max_graph_tokens=512, extensible_margin=None,
                 source="vLLM 0.33.0: config/cache.py:185 DEFAULT_BLOCK_SIZE 16; config/vllm.py"
                        ":588-598 max_concurrent_batches, :1719 async scheduling on (__post_init__), "
                        ":2453-2470 _set_cudagraph_sizes; engine/"
                        "arg_utils.py:2973-3005 get_batch_defaults; v1/core/kv_cache_planning.py;"
                        " v1/worker/gpu_worker.py:707-756")
KV_034 = KvRules(block_tokens=64, in_flight_batches=2, batched_tokens=(2048, 8192),
                 max_num_seqs=(256, 1024), max_graph_tokens=512,
                 extensible_margin=(GIB, 0.75),
                 source="vLLM 0.34.0: config/cache.py:185 DEFAULT_BLOCK_SIZE 64; config/vllm.py"
                        ":560-566 max_concurrent_batches, :1637 async scheduling on; engine/"
                        "arg_utils.py:3010-3042 get_batch_defaults; v1/core/kv_cache_planning.py;"
                        " v1/worker/gpu_worker.py:742-779; v1/worker/extensible_kv_cache.py:"
                        "64-65, 592-618")


@dataclass(frozen=True)
class VllmBehaviour:
    version: str
    # how it sizes the KV cache
    kv: KvRules
    # gpud adds EXTENSIBLE_KV_OFF to the argv (0.34: the extensible cache would otherwise be on)
    extensible_kv_off_arg: bool
    # /checkpoint/* exist on a sleep-mode serve
    checkpoint_routes: bool
    # a level-2 sleep parks non-parameter allocations (CUDA graphs...) in host RAM
    level2_parks_host: bool
    # a level-2 sleep discards a draft model's weights that reload_weights does not restore
    level2_drops_draft: bool
    # None: these are the release's own rules; else the known release whose rules it borrows
    # (a release gpud has no rules of its own for: `behaviour`)
    rules_from: str | None = None

    def parked_host_mib(self, level: int, *, weights_mib: int | None,
                        cudagraph_mib: int | None) -> int | None:
        """Host RAM a sleep at `level` parks, from the serve's calibrated figures (vLLM's own
        log lines); None when a figure it needs is unknown. Level 1 parks the weights (and on
        0.34 the CUDA graph pool: every allocation tagged weights, runtime or cudagraph is
        offloaded); level 2 parks nothing on 0.33 and, on 0.34, all but the parameters: the
        CUDA graph pool is its measurable part (runtime allocations, which vLLM logs no figure
        for, are what the margin `daemon.sleep_host_margin_mib` stands for)."""
        if level <= 0:
            return 0
        if level == 1:
            if weights_mib is None:
                return None
            if not self.level2_parks_host:
                return weights_mib
            return weights_mib + (cudagraph_mib or 0)
        if not self.level2_parks_host:
            return 0
        return cudagraph_mib


BEHAVIOURS: Mapping[str, VllmBehaviour] = MappingProxyType({
    V033: VllmBehaviour(V033, KV_033, extensible_kv_off_arg=False, checkpoint_routes=False,
                        level2_parks_host=False, level2_drops_draft=False),
    V034: VllmBehaviour(V034, KV_034, extensible_kv_off_arg=True, checkpoint_routes=True,
                        level2_parks_host=True, level2_drops_draft=True),
})
# A vLLM version as its releases are numbered (0.33.0, 0.34.1, 0.35.0rc1, 0.35.0+cpu): numbers
# first, then a suffix; nothing that could name another path (the flag tables' file names
# carry it).
VERSION_RE = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?(?:[.+-]?[0-9A-Za-z]+(?:[.+][0-9A-Za-z]+)*)?")
# The first release with the extensible KV cache (and so --enable-extensible-kv-cache) and the
# /checkpoint/* routes: 0.33.0's flag table has neither option, 0.34.0's both.
EXTENSIBLE_SINCE = (0, 34)


def version_key(version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a vLLM version, None when it is not one."""
    found = VERSION_RE.fullmatch(version)
    if found is None:
        return None
    return int(found.group(1)), int(found.group(2)), int(found.group(3) or 0)


KNOWN_VERSIONS = tuple(sorted(BEHAVIOURS, key=lambda v: version_key(v) or (0, 0, 0)))
NEWEST_KNOWN = KNOWN_VERSIONS[-1]


def behaviour(version: str) -> VllmBehaviour:
    """The behaviour of `version`: the one lookup of a release's rules. A release gpud has no
    rules of its own for borrows the newest known release's (`rules_from` says which): its KV
    sizing and sleep; only what depends on an option the release may lack follows the release
    itself (before 0.34 there is no extensible KV cache to turn off, and no checkpoint routes),
    and its flag table (gpud.vllm.vllm_flags) checks every argv gpud builds for it. KeyError
    for a string that is not a vLLM version."""
    known = BEHAVIOURS.get(version)
    if known is not None:
        return known
    key = version_key(version)
    if key is None:
        raise KeyError(f"{version!r} is not a vLLM version (like {NEWEST_KNOWN})")
    newest = BEHAVIOURS[NEWEST_KNOWN]
    since = key[:2] >= EXTENSIBLE_SINCE
    return replace(newest, version=version, rules_from=newest.version,
                   extensible_kv_off_arg=newest.extensible_kv_off_arg and since,
                   checkpoint_routes=newest.checkpoint_routes and since)


def borrowed_rules_note(b: VllmBehaviour) -> str | None:
    """What gpud says of a release it has no rules of its own for (--check-config, the
    journal, gpuctl size); None for a release it knows."""
    if b.rules_from is None:
        return None
    return (f"gpud has no sizing rules of vLLM {b.version}'s own: it sizes its KV cache and "
            f"its sleep by vLLM {b.rules_from}'s, the newest it knows (docs/vllm.md)")


_NO_DRAFT_METHODS = ("ngram", "ngram_gpu", "suffix")  # config/speculative.py:90-97, :1833-1837


def _option(arg: str) -> str:
    name = arg.partition("=")[0]
    if name.startswith("--"):
        return "--" + name[2:].partition(".")[0].replace("_", "-")
    return name


def _values(args: tuple[str, ...] | list[str], i: int) -> list[str]:
    """The values given to the option at args[i]: `--opt=v`, or the words after it up to the
    next option."""
    _head, eq, inline = args[i].partition("=")
    if eq:
        return [inline]
    out: list[str] = []
    for arg in args[i + 1:]:
        if arg.startswith("--") or (arg.startswith("-") and len(arg) > 1 and arg[1].isalpha()):
            break
        out.append(arg)
    return out


def _speculative_method(args: tuple[str, ...] | list[str], i: int) -> str | None:
    """The method of a --speculative-config at args[i] (its JSON's "method", or the value of
    --speculative-config.method), None when it does not say."""
    name = args[i].partition("=")[0]
    values = _values(args, i)
    if name.endswith(".method"):
        return values[0] if values else None
    if "." in name[2:]:
        return None
    import json

    try:
        parsed = json.loads(values[0]) if values else None
    except ValueError:
        return None
    method = parsed.get("method") if isinstance(parsed, dict) else None
    return method if isinstance(method, str) else None


def extra_args_problems(args: tuple[str, ...] | list[str], b: VllmBehaviour, *,
                        sleep_level: int) -> list[tuple[int, str]]:
    """What gpud refuses in a vllm serve's extra_args for the release it runs, by index."""
    problems: list[tuple[int, str]] = []
    speculative: list[int] = []
    methods: list[str | None] = []
    preserved: list[str] = []
    for i, arg in enumerate(args):
        option = _option(arg)
        if option == "--load-format" and IPC_CACHE in _values(args, i)[:1]:
            problems.append((i, "--load-format ipc_cache maps weights that `vllm preload` "
                                "holds in a per-GPU daemon outside the serve's unit (vllm/"
                                "model_executor/model_loader/weight_cache/daemon.py): their "
                                "memory would be drawn by a process gpud neither launched nor "
                                "reserved for; load the weights in the serve itself"))
        elif b.extensible_kv_off_arg and option in EXTENSIBLE_KV_OPTIONS:
            problems.append((i, f"{option}: gpud passes {EXTENSIBLE_KV_OFF} on vLLM "
                                f"{b.version}, so that the reservation is checked at start "
                                "and the KV cache profiled (docs/vllm.md, \"vLLM 0.34\")"))
        elif b.checkpoint_routes and option == PREPARE_ON_STARTUP:
            problems.append((i, f"{PREPARE_ON_STARTUP}: the serve would start prepared for a "
                                "process checkpoint and serve nothing until POST "
                                "/checkpoint/restore (vllm/config/model.py:405), while /health "
                                "says it is up; gpud would call it running"))
        elif option in ("--speculative-config", "-sc"):
            speculative.append(i)
            methods.append(_speculative_method(args, i))
        elif option == "--sleep-preserve-parameter-names":
            preserved += _values(args, i)
    drafts = [i for i, m in zip(speculative, methods, strict=True) if m not in _NO_DRAFT_METHODS]
    if (b.level2_drops_draft and sleep_level == 2 and drafts
            and DRAFT_PRESERVE not in preserved):
        problems.append((drafts[0], f"a draft model at sleep_level 2: vLLM {b.version} "
                                    "discards the draft's weights at level 2 and "
                                    "reload_weights restores only the target (vllm/v1/worker/"
                                    "gpu_worker.py:309-317); add --sleep-preserve-parameter-"
                                    f"names '{DRAFT_PRESERVE}' to keep them (they are then "
                                    "parked in host RAM), or use sleep_level 1"))
    return problems
