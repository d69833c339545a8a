"""No class of gpud's is mostly one-line forwards to its parts: a caller asks the part that does
the work (`sup.launch_job.start`, `sup.sleeps.wake`), and a class keeps what it does itself.
Checked on gpud's syntax trees, with planted sources proving that the check can fail."""

from __future__ import annotations

import ast
from pathlib import Path

GPUD = Path(__file__).resolve().parent.parent / "gpud"
# A class with fewer methods than this is too small to be called mostly forwards.
AT_LEAST = 4


def forwards(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """FN's body (a docstring aside) is one `return self.part.x(...)`, `await self.part.x(...)`,
    `self.part.x(...)` or `return self.part.x`: it hands the work to a part of `self`."""
    body = [s for s in fn.body
            if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Return | ast.Expr):
        return False
    value = body[0].value
    if isinstance(value, ast.Await):
        value = value.value
    if isinstance(value, ast.Call):
        value = value.func
    if not isinstance(value, ast.Attribute):
        return False
    inner, depth = value.value, 0
    while isinstance(inner, ast.Attribute):
        inner, depth = inner.value, depth + 1
    return isinstance(inner, ast.Name) and inner.id == "self" and depth >= 1


def forwarders(source: str, where: str) -> list[str]:
    """The classes of SOURCE (protocols aside) whose methods (dunders aside) are mostly
    forwards."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef) or any(
                isinstance(b, ast.Name) and b.id == "Protocol" for b in node.bases):
            continue
        methods = [f for f in node.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                   and not (f.name.startswith("__") and f.name.endswith("__"))]
        passed = [f.name for f in methods if forwards(f)]
        if len(methods) >= AT_LEAST and 2 * len(passed) > len(methods):
            found.append(f"{where}: {node.name}: {len(passed)} of {len(methods)} methods "
                         f"forward: {', '.join(passed)}")
    return found


def test_no_class_is_mostly_forwards() -> None:
    found = [f for path in sorted(GPUD.rglob("*.py"))
             for f in forwarders(path.read_text(), str(path.relative_to(GPUD.parent)))]
    assert found == []


def test_a_planted_forwarding_class_is_found() -> None:
    planted = (
        "class Facade:\n"
        "    def __init__(self, job):\n"
        "        self.job = job\n"
        "    async def start(self, serve):\n"
        "        return await self.job.start(serve)\n"
        "    async def stop(self, serve):\n"
        "        await self.job.stop(serve)\n"
        "    def life(self, serve):\n"
        "        '''The serve's life.'''\n"
        "        return self.runtime.life(serve)\n"
        "    @property\n"
        "    def booted(self):\n"
        "        return self.boot.booted\n"
        "    def own(self, serve):\n"
        "        return serve.upper()\n"
        "class Narrow(Protocol):\n"
        "    def a(self): return self.x.a()\n"
        "    def b(self): return self.x.b()\n"
        "    def c(self): return self.x.c()\n"
        "    def d(self): return self.x.d()\n")
    assert forwarders(planted, "planted") == [
        "planted: Facade: 4 of 5 methods forward: start, stop, life, booted"]


def test_a_class_that_does_its_own_work_is_let_through() -> None:
    planted = (
        "class Worker:\n"
        "    def a(self, x):\n"
        "        return self.part.a(x)\n"
        "    def b(self, x):\n"
        "        return self.part.b(x)\n"
        "    def c(self, x):\n"
        "        y = x + 1\n"
        "        return self.part.c(y)\n"
        "    def d(self):\n"
        "        return self.count\n")  # its own field, not a part's
    assert forwarders(planted, "planted") == []
