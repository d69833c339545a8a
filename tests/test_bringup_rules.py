"""gpud.core.bringup's rules at their edges: the policy's validation, the backoff's first step
and cap, the "forgotten after stable_s up" rule at exactly stable_s, what `came_up` keeps, when
`held` stops holding and how it rounds, and every branch of `classify` (issue 45, item 6: the
module pinned by its own tests)."""

from __future__ import annotations

from typing import Any

import pytest

from gpud.core.bringup import (
    Hold,
    Policy,
    Tries,
    Why,
    came_up,
    classify,
    failed,
    held,
    public_reason,
    refused,
)
from gpud.errors import Conflict, Denied, Unavailable

POLICY = Policy(refusal_hold_s=5.0, first_s=10.0, max_s=300.0, stable_s=60.0)
MESSAGE = "bring-up policy: refusal_hold_s >= 0 and 0 < first_s <= max_s"


@pytest.mark.parametrize("kwargs", [
    {"refusal_hold_s": -0.001},
    {"first_s": 0.0},
    {"first_s": -1.0},
    {"first_s": 301.0, "max_s": 300.0},
])
def test_a_policy_out_of_its_bounds_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError) as err:
        Policy(**kwargs)
    assert str(err.value) == MESSAGE


@pytest.mark.parametrize("kwargs", [
    {"refusal_hold_s": 0.0},
    {"first_s": 300.0, "max_s": 300.0},
    {"first_s": 0.001},
])
def test_a_policy_at_its_bounds_is_taken(kwargs: dict[str, float]) -> None:
    assert Policy(**kwargs).backoff_s(1) == kwargs.get("first_s", 10.0)


def test_the_defaults() -> None:
    assert Policy() == POLICY


@pytest.mark.parametrize(("failures", "wait"), [
    (-1, 0.0), (0, 0.0), (1, 10.0), (2, 20.0), (5, 160.0), (6, 300.0), (1000, 300.0),
])
def test_the_backoff(failures: int, wait: float) -> None:
    assert POLICY.backoff_s(failures) == wait


def test_the_backoff_never_overflows_below_its_cap() -> None:
    huge = Policy(first_s=1e-300, max_s=1e300)
    assert huge.backoff_s(10_000) == 1e-300 * 2.0 ** 60


def test_a_refusal_keeps_the_failures_and_forgets_the_time_up() -> None:
    before = Tries(3, 0.0, None, "", up_since=50.0)
    assert refused(before, 100.0, Why.NO_MEMORY, "full", POLICY) == Tries(
        3, 105.0, Why.NO_MEMORY, "full", None)
    assert refused(None, 100.0, Why.UNAVAILABLE, "lost", POLICY) == Tries(
        0, 105.0, Why.UNAVAILABLE, "lost", None)


@pytest.mark.parametrize(("up_since", "now", "failures"), [
    (None, 200.0, 3),  # never came up since: one more in a row
    (100.0, 159.999, 3),  # up less than stable_s: one more in a row
    (100.0, 160.0, 1),  # up exactly stable_s: forgotten, this is the first
    (100.0, 500.0, 1),
])
def test_the_failures_in_a_row_are_forgotten_after_stable_s_up(
        up_since: float | None, now: float, failures: int) -> None:
    got = failed(Tries(2, 0.0, None, "", up_since), now, "exited", POLICY)
    assert got == Tries(failures, now + POLICY.backoff_s(failures), Why.FAILED, "exited", None)


def test_a_first_failure() -> None:
    assert failed(None, 7.0, "crash-loop", POLICY) == Tries(1, 17.0, Why.FAILED, "crash-loop")


def test_came_up_keeps_the_failures_and_notes_when() -> None:
    assert came_up(None, 5.0) is None
    assert came_up(Tries(0, 99.0, Why.NO_MEMORY, "full"), 5.0) is None
    assert came_up(Tries(2, 99.0, Why.FAILED, "exited"), 5.0) == Tries(2, 0.0, None, "", 5.0)


@pytest.mark.parametrize(("now", "hold"), [
    (100.0, Hold(Why.FAILED, "exited", 20, 2)),
    (119.2, Hold(Why.FAILED, "exited", 1, 2)),  # 0.8 s left: at least 1
    (118.5, Hold(Why.FAILED, "exited", 2, 2)),  # 1.5 s left: rounded up
    (117.0, Hold(Why.FAILED, "exited", 3, 2)),  # whole seconds stay whole
    (119.999, Hold(Why.FAILED, "exited", 1, 2)),
    (120.0, None),  # the hold ends at not_before
    (130.0, None),
])
def test_held_until_not_before(now: float, hold: Hold | None) -> None:
    assert held(Tries(2, 120.0, Why.FAILED, "exited"), now) == hold


def test_nothing_held_without_a_reason_or_a_record() -> None:
    assert held(None, 0.0) is None
    assert held(Tries(2, 120.0, None, ""), 100.0) is None


@pytest.mark.parametrize(("code", "details", "why"), [
    (Denied.code, {"bound": "device"}, Why.UNAVAILABLE),
    (Denied.code, {"bound": "held"}, Why.UNAVAILABLE),
    (Denied.code, {"bound": "ledger"}, Why.NO_MEMORY),
    (Denied.code, {"bound": "physical", "state": "failed"}, Why.NO_MEMORY),  # the bound decides
    (Denied.code, {}, Why.NO_MEMORY),
    (Unavailable.code, {"state": "failed"}, Why.FAILED),  # the state before the code
    (Conflict.code, {"state": "failed"}, Why.FAILED),
    (Conflict.code, {"state": "starting"}, Why.STARTING),
    (Conflict.code, {"state": "admitted"}, Why.STARTING),
    (Conflict.code, {"state": "running", "timeout": 30}, Why.STARTING),
    (Conflict.code, {"timeout": 0}, Why.REFUSED),
    (Unavailable.code, {"state": "running"}, Why.UNAVAILABLE),
    (Unavailable.code, {}, Why.UNAVAILABLE),
    (Conflict.code, {"state": "stopping"}, Why.REFUSED),
    ("internal", {}, Why.REFUSED),
])
def test_every_branch_of_classify(code: str, details: dict[str, Any], why: Why) -> None:
    assert classify(code, details) == why


def test_the_public_reason_word_for_word() -> None:
    assert public_reason("ocr", Why.QUEUE_TIMEOUT, 7) == (
        "serve ocr: the serve could not be brought up while the request waited; retry after 7 s")
    assert public_reason("ocr", Why.QUEUE_FULL, 7, " (router.max_queued = 8)") == (
        "serve ocr: too many requests wait for the serve (router.max_queued = 8); retry after 7 s")


def test_a_fresh_record_of_tries_has_no_failures() -> None:
    assert came_up(Tries(), 5.0) is None  # nothing failed: nothing to keep
    assert refused(Tries(), 1.0, Why.REFUSED, "busy", POLICY).failures == 0
