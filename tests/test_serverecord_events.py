"""A serve's whole record through its one step (gpud.core.serverecord): every kind of event,
from every recorded state, every phase of its life and on-demand facts known or not, changes
the parts of the record that are its own and keeps every other part; the facts (stored,
reserved, found held, dropped, the unit's PID and restarts) against a table written out here;
the questions asked of a record ("stopping", "settling") answered from each part; and any
sequence of events (Hypothesis) keeps what no event of it owns."""

from __future__ import annotations

import dataclasses
import itertools
from typing import get_args

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpud.core import demand as demand_rules
from gpud.core.bringup import Why
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
from gpud.core.lifecycle import IDLE_LIFE, Input, Job, ServeLife
from gpud.core.lifecycle import step as life_step
from gpud.core.serverecord import (
    Dropped,
    Event,
    Fact,
    FoundHeld,
    Happened,
    Put,
    Record,
    Report,
    Reserved,
    Stepped,
    Stored,
    StoreState,
    UnitPid,
    UnitRestarts,
    as_planned,
    settling,
    step,
)
from gpud.core.states import StateRefusal
from gpud.core.vocab import (
    ADMITTED,
    DECLARED,
    DENIED,
    EXTERNAL,
    FAILED,
    RUNNING,
    SLEEPING,
    STATES,
    STOPPING,
    Phase,
    ServeState,
)
from tests.demand_samples import KNOWN, POLICY
from tests.test_lifecycle import IN_PHASE, samples

PREVS: tuple[ServeState | None, ...] = (None, *STATES)
DEMANDS = (NO_DEMAND, KNOWN)
ALL = frozenset(f.name for f in dataclasses.fields(Record))

# What each kind of event may change of the record; every other part is kept.
OWNS: dict[type, frozenset[str]] = {
    Report: frozenset({"state"}),
    Stored: frozenset({"state", "reason", "updated"}),
    Reserved: frozenset({"holds", "external", "configured"}),
    FoundHeld: frozenset({"state", "holds", "external"}),
    Dropped: frozenset({"state", "reason", "holds", "external", "configured"}),
    UnitPid: frozenset({"main_pid"}),
    UnitRestarts: frozenset({"n_restarts"}),
    Put: frozenset({"demand", "life"}),
    **{kind: frozenset({"demand"}) for kind in get_args(DemandEvent)},
    **{kind: frozenset({"life"}) for kind in get_args(Input)},
}

DEMAND_SAMPLES: list[DemandEvent] = [
    Requested(7.0), BringupBegan(), CameUp(8.0), Tried(9.0, Why.FAILED, "exited", POLICY),
    Tried(9.0, Why.NO_MEMORY, "no memory", POLICY), SeenFailed(6.0, "failed: x", POLICY),
    OperatorStarted(), Idling(True), Idling(False), UpAt(2.0), UpAt(None), LastActivity(1.0),
    LastActivity(None), NeedMib(512), NeedMib(None),
]
FACT_SAMPLES: list[Fact] = [
    Stored(RUNNING, "healthy", 12.0), Stored(DECLARED, None, 13.0),
    Reserved(True, False, True), Reserved(True, True, False), Reserved(False, False, True),
    FoundHeld(False), FoundHeld(True), Dropped(), UnitPid(4242), UnitPid(None),
    UnitRestarts(3), UnitRestarts(0),
    Put(demand=DEMANDS[1]), Put(life=IN_PHASE[Phase.STOPPING]), Put(),
]
SAMPLES: list[Event] = [*(Report(h) for h in Happened), *samples().values(), *DEMAND_SAMPLES,
                        *FACT_SAMPLES]


def test_every_kind_of_event_has_a_sample_and_an_owner() -> None:
    kinds = {Report, *get_args(Input), *get_args(DemandEvent), *get_args(Fact)}
    assert set(get_args(Event)) >= {Report}
    assert {type(e) for e in SAMPLES} == kinds == set(OWNS)


def _record(prev: ServeState | None, life: ServeLife, d: Demand, holds: bool) -> Record:
    return Record(prev, holds=holds, external=False, configured=True, life=life,
                  reason="why", updated=1.5, main_pid=77, n_restarts=1, demand=d)


CASES = list(itertools.product(PREVS, list(IN_PHASE), range(2), (False, True)))


@pytest.mark.parametrize("i", range(len(SAMPLES)), ids=lambda i: repr(SAMPLES[i]))
def test_every_event_from_every_state_and_life_keeps_what_it_does_not_own(i: int) -> None:
    event = SAMPLES[i]
    for prev, phase, d, holds in CASES:
        serve = _record(prev, IN_PHASE[phase], DEMANDS[d], holds)
        got = step(serve, event)
        if isinstance(got, StateRefusal):
            assert isinstance(event, Report)  # only a report is ever refused
            continue
        for name in ALL - OWNS[type(event)]:
            assert getattr(got.serve, name) == getattr(serve, name), (name, prev, phase)
        if isinstance(event, Report):
            stored = [e.state for e in got.effects if isinstance(e, StoreState)]
            assert stored in ([], [got.serve.state])
            assert stored or got.serve == serve
        elif isinstance(event, get_args(Input)):
            life, actions = life_step(serve.life, event)  # type: ignore[arg-type]
            assert got == Stepped(dataclasses.replace(serve, life=life), tuple(actions))
        else:
            assert got.effects == ()


def test_the_table_has_as_many_cases_as_it_says() -> None:
    assert len(CASES) * len(SAMPLES) == len(SAMPLES) * 11 * len(Phase) * 2 * 2


# ---- the facts, written out -----------------------------------------------------------------

FULL = Record(RUNNING, holds=True, external=False, configured=True,
              life=IN_PHASE[Phase.LAUNCHING], reason="up", updated=2.0, main_pid=9,
              n_restarts=4, demand=DEMANDS[1])


def _stepped(serve: Record, event: Event) -> Record:
    got = step(serve, event)
    assert isinstance(got, Stepped) and got.effects == ()
    return got.serve


def test_a_stored_state_is_kept_with_its_reason_and_time() -> None:
    assert _stepped(FULL, Stored(FAILED, "exited", 9.5)) == Record(
        FAILED, True, False, True, FULL.life, "exited", 9.5, 9, 4, DEMANDS[1])


def test_what_the_ledger_and_the_config_say_is_kept() -> None:
    got = _stepped(FULL, Reserved(holds=False, external=True, configured=False))
    assert (got.holds, got.external, got.configured) == (False, True, False)
    assert got.state == RUNNING and got.reason == "up"


@pytest.mark.parametrize(("prev", "external", "shown"), [
    (None, False, ADMITTED), (None, True, ADMITTED),
    (DECLARED, False, ADMITTED), (DECLARED, True, EXTERNAL),
    (DENIED, False, ADMITTED), (DENIED, True, EXTERNAL),
    *((s, e, s) for s in STATES if s not in (DECLARED, DENIED) for e in (False, True)),
])
def test_a_reservation_found_at_start_is_never_shown_unreserved(
        prev: ServeState | None, external: bool, shown: ServeState) -> None:
    serve = Record(prev, reason="old", updated=3.0)
    got = _stepped(serve, FoundHeld(external))
    assert (got.state, got.holds, got.external) == (shown, True, external)
    assert (got.reason, got.updated) == ("old", 3.0)


@pytest.mark.parametrize("prev", PREVS)
def test_a_config_without_it_leaves_it_declared_holding_nothing(
        prev: ServeState | None) -> None:
    serve = Record(prev, holds=True, external=True, configured=True, reason="r", updated=4.0,
                   main_pid=5, n_restarts=2, demand=DEMANDS[1])
    assert _stepped(serve, Dropped()) == Record(
        DECLARED, False, False, False, IDLE_LIFE, None, 4.0, 5, 2, DEMANDS[1])


def test_what_systemd_says_of_the_unit() -> None:
    assert _stepped(FULL, UnitPid(31)).main_pid == 31
    assert _stepped(FULL, UnitPid(None)).main_pid is None
    assert _stepped(FULL, UnitRestarts(0)).n_restarts == 0
    assert _stepped(FULL, UnitRestarts(6)).n_restarts == 6


def test_a_part_put_whole_and_none_left_as_it_was() -> None:
    stop = IN_PHASE[Phase.STOPPING]
    assert _stepped(FULL, Put(demand=NO_DEMAND)) == dataclasses.replace(FULL, demand=NO_DEMAND)
    assert _stepped(FULL, Put(life=stop)) == dataclasses.replace(FULL, life=stop)
    assert _stepped(FULL, Put(demand=NO_DEMAND, life=stop)) == dataclasses.replace(
        FULL, demand=NO_DEMAND, life=stop)
    assert _stepped(FULL, Put()) == FULL


@pytest.mark.parametrize("event", DEMAND_SAMPLES, ids=repr)
def test_each_demand_event_is_its_rule(event: DemandEvent) -> None:
    """Each of gpud.core.demand's events changes the facts by its rule, written out here."""
    d = DEMANDS[1]
    want = {
        Requested: lambda: dataclasses.replace(d, last_activity=7.0, last_request=7.0),
        BringupBegan: lambda: demand_rules.began(d),
        CameUp: lambda: demand_rules.came_up(d, 8.0),
        Tried: lambda: demand_rules.tried(d, 9.0, event.why, event.reason,  # type: ignore
                                          POLICY),
        SeenFailed: lambda: demand_rules.failed_since(d, 6.0, "failed: x", POLICY),
        OperatorStarted: lambda: demand_rules.operator_started(d),
        Idling: lambda: dataclasses.replace(d, idling=event.idling),  # type: ignore
        UpAt: lambda: dataclasses.replace(d, up_at=event.at),  # type: ignore
        LastActivity: lambda: dataclasses.replace(d, last_activity=event.at),  # type: ignore
        NeedMib: lambda: dataclasses.replace(d, need_mib=event.mib),  # type: ignore
    }[type(event)]()
    assert _stepped(dataclasses.replace(FULL, demand=d), event).demand == want


def test_as_planned_sees_the_change_under_way() -> None:
    got = as_planned(FULL, ADMITTED, Reserved(False, True, False))
    assert got == Record(ADMITTED, False, True, False, FULL.life, "up", 2.0, 9, 4, DEMANDS[1])
    assert as_planned(FULL, None, Reserved(True, False, True)).state is None


def test_a_report_decides_on_the_record_as_planned() -> None:
    """A stop that keeps the reservation leaves it admitted; one that releases it, declared:
    the step sees the reservation the change makes."""
    running = Record(STOPPING, holds=True)
    keeps = as_planned(running, STOPPING, Reserved(True, False, True))
    frees = as_planned(running, STOPPING, Reserved(False, False, True))
    assert step(keeps, Report(Happened.STOPPED)) == Stepped(
        dataclasses.replace(keeps, state=ADMITTED), (StoreState(ADMITTED),))
    assert step(frees, Report(Happened.STOPPED)) == Stepped(
        dataclasses.replace(frees, state=DECLARED), (StoreState(DECLARED),))


# ---- the questions asked of a record --------------------------------------------------------

STOPPING_PHASES = {Phase.STOPPING, Phase.RESTARTING, Phase.FAILING}
SETTLING = {Phase.FALLING_ASLEEP, Phase.STOPPING}


@pytest.mark.parametrize(("phase", "prev"), list(itertools.product(Phase, PREVS)))
def test_stopping_is_a_job_of_gpuds_on_its_unit(phase: Phase, prev: ServeState | None) -> None:
    serve = Record(prev, life=IN_PHASE[phase])
    assert serve.stopping is (phase in STOPPING_PHASES)
    assert serve.stop_recorded is (prev == STOPPING)


@pytest.mark.parametrize(("phase", "idling", "draining"),
                         list(itertools.product(Phase, (False, True), (False, True))))
def test_settling_is_a_sleep_or_a_stop_under_way_decided_or_drained_for(
        phase: Phase, idling: bool, draining: bool) -> None:
    serve = Record(RUNNING, life=IN_PHASE[phase], demand=Demand(idling=idling))
    assert serve.settling(draining) is (idling or draining or phase in SETTLING)
    assert serve.settling() is (idling or phase in SETTLING)
    assert settling(Demand(idling=idling), phase, draining) is serve.settling(draining)


def test_a_fresh_record_is_neither() -> None:
    assert not Record().stopping and not Record().settling() and not Record().stop_recorded
    assert Record(SLEEPING, life=ServeLife(job=Job.STOP)).stopping


# ---- any sequence of events -----------------------------------------------------------------

@given(st.lists(st.sampled_from(SAMPLES), max_size=12), st.sampled_from(PREVS),
       st.sampled_from(list(IN_PHASE)))
def test_a_sequence_of_events_changes_only_what_its_events_own(
        events: list[Event], prev: ServeState | None, phase: Phase) -> None:
    serve = start = _record(prev, IN_PHASE[phase], NO_DEMAND, True)
    owned: set[str] = set()
    for event in events:
        got = step(serve, event)
        if isinstance(got, StateRefusal):
            continue  # refused: nothing changed
        owned |= OWNS[type(event)]
        serve = got.serve
    for name in ALL - owned:
        assert getattr(serve, name) == getattr(start, name), name


def test_a_fresh_record_knows_nothing_of_its_unit() -> None:
    fresh = Record()
    assert (fresh.reason, fresh.updated, fresh.main_pid, fresh.n_restarts, fresh.demand) == (
        None, 0.0, None, 0, NO_DEMAND)
