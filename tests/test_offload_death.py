"""A plan worker that dies says how: the signal that killed it, not a guess."""

from __future__ import annotations

import os
import signal

import pytest

from gpud.errors import GpudError
from gpud.life.offload import Offload


def die_by(signum: int) -> None:
    os.kill(os.getpid(), signum)


def exit_with(status: int) -> None:
    os._exit(status)


@pytest.mark.parametrize(("fn", "arg", "said"), [
    (die_by, signal.SIGKILL, "killed by signal SIGKILL (the kernel's OOM killer sends it)"),
    (die_by, signal.SIGSEGV, "killed by signal SIGSEGV"),
    (exit_with, 3, "exited with status 3"),
])
async def test_a_dead_plan_worker_says_how_it_died(fn: object, arg: int, said: str) -> None:
    off = Offload(workers=1)
    try:
        with pytest.raises(GpudError) as caught:
            await off.in_process(fn, arg)  # type: ignore[arg-type]
        assert f"the worker process making the plan died ({said})" in caught.value.message
        assert "out of memory?" not in caught.value.message
        # the next plan gets new workers
        assert await off.in_process(abs, -2) == 2
    finally:
        off.close()
