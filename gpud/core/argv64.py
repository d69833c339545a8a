"""An argv as one base64url JSON word: how gpud hands a command to `python -m gpud.execv`
through a systemd unit that would alter `$` and `;` in it. Standard library only (the shim
imports it at every serve start)."""

from __future__ import annotations

import base64
import json


def encode(argv: list[str]) -> str:
    return base64.urlsafe_b64encode(json.dumps(argv).encode()).decode().rstrip("=")


def decode(text: str) -> list[str]:
    raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    argv = json.loads(raw)
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError("not an argv")
    return argv
