"""The pure core stays pure, all the way down: nothing a module under gpud/core imports, directly
or through any chain of gpud modules, touches I/O, a clock, concurrency or the import machinery.

Checked on the source. From each core module every import statement is followed (at any depth:
an import inside a function, or under TYPE_CHECKING, counts too), through the packages that
importing it runs (gpud/__init__.py, gpud/core/__init__.py). A gpud module may import only
gpud.core.* and gpud.errors, which are followed and held to the same rules; a module of the
standard library that does I/O is refused, and so are calls of the builtins `open` and
`__import__`. Third-party libraries (pydantic, typing_extensions) are not followed."""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "gpud" / "core"
FORBIDDEN = {"asyncio", "sqlite3", "aiohttp", "dbus_fast", "pynvml", "socket", "subprocess",
             "threading", "time", "os", "shutil", "pathlib", "tempfile", "signal", "select",
             "multiprocessing", "concurrent", "urllib", "http", "requests", "io", "importlib",
             "builtins", "ctypes", "fcntl", "mmap", "glob", "sys"}
# The builtins that read files or import modules by a name computed at run time.
FORBIDDEN_CALLS = {"open", "__import__"}
GPUD_ALLOWED = ("gpud.core", "gpud.errors")


def module_file(root: Path, name: str) -> Path | None:
    """The source of module NAME under ROOT (a module file or a package's __init__)."""
    base = root.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def gpud_imports(root: Path, name: str) -> list[tuple[int, str]]:
    """(line, module) of every gpud module importing NAME runs: its packages, then what it
    imports (`from gpud.core import answers` imports gpud.core and gpud.core.answers)."""
    parts = name.split(".")
    found = [(0, ".".join(parts[:i])) for i in range(1, len(parts))]
    path = module_file(root, name)
    assert path is not None, name
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names
                      if module_file(root, f"{node.module}.{alias.name}") is not None]
    return [(line, n) for line, n in found if n.split(".")[0] == "gpud"]


def own_problems(path: Path) -> list[str]:
    """What one module does itself, in line order: forbidden imports and calls, relative
    imports."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                out.append((node.lineno, "relative import"))
            names = [node.module or ""]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in FORBIDDEN_CALLS:
            out.append((node.lineno, f"calls {node.func.id}()"))
        out += [(node.lineno, f"imports {n}") for n in names if n.split(".")[0] in FORBIDDEN]
    return [f"{path.name}:{line}: {what}" for line, what in sorted(out)]


def problems(start: str, root: Path = ROOT) -> list[str]:
    """Every problem of START and of what it imports through gpud, each with the chain of
    imports that reaches it (`gpud.core.plan -> gpud.core.launch: launch.py:3: imports os`)."""
    chains = {start: [start]}
    queue = deque([start])
    out: list[str] = []
    while queue:
        name = queue.popleft()
        chain = " -> ".join(chains[name])
        path = module_file(root, name)
        if path is None:
            continue
        out += [f"{chain}: {p}" for p in own_problems(path)]
        for line, imported in gpud_imports(root, name):
            allowed = imported in ("gpud", "gpud.core") or any(
                imported == a or imported.startswith(a + ".") for a in GPUD_ALLOWED)
            if not allowed:
                out.append(f"{chain}: {path.name}:{line}: imports {imported}, outside the core")
            elif imported not in chains and module_file(root, imported) is not None:
                chains[imported] = [*chains[name], imported]
                queue.append(imported)
    return out


def core_modules() -> list[str]:
    return sorted(f"gpud.core.{p.stem}" for p in CORE.glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("module", core_modules())
def test_core_module_is_pure_all_the_way_down(module: str) -> None:
    assert problems(module) == []


def plant(root: Path, files: dict[str, str]) -> None:
    for rel, text in {"gpud/__init__.py": "", "gpud/core/__init__.py": "", **files}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_check_catches_what_a_module_does_itself(tmp_path: Path) -> None:
    plant(tmp_path, {"gpud/core/bad.py": (
        "import os\nfrom gpud.durable.store import Store\n\ndef f():\n    import time\n"
        "    importlib = __import__('importlib')\n    return open('/etc/passwd').read()\n"
        "from importlib import resources\n")})
    assert problems("gpud.core.bad", tmp_path) == [
        "gpud.core.bad: bad.py:1: imports os",
        "gpud.core.bad: bad.py:5: imports time",
        "gpud.core.bad: bad.py:6: calls __import__()",
        "gpud.core.bad: bad.py:7: calls open()",
        "gpud.core.bad: bad.py:8: imports importlib",
        "gpud.core.bad: bad.py:2: imports gpud.durable.store, outside the core",
    ]


def test_the_check_follows_a_chain_to_a_module_that_does_io(tmp_path: Path) -> None:
    plant(tmp_path, {
        "gpud/core/top.py": "from gpud.core import middle\n",
        "gpud/core/middle.py": "from gpud.errors import Oops\n",
        "gpud/errors.py": "def read(p):\n    with open(p) as f:\n        return f.read()\n",
    })
    assert problems("gpud.core.top", tmp_path) == [
        "gpud.core.top -> gpud.core.middle -> gpud.errors: errors.py:2: calls open()"]


def test_the_check_follows_the_packages_an_import_runs(tmp_path: Path) -> None:
    plant(tmp_path, {"gpud/__init__.py": "import subprocess\n", "gpud/core/leaf.py": ""})
    assert problems("gpud.core.leaf", tmp_path) == [
        "gpud.core.leaf -> gpud: __init__.py:1: imports subprocess"]


def test_the_core_holds_the_modules_it_promises() -> None:
    assert set(core_modules()) >= {f"gpud.core.{m}" for m in (
        "ledger", "plan", "launch", "observation", "transition", "authority", "config")}
