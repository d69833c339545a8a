"""Fixtures for tests that need a real systemd: one disposable sandbox for the whole session."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    # `pytest` (unlike `python3 -m pytest`) does not put the repository root on sys.path
    sys.path.insert(0, str(REPO))

from tests.integration.gpudctl import SandboxGpud  # noqa: E402
from tools.sandbox import SYSTEMD, Sandbox  # noqa: E402


def sandbox_unavailable() -> str | None:
    """Why a sandbox cannot boot here, or None when it can."""
    if os.geteuid() != 0:
        return "the systemd sandbox needs root (namespaces, mounts, cgroups)"
    if not Path(SYSTEMD).exists():
        return f"no systemd at {SYSTEMD}"
    for tool in ("unshare", "nsenter", "setpriv", "pivot_root"):
        if shutil.which(tool, path="/usr/sbin:/usr/bin:/sbin:/bin") is None:
            return f"{tool} (util-linux) is missing"
    return None


HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The folder is the tier: every test here needs the sandbox (`pytest -m sandbox`)."""
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.sandbox)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def sandbox() -> Iterator[Sandbox]:
    """A booted sandbox shared by the session; powered off at its end, whatever the tests did.

    Tests leave it as they found it: what they start they stop, what they install they remove.
    """
    yield from booted_sandbox("gpud-test")


def booted_sandbox(name: str) -> Iterator[Sandbox]:
    """Boot a sandbox for a session fixture and always power it off. Where one cannot boot,
    skip, except in CI, which must run these against real systemd: a skip there would count
    as a pass."""
    reason = sandbox_unavailable()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"the systemd sandbox cannot run in CI: {reason}")
        pytest.skip(reason)
    sbx = Sandbox(name=name)
    try:
        sbx.boot()
        yield sbx
    finally:
        sbx.poweroff()


@pytest.fixture
def gpud(sandbox: Sandbox) -> Iterator[SandboxGpud]:
    """A gpud to configure in the session's sandbox; no gpud, serve or state left after."""
    ctl = SandboxGpud(sandbox)
    yield ctl
    ctl.reset()
