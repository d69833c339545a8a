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

   A device's lock has two modes. **Exclusive** for whatever profiles or changes the device's
   memory outside a reservation's own growth: a util-sized start (vLLM sizes its KV cache from
   what it measures while it profiles), a stop, a sleep, a wake. **Shared** for a start whose KV
   cache is sized in bytes (`vllm.kv_cache_mib` → `--kv-cache-memory-bytes`): vLLM then skips
   the memory profiling (vllm/v1/worker/gpu_worker.py, Worker.determine_available_memory:
   "... as specified by kv_cache_memory_bytes config and skipped memory profiling"), its only
   check being free memory ≥ util x total at its start, which the ledger keeps true for every
   admitted serve at once. Such starts share the device among themselves, never with an
   exclusive holder. Waiters are served first come, first served: a shared request behind a
   queued exclusive one waits for it (no exclusive request starves), so the boot's priority
   order is the order of the starts.

A task taking a lock it holds already goes on (an action that calls another of the same serve);
a task taking a lock of an earlier rank than one it holds is a bug, raised as LockOrderError
before it can deadlock.
"""

from __future__ import annotations

import asyncio
from collections import deque
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
Task = asyncio.Task[object]


class SharedLock:
    """A first-come-first-served reader/writer lock: any number of shared holders, or one
    exclusive holder; a request is granted only once every request queued before it is."""

    def __init__(self) -> None:
        self._holders: dict[Task, bool] = {}  # task -> exclusive
        self._waiters: deque[tuple[bool, asyncio.Future[None], Task]] = deque()

    def locked(self) -> bool:
        return bool(self._holders)

    def exclusive(self) -> bool:
        return any(self._holders.values())

    def holders(self) -> dict[Task, bool]:
        return dict(self._holders)

    def waiting(self) -> int:
        return len(self._waiters)

    def _fits(self, exclusive: bool) -> bool:
        return not self._holders or (not exclusive and not self.exclusive())

    async def acquire(self, task: Task, *, exclusive: bool) -> None:
        if not self._waiters and self._fits(exclusive):
            self._holders[task] = exclusive
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (exclusive, fut, task)
        self._waiters.append(entry)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(task)  # granted, then cancelled before it ran
            else:
                self._waiters.remove(entry)
                self._grant()  # a shared request behind it may go now
            raise

    def release(self, task: Task) -> None:
        del self._holders[task]
        self._grant()

    def _grant(self) -> None:
        while self._waiters:
            exclusive, fut, task = self._waiters[0]
            if not self._fits(exclusive):
                return
            self._waiters.popleft()
            self._holders[task] = exclusive
            fut.set_result(None)


class Locks:
    def __init__(self) -> None:
        self._locks: dict[Key, asyncio.Lock] = {}
        self._owner: dict[Key, Task] = {}
        self._devices: dict[str, SharedLock] = {}

    def lock(self, rank: Rank, name: str = "") -> asyncio.Lock:
        """The lock itself (for a caller that must hold it across tasks: tests); not a
        device's (see device)."""
        if rank == Rank.DEVICE:
            raise ValueError("a device's lock is a SharedLock: Locks.device")
        return self._locks.setdefault((rank, name), asyncio.Lock())

    def device(self, name: str) -> SharedLock:
        return self._devices.setdefault(name, SharedLock())

    def locked(self, rank: Rank, name: str = "") -> bool:
        if rank == Rank.DEVICE:
            return self.device(name).locked()
        return self.lock(rank, name).locked()

    def coordination(self) -> Taken:
        return Taken(self, [(Rank.COORDINATION, "")])

    def serve(self, name: str) -> Taken:
        return Taken(self, [(Rank.SERVE, name)])

    def devices(self, names: Iterable[str], *, shared: bool = False) -> Taken:
        """The devices' locks, exclusive, or `shared` with other shared holders (a start that
        does not profile: see the module's text)."""
        return Taken(self, [(Rank.DEVICE, n) for n in sorted(set(names))], shared=shared)

    def _held(self, task: object) -> dict[Key, bool]:
        """The keys `task` holds, each with whether it holds it exclusively."""
        held = {k: True for k, t in self._owner.items() if t is task}
        for name, lock in self._devices.items():
            mode = next((m for t, m in lock.holders().items() if t is task), None)
            if mode is not None:
                held[(Rank.DEVICE, name)] = mode
        return held

    def held_by_me(self) -> list[Key]:
        return sorted(self._held(asyncio.current_task()))

    def _check(self, wanted: list[Key], *, shared: bool = False) -> list[Key]:
        """The keys of `wanted` the current task does not hold yet; LockOrderError when taking
        them breaks the order, or asks exclusively for a device it holds shared (two such
        tasks would wait on each other for ever)."""
        task = asyncio.current_task()
        mine = self._held(task)
        held = list(mine)
        for key in wanted:
            if key in mine and not mine[key] and not shared:
                raise LockOrderError(f"lock device {key[1]!r} taken exclusively while holding "
                                     "it shared")
        new = [k for k in wanted if k not in mine]
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
    async def _take(self, wanted: list[Key], *, shared: bool = False) -> AsyncIterator[None]:
        new = self._check(wanted, shared=shared)
        task = asyncio.current_task()
        assert task is not None
        taken: list[Key] = []
        try:
            for key in new:
                if key[0] == Rank.DEVICE:
                    await self.device(key[1]).acquire(task, exclusive=not shared)
                else:
                    await self.lock(*key).acquire()
                    self._owner[key] = task
                taken.append(key)
            yield
        finally:
            for key in reversed(taken):
                if key[0] == Rank.DEVICE:
                    self.device(key[1]).release(task)
                else:
                    del self._owner[key]
                    self.lock(*key).release()


class Taken:
    """`async with locks.serve(name):`; `.locked()` says whether anyone holds it."""

    def __init__(self, locks: Locks, keys: list[Key], *, shared: bool = False) -> None:
        self._locks, self._keys, self._shared = locks, keys, shared
        self._cm: AbstractAsyncContextManager[None] | None = None

    def locked(self) -> bool:
        return any(self._locks.locked(*k) for k in self._keys)

    async def __aenter__(self) -> None:
        cm = self._locks._take(self._keys, shared=self._shared)
        self._cm = cm
        await cm.__aenter__()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        cm = self._cm
        assert cm is not None
        self._cm = None
        await cm.__aexit__(exc_type, exc, tb)
