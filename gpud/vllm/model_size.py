"""A vllm serve's needs from its checkpoint on disk, and the config problems they show: a
`vram_mib` below the weights, or below the minimum (weights + the KV cache of one max_model_len
sequence + context). Checked at every config load (gpud.config.parse_config: --check-config,
start, reload, plan, apply). A model not on disk is "unknown until its first start", never an
error.

Where the model is: `vllm.model` as a local directory, or in the Hugging Face cache the serve
itself uses (its environment's HF_HUB_CACHE / HF_HOME, else its identity's: the shared cache of
daemon.serve_user, `/var/cache/gpud-serve/huggingface`, or its own user's ~/.cache), at its pinned
`vllm.revision`. A container serve's model is read inside its container: unknown here.
"""

from __future__ import annotations

import pwd
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gpud.core.answers import PredictedKv
from gpud.core.config import Config, DaemonConfig, ServeConfig
from gpud.core.launch import SERVE_CACHE_ENVIRONMENT
from gpud.core.modelconfig import check_max_model_len, default_max_model_len
from gpud.core.sizing import (
    CONFIGURED,
    ESTIMATED,
    MEASURED,
    MIB,
    KvCache,
    Need,
    NotApplicable,
    SizingError,
    Source,
    Unknown,
    Weights,
    at_reservation,
    estimate_overheads,
    kv_cache,
    measured_overheads,
    need,
    shortfall,
    weights,
)
from gpud.core.vllm_versions import KvRules, behaviour
from gpud.vllm.checkpoint import (
    CheckpointError,
    MissingFile,
    NotOnDisk,
    hub_cache_of,
    locate,
    read_checkpoint,
)


@dataclass(frozen=True)
class Sized:
    """A serve's predicted needs, or why there are none (`unknown`), or a broken checkpoint
    (`error`)."""

    weights: Weights | None = None
    kv: KvCache | None = None
    need: Need | None = None
    where: str = ""
    context_from: str = ""
    unknown: str | None = None
    error: str | None = None
    # the key under serves.NAME an error belongs to
    error_key: str = "vllm.model"
    # the checkpoint's config.json, for the overheads' estimate
    config: dict[str, object] | None = None


def _option(extra_args: list[str], name: str) -> str | None:
    """The value of `name` in extra_args (`--name V` or `--name=V`; the last wins, as in
    argparse)."""
    found = None
    for i, arg in enumerate(extra_args):
        if arg == name and i + 1 < len(extra_args):
            found = extra_args[i + 1]
        elif arg.startswith(name + "="):
            found = arg.partition("=")[2]
    return found


def _home(user: str) -> str | None:
    try:
        return (pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)).pw_dir
    except KeyError:
        return None


def serve_hub_cache(serve: ServeConfig, daemon: DaemonConfig) -> Path:
    """The Hugging Face cache the serve's vLLM uses (gpud.core.launch.serve_identity: the
    default identity's environment, or the named user's home)."""
    env: dict[str, str] = {}
    user = serve.user or daemon.serve_user
    if serve.user is None and user not in ("root", "0"):
        env.update(SERVE_CACHE_ENVIRONMENT)
    else:
        env["HOME"] = _home(user) or "/root"
    env.update(serve.environment)
    return hub_cache_of(env)


def size_serve(serve: ServeConfig, daemon: DaemonConfig) -> Sized:
    v = serve.vllm
    if v is None:
        return Sized(unknown="not a vllm serve")
    if serve.container is not None:
        return Sized(unknown="a container serve's model is read inside its container")
    try:
        directory, local = locate(v.model, v.revision, serve_hub_cache(serve, daemon))
        try:
            ckpt = read_checkpoint(directory)
        except MissingFile as exc:
            if not local:  # vLLM downloads what the cache lacks
                raise NotOnDisk(str(exc)) from None
            raise
        devices = len(serve.all_roles)
        dtype_arg = _option(v.extra_args, "--dtype")
        w = weights(ckpt.tensors, ckpt.config, quantization=v.quantization,
                    dtype_arg=dtype_arg, devices=devices)
    except NotOnDisk as exc:
        return Sized(unknown=f"{exc}: unknown until its first start")
    except NotApplicable as exc:
        return Sized(error=str(exc), error_key="vllm.quantization")
    except (Unknown, SizingError) as exc:
        # an architecture whose config gpud cannot size (an encoder-decoder's layers, a dtype
        # it does not know) is not the config's fault: vLLM may well run it
        return Sized(unknown=str(exc))
    except CheckpointError as exc:
        return Sized(error=str(exc))
    try:
        kv = kv_cache(ckpt.config, cache_dtype=_option(v.extra_args, "--kv-cache-dtype"),
                      dtype_arg=dtype_arg, devices=devices)
    except SizingError as exc:  # the weights still bound the reservation
        return Sized(w, where=ckpt.where(), unknown=f"KV cache: {exc}")
    if v.max_model_len is not None:
        too_long = check_max_model_len(ckpt.config, v.max_model_len)
        if too_long is not None:
            return Sized(w, kv, where=ckpt.where(), error=f"{too_long} (read from "
                         f"{ckpt.where()})", error_key="vllm.max_model_len")
    length = v.max_model_len or default_max_model_len(ckpt.config)
    if length is None:
        return Sized(w, kv, where=ckpt.where(),
                     unknown="no max_model_len, and config.json gives no context length")
    if v.context_mib:
        context, context_from = v.context_mib, "vllm.context_mib"
    else:
        context, context_from = daemon.vllm_start_context_mib, "daemon.vllm_start_context_mib"
    kv_mib = v.kv_cache_mib if isinstance(v.kv_cache_mib, int) else None
    return Sized(w, kv, need(w, kv, length, context, kv_mib, kv_rules(daemon)), ckpt.where(),
                 context_from, config=dict(ckpt.config))


def kv_rules(daemon: DaemonConfig) -> KvRules:
    """How the serves' vLLM release sizes its KV cache (daemon.vllm_version)."""
    return behaviour(daemon.vllm_version).kv


def kv_at_reservation(spec: ServeConfig, daemon: DaemonConfig, sized: Sized, max_model_len: int,
                      figures: dict[str, Any] | None, *,
                      device_mib: int | None = None) -> PredictedKv:
    """The serve's reservation, each deduction named and sourced, and the KV cache it leaves in
    vLLM's terms (gpud.core.sizing.at_reservation): with the overheads a calibration measured
    (`figures`, its vLLM lines) once there is one, as Ollama replaces its estimate with what the
    engine logged; else gpud's estimate. vLLM's budget is the reservation less vllm.context_mib
    (gpud.core.launch.vllm_budget_mib), so that is the context deducted (the context measured
    beyond the budget is the calibration's own figure). A serve with vllm.kv_cache_mib gets that
    KV cache whatever is left (--kv-cache-memory-bytes)."""
    assert sized.weights is not None and sized.kv is not None and sized.config is not None
    assert spec.vllm is not None
    rules = kv_rules(daemon)
    estimate = estimate_overheads(sized.config, sized.weights.dtype, rules,
                                  context_mib=spec.vllm.context_mib, device_mib=device_mib)
    overheads = estimate
    weights_mib = sized.weights.mib
    weights_from = ESTIMATED if sized.weights.estimate else Source.CHECKPOINT
    if figures:
        overheads = replace(measured_overheads(figures, estimate,
                                               budget_mib=spec.vram_mib - spec.vllm.context_mib),
                            context_mib=spec.vllm.context_mib, context_from=CONFIGURED)
        if isinstance(figures.get("weights_mib"), int):
            weights_mib, weights_from = int(figures["weights_mib"]), MEASURED
    at = at_reservation(spec.vram_mib, weights_mib, weights_from, sized.kv, max_model_len,
                        overheads, rules)
    cap, kv_from = at.capacity, "what the reservation leaves"
    if isinstance(spec.vllm.kv_cache_mib, int):
        cap = sized.kv.capacity(spec.vllm.kv_cache_mib * MIB, max_model_len, rules)
        kv_from = "vllm.kv_cache_mib"
    logged = figures.get("kv_cache_tokens") if figures else None
    return {"vram_mib": spec.vram_mib, "vllm_version": daemon.vllm_version,
            "rules_from": behaviour(daemon.vllm_version).rules_from,
            "kv_at_mib": cap.kv_bytes // MIB, "kv_from": kv_from, "kv_tokens": cap.tokens,
            "max_concurrency": round(cap.max_concurrency, 2), "sequences": cap.sequences,
            "deductions": [{"name": d.name, "mib": d.mib, "source": d.source}
                           for d in at.deductions],
            "overheads_how": overheads.how,
            "logged_kv_tokens": logged if isinstance(logged, int) else None}


def checkpoint_problems(cfg: Config) -> list[str]:
    """The problems of each vllm serve's reservation against its checkpoint on disk."""
    problems: list[str] = []
    for name, serve in sorted(cfg.serves.items()):
        if serve.vllm is None:
            continue
        sized = size_serve(serve, cfg.daemon)
        if sized.error is not None:
            problems.append(f"serves.{name}.{sized.error_key}: {sized.error}")
            continue
        w, n, kv = sized.weights, sized.need, sized.kv
        if w is None:
            continue
        if serve.vram_mib < w.mib:
            problems.append(
                f"serves.{name}.vram_mib: {serve.vram_mib} MiB is below the weights alone: "
                f"{w.mib} MiB ({w.how}), read from {sized.where}")
            continue
        if n is None or kv is None:
            continue
        rules = kv_rules(cfg.daemon)
        if isinstance(serve.vllm.kv_cache_mib, int):
            one = -(-kv.bytes_for(n.max_model_len, rules) // (1 << 20))
            if serve.vllm.kv_cache_mib < one:
                problems.append(
                    f"serves.{name}.vllm.kv_cache_mib: {serve.vllm.kv_cache_mib} MiB does not "
                    f"hold one sequence of max_model_len {n.max_model_len} ({one} MiB of KV "
                    "cache): vLLM refuses to start (vllm/v1/core/kv_cache_utils.py:1104)")
                continue
        why = shortfall(serve.vram_mib, n, kv, rules)
        if why is not None:
            problems.append(f"serves.{name}.vram_mib: {why} (weights {w.how}, read from "
                            f"{sized.where}; context from {sized.context_from})")
    return problems
