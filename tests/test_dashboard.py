"""The shipped Grafana dashboard only asks for metrics gpud exports."""

from __future__ import annotations

import json
import re

from tests.conftest import REPO


def test_dashboard_queries_exported_metrics() -> None:
    dash = json.loads((REPO / "packaging" / "grafana" / "gpud-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"\b(gpud_[a-z_]+)", e)}
    source = (REPO / "gpud" / "metrics.py").read_text()
    exported = set(re.findall(r'"(gpud_[a-z_]+)"', source))
    exported |= {f"{name}_total" for name in exported}  # counters
    assert used and used <= exported, used - exported
