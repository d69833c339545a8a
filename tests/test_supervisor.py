"""The supervisor's waits, with fakes for observation (no systemd needed)."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace
from typing import Any, cast

import pytest

from gpud.config import Config, DaemonConfig
from gpud.core.lifecycle import ServeLife
from gpud.core.serverecord import Put, Stored
from gpud.life.records import ServeRecords
from gpud.life.supervisor import Handles, Supervisor
from tests.waiting import until, waiters


class StuckObserver:
    """Observation that keeps reporting the stopped serve's draw on the device."""

    available = True

    def __init__(self) -> None:
        self.draws = {"GPU-a": {"old": 2900}}
        self.samples = 0

    async def next_sample(self, timeout: float) -> None:
        self.samples += 1
        await asyncio.sleep(min(timeout, 0.05))


def service(config: Config, **more: Any) -> Any:
    """What the supervisor reads and writes of the service here: the config, and each serve's
    record (gpud.life.records, as the service keeps them)."""
    return SimpleNamespace(config=config, records=more.pop("records", ServeRecords()), **more)


def returning(sup: Supervisor, serve: str, *devices: str) -> Handles:
    """The serve's memory is on its way back to `devices`; the handles of its work."""
    sup.svc.records.apply(serve, Put(life=ServeLife(returning=frozenset(devices))))
    return sup.runtime.handles(serve)


def checking(sup: Supervisor) -> set[str]:
    """The serves whose health check is in flight."""
    return {name for name, rec in sup.runtime.serves.items() if rec.check is not None}


def supervisor(timeout_s: float, observer: Any) -> Supervisor:
    svc = service(Config(daemon=DaemonConfig(memory_return_timeout_s=timeout_s)))
    return Supervisor(svc, cast(Any, None), cast(Any, observer))


async def test_memory_wait_gives_up_when_the_draw_stays(caplog: pytest.LogCaptureFixture) -> None:
    observer = StuckObserver()
    sup = supervisor(0.4, observer)
    returning(sup, "old", "GPU-a")
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, "gpud.supervisor"):
        await asyncio.wait_for(sup.memory.back("GPU-a"), 10)
    took = time.monotonic() - t0
    assert 0.4 <= took < 3, took
    assert observer.samples >= 2  # it waited on observation, not on a clock alone
    assert "memory of ['old'] on GPU-a not back after 0.4 s; starting anyway" in caplog.text
    # given up on: the next start does not wait again
    assert "GPU-a" not in sup.runtime.life("old").returning


async def test_memory_wait_covers_a_stop_still_in_progress() -> None:
    observer = StuckObserver()
    observer.draws = {"GPU-a": {}}  # nothing observed: only the stop in progress holds it up
    sup = supervisor(30, observer)
    done = asyncio.Event()
    returning(sup, "old", "GPU-a").stop_done = done
    waiter = asyncio.ensure_future(sup.memory.back("GPU-a"))
    await until(lambda: waiters(done) == 1, what="the start waiting on the stop")
    assert not waiter.done(), "a start went ahead while a stop on its device was in progress"
    sup.runtime.serves["old"].stop_done = None
    done.set()
    await asyncio.wait_for(waiter, 5)
    assert "GPU-a" not in sup.runtime.life("old").returning


async def test_memory_wait_for_a_stop_that_never_ends_is_bounded(
        caplog: pytest.LogCaptureFixture) -> None:
    sup = supervisor(0.3, StuckObserver())
    returning(sup, "old", "GPU-a").stop_done = asyncio.Event()  # never set
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, "gpud.supervisor"):
        await asyncio.wait_for(sup.memory.back("GPU-a"), 10)
    assert 0.3 <= time.monotonic() - t0 < 3
    assert "not back after 0.3 s" in caplog.text
    # the stop still in progress stays known: a later start waits for it again
    assert sup.runtime.life("old").returning == {"GPU-a"}


class CountingProbe:
    """Health answers from a table instead of HTTP: `hang` never answers."""

    def __init__(self, hang: set[str]) -> None:
        self.hang = hang
        self.asked: dict[str, int] = {}
        self.release = asyncio.Event()

    async def probe(self, serve: str, spec: Any) -> Any:
        from gpud.core.health import Answer, Probe

        self.asked[serve] = self.asked.get(serve, 0) + 1
        if serve in self.hang:
            await self.release.wait()
        return Answer(Probe.OK, "200")


async def test_a_check_in_flight_is_not_started_twice_and_delays_no_other() -> None:
    from gpud.config import ServeConfig
    from gpud.core.vocab import RUNNING
    spec = ServeConfig(role="r", vram_mib=1, port=1, command=["x"])
    records = ServeRecords()
    for name in ("hung", "quick"):
        records.apply(name, Stored(RUNNING, None, 0.0))
    svc = service(Config(), records=records, serve_spec=lambda _n: spec,
                  state_of=lambda n: records[n].state)
    probe = CountingProbe(hang={"hung"})
    sup = Supervisor(svc, cast(Any, None), cast(Any, StuckObserver()), prober=probe)
    for rounds in range(1, 4):  # three rounds while hung's first check is still in flight
        await sup.health_job.check_running()
        # This round's check of quick has ended: hung's, begun with the first, had its turn.
        await until(lambda: "quick" not in checking(sup), what="quick's check")
        assert probe.asked == {"hung": 1, "quick": rounds}
    probe.release.set()
    await until(lambda: "hung" not in checking(sup), what="hung's check, released")
    await sup.health_job.check_running()
    await until(lambda: not checking(sup), what="the fourth round's checks")
    assert probe.asked == {"hung": 2, "quick": 4}
    await asyncio.gather(*sup.runtime.tasks)
