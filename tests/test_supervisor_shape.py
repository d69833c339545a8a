"""The supervisor's jobs are objects composed in one place (gpud.life.supervisor.Supervisor), each
holding what it asks of the others: no job inherits another's methods (no mixins) and none
declares a method for another module to fill in (no NotImplementedError stubs). Checked on the
syntax trees of gpud/supervisor, with planted sources proving that the checks can fail."""

from __future__ import annotations

import ast
from pathlib import Path

import gpud.life.supervisor

PACKAGE = Path(gpud.life.supervisor.__file__).parent
# What a class here may derive from: a protocol (the narrow dependencies), nothing else.
ALLOWED_BASES = {"Protocol"}


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript):
        return _name(node.value)
    return node.id if isinstance(node, ast.Name) else ast.dump(node)


def problems(source: str, where: str) -> list[str]:
    tree = ast.parse(source)
    protocols = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
                 and any(_name(b) == "Protocol" for b in node.bases)}
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                name = _name(base)
                if name in ALLOWED_BASES or (name in protocols and node.name in protocols):
                    continue
                found.append(f"{where}:{node.lineno}: class {node.name} derives from {name}")
        elif isinstance(node, ast.Raise) and node.exc is not None and \
                _name(node.exc.func if isinstance(node.exc, ast.Call) else node.exc) == \
                "NotImplementedError":
            found.append(f"{where}:{node.lineno}: raise NotImplementedError")
    return found


def sources() -> dict[str, str]:
    return {path.name: path.read_text() for path in sorted(PACKAGE.glob("*.py"))}


def test_no_mixins_and_no_stubs_in_the_supervisor() -> None:
    found = [p for name, text in sources().items() for p in problems(text, name)]
    assert found == []


def test_the_check_finds_a_planted_mixin_and_stub() -> None:
    planted = (
        "class Base:\n"
        "    async def start(self) -> None:\n"
        "        raise NotImplementedError  # done in launch\n"
        "class LaunchJob(Base): ...\n"
        "class Supervisor(LaunchJob, Health): ...\n"
        "class Narrow(Protocol): ...\n"
        "class Wider(Narrow, Protocol): ...\n"
        "class Job(Narrow): ...\n")
    assert sorted(problems(planted, "planted")) == [
        "planted:3: raise NotImplementedError",
        "planted:4: class LaunchJob derives from Base",
        "planted:5: class Supervisor derives from Health",
        "planted:5: class Supervisor derives from LaunchJob",
        "planted:8: class Job derives from Narrow",
    ]


def test_only_the_composition_root_knows_every_job() -> None:
    """A job is handed the others it needs; none reaches the whole supervisor."""
    for name, text in sources().items():
        if name == "__init__.py":
            continue
        names = {n.id for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Name)}
        assert "Supervisor" not in names, name
    root = ast.parse(sources()["__init__.py"])
    made = {_name(n.func) for n in ast.walk(root) if isinstance(n, ast.Call)}
    assert {"Runtime", "MemoryReturn", "StopJob", "HealthJob", "LaunchJob", "UnitWatch",
            "BootJob", "Sleeps", "Reconciler"} <= made
