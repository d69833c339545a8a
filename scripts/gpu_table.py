#!/usr/bin/env python3
"""What only a real NVIDIA GPU shows, as one table (run by scripts/gpu-check): per device, NVML's
memory figures beside CUDA's (torch.cuda.mem_get_info), and a real allocation in a child process:
the draw NVML attributes to its PID (the allocation plus the CUDA context, the figure a
serve's `vllm.context_mib` stands for), how far "used" rose, and whether gpud's own NVML backend
lists the process with a figure (none under WDDM: gpud then estimates the split).

Needs nvidia-ml-py and torch (no vLLM, no network). Where there is no GPU it says why and exits
3 (scripts/gpu-check then exits 0: nothing to check).

    python3 scripts/gpu_table.py [--mib 1024]
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import select
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# gpud.host.nvml imports pynvml only when sampling: importing it here works without a GPU
from gpud.core.observation import DeviceSample, find_device  # noqa: E402
from gpud.host.nvml import NvmlBackend  # noqa: E402

MIB = 1 << 20
READY_TIMEOUT_S = 180.0
SETTLE_TIMEOUT_S = 30.0

CHILD = r"""
import sys
import torch

buf = torch.empty(int(sys.argv[1]) * 2**20, dtype=torch.uint8, device="cuda")
buf.fill_(1)
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.readline()
"""


NO_GPU = "gpu-check: no NVIDIA GPU to measure here"
# the exit status that says so (scripts/gpu-check then runs no GPU test)
NO_GPU_STATUS = 3


def no_gpu(why: str) -> int:
    print(f"{NO_GPU}: {why}; nothing was run")
    return NO_GPU_STATUS


def table(rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)


def cuda_figures(index: int) -> tuple[int, int] | str:
    """(free, total) MiB as CUDA sees device `index`, from a child (so this process holds no
    context that would show in NVML's figures); or why not."""
    code = ("import sys, torch; f, t = torch.cuda.mem_get_info(int(sys.argv[1])); "
            "print(f // 2**20, t // 2**20)")
    env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID")
    out = subprocess.run([sys.executable, "-c", code, str(index)], capture_output=True,
                         text=True, env=env, check=False, timeout=READY_TIMEOUT_S)
    if out.returncode != 0:
        return (out.stderr.strip().splitlines() or ["torch failed"])[-1]
    free, total = out.stdout.split()
    return int(free), int(total)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="the allocation (default 1024)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # gpud.host.nvml's retry notice: the answer says it
    if importlib.util.find_spec("pynvml") is None:
        return no_gpu("nvidia-ml-py (pynvml) is not installed")
    backend = NvmlBackend()
    try:
        obs = backend.sample()
        if not obs.available:
            return no_gpu(f"NVML: {obs.reason}")
        devices = [d for d in obs.devices if d.healthy and d.total_mib is not None]
        if not devices:
            return no_gpu("NVML lists no readable device")
        if importlib.util.find_spec("torch") is None:
            return no_gpu("torch is not installed (it makes the CUDA figures and the allocation)")
        rows = [("device", "NVML total", "NVML used", "NVML free", "CUDA total", "CUDA free",
                 "total differs by")]
        for d in devices:
            cuda = cuda_figures(d.index)
            if isinstance(cuda, str):
                rows.append((f"{d.index} {d.uuid}", f"{d.total_mib}", f"{d.used_mib}",
                             f"{d.free_mib}", "-", "-", f"CUDA: {cuda}"))
                continue
            free, total = cuda
            rows.append((f"{d.index} {d.uuid}", f"{d.total_mib} MiB", f"{d.used_mib} MiB",
                         f"{d.free_mib} MiB", f"{total} MiB", f"{free} MiB",
                         f"{(d.total_mib or 0) - total} MiB"))
        print(table(rows))
        print()
        print(allocation(backend, devices[0].uuid, args.mib))
    finally:
        backend.close()
    return 0


def allocation(backend: NvmlBackend, uuid: str, mib: int) -> str:
    def now() -> DeviceSample | None:
        return find_device(backend.sample().devices, uuid)

    before = now()
    env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=uuid)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(mib)], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        ready, _, _ = select.select([child.stdout], [], [], READY_TIMEOUT_S)
        if not ready or child.stdout.readline().strip() != "ready":
            return f"allocation of {mib} MiB: the child did not allocate"
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        dev = now()
        while dev is None or child.pid not in {p.pid for p in dev.processes or ()}:
            if time.monotonic() > deadline:
                return (f"allocation of {mib} MiB: NVML does not list PID {child.pid} "
                        "(another PID namespace, or a driver that lists no process: WSL2)")
            time.sleep(0.5)
            dev = now()
        drawn = {p.pid: p.mib for p in dev.processes or ()}[child.pid]
        rise = (dev.used_mib or 0) - (before.used_mib or 0 if before is not None else 0)
        rows = [("allocation", "NVML per-process", "beyond the allocation (context)",
                 "NVML used rose by")]
        rows.append((f"{mib} MiB (PID {child.pid})",
                     "not available (WDDM)" if drawn is None else f"{drawn} MiB",
                     "-" if drawn is None else f"{drawn - mib} MiB", f"{rise} MiB"))
        return table(rows)
    finally:
        if child.stdin is not None:
            child.stdin.close()
        child.wait(30)


if __name__ == "__main__":
    sys.exit(main())
