"""What a refusal of gpud.core.states says, word for word (the journal and StateRefused carry
it): which of its three reasons, with the states a cause leads to sorted."""

from __future__ import annotations

from gpud.core.states import Cause, StateRefusal, check_change
from gpud.core.vocab import ADMITTED, DECLARED, FAILED, RUNNING, SLEEPING, STOPPING


def test_a_cause_that_does_not_lead_there_names_where_it_leads() -> None:
    got = check_change(RUNNING, ADMITTED, Cause.FAIL)
    assert isinstance(got, StateRefusal)
    assert got.message == ("running -> admitted (fail) refused: fail leads only to failed")
    stop = StateRefusal(RUNNING, FAILED, Cause.STOP).message
    assert stop == ("running -> failed (stop) refused: stop leads only to admitted, declared, "
                    "stopping")


def test_a_cause_that_leads_there_but_not_from_there() -> None:
    got = check_change(STOPPING, RUNNING, Cause.HEALTHY)
    assert got == StateRefusal(STOPPING, RUNNING, Cause.HEALTHY)
    assert isinstance(got, StateRefusal)
    assert got.message == ("stopping -> running (healthy) refused: healthy does not apply to a "
                           "serve that is stopping")


def test_an_unrecorded_serve_and_no_cause_named() -> None:
    got = check_change(None, RUNNING, Cause.HEALTHY)
    assert isinstance(got, StateRefusal)
    assert got.message == ("unrecorded -> running (healthy) refused: healthy does not apply to "
                           "a serve that is unrecorded")
    nothing = StateRefusal(DECLARED, STOPPING, None).message
    assert nothing == ("declared -> stopping (no cause named) refused: no cause leads there from "
                       "there")


def test_a_refusal_that_names_its_own_why_says_it() -> None:
    """The serve's record (gpud.core.serverecord) refuses a change this rule allows, naming
    what the record lacks: that is the whole reason, whatever the cause."""
    got = StateRefusal(SLEEPING, RUNNING, Cause.WAKE, "woken needs a reservation held").message
    assert got == "sleeping -> running (wake) refused: woken needs a reservation held"
    assert StateRefusal(None, RUNNING, None, "why").message == (
        "unrecorded -> running (no cause named) refused: why")
