"""The lock order as code (gpud.life.locks): coordination, then a serve's, then the devices'."""

from __future__ import annotations

import asyncio

import pytest

from gpud.life.locks import LockOrderError, Locks, Rank


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


async def _until(cond: object) -> None:
    for _ in range(1000):
        if callable(cond) and cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


async def test_shared_holders_go_together_an_exclusive_one_alone_first_come_first_served() -> None:
    """Starts sized in bytes share a device; a profiling start, a stop, a sleep or a wake holds
    it alone; requests are granted in the order they came (the boot's priority order)."""
    locks = Locks()
    inside: set[str] = set()
    seen: list[tuple[str, frozenset[str]]] = []
    release = {n: asyncio.Event() for n in "abcdef"}

    async def take(name: str, shared: bool) -> None:
        async with locks.devices(["d"], shared=shared):
            inside.add(name)
            seen.append((name, frozenset(inside)))
            await release[name].wait()
            inside.discard(name)

    loop = asyncio.get_running_loop()
    # a, b shared; c exclusive; d, e shared; f exclusive
    tasks = [loop.create_task(take(n, n not in "cf")) for n in "abcdef"]
    await _until(lambda: inside == {"a", "b"})
    assert locks.device("d").waiting() == 4  # c queued, d and e behind it (no overtaking)
    release["a"].set()
    await asyncio.sleep(0)
    assert inside == {"b"}  # c waits for b
    release["b"].set()
    await _until(lambda: inside == {"c"})
    assert locks.device("d").exclusive()
    release["c"].set()
    await _until(lambda: inside == {"d", "e"})
    release["d"].set()
    release["e"].set()
    await _until(lambda: inside == {"f"})
    release["f"].set()
    await asyncio.gather(*tasks)
    assert [n for n, _ in seen] == list("abcdef")
    assert dict(seen)["c"] == {"c"} and dict(seen)["f"] == {"f"}
    assert not locks.devices(["d"]).locked()


async def test_a_cancelled_waiter_lets_the_shared_ones_behind_it_go() -> None:
    locks = Locks()
    loop = asyncio.get_running_loop()
    hold = asyncio.Event()
    got: list[str] = []

    async def take(name: str, shared: bool) -> None:
        async with locks.devices(["d"], shared=shared):
            got.append(name)
            await hold.wait()

    first = loop.create_task(take("a", True))
    await _until(lambda: got == ["a"])
    blocker = loop.create_task(take("x", False))
    behind = loop.create_task(take("b", True))
    await _until(lambda: locks.device("d").waiting() == 2)
    blocker.cancel()
    await _until(lambda: got == ["a", "b"])  # b shares with a once x is gone
    hold.set()
    await asyncio.gather(first, behind)
    assert blocker.cancelled() and not locks.device("d").locked()


async def test_shared_holders_keep_the_order_and_never_upgrade() -> None:
    locks = Locks()
    async with locks.serve("a"), locks.devices(["d0", "d1"], shared=True):
        assert locks.held_by_me()[-2:] == [(Rank.DEVICE, "d0"), (Rank.DEVICE, "d1")]
        async with locks.devices(["d0"], shared=True):  # re-entered as it is held
            pass
        with pytest.raises(LockOrderError, match="device 'd0' taken exclusively while holding "
                                                 "it shared"):
            async with locks.devices(["d0"]):
                pass
        with pytest.raises(LockOrderError, match="serve 'b' taken while holding"):
            async with locks.serve("b"):
                pass
    async with locks.devices(["d0"]), locks.devices(["d0"], shared=True):
        pass  # an exclusive holder may take what it holds shared
    assert locks.held_by_me() == [] and not locks.locked(Rank.DEVICE, "d0")
    with pytest.raises(ValueError, match="SharedLock"):
        locks.lock(Rank.DEVICE, "d0")
