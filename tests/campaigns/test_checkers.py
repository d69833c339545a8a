"""The campaigns' checks are not vacuous: each catches the fault it is there for."""

from __future__ import annotations

from gpud.core.ledger import RoleBudget
from tests.campaigns.conftest import (
    Op,
    Replay,
    Sampler,
    check_ledger_figures,
    check_real_time_order,
    fingerprint,
    match_acks,
    replay,
)

BUDGETS = [RoleBudget("r", "0", 1000, 100)]


def ev(i: int, kind: str, serve: str, mib: int, **details: int) -> dict:
    return {"id": i, "ts": float(i), "kind": kind, "serve": serve, "role": "r", "mib": mib,
            "uid": 0, "details": details}


def good_log() -> list[dict]:
    return [ev(1, "admit", "a", 500, free_mib=400, committed_mib=500),
            ev(2, "deny", "b", 500, free_mib=400),
            ev(3, "admit", "b", 300, free_mib=100, committed_mib=800),
            ev(4, "release", "a", 500)]


def test_replay_accepts_a_consistent_log() -> None:
    rep = replay(good_log(), BUDGETS)
    assert rep.problems == []
    assert {s: r.mib for s, r in rep.ledger.reservations.items()} == {"b": 300}
    assert len(rep.states) == 4  # the empty ledger, then one state per change


def test_replay_catches_over_admission_wrong_figures_and_phantom_releases() -> None:
    log = good_log()
    log[2] = ev(3, "admit", "b", 600, free_mib=-200, committed_mib=1100)  # over capacity
    assert any("replay denies it" in p for p in replay(log, BUDGETS).problems)
    log = good_log()
    log[1] = ev(2, "deny", "b", 300, free_mib=400)  # it fitted
    assert any("replay admits it" in p for p in replay(log, BUDGETS).problems)
    log = good_log()
    log[0] = ev(1, "admit", "a", 500, free_mib=401, committed_mib=500)
    assert any("gpud said free 401" in p for p in replay(log, BUDGETS).problems)
    log = [*good_log(), ev(5, "release", "a", 500)]  # released twice
    assert any("the replay holds None" in p for p in replay(log, BUDGETS).problems)


def test_ledger_figures_checked() -> None:
    role = {"name": "r", "capacity_mib": 1000, "reserve_mib": 100, "committed_mib": 950,
            "free_mib": -50, "reservations": [{"serve": "a", "role": "r", "mib": 950}]}
    assert any("> capacity" in p for p in check_ledger_figures({"roles": [role]}))
    role.update(committed_mib=900, free_mib=0)
    assert any("!= sum" in p for p in check_ledger_figures({"roles": [role]}))


def test_acknowledged_operation_without_its_event_is_caught() -> None:
    ops = [Op("admit", "a", 500, t_send=0, t_reply=1, status=200, body={}),
           Op("admit", "c", 77, t_send=0, t_reply=1, status=200, body={})]
    matched, problems = match_acks(ops, good_log())
    assert matched == {0: 1}
    assert problems == ["acknowledged admit c 77 (200) has no stored admit event"]


def test_commit_order_against_real_time() -> None:
    first = Op("admit", "a", 1, t_send=0.0, t_reply=1.0, status=200)
    later = Op("admit", "b", 2, t_send=2.0, t_reply=3.0, status=200)
    assert check_real_time_order([first, later], {0: 10, 1: 11}) == []
    assert check_real_time_order([first, later], {0: 11, 1: 10})  # committed before it was sent


def test_snapshots_must_be_replay_states_in_order() -> None:
    rep: Replay = replay(good_log(), BUDGETS)
    sampler = Sampler("/nonexistent")
    sampler.snapshots = [rep.states[0], rep.states[2], rep.states[3]]
    assert sampler.check_against(rep) == []
    sampler.snapshots = [rep.states[3], rep.states[1]]
    assert any("back in time" in p for p in sampler.check_against(rep))
    sampler.snapshots = [fingerprint({"a": ("r", 999)})]
    assert any("no state of the replay" in p for p in sampler.check_against(rep))
