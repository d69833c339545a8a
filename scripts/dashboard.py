#!/usr/bin/env python3
"""Write the parts of packaging/grafana/gpud-dashboard.json that follow gpud's vocabulary.

    python3 scripts/dashboard.py            # rewrite them
    python3 scripts/dashboard.py --check    # exit 1 when the dashboard is out of date

The "Serve states" panel turns gpud_serve_state (1 for the current state) into the index of the
state in gpud.life.service.STATES, and its value mappings name each index: both are written from
STATES here, so a new state cannot leave the panel showing a bare number. The "Events per
minute" panel's kinds are gpud.core.vocab.WATCHED_KINDS.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpud.core.vocab import STATES, WATCHED_KINDS  # noqa: E402
from tools.generated import write_or_check  # noqa: E402

DASHBOARD = REPO / "packaging" / "grafana" / "gpud-dashboard.json"
# Grafana's named colours; a state not listed here shows in the text colour
COLOURS = {"declared": "text", "admitted": "blue", "starting": "yellow", "running": "green",
           "stopping": "purple", "denied": "orange", "failed": "red", "external": "light-blue",
           "orphan": "dark-red", "sleeping": "dark-blue"}


def state_query() -> str:
    parts = [f'(gpud_serve_state{{role=~"$role",state="{s}"}} == 1) * {i}' for i, s in enumerate(STATES)]
    return "max by (serve) (" + " or ".join(parts) + ")"


def events_query() -> str:
    kinds = "|".join(str(k) for k in WATCHED_KINDS)
    return f'sum by (kind) (rate(gpud_events_total{{kind=~"{kinds}"}}[5m])) * 60'


def render(dash: dict[str, Any]) -> str:
    panel = next(p for p in dash["panels"] if p["title"] == "Serve states")
    panel["targets"] = [{"expr": state_query(), "legendFormat": "{{serve}}", "refId": "A",
                         "format": "time_series"}]
    panel["fieldConfig"]["defaults"]["mappings"] = [{"type": "value", "options": {
        str(i): {"text": s, "color": COLOURS.get(s, "text"), "index": i} for i, s in enumerate(STATES)}}]
    events = next(p for p in dash["panels"] if p["title"] == "Events per minute")
    events["targets"] = [{"expr": events_query(), "legendFormat": "{{kind}}", "refId": "A"}]
    return json.dumps(dash, indent=2) + "\n"


def main() -> int:
    return write_or_check({DASHBOARD: render(json.loads(DASHBOARD.read_text()))},
                          "scripts/dashboard.py")


if __name__ == "__main__":
    sys.exit(main())
