"""MemAvailable as gpud reads it (gpud/host/hostmem.py)."""

from __future__ import annotations

from pathlib import Path

from gpud.host.hostmem import host_memory, mem_available_mib


def test_mem_available_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       131072000 kB\nMemFree:  1000 kB\n"
                       "MemAvailable:   65536000 kB\n")
    assert mem_available_mib(meminfo) == 64000
    meminfo.write_text("MemTotal: 1 kB\n")
    assert mem_available_mib(meminfo) is None
    assert mem_available_mib(tmp_path / "absent") is None


def test_the_simulation_wins_when_it_says(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable: 2048 kB\n")

    class Sim:
        value: int | None = 5000

        def mem_available_mib(self) -> int | None:
            return self.value

    sim = Sim()
    available = host_memory(sim, meminfo)
    assert available() == 5000
    sim.value = None
    assert available() == 2
    assert host_memory(None, meminfo)() == 2


def test_this_host() -> None:
    value = mem_available_mib()
    assert value is not None and value > 0
