"""No module of gpud outside gpud/testing is over 800 lines: a room that grows past that holds
more than one concern and is split by concern (docs/development.md, "Repository")."""

from __future__ import annotations

from pathlib import Path

GPUD = Path(__file__).resolve().parent.parent / "gpud"
MAX_LINES = 800


def over(root: Path) -> list[str]:
    """The modules under ROOT (but its testing/) over MAX_LINES lines, with their lengths."""
    return [f"{path.relative_to(root.parent)}: {n} lines"
            for path in sorted(root.rglob("*.py"))
            if "testing" not in path.relative_to(root).parts
            and (n := len(path.read_text().splitlines())) > MAX_LINES]


def test_no_module_is_over_800_lines() -> None:
    assert over(GPUD) == []


def test_a_planted_long_module_is_found(tmp_path: Path) -> None:
    root = tmp_path / "gpud"
    (root / "life").mkdir(parents=True)
    (root / "testing").mkdir()
    (root / "life" / "short.py").write_text("x = 1\n" * MAX_LINES)
    (root / "life" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (root / "testing" / "standin.py").write_text("x = 1\n" * (MAX_LINES * 2))
    assert over(root) == ["gpud/life/long.py: 801 lines"]
