"""A change that any number of waiters await together, with no polling.

`fire` says that something a waiter reads may have changed; `until(holds)` returns once `holds()`
is true, looking again only after a fire. The waiters of one change share one future: a waiter
cancelled (its request gone, its timeout over) leaves it, and the others, as they were.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Pulse:
    def __init__(self) -> None:
        self._next: asyncio.Future[None] | None = None
        # How many times a waiter looked (`holds` asked): what the tests count.
        self.looks = 0

    def fire(self) -> None:
        """Something may have changed: every waiter looks again."""
        fut, self._next = self._next, None
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def until(self, holds: Callable[[], bool]) -> None:
        """Return once `holds()` is true (at once if it is now)."""
        while True:
            self.looks += 1
            if holds():
                return
            if self._next is None:
                self._next = asyncio.get_running_loop().create_future()
            # shielded: a waiter cancelled must not cancel the future the others await
            await asyncio.shield(self._next)

    async def next(self) -> None:
        """Return at the next fire (a waiter that decided what it waits for: a change)."""
        self.looks += 1
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._next)
