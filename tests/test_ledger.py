"""The ledger arithmetic, against the seed's numbers and as a property."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpud.core.ledger import (
    Denial,
    Ledger,
    PhysicalView,
    Reservation,
    RoleBudget,
    device_draw,
    gpu_memory_utilization,
    serve_draws,
)

DARK_FAST = RoleBudget("dark-fast", "0", 32607, 7168)


def admit(ledger: Ledger, serve: str, mib: int, **kw: object) -> Ledger:
    outcome = ledger.decide(serve, "dark-fast", mib, since=0.0, by_uid=0, **kw)  # type: ignore[arg-type]
    assert not isinstance(outcome, Denial), outcome
    return outcome[0]


def t015() -> Ledger:
    ledger = Ledger.build([DARK_FAST], [])
    for serve, mib in (("fast", 18432), ("embeddings", 3200), ("reranker", 3456)):
        ledger = admit(ledger, serve, mib)
    return ledger


def test_seed_t015_ocr_denied_with_shortfall() -> None:
    ledger = t015()
    figures = ledger.figures("dark-fast")
    assert (figures.committed_mib, figures.free_mib) == (25088, 351)
    denial = ledger.decide("ocr", "dark-fast", 5120, since=0.0, by_uid=0)
    assert isinstance(denial, Denial)
    assert (denial.bound, denial.need_mib, denial.free_mib, denial.shortfall_mib) == (
        "ledger", 5120, 351, 4769)
    assert denial.message == (
        "ocr denied on dark-fast: ledger bound: need 5120 MiB, free 351 MiB, short 4769 MiB")


def test_seed_t011_rebalance() -> None:
    ledger = t015().with_roles([RoleBudget("dark-fast", "0", 32607, 4608)])
    ledger = admit(ledger, "fast", 14336)  # replaces 18432, not added to it
    ledger = admit(ledger, "ocr", 5120)
    figures = ledger.figures("dark-fast")
    assert (figures.committed_mib, figures.free_mib) == (26112, 1887)
    assert figures.line() == (
        "gpu_role 'dark-fast': capacity 32607 MiB, reserve 4608 MiB, committed 26112 MiB, "
        "free 1887 MiB")


def test_own_reservation_is_replaced_not_added() -> None:
    ledger = Ledger.build([RoleBudget("r", "0", 1000, 0)], [])
    outcome = ledger.decide("a", "r", 900, since=0, by_uid=0)
    assert not isinstance(outcome, Denial)
    ledger, first = outcome
    assert first.replaced_mib is None
    # 950 would not fit next to 900, but it replaces it.
    outcome = ledger.decide("a", "r", 950, since=0, by_uid=0)
    assert not isinstance(outcome, Denial)
    assert outcome[1].replaced_mib == 900
    assert outcome[0].figures("r").committed_mib == 950


def test_physical_bound_named() -> None:
    ledger = Ledger.build([RoleBudget("r", "0", 32607, 4608)], [])
    view = PhysicalView(physical_free_mib=3000, pending_mib=1000)
    denial = ledger.decide("ocr", "r", 5120, since=0, by_uid=0, physical=view, check="strict")
    assert isinstance(denial, Denial)
    assert (denial.bound, denial.free_mib, denial.shortfall_mib) == ("physical", 2000, 3120)


def test_physical_counts_the_serves_own_draw_back() -> None:
    ledger = Ledger.build([RoleBudget("r", "0", 32607, 0)], [Reservation("a", "r", 1000, 0)])
    view = PhysicalView(physical_free_mib=100, pending_mib=0, own_observed_mib=1000)
    outcome = ledger.decide("a", "r", 1100, since=0, by_uid=0, physical=view)
    assert not isinstance(outcome, Denial)


def test_missing_role_keeps_reservations_as_over_committed() -> None:
    ledger = Ledger.build([], [Reservation("x", "gone", 100, 0)])
    over = ledger.over_committed()
    assert [f.role for f in over] == ["gone"] and over[0].free_mib == -100


def test_changed_config_reports_over_commit_and_keeps_reservations() -> None:
    ledger = t015().with_roles([RoleBudget("dark-fast", "0", 20000, 7168)])
    assert len(ledger.reservations) == 3
    assert ledger.over_committed()[0].free_mib == 20000 - 7168 - 25088


def test_device_draw_seed_honesty_note() -> None:
    # T011 live: full resident set running and drawing its reservations, 5837 MiB non-ledger.
    mibs = {"fast": 14336, "embeddings": 3200, "reranker": 3456, "ocr": 5120}
    pids = {100 + i: s for i, s in enumerate(mibs)}
    draws = serve_draws([(pid, mibs[s]) for pid, s in pids.items()] + [(999, 200), (998, None)],
                        pids)
    used = sum(mibs.values()) + 5837
    reservations = [Reservation(s, "dark-fast", m, 0) for s, m in mibs.items()]
    draw = device_draw(total_mib=32607, used_mib=used, free_mib=32607 - used, draws=draws,
                       reservations=reservations, states=dict.fromkeys(mibs, "running"),
                       reserve_mib=4608)
    assert draw.managed_draw_mib == 26112
    assert draw.non_ledger_draw_mib == 5837
    assert draw.reserve_excess_mib == 1229
    assert draw.pending_mib == 0
    assert draw.effective_free(1887) == 32607 - used  # 658: physical is the tighter bound


def test_pending_counts_reservations_not_yet_drawing() -> None:
    reservations = [Reservation("a", "r", 1000, 0), Reservation("b", "r", 500, 0)]
    draw = device_draw(total_mib=8000, used_mib=300, free_mib=7700, draws={"a": 300},
                       reservations=reservations, states={"a": "starting", "b": "running"},
                       reserve_mib=0)
    assert draw.pending_mib == 700


@pytest.mark.parametrize(("vram", "total", "util"), [
    (14336, 32607, "0.4396"), (18432, 32607, "0.5652"), (32607, 32607, "1.0000"),
    (1, 32607, "0.0000"), (5120, 32607, "0.1570"),
])
def test_gpu_memory_utilization_floors(vram: int, total: int, util: str) -> None:
    assert gpu_memory_utilization(vram, total) == util
    assert float(util) * total <= vram


@st.composite
def operations(draw: st.DrawFn) -> list[tuple[str, str, int]]:
    serves = ["a", "b", "c", "d", "e"]
    ops = st.tuples(st.sampled_from(["admit", "release", "shrink"]), st.sampled_from(serves),
                    st.integers(1, 40000))
    return draw(st.lists(ops, max_size=60))


@settings(max_examples=300, deadline=None)
@given(operations(), st.integers(1, 40000), st.integers(0, 39999))
def test_no_sequence_over_commits(ops: list[tuple[str, str, int]], capacity: int,
                                  reserve: int) -> None:
    reserve = min(reserve, capacity - 1)
    ledger = Ledger.build([RoleBudget("r", "0", capacity, reserve)], [])
    for op, serve, mib in ops:
        if op == "release":
            if serve in ledger.reservations:
                ledger, _ = ledger.release(serve)
        else:
            if op == "shrink" and serve in ledger.reservations:
                mib = max(1, ledger.reservations[serve].mib // 2)
            outcome = ledger.decide(serve, "r", mib, since=0, by_uid=0)
            if isinstance(outcome, Denial):
                assert outcome.shortfall_mib > 0
            else:
                ledger = outcome[0]
        committed = sum(r.mib for r in ledger.reservations.values())
        assert committed <= capacity - reserve
        assert ledger.figures("r").free_mib >= 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(1, 3000)), max_size=30),
       st.integers(0, 5000))
def test_admit_in_order_is_decide_one_after_another(wanted: list[tuple[str, int]],
                                                    reserve: int) -> None:
    roles = [RoleBudget("a", "0", 8000, reserve), RoleBudget("b", "1", 4000, 0)]
    start = Ledger.build(roles, [Reservation("held", "a", 500, 0.0)])
    items = [(f"s{i}", role, mib) for i, (role, mib) in enumerate(wanted)]
    batch, denied = start.admit_in_order(items, since=0.0)
    one_by_one, expected = start, []
    for serve, role, mib in items:
        outcome = one_by_one.decide(serve, role, mib, since=0.0, by_uid=None)
        if isinstance(outcome, Denial):
            expected.append(outcome)
        else:
            one_by_one = outcome[0]
    assert denied == expected
    assert batch.reservations == one_by_one.reservations
