"""Waiting on conditions, not on clocks: a test that needs something to have happened waits
until it has (bounded, failing with what it waited for), never for a fixed time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

WAIT_S = 10.0


def wait_until(predicate: Callable[[], Any], timeout: float = WAIT_S,
               what: str = "condition", interval: float = 0.01) -> Any:
    """The first true value of `predicate`, checked every `interval` seconds; AssertionError
    naming `what` if it stays false for `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


async def until(predicate: Callable[[], Any], timeout: float = WAIT_S,
                what: str = "condition") -> Any:
    """`wait_until` on the event loop: checked at every turn of the loop (other tasks run in
    between), then every millisecond once a hundred turns have not made it true (a thread's
    work, an executor's)."""
    deadline = time.monotonic() + timeout
    turns = 0
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        turns += 1
        await asyncio.sleep(0 if turns < 100 else 0.001)


def waiters(primitive: asyncio.Lock | asyncio.Event) -> int:
    """How many tasks wait on an asyncio lock or event: the marker that a task has got as far
    as waiting on it. (CPython keeps them in `_waiters`: None or a deque.)"""
    return len(getattr(primitive, "_waiters", None) or ())
