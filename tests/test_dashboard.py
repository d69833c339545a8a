"""The shipped Grafana dashboard against a real gpud: its queries ask only for exported metrics,
and a real Prometheus (Debian's, unpacked into .venv/bin by scripts/setup-test) scraping a real gpud
over loopback answers every panel's query with the figures and names the panel is meant to show.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpud.core.routerlog import LOG_FIELDS, USAGE_FIELDS
from gpud.core.vocab import STATES, WARNING_KINDS, WATCHED_KINDS, EventKind
from tests.conftest import REPO, GpudProcess, start_gpud
from tests.test_metrics import free_port, sim_config

DASHBOARD = REPO / "packaging" / "grafana" / "gpud-dashboard.json"


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def panels() -> dict[str, dict[str, Any]]:
    return {p["title"]: p for p in dashboard()["panels"]}


def test_dashboard_is_current() -> None:
    """The serve-state panel is written from gpud's STATES (scripts/dashboard.py)."""
    result = subprocess.run([sys.executable, "scripts/dashboard.py", "--check"], cwd=REPO,
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def routed_config(tmp: Path, port: int | None = None) -> str:
    """sim_config with the router: fast on demand behind it (its queue's series), the
    router's access log in TMP/front/log (gpud.nginx.router.log_path)."""
    text = sim_config(tmp, port).replace("[daemon]\n", f'[daemon]\nfront_dir = "{tmp / "front"}"\n')
    text = text.replace('vram_mib = 14336\ncommand = ["/bin/true"]\n',
                        'vram_mib = 14336\nport = 30001\non_demand = true\nmodels = ["fast"]\n'
                        'command = ["/bin/true", "--uds", "{socket}"]\n')
    return text + f'[router]\nlisten = "127.0.0.1:{free_port()}"\n'


def router_answered(tmp: Path) -> None:
    """What the router's nginx writes to its access log (LOG_FIELDS, USAGE_FIELDS) for two
    requests of key alice to fast and one of bob's for a name it does not route; gpud reads
    the log at each scrape."""
    def line(model: str, status: str, key: str, prompt: str, completion: str) -> str:
        doc = {name: "" for name, _ in (*LOG_FIELDS, *USAGE_FIELDS)}
        doc.update(model=model, serve=model, status=status, request_s="0.012",
                   upstream_s="0.010", key=key, ts=f"{time.time():.3f}",
                   prompt_tokens=prompt, completion_tokens=completion)
        return json.dumps(doc)
    log = tmp / "front" / "log" / "router.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f:
        f.write("\n".join([line("fast", "200", "alice", "12", "5"),
                           line("fast", "200", "alice", "3", "4"),
                           line("nope", "404", "bob", "", "")]) + "\n")


def started(tmp: Path, port: int | None = None) -> GpudProcess:
    gp = start_gpud(tmp, routed_config(tmp, port))
    router_answered(tmp)
    return gp


def test_dashboard_queries_exported_metrics(tmp_path: Path) -> None:
    exprs = [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"\b(gpud_[a-z_]+)", e)}
    gp = started(tmp_path)
    try:
        assert gp.call("POST", "/v1/serves/fast/admit", {"mib": 1000}).status == 200
        text = gp.call("GET", "/metrics").raw.decode()
    finally:
        gp.stop()
    exported = set(re.findall(r"^(gpud_[a-z_]+)", text, flags=re.M))
    assert used and used <= exported, used - exported


def prometheus_binary() -> str:
    found = shutil.which("prometheus", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is missing: scripts/setup-test unpacks it into .venv/bin")
        pytest.skip("prometheus is missing: run scripts/setup-test")
    return found


class Prometheus:
    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.base}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as resp:
            answer = json.loads(resp.read())
        assert answer["status"] == "success", answer
        return answer["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        result: list[dict[str, Any]] = data["result"]
        return result


@pytest.fixture
def scraped(tmp_path: Path) -> Iterator[Prometheus]:
    """A gpud (fast admitted on dark-fast) scraped every second by a real Prometheus."""
    binary = prometheus_binary()
    gpud_port, prom_port = free_port(), free_port()
    gp = started(tmp_path, gpud_port)
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: gpud\n    static_configs: [{{targets: ['127.0.0.1:{gpud_port}']}}]\n"
    )
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
    )
    try:
        assert gp.call("POST", "/v1/serves/fast/admit", {"mib": 14336}).status == 200
        prom = Prometheus(prom_port)
        deadline = time.monotonic() + 60
        while True:
            try:
                # three scrapes: enough samples for the events panel's rate()
                if prom.query('count_over_time(up{job="gpud"}[1m]) >= 3 and up{job="gpud"} == 1'):
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("Prometheus never scraped gpud:\n"
                                     + (tmp_path / "prometheus.log").read_text()[-3000:])
            time.sleep(0.25)
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        gp.stop()


def for_role(expr: str, role: str = ".*") -> str:
    return expr.replace("$role", role)


def value(sample: dict[str, Any]) -> float:
    return float(sample["value"][1])


def test_every_panel_against_a_real_prometheus(scraped: Prometheus) -> None:
    prom = scraped
    # Prometheus stored the metadata of every family, the counter's under its sample name
    meta = prom.api("metadata")
    assert meta["gpud_events_total"][0]["type"] == "counter", meta.get("gpud_events_total")
    assert meta["gpud_device_used_mib"][0]["type"] == "gauge"

    # the $role variable
    var = next(v for v in dashboard()["templating"]["list"] if v["name"] == "role")
    metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", var["definition"]).groups()  # type: ignore[union-attr]
    assert "dark-fast" in prom.api(f"label/{label}/values", **{"match[]": metric})

    # every target of every panel answers, with the $role variable at All and at one role
    by_title = panels()
    for title, panel in by_title.items():
        for target in panel.get("targets", []):
            for role in (".*", "dark-fast"):
                assert prom.query(for_role(target["expr"], role)), (title, target["expr"], role)

    # committed vs used: the device's figures once per GPU, not once per role sharing it
    mem = next(p for t, p in by_title.items() if t.startswith("Committed vs used"))
    used = next(t["expr"] for t in mem["targets"] if "gpud_device_used_mib" in t["expr"])
    rows = prom.query(for_role(used))
    assert [(r["metric"]["gpu"], value(r)) for r in rows] == [("0", 5837.0)]
    committed = next(t["expr"] for t in mem["targets"] if "committed" in t["expr"])
    assert [value(r) for r in prom.query(for_role(committed, "dark-fast"))] == [14336.0]

    # serve states: the value is the state's index, and the panel's mappings name it
    states = by_title["Serve states"]
    rows = prom.query(for_role(states["targets"][0]["expr"]))
    assert {r["metric"]["serve"]: value(r) for r in rows} == {"fast": STATES.index("admitted")}
    names = {k: v["text"] for m in states["fieldConfig"]["defaults"]["mappings"]
             for k, v in m["options"].items()}
    assert names == {str(i): s for i, s in enumerate(STATES)}
    assert names[f"{value(rows[0]):g}"] == "admitted"

    # backends: observation works (simulated), launching does not (no system bus): both named
    backends = by_title["Backends"]
    words = {k: v["text"] for m in backends["fieldConfig"]["defaults"]["mappings"]
             for k, v in m["options"].items()}
    shown = {}
    for target in backends["targets"]:
        for r in prom.query(target["expr"]):
            legend = re.sub(r"\{\{(\w+)\}\}", lambda m: r["metric"][m.group(1)], target["legendFormat"])  # noqa: B023
            shown[legend] = words[f"{value(r):g}"]
    assert shown == {"observation (simulated)": "available", "launching (system bus)": "unavailable"}

    # the router's and usage's panels: by the names the router's log gave (models of its
    # table, "" for a name it does not route: Prometheus stores no empty label), keys and
    # kinds of tokens
    def labels(title: str, *names: str) -> set[tuple[str, ...]]:
        (target, *_) = by_title[title]["targets"]
        return {tuple(r["metric"].get(n, "") for n in names) for r in prom.query(target["expr"])}
    assert labels("Router: requests per second by model and status", "model", "code") >= {
        ("fast", "2xx"), ("", "4xx")}
    assert labels("Usage: tokens per minute by key", "key", "kind") == {
        (k, kind) for k in ("alice", "bob") for kind in ("prompt", "completion")}
    assert labels("Usage: requests per minute by key and status, and those without usage",
                  "key", "code") == {("alice", "2xx"), ("bob", "4xx")}
    assert labels("Queue: requests waiting for a bring-up, by serve", "serve") == {("fast",)}
    # the figures behind them: the tokens of the serve's own usage, nothing dark
    tokens = {(r["metric"]["key"], r["metric"]["kind"]): value(r)
              for r in prom.query("gpud_router_key_tokens_total")}
    assert tokens == {("alice", "prompt"): 15.0, ("alice", "completion"): 9.0,
                      ("bob", "prompt"): 0.0, ("bob", "completion"): 0.0}, tokens
    dark = by_title["Front and router: what is dark (why: gpuctl status)"]
    assert [value(r) for r in prom.query(dark["targets"][0]["expr"])] == [0.0]


def test_the_events_panel_shows_the_watched_kinds_of_the_vocabulary() -> None:
    """Its kinds come from gpud.core.vocab (scripts/dashboard.py); every warning is among them."""
    (target,) = panels()["Events per minute"]["targets"]
    listed = re.search(r'kind=~"([^"]+)"', target["expr"])
    assert listed is not None, target["expr"]
    kinds = listed.group(1).split("|")
    assert kinds == [str(k) for k in WATCHED_KINDS]
    assert set(kinds) <= {str(k) for k in EventKind}
    assert {str(k) for k in WARNING_KINDS} <= set(kinds)
