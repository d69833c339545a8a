"""Repeated refusals coalesced: the pure rule (gpud.core.coalesce) and the service's use of it
on a real SQLite store: a flood of refusals asked for through the front is a few stored events
with their count, an operator's refusals are each stored."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpud.config import parse_config
from gpud.core.coalesce import Coalescer, Verdict
from gpud.durable.store import EventQuery, Store
from gpud.errors import Denied
from gpud.life.service import LedgerService
from gpud.life.writes import COALESCE_REFUSALS
from tests.conftest import loaded_service

# ---- the rule -------------------------------------------------------------------------------


def test_the_first_of_a_window_is_stored_the_rest_counted() -> None:
    c: Coalescer[str, str] = Coalescer(window_s=10)
    assert c.offer("a", "1", 0.0) == Verdict.STORE
    assert [c.offer("a", str(i), 0.5 + i) for i in range(5)] == [Verdict.COUNT] * 5
    # another key has its own window
    assert c.offer("b", "x", 1.0) == Verdict.STORE
    assert c.due(9.9) == []
    assert c.next_due() == 10.0
    (s,) = c.due(10.0)
    assert (s.key, s.count, s.first_ts, s.last_ts, s.last) == ("a", 5, 0.5, 4.5, "4")
    # "b" counted none: closed without a summary, its next refusal stored as it comes
    assert c.due(11.0) == []
    assert c.offer("b", "y", 11.5) == Verdict.STORE


def test_a_flood_that_goes_on_is_one_summary_per_window() -> None:
    c: Coalescer[str, int] = Coalescer(window_s=60)
    stored = summaries = 0
    counted = 0
    t = 0.0
    # 94 refusals a second for 30 minutes, as a local user's alternating requests made
    while t < 1800:
        for s in c.due(t):
            summaries += 1
            counted += s.count
        if c.offer("od1", 1, t) == Verdict.STORE:
            stored += 1
        t += 1 / 94
    for s in c.due(float("inf")):
        summaries += 1
        counted += s.count
    assert stored == 1
    assert summaries == 30  # one a window
    assert stored + counted == 169200  # every refusal accounted for


def test_the_window_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Coalescer(window_s=0)


# ---- in the service -------------------------------------------------------------------------

CONFIG = """
[daemon]
admission = "ledger"
[roles.r]
device = "0"
capacity_mib = 10000
[serves.fill]
role = "r"
vram_mib = 5000
command = ["x"]
[serves.big]
role = "r"
vram_mib = 6000
command = ["x"]
[serves.other]
role = "r"
vram_mib = 6000
command = ["x"]
"""


@pytest.fixture
def service(tmp_path: Path) -> Iterator[LedgerService]:
    with loaded_service(tmp_path, CONFIG) as svc:
        yield svc


async def deny_many(svc: LedgerService, serve: str, n: int, *, front: bool) -> None:
    if "fill" not in svc.ledger.reservations:
        await svc.admit("fill", 5000)  # what leaves no room for the others
    async def one() -> None:
        if front:
            COALESCE_REFUSALS.set(True)  # as gpud.server.ondemand's bring-up task does
        with pytest.raises(Denied):
            await svc.admit(serve, svc.config.serves[serve].vram_mib)
    for _ in range(n):
        await asyncio.get_running_loop().create_task(one())


def denials(svc: LedgerService, serve: str) -> list[dict[str, object]]:
    return [e.to_json() for e in svc.store.events(EventQuery(serves=[serve], kinds=["deny"],
                                                             limit=10_000))]


async def test_a_refusal_flood_through_the_front_adds_a_handful_of_events(
        service: LedgerService) -> None:
    before = len(service.store.events(EventQuery(limit=10_000)))
    await deny_many(service, "big", 500, front=True)
    await service.drain()
    stored = denials(service, "big")
    assert len(stored) == 1, stored  # the first of the window; the rest counted
    assert len(service.store.events(EventQuery(limit=10_000))) - before <= 3
    # every refusal is still counted in the metrics' figure
    assert service.counters["deny"] == 500
    assert service.refusals.windows.pending() == 499
    # the window ends: one event stands for the 499, saying so
    service.clock = lambda: 1e12
    service.refusals.flush(1e12)
    await service.drain()
    _first, summary = denials(service, "big")
    details = summary["details"]
    assert isinstance(details, dict) and details["repeated"] == 499
    assert "499 more like this" in str(summary["message"])
    assert service.counters["deny"] == 500  # the summary is not counted again


async def test_an_operators_refusals_are_each_stored(service: LedgerService) -> None:
    await deny_many(service, "other", 20, front=False)
    await service.drain()
    assert len(denials(service, "other")) == 20


async def test_the_refusals_counted_are_stored_when_gpud_stops(tmp_path: Path) -> None:
    store = Store(tmp_path / "gpud.sqlite3")
    svc = LedgerService(parse_config(CONFIG, "test"), store)
    svc.load()
    await deny_many(svc, "big", 7, front=True)
    await svc.drain()
    svc.close()
    (summary,) = [e for e in store.events(EventQuery(serves=["big"], kinds=["deny"]))
                  if e.details.get("repeated")]
    assert summary.details["repeated"] == 6
    store.close()


async def test_the_summary_is_stored_on_time_without_another_refusal(
        service: LedgerService) -> None:
    service.refusals.windows = Coalescer(window_s=0.2)
    await deny_many(service, "big", 3, front=True)

    async def summarized() -> bool:
        await service.drain()
        return any(e["details"].get("repeated") == 2  # type: ignore[union-attr]
                   for e in denials(service, "big"))
    for _ in range(100):
        if await summarized():
            break
        await asyncio.sleep(0.02)
    assert await summarized(), denials(service, "big")
