"""Waits in the router's queue that cannot be lost (gpud.server.ondemand, `_wait_turn`): a
waiting serve looks again on the next change or its next deadline, whichever is first: memory
freed just after a refused try is tried once the retry's hold ends, and a victim's
router.min_awake_s ending brings the head up with no other change. One turn per waiting serve,
shared by all its requests. (OnDemand with a fake service and supervisor, real time.)"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, cast

from gpud.core.lifecycle import IDLE_LIFE
from gpud.core.serverecord import Put
from gpud.core.vocab import DECLARED, RUNNING
from gpud.errors import Denied
from gpud.server.ondemand import QUEUE_RETRY_S, OnDemand
from tests.test_bringup import BringUps, Clock, FakeService

CAPACITY = 31607
MIN_AWAKE_S = 100.0


def spec(vram_mib: int) -> Any:
    return SimpleNamespace(on_demand=True, preempt=False, start_timeout_s=30.0, priority=5,
                           all_roles=("r",), sleep_level=0, preemptible="sleep",
                           vram_mib=vram_mib)


class Room(FakeService):
    """A role of CAPACITY MiB: each running serve holds its vram_mib; `other` holds some."""

    other_mib = 0

    def free_for(self, serve: str, role: str) -> int:
        held = sum(self.config.serves[n].vram_mib for n, st in self.states.items()
                   if st == RUNNING and n != serve)
        return CAPACITY - held - self.other_mib

    @property
    def ledger(self) -> Any:
        return SimpleNamespace(
            roles={"r": SimpleNamespace(capacity_mib=CAPACITY, reserve_mib=0)},
            reservations={n: SimpleNamespace(mib=self.config.serves[n].vram_mib, all_roles=("r",))
                          for n, st in self.states.items() if st == RUNNING})

    @ledger.setter
    def ledger(self, _default: Any) -> None:
        """FakeService's default figures: this room's are the ones above."""


class Admits(BringUps):
    """A supervisor that starts a serve when it fits (else refuses it for memory: Denied), and
    stops one at once."""

    def __init__(self, svc: Room) -> None:
        super().__init__()
        self.svc = svc
        self.starts: list[tuple[str, float]] = []

    async def start(self, serve: str, uid: int | None, *, wait: bool = False,
                    preempt: bool = False) -> None:
        self.starts.append((serve, time.monotonic()))
        need, free = self.svc.config.serves[serve].vram_mib, self.svc.free_for(serve, "r")
        if need > free:
            raise Denied(f"{serve} denied on r: need {need} MiB, free {free} MiB",
                         {"serve": serve, "bound": "ledger", "need_mib": need,
                          "free_mib": free})
        self.svc.set(serve, RUNNING)

    async def stop(self, serve: str, uid: int | None, **_kw: Any) -> None:
        self.svc.set(serve, DECLARED)

    def life(self, serve: str) -> Any:
        return IDLE_LIFE


def rig(up_for_s: float) -> tuple[OnDemand, Room, Admits]:
    """a (20000 MiB) running, brought up by a request UP_FOR_S ago (its count of requests in
    flight unknown: busy); b (20000 MiB) does not fit beside it."""
    svc = Room(Clock())
    svc.config = SimpleNamespace(
        router=SimpleNamespace(max_queued=8, queue_timeout_s=30, min_awake_s=MIN_AWAKE_S),
        serves={"a": spec(20000), "b": spec(20000)})
    svc.serve_spec = lambda name: svc.config.serves[name]  # type: ignore[method-assign]
    svc.set("a", RUNNING)
    sup = Admits(svc)
    od = OnDemand(cast(Any, svc), cast(Any, sup), clock=time.monotonic)
    up_at = time.monotonic() - up_for_s
    svc.records.apply("a", Put(demand=replace(svc.records.demand("a"), up_at=up_at)))
    return od, svc, sup


async def test_memory_freed_just_after_a_refused_try_is_tried_within_a_second() -> None:
    """b waits (a is protected for 100 s); 0.5 s after b's refused try, a's memory is freed
    otherwise (an operator's stop) and the change fires: b is up within about a second of its
    try. (Before: the change came within QUEUE_RETRY_S of the try and was used up without one;
    b waited for a's min_awake_s.)"""
    od, svc, sup = rig(up_for_s=0.0)
    waiting = asyncio.ensure_future(od.ensure("b"))
    while not od.queued.get("b"):
        await asyncio.sleep(0.01)
    refused_at = sup.starts[-1][1]
    await asyncio.sleep(max(0.0, refused_at + 0.5 - time.monotonic()))
    svc.set("a", DECLARED)  # stopped by its operator
    od.changed()
    reply = await asyncio.wait_for(waiting, 5)
    took = time.monotonic() - refused_at
    assert reply.status == 204 and svc.state_of("b") == RUNNING
    assert took < QUEUE_RETRY_S + 0.5, took


async def test_a_victims_min_awake_ending_brings_the_head_up_with_no_other_change() -> None:
    """a's min_awake_s ends 1 s after b begins to wait, and nothing else happens: b evicts a
    and is up within about a second."""
    od, svc, _sup = rig(up_for_s=MIN_AWAKE_S - 1.0)
    began = time.monotonic()
    reply = await asyncio.wait_for(od.ensure("b"), 5)
    took = time.monotonic() - began
    assert reply.status == 204 and svc.state_of("b") == RUNNING and svc.state_of("a") == DECLARED
    assert 0.9 <= took < 1.5, took
    assert od.counts.evictions == {"a": 1}


async def test_the_requests_waiting_for_one_serve_share_one_turn() -> None:
    """Eight requests for b wait while changes come ten times a second (nothing b can use):
    b is tried at most once per QUEUE_RETRY_S for all of them, not once per request; once
    a's memory is freed, all eight are answered."""
    od, svc, sup = rig(up_for_s=0.0)
    waiting = [asyncio.ensure_future(od.ensure("b")) for _ in range(8)]
    while len(od.queued.get("b", ())) < 8:
        await asyncio.sleep(0.01)
    began, tries = time.monotonic(), len(sup.starts)
    while time.monotonic() - began < 2.5:
        od.changed()
        await asyncio.sleep(0.1)
    window = [t for _, t in sup.starts[tries:]]
    assert len(window) <= 2.5 / QUEUE_RETRY_S + 1, window
    svc.set("a", DECLARED)
    od.changed()
    replies = await asyncio.wait_for(asyncio.gather(*waiting), 5)
    assert [r.status for r in replies] == [204] * 8
