"""The test folders are the tiers: `pytest -m sandbox` selects tests/integration, all of it, and
the campaigns that drive gpud under the sandbox's systemd, and the real-vLLM tier (tests/vllm) where
it runs real vLLM under it; nothing else needs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def collected(*args: str) -> set[str]:
    """The test files `pytest --collect-only` selects with `args`."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", *args], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode in (0, 5), out.stdout + out.stderr  # 5: nothing collected
    return {line.split("::")[0] for line in out.stdout.splitlines() if "::" in line}


def test_sandbox_selects_the_integration_folder_and_the_sandbox_campaigns() -> None:
    # Every test in tests/integration carries the marker (its conftest gives it)...
    assert collected("-m", "not sandbox", "tests/integration") == set()
    # ... and elsewhere only campaigns and the real-vLLM tier say they need it (collecting the whole tree to show it
    # would cost more than the rest of this file).
    marked = {str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
              if "pytest.mark.sandbox" in p.read_text() and "integration" not in p.parts
              and p != Path(__file__).resolve()}
    assert marked and all(f.startswith(("tests/campaigns/", "tests/vllm/")) for f in marked), sorted(marked)
