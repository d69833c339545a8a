"""Every serve state and event kind gpud acts on is a member of gpud.core.vocab's enums: no
module spells one as a bare string literal. A literal equal to a ServeState or EventKind value,
used as a value (compared, passed, returned, a dict key, a default, a Literal type), is a
finding; the words inside a message (an f-string's text, a docstring, a longer string) are not.
"""

from __future__ import annotations

import ast
from pathlib import Path

from gpud.core import answers
from gpud.core.vocab import EventKind, ServeState

ROOT = Path(__file__).resolve().parents[1]
VOCAB = "gpud/core/vocab.py"
VALUES = {m.value: f"ServeState.{m.name}" for m in ServeState} | {
    m.value: f"EventKind.{m.name}" for m in EventKind}


# Fields of gpud's answers named like a state or a kind ("running", "external", "restart",
# "denied", "sleep", "wake", "healthy"): a field name used as a key is not the word's value.
FIELDS = frozenset(
    key for obj in vars(answers).values()
    if isinstance(obj, type) and hasattr(obj, "__required_keys__")
    for key in obj.__required_keys__ | obj.__optional_keys__)
# Words that are the same string in another vocabulary, each where it is used so.
ALLOWED: dict[str, tuple[frozenset[str], str]] = {
    "gpud/server/api.py": (frozenset({"start", "stop", "restart", "apply", "reload"}),
                    "routes' actions (POST /v1/serves/NAME/start), the offload's slot names"),
    "gpud/ctl/commands.py": (frozenset({"admit", "release", "start", "sleep", "wake", "stop",
                                        "restart", "apply", "calibrate", "reload", "preempt"}),
                             "gpuctl's commands and the API paths and body fields they call"),
    "gpud/ctl/format.py": (frozenset({"external", "over-committed", "denied", "forbidden"}),
                           "column headings and error codes (gpud.errors)"),
    "gpud/errors.py": (frozenset({"denied", "forbidden"}), "error codes"),
    "gpud/ctl/keys.py": (frozenset({"forbidden"}), "an error code (gpud.errors)"),
    "gpud/ctl/logs.py": (frozenset({"forbidden"}), "an error code (gpud.errors)"),
    "gpud/host/containers.py": (frozenset({"stop", "pull"}), "systemctl's and podman's verbs"),
    "gpud/host/units.py": (frozenset({"stopping"}), "systemd's Manager.SystemState"),
    "gpud/core/unitstate.py": (frozenset({"failed"}), "systemd's ActiveState"),
    "gpud/life/rebalance.py": (frozenset({"apply", "starting"}),
                          "the store's key of an apply under way, a detail naming the serves "
                          "starting"),
    "gpud/host/simulation.py": (frozenset({"external"}), "the simulation file's keys"),
    "gpud/host/observer.py": (frozenset({"healthy"}), "a device's field in the observation answer"),
    "gpud/testing/standin.py": (frozenset({"unhealthy", "sleeping", "stop", "start", "running"}),
                                "vLLM's words, which the stand-in imitates (0.34's CheckpointState)"),
}


def _exempt(tree: ast.AST) -> set[int]:
    """The ids of the string nodes that are not values of the vocabulary: docstrings, the text
    of f-strings, the members of other enums, and answer fields used as keys."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
        if isinstance(node, ast.ClassDef) and any(
                isinstance(b, ast.Name) and b.id.endswith("Enum") for b in node.bases):
            found |= {id(s.value) for s in node.body if isinstance(s, ast.Assign)}
        if isinstance(node, ast.JoinedStr):
            found |= {id(v) for v in node.values}
        keys: list[ast.expr | None] = []
        if isinstance(node, ast.Dict):
            keys = list(node.keys)
        elif isinstance(node, ast.Subscript):
            keys = [node.slice]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("get", "pop", "setdefault") and node.args:
            keys = [node.args[0]]
        found |= {id(k) for k in keys
                  if isinstance(k, ast.Constant) and k.value in FIELDS}
    return found


def literals(path: Path, rel: str) -> list[str]:
    """`rel:line: "value" (Member)` for each bare literal of the vocabulary in the module."""
    tree = ast.parse(path.read_text())
    skip = _exempt(tree)
    allowed = ALLOWED.get(rel, (frozenset(), ""))[0]
    return [f"{rel}:{node.lineno}: {node.value!r} ({VALUES[node.value]})"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and node.value in VALUES and node.value not in allowed and id(node) not in skip]


def findings(root: Path = ROOT) -> list[str]:
    out: list[str] = []
    for path in sorted((root / "gpud").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel != VOCAB:
            out += literals(path, rel)
    return sorted(out, key=lambda f: (f.split(":")[0], int(f.split(":")[1])))


def test_no_state_or_event_kind_literal_outside_the_vocabulary() -> None:
    assert findings() == []


def test_the_check_finds_a_planted_literal(tmp_path: Path) -> None:
    (tmp_path / "gpud" / "core").mkdir(parents=True)
    (tmp_path / "gpud" / "core" / "vocab.py").write_text('RUNNING = "running"\n')
    (tmp_path / "gpud" / "planted.py").write_text(
        '"""running"""\n'
        'def f(state: str = "denied") -> bool:\n'
        '    """sleeping"""\n'
        '    print(f"now running: {state}", "the serve is running")\n'
        '    event("admit", {"crash-loop": 1})\n'
        '    return state == "running"\n'
        'class Verb(StrEnum):\n'
        '    STOP = "stop"\n'
        'def g(doc: dict) -> object:\n'
        '    return doc.get("running"), doc["external"], {"restart": True}, doc.get("x", "failed")\n')
    assert findings(tmp_path) == [
        "gpud/planted.py:2: 'denied' (ServeState.DENIED)",
        "gpud/planted.py:5: 'admit' (EventKind.ADMIT)",
        "gpud/planted.py:5: 'crash-loop' (EventKind.CRASH_LOOP)",
        "gpud/planted.py:6: 'running' (ServeState.RUNNING)",
        "gpud/planted.py:10: 'failed' (ServeState.FAILED)",
    ]
