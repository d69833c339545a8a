"""No class name is defined twice in gpud/ (issue 45): two classes of one name make a reader
ask which one a module means. Read from the syntax trees by tools/shape.py."""

from __future__ import annotations

from pathlib import Path

from tools.shape import classes_defined_twice

ROOT = Path(__file__).resolve().parents[1]

# Left, each with why. The API's answers (gpud/core/answers.py) are the JSON form of the core
# value of the same name, and their class names are the served OpenAPI document's component
# names (gpud.server.openapi): renaming them changes the document clients read. Supervisor: the API's
# protocol of the supervisor, in api.py and ondemand.py, which other branches change now.
KNOWN: dict[str, set[str]] = {
    "Calibration": {"gpud/core/answers.py", "gpud/durable/store.py"},
    "Event": {"gpud/core/answers.py", "gpud/durable/store.py"},
    "Ledger": {"gpud/core/answers.py", "gpud/core/ledger.py"},
    "Observation": {"gpud/core/answers.py", "gpud/core/observation.py"},
    "Reservation": {"gpud/core/answers.py", "gpud/core/ledger.py"},
    "Supervisor": {"gpud/server/api.py", "gpud/life/supervisor/__init__.py"},
}


def test_no_class_name_is_defined_twice() -> None:
    twice = {name: set(paths) for name, paths in classes_defined_twice(ROOT).items()}
    new = {name: paths for name, paths in twice.items() if KNOWN.get(name) != paths}
    assert not new, f"class names defined more than once in gpud/: {new}"
    assert set(KNOWN) <= set(twice), f"no longer twice (drop from KNOWN): {set(KNOWN) - set(twice)}"


def test_a_planted_second_class_is_found(tmp_path: Path) -> None:
    for where in ("gpud/one.py", "gpud/core/two.py"):
        (tmp_path / where).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / where).write_text("class Plan:\n    pass\n\nclass Only:\n    pass\n")
    (tmp_path / "gpud" / "three.py").write_text("def f():\n    class Plan:\n        pass\n")
    assert classes_defined_twice(tmp_path) == {
        "Only": ["gpud/core/two.py", "gpud/one.py"],
        "Plan": ["gpud/core/two.py", "gpud/one.py", "gpud/three.py"]}
