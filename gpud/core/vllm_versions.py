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

from dataclasses import dataclass

V033 = "0.33.0"
V034 = "0.34.0"

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


@dataclass(frozen=True)
class VllmBehaviour:
    version: str
    # gpud adds EXTENSIBLE_KV_OFF to the argv (0.34: the extensible cache would otherwise be on)
    extensible_kv_off_arg: bool
    # /checkpoint/* exist on a sleep-mode serve
    checkpoint_routes: bool
    # a level-2 sleep parks non-parameter allocations (CUDA graphs...) in host RAM
    level2_parks_host: bool
    # a level-2 sleep discards a draft model's weights that reload_weights does not restore
    level2_drops_draft: bool

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


BEHAVIOURS: dict[str, VllmBehaviour] = {
    V033: VllmBehaviour(V033, extensible_kv_off_arg=False, checkpoint_routes=False,
                        level2_parks_host=False, level2_drops_draft=False),
    V034: VllmBehaviour(V034, extensible_kv_off_arg=True, checkpoint_routes=True,
                        level2_parks_host=True, level2_drops_draft=True),
}


def behaviour(version: str) -> VllmBehaviour:
    """The behaviour of `version`; KeyError naming the versions gpud knows."""
    try:
        return BEHAVIOURS[version]
    except KeyError:
        raise KeyError(f"gpud knows vLLM {', '.join(sorted(BEHAVIOURS))}, not {version!r}") \
            from None


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
