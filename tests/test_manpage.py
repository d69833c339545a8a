"""docs/gpuctl.1 and docs/gpud.8 are generated from the programs' parsers, current, mandoc-clean
and readable on an 80-column terminal."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpud import daemon
from gpud.ctl.commands import COMMANDS
from gpud.ctl.main import build_parser
from tests.conftest import REPO

PAGES = (REPO / "docs" / "gpuctl.1", REPO / "docs" / "gpud.8")


def mandoc() -> str:
    found = shutil.which("mandoc")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("mandoc is missing: scripts/setup-test installs it")
        pytest.skip("mandoc is missing: run scripts/setup-test")
    return found


def test_manpages_are_current() -> None:
    result = subprocess.run([sys.executable, "scripts/manpage.py", "--check"], cwd=REPO,
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_mandoc_lint_clean_and_80_columns(page: Path) -> None:
    tool = mandoc()
    lint = subprocess.run([tool, "-T", "lint", "-W", "style", str(page)], capture_output=True,
                          text=True, check=False)
    assert lint.returncode == 0 and not (lint.stdout + lint.stderr).strip(), lint.stdout + lint.stderr
    shown = subprocess.run([tool, "-T", "ascii", "-O", "width=80", str(page)], capture_output=True,
                           text=True, check=True).stdout
    plain = re.sub(r".\x08", "", shown)  # overstrike (bold, underline) is not a column
    wide = [line for line in plain.splitlines() if len(line) > 80]
    assert not wide, wide
    text = page.read_text()
    assert re.match(r'\.TH \S+ [18] \d{4}-\d{2}-\d{2} ', text), text.splitlines()[0]
    for section in ("NAME", "SYNOPSIS", "DESCRIPTION", "OPTIONS", "EXIT STATUS", "ENVIRONMENT",
                    "FILES", "SEE ALSO"):
        assert f"\n.SH {section}\n" in text, (page.name, section)


def test_gpuctl_page_covers_every_command_and_option() -> None:
    page = PAGES[0].read_text()
    for cmd in COMMANDS:
        assert f".SS {cmd.name}\n" in page
        sub = build_parser(cmd.name)
        for action in sub._actions:
            for option in action.option_strings:
                assert f"\\fB{option.replace('-', chr(92) + '-')}\\fR" in page, option
    # what SEE ALSO names exists
    assert ".BR gpud (8)" in page and PAGES[1].exists()


def test_gpud_page_covers_options_signals_socket_and_config() -> None:
    page = PAGES[1].read_text()
    for action in daemon.build_parser()._actions:
        for option in action.option_strings:
            assert f"\\fB{option.replace('-', chr(92) + '-')}\\fR" in page, option
    for section in ("CONFIGURATION", "SIGNALS", "SOCKET"):
        assert f"\n.SH {section}\n" in page
    for signal_name in ("SIGTERM", "SIGHUP"):
        assert signal_name in page
