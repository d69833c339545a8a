#!/usr/bin/env python3
"""Mutation testing of gpud's pure core: change one thing at a time, run the unit tests, count
the changes they notice.

    python3 tools/mutate.py                      # every module in MODULES, its tests
    python3 tools/mutate.py gpud/core/ledger.py       # one module
    python3 tools/mutate.py --list gpud/core/plan.py  # the mutants, without running anything
    python3 tools/mutate.py gpud/core/launch.py --function boot_steps --function start_sharing

A mutant is one of: a comparison flipped (< <=, > >=, == !=, in / not in), + and - swapped,
an integer constant moved by one, min and max swapped, and / or swapped, a condition negated,
a statement replaced by `pass`. Each mutant's module is served to a fresh test run (a forked
child, through an import hook: the file on disk is never touched); the mutant is killed when the
tests fail, survives when they pass, and counts as killed when they run past the timeout.

Mutants known to be equivalent (no test can tell them apart from the original) are listed in
tools/mutants-equivalent.txt as `module:line:description  # why`; they are left out of the
score. Exit status 1 when a module scores under --min (default 85%).
"""

from __future__ import annotations

import argparse
import ast
import copy
import importlib.abc
import importlib.util
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import CodeType, ModuleType

REPO = Path(__file__).resolve().parents[1]
# The deciding modules of the pure core. Each is measured by its own unit tests only,
# tests/test_<module>*.py (not by daemon-level tests that happen to pass through it).
MODULES: tuple[str, ...] = (
    "gpud/core/ledger.py", "gpud/core/plan.py", "gpud/core/transition.py", "gpud/core/preempt.py",
    "gpud/core/actions.py", "gpud/core/authority.py", "gpud/core/launch.py", "gpud/core/health.py",
    "gpud/core/unitstate.py", "gpud/core/lifecycle.py", "gpud/core/reconcile.py",
    "gpud/core/serverecord.py", "gpud/core/states.py", "gpud/core/bringup.py",
    "gpud/core/coalesce.py", "gpud/core/traffic.py",
    "gpud/core/queue.py", "gpud/core/demand.py",
    "gpud/core/keys.py", "gpud/core/limits.py", "gpud/core/routerlog.py",
    "gpud/core/nginxblocks.py",
    "gpud/core/quota.py", "gpud/core/peers.py", "gpud/core/router.py", "gpud/core/routerconf.py",
)
# A module whose tests/test_<module>*.py also names tests that are not its unit tests (a real
# nginx, a running daemon) is measured by the files named here instead.
TESTS: dict[str, tuple[str, ...]] = {
    # test_peers_daemon.py and test_peers_poller.py run gpud and peers as real processes
    "gpud/core/peers.py": ("tests/test_peers_core.py",),
    # test_router*.py: the router in a real nginx; its settings' figures are read in the
    # config routerconf renders from them (test_routerconf.py: pure)
    "gpud/core/router.py": ("tests/test_core_router.py", "tests/test_routerconf.py"),
}


def own_tests(module: str) -> tuple[str, ...]:
    """A module's own unit tests: those TESTS names for it, else tests/test_<module>*.py
    (test_plan.py, test_plan_cases.py...)."""
    if module in TESTS:
        return TESTS[module]
    stem = Path(module).stem
    return tuple(sorted(str(p.relative_to(REPO))
                        for p in (REPO / "tests").glob(f"test_{stem}*.py")))


EQUIVALENT = REPO / "tools" / "mutants-equivalent.txt"

SWAP_CMP: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In,
}
SWAP_BIN: dict[type[ast.operator], type[ast.operator]] = {ast.Add: ast.Sub, ast.Sub: ast.Add}


@dataclass(frozen=True)
class Mutant:
    module: str
    line: int
    description: str
    tree: ast.Module

    @property
    def key(self) -> str:
        return f"{self.module}:{self.line}:{self.description}"


def _sites(tree: ast.Module) -> Iterator[tuple[ast.AST, str]]:
    """(node, what is done to it) for every place a mutation applies."""
    docstrings = {id(n.body[0]) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr)
                  and isinstance(n.body[0].value, ast.Constant)}
    in_function = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for stmt in ast.walk(fn):
                in_function.add(id(stmt))
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                if type(op) in SWAP_CMP:
                    yield node, f"cmp{i}"
        elif isinstance(node, ast.BinOp) and type(node.op) in SWAP_BIN:
            yield node, "binop"
        elif isinstance(node, ast.AugAssign) and type(node.op) in SWAP_BIN:
            yield node, "augop"
        elif (isinstance(node, ast.Constant) and type(node.value) is int
              and not isinstance(node.value, bool)):
            yield node, "const+1"
            yield node, "const-1"
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("min", "max")):
            yield node, "minmax"
        elif isinstance(node, ast.BoolOp):
            yield node, "andor"
        elif isinstance(node, (ast.If, ast.While, ast.IfExp)):
            yield node, "negate"
        if (isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.Return,
                              ast.Raise))
                and id(node) in in_function and id(node) not in docstrings):
            yield node, "delete"


def _apply(node: ast.AST, what: str) -> str:
    """Mutate `node` in place; returns the description."""
    if what.startswith("cmp"):
        assert isinstance(node, ast.Compare)
        i = int(what[3:])
        old = type(node.ops[i])
        node.ops[i] = SWAP_CMP[old]()
        return f"{old.__name__} -> {SWAP_CMP[old].__name__}"
    if what in ("binop", "augop"):
        assert isinstance(node, (ast.BinOp, ast.AugAssign))
        old_op = type(node.op)
        node.op = SWAP_BIN[old_op]()
        return f"{old_op.__name__} -> {SWAP_BIN[old_op].__name__}"
    if what in ("const+1", "const-1"):
        assert isinstance(node, ast.Constant) and isinstance(node.value, int)
        before = node.value
        node.value = before + (1 if what == "const+1" else -1)
        return f"{before} -> {node.value}"
    if what == "minmax":
        assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        before_name = node.func.id
        node.func.id = "max" if before_name == "min" else "min"
        return f"{before_name} -> {node.func.id}"
    if what == "andor":
        assert isinstance(node, ast.BoolOp)
        swapped = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        desc = f"{type(node.op).__name__} -> {type(swapped).__name__}"
        node.op = swapped
        return desc
    if what == "negate":
        assert isinstance(node, (ast.If, ast.While, ast.IfExp))
        node.test = ast.UnaryOp(ast.Not(), node.test)
        return "condition negated"
    if what == "delete":
        return f"{type(node).__name__} deleted"
    raise ValueError(what)


def _lines_of(tree: ast.Module, functions: Sequence[str]) -> set[int] | None:
    """The lines of the named functions (methods included, by their own name); None: all."""
    if not functions:
        return None
    lines: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name in functions:
            lines.update(range(fn.lineno, (fn.end_lineno or fn.lineno) + 1))
    missing = set(functions) - {fn.name for fn in ast.walk(tree)
                                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))}
    if missing:
        raise SystemExit(f"no such function: {', '.join(sorted(missing))}")
    return lines


def mutants(module: str, functions: Sequence[str] = ()) -> list[Mutant]:
    source = (REPO / module).read_text()
    original = ast.parse(source)
    within = _lines_of(original, functions)
    found: list[Mutant] = []
    for index, (site, _) in enumerate(list(_sites(original))):
        line = getattr(site, "lineno", 0)
        if within is not None and line not in within:
            continue
        tree = copy.deepcopy(original)
        node, what = list(_sites(tree))[index]
        description = _apply(node, what)
        if what == "delete":
            tree = _DeleteOne(node).visit(tree)
        ast.fix_missing_locations(tree)
        found.append(Mutant(module, line, description, tree))
    return found


def keys(module: str) -> list[str]:
    """The keys of every mutant of MODULE (`mutants`' keys, without making the mutants: what
    checks tools/mutants-equivalent.txt against today's code)."""
    tree = ast.parse((REPO / module).read_text())
    return [f"{module}:{getattr(node, 'lineno', 0)}:{_apply(copy.deepcopy(node), what)}"
            for node, what in _sites(tree)]


class _DeleteOne(ast.NodeTransformer):
    def __init__(self, target: ast.AST) -> None:
        self.target = target

    def generic_visit(self, node: ast.AST) -> ast.AST:
        for _field, value in ast.iter_fields(node):
            if isinstance(value, list) and self.target in value:
                value[value.index(self.target)] = ast.copy_location(ast.Pass(), self.target)
        return super().generic_visit(node)


class _MutantFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, name: str, path: Path, code: CodeType) -> None:
        self.name, self.path, self.code = name, path, code

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        return importlib.util.spec_from_loader(fullname, self, origin=str(self.path))

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        module.__file__ = str(self.path)
        exec(self.code, module.__dict__)  # the mutant under test


def _preload() -> None:
    """Import in the parent what every child needs and no mutant changes, so each fork starts
    warm: pytest, pydantic and gpud's config models (none of them a mutant). Not pytest plugins
    such as hypothesis: imported before pytest starts, they cannot be rewritten, and the
    warning saying so is an error here."""
    import pytest  # noqa: F401

    import gpud.core.config  # noqa: F401

    # gpud.core.config's own imports bring gpud.core.queue (gpud.core.router's Histogram): it is
    # forgotten again, so that the tests' imports find the mutant (the config keeps its names).
    for module in MODULES:
        if module != "gpud/core/config.py":
            sys.modules.pop(module.removesuffix(".py").replace("/", "."), None)
    # A module imported here is never replaced by its mutant (the finder sees only new imports).
    loaded = [m for m in MODULES if m.removesuffix(".py").replace("/", ".") in sys.modules]
    if loaded:
        raise SystemExit(f"preloaded modules that mutants replace: {', '.join(loaded)}")


def _run(mutant: Mutant, tests: Sequence[str], timeout: float) -> str:
    """'killed', 'survived' or 'timeout', from a forked child running the tests."""
    import pytest

    name = mutant.module.removesuffix(".py").replace("/", ".")
    code = compile(mutant.tree, str(REPO / mutant.module), "exec")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            sys.meta_path.insert(0, _MutantFinder(name, REPO / mutant.module, code))
            status = pytest.main(["-x", "-q", "-p", "no:cacheprovider", *tests])
            os._exit(0 if status == 0 else 1)
        except BaseException:
            os._exit(1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return "survived" if os.waitstatus_to_exitcode(status) == 0 else "killed"
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "timeout"


def equivalent() -> set[str]:
    if not EQUIVALENT.exists():
        return set()
    keys = set()
    for line in EQUIVALENT.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            keys.add(line)
    return keys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help=f"module files (default: {', '.join(MODULES)})")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--min", type=float, default=85.0, help="lowest passing score, percent")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per mutant")
    parser.add_argument("--function", action="append", default=[],
                        help="only the mutants inside this function (repeatable)")
    args = parser.parse_args(argv)
    os.chdir(REPO)
    sys.path.insert(0, str(REPO))
    known = equivalent()
    if not args.list:
        _preload()
    failed = False
    for module in args.modules or list(MODULES):
        found = mutants(module, args.function)
        if args.list:
            for m in found:
                print(m.key)
            continue
        if module not in MODULES:
            parser.error(f"{module}: not one of {', '.join(MODULES)}")
        tests = own_tests(module)
        if not tests:
            parser.error(f"{module}: no tests/test_{Path(module).stem}*.py, none in TESTS")
        counted = [m for m in found if m.key not in known]
        unchanged = Mutant(module, 0, "unchanged", ast.parse((REPO / module).read_text()))
        if _run(unchanged, tests, args.timeout) != "survived":
            print(f"{module}: its tests fail on the unchanged module through this runner: "
                  "no score", file=sys.stderr)
            failed = True
            continue
        survivors = []
        started = time.monotonic()
        for m in counted:
            if _run(m, tests, args.timeout) == "survived":
                survivors.append(m)
        killed = len(counted) - len(survivors)
        score = 100.0 * killed / len(counted) if counted else 100.0
        scope = f" in {', '.join(args.function)}" if args.function else ""
        print(f"{module}{scope}: {killed}/{len(counted)} killed, {score:.1f}% "
              f"({len(found) - len(counted)} equivalent left out; "
              f"{time.monotonic() - started:.0f} s)", flush=True)
        for m in survivors:
            print(f"  survived: {m.key}", flush=True)
        failed |= score < args.min
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
