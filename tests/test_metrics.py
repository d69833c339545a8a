"""/metrics parsed by Prometheus' own parser and linted by promtool; its figures equal /v1/ledger's."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpud.config import parse_config
from gpud.core.queue import Histogram
from gpud.core.vocab import EVENT_KINDS, EventKind, StepKind
from gpud.durable.store import Store
from gpud.host.observer import Observer
from gpud.host.simulation import SimulatedBackend, SimulatedDevice
from gpud.life.service import LedgerService
from gpud.nginx.router import RouterLog
from gpud.server.metrics import render
from gpud.server.ondemand import OnDemand
from tests.conftest import GpudProcess, start_gpud


def sim_config(tmp: Path, port: int | None = None) -> str:
    (tmp / "sim.json").write_text(json.dumps(
        {"external": [{"device": "GPU-sim-0", "label": "display", "mib": 5837}]}))
    listen = f'metrics_listen = "127.0.0.1:{port}"\n' if port else ""
    return f"""
[daemon]
observe_interval_s = 0.2
{listen}
[roles.dark-fast]
device = "GPU-sim-0"
capacity_mib = 28511  # the device, less dark-side
reserve_mib = 4608
[roles.dark-side]
device = "0"
capacity_mib = 4096
reserve_mib = 0
[serves.fast]
role = "dark-fast"
vram_mib = 14336
command = ["/bin/true"]
[simulation]
state_file = "{tmp / 'sim.json'}"
[[simulation.devices]]
uuid = "GPU-sim-0"
total_mib = 32607
"""


def text_samples(text: str, prefixes: tuple[str, ...]
                 ) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples of exposition TEXT whose names begin with one of PREFIXES, by name and
    sorted labels."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith(prefixes)}


def samples(gp: GpudProcess) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    reply = gp.call("GET", "/metrics")
    assert reply.status == 200
    out = {}
    for family in text_string_to_metric_families(reply.raw.decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


DEVICE = frozenset({("gpu", "0"), ("UUID", "GPU-sim-0"), ("pci_bus_id", "00000000:01:00.0")})


def test_metrics_parse_and_match_the_ledger(tmp_path: Path) -> None:
    gp = start_gpud(tmp_path, sim_config(tmp_path))
    try:
        assert gp.call("POST", "/v1/serves/fast/admit", {"mib": 14336}).status == 200
        assert gp.call("POST", "/v1/serves/side/admit", {"mib": 1000, "role": "dark-fast"}).status == 200
        assert gp.call("POST", "/v1/serves/big/admit", {"mib": 99999, "role": "dark-fast"}).status == 409
        roles = {r["name"]: r for r in gp.call("GET", "/v1/ledger").body["roles"]}
        role = roles["dark-fast"]
        got = samples(gp)
        labels = frozenset({("role", "dark-fast"), ("gpu", "0"), ("UUID", "GPU-sim-0")})
        for metric, key in (("gpud_role_capacity_mib", "capacity_mib"),
                            ("gpud_role_reserve_mib", "reserve_mib"),
                            ("gpud_role_committed_mib", "committed_mib"),
                            ("gpud_role_ledger_free_mib", "free_mib")):
            assert got[(metric, labels)] == role[key], metric
        obs = role["observed"]
        assert got[("gpud_role_effective_free_mib", labels)] == obs["effective_free_mib"]
        # Device figures: one series per device, with DCGM's labels, although two roles share it
        # (a sum by gpu must not count the device twice).
        for metric, key in (("gpud_device_used_mib", "used_mib"),
                            ("gpud_device_managed_draw_mib", "managed_draw_mib"),
                            ("gpud_device_non_ledger_draw_mib", "non_ledger_draw_mib"),
                            ("gpud_device_physical_free_mib", "physical_free_mib")):
            assert got[(metric, DEVICE)] == obs[key], metric
            assert [k for k in got if k[0] == metric] == [(metric, DEVICE)], metric
        assert got[("gpud_device_total_mib", DEVICE)] == 32607
        assert got[("gpud_device_reserve_excess_mib", DEVICE)] == 1229
        assert got[("gpud_device_info", DEVICE | {("model_name", "Simulated GPU")})] == 1
        assert not any(k[0].startswith("gpud_role_") and k[0].endswith(("used_mib", "non_ledger_draw_mib"))
                       for k in got)
        # serve series carry the device of their role, to join with DCGM's per-GPU series
        fast = frozenset({("serve", "fast"), ("role", "dark-fast"), ("gpu", "0"), ("UUID", "GPU-sim-0")})
        assert got[("gpud_serve_reservation_mib", fast)] == 14336
        assert got[("gpud_serve_state", fast | {("state", "admitted")})] == 1
        assert got[("gpud_serve_state", fast | {("state", "running")})] == 0
        assert got[("gpud_events_total", frozenset({("kind", "admit")}))] == 2
        assert got[("gpud_events_total", frozenset({("kind", "deny")}))] == 1
        assert got[("gpud_invariant_violations_total", frozenset())] == 0
        # every kind of event gpud stores has its series (0 until it happens), and
        # nothing else is counted
        counted = {dict(labels)["kind"] for name, labels in got if name == "gpud_events_total"}
        assert counted == {str(kind) for kind in EVENT_KINDS}, counted ^ {str(k) for k in EVENT_KINDS}
        for kind in ("pull", "container-outside-unit", "device-lost", "calibrate", "apply"):
            assert got[("gpud_events_total", frozenset({("kind", kind)}))] == 0, kind
        assert got[("gpud_observation_available", frozenset({("backend", "simulated")}))] == 1
        # every metric that is a quantity of memory says its unit
        for name, _ in got:
            if name.startswith(("gpud_device_", "gpud_role_")) and name != "gpud_device_info":
                assert name.endswith("_mib"), name
    finally:
        gp.stop()


def promtool() -> str:
    """promtool, from the project's .venv (scripts/setup-test unpacks it from Debian's prometheus)."""
    found = shutil.which("promtool", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing: scripts/setup-test installs it into .venv/bin")
        pytest.skip("promtool is missing: run scripts/setup-test")
    return found


def test_promtool_accepts_live_metrics(tmp_path: Path) -> None:
    tool = promtool()
    gp = start_gpud(tmp_path, sim_config(tmp_path))
    try:
        assert gp.call("POST", "/v1/serves/fast/admit", {"mib": 14336}).status == 200
        assert gp.call("POST", "/v1/serves/big/admit", {"mib": 99999, "role": "dark-fast"}).status == 409
        text = gp.call("GET", "/metrics").raw
    finally:
        gp.stop()
    assert b"# TYPE gpud_events_total counter" in text
    result = subprocess.run([tool, "check", "metrics"], input=text, capture_output=True, timeout=60,
                            check=False)
    assert result.returncode == 0, (result.stdout + result.stderr).decode()
    assert not (result.stdout + result.stderr).strip(), (result.stdout + result.stderr).decode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_tcp_listener_serves_only_metrics(tmp_path: Path) -> None:
    port = free_port()
    gp = start_gpud(tmp_path, sim_config(tmp_path, port))
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            assert b"gpud_role_committed_mib" in resp.read()
            # the exposition format Prometheus negotiates, by its version
            assert resp.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        for method, path in (("GET", "/v1/ledger"), ("POST", "/v1/serves/fast/admit")):
            req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                         data=b'{"mib": 1}' if method == "POST" else None)
            try:
                urllib.request.urlopen(req, timeout=5)
                raise AssertionError(f"{method} {path} answered on TCP")
            except urllib.error.HTTPError as exc:
                assert exc.code == 403
        assert gp.call("GET", "/v1/ledger").body["roles"][0]["committed_mib"] == 0
    finally:
        gp.stop()


# A device total the size of a byte count (80 GiB in bytes, as an exporter of bytes would show),
# and a counter past 10^7: `{:g}` wrote both with six significant digits.
HUGE_TOTAL = 85_899_345_927
BIG_COUNT = 12_345_679


async def test_exact_figures_past_six_digits(tmp_path: Path) -> None:
    (tmp_path / "sim.json").write_text("{}")
    (tmp_path / "sim-procs").mkdir()
    observer = Observer(SimulatedBackend((SimulatedDevice("GPU-sim-0", HUGE_TOTAL),),
                                         tmp_path / "sim.json"))  # fmt: skip
    await observer.sample()
    text = '[roles.big]\ndevice = "GPU-sim-0"\nreserve_mib = 1\n'
    store = Store(tmp_path / "gpud.sqlite3")
    svc = LedgerService(parse_config(text, "test"), store, observer=observer, config_text=text)
    try:
        svc.load()
        svc.counters[str(EventKind.ADMIT)] = BIG_COUNT
        svc.counters["preempt"] = 10**7
        exposed = render(svc, observer)
    finally:
        svc.close()
        store.close()
    got = {(s.name, frozenset(s.labels.items())): s.value
           for f in text_string_to_metric_families(exposed) for s in f.samples}
    role = frozenset({("role", "big"), ("gpu", "0"), ("UUID", "GPU-sim-0")})
    assert got[("gpud_events_total", frozenset({("kind", "admit")}))] == BIG_COUNT
    assert got[("gpud_preemptions_total", frozenset())] == 10**7
    assert got[("gpud_role_capacity_mib", role)] == HUGE_TOTAL
    assert got[("gpud_role_ledger_free_mib", role)] == HUGE_TOTAL - 1
    assert got[("gpud_device_total_mib", DEVICE)] == HUGE_TOTAL
    # as Prometheus' own client writes them: every digit kept
    assert 'gpud_events_total{kind="admit"} 1.2345679e+07\n' in exposed
    assert "gpud_role_capacity_mib{UUID=\"GPU-sim-0\",gpu=\"0\",role=\"big\"} 8.5899345927e+10\n" in exposed
    result = subprocess.run([promtool(), "check", "metrics"], input=exposed.encode(),
                            capture_output=True, timeout=60, check=False)  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr).decode()
    assert not (result.stdout + result.stderr).strip(), (result.stdout + result.stderr).decode()


def test_idle_sleeps_and_stops_are_counted_by_serve(tmp_path: Path) -> None:
    """A series for each on-demand serve with an idle time, at 0 from the first scrape, and the
    counts gpud.server.ondemand keeps; promtool accepts them."""
    serve = ('[serves.{name}]\nrole = "r"\nvram_mib = 100\nport = {port}\non_demand = true\n'
             'front = true\ncommand = ["/bin/true", "--uds", "{{socket}}"]\n')
    text = ('[roles.r]\ndevice = "0"\ncapacity_mib = 1000\nreserve_mib = 0\n'
            + serve.format(name="coder", port=30001) + "sleep_level = 1\nidle_sleep_s = 60\n"
            "idle_stop_s = 600\n"
            + serve.format(name="lazy", port=30002) + "idle_stop_s = 60\n"
            + serve.format(name="always", port=30003))
    store = Store(tmp_path / "gpud.sqlite3")
    svc = LedgerService(parse_config(text, "test"), store, config_text=text)
    try:
        svc.load()
        on_demand = OnDemand(svc, None)  # type: ignore[arg-type]  # the counts only
        first = render(svc, None, on_demand=on_demand)
        on_demand.counts.idle_sleeps["coder"] = 3
        on_demand.counts.idle_stops["lazy"] = 1
        exposed = render(svc, None, on_demand=on_demand)
    finally:
        svc.close()
        store.close()

    def idle(text: str) -> dict[tuple[str, str], float]:
        return {(s.name, s.labels["serve"]): s.value
                for f in text_string_to_metric_families(text) for s in f.samples
                if s.name.startswith("gpud_idle_")}

    assert idle(first) == {("gpud_idle_sleeps_total", "coder"): 0,
                           ("gpud_idle_stops_total", "coder"): 0,
                           ("gpud_idle_stops_total", "lazy"): 0}
    assert idle(exposed) == {("gpud_idle_sleeps_total", "coder"): 3,
                             ("gpud_idle_stops_total", "coder"): 0,
                             ("gpud_idle_stops_total", "lazy"): 1}
    result = subprocess.run([promtool(), "check", "metrics"], input=exposed.encode(),
                            capture_output=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_queue_and_the_bring_ups_are_measured_by_serve(tmp_path: Path) -> None:
    """The router's queue by serve (requests waiting, their waits, evictions) and the bring-ups
    by request (a histogram by serve and kind): series for each on-demand serve from the first
    scrape; promtool accepts them."""
    serve = ('[serves.{name}]\nrole = "r"\nvram_mib = 100\nport = {port}\non_demand = true\n'
             'command = ["/bin/true", "--uds", "{{socket}}"]\n')
    text = ('[roles.r]\ndevice = "0"\ncapacity_mib = 1000\nreserve_mib = 0\n'
            + serve.format(name="a", port=30001) + serve.format(name="b", port=30002))
    store = Store(tmp_path / "gpud.sqlite3")
    svc = LedgerService(parse_config(text, "test"), store, config_text=text)
    try:
        svc.load()
        on_demand = OnDemand(svc, None)  # type: ignore[arg-type]  # the counts only
        first = render(svc, None, on_demand=on_demand)
        on_demand.queued["b"] = [1.0, 2.0, 3.0]
        on_demand.counts.evictions["a"] = 2
        on_demand.counts.queue_waits["b"] = Histogram.empty()
        on_demand.counts.queue_waits["b"].observe(4.0)
        on_demand.counts.bringups[("a", StepKind.START)] = Histogram.empty()
        on_demand.counts.bringups[("a", StepKind.START)].observe(12.0)
        exposed = render(svc, None, on_demand=on_demand)
    finally:
        svc.close()
        store.close()

    def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return text_samples(text, ("gpud_requests_queued", "gpud_evictions", "gpud_queue_wait",
                                   "gpud_bringup"))

    before = samples(first)
    assert before[("gpud_requests_queued", (("serve", "a"),))] == 0
    assert before[("gpud_evictions_total", (("serve", "b"),))] == 0
    assert before[("gpud_queue_wait_seconds_count", (("serve", "a"),))] == 0
    after = samples(exposed)
    assert after[("gpud_requests_queued", (("serve", "b"),))] == 3
    assert after[("gpud_evictions_total", (("serve", "a"),))] == 2
    assert after[("gpud_queue_wait_seconds_bucket", (("le", "2.5"), ("serve", "b")))] == 0
    assert after[("gpud_queue_wait_seconds_bucket", (("le", "5.0"), ("serve", "b")))] == 1
    assert after[("gpud_queue_wait_seconds_sum", (("serve", "b"),))] == 4.0
    assert after[("gpud_bringup_seconds_count", (("kind", "start"), ("serve", "a")))] == 1
    result = subprocess.run([promtool(), "check", "metrics"], input=exposed.encode(),
                            capture_output=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def _line(model: str, status: int, request_s: str = "0.010", upstream_s: str = "0.008",
          ensure_s: str = "", sse: str = "") -> str:
    return json.dumps({"model": model, "serve": "", "status": str(status),
                       "request_s": request_s, "upstream_s": upstream_s, "ensure_s": ensure_s,
                       "sse": sse})


def test_the_router_log_counts_from_when_gpud_began_not_from_its_first_read(
        tmp_path: Path) -> None:
    """Lines the front writes after gpud began and before gpud first reads the log (a cold
    start's stream ends within the first read interval) are counted; what was there before is
    not; a log made after gpud began is counted whole."""
    text = (f'[daemon]\nfront_dir = "{tmp_path}"\n[router]\nlisten = "127.0.0.1:8000"\n'
            '[roles.r]\ndevice = "0"\ncapacity_mib = 1000\nreserve_mib = 0\n'
            '[serves.a]\nrole = "r"\nvram_mib = 100\nport = 30001\n'
            'command = ["/bin/true"]\n')
    cfg = parse_config(text, "test")
    (tmp_path / "log").mkdir()
    log = tmp_path / "log" / "router.log"

    def counted(router_log: RouterLog) -> int:
        router_log.read()
        return sum(router_log.stats.requests.values())

    made_later = RouterLog(lambda: cfg)  # no log yet
    log.write_text(_line("a", 200) + "\n")  # before the other gpud below began
    older = RouterLog(lambda: cfg)
    with log.open("a") as f:
        f.write(_line("a", 200) + "\n" + _line("a", 404) + "\n")
    assert counted(older) == 2
    assert counted(made_later) == 3


def test_the_routers_requests_and_own_latency_are_measured_by_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The router's access log, read by gpud: requests by model, serve and status class, and
    the router's own latency by model (a series for each routed name from the first scrape);
    what was in the log before gpud is not counted; a log past its bound is emptied and read
    on from its start; promtool accepts the text."""
    text = (f'[daemon]\nfront_dir = "{tmp_path}"\n[router]\nlisten = "127.0.0.1:8000"\n'
            '[roles.r]\ndevice = "0"\ncapacity_mib = 1000\nreserve_mib = 0\n'
            '[serves.a]\nrole = "r"\nvram_mib = 100\nport = 30001\nmodels = ["a", "a-fast"]\n'
            'command = ["/bin/true"]\n')
    (tmp_path / "log").mkdir()
    log = tmp_path / "log" / "router.log"
    log.write_text(_line("a", 200) + "\n")  # before gpud: not counted
    store = Store(tmp_path / "gpud.sqlite3")
    svc = LedgerService(parse_config(text, "test"), store, config_text=text)
    try:
        svc.load()
        router_log = RouterLog(lambda: svc.config)
        router_log.read()
        first = render(svc, None, router_log=router_log)
        with log.open("a") as f:
            f.write("\n".join([
                _line("a", 200, "0.012", "0.010"),
                _line("a-fast", 200, "2.013", "0.010", ensure_s="2.001"),  # a bring-up
                _line("a-fast", 503, upstream_s="-"),  # refused: no serve answered
                _line("\u001b[31mnope", 404, upstream_s="-"),  # an unknown name
                _line("a", 200, "9.5", "-", ensure_s="3.0", sse="stream"),
                _line("a", 200, "3.0", "-", ensure_s="3.0", sse="refused"),
                "not json"]) + "\n" + _line("a", 200)[:20])  # the last line not whole yet
        router_log.read()
        exposed = render(svc, None, router_log=router_log)
        # past the bound: emptied once read, then read from the start
        monkeypatch.setattr("gpud.nginx.router.LOG_MAX_BYTES", 1)
        with log.open("a") as f:
            f.write(_line("a", 200)[20:] + "\n")
        router_log.read()
        assert log.stat().st_size == 0
        log.write_text(_line("a", 500) + "\n")
        router_log.read()
        last = render(svc, None, router_log=router_log)
    finally:
        svc.close()
        store.close()

    def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return text_samples(text, ("gpud_router_",))

    def requests(model: str, serve: str, code: str) -> tuple[str, tuple[tuple[str, str], ...]]:
        return ("gpud_router_requests_total", (("code", code), ("model", model),
                                               ("serve", serve)))

    before = samples(first)
    assert before[requests("a", "a", "2xx")] == 0 and before[requests("a-fast", "a", "5xx")] == 0
    assert before[("gpud_router_overhead_seconds_count", (("model", "a-fast"),))] == 0
    after = samples(exposed)
    assert after[requests("a", "a", "2xx")] == 2
    assert after[requests("a", "a", "5xx")] == 1  # refused after the loading feedback began
    assert after[requests("a-fast", "a", "2xx")] == 1
    assert after[requests("a-fast", "a", "5xx")] == 1
    assert after[requests("", "", "4xx")] == 1  # a client's name is never a label
    # the router's own: 2 ms and 2 ms (a bring-up's wait is gpud's, not the router's)
    assert after[("gpud_router_overhead_seconds_count", (("model", "a"),))] == 1
    assert after[("gpud_router_overhead_seconds_bucket", (("le", "0.002"), ("model", "a")))
                 ] == 1
    assert after[("gpud_router_overhead_seconds_bucket", (("le", "0.001"), ("model", "a")))
                 ] == 0
    assert after[("gpud_router_overhead_seconds_bucket", (("le", "0.005"), ("model", "a-fast")))
                 ] == 1
    end = samples(last)
    assert end[requests("a", "a", "2xx")] == 3 and end[requests("a", "a", "5xx")] == 2
    result = subprocess.run([promtool(), "check", "metrics"], input=exposed.encode(),
                            capture_output=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
