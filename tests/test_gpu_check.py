"""scripts/gpu-check: the table on a GPU host, a clean exit that says why everywhere else."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO


def test_gpu_check_says_why_or_prints_its_table() -> None:
    out = subprocess.run([str(REPO / "scripts" / "gpu-check")], capture_output=True, text=True,
                         cwd=REPO, env=dict(os.environ, PYTHON=sys.executable), timeout=900,
                         check=False)
    if out.stdout.startswith("gpu-check: no NVIDIA GPU to measure here: "):
        # no GPU: the reason on one line, nothing else run, exit 0
        assert out.returncode == 0, out.stderr
        assert out.stdout.count("\n") == 1 and out.stdout.rstrip().endswith("nothing was run")
    else:
        assert out.returncode == 0, out.stdout + out.stderr
        assert "NVML total" in out.stdout and "CUDA total" in out.stdout
        assert "NVML per-process" in out.stdout
