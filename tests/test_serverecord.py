"""A serve's one step (gpud.core.serverecord), tested from a table: every report from every
recorded state, with every combination of what the record holds (a reservation, an external
one, a configured serve), against the table below, written out here (not derived from the
module's own tables)."""

from __future__ import annotations

import itertools

import pytest

from gpud.core import serverecord as sr
from gpud.core.lifecycle import IDLE_LIFE, Job, JobBegan, StartAsked
from gpud.core.lifecycle import step as life_step
from gpud.core.serverecord import Happened, Record, Report, Stepped, StoreState, next_state, step
from gpud.core.states import Cause, StateRefusal
from gpud.core.vocab import (
    ADMITTED,
    DECLARED,
    DENIED,
    EXTERNAL,
    FAILED,
    ORPHAN,
    RUNNING,
    SLEEPING,
    STARTING,
    STATES,
    STOPPING,
    ServeState,
)

H = Happened
PREVS: tuple[ServeState | None, ...] = (None, *STATES)
LIVE = {STARTING, RUNNING, STOPPING, SLEEPING}
NOT_STARTED = {None, DECLARED, DENIED, ORPHAN}

# The states each report is refused from (every other one leads where TARGET says).
REFUSED_FROM: dict[Happened, set[ServeState | None]] = {
    H.CLEARED: set(PREVS) - {DENIED},
    H.LAUNCHED: {STOPPING, ORPHAN},
    H.HEALTHY: set(PREVS) - {STARTING, RUNNING, FAILED, SLEEPING},
    H.RESTARTING: NOT_STARTED,
    H.ASLEEP: NOT_STARTED,
    H.WAKE_ADMITTED: NOT_STARTED,
    H.WOKEN: NOT_STARTED,
}


def target(what: Happened, prev: ServeState | None, holds: bool, external: bool,
           configured: bool, back_to: ServeState | None) -> ServeState | None:
    """The state each report leads to (None: no state stored)."""
    table: dict[Happened, ServeState | None] = {
        H.ADMITTED: EXTERNAL if external else prev if prev in LIVE else ADMITTED,
        H.DENIED: None if prev in LIVE or holds or not configured else DENIED,
        H.CLEARED: DECLARED,
        H.LAUNCHED: STARTING,
        H.HEALTHY: RUNNING,
        H.RESTARTING: STARTING,
        H.FOUND_ORPHAN: ORPHAN,
        H.FOUND_ACTIVE: prev if prev in (RUNNING, STARTING) else STARTING,
        H.FOUND_ASLEEP: SLEEPING,
        H.FOUND_AS_RECORDED: RUNNING if prev == RUNNING else SLEEPING,
        H.FOUND_AWAKE: STARTING,
        H.STARTED_OUTSIDE: STARTING,
        H.ORPHAN_ENDED: DECLARED,
        H.STOP_BEGUN: STOPPING,
        H.STOPPED: ADMITTED if holds else DECLARED,
        H.FAILED: FAILED,
        H.ASLEEP: SLEEPING,
        H.WAKE_ADMITTED: SLEEPING,
        H.WOKEN: RUNNING,
        H.RELEASED: DECLARED,
        H.ROLLED_BACK: back_to or DECLARED,
        H.CONFIG_DROPPED: DECLARED,
    }
    return table[what]


CASES = list(itertools.product(Happened, PREVS, (False, True), (False, True), (False, True)))


@pytest.mark.parametrize(("what", "prev", "holds", "external", "configured"), CASES)
def test_every_report_from_every_state(what: Happened, prev: ServeState | None, holds: bool,
                                       external: bool, configured: bool) -> None:
    serve = Record(prev, holds=holds, external=external, configured=configured)
    got = step(serve, Report(what))
    want = target(what, prev, holds, external, configured, None)
    if want is None:
        assert got == Stepped(serve)  # nothing stored, nothing else changed
        return
    if prev in REFUSED_FROM.get(what, set()):
        assert got == StateRefusal(prev, want, sr.CAUSES[what])
        return
    if what is H.WOKEN and not holds:
        # awake with no reservation: a release (or anything) that says "woken" is refused
        assert got == StateRefusal(prev, RUNNING, Cause.WAKE,
                                   "woken needs a reservation held, and the serve holds none")
        return
    assert got == Stepped(Record(want, holds, external, configured), (StoreState(want),))


def test_the_table_has_as_many_cases_as_it_says() -> None:
    assert len(CASES) == len(Happened) * 11 * 8 == 1936


def test_every_report_has_one_rule_and_a_cause() -> None:
    assert set(sr.FIXED) | set(sr.RULES) == set(Happened)
    assert not set(sr.FIXED) & set(sr.RULES)
    assert set(sr.CAUSES) == set(Happened)


@pytest.mark.parametrize("back_to", [None, FAILED, ADMITTED, DENIED, EXTERNAL])
@pytest.mark.parametrize("prev", [RUNNING, ADMITTED, None])
def test_a_rollback_takes_the_serve_back_to_the_state_it_had(
        back_to: ServeState | None, prev: ServeState | None) -> None:
    got = step(Record(prev), Report(H.ROLLED_BACK, back_to))
    assert isinstance(got, Stepped)
    assert got.serve.state == (back_to or DECLARED)
    assert got.effects == (StoreState(back_to or DECLARED),)


def test_a_rollback_to_a_state_its_cause_does_not_lead_to_is_refused() -> None:
    assert step(Record(RUNNING), Report(H.ROLLED_BACK, RUNNING)) == StateRefusal(
        RUNNING, RUNNING, Cause.RELEASE)


def test_next_state_before_the_rule() -> None:
    """next_state says where a report leads before the rule checks it (a refused one too)."""
    assert next_state(Record(ADMITTED), Report(H.HEALTHY)) == RUNNING
    assert next_state(Record(RUNNING), Report(H.DENIED)) is None
    assert next_state(Record(SLEEPING), Report(H.FOUND_AS_RECORDED)) == SLEEPING


def test_a_step_keeps_what_it_does_not_decide() -> None:
    life = life_step(IDLE_LIFE, StartAsked())[0]
    serve = Record(ADMITTED, holds=True, external=False, configured=True, life=life)
    got = step(serve, Report(H.LAUNCHED))
    assert got == Stepped(Record(STARTING, True, False, True, life), (StoreState(STARTING),))


def test_the_supervisors_inputs_step_its_life_and_leave_the_state() -> None:
    """A lifecycle input (gpud.core.lifecycle) is the same step on the record's life: its
    actions are the effects, the state untouched."""
    started = life_step(IDLE_LIFE, StartAsked())[0]
    serve = Record(STARTING, holds=True, life=started)
    life, actions = life_step(started, JobBegan(Job.STOP))
    assert actions  # a stop while launching cancels the launch
    assert step(serve, JobBegan(Job.STOP)) == Stepped(
        Record(STARTING, holds=True, life=life), tuple(actions))


def test_a_fresh_record() -> None:
    assert Record() == Record(None, False, False, True, IDLE_LIFE)


def test_a_release_that_says_woken_is_refused_and_says_why() -> None:
    """A serve admitted (or asleep) whose reservation the change releases cannot be woken by
    it: it would run on no reservation. The refusal names what is missing."""
    for prev in (ADMITTED, SLEEPING):
        got = step(Record(prev, holds=False), Report(H.WOKEN))
        assert isinstance(got, StateRefusal)
        assert got.message == (f"{prev} -> running (wake) refused: woken needs a reservation "
                               "held, and the serve holds none")
    assert step(Record(ADMITTED, holds=True), Report(H.WOKEN)) == Stepped(
        Record(RUNNING, holds=True), (StoreState(RUNNING),))
