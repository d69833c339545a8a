"""The tree shows the architecture: gpud's adapters live on floors (packages), each importing only
the pure core, the root modules and the floors below it (each floor's __init__ says so)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

GPUD = Path(__file__).resolve().parent.parent / "gpud"

# bottom to top; "errors" is the one error tree, pure, that every floor raises from; "root" the
# modules every adapter shares (gpud/*.py but daemon and execv)
FLOORS = ["errors", "core", "vllm", "root", "durable", "host", "nginx", "life", "server", "top"]
ROOT = {"files", "bounded", "config", "__init__"}
TOP = {"daemon", "execv", "ctl", "testing"}


def floor_of(module: str) -> str:
    """The floor of a module named gpud.X[.Y...]."""
    parts = module.split(".")
    if len(parts) == 1:
        return "root"
    head = parts[1]
    if head == "errors":
        return "errors"
    if head in FLOORS:
        return head
    if head in ROOT or head == "__version__":
        return "root"
    if head in TOP:
        return "top"
    raise AssertionError(f"{module}: on no floor (put it in one of {FLOORS})")


def imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "gpud":
            if node.module == "gpud":
                found += [(node.lineno, f"gpud.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "gpud"]
    return found


def violations(root: Path) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        module = ".".join(rel.parts).removesuffix(".__init__")
        mine = floor_of(module)
        for line, target in imports(path):
            theirs = floor_of(target)
            # every floor may import the error tree and the pure core, but the error tree
            # sits below the core: it imports neither the core nor anything else of gpud
            if mine == "top" or theirs == mine or theirs == "errors" or (
                    theirs == "core" and mine != "errors"):
                continue
            if mine == "core" or FLOORS.index(theirs) > FLOORS.index(mine):
                out.append(f"{path.relative_to(root.parent)}:{line}: {mine} imports {target} "
                           f"({theirs}, a floor above)")
    return out


def test_no_floor_imports_one_above_it() -> None:
    assert violations(GPUD) == []


def test_every_floor_says_what_lives_there_and_what_it_may_import() -> None:
    for floor in FLOORS:
        if floor in ("errors", "root", "top"):
            continue
        doc = ast.get_docstring(ast.parse((GPUD / floor / "__init__.py").read_text()))
        assert doc and "import" in doc, f"gpud/{floor}/__init__.py: no docstring naming its imports"


def test_no_module_is_left_beside_the_floors() -> None:
    loose = {p.stem for p in GPUD.glob("*.py")} - ROOT - TOP - {"errors"}
    assert loose == set(), f"modules on no floor: {sorted(loose)}"


@pytest.mark.parametrize("planted, floor", [
    ("from gpud.server.api import GpudApi\n", "host"),
    ("from gpud.life.service import LedgerService\n", "nginx"),
    ("import gpud.host.units\n", "core"),
    ("from gpud.core import answers\n", "errors"),
])
def test_a_planted_import_from_above_is_found(tmp_path: Path, planted: str, floor: str) -> None:
    tree = tmp_path / "gpud"
    (tree / floor).mkdir(parents=True)
    (tree / floor / "planted.py").write_text(planted)
    found = violations(tree)
    assert len(found) == 1 and "a floor above" in found[0], found
