"""Expensive work off the event loop, shared fairly between peers.

Parsing and planning a config of up to 1 MiB (POST /v1/plan, apply, reload: 11,919 serves take
about 0.7 s) held the event loop for all of that time: every other request, the health checks
and the watchdog waited behind it, and 40 plans from one reader held GET /v1/status for 15 s.

- A plan, which any reader may ask for, is made in a worker process (`in_process`): the config
  text and what it is planned against (gpud.life.planning.PlanInputs, values only) go in, the JSON
  text of the answer comes back. Not a thread: the TOML parser (compiled) and pydantic's
  validation hold the interpreter lock for up to 0.3 s at a time, and the loop would wait for
  it as it waited for the plan itself.
- Apply and reload (an admin or root, one apply at a time) parse and plan in a worker thread
  (`run`): they need the parsed config back in the daemon, and unpickling 11,919 serves would
  cost the loop about what parsing them does.
- Each peer (uid) may have at most `per_peer` expensive requests under way: one more is answered
  429 `too-many-requests` at once, before its body is read (`slot`). Root included.

What runs off the loop only reads values: the config text, the config in force and the ledger
(both immutable, replaced whole by the loop, never changed in place), the serve states copied on
the loop, and the observer's latest sample (also replaced whole). Everything that changes the
ledger stays on the loop, whose store has one writer.

`inline` runs everything on the loop with no limit, as gpud did before: only for the benchmark
that measures the difference (bench/fig_flood.py, GPUD_EXPENSIVE_INLINE=1).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import multiprocessing
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.process import BaseProcess
from typing import TypeVar

from gpud.errors import GpudError, TooManyRequests

log = logging.getLogger("gpud.api")

T = TypeVar("T")

# Workers of each kind: the threads share the interpreter lock with the loop, so few; work beyond
# them waits in their queue.
WORKERS = 2
PER_PEER = 2
# The benchmark's switch (see the module's docstring): the old behaviour, to compare against.
INLINE_ENV = "GPUD_EXPENSIVE_INLINE"


class Offload:
    def __init__(self, *, workers: int = WORKERS, per_peer: int = PER_PEER,
                 inline: bool = False) -> None:
        self.per_peer = per_peer
        self.inline = inline
        self.under_way: dict[int | None, int] = {}
        self.refused = 0
        self._pool: ThreadPoolExecutor | None = None
        self._processes: ProcessPoolExecutor | None = None
        self._workers = workers

    @contextlib.asynccontextmanager
    async def slot(self, uid: int | None, what: str) -> AsyncIterator[None]:
        """Hold one of the peer's `per_peer` slots for an expensive request, or raise
        TooManyRequests (429) when it has none left."""
        if self.inline:
            yield
            return
        held = self.under_way.get(uid, 0)
        if held >= self.per_peer:
            self.refused += 1
            if self.refused in (1, 10, 100) or self.refused % 1000 == 0:
                log.warning("uid %s has %d expensive requests under way: refusing more "
                            "(%d refused so far)", uid, held, self.refused)
            raise TooManyRequests(
                f"uid {uid} has {held} expensive requests under way (plan, apply, reload), "
                f"as many as a peer may: retry when one has been answered",
                {"uid": uid, "limit": self.per_peer, "request": what, "retry": True})
        self.under_way[uid] = held + 1
        try:
            yield
        finally:
            left = self.under_way.get(uid, 1) - 1
            if left > 0:
                self.under_way[uid] = left
            else:
                self.under_way.pop(uid, None)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """fn(*args) in a worker thread (on the loop when `inline`)."""
        if self.inline:
            return fn(*args)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="gpud-expensive")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args))

    async def in_process(self, fn: Callable[..., T], *args: object) -> T:
        """fn(*args) in a worker process (on the loop when `inline`): for the work a reader
        may ask for (POST /v1/plan), which must not hold the interpreter lock the loop needs.
        fn and its arguments are pickled: values only. A GpudError it raises comes back whole."""
        if self.inline:
            return fn(*args)
        if self._processes is None:
            # spawned, not forked: a fork of a process with threads and an event loop could
            # inherit a lock held by another thread
            self._processes = ProcessPoolExecutor(
                self._workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=_worker_start, initargs=(os.getpid(),))
            for _ in range(self._workers - 1):
                # every worker starts now, not the second one at the second plan: starting one
                # (an interpreter, pydantic, gpud's config models) takes the better part of a
                # second, which a plan would wait for
                self._processes.submit(_started)
        loop = asyncio.get_running_loop()
        pool = self._processes
        future = loop.run_in_executor(pool, functools.partial(fn, *args))
        # The workers, taken now (the submit has started them): once one dies, the pool's
        # manager thread may forget them before they are read, and with them how it died.
        workers = list((getattr(pool, "_processes", None) or {}).values())
        try:
            return await future
        except BrokenProcessPool as exc:
            self._processes = None  # the next request starts new workers
            how = await asyncio.to_thread(worker_death, workers)
            raise GpudError(f"the worker process making the plan died ({how}): try again",
                            {"death": how}) from exc

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self._processes is not None:
            self._processes.shutdown(wait=False, cancel_futures=True)
            self._processes = None


INLINE = Offload(inline=True)

# How long the pool's workers are waited for, once one died, to tell how it died.
DEATH_WAIT_S = 1.0


def worker_death(workers: Sequence[BaseProcess]) -> str:
    """How a broken pool's worker died: "killed by signal SIGKILL (the kernel's OOM killer
    sends it)", "exited with status N", or "cause unknown". The pool ends the workers still
    alive with SIGTERM once one has died (CPython's concurrent/futures/process.py,
    terminate_broken), so a SIGTERM counts only when no worker died otherwise.

    WORKERS: the pool's worker processes (its `_processes`, pid -> multiprocessing.Process, in
    CPython since 3.2), taken when the work was submitted: the exit status is only known to
    the parent that waits for it."""
    codes: list[int] = []
    deadline = time.monotonic() + DEATH_WAIT_S
    for proc in workers:
        with contextlib.suppress(Exception):
            proc.join(max(0.0, deadline - time.monotonic()))
            # The pool's manager thread may reap it first (waitpid answers ECHILD here): its
            # status lands on the same process object a moment later.
            while proc.exitcode is None and time.monotonic() < deadline:
                time.sleep(0.01)
            if proc.exitcode is not None:
                codes.append(int(proc.exitcode))
    other = [c for c in codes if c != -signal.SIGTERM and c != 0]
    code = other[0] if other else (-signal.SIGTERM if -signal.SIGTERM in codes else None)
    if code is None:
        return "cause unknown"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (the kernel's OOM killer sends it)" if -code == signal.SIGKILL else ""
        return f"killed by signal {name}{hint}"
    return f"exited with status {code}"

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _worker_start(parent: int) -> None:
    """In each worker process: end when gpud ends, however it ends. A worker waits on a queue
    whose write end it holds itself, so it would never see gpud go (SIGKILL, the watchdog), and
    gpud.service's KillMode=process leaves the rest of the cgroup alone. Then load what a plan
    needs, before the first plan."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # gone before the line above
        os._exit(0)
    import gpud.life.planning  # noqa: F401 - imported for its cost, paid here


def _started() -> None:
    """Nothing: submitted so that the pool starts its workers."""
