"""`make demo` on a fresh checkout sets up the demo's tier and nothing more, and the demo runs on it.

A newcomer's first command used to build every test tier first, the real-vLLM one included
(torch and vLLM's CPU build, 3.5 GiB, minutes), for a demo whose serves are stand-ins. Here a
copy of the working tree with nothing built (no .venv, no .venv-vllm) runs `make demo` with an
empty pip cache and a bare PATH; its scripts/setup-vllm and scripts/setup-test are replaced by
trip wires that leave a mark and fail. The demo must replay the seed's figures, no mark may
appear, no .venv-vllm be made, and the venv must hold gpud's dependencies without the test tools
(pytest, ruff, mypy) or the test tier's promtool; it does hold nginx and its njs module, which the
demo's router runs on (docs/router.md). Each long step of the set-up says what
it does first.

Cost: the venv and gpud's dependencies from the index (about 30 to 90 s) and one demo (15 to
30 s); marked ``build`` (``make unit`` leaves it out).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_demo import SEED_LINES

pytestmark = pytest.mark.build

REPO = Path(__file__).resolve().parents[2]
BARE_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
TIERS_NOT_FOR_THE_DEMO = ("scripts/setup-vllm", "scripts/setup-test")
# What the demo's tier has no business installing into .venv: the `test` extra and the test
# tier's binaries.
TEST_ONLY = ("pytest", "ruff", "mypy", "hypothesis")
TEST_BINARIES = ("promtool", "prometheus")
# What the demo runs beyond gpud: the front's nginx with the router's njs module.
DEMO_FILES = ("bin/nginx", "lib/nginx/modules/ngx_http_js_module.so")


def fresh_checkout(dest: Path) -> Path:
    """The working tree's files (tracked, and untracked but not ignored) copied to DEST, as a
    fresh clone of them would have them: nothing built, no virtualenv."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        if name.split("/")[0].startswith(".venv"):
            continue  # a worktree's links to another checkout's venvs
        src = REPO / name
        if src.is_file() and not src.is_symlink():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def trip_wire(path: Path) -> Path:
    """Replace the script at PATH with one that leaves PATH.ran and fails."""
    mark = path.with_name(path.name + ".ran")
    path.write_text(f'#!/bin/sh\necho "$0 ran" >"{mark}"\nexit 1\n')
    path.chmod(0o755)
    return mark


def test_make_demo_on_a_fresh_checkout_builds_only_the_demo_tier(tmp_path: Path) -> None:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: the working tree's files cannot be listed")
    checkout, cache = tmp_path / "gpud", tmp_path / "cache"
    try:
        fresh_checkout(checkout)
        marks = [trip_wire(checkout / script) for script in TIERS_NOT_FOR_THE_DEMO]
        env = {
            "PATH": BARE_PATH,
            "HOME": os.environ.get("HOME", "/root"),
            "XDG_CACHE_HOME": str(cache),
            "PIP_CACHE_DIR": str(cache / "pip"),
            # the interpreter this suite runs on (not whichever python3 a bare PATH finds first)
            "PYTHON": os.path.realpath(sys.executable),
        }
        out = subprocess.run(["make", "--no-print-directory", "demo"], cwd=checkout, env=env,
                             capture_output=True, text=True, timeout=900, check=False)
        text = out.stdout + out.stderr
        ran = [m.read_text().strip() for m in marks if m.exists()]
        assert ran == [], f"make demo set up a tier the demo does not use: {ran}\n{text[-3000:]}"
        assert not (checkout / ".venv-vllm").exists(), "make demo made .venv-vllm"
        assert out.returncode == 0, text[-6000:]
        missing = [f"{why}: {line!r}" for line, why in SEED_LINES if line not in text]
        assert not missing, "\n".join(missing) + "\n" + text[-4000:]
        assert "sandbox powered off" in text

        # each long step said what it was doing before doing it
        for step in ("setup: making the virtualenv .venv", "setup: installing gpud and its dependencies"):
            assert step in text, f"no word before the step {step!r}:\n{text[:3000]}"

        python = checkout / ".venv" / "bin" / "python"
        probe = ("import importlib.util, sys; "
                 f"print(' '.join(m for m in {TEST_ONLY!r} if importlib.util.find_spec(m)))")
        present = subprocess.run([str(python), "-c", probe], capture_output=True, text=True,
                                 check=True).stdout.split()
        assert present == [], f"make demo installed test-only tools: {present}"
        binaries = [b for b in TEST_BINARIES if (checkout / ".venv" / "bin" / b).exists()]
        assert binaries == [], f"make demo unpacked the test tier's binaries: {binaries}"
        missing = [f for f in DEMO_FILES if not (checkout / ".venv" / f).exists()]
        assert missing == [], f"make demo did not unpack what its router runs on: {missing}"
        # and what the demo does need is there: gpud with its dependencies, importable
        subprocess.run([str(python), "-c", "import gpud.daemon, gpud.ctl.main"], cwd=checkout,
                       check=True, capture_output=True)
    finally:
        # a venv of its own and a pip cache, 70 MB: not left behind in the temporary directory
        shutil.rmtree(checkout, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
