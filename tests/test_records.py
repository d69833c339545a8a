"""A serve's on-demand facts (gpud.core.demand.Demand) and its runtime life
(gpud.core.lifecycle.ServeLife) are parts of the serve's one record in memory
(gpud.core.serverecord.Record), changed in one place: the record's one step, kept by
`ServeRecords.apply` (the supervisor's step reports its inputs there); no adapter writes them
(checked on gpud's syntax trees; planted writers prove the check can fail). A state change
keeps them, and a change of them keeps the state."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest

from gpud.core.bringup import Tries
from gpud.core.demand import NO_DEMAND, Demand, Requested
from gpud.core.lifecycle import IDLE_LIFE, LaunchEnded, ServeLife, StartAsked
from gpud.core.serverecord import Put
from gpud.core.vocab import DECLARED, EXTERNAL
from gpud.life.records import ServeRecords
from gpud.life.service import LedgerService
from tests.test_bringup import on_demand
from tests.test_service_records import svc  # noqa: F401  (the fixture: a real service)

GPUD = Path(__file__).resolve().parents[1] / "gpud"
BUILDERS = ("replace", "ServeRecord")  # the calls that make a serve's record anew


def writers(tree: ast.AST, field: str = "demand") -> list[str]:
    """The functions (Class.function) that set FIELD of a serve's record: a record built or
    replaced with it (`replace(rec, demand=...)`, `ServeRecord(demand=...)`) or an assignment
    to `.demand`."""
    out: list[str] = []

    def visit(node: ast.AST, scope: list[str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = [*scope, node.name]
        if isinstance(node, ast.Call) and any(k.arg == field for k in node.keywords) and (
                getattr(node.func, "id", None) in BUILDERS
                or getattr(node.func, "attr", None) in BUILDERS):
            out.append(".".join(scope))
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Attribute) and t.attr == field
                   for target in targets for t in ast.walk(target)):
                out.append(".".join(scope))
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(tree, [])
    return out


def callers(tree: ast.AST, method: str) -> list[str]:
    """The functions (Class.function) that call METHOD."""
    out: list[str] = []

    def visit(node: ast.AST, scope: list[str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = [*scope, node.name]
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == method:
            out.append(".".join(scope))
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(tree, [])
    return out


def _adapters() -> list[tuple[Path, ast.AST]]:
    # the pure core's own Record (gpud.core.serverecord) is a value stepped, not the store
    return [(p, ast.parse(p.read_text())) for p in sorted(GPUD.rglob("*.py"))
            if p.relative_to(GPUD).parts[0] != "core"]


STEP = GPUD / "core" / "serverecord.py"


@pytest.mark.parametrize("field", ["demand", "life"])
def test_each_memory_only_part_of_the_record_has_one_writer(field: str) -> None:
    """No adapter makes a record with a part changed: the record's one step does
    (gpud.core.serverecord), kept by ServeRecords.apply."""
    found = {f"{p.relative_to(GPUD)}:{w}" for p, tree in _adapters()
             for w in writers(tree, field)}
    assert found == set()
    in_step = {w.split(".")[-1] for w in writers(ast.parse(STEP.read_text()), field)}
    assert in_step == {"_fact", "step"}


def test_only_the_step_of_a_serves_life_sets_it() -> None:
    """The supervisor's step reports its input to the record's one writer; nothing of gpud's
    sets a life whole."""
    found = {f"{p.relative_to(GPUD)}:{c}" for p, tree in _adapters()
             for c in callers(tree, "set_life")}
    assert found == set()
    base = GPUD / "life" / "supervisor" / "base.py"
    assert "Runtime.step" in callers(ast.parse(base.read_text()), "apply")


@pytest.mark.parametrize("planted", [
    "class OnDemand:\n    def _evict(self, rec):\n        return replace(rec, demand=None)\n",
    "class OnDemand:\n    def _evict(self, rec):\n        rec.demand = None\n",
    "class OnDemand:\n    def _evict(self):\n        return ServeRecord(demand=NO_DEMAND)\n",
    "class OnDemand:\n    def _evict(self, rec):\n        return dataclasses.replace(rec, demand=1)\n",
])
def test_a_planted_writer_is_found(planted: str) -> None:
    assert writers(ast.parse(planted)) == ["OnDemand._evict"]


def test_a_planted_caller_is_found() -> None:
    planted = "class Sleeps:\n    def wake(self, svc):\n        svc.records.set_life('a', None)\n"
    assert callers(ast.parse(planted), "set_life") == ["Sleeps.wake"]


async def test_the_facts_the_life_and_the_state_are_one_record(
        svc: LedgerService) -> None:  # noqa: F811
    svc.records.apply("a", Put(demand=replace(svc.records.demand("a"), idling=True, up_at=3.0)))
    assert svc.records["a"].demand == svc.records.demand("a") == Demand(idling=True, up_at=3.0)
    assert svc.state_of("a") == DECLARED
    # a committed state change keeps the facts...
    await svc.admit("a", 100, role="r")
    assert svc.records["a"].state == EXTERNAL  # the config names no serve a
    assert svc.records.demand("a") == Demand(idling=True, up_at=3.0)
    # ...and a change of the facts keeps the state, its reason and when it was stored
    before = svc.records["a"]
    svc.records.apply("a", Put(demand=replace(svc.records.demand("a"), idling=False)))
    assert svc.records["a"] == replace(before, demand=Demand(up_at=3.0))
    # its life is the same record's, and changing it keeps the rest
    launching = ServeLife(launching=True)
    svc.records.apply("a", Put(life=launching))
    assert svc.records["a"] == replace(before, demand=Demand(up_at=3.0), life=launching)
    assert svc.records.life("a") == launching


def test_nothing_known_of_a_serve_without_a_record_makes_none(
        svc: LedgerService) -> None:  # noqa: F811
    noted = replace(svc.records.demand("b"), idling=False)
    svc.records.apply("b", Put(demand=noted))
    assert noted == NO_DEMAND
    svc.records.apply("b", Put(life=IDLE_LIFE))
    assert "b" not in svc.records and svc.records.demand("b") == NO_DEMAND
    assert svc.records.life("b") == IDLE_LIFE


def test_the_tries_are_read_from_the_records() -> None:
    od, _sup, fake, _clock = on_demand()
    tries = Tries(failures=2, not_before=9.0)
    fake.records.apply("od", Put(demand=replace(fake.records.demand("od"), tries=tries)))
    assert od.tries == {"od": tries} and fake.records["od"].demand.tries == tries


async def test_a_request_notes_its_time_in_the_one_record() -> None:
    od, _sup, _svc, clock = on_demand()
    clock.t = 7.0
    await od.ensure("od")
    got = od.svc.records.demand("od")
    assert got.last_request is not None and got.last_activity is not None
    assert got.last_request == got.last_activity == 7.0 and not got.idling


def test_a_change_of_a_serves_life_is_told_with_its_name() -> None:
    """`watch_lives`: each step that changes a serve's life is told with the serve's name (the
    on-demand orchestrator wakes the requests waiting on that serve's devices, not all); one
    that leaves the life as it was (a request's time, a refused start) is not."""
    records = ServeRecords()
    told: list[str] = []
    records.watch_lives(told.append)
    records.apply("a", StartAsked())
    records.apply("a", Requested(5.0))
    records.apply("b", StartAsked())
    records.apply("a", StartAsked())  # refused: a launch is under way, its life unchanged
    records.apply("a", LaunchEnded())
    assert told == ["a", "b", "a"]
