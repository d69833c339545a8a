"""``gpuctl size MODEL``: what a model needs before a config exists, read from its checkpoint on
this host (gpud.vllm.checkpoint, gpud.core.sizing: the standard library only, no daemon asked).
Imported lazily by the command's run: reading checkpoints costs nothing to the other commands.
"""

from __future__ import annotations

from gpud.ctl.errors import EXIT_OK, EXIT_REFUSED, CtlError, usage_error

TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from typing import Any

# The serves' shared model cache (gpud.core.launch.SERVE_CACHE_ENVIRONMENT's HF_HOME): where a
# repository id is looked for unless --hf-home says otherwise.
SERVES_HF_HOME = "/var/cache/gpud-serve/huggingface"
# What a serve without vllm.context_mib is taken to draw beyond its budget
# (daemon.vllm_start_context_mib's default).
DEFAULT_CONTEXT_MIB = 512
EXIT_NOT_ON_DISK = 2


def _positive_int(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) <= 0:
        import argparse

        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", nargs="?",
                   help="a checkpoint directory, or a repository id (ORG/NAME) in the serves' "
                        "model cache")
    p.add_argument("--serve", metavar="NAME",
                   help="instead of MODEL: a configured serve, sized by the daemon with the "
                        "overheads its calibration measured (estimated until it has one)")
    p.add_argument("--max-model-len", type=_positive_int, metavar="N",
                   help="the longest sequence (default: the model's context length, as vLLM "
                        "takes it; longer is refused)")
    p.add_argument("--quantization", metavar="Q",
                   help="vllm.quantization: a pre-quantized checkpoint counts as stored; an "
                        "online method (fp8_per_tensor, fp8_per_block, ...) is estimated")
    p.add_argument("--kv-cache-dtype", metavar="D",
                   help="the KV cache's dtype (auto, fp8, bfloat16, ...; default auto: the "
                        "model's)")
    p.add_argument("--dtype", metavar="D", help="vLLM's --dtype (default auto)")
    p.add_argument("--revision", metavar="R",
                   help="the pinned revision of a repository id (default main)")
    p.add_argument("--hf-home", metavar="PATH", default=SERVES_HF_HOME,
                   help=f"the Hugging Face home of the cache (default {SERVES_HF_HOME}, the "
                        "serves' own)")
    p.add_argument("--context-mib", type=int, default=DEFAULT_CONTEXT_MIB, metavar="MIB",
                   help="what vLLM draws beyond its budget (vllm.context_mib; default "
                        f"{DEFAULT_CONTEXT_MIB}, daemon.vllm_start_context_mib's)")
    p.add_argument("--devices", type=_positive_int, default=1, metavar="N",
                   help="tensor parallel over N devices (the serve's roles): figures per device")
    p.add_argument("--vram-mib", type=_positive_int, metavar="MIB",
                   help="the reservation to size: the KV cache it leaves, in MiB, tokens and "
                        "sequences at once; exit 1 with the reason when it cannot hold the model")
    p.add_argument("--concurrency", type=_positive_int, default=1, metavar="N",
                   help="without --vram-mib: the smallest reservation for N sequences of "
                        "max_model_len at once (default 1)")
    # the releases are not listed here: gpud.core.vllm_versions stays out of gpuctl's start
    p.add_argument("--vllm-version", metavar="V",
                   help="the vLLM release whose rules size the KV cache (default "
                        "daemon.vllm_version's); one gpud has no rules of its own for is sized "
                        "by the newest it knows, and says so")
    p.add_argument("--device-mib", type=_positive_int, metavar="MIB",
                   help="the device's total memory: vLLM's batch defaults (and so its "
                        "activation peak) grow from 70 GiB (default: a smaller device)")


def size_doc(args: argparse.Namespace) -> dict[str, Any]:
    """The figures as JSON, or CtlError (exit 2) for a checkpoint that is not there or not
    readable, or a setting vLLM would refuse."""

    from gpud.core import modelconfig, sizing
    from gpud.core.vllm_versions import DEFAULT_VERSION, behaviour, borrowed_rules_note
    from gpud.vllm.checkpoint import CheckpointError, NotOnDisk, hub_cache_of, locate, read_checkpoint

    if args.context_mib < 0:
        raise usage_error("--context-mib must be >= 0")
    version = args.vllm_version or DEFAULT_VERSION
    try:
        release = behaviour(version)
    except KeyError as exc:
        raise usage_error(f"--vllm-version: {exc.args[0]}") from None
    rules = release.kv
    try:
        directory, _local = locate(args.model, args.revision,
                                   hub_cache_of({"HF_HOME": args.hf_home}))
        ckpt = read_checkpoint(directory)
        w = sizing.weights(ckpt.tensors, ckpt.config, quantization=args.quantization,
                           dtype_arg=args.dtype, devices=args.devices)
        kv = sizing.kv_cache(ckpt.config, cache_dtype=args.kv_cache_dtype, dtype_arg=args.dtype,
                             devices=args.devices)
    except NotOnDisk as exc:
        raise CtlError("not-on-disk", f"{exc}: its needs are unknown until its first start "
                       "(or until it is downloaded: --hf-home names the cache)",
                       EXIT_NOT_ON_DISK, {"model": args.model}) from None
    except sizing.Unknown as exc:
        raise CtlError("unknown", str(exc), EXIT_REFUSED, {"model": args.model}) from None
    except (CheckpointError, sizing.SizingError) as exc:
        raise usage_error(str(exc), model=args.model) from None
    if args.max_model_len is not None:
        too_long = modelconfig.check_max_model_len(ckpt.config, args.max_model_len)
        if too_long is not None:
            raise usage_error(too_long.replace("use max_model_len", "use --max-model-len"),
                              model=args.model)
    length = args.max_model_len or modelconfig.default_max_model_len(ckpt.config)
    if length is None:
        raise usage_error("config.json gives no context length: give --max-model-len",
                          model=args.model)
    n = sizing.need(w, kv, length, args.context_mib, rules=rules)
    overheads = sizing.estimate_overheads(ckpt.config, w.dtype, rules,
                                          context_mib=args.context_mib,
                                          device_mib=args.device_mib)
    for_one, _ = sizing.smallest_reservation(1, w.mib, kv, length, overheads, rules)
    for_n, _ = sizing.smallest_reservation(args.concurrency, w.mib, kv, length, overheads,
                                           rules)
    if args.vram_mib is not None and args.vram_mib < w.mib:
        raise usage_error(
            f"--vram-mib {args.vram_mib} is below the weights alone: {w.mib} MiB ({w.how}); "
            f"one sequence of {length} tokens needs --vram-mib >= {for_one} (>= {n.minimum_mib} "
            "without the estimated activation peak and CUDA graphs)", model=args.model)
    vram = args.vram_mib if args.vram_mib is not None else for_n
    weights_from = sizing.Source.ESTIMATED if w.estimate else sizing.Source.CHECKPOINT
    at = sizing.at_reservation(vram, w.mib, weights_from, kv, length, overheads, rules)
    cap = at.capacity
    transient = (overheads.activation_mib + overheads.graphs_mib) * sizing.MIB
    margin = rules.extensible_margin_bytes(transient)
    doc: dict[str, Any] = {
        "model": args.model, "checkpoint": ckpt.where(), "files": list(ckpt.files),
        "vllm_version": version, "rules_source": rules.source,
        "rules_from": release.rules_from, "rules_note": borrowed_rules_note(release),
        "weights_mib": w.mib, "weights_bytes": w.bytes, "stored_bytes": w.stored_bytes,
        "dtype": w.dtype, "weights_how": w.how, "estimate": w.estimate,
        "kv_bytes_per_token": kv.per_token_bytes, "kv_dtype": kv.dtype, "kv_note": kv.note,
        "block_tokens": rules.block_tokens, "block_bytes": kv.block_bytes(rules),
        "blocks_per_sequence": cap.blocks_per_request,
        "max_model_len": length, "one_sequence_kv_mib": n.kv_mib,
        "context_mib": n.context_mib, "minimum_mib": n.minimum_mib, "devices": args.devices,
        "reservation_mib": vram,
        "reservation_from": "--vram-mib" if args.vram_mib is not None
        else f"the smallest for {args.concurrency} at once",
        "deductions": [{"name": d.name, "mib": d.mib, "source": d.source}
                       for d in at.deductions],
        "overheads_how": overheads.how,
        "kv_mib": at.kv_mib, "kv_bytes": cap.kv_bytes, "kv_blocks": cap.blocks,
        "kv_tokens": cap.tokens, "max_concurrency": round(cap.max_concurrency, 2),
        "sequences": cap.sequences,
        "smallest_mib": {"1": for_one, str(args.concurrency): for_n},
        "extensible_margin_mib": None if margin is None else sizing.mib_up(margin),
        "vram_mib": args.vram_mib, "fits": None, "reason": None,
    }
    if args.vram_mib is not None:
        why = sizing.shortfall(args.vram_mib, n, kv, rules)
        if why is None and not cap.starts:
            why = (f"{args.vram_mib} MiB leaves {at.kv_mib} MiB of KV cache after the "
                   f"estimated activation peak and CUDA graphs: not one sequence of {length} "
                   f"tokens ({cap.blocks_per_request} blocks and the null block); vLLM will not "
                   f"start. Set vram_mib >= {for_one}, or calibrate: the estimate may be high")
        doc["fits"] = why is None
        doc["reason"] = why
    return doc


def _deduction(d: dict[str, Any]) -> str:
    return f"  - {d['name']:<16}{d['mib']:>7} MiB  ({d['source']})"


def format_size(d: dict[str, Any]) -> str:
    mib = 1 << 20
    per = "per device, " if d["devices"] > 1 else ""
    n = d["max_model_len"]
    lines = [f"checkpoint {d['checkpoint']}",
             f"  weights    {d['weights_mib']} MiB ({per}{d['weights_how']}; "
             f"{d['stored_bytes'] / mib:.1f} MiB on disk)",
             f"  KV cache   {d['kv_bytes_per_token']} bytes per token ({d['kv_dtype']}"
             + (f"; {d['kv_note']}" if d["kv_note"] else "") + ")",
             f"             vLLM {d['vllm_version']}: blocks of {d['block_tokens']} tokens, "
             f"{d['block_bytes']} bytes a block; one sequence of {n} takes "
             f"{d['blocks_per_sequence']} blocks",
             *([f"             ({d['rules_note']})"] if d.get("rules_note") else []),
             f"             {d['one_sequence_kv_mib']} MiB for one sequence of max_model_len "
             f"{n} (and the null block)",
             f"  context    {d['context_mib']} MiB",
             f"  minimum    {d['minimum_mib']} MiB (weights + KV + context: below it vLLM "
             "cannot start; its activation peak and CUDA graphs come on top)",
             f"reservation {d['reservation_mib']} MiB ({d['reservation_from']}):",
             *(_deduction(x) for x in d["deductions"]),
             f"  = KV cache {d['kv_mib']} MiB: {d['kv_tokens']:,} tokens ({d['kv_blocks']:,} "
             f"blocks of {d['block_tokens']}), {d['max_concurrency']:.2f}x max concurrency for "
             f"{n} tokens ({d['sequences']} sequences at once)",
             f"  ({d['overheads_how']})"]
    if d.get("extensible_margin_mib") is not None:
        lines.append(f"  vLLM {d['vllm_version']}'s extensible KV cache would keep "
                     f"{d['extensible_margin_mib']} MiB of the device free beside it and the "
                     "transient peak out of it; gpud turns it off "
                     "(--no-enable-extensible-kv-cache)")
    lines.append("smallest reservation: " + ", ".join(
        f"{v} MiB for {k} at once" for k, v in d["smallest_mib"].items())
        + " (with the estimated overheads)")
    # The smallest reservation for the sequences asked (--concurrency, the last figure above):
    # the minimum alone leaves no room for the activation peak and CUDA graphs, and vLLM would
    # not start on it.
    at_once, smallest = list(d["smallest_mib"].items())[-1]
    lines += ["in serves.toml:",
              f"  vram_mib = {smallest}      # the smallest reservation for {at_once} at once "
              f"(the minimum {d['minimum_mib']} MiB and the estimated overheads)",
              f"  vllm.max_model_len = {n}",
              f"  vllm.kv_cache_mib = {d['one_sequence_kv_mib']}      # one sequence; more for "
              "more at once"]
    if d["vram_mib"] is not None:
        lines.append(f"vram_mib {d['vram_mib']}: fits" if d["fits"]
                     else f"vram_mib {d['reason']}")
    return "\n".join(lines)


def serve_doc(ctl: Any, name: str) -> dict[str, Any]:
    """A configured serve's sizes as the daemon has them (GET /v1/serves/NAME/calibration: its
    checkpoint's prediction, and what its reservation leaves for the KV cache with the
    overheads its current calibration measured)."""
    from gpud.ctl.client import quote_segment

    view = ctl.client.call("GET", f"/v1/serves/{quote_segment(name)}/calibration")
    if view.get("predicted") is None:
        raise usage_error(f"{name} is not a vllm serve: gpud sizes vllm serves only", serve=name)
    return {"serve": name, "status": view.get("status"), "predicted": view["predicted"],
            "vllm": view.get("vllm")}


def format_serve_size(d: dict[str, Any]) -> str:
    from gpud.ctl.format import predicted_lines

    return "\n".join([f"{d['serve']}: {d['status']}",
                      *predicted_lines(d["predicted"], d.get("vllm"))])


def run(ctl: Any, args: argparse.Namespace) -> int:
    """gpud.ctl.commands.run_size's (`ctl` its Ctl: this module does not import it back)."""
    if (args.model is None) == (args.serve is None):
        raise usage_error("give MODEL (a checkpoint) or --serve NAME (a configured serve)")
    if args.serve is not None:
        ctl.emit(serve_doc(ctl, args.serve), format_serve_size)
        return EXIT_OK
    doc = size_doc(args)
    ctl.emit(doc, format_size)
    return EXIT_REFUSED if doc["fits"] is False else EXIT_OK
