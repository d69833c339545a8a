"""A serve's on-demand facts are one record (gpud.core.demand.Demand), changed in one place:
`OnDemand.note` is the only code in gpud that writes the records (checked on gpud's syntax
trees; a planted writer proves the check can fail), and a record equal to NO_DEMAND is not kept."""

from __future__ import annotations

import ast
from dataclasses import FrozenInstanceError, replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpud.core import bringup, demand
from gpud.core.bringup import Policy, Tries, Why
from gpud.core.demand import NO_DEMAND, Demand
from tests.test_bringup import on_demand

GPUD = Path(__file__).resolve().parents[1] / "gpud"
STORE = "_demands"


def writers(tree: ast.AST) -> list[str]:
    """The functions (Class.function) that touch the records other than by reading one item."""
    out: list[str] = []

    def visit(node: ast.AST, scope: list[str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = [*scope, node.name]
        for child in ast.iter_child_nodes(node):
            # a read is self._demands.get(...) or iterating .items(); anything else writes
            if isinstance(child, ast.Attribute) and child.attr == STORE and not (
                    isinstance(node, ast.Attribute) and node.attr in ("get", "items")):
                out.append(".".join(scope))
            visit(child, scope)

    visit(tree, [])
    return out


def test_only_note_writes_the_records() -> None:
    found = {f"{p.relative_to(GPUD)}:{w}" for p in sorted(GPUD.rglob("*.py"))
             for w in writers(ast.parse(p.read_text()))}
    assert found == {"server/ondemand.py:OnDemand.__init__", "server/ondemand.py:OnDemand.note"}


def test_a_planted_writer_is_found() -> None:
    planted = ("class OnDemand:\n"
               "    def _evict(self, name):\n"
               "        self._demands[name] = None\n"
               "    def demand(self, name):\n"
               "        return self._demands.get(name)\n")
    assert writers(ast.parse(planted)) == ["OnDemand._evict"]


def test_a_record_is_frozen() -> None:
    with pytest.raises(FrozenInstanceError):
        NO_DEMAND.idling = True  # type: ignore[misc]


def test_a_record_back_to_nothing_known_is_not_kept() -> None:
    od, _sup, _svc, _clock = on_demand()
    od.note("od", lambda d: replace(d, idling=True, up_at=3.0))
    assert od.demand("od") == Demand(idling=True, up_at=3.0)
    od.note("od", lambda d: replace(d, idling=False))
    assert od.demand("od") == Demand(up_at=3.0)
    od.note("od", lambda d: replace(d, up_at=None))
    assert od.demand("od") == NO_DEMAND and "od" not in od._demands


async def test_a_request_notes_its_time_in_the_one_record() -> None:
    od, _sup, _svc, clock = on_demand()
    clock.t = 7.0
    await od.ensure("od")
    got = od.demand("od")
    assert got.last_request is not None and got.last_activity is not None
    assert got.last_request == got.last_activity == 7.0 and not got.idling


# --- the bring-up rules over Demand (gpud.core.demand): pure, so checked as properties -------

POLICY = Policy(refusal_hold_s=5, first_s=2, max_s=60, stable_s=30)
TIMES = st.floats(0, 1e6, allow_nan=False)
REFUSALS = st.sampled_from([w for w in Why if w != Why.FAILED])
DEMANDS = st.builds(
    Demand, tries=st.none() | st.builds(Tries, failures=st.integers(0, 40), not_before=TIMES,
                                        why=st.none() | st.sampled_from(list(Why)),
                                        up_since=st.none() | TIMES),
    failure_counted=st.booleans(), idling=st.booleans(), up_at=st.none() | TIMES)


def _failures(d: Demand) -> int:
    return d.tries.failures if d.tries is not None else 0


@given(DEMANDS, TIMES, TIMES)
def test_a_failure_seen_again_and_again_counts_once(d: Demand, at: float, later: float) -> None:
    once = demand.failed_since(demand.began(d), at, "failed: exited", POLICY)
    assert once.failure_counted and _failures(once) >= 1
    assert demand.failed_since(once, later, "failed: exited", POLICY) == once
    # a new bring-up's failure is one more
    again = demand.failed_since(demand.began(once), at, "failed: exited", POLICY)
    assert _failures(again) in (1, _failures(once) + 1)  # 1: it had stayed up stable_s


@given(DEMANDS, TIMES, REFUSALS)
def test_a_refusal_holds_the_next_try_off_and_is_no_failure(d: Demand, now: float,
                                                            why: Why) -> None:
    after = demand.tried(d, now, why, "no room", POLICY)
    assert _failures(after) == _failures(d) and after.failure_counted == d.failure_counted
    assert after.tries is not None and after.tries.not_before == now + POLICY.refusal_hold_s
    hold = bringup.held(after.tries, now)
    assert hold is not None and hold.why == why


@given(DEMANDS, TIMES, TIMES)
def test_a_serve_that_came_up_is_held_off_no_more(d: Demand, now: float, later: float) -> None:
    up = demand.came_up(d, now)
    assert up.up_at == now and bringup.held(up.tries, now + later) is None
    # the other facts are left as they were
    assert (up.idling, up.failure_counted, up.need_mib) == (d.idling, d.failure_counted,
                                                           d.need_mib)


@given(DEMANDS, TIMES)
def test_an_operators_start_ends_the_backoff(d: Demand, now: float) -> None:
    started = demand.operator_started(d)
    assert bringup.held(started.tries, now) is None and not started.failure_counted
    assert replace(started, tries=d.tries, failure_counted=d.failure_counted) == d
