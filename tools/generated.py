"""Files generated from gpud's own tables (man pages, completion, the dashboard's state panel):
written, or with --check compared, by one function."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path


def write_or_check(outputs: Mapping[Path, str], script: str, argv: list[str] | None = None) -> int:
    """Write each path's text; with --check in `argv`, write nothing and exit 1 naming each
    path whose file differs (the test that keeps them current runs this)."""
    args = sys.argv[1:] if argv is None else argv
    if "--check" in args:
        stale = [p for p, text in outputs.items() if not p.exists() or p.read_text() != text]
        for path in stale:
            print(f"{path} is out of date: run python3 {script}", file=sys.stderr)
        return 1 if stale else 0
    for path, text in outputs.items():
        path.write_text(text)
        print(f"wrote {path}")
    return 0
