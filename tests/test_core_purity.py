"""The pure core stays pure: no module under gpud/core imports I/O, a clock, concurrency or a
gpud module outside the core (the config models and the error tree aside). Checked on the
source, every import statement, at any depth (an import inside a function counts too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[1] / "gpud" / "core"
FORBIDDEN = {"asyncio", "sqlite3", "aiohttp", "dbus_fast", "pynvml", "socket", "subprocess",
             "threading", "time", "os", "shutil", "pathlib", "tempfile", "signal", "select",
             "multiprocessing", "concurrent", "urllib", "http", "requests"}
GPUD_ALLOWED = ("gpud.core", "gpud.config", "gpud.errors")


def imported(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise AssertionError(f"{path.name}:{node.lineno}: relative import")
            found.append((node.lineno, node.module or ""))
    return found


def problems(path: Path) -> list[str]:
    out = []
    for line, name in imported(path):
        top = name.split(".")[0]
        if top in FORBIDDEN:
            out.append(f"{path.name}:{line}: imports {name}")
        elif top == "gpud" and not any(name == a or name.startswith(a + ".")
                                       for a in GPUD_ALLOWED):
            out.append(f"{path.name}:{line}: imports {name}, outside gpud.core")
    return out


@pytest.mark.parametrize("path", sorted(CORE.glob("*.py")), ids=lambda p: p.name)
def test_core_module_is_pure(path: Path) -> None:
    assert problems(path) == []


def test_the_check_catches_what_it_forbids(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom gpud.store import Store\n\ndef f():\n    import time\n")
    assert problems(bad) == ["bad.py:1: imports os", "bad.py:2: imports gpud.store, outside "
                             "gpud.core", "bad.py:5: imports time"]


def test_the_core_holds_the_modules_it_promises() -> None:
    assert {p.stem for p in CORE.glob("*.py")} >= {
        "ledger", "plan", "launch", "observation", "transition", "authority"}
