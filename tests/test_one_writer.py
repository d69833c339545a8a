"""A serve's recorded state has one writer: `LedgerService._store_state` (gpud/life/service.py),
which asks gpud.core.states whether the change is allowed and puts it into the transaction beside
the reservation change. Checked on gpud's syntax trees: nothing else builds a state row, puts one
into a change, writes the store's table of states, or sets a record's state in memory; and every
call that asks for a state names its cause. A planted writer proves each check can fail."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPUD = ROOT / "gpud"

# What may do which kind of writing (module path relative to the repository, function).
SERVICE, STORE, STEP = "gpud/life/service.py", "gpud/durable/store.py", "gpud/core/serverecord.py"
ALLOWED: dict[str, set[tuple[str, str]]] = {
    # a state row built: the adapter's callers get one only from state_row; the store reads back
    "row": {(SERVICE, "LedgerService.state_row"), (STORE, "Store.serve_states")},
    # a row put into a change (Changes.states): the adapter alone
    "change": {(SERVICE, "LedgerService._store_state")},
    # the store's table of states written (its SQL): the store's transaction alone
    "table": {(STORE, "Store._write")},
    # a record's state set in memory: the record's one step alone (kept by ServeRecords.apply,
    # with what was stored: gpud.core.serverecord.Stored)
    "memory": {(STEP, "_fact"), (STEP, "step"), (STEP, "as_planned")},
    # no setter of a state in memory (there was one for tests): the service reports Stored events
    "remember": set(),
}
# Calls that ask for a state (keyword) and must say why (cause=).
ASKS = {"store_event": "state", "admit": "state", "admit_preempting": "state",
        "release": "next_state"}


@dataclass(frozen=True)
class Write:
    path: str
    where: str  # Class.function, or <module>
    line: int
    kind: str
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} ({self.where}): {self.what}"


def _name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


class _Finder(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path = path
        self.scope: list[str] = []
        self.found: list[Write] = []

    def _add(self, node: ast.AST, kind: str, what: str) -> None:
        where = ".".join(self.scope) or "<module>"
        self.found.append(Write(self.path, where, getattr(node, "lineno", 0), kind, what))

    def _scoped(self, node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_ClassDef = visit_FunctionDef = visit_AsyncFunctionDef = _scoped

    def visit_Call(self, node: ast.Call) -> None:
        name = _name(node.func)
        keywords = {k.arg for k in node.keywords}
        if name == "ServeStateRow":
            self._add(node, "row", "builds a ServeStateRow")
        if name == "Changes" and "states" in keywords:
            self._add(node, "change", "puts states into a Changes")
        if isinstance(node.func, ast.Attribute) and node.func.attr in (
                "append", "extend", "insert") and _name(node.func.value) == "states" \
                and isinstance(node.func.value, ast.Attribute):
            self._add(node, "change", f"adds to a change's states ({node.func.attr})")
        if name == "replace" and "state" in keywords:
            self._add(node, "memory", "replaces a record's state")
        if name == "ServeRecord" and (node.args or "state" in keywords):
            self._add(node, "memory", "builds a ServeRecord with a state")
        if name == "remember":
            self._add(node, "remember", "sets a record's state in memory")
        asked = ASKS.get(name or "")
        if asked is not None and asked in keywords and "cause" not in keywords:
            self._add(node, "cause", f"asks {name}() for a state ({asked}=) naming no cause")
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            if isinstance(target, ast.Attribute) and target.attr == "states" \
                    and _name(target.value) != "self":
                self._add(node, "change", "assigns a change's states")
            if isinstance(target, ast.Attribute) and target.attr == "state" \
                    and _name(target.value) in ("rec", "record"):
                self._add(node, "memory", "assigns a record's state")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str):
            sql = " ".join(node.value.upper().split())
            if any(w in sql for w in ("INTO SERVE_STATES", "UPDATE SERVE_STATES",
                                      "FROM SERVE_STATES WHERE")) and "SELECT" not in sql:
                self._add(node, "table", "writes the store's table of states")


def writes(path: Path, root: Path = ROOT) -> list[Write]:
    rel = path.relative_to(root).as_posix()
    finder = _Finder(rel)
    finder.visit(ast.parse(path.read_text(), str(path)))
    return finder.found


def strays(root: Path = ROOT) -> list[Write]:
    """Every write of a state not where ALLOWED puts it, under root/gpud."""
    out = []
    for path in sorted((root / "gpud").rglob("*.py")):
        for w in writes(path, root):
            if (w.path, w.where) not in ALLOWED.get(w.kind, set()):
                out.append(w)
    return out


def test_one_writer_of_a_serve_state() -> None:
    found = strays()
    assert not found, "a serve's state written outside LedgerService._store_state:\n" + \
        "\n".join(map(str, found))


def test_each_allowed_writer_is_where_it_is_said_to_be() -> None:
    """The checks find what they are meant to find in gpud itself: a renamed adapter or store
    method fails here rather than leaving a check that can no longer see anything."""
    seen = {(w.kind, w.path, w.where) for p in GPUD.rglob("*.py") for w in writes(p)}
    for kind, places in ALLOWED.items():
        for path, where in places:
            assert (kind, path, where) in seen, (kind, path, where)


def test_every_writer_names_its_cause() -> None:
    """Each of gpud's calls that asks for a state names why (gpud.core.states.Cause)."""
    asked = [w for p in GPUD.rglob("*.py") for w in writes(p) if w.kind == "cause"]
    assert not asked, "\n".join(map(str, asked))


PLANTED = '''
from dataclasses import replace
from gpud.durable.store import Changes, ServeStateRow

class Sneaky:
    def run(self, svc, store, rec, changes, now):
        row = ServeStateRow("a", "running", None, now)
        store.commit(Changes(states=[row]))
        changes.states.append(row)
        changes.states = [row]
        svc._records["a"] = replace(rec, state="running")
        rec.state = "failed"
        svc.records.remember("a", "running", None, now)
        store._db.execute("UPDATE serve_states SET state='running' WHERE serve='a'")
        svc.store_event(None, state=row)
        svc.release("a", next_state="failed")
        svc.admit("a", 100, state="sleeping")
'''


def test_a_planted_writer_is_found(tmp_path: Path) -> None:
    (tmp_path / "gpud").mkdir()
    (tmp_path / "gpud" / "sneaky.py").write_text(PLANTED)
    found = strays(tmp_path)
    kinds = [w.kind for w in found]
    assert kinds.count("row") == 1
    assert kinds.count("change") == 3
    assert kinds.count("memory") == 2
    assert kinds.count("remember") == 1
    assert kinds.count("table") == 1
    assert kinds.count("cause") == 3
    assert all(w.where == "Sneaky.run" and w.path == "gpud/sneaky.py" for w in found)


PLANTED_LINES = [ln.strip() for ln in PLANTED.splitlines() if ln.startswith(" " * 8)]


@pytest.mark.parametrize("line", PLANTED_LINES)
def test_each_planted_line_alone_is_found(tmp_path: Path, line: str) -> None:
    (tmp_path / "gpud").mkdir()
    (tmp_path / "gpud" / "one.py").write_text(
        f"def f(svc, store, rec, changes, row, now):\n    {line}\n")
    assert len(strays(tmp_path)) == 1, line
