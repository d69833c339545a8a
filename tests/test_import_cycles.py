"""gpud's modules import one another without a circle. The graph is built from the source: every
import statement at any depth is an edge (one inside a function, or under TYPE_CHECKING, ties
the two modules together as much as one at the top: it only moves the circle to run time or to
the type checker). A circle is a strongly connected set of modules; each is listed."""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, package: str = "gpud") -> dict[str, set[str]]:
    """Module -> the modules of PACKAGE it imports (`from gpud.core import answers` imports
    gpud.core.answers, a module of its own)."""
    modules = {module_name(root, p): p for p in (root / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                names_only = len(subs) < len(node.names)
                edges |= subs | ({node.module} if names_only else set())
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        # Iterative: a recursion as deep as the import chains is fine, but this needs no limit.
        work: list[tuple[str, Iterator[str]]] = [(v, iter(sorted(graph[v])))]
        index[v] = low[v] = len(index)
        stack.append(v)
        while work:
            node, edges = work[-1]
            for w in edges:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    scc = []
                    while True:
                        w = stack.pop()
                        scc.append(w)
                        if w == node:
                            break
                    if len(scc) > 1:
                        found.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_gpud_has_no_import_cycle() -> None:
    found = cycles(import_graph(ROOT))
    assert found == []


def test_the_check_finds_a_planted_cycle(tmp_path: Path) -> None:
    files = {
        "gpud/__init__.py": "",
        "gpud/core/__init__.py": "",
        "gpud/core/a.py": "from gpud.core import b\n",
        "gpud/core/b.py": "def f():\n    from gpud.c import x\n",
        "gpud/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from gpud.core.a import A\n",
        "gpud/d.py": "import gpud.core.a\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert cycles(import_graph(tmp_path)) == [["gpud.c", "gpud.core.a", "gpud.core.b"]]
