"""The executor of gpud/life/steps.py: which steps count as done when one fails, and an undo list
that goes on past a failed undo and ends at a Halt."""

from __future__ import annotations

import asyncio

import pytest

from gpud.core.actions import Action
from gpud.errors import GpudError
from gpud.life.steps import Halt, carry_out, undo_all

STEPS = [Action("stop", "old", "a"), Action("start", "new", "b"), Action("start", "new", "c")]


def run_until(fails_at: str, *, count_begun: bool) -> tuple[list[str], list[str]]:
    did: list[str] = []
    done: list[Action] = []

    async def do(a: Action) -> None:
        assert a.serve is not None
        if a.serve == fails_at:
            raise GpudError(f"{a.serve} failed")
        did.append(a.serve)

    async def main() -> None:
        with pytest.raises(GpudError, match="b failed"):
            await carry_out(STEPS, do, done, count_begun=count_begun)

    asyncio.run(main())
    return did, [a.serve or "" for a in done]


def test_a_failed_step_ends_the_list_and_counts_as_done_only_when_begun_counts() -> None:
    assert run_until("b", count_begun=True) == (["a"], ["a", "b"])  # apply: b half-done
    assert run_until("b", count_begun=False) == (["a"], ["a"])  # preemption: b left as it is


def test_the_undo_list_goes_on_past_a_failure_and_ends_at_a_halt() -> None:
    undos = [Action("stop", "new", n, rollback=True) for n in ("x", "y", "z", "w")]
    did: list[str] = []

    async def do(a: Action) -> None:
        assert a.serve is not None
        if a.serve == "y":
            raise GpudError("y would not stop")
        if a.serve == "z":
            raise Halt
        did.append(a.serve)

    tried = asyncio.run(undo_all(undos, do))
    assert did == ["x"]
    assert [(a.serve, exc.message if exc else None) for a, exc in tried] == [
        ("x", None), ("y", "y would not stop")]
