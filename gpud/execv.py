"""`python -m gpud.execv ARGV64`: exec a serve's command passed as one base64url JSON argument.

systemd 252 writes a transient unit to /run/systemd/transient/ and re-parses it at every
daemon-reload; an ExecStart= argument holding `$` or `;` comes back altered, so the serve would
restart with a different command. gpud passes such a command through this shim instead: the
unit's own argv is then plain base64 that survives the round trip, and the exec keeps the PID,
so systemd's MainPID and the cgroup are the serve's.
"""

from __future__ import annotations

import os
import sys

from gpud.core.argv64 import decode


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python -m gpud.execv ARGV64")
    argv = decode(sys.argv[1])
    os.execv(argv[0], argv)


if __name__ == "__main__":
    main()
