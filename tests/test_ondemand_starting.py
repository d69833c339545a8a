"""A request for a serve that is starting waits for it, whoever started it (gpud.server.ondemand):
a boot's or an operator's launch under way, the health wait of a restart after a crash, or gpud
itself still reconciling; a start that fails answers the waiting requests with its reason at
once. (OnDemand with a fake service and supervisor.)"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any, cast

from gpud.core.vocab import ADMITTED, FAILED, RUNNING, STARTING
from gpud.server.ondemand import OnDemand
from tests.test_bringup import BringUps, Clock, FakeService

SETTLE_S = 0.2


class Launching(BringUps):
    """A supervisor with someone else's launch (or restart's health wait) of each serve under
    way: a request must not start it again."""

    def __init__(self) -> None:
        super().__init__()
        self.launching = True
        self.watching = False

    def life(self, serve: str) -> Any:
        return SimpleNamespace(phase="idle", launching=self.launching, watching=self.watching)

    async def start(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("a serve whose start is under way is not started again")


def rig() -> tuple[OnDemand, FakeService, Launching]:
    svc = FakeService(Clock())
    sup = Launching()
    return OnDemand(cast(Any, svc), cast(Any, sup)), svc, sup


async def test_a_request_waits_for_a_launch_under_way() -> None:
    """The serve is admitted and its launch (a boot's, behind another start on its device) is
    under way: the request waits, and goes once it is running."""
    od, svc, sup = rig()
    svc.set("od", ADMITTED)
    waiting = asyncio.ensure_future(od.ensure("od"))
    await asyncio.sleep(SETTLE_S)
    assert not waiting.done()
    svc.set("od", STARTING)
    od.changed()
    await asyncio.sleep(SETTLE_S)
    assert not waiting.done()
    sup.launching = False
    svc.set("od", RUNNING)
    od.changed()
    assert (await asyncio.wait_for(waiting, 5)).status == 204


async def test_a_failed_start_answers_the_waiting_requests_with_its_reason_at_once() -> None:
    od, svc, sup = rig()
    svc.set("od", ADMITTED)
    waiting = [asyncio.ensure_future(od.ensure("od")) for _ in range(3)]
    await asyncio.sleep(SETTLE_S)
    sup.launching = False
    svc.set("od", FAILED, "unhealthy: no 200 from /health within 30 s")
    od.changed()
    replies = await asyncio.wait_for(asyncio.gather(*waiting), 5)
    for reply in replies:
        assert reply.status == 403
        body = json.loads(reply.body)  # type: ignore[arg-type]
        assert "no 200 from /health within 30 s" in body["error"]["message"], body


async def test_a_restart_after_a_crash_is_waited_for() -> None:
    """The unit restarted after a crash; gpud waits for its health (life.watching)."""
    od, svc, sup = rig()
    sup.launching, sup.watching = False, True
    svc.set("od", FAILED, "exited: status 1")
    waiting = asyncio.ensure_future(od.ensure("od"))
    await asyncio.sleep(SETTLE_S)
    assert not waiting.done()
    sup.watching = False
    svc.set("od", RUNNING)
    od.changed()
    assert (await asyncio.wait_for(waiting, 5)).status == 204


async def test_a_request_while_gpud_reconciles_waits_for_it() -> None:
    od, svc, sup = rig()
    sup.launching = False
    svc.ready = False
    svc.set("od", RUNNING)  # adopted, but gpud is not ready yet: the request is let through
    assert (await od.ensure("od")).status == 204
    svc.set("od", STARTING)
    sup.launching = True
    waiting = asyncio.ensure_future(od.ensure("od"))
    await asyncio.sleep(SETTLE_S)
    assert not waiting.done()  # before: 403 "gpud is starting" at once
    svc.ready = True
    od.changed()
    await asyncio.sleep(SETTLE_S)
    assert not waiting.done()  # ready: now it waits for the start
    sup.launching = False
    svc.set("od", RUNNING)
    od.changed()
    assert (await asyncio.wait_for(waiting, 5)).status == 204
