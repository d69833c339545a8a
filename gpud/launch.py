"""How a serve is run: its argv, environment and fingerprint. Pure: values in, values out.

Commands come only from the root-owned config, never from a client request: nothing here takes
client input.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

from gpud.config import ServeConfig
from gpud.ledger import gpu_memory_utilization


def vllm_argv(serve: ServeConfig, *, executable: str, util: str) -> list[str]:
    """`vllm serve MODEL --revision R --port P --gpu-memory-utilization U --max-model-len N
    [--quantization Q] [extra_args...]` (pinned by a golden test)."""
    v = serve.vllm
    if v is None:
        raise ValueError("not a vllm serve")
    argv = [v.executable or executable, "serve", v.model]
    if v.revision:
        argv += ["--revision", v.revision]
    if serve.port is not None:
        argv += ["--port", str(serve.port)]
    argv += ["--gpu-memory-utilization", util]
    if v.max_model_len is not None:
        argv += ["--max-model-len", str(v.max_model_len)]
    if v.quantization:
        argv += ["--quantization", v.quantization]
    return argv + list(v.extra_args)


def command_argv(serve: ServeConfig, *, util: str, device_index: int) -> list[str]:
    """An explicit command with its placeholders filled. Each argument is formatted on its own,
    so a value can never split into two arguments or reach a shell."""
    if serve.command is None:
        raise ValueError("not a command serve")
    values: Mapping[str, object] = {
        "port": serve.port if serve.port is not None else "",
        "gpu_memory_utilization": util,
        "device_index": device_index,
        "vram_mib": serve.vram_mib,
    }
    return [arg.format_map(values) for arg in serve.command]


def serve_argv(serve: ServeConfig, *, total_mib: int | None, device_index: int,
               vllm_executable: str, vram_mib: int | None = None) -> list[str]:
    """The argv of a serve. `vram_mib` is its current reservation (default: the config's);
    util = floor(vram / device total, 4 decimals), so util x total never exceeds it."""
    mib = vram_mib if vram_mib is not None else serve.vram_mib
    util = gpu_memory_utilization(mib, total_mib) if total_mib else "0.9000"
    if serve.vllm is not None:
        return vllm_argv(serve, executable=vllm_executable, util=util)
    return command_argv(serve, util=util, device_index=device_index)


# What systemd 252 alters in an ExecStart= argument when it re-reads a transient unit.
ALTERED_BY_RELOAD = ("$", ";")


def through_shim(argv: list[str], python: str, systemd_version: int | None) -> list[str]:
    """The argv to hand systemd: the command itself, or (when an argument would not survive a
    daemon-reload on this systemd) the command wrapped for gpud.execv."""
    fragile = any(ch in arg for arg in argv for ch in ALTERED_BY_RELOAD)
    if not fragile or (systemd_version is not None and systemd_version > 252):
        return argv
    from gpud.execv import encode

    return [python, "-I", "-m", "gpud.execv", encode(argv)]


def fingerprint(serve: ServeConfig) -> str:
    """A hash of what defines a serve's memory behaviour: model, revision, quantization,
    max_model_len and the command. A changed serve no longer matches its calibration."""
    v = serve.vllm
    what = {
        "model": v.model if v else None,
        "revision": v.revision if v else None,
        "quantization": v.quantization if v else None,
        "max_model_len": v.max_model_len if v else None,
        "extra_args": list(v.extra_args) if v else None,
        "command": list(serve.command) if serve.command else None,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
