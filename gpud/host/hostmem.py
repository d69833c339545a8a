"""The host's RAM as a budget: a level-1 sleep parks a serve's weights there (vLLM's sleep mode
backs them up in CPU memory), so gpud asks MemAvailable before it asks vLLM to sleep."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

MEMINFO = Path("/proc/meminfo")


def mem_available_mib(path: Path = MEMINFO) -> int | None:
    """MemAvailable from /proc/meminfo (kB there), in MiB; None when it cannot be read."""
    try:
        text = path.read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key == "MemAvailable":
            fields = rest.split()
            if fields and fields[0].isdigit():
                return int(fields[0]) // 1024
    return None


def host_memory(backend: Any, path: Path = MEMINFO) -> Callable[[], int | None]:
    """MemAvailable as gpud sees it: the simulation's, when its state file sets one, else the
    host's own."""
    simulated = getattr(backend, "mem_available_mib", None)

    def available() -> int | None:
        if callable(simulated):
            value = simulated()
            if isinstance(value, int):
                return value
        return mem_available_mib(path)

    return available
