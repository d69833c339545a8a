"""Group commit in the ledger service, on a real SQLite store: decisions one after another,
every decision made while a transaction is being written goes into the next one, and nobody is
answered before the transaction holding their change is durable."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

from gpud.config import parse_config
from gpud.durable.store import Changes, Event, Store
from gpud.errors import Denied, StoreError
from gpud.life.service import LedgerService
from tests.waiting import until

CONFIG = """
[daemon]
admission = "ledger"
[roles.r]
device = "0"
capacity_mib = 1000
"""


class GatedStore(Store):
    """A real store whose transactions wait for the test to let them through, and that can be
    told to fail the next one."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail_next = False
        self.batches: list[int] = []

    def commit_many(self, batch: Sequence[Changes]) -> list[list[Event]]:
        self.entered.set()
        self.gate.wait(10)
        if self.fail_next:
            self.fail_next = False
            raise StoreError("the store could not commit the change: disk I/O error")
        self.batches.append(len(batch))
        return super().commit_many(batch)


@pytest.fixture
def service(tmp_path: Path) -> LedgerService:
    store = GatedStore(tmp_path / "gpud.sqlite3")
    svc = LedgerService(parse_config(CONFIG, "test"), store)
    svc.load()
    store.batches.clear()
    yield svc
    svc.close()
    store.close()


def durable(svc: LedgerService) -> dict[str, int]:
    return {r.serve: r.mib for r in svc.store.reservations()}


async def test_admissions_made_during_one_write_share_the_next(service: LedgerService) -> None:
    store = service.store
    assert isinstance(store, GatedStore)
    store.gate.clear()
    store.entered.clear()
    first = asyncio.create_task(service.admit("a", 100, role="r"))
    await asyncio.to_thread(store.entered.wait, 5)  # the first transaction is being written
    rest = [asyncio.create_task(service.admit(f"b{i}", 100, role="r")) for i in range(8)]
    answered: list[str] = []
    for task in rest:
        task.add_done_callback(lambda t: answered.append(t.result().reservation.serve))
    await until(lambda: len(service._queue) == 8, what="the eight decided, queued for the next")
    assert not first.done() and answered == []  # nothing answered before it is durable
    assert service.ledger.reservations == {}  # nor shown
    store.gate.set()
    await asyncio.gather(first, *rest)
    assert store.batches == [1, 8]  # two transactions for nine admissions
    assert durable(service) == {"a": 100, **{f"b{i}": 100 for i in range(8)}}
    assert service.ledger.figures("r").committed_mib == 900


async def test_a_denial_waits_for_the_admission_it_was_decided_on(service: LedgerService) -> None:
    store = service.store
    assert isinstance(store, GatedStore)
    store.gate.clear()
    big = asyncio.create_task(service.admit("big", 900, role="r"))
    await asyncio.to_thread(store.entered.wait, 5)
    denied = asyncio.create_task(service.admit("late", 200, role="r"))
    await until(lambda: len(service._queue) == 1, what="the denial decided, queued")
    assert not denied.done()  # it was denied because of `big`, which is not durable yet
    store.gate.set()
    await big
    with pytest.raises(Denied) as info:
        await denied
    assert info.value.details["free_mib"] == 100
    assert durable(service) == {"big": 900}


async def test_a_failed_write_fails_every_change_that_rests_on_it(service: LedgerService) -> None:
    store = service.store
    assert isinstance(store, GatedStore)
    await service.admit("kept", 100, role="r")
    store.gate.clear()
    store.entered.clear()
    store.fail_next = True
    first = asyncio.create_task(service.admit("a", 100, role="r"))
    await asyncio.to_thread(store.entered.wait, 5)
    second = asyncio.create_task(service.release("kept"))
    await until(lambda: len(service._queue) == 1, what="the release decided, queued")
    store.gate.set()
    results = await asyncio.gather(first, second, return_exceptions=True)
    assert all(isinstance(r, StoreError) for r in results), results
    assert durable(service) == {"kept": 100}
    assert set(service.ledger.reservations) == {"kept"}
    # Decisions start again from what is durable.
    admission = await service.admit("c", 900, role="r")
    assert admission.figures.free_mib == 0
