"""`python -m gpud.execv ARGV64`: exec a serve's command passed as one base64url JSON argument.

systemd 252 writes a transient unit to /run/systemd/transient/ and re-parses it at every
daemon-reload; an ExecStart= argument holding `$` or `;` comes back altered, so the serve would
restart with a different command. gpud passes such a command through this shim instead: the
unit's own argv is then plain base64 that survives the round trip, and the exec keeps the PID,
so systemd's MainPID and the cgroup are the serve's.
"""

from __future__ import annotations

import base64
import json
import os
import sys


def encode(argv: list[str]) -> str:
    return base64.urlsafe_b64encode(json.dumps(argv).encode()).decode().rstrip("=")


def decode(text: str) -> list[str]:
    raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    argv = json.loads(raw)
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError("not an argv")
    return argv


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python -m gpud.execv ARGV64")
    argv = decode(sys.argv[1])
    os.execv(argv[0], argv)


if __name__ == "__main__":
    main()
