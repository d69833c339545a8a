"""A serve's on-demand facts are one record (gpud.core.demand.Demand), changed in one place:
`OnDemand.note` is the only code in gpud that writes the records (checked on gpud's syntax
trees; a planted writer proves the check can fail), and a record equal to NO_DEMAND is not kept."""

from __future__ import annotations

import ast
from dataclasses import FrozenInstanceError, replace
from pathlib import Path

import pytest

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
