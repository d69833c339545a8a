"""The service's one writer on what adapters report (gpud.core.serverecord): the state comes
from the serve's step, with the reservation the change leaves, and a refused report fails the
whole change: reservation, event and state (issue 45)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpud.core.serverecord import Happened
from gpud.core.vocab import ADMITTED, DECLARED, EXTERNAL, RUNNING, SLEEPING, STARTING
from gpud.durable.store import EventQuery, Store
from gpud.life.service import LedgerService, StateRefused
from tests.test_service import ROLES, Clock, World


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[LedgerService]:
    world = World(tmp_path, Clock(), [], [])
    yield world.service(ROLES)
    for s in world.services:
        s.close()
    for store in world.stores:
        store.close()


def stored(svc: LedgerService) -> dict[str, str]:
    return {r.serve: r.state for r in svc.store.serve_states()}


async def test_reports_lead_a_serve_through_its_life(svc: LedgerService) -> None:
    await svc.admit("a", 300)
    assert stored(svc) == {"a": ADMITTED}
    await svc.store_event(svc.event("start", "a: started", serve="a"),
                     report=svc.report("a", Happened.LAUNCHED))
    assert stored(svc) == {"a": STARTING}
    await svc.store_event(svc.event("healthy", "a: healthy", serve="a"),
                     report=svc.report("a", Happened.HEALTHY))
    await svc.admit("a", 400)  # a re-admission keeps a live serve's state
    assert stored(svc) == {"a": RUNNING}
    await svc.admit("a", 200, happened=Happened.ASLEEP, shrink=True, state_reason="idle")
    assert (svc.state_of("a"), svc.records["a"].reason) == (SLEEPING, "idle")
    await svc.store_event(svc.event("stop", "a: stopping", serve="a"),
                     report=svc.report("a", Happened.STOP_BEGUN))
    await svc.release("a", allow_live=True, happened=Happened.STOPPED)
    assert stored(svc) == {"a": DECLARED}  # stopped and released: declared


async def test_a_stop_that_keeps_the_reservation_leaves_the_serve_admitted(
        svc: LedgerService) -> None:
    await svc.admit("a", 300)
    await svc.store_event(svc.event("stop", "a: stopped", serve="a"),
                     report=svc.report("a", Happened.STOPPED))
    assert stored(svc) == {"a": ADMITTED}


async def test_an_external_admission_is_shown_external(svc: LedgerService) -> None:
    await svc.admit("ext", 100, role="r")
    assert stored(svc) == {"ext": EXTERNAL}


async def test_a_rollback_takes_the_serve_back(svc: LedgerService) -> None:
    await svc.admit("a", 300)
    await svc.release("a", happened=Happened.ROLLED_BACK, back_to=ADMITTED)
    assert stored(svc) == {"a": ADMITTED} and "a" not in svc.ledger.reservations
    await svc.admit("b", 300)
    await svc.release("b", happened=Happened.ROLLED_BACK)
    assert stored(svc)["b"] == DECLARED


async def test_a_refused_report_fails_the_whole_change(svc: LedgerService) -> None:
    await svc.admit("a", 300)
    with pytest.raises(StateRefused) as err:
        await svc.store_event(svc.event("healthy", "a: healthy", serve="a"),
                         report=svc.report("a", Happened.HEALTHY))
    assert err.value.code == "conflict"
    assert "admitted -> running (healthy) refused" in err.value.message
    assert await svc.events(EventQuery(kinds=["healthy"])) == []
    with pytest.raises(StateRefused):  # a release whose report is refused releases nothing
        await svc.release("a", happened=Happened.HEALTHY)
    assert svc.ledger.reservations["a"].mib == 300
    assert stored(svc) == {"a": ADMITTED}
    assert [e.kind for e in await svc.events(EventQuery(serves=["a"]))] == ["admit"]


async def test_a_refused_admission_report_reserves_nothing(svc: LedgerService) -> None:
    with pytest.raises(StateRefused):
        await svc.admit("a", 300, happened=Happened.WOKEN)  # never started: cannot be woken
    assert "a" not in svc.ledger.reservations
    assert stored(svc) == {}
    assert isinstance(svc.store, Store) and svc.store.reservations() == []
