"""What a refusal of gpud.core.states says, word for word (the journal and StateRefused carry
it): which of its three reasons, with the states a cause leads to sorted."""

from __future__ import annotations

from gpud.core.states import Cause, StateRefusal, record
from gpud.core.vocab import ADMITTED, DECLARED, FAILED, RUNNING, STOPPING


def test_a_cause_that_does_not_lead_there_names_where_it_leads() -> None:
    got = record(RUNNING, ADMITTED, Cause.FAIL)
    assert isinstance(got, StateRefusal)
    assert got.message == ("running -> admitted (fail) refused: fail leads only to failed")
    stop = StateRefusal(RUNNING, FAILED, Cause.STOP).message
    assert stop == ("running -> failed (stop) refused: stop leads only to admitted, declared, "
                    "stopping")


def test_a_cause_that_leads_there_but_not_from_there() -> None:
    got = record(STOPPING, RUNNING, Cause.HEALTHY)
    assert got == StateRefusal(STOPPING, RUNNING, Cause.HEALTHY)
    assert isinstance(got, StateRefusal)
    assert got.message == ("stopping -> running (healthy) refused: healthy does not apply to a "
                           "serve that is stopping")


def test_an_unrecorded_serve_and_no_cause_named() -> None:
    got = record(None, RUNNING, Cause.HEALTHY)
    assert isinstance(got, StateRefusal)
    assert got.message == ("unrecorded -> running (healthy) refused: healthy does not apply to "
                           "a serve that is unrecorded")
    nothing = StateRefusal(DECLARED, STOPPING, None).message
    assert nothing == ("declared -> stopping (no cause named) refused: no cause leads there from "
                       "there")
