#!/usr/bin/env python3
"""Figures of the code's shape, read from gpud's syntax trees (issue 45's note):

    python3 tools/shape.py            # this checkout
    python3 tools/shape.py /some/tree # another (e.g. `git archive COMMIT | tar -x -C DIR`)

- sites naming a state: calls outside gpud/core that pass a serve's next state (a ServeState
  member given as `state=`/`next_state=`, or a state row built with a state: only the one
  writer builds one, with what the step decided), the decision the serve's one step
  (gpud.core.serverecord) makes;
- the longest functions (lines), and the classes with the most methods;
- class names defined more than once in gpud/.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

STATE_NAMES = frozenset({"DECLARED", "ADMITTED", "STARTING", "RUNNING", "STOPPING", "DENIED",
                         "FAILED", "EXTERNAL", "ORPHAN", "SLEEPING"})
STATE_WORDS = frozenset(n.lower() for n in STATE_NAMES)
# Keywords by which a call asks for a serve's next state.
STATE_KEYWORDS = ("state", "next_state")
# Where the one writer builds a state row: with what the step decided, or (admit, release) with
# the state a test or a tool names outright through `state=`/`next_state=` (a keyword no caller
# in gpud passes a state to: the keyword check below finds any).
WRITERS = frozenset({("gpud/life/service.py", "LedgerService._store_state"),
                     ("gpud/life/service.py", "LedgerService._admit_locked"),
                     ("gpud/life/service.py", "LedgerService._release_locked")})


@dataclass(frozen=True)
class Site:
    path: str
    where: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} ({self.where}): {self.what}"


def names_a_state(node: ast.expr) -> bool:
    """The expression is (or picks between) ServeState members: DECLARED, ServeState.FAILED,
    "running", `A if c else B` of them."""
    if isinstance(node, ast.Name):
        return node.id in STATE_NAMES
    if isinstance(node, ast.Attribute):
        return node.attr in STATE_NAMES
    if isinstance(node, ast.Constant):
        return node.value in STATE_WORDS
    if isinstance(node, ast.IfExp):
        return names_a_state(node.body) or names_a_state(node.orelse)
    if isinstance(node, ast.BoolOp):
        return any(names_a_state(v) for v in node.values)
    return False


class _Finder(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path = path
        self.scope: list[str] = []
        self.found: list[Site] = []

    def _scoped(self, node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_ClassDef = visit_FunctionDef = visit_AsyncFunctionDef = _scoped

    def visit_Call(self, node: ast.Call) -> None:
        where = ".".join(self.scope) or "<module>"
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else (
            func.id if isinstance(func, ast.Name) else "")
        if name == "state_row" and len(node.args) >= 2 and (self.path, where) not in WRITERS:
            self.found.append(Site(self.path, where, node.lineno,
                                   "builds a state row naming its state"))
        for kw in node.keywords:
            if kw.arg in STATE_KEYWORDS and names_a_state(kw.value):
                self.found.append(Site(self.path, where, node.lineno,
                                       f"passes a state as {kw.arg}= to {name}()"))
        self.generic_visit(node)


def state_namings(root: Path) -> list[Site]:
    """Every call outside gpud/core (and outside the one writer) that names a serve's next
    state, under root/gpud."""
    out: list[Site] = []
    for path in sorted((root / "gpud").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("gpud/core/") or rel.startswith("gpud/testing/"):
            continue
        finder = _Finder(rel)
        finder.visit(ast.parse(path.read_text(), rel))
        out.extend(finder.found)
    return out


def _defs(root: Path) -> list[tuple[str, ast.AST, str]]:
    out: list[tuple[str, ast.AST, str]] = []
    for path in sorted((root / "gpud").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                out.append((rel, node, node.name))
    return out


def longest_functions(root: Path, n: int = 10) -> list[tuple[int, str]]:
    sized = [((node.end_lineno or 0) - node.lineno + 1, f"{rel}:{name}")
             for rel, node, name in _defs(root)
             if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]
    return sorted(sized, reverse=True)[:n]


def largest_classes(root: Path, n: int = 10) -> list[tuple[int, str]]:
    sized = [(sum(isinstance(b, ast.FunctionDef | ast.AsyncFunctionDef) for b in node.body),
              f"{rel}:{name}") for rel, node, name in _defs(root) if isinstance(node, ast.ClassDef)]
    return sorted(sized, reverse=True)[:n]


def classes_defined_twice(root: Path) -> dict[str, list[str]]:
    where: dict[str, list[str]] = defaultdict(list)
    for rel, node, name in _defs(root):
        if isinstance(node, ast.ClassDef):
            where[name].append(rel)
    return {name: paths for name, paths in sorted(where.items()) if len(paths) > 1}


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1]
    sites = state_namings(root)
    print(f"sites naming a state outside gpud/core: {len(sites)}")
    by_file: dict[str, int] = defaultdict(int)
    for s in sites:
        by_file[s.path] += 1
    for path, count in sorted(by_file.items(), key=lambda kv: -kv[1]):
        print(f"  {count:3d} {path}")
    print("longest functions (lines):")
    for size, name in longest_functions(root):
        print(f"  {size:4d} {name}")
    print("largest classes (methods):")
    for size, name in largest_classes(root):
        print(f"  {size:4d} {name}")
    twice = classes_defined_twice(root)
    print(f"class names defined more than once in gpud/: {len(twice)}")
    for name, paths in twice.items():
        print(f"  {name}: {', '.join(paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
