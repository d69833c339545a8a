"""docs/gpuctl.1 is generated from gpuctl's --help texts and must be current."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def test_manpage_is_current() -> None:
    result = subprocess.run([sys.executable, "scripts/manpage.py", "--check"], cwd=REPO,
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    page = (REPO / "docs" / "gpuctl.1").read_text()
    for command in ("status", "ledger", "admit", "release", "plan", "apply", "calibrate"):
        assert f".SS {command}\n" in page
