"""Who may take which lock, in which order: the one owner of the supervisor's locks.

Three ranks, always taken in this order and never the other way round:

1. **coordination**: one lock for every preemption and wake-back (a serve on several roles takes
   part in each of them, and one lock cannot be taken in two orders);
2. **a serve's**: every lifecycle action of that serve (start, stop, restart, the health
   check's restart, sleep, wake, the reconciliation of what it says it is); a second serve's
   lock only under coordination (a preemption stops or puts to sleep its victims while it holds
   the serve it makes room for);
3. **the devices'**: the part of an action that changes a device's memory (a start's load and
   profile window, a stop, a sleep, a wake, a restart), all the devices of the serve at once,
   in sorted order. vLLM instances profiling at once on one GPU mis-size each other (vLLM
   #55827): no neighbour's sleep, wake or stop runs inside a start's window.

A task taking a lock it holds already goes on (an action that calls another of the same serve);
a task taking a lock of an earlier rank than one it holds is a bug, raised as LockOrderError
before it can deadlock.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from enum import IntEnum
from types import TracebackType


class Rank(IntEnum):
    COORDINATION = 0
    SERVE = 1
    DEVICE = 2


class LockOrderError(AssertionError):
    """A lock taken against the order of Rank."""


Key = tuple[Rank, str]


class Locks:
    def __init__(self) -> None:
        self._locks: dict[Key, asyncio.Lock] = {}
        self._owner: dict[Key, asyncio.Task[object]] = {}

    def lock(self, rank: Rank, name: str = "") -> asyncio.Lock:
        """The lock itself (for a caller that must hold it across tasks: tests)."""
        return self._locks.setdefault((rank, name), asyncio.Lock())

    def locked(self, rank: Rank, name: str = "") -> bool:
        return self.lock(rank, name).locked()

    def coordination(self) -> Taken:
        return Taken(self, [(Rank.COORDINATION, "")])

    def serve(self, name: str) -> Taken:
        return Taken(self, [(Rank.SERVE, name)])

    def devices(self, names: Iterable[str]) -> Taken:
        return Taken(self, [(Rank.DEVICE, n) for n in sorted(set(names))])

    def held_by_me(self) -> list[Key]:
        task = asyncio.current_task()
        return sorted(k for k, t in self._owner.items() if t is task)

    def _check(self, wanted: list[Key]) -> list[Key]:
        """The keys of `wanted` the current task does not hold yet; LockOrderError when taking
        them breaks the order."""
        task = asyncio.current_task()
        held = [k for k, t in self._owner.items() if t is task]
        new = [k for k in wanted if self._owner.get(k) is not task]
        for key in new:
            later = [h for h in held if h[0] > key[0]]
            if key[0] == Rank.SERVE and any(h[0] == Rank.SERVE for h in held) \
                    and (Rank.COORDINATION, "") not in held:
                later.append(next(h for h in held if h[0] == Rank.SERVE))
            if key[0] == Rank.DEVICE and any(h[0] == Rank.DEVICE for h in held):
                later.append(next(h for h in held if h[0] == Rank.DEVICE))
            if later:
                raise LockOrderError(f"lock {key[0].name.lower()} {key[1]!r} taken while "
                                     f"holding {', '.join(f'{r.name.lower()} {n!r}' for r, n in later)}")
        return new

    @asynccontextmanager
    async def _take(self, wanted: list[Key]) -> AsyncIterator[None]:
        new = self._check(wanted)
        task = asyncio.current_task()
        assert task is not None
        taken: list[Key] = []
        try:
            for key in new:
                await self.lock(*key).acquire()
                self._owner[key] = task
                taken.append(key)
            yield
        finally:
            for key in reversed(taken):
                del self._owner[key]
                self.lock(*key).release()


class Taken:
    """`async with locks.serve(name):`; `.locked()` says whether anyone holds it."""

    def __init__(self, locks: Locks, keys: list[Key]) -> None:
        self._locks, self._keys = locks, keys
        self._cm: AbstractAsyncContextManager[None] | None = None

    def locked(self) -> bool:
        return any(self._locks.locked(*k) for k in self._keys)

    async def __aenter__(self) -> None:
        cm = self._locks._take(self._keys)
        self._cm = cm
        await cm.__aenter__()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        cm = self._cm
        assert cm is not None
        self._cm = None
        await cm.__aexit__(exc_type, exc, tb)
