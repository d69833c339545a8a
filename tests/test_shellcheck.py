"""Every shell script of the project passes shellcheck (scripts/setup-test installs it)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.conftest import REPO

SHELLS = {"sh", "bash", "dash"}


def interpreter(first_line: bytes) -> str:
    """The program a #! line runs (through env too), or "" for none."""
    if not first_line.startswith(b"#!"):
        return ""
    words = first_line[2:].decode(errors="replace").split()
    if words and os.path.basename(words[0]) == "env":
        words = words[1:]
    return os.path.basename(words[0]) if words else ""


def shell_scripts() -> list[str]:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
                           ).stdout.decode().split("\0")
    found = []
    for name in filter(None, files):
        path = REPO / name
        if not path.is_file():
            continue
        with path.open("rb") as fh:
            first = fh.readline(200)
        if name.endswith((".sh", ".bash")) or interpreter(first) in SHELLS:
            found.append(name)
    return sorted(found)


def test_shell_scripts_are_found() -> None:
    scripts = shell_scripts()
    for expected in ("scripts/setup", "scripts/setup-test", ".ci/run", "tools/sandbox-boot.sh",
                     "packaging/build-deb", "packaging/debian/postinst",
                     "contrib/completion/gpuctl.bash"):
        assert expected in scripts, scripts


def test_shellcheck_clean() -> None:
    tool = shutil.which("shellcheck")
    if tool is None:
        if os.environ.get("CI"):
            pytest.fail("shellcheck is missing: scripts/setup-test installs it")
        pytest.skip("shellcheck is missing: run scripts/setup-test")
    result = subprocess.run([tool, "--format=gcc", *shell_scripts()], cwd=REPO, capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
