"""The boot of a device's resident set: exactly sized serves (vllm.kv_cache_mib, no profiling)
start together, a util-sized one alone (gpud.life.locks, gpud.core.launch.start_sharing)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from gpud.core.vocab import RUNNING
from tests.rig import Rig, entered, make_rig

CONFIG = """
[daemon]
admission = "ledger"
state_dir = "{tmp}"
health_interval_s = {health}

[roles.r]
device = "GPU-sim-0"
capacity_mib = 2000
"""


def serves(spec: list[tuple[str, int, bool]]) -> str:
    out = ""
    for i, (name, prio, exact) in enumerate(spec):
        kv = "kv_cache_mib = 100\n" if exact else ""
        out += (f'[serves.{name}]\nrole = "r"\nvram_mib = 300\nresident = true\n'
                f'priority = {prio}\nport = {31000 + i}\n'
                f'[serves.{name}.vllm]\nmodel = "m/{name}"\nexecutable = "/bin/true"\n{kv}')
    return out


async def until(cond: Callable[[], bool], what: str) -> None:
    async def poll() -> None:
        while not cond():
            await asyncio.sleep(0.001)
    try:
        await asyncio.wait_for(poll(), 5)
    except TimeoutError:
        raise AssertionError(f"never: {what}") from None


async def booting(tmp: Path, spec: list[tuple[str, int, bool]]) -> Rig:
    r = await make_rig(tmp, CONFIG, extra=serves(spec))
    r.units.start_gate = asyncio.Event()  # every unit start waits here until the test opens it
    return r


def started(r: Rig) -> list[str]:
    return [s.serve for s in r.units.started]


async def test_four_exactly_sized_serves_on_one_device_start_together(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    spec = [(f"e{i}", 10 * i, True) for i in range(1, 5)]
    r = await booting(tmp_path, spec)
    async for _ in entered(r):
        with caplog.at_level(logging.INFO, "gpud.supervisor"):
            boot = asyncio.get_running_loop().create_task(r.sup.boot_job.boot())
            # All four are inside their start at once (the gate holds each of them there).
            await until(lambda: len(started(r)) == 4, "four starts at once")
            assert started(r) == ["e1", "e2", "e3", "e4"]  # in priority order
            assert r.units.start_gate is not None
            r.units.start_gate.set()
            await boot
        assert all(r.state(n) == RUNNING for n, _, _ in spec)
        ev = [e for e in r.events(kinds=["start"])]
        assert {e.details["device_lock"] for e in ev} == {"shared"}
        assert "e1 starts with its device's other exactly sized serves: KV cache 100 MiB" \
            in caplog.text


async def test_a_util_sized_serve_starts_alone_in_its_priority_place(tmp_path: Path) -> None:
    spec = [("e1", 10, True), ("e2", 20, True), ("u", 30, False), ("e3", 40, True)]
    r = await booting(tmp_path, spec)
    async for _ in entered(r):
        gate = r.units.start_gate
        assert gate is not None
        boot = asyncio.get_running_loop().create_task(r.sup.boot_job.boot())
        await until(lambda: len(started(r)) == 2, "e1 and e2 together")
        await asyncio.sleep(0.05)
        assert started(r) == ["e1", "e2"]  # u waits for them, e3 waits behind u
        gate.set()
        await boot
        assert started(r) == ["e1", "e2", "u", "e3"]
        ts = {(e.kind, e.serve): e.id or 0 for e in r.events(kinds=["start", "healthy"])}
        assert ts[("start", "u")] > max(ts[("healthy", "e1")], ts[("healthy", "e2")])
        assert ts[("start", "e3")] > ts[("healthy", "u")]
        u = next(e for e in r.events(kinds=["start"]) if e.serve == "u")
        assert u.details["device_lock"] == "exclusive"
        assert "sized by profiling" in u.details["device_lock_why"]


async def test_kv_cache_calibrated_uses_the_calibrations_figure_or_starts_alone(
        tmp_path: Path) -> None:
    spec = [("c1", 10, True), ("c2", 20, True)]
    text = serves(spec).replace("kv_cache_mib = 100", 'kv_cache_mib = "calibrated"')
    r = await make_rig(tmp_path, CONFIG, extra=text)
    r.figures.kv["c1"] = 96  # c2 not calibrated
    async for _ in entered(r):
        await r.sup.boot_job.boot()
        argv = {s.serve: s.argv for s in r.units.started}
        assert "--kv-cache-memory-bytes" in argv["c1"]
        assert argv["c1"][argv["c1"].index("--kv-cache-memory-bytes") + 1] == str(96 << 20)
        assert "--kv-cache-memory-bytes" not in argv["c2"]
        ev = {e.serve: e.details for e in r.events(kinds=["start"])}
        assert ev["c1"]["device_lock"] == "shared"
        assert ev["c2"]["device_lock"] == "exclusive"
        assert ev["c2"]["device_lock_why"].startswith(
            'starts alone: kv_cache_mib = "calibrated" but no calibration gives a figure yet')
