"""The lock order as code (gpud.locks): coordination, then a serve's, then the devices'."""

from __future__ import annotations

import asyncio

import pytest

from gpud.locks import LockOrderError, Locks


async def test_the_order_is_enforced() -> None:
    locks = Locks()
    async with locks.coordination(), locks.serve("a"), locks.devices(["d1", "d0"]):
        assert [n for _r, n in locks.held_by_me()] == ["", "a", "d0", "d1"]
    async with locks.devices(["d0"]):
        with pytest.raises(LockOrderError, match="serve 'a' taken while holding device 'd0'"):
            async with locks.serve("a"):
                pass
        with pytest.raises(LockOrderError, match="device 'd1' taken while holding device"):
            async with locks.devices(["d1"]):
                pass
    async with locks.serve("a"):
        with pytest.raises(LockOrderError, match="coordination '' taken while holding serve"):
            async with locks.coordination():
                pass
        with pytest.raises(LockOrderError, match="serve 'b' taken while holding serve 'a'"):
            async with locks.serve("b"):
                pass
    async with locks.coordination(), locks.serve("a"), locks.serve("b"):
        pass  # a preemption: its victims' locks under coordination
    assert locks.held_by_me() == []


async def test_a_task_holding_a_lock_takes_it_again_and_others_wait() -> None:
    locks = Locks()
    order: list[str] = []

    async def other() -> None:
        async with locks.serve("a"):
            order.append("other")

    async with locks.serve("a"):
        task = asyncio.get_running_loop().create_task(other())
        async with locks.serve("a"), locks.devices(["d"]):  # re-entered by its holder
            await asyncio.sleep(0)
            assert locks.serve("a").locked()
            order.append("holder")
        assert locks.serve("a").locked()  # the inner exit did not release the outer hold
    await task
    assert order == ["holder", "other"]
    assert not locks.serve("a").locked() and not locks.devices(["d"]).locked()
