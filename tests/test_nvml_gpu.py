"""The NVML backend against a real GPU: real allocations in real processes.

Runs only where NVML sees a device and torch can allocate on it; elsewhere every test skips and
says why ("no NVML device: <reason>", or that torch is missing).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpud.core.ledger import serve_draws
from gpud.core.observation import DeviceSample, find_device
from gpud.host.nvml import NvmlBackend

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


# ---- real cgroups -----------------------------------------------------------------------------

CGROUP_PARENT = "gpud-gpu-check.slice"
CGROUP_SERVE = "gpucheck"


def _cgroup2_root() -> str | None:
    """A writable cgroup v2 hierarchy: /sys/fs/cgroup (unified) or /sys/fs/cgroup/unified."""
    for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
        if os.path.exists(f"{root}/cgroup.procs") and os.path.exists(f"{root}/cgroup.controllers") \
                and os.access(root, os.W_OK):
            return root
    return None


def test_a_torch_process_in_a_serve_cgroup_is_attributed(
        gpu: tuple[NvmlBackend, DeviceSample]) -> None:
    """gpud attributes by /proc/PID/cgroup: a real allocating process placed in a real cgroup
    named like a serve's unit is that serve's draw, and only its draw leaves non-ledger draw."""
    from gpud.host.cgroups import CachedAttribution

    backend, first = gpu
    root = _cgroup2_root()
    if root is None:
        pytest.skip("no writable cgroup v2 hierarchy (run as root on a cgroup v2 host)")
    unit_dir = f"{root}/{CGROUP_PARENT}/gpud-serve-{CGROUP_SERVE}.service"
    os.makedirs(unit_dir, exist_ok=True)
    env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=first.uuid)
    before = device_now(backend, first.uuid)
    # The child joins the cgroup before it touches CUDA (python reads stdin first).
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.readline(); exec(sys.argv.pop(1))", CHILD,
         "2048"],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        with open(f"{unit_dir}/cgroup.procs", "w") as f:
            f.write(str(child.pid))
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        ready, _, _ = select.select([child.stdout], [], [], READY_TIMEOUT_S)
        assert ready and child.stdout.readline().strip() == "ready"
        attribute = CachedAttribution(ttl=0)
        assert attribute([child.pid]) == {child.pid: CGROUP_SERVE}
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        dev = device_now(backend, first.uuid)
        while child.pid not in {p.pid for p in dev.processes or ()}:
            assert time.monotonic() < deadline, f"NVML lists {dev.processes}"
            time.sleep(0.5)
            dev = device_now(backend, first.uuid)
        assert dev.processes is not None and dev.used_mib is not None
        owners = attribute(p.pid for p in dev.processes)
        managed = serve_draws(((p.pid, p.mib) for p in dev.processes), owners)
        assert 2048 <= managed[CGROUP_SERVE] <= 2048 + CONTEXT_TOLERANCE_MIB
        assert before.used_mib is not None
        # Non-ledger draw did not move by the serve's allocation.
        assert abs((dev.used_mib - managed[CGROUP_SERVE]) - before.used_mib) <= 256
    finally:
        if child.stdin is not None:
            child.stdin.close()
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        for d in (unit_dir, f"{root}/{CGROUP_PARENT}"):
            with contextlib.suppress(OSError):
                os.rmdir(d)


# ---- a real vllm serve ------------------------------------------------------------------------


def real_vllm_model() -> str:
    """The local model a real `vllm serve` is started on; skips where there is none or no vLLM."""
    model = os.environ.get("GPUD_TEST_VLLM_MODEL")
    if not model or not os.path.isdir(model):
        pytest.skip("set GPUD_TEST_VLLM_MODEL to a local model directory to start a real vLLM")
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not importable in this interpreter")
    return model


def test_a_real_vllm_serve_behaves_as_gpud_expects(
        gpu: tuple[NvmlBackend, DeviceSample], tmp_path: Path) -> None:
    """Where vLLM and a local model are present (GPUD_TEST_VLLM_MODEL=/path/to/model): the argv
    and environment gpud builds start a real `vllm serve`; it refuses connections while loading,
    answers /health 200 once loaded, its memory sits in a VLLM::EngineCore child, its draw is
    util x total plus a context, and its memory lines read back through gpud.vllm.vllm_log. (Run
    directly, not in a systemd unit: the unit path is what the sandbox tests cover.)"""
    import socket
    import urllib.request

    from gpud.config import ServeConfig
    from gpud.core.launch import serve_argv, serve_environment
    from gpud.vllm.vllm_log import parse_memory_lines

    backend, first = gpu
    model = real_vllm_model()
    assert first.total_mib is not None
    port = 30999
    serve = ServeConfig.model_validate({
        "role": "gpu", "vram_mib": min(first.total_mib // 4, 24576), "port": port,
        "vllm": {"model": model, "max_model_len": 2048, "extra_args": ["--enforce-eager"]}})
    argv = serve_argv(serve, total_mib=first.total_mib, device_index=first.index,
                      vllm_executable=os.path.join(os.path.dirname(sys.executable), "vllm"))
    env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=str(first.index),
               HF_HUB_OFFLINE="1", **serve_environment(serve))
    log = tmp_path / "vllm.log"
    with log.open("w") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + serve.start_timeout_s
        refused_while_loading = False
        while True:
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, "vLLM did not become healthy"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError as exc:
                if isinstance(getattr(exc, "reason", exc), ConnectionRefusedError):
                    refused_while_loading = True
            time.sleep(1)
        assert refused_while_loading, "no refused connection was seen while loading"
        dev = device_now(backend, first.uuid)
        titles = {}
        for p in dev.processes or ():
            with contextlib.suppress(OSError), open(f"/proc/{p.pid}/cmdline", "rb") as f:
                titles[p.pid] = f.read().split(b"\0")[0].decode()
        engines = [pid for pid, title in titles.items() if title.startswith("VLLM::EngineCore")]
        assert engines and proc.pid not in {p.pid for p in dev.processes or ()}, titles
        util = float(argv[argv.index("--gpu-memory-utilization") + 1])
        drawn = sum(p.mib or 0 for p in dev.processes or () if p.pid in engines)
        assert util * first.total_mib <= drawn, (drawn, util)
        print(f"vLLM context beyond util x total: {drawn - util * first.total_mib:.0f} MiB")
        got = parse_memory_lines(log.read_text().splitlines())
        assert got.weights_mib and got.kv_cache_mib, log.read_text()[-4000:]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=serve.stop_timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        with socket.socket() as s:  # the port is free again
            s.bind(("127.0.0.1", port))


def test_real_vllm_serves_sized_exactly_start_together(
        gpu: tuple[NvmlBackend, DeviceSample], tmp_path: Path) -> None:
    """Where vLLM and a local model are present (GPUD_TEST_VLLM_MODEL): four `vllm serve`s with
    the argv gpud builds for kv_cache_mib (--kv-cache-memory-bytes) started at once on one GPU,
    as gpud's boot starts them, all come up; each says it skipped memory profiling
    (vllm/v1/worker/gpu_worker.py, Worker.determine_available_memory) and none reads a KV
    cache but its own; the four up in <= 1.3 x the slowest one's own start."""
    import urllib.request

    from gpud.config import ServeConfig
    from gpud.core.launch import serve_argv, serve_environment

    _backend, first = gpu
    model = real_vllm_model()
    assert first.total_mib is not None
    vram = min(first.total_mib // 5, 24576)
    kv_mib = 1024
    procs: list[tuple[subprocess.Popen[bytes], int, Path, float]] = []
    try:
        t0 = time.monotonic()
        for i in range(4):
            port = 30990 + i
            serve = ServeConfig.model_validate({
                "role": "gpu", "vram_mib": vram, "port": port,
                "vllm": {"model": model, "max_model_len": 2048, "kv_cache_mib": kv_mib,
                         "extra_args": ["--enforce-eager"]}})
            argv = serve_argv(serve, total_mib=first.total_mib, device_index=first.index,
                              vllm_executable=os.path.join(os.path.dirname(sys.executable), "vllm"))
            assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(kv_mib << 20)
            env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID",
                       CUDA_VISIBLE_DEVICES=str(first.index), HF_HUB_OFFLINE="1",
                       **serve_environment(serve))
            log = tmp_path / f"vllm-{i}.log"
            with log.open("w") as out:
                procs.append((subprocess.Popen(argv, env=env, stdout=out,
                                               stderr=subprocess.STDOUT), port, log,
                              time.monotonic()))
        up: dict[int, float] = {}
        deadline = time.monotonic() + 900
        while len(up) < len(procs):
            assert time.monotonic() < deadline, "not all vLLMs became healthy"
            for proc, port, log, _started in procs:
                assert proc.poll() is None, log.read_text()[-4000:]
                if port in up:
                    continue
                with contextlib.suppress(OSError), urllib.request.urlopen(
                        f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        up[port] = time.monotonic()
            time.sleep(0.5)
        wall = max(up.values()) - t0
        own = [up[port] - started for _p, port, _l, started in procs]
        print(f"four exactly sized vLLMs together: wall {wall:.1f} s, own starts "
              + ", ".join(f"{x:.1f}" for x in own) + " s")
        for _proc, _port, log, _started in procs:
            text = log.read_text()
            assert "skipped memory profiling" in text, text[-4000:]
            assert "No available memory for the cache blocks" not in text
        assert wall <= 1.3 * max(own), (wall, own)
    finally:
        for proc, _port, _log, _started in procs:
            proc.terminate()
        for proc, _port, _log, _started in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
