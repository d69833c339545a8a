"""A serve's record changes one way: `ServeRecords.apply(serve, event)` steps the whole record
with gpud.core.serverecord.step and keeps the result. Checked on gpud's syntax trees: nothing
outside that step (gpud/core/serverecord.py) and `apply` puts a record into the records,
takes one out, or makes a changed copy of one (`replace(rec, state=...)`), and gpud's adapters
report events rather than call the setters kept for tests (`remember`, `note_demand`,
`set_life`...). Planted raw changes prove each check can fail."""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpud.core.serverecord import Record

ROOT = Path(__file__).resolve().parents[1]
GPUD = ROOT / "gpud"
STEP = "gpud/core/serverecord.py"  # the step: every changed copy of a record is made here
RECORDS = "gpud/life/records.py"
APPLY = "ServeRecords.apply"  # the one place a stepped record is kept

FIELDS = frozenset(f.name for f in dataclasses.fields(Record))
# Fields no other value of gpud's has: a replace() naming one changes a serve's record. `reason`
# and `updated` are common words, counted when the value replaced is named as a record.
OWN_FIELDS = FIELDS - {"reason", "updated"}
MUTATORS = frozenset({"pop", "popitem", "setdefault", "update", "clear", "__setitem__",
                      "__delitem__"})
# The setters there were (each one event through apply; now gone): a call of one is still found.
SETTERS = frozenset({"remember", "set_main_pid", "set_restart_count", "note_demand",
                     "set_life"})
# The on-demand orchestrator changes its facts by events once it is moved to the life floor
# (one file, by name, wherever it lives until then).
SETTER_CALLERS = frozenset({"ondemand.py"})


@dataclass(frozen=True)
class Change:
    path: str
    where: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} ({self.where}): {self.what}"


def _records_of(node: ast.expr, scope: list[str]) -> bool:
    """NODE is the records (`svc.records`, `x._records`; `self._records` inside ServeRecords,
    the one class whose own `_records` they are)."""
    if not isinstance(node, ast.Attribute):
        return False
    if node.attr == "records":
        return True
    if node.attr != "_records":
        return False
    own = isinstance(node.value, ast.Name) and node.value.id == "self"
    return not own or "ServeRecords" in scope


def _named_record(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and "rec" in node.id.lower()


class _Finder(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path = path
        self.scope: list[str] = []
        self.found: list[Change] = []

    def _add(self, node: ast.AST, what: str) -> None:
        where = ".".join(self.scope) or "<module>"
        self.found.append(Change(self.path, where, getattr(node, "lineno", 0), what))

    def _scoped(self, node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_ClassDef = visit_FunctionDef = visit_AsyncFunctionDef = _scoped

    def _targets(self, node: ast.AST, targets: list[ast.expr]) -> None:
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Subscript) and _records_of(t.value, self.scope):
                    self._add(node, f"puts into the records ({ast.unparse(t)})")

    def visit_Assign(self, node: ast.Assign) -> None:
        self._targets(node, node.targets)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._targets(node, [node.target])
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._targets(node, [node.target])
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        self._targets(node, node.targets)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        if isinstance(func, ast.Attribute) and func.attr in MUTATORS \
                and _records_of(func.value, self.scope):
            self._add(node, f"changes the records ({func.attr})")
        if name == "replace":
            keys = {k.arg for k in node.keywords if k.arg is not None}
            first = node.args[0] if node.args else None
            if keys & OWN_FIELDS or (keys and keys <= FIELDS and first is not None
                                     and _named_record(first)):
                self._add(node, f"makes a changed record ({', '.join(sorted(keys))})")
        if name == "__setattr__" and not (node.args and isinstance(node.args[0], ast.Name)
                                          and node.args[0].id == "self"):
            # (a frozen value's own __post_init__ sets its own attributes)
            self._add(node, "sets an attribute of a frozen value")
        if name in SETTERS and isinstance(func, ast.Attribute) \
                and not (isinstance(func.value, ast.Name) and func.value.id == "self"):
            self._add(node, f"calls the setter {name}() (report an event)")
        if name == "Put":
            self._add(node, "sets a part of a record whole (Put)")
        self.generic_visit(node)


def changes(path: Path, root: Path = ROOT) -> list[Change]:
    rel = path.relative_to(root).as_posix()
    finder = _Finder(rel)
    finder.visit(ast.parse(path.read_text(), str(path)))
    return finder.found


def _allowed(c: Change) -> bool:
    if c.path == STEP:
        return True  # the step itself
    if c.path == RECORDS:
        # apply keeps what the step made; the setters kept for tests each call apply with Put
        return c.where == APPLY or (c.what.startswith("sets a part")
                                    and c.where.split(".")[-1] in SETTERS)
    return c.what.startswith("calls the setter") and Path(c.path).name in SETTER_CALLERS


def raw_changes(root: Path = ROOT) -> list[Change]:
    """Every change of a serve's record in root/gpud that is not the step's or apply's."""
    return [c for p in sorted((root / "gpud").rglob("*.py")) for c in changes(p, root)
            if not _allowed(c)]


def test_a_record_changes_only_through_apply() -> None:
    found = raw_changes()
    assert not found, "a serve's record changed outside ServeRecords.apply:\n" + \
        "\n".join(map(str, found))


def test_the_check_sees_the_one_writer() -> None:
    """The check finds apply's keeping and the step's copies in gpud itself: a renamed method
    fails here rather than leaving a check that sees nothing."""
    seen = {(c.path, c.where) for p in GPUD.rglob("*.py") for c in changes(p)}
    assert (RECORDS, APPLY) in seen
    assert (STEP, "step") in seen


PLANTED = [
    "svc.records._records['a'] = rec",
    "self.svc.records._records.pop('a')",
    "del svc.records._records['a']",
    "svc.records._records.setdefault('a', rec)",
    "new = replace(rec, state='running')",
    "new = dataclasses.replace(record, demand=d)",
    "new = replace(rec, reason='why')",
    "object.__setattr__(rec, 'state', 'failed')",
    "svc.records.note_demand('a', lambda d: d)",
    "svc.records.set_life('a', life)",
    "svc.records.remember('a', 'running', None, 0.0)",
    "svc.records.apply('a', Put(demand=d))",
]


@pytest.mark.parametrize("line", PLANTED)
def test_a_planted_raw_change_is_found(tmp_path: Path, line: str) -> None:
    (tmp_path / "gpud" / "life").mkdir(parents=True)
    (tmp_path / "gpud" / "life" / "sleeping.py").write_text(
        f"class Sleeps:\n    def wake(self, svc, rec, record, d, life):\n        {line}\n")
    [found] = raw_changes(tmp_path)
    assert (found.path, found.where, found.line) == ("gpud/life/sleeping.py", "Sleeps.wake", 3)


@pytest.mark.parametrize("line", [
    "self._records['a'] = rec",  # in ServeRecords, outside apply
    "self._records.pop('a')",
])
def test_a_raw_change_inside_the_records_but_outside_apply_is_found(
        tmp_path: Path, line: str) -> None:
    (tmp_path / "gpud" / "life").mkdir(parents=True)
    (tmp_path / "gpud" / "life" / "records.py").write_text(
        f"class ServeRecords:\n    def forget(self, rec):\n        {line}\n")
    [found] = raw_changes(tmp_path)
    assert found.where == "ServeRecords.forget"


def test_reads_and_other_values_are_let_through(tmp_path: Path) -> None:
    (tmp_path / "gpud").mkdir()
    (tmp_path / "gpud" / "calm.py").write_text(
        "class Calibrations:\n"
        "    def put(self, cal, peer):\n"
        "        self._records[cal.serve] = cal\n"  # another class's own _records
        "        x = svc.records['a'].state\n"
        "        y = replace(peer, reason='gone')\n"  # not a record's: named otherwise
        "        z = Record(state)\n"  # a value made, not a record changed
        "        svc.records.apply('a', Stored('running', None, 0.0))\n")
    assert raw_changes(tmp_path) == []


def test_the_setters_are_left_to_the_orchestrator_alone(tmp_path: Path) -> None:
    (tmp_path / "gpud" / "life").mkdir(parents=True)
    (tmp_path / "gpud" / "life" / "ondemand.py").write_text(
        "class OnDemand:\n    def f(self, name):\n"
        "        self.svc.records.note_demand(name, lambda d: d)\n")
    assert raw_changes(tmp_path) == []
