"""Wake-ups per serve (gpud.life.ondemand, `changed`; gpud.life.pulse.Wakeups): a change that
names a serve wakes the waiting serves that share one of its roles, and those the queue now lets
go (its head, the serves that backfill); no other. So the cost of a change grows with the
waiters on its roles, not with every waiter. (OnDemand with a fake service and supervisor on
one role per device, real time.)

A waiting serve's looks are counted as its asks of the supervisor for its bring-up under way
(`bringup(serve)`): once per look of its turn (`_wait_turn`), once per try."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, cast

import pytest

import gpud.life.ondemand
from gpud.core.serverecord import Put
from gpud.core.vocab import DECLARED, RUNNING
from gpud.errors import Denied, Unavailable
from gpud.server.ondemand import OnDemand
from tests.test_bringup import Clock, FakeService
from tests.test_queue_waits import Admits

CAPACITY = 31607
MIN_AWAKE_S = 100.0


def spec(vram_mib: int, role: str) -> Any:
    return SimpleNamespace(on_demand=True, preempt=False, start_timeout_s=30.0, priority=5,
                           all_roles=(role,), sleep_level=0, preemptible="sleep",
                           vram_mib=vram_mib)


class Devices(FakeService):
    """One role of CAPACITY MiB per device: each running serve holds its vram_mib on its role."""

    def free_for(self, serve: str, role: str) -> int:
        held = sum(self.config.serves[n].vram_mib for n, st in self.states.items()
                   if st == RUNNING and n != serve and role in self.config.serves[n].all_roles)
        return CAPACITY - held

    @property
    def ledger(self) -> Any:
        serves = self.config.serves
        return SimpleNamespace(
            roles={r: SimpleNamespace(capacity_mib=CAPACITY, reserve_mib=0)
                   for s in serves.values() for r in s.all_roles},
            reservations={n: SimpleNamespace(mib=serves[n].vram_mib, all_roles=serves[n].all_roles)
                          for n, st in self.states.items() if st == RUNNING})

    @ledger.setter
    def ledger(self, _default: Any) -> None:
        """FakeService's default figures: these devices' are the ones above."""


class Counted(Admits):
    """Admits on each serve's own role, counting each serve's asks for its bring-up (a look of
    its turn, or a try). A start decides at once, and ends once GATE is set."""

    def __init__(self, svc: Any) -> None:
        super().__init__(svc)
        self.looks: Counter[str] = Counter()
        self.gate = asyncio.Event()
        self.gate.set()

    def bringup(self, serve: str) -> asyncio.Task[None] | None:
        self.looks[serve] += 1
        return super().bringup(serve)

    async def start(self, serve: str, uid: int | None, *, wait: bool = False,
                    preempt: bool = False) -> None:
        self.starts.append((serve, time.monotonic()))
        spec_ = self.svc.config.serves[serve]
        refused = None
        for role in spec_.all_roles:
            free = self.svc.free_for(serve, role)
            if spec_.vram_mib > free:
                refused = Denied(f"{serve} denied on {role}: need {spec_.vram_mib} MiB, free "
                                 f"{free} MiB", {"serve": serve, "bound": "ledger",
                                                 "need_mib": spec_.vram_mib, "free_mib": free})
        await self.gate.wait()
        if refused is not None:
            raise refused
        self.svc.set(serve, RUNNING)


def rig(n: int, *, evictable: tuple[int, ...] = ()) -> tuple[OnDemand, Devices, Counted]:
    """N devices, role rI each: aI (20000 MiB) running there, brought up by a request just now
    (protected for MIN_AWAKE_S; long ago for those in EVICTABLE), and wI (20000 MiB), which
    does not fit beside it."""
    svc = Devices(Clock())
    serves = {}
    for i in range(n):
        serves[f"a{i}"] = spec(20000, f"r{i}")
        serves[f"w{i}"] = spec(20000, f"r{i}")
    svc.config = SimpleNamespace(
        router=SimpleNamespace(max_queued=100, queue_timeout_s=30, min_awake_s=MIN_AWAKE_S),
        serves=serves)
    svc.serve_spec = lambda name: svc.config.serves[name]  # type: ignore[method-assign]
    sup = Counted(svc)
    od = OnDemand(cast(Any, svc), cast(Any, sup), clock=time.monotonic)
    now = time.monotonic()
    for i in range(n):
        svc.set(f"a{i}", RUNNING)
        up_at = now - 10 * MIN_AWAKE_S if i in evictable else now
        svc.records.apply(f"a{i}", Put(demand=replace(svc.records.demand(f"a{i}"), up_at=up_at)))
    return od, svc, sup


async def settle() -> None:
    """Run the event loop until what was woken has looked (no step here waits on time)."""
    for _ in range(100):
        await asyncio.sleep(0)


@pytest.fixture
def no_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused try is not retried within the test (QUEUE_RETRY_S an hour): every look that is
    counted is a change's."""
    monkeypatch.setattr(gpud.life.ondemand, "QUEUE_RETRY_S", 3600.0)


async def waiting(od: OnDemand, names: list[str], per_serve: int = 1) -> list[asyncio.Future[Any]]:
    futures = [asyncio.ensure_future(od.ensure(name)) for name in names for _ in range(per_serve)]
    await settle()
    assert all(len(od.queued.get(name, ())) == per_serve for name in names), od.queued
    return futures


@pytest.mark.usefixtures("no_retry")
async def test_a_change_on_a_role_a_serve_does_not_use_does_not_wake_it() -> None:
    """w0 (the head) and w1 wait, each on its own device. A change of a0 (device r0) wakes
    w0's turn and not w1's; one of a1 wakes w1's."""
    od, _svc, sup = rig(2)
    futures = await waiting(od, ["w0", "w1"])
    before = dict(sup.looks)
    od.changed(("a0",))
    await settle()
    assert sup.looks["w1"] == before["w1"], "a change on r0 woke w1, which waits on r1"
    assert sup.looks["w0"] > before["w0"], "a change on r0 did not wake w0, which waits on r0"
    before = dict(sup.looks)
    od.changed(("a1",))
    await settle()
    assert sup.looks["w1"] == before["w1"] + 1
    assert sup.looks["w0"] == before["w0"]
    for f in futures:
        f.cancel()
    await asyncio.gather(*futures, return_exceptions=True)


@pytest.mark.usefixtures("no_retry")
@pytest.mark.parametrize("per_serve", [1, 10])
async def test_one_change_on_one_role_wakes_the_one_serve_waiting_there(per_serve: int) -> None:
    """Ten serves wait, each on its own device (PER_SERVE requests each). Twenty changes of a5
    (device r5) wake w5's turn twenty times and no other serve's: the cost of a change is that
    of the waiters on its role (one turn for all of a serve's requests), not of every waiter."""
    od, _svc, sup = rig(10)
    names = [f"w{i}" for i in range(10)]
    futures = await waiting(od, names, per_serve)
    before = Counter(sup.looks)
    for _ in range(20):
        od.changed(("a5",))
        await settle()
    woken = {n: sup.looks[n] - before[n] for n in names if sup.looks[n] != before[n]}
    assert woken == {"w5": 20}
    for f in futures:
        f.cancel()
    await asyncio.gather(*futures, return_exceptions=True)


@pytest.mark.usefixtures("no_retry")
async def test_a_change_that_names_no_serve_wakes_every_waiting_serve() -> None:
    """A reload or gpud becoming ready names no serve: every waiting serve looks again."""
    od, _svc, sup = rig(3)
    names = ["w0", "w1", "w2"]
    futures = await waiting(od, names)
    before = Counter(sup.looks)
    od.changed()
    await settle()
    assert all(sup.looks[n] > before[n] for n in names), (before, sup.looks)
    for f in futures:
        f.cancel()
    await asyncio.gather(*futures, return_exceptions=True)


@pytest.mark.usefixtures("no_retry")
async def test_the_next_head_is_woken_when_the_head_leaves() -> None:
    """w0 is the head; w1 waits behind it on another device, though a1 may be evicted now.
    w0's one request goes away (its client hung up): nothing on r1 changed, yet w1 is woken as
    the new head, evicts a1 and is up."""
    od, svc, _sup = rig(2, evictable=(1,))
    gone = asyncio.get_running_loop().create_future()
    first = asyncio.ensure_future(od.ensure("w0", gone=gone))
    await settle()
    second = asyncio.ensure_future(od.ensure("w1"))
    await settle()
    assert svc.state_of("w1") != RUNNING and od.queued.get("w1"), "w1 went before the head"
    gone.set_result(None)
    assert (await asyncio.wait_for(first, 5)).status == 503
    reply = await asyncio.wait_for(second, 5)
    assert reply.status == 204 and svc.state_of("w1") == RUNNING
    assert svc.state_of("a1") == DECLARED and svc.state_of("a0") == RUNNING


class SlowStops(Counted):
    """Counted, whose stops end when the test releases them."""

    def __init__(self, svc: Any) -> None:
        super().__init__(svc)
        self.release = asyncio.Event()

    async def stop(self, serve: str, uid: int | None, **kw: Any) -> None:
        await self.release.wait()
        await super().stop(serve, uid, **kw)


async def test_a_serve_that_fits_while_another_swaps_goes_when_the_swap_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """w0, the head, evicts a0 (its stop held open by the test). w1 (device r1, free) asks
    meanwhile: no serve backfills during a swap, so it waits (with no deadline: until the swap
    ends). The swap ends (w0 up), and nothing on r1 changes: w1 is woken by the swap's end and
    is up (its retry's hold: 20 ms here)."""
    monkeypatch.setattr(gpud.life.ondemand, "QUEUE_RETRY_S", 0.02)
    od, svc, _ = rig(2, evictable=(0,))
    sup = SlowStops(svc)
    od.sup = cast(Any, sup)
    svc.set("a1", DECLARED)
    first = asyncio.ensure_future(od.ensure("w0"))
    await settle()
    assert od._swapping is not None, "w0 is not evicting a0"
    second = asyncio.ensure_future(od.ensure("w1"))
    await settle()
    assert od.queued.get("w1") and svc.state_of("w1") != RUNNING, "w1 went during a swap"
    sup.release.set()
    replies = await asyncio.wait_for(asyncio.gather(first, second), 5)
    assert [r.status for r in replies] == [204, 204]
    assert svc.state_of("w0") == RUNNING and svc.state_of("w1") == RUNNING


async def test_a_change_that_comes_while_the_head_tries_is_not_lost(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """w0 (11000 MiB) waits on r0 beside a0 and x0, both protected for MIN_AWAKE_S. Its retry
    is refused, and while that try ends (after its decision), x0 is stopped by its operator:
    the change comes while w0 awaits its try, not its pulse. w0 looks again and is up after its
    retry's hold (50 ms here), not after a0's min_awake_s."""
    monkeypatch.setattr(gpud.life.ondemand, "QUEUE_RETRY_S", 0.05)
    od, svc, sup = rig(1)
    svc.config.serves["w0"] = spec(11000, "r0")
    svc.config.serves["x0"] = spec(10000, "r0")
    svc.set("x0", RUNNING)
    now = time.monotonic()
    svc.records.apply("x0", Put(demand=replace(svc.records.demand("x0"), up_at=now)))
    waiter = asyncio.ensure_future(od.ensure("w0"))
    await settle()
    assert od.queued.get("w0") and len(sup.starts) == 1, sup.starts
    sup.gate.clear()
    while len(sup.starts) < 2:  # its retry, once the hold is over: decided, not yet ended
        await asyncio.sleep(0.01)
    svc.set("x0", DECLARED)
    od.changed(("x0",))
    sup.gate.set()
    reply = await asyncio.wait_for(waiter, 5)
    assert reply.status == 204 and svc.state_of("w0") == RUNNING
    assert svc.state_of("a0") == RUNNING


class BusyStops(Counted):
    """Counted, whose stops are refused: the serve is busy (a request in flight at the drain's
    bound)."""

    def __init__(self, svc: Any) -> None:
        super().__init__(svc)
        self.stops = 0

    async def stop(self, serve: str, uid: int | None, **kw: Any) -> None:
        self.stops += 1
        raise Unavailable(f"{serve} is busy", {"serve": serve, "busy": True})


async def test_a_refused_eviction_is_not_tried_again_on_its_own_change() -> None:
    """w0, the head, may evict a0, whose stop is refused (busy). The refusal's own change (a0's
    eviction over) does not make w0 evict a0 again at once: it waits for a0's next change.
    Then a0's count of requests in flight changes (a change of a0): w0 tries again."""
    od, svc, _ = rig(1, evictable=(0,))
    sup = BusyStops(svc)
    od.sup = cast(Any, sup)
    waiter = asyncio.ensure_future(od.ensure("w0"))
    await settle()
    await settle()
    assert sup.stops == 1, sup.stops
    od.changed(("a0",))
    await settle()
    assert sup.stops == 2, sup.stops
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
