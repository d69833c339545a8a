"""The shipped Grafana dashboard only asks for metrics a running gpud exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.conftest import REPO, start_gpud
from tests.test_metrics import sim_config


def test_dashboard_queries_exported_metrics(tmp_path: Path) -> None:
    dash = json.loads((REPO / "packaging" / "grafana" / "gpud-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"\b(gpud_[a-z_]+)", e)}
    gp = start_gpud(tmp_path, sim_config(tmp_path))
    try:
        assert gp.call("POST", "/v1/serves/fast/admit", {"mib": 1000}).status == 200
        text = gp.call("GET", "/metrics").raw.decode()
    finally:
        gp.stop()
    exported = set(re.findall(r"^(gpud_[a-z_]+)", text, flags=re.M))
    assert used and used <= exported, used - exported
