"""gpud.core.demand's events: each one changes a serve's on-demand facts by its rule, written out
here, and touches nothing else of them."""

from __future__ import annotations

import dataclasses

import pytest

from gpud.core import demand
from gpud.core.bringup import Tries, Why
from gpud.core.demand import (
    NO_DEMAND,
    BringupBegan,
    CameUp,
    Demand,
    DemandEvent,
    Idling,
    LastActivity,
    NeedMib,
    OperatorStarted,
    Requested,
    SeenFailed,
    Tried,
    UpAt,
)
from tests.demand_samples import KNOWN, POLICY

FRESH = Demand(tries=Tries(failures=1, not_before=1.0), failure_counted=False)


@pytest.mark.parametrize("d", [NO_DEMAND, KNOWN, FRESH])
@pytest.mark.parametrize(("event", "changed"), [
    (Requested(7.0), {"last_activity": 7.0, "last_request": 7.0}),
    (Idling(True), {"idling": True}),
    (Idling(False), {"idling": False}),
    (UpAt(2.0), {"up_at": 2.0}),
    (UpAt(None), {"up_at": None}),
    (LastActivity(1.0), {"last_activity": 1.0}),
    (LastActivity(None), {"last_activity": None}),
    (NeedMib(512), {"need_mib": 512}),
    (NeedMib(None), {"need_mib": None}),
    (BringupBegan(), {"failure_counted": False}),
    (OperatorStarted(), {"tries": None, "failure_counted": False}),
], ids=repr)
def test_a_fact_set_by_its_event(d: Demand, event: DemandEvent, changed: dict[str, object]) -> None:
    assert demand.step(d, event) == dataclasses.replace(d, **changed)  # type: ignore[arg-type]


@pytest.mark.parametrize("d", [NO_DEMAND, KNOWN, FRESH])
def test_a_bring_up_that_came_up(d: Demand) -> None:
    got = demand.step(d, CameUp(8.0))
    assert got == demand.came_up(d, 8.0)
    assert got.up_at == 8.0 and got.idling == d.idling


@pytest.mark.parametrize("d", [NO_DEMAND, KNOWN, FRESH])
@pytest.mark.parametrize("why", list(Why))
def test_a_bring_up_tried(d: Demand, why: Why) -> None:
    got = demand.step(d, Tried(9.0, why, "because", POLICY))
    assert got == demand.tried(d, 9.0, why, "because", POLICY)
    assert got.failure_counted is (why == Why.FAILED or d.failure_counted)


@pytest.mark.parametrize("d", [NO_DEMAND, KNOWN, FRESH])
def test_a_failure_seen(d: Demand) -> None:
    got = demand.step(d, SeenFailed(6.0, "failed: x", POLICY))
    assert got == demand.failed_since(d, 6.0, "failed: x", POLICY)
    assert got.failure_counted
    assert (got == d) is d.failure_counted  # counted once
