#!/usr/bin/env python3
"""Write the parts of packaging/grafana/gpud-dashboard.json that follow gpud's vocabulary.

    python3 scripts/dashboard.py            # rewrite them
    python3 scripts/dashboard.py --check    # exit 1 when the dashboard is out of date

The "Serve states" panel turns gpud_serve_state (1 for the current state) into the index of the
state in gpud.life.service.STATES, and its value mappings name each index: both are written from
STATES here, so a new state cannot leave the panel showing a bare number. The "Events per
minute" panel's kinds are gpud.core.vocab.WATCHED_KINDS. The "Router and usage" row and its
panels are written whole from ROUTER_PANELS here, on gpud_router_*, gpud_requests_queued,
gpud_queue_wait_seconds, gpud_evictions_total and gpud_front_degraded (gpud/server/metrics.py).
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


DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
ROUTER_ROW_Y = 34


def _timeseries(panel_id: int, title: str, grid: tuple[int, int, int, int], unit: str,
                targets: list[tuple[str, str]]) -> dict[str, Any]:
    x, y, w, h = grid
    return {"type": "timeseries", "title": title, "gridPos": {"x": x, "y": y, "w": w, "h": h},
            "datasource": DATASOURCE,
            "targets": [{"expr": expr, "legendFormat": legend, "refId": chr(ord("A") + i)}
                        for i, (expr, legend) in enumerate(targets)],
            "id": panel_id, "fieldConfig": {"defaults": {"unit": unit}, "overrides": []}}


def router_panels() -> list[dict[str, Any]]:
    """The router's and usage's panels, below the ledger's (docs/router.md, "Seeing it")."""
    y = ROUTER_ROW_Y
    quantile = "histogram_quantile({q}, sum by ({by}) (rate({m}_bucket[5m])))"
    return [
        {"type": "row", "title": "Router and usage", "gridPos": {"x": 0, "y": y, "w": 24, "h": 1},
         "id": 7, "collapsed": False, "panels": []},
        _timeseries(8, "Router: requests per second by model and status", (0, y + 1, 12, 8),
                    "reqps", [("sum by (model, code) (rate(gpud_router_requests_total[5m]))",
                               "{{model}} {{code}}")]),
        _timeseries(9, "Router: its own latency (p50, p95; the serve's and gpud's ensure left out)",
                    (12, y + 1, 12, 8), "s", [
                        (quantile.format(q=q, by="le", m="gpud_router_overhead_seconds"), name)
                        for q, name in (("0.5", "p50"), ("0.95", "p95"))]),
        _timeseries(10, "Queue: requests waiting for a bring-up, by serve", (0, y + 9, 12, 8),
                    "short", [("sum by (serve) (gpud_requests_queued)", "{{serve}}")]),
        _timeseries(11, "Queue: wait p95 and bring-ups per minute, by serve", (12, y + 9, 12, 8),
                    "s", [
                        (quantile.format(q="0.95", by="serve, le", m="gpud_queue_wait_seconds"),
                         "{{serve}} wait p95"),
                        ("sum by (serve) (rate(gpud_evictions_total[5m])) * 60",
                         "{{serve}} evicted per minute")]),
        _timeseries(12, "Usage: tokens per minute by key", (0, y + 17, 12, 8), "short", [
            ("sum by (key, kind) (rate(gpud_router_key_tokens_total[5m])) * 60",
             "{{key}} {{kind}}")]),
        _timeseries(13, "Usage: requests per minute by key and status, and those without usage",
                    (12, y + 17, 12, 8), "short", [
                        ("sum by (key, code) (rate(gpud_router_key_requests_total[5m])) * 60",
                         "{{key}} {{code}}"),
                        ("sum by (key) (rate(gpud_router_key_unmetered_total[5m])) * 60",
                         "{{key}} unmetered")]),
        {"type": "stat", "title": "Front and router: what is dark (why: gpuctl status)",
         "gridPos": {"x": 0, "y": y + 25, "w": 24, "h": 5}, "datasource": DATASOURCE, "id": 14,
         "targets": [{"expr": "gpud_front_degraded", "legendFormat": "degraded", "refId": "A"}],
         "fieldConfig": {"defaults": {
             "mappings": [{"type": "value", "options": {
                 "0": {"text": "nothing dark", "color": "green", "index": 0}}}],
             "color": {"mode": "thresholds"},
             "thresholds": {"mode": "absolute", "steps": [{"color": "green", "value": None},
                                                            {"color": "red", "value": 1}]}},
             "overrides": []},
         "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                     "colorMode": "background", "textMode": "value_and_name",
                     "graphMode": "none"}},
    ]


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
    ours = router_panels()
    ids = {p["id"] for p in ours}
    dash["panels"] = [p for p in dash["panels"] if p["id"] not in ids] + ours
    return json.dumps(dash, indent=2) + "\n"


def main() -> int:
    return write_or_check({DASHBOARD: render(json.loads(DASHBOARD.read_text()))},
                          "scripts/dashboard.py")


if __name__ == "__main__":
    sys.exit(main())
