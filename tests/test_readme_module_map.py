"""The module map (docs/development.md, "Repository"; it was the README's) names every module of
the pure core (it once listed 14 of 28)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def core_modules_missing(readme: str, core: Path) -> list[str]:
    repository = readme.split("\n## Repository\n", 1)[1].split("\n## ", 1)[0]
    return sorted(p.name for p in core.glob("*.py")
                  if p.name != "__init__.py" and f"`{p.name}`" not in repository)


def test_the_readme_names_every_core_module() -> None:
    missing = core_modules_missing((ROOT / "docs" / "development.md").read_text(),
                                   ROOT / "gpud" / "core")
    assert missing == []


def test_a_module_left_out_is_found(tmp_path: Path) -> None:
    (tmp_path / "ledger.py").write_text("")
    (tmp_path / "newone.py").write_text("")
    (tmp_path / "__init__.py").write_text("")
    readme = "# x\n\n## Repository\n\n- `ledger.py`: the arithmetic\n\n## Next\n\n`newone.py`\n"
    assert core_modules_missing(readme, tmp_path) == ["newone.py"]
