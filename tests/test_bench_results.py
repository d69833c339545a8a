"""bench/RESULTS.md is a full run at a commit of this history, and the figures of
docs/development.md are its.

That table is written by bench/run.py from RESULTS.md (between two marker lines); by hand it went
stale (figures of another run than the one RESULTS.md held)."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess

import pytest

from bench.run import FIGURES, FIGURES_DOC, RESULTS, readme_figures
from tests.conftest import REPO


def results() -> str:
    return RESULTS.read_text()


def test_the_readme_figures_are_those_of_results() -> None:
    assert readme_figures(results()) in FIGURES_DOC.read_text()


def test_results_is_a_full_run_of_every_figure() -> None:
    run = re.search(r"^- run: full, figures (.*), \d+ s$", results(), flags=re.M)
    assert run is not None, "RESULTS.md is not from a full run (make bench)"
    assert set(run.group(1).split(", ")) == set(FIGURES)


def test_results_names_a_clean_commit_of_this_history() -> None:
    found = re.search(r"^- commit: (\S+)(.*)$", results(), flags=re.M)
    assert found is not None
    commit, rest = found.groups()
    assert re.fullmatch(r"[0-9a-f]{7,40}", commit) and rest == "", found.group(0)
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=REPO,
                             capture_output=True, text=True, check=False).stdout.strip()
    known = subprocess.run(["git", "merge-base", "--is-ancestor", commit, "HEAD"], cwd=REPO,
                           capture_output=True, check=False)  # fmt: skip
    if known.returncode != 0 and shallow == "true":
        pytest.skip("a shallow clone: the measured commit may lie beyond its history")
    assert known.returncode == 0, f"{commit} is not a commit of this history"


def test_every_module_results_runs_exists() -> None:
    modules = set(re.findall(r"python3? -m ([\w.]+)", results()))
    assert modules, "RESULTS.md names how gpuctl was run"
    assert [m for m in sorted(modules) if importlib.util.find_spec(m) is None] == []
