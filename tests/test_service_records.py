"""The serves' records (gpud.life.records: state, reason, the unit's PID and restart count, the
on-demand facts, the life) are changed only through their writers (the state by the ledger
service alone): read-only to everyone else, enforced three ways (a frozen record, a read-only
mapping, and a scan of every other module of gpud for a write into them)."""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpud.config import parse_config
from gpud.core.serverecord import Happened, UnitPid, UnitRestarts
from gpud.durable.store import Store
from gpud.life.records import ServeRecord
from gpud.life.service import LedgerService
from tests.conftest import REPO

CONFIG = """
[daemon]
admission = "ledger"
[roles.r]
device = "0"
capacity_mib = 1000
"""

FIELDS = {f.name for f in dataclasses.fields(ServeRecord)}
MUTATORS = {"setdefault", "pop", "popitem", "update", "clear", "__setitem__", "__delitem__",
            "remember"}  # the state: the ledger service's alone, after a commit


def _mentions_records(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "records" for n in ast.walk(node))


def writes_into_records(source: str) -> list[int]:
    """Lines of ``source`` that change a serve record: an item of ``.records`` assigned or
    deleted, a mutating method of ``.records`` called, or a field of a record taken from
    ``.records`` assigned (``rec = svc.records.get(s); rec.main_pid = ...``)."""
    tree = ast.parse(source)
    from_records: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AnnAssign | ast.NamedExpr) and node.value is not None \
                and _mentions_records(node.value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            from_records |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        if isinstance(node, ast.For | ast.comprehension) and _mentions_records(node.iter):
            from_records |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
    lines = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for target in targets:
            for t in ast.walk(target):
                item = isinstance(t, ast.Subscript) and _mentions_records(t.value)
                field = (isinstance(t, ast.Attribute) and t.attr in FIELDS
                         and isinstance(t.value, ast.Name) and t.value.id in from_records)
                if item or field:
                    lines.append(t.lineno)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in MUTATORS and _mentions_records(node.func.value)):
            lines.append(node.lineno)
    return sorted(set(lines))


def test_no_module_but_the_service_writes_into_the_records() -> None:
    found = {}
    for path in sorted((REPO / "gpud").rglob("*.py")):
        if path.name == "service.py" and path.parent.name == "gpud":
            continue
        lines = writes_into_records(path.read_text())
        if lines:
            found[str(path.relative_to(REPO))] = lines
    assert found == {}


@pytest.mark.parametrize("source", [
    "rec = self.svc.records.get(s)\nrec.main_pid = 5\n",
    "rec = svc.records[s]\nrec.n_restarts += 1\n",
    "for name, rec in svc.records.items():\n    rec.state = 'x'\n",
    "svc.records[s] = None\n",
    "svc.records.setdefault(s, None)\n",
    "del svc.records[s]\n",
])
def test_the_scan_finds_a_write(source: str) -> None:
    assert writes_into_records(source) != []


def test_the_scan_lets_reads_through() -> None:
    source = ("rec = svc.records.get(s)\nx = rec.main_pid if rec else None\n"
              "names = [n for n, r in svc.records.items() if r.state]\nrec2 = other()\n"
              "rec2.state = 1\n")
    assert writes_into_records(source) == []


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[LedgerService]:
    store = Store(tmp_path / "gpud.sqlite3")
    service = LedgerService(parse_config(CONFIG, "test"), store)
    service.load()
    yield service
    service.close()
    store.close()


async def test_the_records_are_read_only_outside(svc: LedgerService) -> None:
    await svc.admit("a", 100, role="r")
    with pytest.raises(TypeError):
        svc.records["a"] = ServeRecord()  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        svc.records["a"].main_pid = 1  # type: ignore[misc]


async def test_pid_and_restart_count_through_the_service_kept_across_a_state_change(
        svc: LedgerService) -> None:
    await svc.admit("a", 100, role="r")
    svc.records.apply("a", UnitPid(4242))
    svc.records.apply("a", UnitRestarts(3))
    assert (svc.records["a"].main_pid, svc.records["a"].n_restarts) == (4242, 3)
    await svc.store_event(svc.event("start", "a started"), report=svc.report("a", Happened.LAUNCHED))
    rec = svc.records["a"]
    assert (rec.state, rec.main_pid, rec.n_restarts) == ("starting", 4242, 3)
    svc.records.apply("a", UnitPid(None))
    svc.records.apply("a", UnitRestarts(0))
    assert (svc.records["a"].main_pid, svc.records["a"].n_restarts) == (None, 0)
    svc.records.apply("nobody", UnitPid(1))  # a serve without a record gets none
    svc.records.apply("nobody", UnitRestarts(1))
    assert "nobody" not in svc.records
