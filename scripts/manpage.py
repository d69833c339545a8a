#!/usr/bin/env python3
"""Write docs/gpuctl.1 from gpuctl's own --help texts (so the two cannot drift apart).

    python3 scripts/manpage.py            # rewrite docs/gpuctl.1
    python3 scripts/manpage.py --check    # exit 1 when docs/gpuctl.1 is out of date
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["COLUMNS"] = "80"  # argparse wraps to the terminal: pin it so the page is stable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpud import __version__, gpuctl  # noqa: E402


def roff(text: str) -> str:
    out = []
    for line in text.rstrip().splitlines():
        line = line.replace("\\", "\\e").replace("-", "\\-")
        if line.startswith((".", "'")):
            line = "\\&" + line
        out.append(line)
    return "\n".join(out)


def render() -> str:
    parser = gpuctl.build_parser()
    parts = [
        f'.TH GPUCTL 1 "" "gpud {__version__}" "gpud manual"',
        ".SH NAME",
        "gpuctl \\- the command-line client of gpud, the GPU-memory ledger of this host",
        ".SH SYNOPSIS",
        ".B gpuctl",
        "[\\-\\-socket PATH] [\\-\\-json] [\\-\\-timeout S] COMMAND [ARGS]",
        ".SH DESCRIPTION",
        ".nf",
        roff(gpuctl.DESCRIPTION),
        ".fi",
        ".SH COMMANDS",
    ]
    for cmd in gpuctl.COMMANDS:
        sub = gpuctl.build_parser(cmd.name)
        for action in sub._subparsers._group_actions if sub._subparsers else []:
            choice = getattr(action, "choices", {}).get(cmd.name)
            if choice is not None:
                parts += [f".SS {cmd.name}", ".nf", roff(choice.format_help()), ".fi"]
    parts += [".SH NOTES", ".nf", roff(gpuctl.EPILOG), ".fi",
              ".SH SEE ALSO", "gpud(8), systemctl(1), journalctl(1)"]
    del parser
    return "\n".join(parts) + "\n"


def main() -> int:
    target = REPO / "docs" / "gpuctl.1"
    text = render()
    if "--check" in sys.argv:
        if not target.exists() or target.read_text() != text:
            print(f"{target} is out of date: run python3 scripts/manpage.py", file=sys.stderr)
            return 1
        return 0
    target.write_text(text)
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
