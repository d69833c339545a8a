"""gpud.service's sandboxing, as systemd itself scores it: exposure at most 3.0.

(tests/integration/ runs gpud under this very unit in the sandbox: the hardening keeps what
gpud needs.)"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from tests.conftest import REPO

UNIT = REPO / "units" / "gpud.service"
MAX_EXPOSURE = 3.0


def test_exposure_at_most_3() -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.fail("systemd-analyze is missing (package systemd): scripts/setup installs it")
    result = subprocess.run(
        [tool, "security", "--offline=yes", "--no-pager", f"--threshold={int(MAX_EXPOSURE * 10)}",
         str(UNIT)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d)", result.stdout)
    assert found, result.stdout + result.stderr
    assert float(found.group(1)) <= MAX_EXPOSURE, result.stdout
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_remaining_exposure_is_explained() -> None:
    """The unit says why each thing it leaves open stays open."""
    text = UNIT.read_text()
    comments = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    for reason in ("AF_NETLINK", "CAP_CHOWN", "CAP_SYS_ADMIN", "PrivateDevices", "ProtectProc",
                   "ProcSubset", "PrivateUsers", "PrivateNetwork", "IPAddressAllow", "User=",
                   "UMask"):
        assert reason in comments, reason
