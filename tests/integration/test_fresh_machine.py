"""A fresh Debian 12 machine: the project's virtualenv made from Debian's own python3, and the
package built with it, with nothing cached.

Debian's ``/usr/bin/python3`` makes a venv with the pip 23.0.1 and setuptools 66 its ensurepip
bundles. That pip built sdnotify (published only as an sdist) with ``setup.py bdist_wheel`` and
failed; it passed wherever another pip had already cached a built wheel in ``~/.cache/pip``, so
a machine with a newer ``python3`` first on ``PATH``, or one set up before, never showed it. Here
the venv is made the way scripts/setup makes it (scripts/make-venv) from ``/usr/bin/python3``
with ``PATH`` without ``/usr/local/bin``, an empty pip cache and an empty wheelhouse.

Cost: about 10 s for the venv (pip, setuptools and wheel from the index) and 15 to 40 s for the
package (every dependency wheel from the index); marked ``build`` (``make unit`` leaves it out).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.build

DEBIAN_PYTHON = Path("/usr/bin/python3")
BARE_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


def debian_python_unavailable() -> str | None:
    """Why Debian's own externally managed python3 is not here, or None when it is."""
    if not DEBIAN_PYTHON.exists():
        return f"no {DEBIAN_PYTHON}"
    probe = subprocess.run(
        [str(DEBIAN_PYTHON), "-c",
         "import sys, sysconfig, pathlib, ensurepip, venv; "
         "sys.exit(not (pathlib.Path(sysconfig.get_path('stdlib')) / 'EXTERNALLY-MANAGED').exists()"
         " or sys.version_info < (3, 11))"],
        capture_output=True, timeout=30, check=False,
    )  # fmt: skip
    if probe.returncode != 0:
        return f"{DEBIAN_PYTHON} is not an externally managed python >= 3.11 with venv and ensurepip"
    return None


@pytest.fixture(scope="module")
def fresh_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a fresh machine: no /usr/local on PATH, an empty pip cache."""
    reason = debian_python_unavailable()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI runs on Debian 12: {reason}")
        pytest.skip(reason)
    cache = tmp_path_factory.mktemp("pip-cache")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIRTUAL_ENV")}
    env.update(PATH=BARE_PATH, PIP_CACHE_DIR=str(cache), PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PIP_NO_CACHE_DIR", None)
    return env


@pytest.fixture(scope="module")
def debian_venv(
    repo_root: Path, fresh_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    """A venv made by scripts/make-venv from Debian's python3; yields its interpreter."""
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    result = subprocess.run(
        [str(repo_root / "scripts" / "make-venv"), str(DEBIAN_PYTHON), str(venv)],
        capture_output=True, text=True, timeout=300, check=False, env=fresh_env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    python = venv / "bin" / "python"
    base = subprocess.run([str(python), "-c", "import sys; print(sys.base_prefix)"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    assert base == "/usr", f"the venv is not made from Debian's python3: {base}"
    yield python


def test_venv_pip_builds_an_sdist_without_a_cache(
    debian_venv: Path, fresh_env: dict[str, str], tmp_path: Path
) -> None:
    # sdnotify has no wheel on the index and no pyproject.toml: the case Debian's pip got wrong
    result = subprocess.run(
        [str(debian_venv), "-m", "pip", "wheel", "--no-deps", "--no-binary", "sdnotify",
         "--wheel-dir", str(tmp_path), "sdnotify==0.3.2"],
        capture_output=True, text=True, timeout=300, check=False, env=fresh_env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert [p.name for p in tmp_path.glob("sdnotify-0.3.2-*.whl")], list(tmp_path.iterdir())


def test_build_deb_with_the_debian_venv_and_nothing_cached(
    repo_root: Path, debian_venv: Path, fresh_env: dict[str, str], tmp_path: Path
) -> None:
    out, cache = tmp_path / "out", tmp_path / "cache"
    result = subprocess.run(
        [str(repo_root / "packaging" / "build-deb")],
        capture_output=True, text=True, timeout=600, check=False,
        env={**fresh_env, "PYTHON": str(debian_venv), "OUT_DIR": str(out), "DEB_CACHE_DIR": str(cache)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-6000:]
    deb = Path(result.stdout.strip().splitlines()[-1])
    assert deb.parent == out and deb.is_file()
    listing = subprocess.run(["dpkg-deb", "--contents", str(deb)], capture_output=True, text=True,
                             check=True).stdout  # fmt: skip
    assert "/site-packages/sdnotify/" in listing
    # the sdist was built here, from nothing cached: its wheel is in the fresh wheelhouse
    assert list((cache / "wheelhouse").glob("sdnotify-*.whl"))
