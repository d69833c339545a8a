"""A unit's lines in the journal, read with journalctl (the one reader: calibration reads a
serve's start-up account from it, the supervisor a failed serve's last words).

Each reader answers the messages alone (`-o cat`), of this boot (`-b`), oldest first, and []
when journalctl cannot say (not installed, or no answer in time): a journal that cannot be read
never fails what asked for it.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("gpud.journal")


async def unit_lines(unit: str, *, last: int, timeout_s: float, invocation: str | None = None,
                     sync: bool = False) -> list[str]:
    """The last `last` messages of `unit` in this boot, oldest first; of its run `invocation`
    alone when that is known (the unit's invocation ID). `sync`: `journalctl --sync` first, so
    that what the unit wrote just before systemd reported its exit is in the journal."""
    try:
        if sync:
            flushed = await asyncio.create_subprocess_exec(
                "journalctl", "--sync", stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL)
            await asyncio.wait_for(flushed.wait(), 5)
        match = [f"_SYSTEMD_INVOCATION_ID={invocation}"] if invocation else ["-u", unit]
        proc = await asyncio.create_subprocess_exec(
            "journalctl", "--no-pager", "-b", "-o", "cat", "-n", str(last), *match,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except (OSError, TimeoutError) as exc:
        log.warning("cannot read the journal of %s: %s", unit, exc)
        return []
    return out.decode("utf-8", "replace").splitlines()


async def read_unit_journal(unit: str) -> list[str]:
    """The messages of `unit` in this boot (up to 20000), oldest first: what calibration reads
    vLLM's start-up account from."""
    return await unit_lines(unit, last=20000, timeout_s=30)


async def read_exit_lines(unit: str, invocation: str | None) -> list[str]:
    """The last 60 lines of `unit` (of its `invocation`, when known), oldest first: a failed
    serve's last words. `--sync` first: they may still be on their way to journald when
    systemd reports the exit."""
    return await unit_lines(unit, last=60, timeout_s=10, invocation=invocation, sync=True)
