"""A calibration's measurement: its window runs on the calibrator's injected clock; what can fail
(the serve stops, nothing observed) is reported in the event log; anything else is a fault
logged with its traceback, not passed off as a failed calibration. Real store, fake observer."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpud.config import parse_config
from gpud.core.serverecord import Happened
from gpud.durable.store import EventQuery, Store
from gpud.life.calibration import Calibrator
from gpud.life.service import LedgerService

CONFIG = """
[daemon]
admission = "ledger"
[roles.r]
device = "0"
capacity_mib = 40000
[serves.s]
role = "r"
vram_mib = 3200
port = 30001
command = ["/bin/true"]
"""


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class Observer:
    """Each sample moves the clock on by `step` seconds and observes the next figure."""

    interval = 1.0
    available = True

    def __init__(self, svc: LedgerService, clock: Clock, figures: list[int | None],
                 step: float = 100.0) -> None:
        self.svc = svc
        self.clock = clock
        self.figures = figures
        self.step = step
        self.samples = 0
        self.stop_after: int | None = None
        self.fail_with: Exception | None = None

    async def next_sample(self, timeout: float) -> None:
        self.clock.now += self.step
        self.samples += 1
        if self.stop_after is not None and self.samples > self.stop_after:
            await self.svc.store_event(self.svc.event("stop", "s stopping"),
                                       report=self.svc.report("s", Happened.STOP_BEGUN))

    def observed_mib(self, serve: str) -> int | None:
        if self.fail_with is not None:
            raise self.fail_with
        return self.figures[(self.samples - 1) % len(self.figures)]

    def device_total(self, device: str) -> int | None:
        return None


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[LedgerService]:
    store = Store(tmp_path / "gpud.sqlite3")
    service = LedgerService(parse_config(CONFIG, "test"), store)
    service.load()
    yield service
    service.close()
    store.close()


async def running(svc: LedgerService) -> None:
    await svc.admit("s", 3200)
    await svc.store_event(svc.event("start", "s started"), report=svc.report("s", Happened.LAUNCHED))
    await svc.store_event(svc.event("healthy", "s healthy"), report=svc.report("s", Happened.HEALTHY))


async def calibrate_events(svc: LedgerService) -> list[dict[str, object]]:
    return [dict(e.to_json()) for e in await svc.events(EventQuery(kinds=("calibrate",)))]


async def test_the_window_runs_on_the_injected_clock(svc: LedgerService) -> None:
    await running(svc)
    clock = Clock()
    obs = Observer(svc, clock, [3000, 3100, 3050])
    cal = Calibrator(svc, obs, clock=clock)  # type: ignore[arg-type]
    run = cal.start("s", 600.0, 0)
    assert run["window_s"] == 600.0
    task = cal.runs["s"].task
    assert task is not None
    await task  # ten simulated minutes, no real wait
    assert obs.samples == 6  # one per 100 s of the 600 s window
    record = cal.view("s")["record"]
    assert record is not None
    assert (record["samples"], record["peak_mib"], record["ts"]) == (6, 3100, clock.now)
    assert "s" not in cal.runs
    [ev] = await calibrate_events(svc)
    assert ev["mib"] == record["recommended_mib"]


async def test_a_serve_that_stops_is_a_failed_calibration_in_the_event_log(
        svc: LedgerService, caplog: pytest.LogCaptureFixture) -> None:
    await running(svc)
    clock = Clock()
    obs = Observer(svc, clock, [3000])
    obs.stop_after = 2
    cal = Calibrator(svc, obs, clock=clock)  # type: ignore[arg-type]
    cal.start("s", 600.0, 0)
    task = cal.runs["s"].task
    assert task is not None
    with caplog.at_level(logging.WARNING, logger="gpud.calibration"):
        await task
    [ev] = await calibrate_events(svc)
    assert ev["message"] == "s: calibration failed: s stopped running during calibration"
    assert cal.view("s")["record"] is None and "s" not in cal.runs
    assert [r.levelname for r in caplog.records] == ["WARNING"]


async def test_a_fault_is_logged_with_its_traceback_not_reported_as_a_failed_calibration(
        svc: LedgerService, caplog: pytest.LogCaptureFixture) -> None:
    await running(svc)
    clock = Clock()
    obs = Observer(svc, clock, [3000])
    obs.fail_with = KeyError("bug")
    cal = Calibrator(svc, obs, clock=clock)  # type: ignore[arg-type]
    cal.start("s", 600.0, 0)
    task = cal.runs["s"].task
    assert task is not None
    with caplog.at_level(logging.ERROR, logger="gpud.calibration"), pytest.raises(KeyError):
        await task
    assert "s" not in cal.runs  # a new calibration may start
    assert await calibrate_events(svc) == []
    crashed = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(crashed) == 1 and crashed[0].getMessage().startswith("calibration of s crashed")
    assert crashed[0].exc_info is not None
