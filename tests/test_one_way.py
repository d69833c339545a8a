"""One way to change a serve's state: an adapter reports what happened (gpud.core.serverecord)
and the serve's step decides. No call hands LedgerService's `admit`, `release` or
`store_event` a state (`state=`, `next_state=`) or a cause (`cause=`), none of them (nor the
one writer behind them) takes such a parameter, and gpud.core.states.check_change is never
asked without a cause (None allowed any change some cause allows). Checked on the syntax trees
of gpud, its tests, tools, bench and scripts; a second way planted in a copy of the tree is
found."""

from __future__ import annotations

import ast
import functools
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.test_one_writer import _name

ROOT = Path(__file__).resolve().parents[1]
TREES = ("gpud", "tests", "tools", "bench", "scripts")
# LedgerService's ways in to a state change, and the one writer behind them.
ENTRIES = frozenset({"admit", "release", "store_event"})
WRITERS = ENTRIES | {"_admit_locked", "_release_locked", "_store_state"}
SERVICE = "gpud/life/service.py"
NAMING = frozenset({"state", "next_state", "cause"})  # a state or its cause named outright


@dataclass(frozen=True)
class Way:
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def _is_none(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.arg]:
    a = fn.args
    return [*a.posonlyargs, *a.args, *a.kwonlyargs]


def ways(tree: ast.AST, path: str) -> list[Way]:
    """The second ways to change a state in one module."""
    found: list[Way] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _name(node.func)
            named = sorted(k.arg for k in node.keywords if k.arg in NAMING)
            if name in ENTRIES and named:
                found.append(Way(path, node.lineno,
                                 f"{name}() given {', '.join(f'{k}=' for k in named)}"))
            if name == "check_change":
                cause = [k.value for k in node.keywords if k.arg == "cause"]
                cause += node.args[2:3]
                if any(_is_none(c) for c in cause):
                    found.append(Way(path, node.lineno, "check_change() asked with no cause"))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if path == SERVICE and node.name in WRITERS:
                for arg in _params(node):
                    if arg.arg in NAMING:
                        found.append(Way(path, node.lineno,
                                         f"{node.name}() takes {arg.arg}="))
            if node.name == "check_change":
                causes = [a for a in _params(node) if a.arg == "cause"]
                if any(a.annotation is not None and "None" in ast.unparse(a.annotation)
                       for a in causes):
                    found.append(Way(path, node.lineno, "check_change() takes no cause (None)"))
    return found


@functools.cache
def _module_ways(text: str, rel: str) -> tuple[Way, ...]:
    # Kept by text: a planted copy re-reads only the module planted in.
    return tuple(ways(ast.parse(text, rel), rel))


def second_ways(root: Path = ROOT) -> list[Way]:
    out: list[Way] = []
    for tree in TREES:
        for path in sorted((root / tree).rglob("*.py")):
            out += _module_ways(path.read_text(), path.relative_to(root).as_posix())
    return out


def test_one_way_to_change_a_state() -> None:
    found = second_ways()
    assert not found, "a second way to change a serve's state:\n" + "\n".join(map(str, found))


def test_the_check_sees_the_entries_it_guards() -> None:
    """A renamed entry would leave a check that sees nothing: the service defines each one,
    and gpud's adapters call each one."""
    tree = ast.parse((ROOT / SERVICE).read_text())
    defined = {n.name for n in ast.walk(tree)
               if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    assert defined >= WRITERS
    called = {_name(n.func) for p in (ROOT / "gpud").rglob("*.py")
              for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.Call)}
    assert ENTRIES | {"check_change"} <= called


@pytest.fixture(scope="module")
def copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the trees the check reads, planted in by each test (a fresh copy per plant
    would copy the tree dozens of times: each test puts back what it planted)."""
    root = tmp_path_factory.mktemp("tree")
    for tree in TREES:
        shutil.copytree(ROOT / tree, root / tree,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return root


PLANTED_CALLS = [
    ("gpud/life/supervisor/launch.py",
     "await self.svc.store_event(ev, state=self.svc.state_row(serve, RUNNING))"),
    ("gpud/life/sleeping.py", "await self.svc.admit(serve, 100, state=SLEEPING)"),
    ("gpud/life/sleeping.py", "await self.svc.admit(serve, 100, happened=H, cause=Cause.SLEEP)"),
    ("gpud/life/rebalance.py", "await self.svc.release(serve, next_state=DECLARED)"),
    ("gpud/life/rebalance.py", "await svc.release(serve, next_state=FAILED, cause=Cause.FAIL)"),
    ("tests/test_service.py", "await svc.store_event(ev, state=row, cause=Cause.HEALTHY)"),
    ("tools/shape.py", "await svc.admit('a', 100, state=None)"),
    ("gpud/core/serverecord.py", "check_change(serve.state, target, None)"),
    ("gpud/life/service.py", "check_change(prev, row.state, cause=None)"),
]


@pytest.mark.parametrize(("where", "line"), PLANTED_CALLS)
def test_a_planted_second_way_is_found(copy: Path, where: str, line: str) -> None:
    path = copy / where
    before = path.read_text()
    try:
        path.write_text(before + f"\n\nasync def _planted(self, svc, serve, ev, row, H):\n"
                        f"    {line}\n")
        planted_at = len(before.splitlines()) + 4
        found = second_ways(copy)
    finally:
        path.write_text(before)
    assert [(w.path, w.line) for w in found] == [(where, planted_at)], found
    assert second_ways(copy) == []


PLANTED_SIGNATURES = [
    ("async def admit(self, serve: str, mib: int, *, role: str | None = None,",
     "async def admit(self, serve: str, mib: int, *, state: str | None = None, "
     "role: str | None = None,"),
    ("async def release(self, serve: str, *, uid: int | None = None,",
     "async def release(self, serve: str, *, next_state: str | None = None, "
     "uid: int | None = None,"),
    ("async def store_event(self, ev: Event, *, report: Reported | None = None,",
     "async def store_event(self, ev: Event, *, report: Reported | None = None, "
     "cause: object = None,"),
    ("def _store_state(self, changes: Changes, row: Reported, *,",
     "def _store_state(self, changes: Changes, row: Reported, cause: object = None, *,"),
]


@pytest.mark.parametrize(("old", "new"), PLANTED_SIGNATURES)
def test_a_planted_parameter_is_found(copy: Path, old: str, new: str) -> None:
    path = copy / SERVICE
    before = path.read_text()
    assert before.count(old) == 1
    try:
        path.write_text(before.replace(old, new))
        found = second_ways(copy)
    finally:
        path.write_text(before)
    [way] = found
    assert way.path == SERVICE and "takes" in way.what


def test_a_planted_optional_cause_is_found(copy: Path) -> None:
    path = copy / "gpud/core/states.py"
    before = path.read_text()
    old = "cause: Cause) -> ServeState | StateRefusal:"
    assert before.count(old) == 1
    try:
        path.write_text(before.replace(old, "cause: Cause | None) -> ServeState | StateRefusal:"))
        found = second_ways(copy)
    finally:
        path.write_text(before)
    assert [w.what for w in found] == ["check_change() takes no cause (None)"]
