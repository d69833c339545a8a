"""What a sleep-capable serve says it is, against the ledger: the decision as a table."""

from __future__ import annotations

import itertools

import pytest

from gpud.core.reconcile import Reconcile, disagrees, reconcile
from gpud.core.vocab import STATES

A, S = "running", "sleeping"
CASES = [
    # (recorded, is_sleeping, overdrawn, awake fits, preemptible, decision)
    (A, False, False, True, None, Reconcile.AGREE),
    (A, None, False, True, None, Reconcile.AGREE),  # no answer: nothing to go on
    (A, True, False, True, None, Reconcile.SHOW_ASLEEP),  # slept outside gpud: the safe side
    (A, True, False, False, "stop", Reconcile.SHOW_ASLEEP),  # fitting does not matter
    (A, True, True, True, None, Reconcile.SHOW_ASLEEP),
    (S, True, False, True, None, Reconcile.AGREE),
    (S, None, False, False, None, Reconcile.AGREE),  # no answer, draw within its reservation
    (S, False, False, True, "sleep", Reconcile.ADMIT_AWAKE),  # woken outside gpud, fits
    (S, False, False, False, "sleep", Reconcile.SLEEP_AGAIN),
    (S, False, False, False, None, Reconcile.SLEEP_AGAIN),
    (S, False, False, False, "stop", Reconcile.STOP),
    (S, None, True, True, None, Reconcile.ADMIT_AWAKE),  # silent, but drawing its full size
    (S, None, True, False, "stop", Reconcile.STOP),
    (S, True, True, False, "stop", Reconcile.AGREE),  # says asleep: an overdraw event, no more
]


@pytest.mark.parametrize(("recorded", "said", "over", "fits", "preemptible", "decision"), CASES)
def test_the_table(recorded: str, said: bool | None, over: bool, fits: bool,
                   preemptible: str | None, decision: Reconcile) -> None:
    assert reconcile(recorded, said, overdrawn=over, awake_fits=fits,
                     preemptible=preemptible) is decision
    assert disagrees(recorded, said, overdrawn=over) is (decision is not Reconcile.AGREE)


def test_other_states_are_not_a_sleep_to_check() -> None:
    for state, said, over, fits in itertools.product(
            [s for s in STATES if s not in (A, S)], (True, False, None), (True, False),
            (True, False)):
        assert reconcile(state, said, overdrawn=over, awake_fits=fits,
                         preemptible="stop") is Reconcile.AGREE


def test_every_combination_is_decided() -> None:
    decided = {(r, s, o, f, p) for r, s, o, f, p, _ in CASES}
    for combo in itertools.product((A, S), (True, False, None), (True, False), (True, False),
                                   (None, "sleep", "stop")):
        out = reconcile(combo[0], combo[1], overdrawn=combo[2], awake_fits=combo[3],
                        preemptible=combo[4])
        assert isinstance(out, Reconcile), combo
    assert len(decided) == len(CASES)


PREPARED = [
    # vLLM 0.34: /checkpoint/status prepared (is_sleeping says true): (recorded, fits, decision)
    (A, True, Reconcile.RESTORE),  # held running: restored within its reservation
    (A, False, Reconcile.RESTORE),
    (S, True, Reconcile.ADMIT_AWAKE_RESTORE),  # woken and prepared outside gpud: fits awake
    (S, False, Reconcile.STOP),  # cannot sleep while prepared, nor restore within its sleep
]


@pytest.mark.parametrize(("recorded", "fits", "decision"), PREPARED)
@pytest.mark.parametrize("preemptible", [None, "sleep", "stop"])
def test_a_prepared_serve_is_told_from_a_sleeping_one(recorded: str, fits: bool,
                                                      decision: Reconcile,
                                                      preemptible: str | None) -> None:
    assert reconcile(recorded, True, awake_fits=fits, preemptible=preemptible,
                     prepared=True) is decision
    assert disagrees(recorded, True, prepared=True)
    # the same answer without the checkpoint's: an ordinary sleeper
    assert reconcile(recorded, True, awake_fits=fits, preemptible=preemptible) in (
        Reconcile.SHOW_ASLEEP, Reconcile.AGREE)


def test_prepared_means_nothing_outside_running_and_sleeping() -> None:
    for state in STATES:
        if state not in (A, S):
            assert reconcile(state, True, awake_fits=True, preemptible=None,
                             prepared=True) is Reconcile.AGREE
