"""A request through the front waits for a serve without polling: on a sleep or stop settling,
and on a start or wake of someone else's, it looks again only when something it reads changed
(gpud.life.pulse.Pulse, fired by a stored state, a step of a serve's life, a drain's end)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

from gpud.core.lifecycle import Phase
from gpud.core.vocab import FAILED, RUNNING, STARTING, ServeState
from gpud.life.pulse import Pulse
from gpud.server.ondemand import OnDemand
from tests.test_bringup import BringUps, Clock, FakeService

QUIET_S = 0.3  # long enough for a 5 ms poll to read the state dozens of times


class CountingService(FakeService):
    """Counts the state reads: a poll would read it again and again while nothing changes."""

    reads = 0

    def state_of(self, name: str) -> ServeState:
        self.reads += 1
        return super().state_of(name)


class NoStarts(BringUps):
    """A supervisor with someone else's bring-up under way: never asked to start the serve."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = Phase.IDLE

    def life(self, serve: str) -> Any:
        return SimpleNamespace(phase=self.phase, launching=False, watching=False)

    async def start(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("a serve starting already is not started again")


def rig() -> tuple[OnDemand, CountingService, NoStarts]:
    svc = CountingService(Clock())
    sup = NoStarts()
    return OnDemand(cast(Any, svc), cast(Any, sup)), svc, sup


async def test_a_start_under_way_is_awaited_without_reading_the_state_again() -> None:
    od, svc, _sup = rig()
    svc.set("od", STARTING)
    waiters = [asyncio.ensure_future(od.ensure("od")) for _ in range(3)]
    await asyncio.sleep(QUIET_S)
    assert not any(w.done() for w in waiters)
    looks, reads = od.changes.looks, svc.reads
    await asyncio.sleep(QUIET_S)
    assert (od.changes.looks, svc.reads) == (looks, reads), "the wait reads the state on a timer"
    # the one bring-up task all three share waits on it: a few looks, not one per 5 ms
    assert looks <= 6, looks
    svc.set("od", RUNNING)
    od.changed()
    replies = await asyncio.wait_for(asyncio.gather(*waiters), 10)
    assert [r.status for r in replies] == [204, 204, 204]


async def test_a_waiter_gone_leaves_the_others_waiting() -> None:
    od, svc, _sup = rig()
    svc.set("od", STARTING)
    gone = asyncio.ensure_future(od.ensure("od"))
    stays = asyncio.ensure_future(od.ensure("od"))
    await asyncio.sleep(0.05)
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    svc.set("od", FAILED, "crash-loop")
    od.changed()
    reply = await asyncio.wait_for(stays, 10)
    assert reply.status == 403  # its bring-up ended failed, and this waiter heard it


async def test_a_stop_settling_is_waited_out_until_its_life_steps() -> None:
    od, svc, sup = rig()
    svc.set("od", RUNNING)
    sup.phase = Phase.STOPPING
    waiter = asyncio.ensure_future(od.ensure("od"))
    await asyncio.sleep(QUIET_S)
    looks = od.changes.looks
    await asyncio.sleep(QUIET_S)
    assert not waiter.done() and od.changes.looks == looks
    sup.phase = Phase.IDLE  # the stop's end, told as gpud.daemon wires it (watch_lives)
    od.changed()
    assert (await asyncio.wait_for(waiter, 10)).status == 204


async def test_a_pulse_wakes_every_waiter_and_survives_a_cancelled_one() -> None:
    pulse = Pulse()
    flag = {"up": False}
    waiters = [asyncio.ensure_future(pulse.until(lambda: flag["up"])) for _ in range(3)]
    await asyncio.sleep(0)
    waiters[0].cancel()
    await asyncio.gather(waiters[0], return_exceptions=True)
    pulse.fire()  # not yet true: each looks once more and waits again
    await asyncio.sleep(0.05)
    assert not waiters[1].done() and not waiters[2].done()
    flag["up"] = True
    pulse.fire()
    await asyncio.wait_for(asyncio.gather(*waiters[1:]), 10)
    await pulse.until(lambda: True)  # true already: no wait at all


def test_the_bring_up_path_has_no_timer() -> None:
    """No `asyncio.sleep` in the waits of a request for its serve (the router's queue, which
    retries on its own terms, is gpud.core.queue's and not this path)."""
    import ast
    import inspect
    import textwrap

    for method in (OnDemand._up, OnDemand._bring_up, OnDemand._bring_up_once):
        tree = ast.parse(textwrap.dedent(inspect.getsource(method)))
        sleeps = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
                  and isinstance(node.func, ast.Attribute) and node.func.attr == "sleep"]
        assert sleeps == [], (method.__name__, sleeps)


def test_the_on_demand_path_has_no_polling_loop() -> None:
    """Issue 45: the on-demand path, the queue and the idle check wait on changes (the Pulse),
    bounded by a deadline the queue or the idle thresholds name; no `asyncio.sleep` of a
    period anywhere in gpud/server/ondemand.py or the orchestrator it answers for (gpud/life/
    ondemand.py, idle.py, demandview.py; a sleep(0) only yields). Planted: a sleep of 0.05 is
    found."""
    import ast
    from pathlib import Path

    def periods(source: str) -> list[int]:
        found = []
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "sleep" and isinstance(node.func.value, ast.Name) \
                    and node.func.value.id == "asyncio" and not (
                        node.args and isinstance(node.args[0], ast.Constant)
                        and node.args[0].value == 0):
                found.append(node.lineno)
        return found

    gpud = Path(__file__).parents[1] / "gpud"
    source = "\n".join((gpud / path).read_text() for path in (
        "server/ondemand.py", "life/ondemand.py", "life/idle.py", "life/demandview.py"))
    assert periods(source) == []
    assert periods(source + "\nasync def poll():\n    await asyncio.sleep(0.05)\n") != []
    assert periods("async def poll(s):\n    await asyncio.sleep(s)\n") != []
