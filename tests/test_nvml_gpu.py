"""The NVML backend against a real GPU: real allocations in real processes.

Runs only where NVML sees a device and torch can allocate on it; elsewhere every test skips and
says why ("no NVML device: <reason>", or that torch is missing).
"""

from __future__ import annotations

import importlib.util
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from gpud.ledger import serve_draws
from gpud.nvml import NvmlBackend
from gpud.observation import DeviceSample, find_device

pytestmark = pytest.mark.gpu

# Two processes with different, known allocations.
ALLOC_MIB = (1024, 3072)
# Per process: the CUDA context (~500 MiB on recent drivers) plus allocator rounding.
CONTEXT_TOLERANCE_MIB = 1024
READY_TIMEOUT_S = 180.0
SETTLE_TIMEOUT_S = 30.0

CHILD = r"""
import sys
import torch

mib = int(sys.argv[1])
buf = torch.empty(mib * 2**20, dtype=torch.uint8, device="cuda")
buf.fill_(1)
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.readline()
"""


@pytest.fixture(scope="module")
def gpu() -> Iterator[tuple[NvmlBackend, DeviceSample]]:
    backend = NvmlBackend()
    obs = backend.sample()
    if not obs.available:
        backend.close()
        pytest.skip(f"no NVML device: {obs.reason}")
    healthy = [d for d in obs.devices if d.healthy and d.total_mib is not None]
    if not healthy:
        backend.close()
        problems = "; ".join(f"{d.uuid}: {d.problem}" for d in obs.devices) or "none listed"
        pytest.skip(f"no NVML device: NVML is up but no device is readable ({problems})")
    if importlib.util.find_spec("torch") is None:
        backend.close()
        pytest.skip("torch is not importable: cannot allocate GPU memory from a test process")
    yield backend, healthy[0]
    backend.close()


def device_now(backend: NvmlBackend, uuid: str) -> DeviceSample:
    obs = backend.sample()
    assert obs.available, obs.reason
    dev = find_device(obs.devices, uuid)
    assert dev is not None and dev.healthy, dev
    return dev


def test_identity_and_memory_figures(gpu: tuple[NvmlBackend, DeviceSample]) -> None:
    backend, first = gpu
    dev = device_now(backend, first.uuid)
    assert dev.uuid.startswith(("GPU-", "MIG-"))
    assert dev.name and dev.pci_bus_id
    assert find_device((dev,), dev.pci_bus_id) == dev
    assert find_device((dev,), str(dev.index)) == dev
    assert dev.total_mib is not None and dev.used_mib is not None and dev.free_mib is not None
    assert dev.total_mib > 0
    assert abs(dev.used_mib + dev.free_mib - dev.total_mib) <= 2  # rounding to MiB
    assert dev.processes is not None, "NVML cannot list processes on this device"


def test_allocating_processes_are_seen(gpu: tuple[NvmlBackend, DeviceSample]) -> None:
    backend, first = gpu
    uuid = first.uuid
    before = device_now(backend, uuid)
    assert before.used_mib is not None
    env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=uuid)
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(mib)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for mib in ALLOC_MIB
    ]
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for child in children:
            assert child.stdout is not None
            ready, _, _ = select.select([child.stdout], [], [], deadline - time.monotonic())
            line = child.stdout.readline() if ready else ""
            assert line.strip() == "ready", f"child {child.pid} did not allocate: {line!r}"

        want = {child.pid: mib for child, mib in zip(children, ALLOC_MIB, strict=True)}
        dev = device_now(backend, uuid)
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while not want.keys() <= {p.pid for p in dev.processes or ()}:
            assert time.monotonic() < deadline, (
                f"NVML lists {dev.processes}, expected PIDs {sorted(want)} "
                "(a container with its own PID namespace shows other PIDs)"
            )
            time.sleep(0.5)
            dev = device_now(backend, uuid)

        assert dev.processes is not None
        draws = {p.pid: p.mib for p in dev.processes}
        for pid, mib in want.items():
            got = draws[pid]
            assert got is not None, f"NVML does not report the draw of PID {pid}"
            assert mib <= got <= mib + CONTEXT_TOLERANCE_MIB, (pid, mib, got)

        assert dev.used_mib is not None
        rise = dev.used_mib - before.used_mib
        total_alloc = sum(ALLOC_MIB)
        assert total_alloc <= rise <= total_alloc + CONTEXT_TOLERANCE_MIB * len(children), (
            f"used rose by {rise} MiB for {total_alloc} MiB allocated"
        )
        # The ledger's split: the first child stands for a serve (attributed), the second for
        # draw nobody declared. Non-ledger draw moves by the second one's draw, not the first's.
        managed = serve_draws(((p.pid, p.mib) for p in dev.processes), {children[0].pid: "a"})
        assert managed == {"a": draws[children[0].pid]}
        non_ledger_moved = (dev.used_mib - managed["a"]) - before.used_mib
        second = draws[children[1].pid]
        assert second is not None
        assert abs(non_ledger_moved - second) <= 256, (non_ledger_moved, second)
    finally:
        for child in children:
            if child.stdin is not None:
                child.stdin.close()
        for child in children:
            try:
                child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            if child.stdout is not None:
                child.stdout.close()

    # After the processes end NVML shows the memory back (gpud's post-stop wait relies on it).
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    after = device_now(backend, uuid)
    while after.used_mib is not None and after.used_mib > before.used_mib + 256:
        assert time.monotonic() < deadline, f"memory not returned: {before} -> {after}"
        time.sleep(0.5)
        after = device_now(backend, uuid)
    assert not {p.pid for p in after.processes or ()} & {c.pid for c in children}
