"""gpuctl: formatting against the documented answers, argument parsing, exit codes, and the
whole client end to end against a real HTTP server on a Unix socket that returns canned JSON.

The canned answers are gpud's answers: each is held to the OpenAPI document gpud serves (from
gpud.core.answers), as a constant and again whenever the fake server or the in-memory transport
answers with one, so a canned answer cannot lack a field the real one has."""

from __future__ import annotations

import copy
import errno
import http.server
import json
import os
import re
import socket
import socketserver
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpud.ctl import commands
from gpud.ctl import main as ctl_main
from gpud.ctl.arguments import parse_mib, parse_since
from gpud.ctl.client import Client, MemoryTransport, quote_segment
from gpud.ctl.commands import COMMANDS, Ctl
from gpud.ctl.errors import (
    EXIT_BROKEN_PIPE,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    CtlError,
    api_error,
    exit_code_for_status,
    unreachable_error,
)
from gpud.ctl.format import (
    ago,
    format_admit,
    format_error,
    format_event,
    format_events,
    format_ledger,
    format_lifecycle,
    format_release,
    format_serve,
    format_serves,
    format_status,
    local_time,
)
from gpud.ctl.main import main
from gpud.server.openapi import document
from tests.schema import answer_errors, schema_errors

REPO = Path(__file__).resolve().parent.parent
NOT_RUNNING = ("gpuctl: gpud is not running at {}: start it with `systemctl start gpud` or "
               "`gpud --config /etc/gpud/serves.toml`")

# ---- the documented answers (docs/api.md), with the seed's T011 numbers ----------------------

T0 = 1764460800.0


def reservation(serve: str, mib: int, since: float, **kw: Any) -> dict[str, Any]:
    res = {"serve": serve, "role": "dark-fast", "mib": mib, "since": since, "by_uid": 0,
           "state": "running", "resident": True, "external": False}
    res.update(kw)
    return res


LEDGER_T011: dict[str, Any] = {
    "admission": "strict", "simulated": False,
    "roles": [{
        "name": "dark-fast", "device": "GPU-3f6c", "note": "display + voice sidecars",
        "capacity_mib": 32607, "reserve_mib": 4608, "committed_mib": 26112, "free_mib": 1887,
        "missing": False, "over_committed": False,
        "reservations": [reservation("fast", 14336, T0), reservation("embeddings", 3200, T0 + 1),
                         reservation("reranker", 3456, T0 + 2), reservation("ocr", 5120, T0 + 3)],
        "observed": None,
    }],
}

SEED_LEDGER = """\
gpu_role 'dark-fast': capacity 32607 MiB, reserve 4608 MiB, committed 26112 MiB, free 1887 MiB
  fast 14336 MiB (resident, running)
  embeddings 3200 MiB (resident, running)
  reranker 3456 MiB (resident, running)
  ocr 5120 MiB (resident, running)"""

OBSERVED_SIM: dict[str, Any] = {
    "simulated": True, "total_mib": 32607, "used_mib": 30000, "physical_free_mib": 2607,
    "managed_draw_mib": 24163, "non_ledger_draw_mib": 5837, "reserve_mib": 4608,
    "reserve_excess_mib": 1229,
    "pending_mib": 0, "effective_free_mib": 1887, "estimated": False,
}

STATUS: dict[str, Any] = {
    "version": "0.1.0", "host": "node1", "config": "/etc/gpud/serves.toml",
    "admission": "strict", "started_at": T0, "ready": True,
    "launching": {"available": False, "reason": "system bus unreachable: no such file"},
    "observation": {"backend": "simulated", "available": True, "reason": None, "simulated": True},
    "serve_states": {"running": 3, "denied": 1},
    "over_committed": [],
    "config_file": {"differs": False, "reason": None}, "store_transactions": 12,
    "store": {"ok": True, "error": None, "failing_since": None, "failed_commits": 0},
    "summary": "dark-fast 26112/27999 MiB committed (free 1887); 4 serves: 4 running",
}

SERVE_OCR: dict[str, Any] = {
    "name": "ocr", "role": "dark-fast", "configured": True, "external": False,
    "state": "denied", "phase": "idle",
    "reason": "ledger bound: need 5120 MiB, free 351 MiB, short 4769 MiB", "vram_mib": 5120, "reserved_mib": None, "resident": True, "priority": 40, "port": 30007,
    "unit": "gpud-serve-ocr.service", "main_pid": None, "n_restarts": 0,
    "observed_mib": None, "calibration": "uncalibrated", "fingerprint": "9c1e",
    "device_lost": None, "calibrated": None, "sleep_level": 0, "parked_host_mib": None,
    "front": False, "last_activity_s_ago": None, "in_flight": None,
    "wake_s": None, "start_s": None, "queued": 0,
}

SERVE_FAST: dict[str, Any] = dict(
    SERVE_OCR, name="fast", state="running", reason=None, vram_mib=14336, reserved_mib=14336,
    priority=10, port=30001, unit="gpud-serve-fast.service", main_pid=4242,
    observed_mib=13900, fingerprint="de40")

ADMITTED: dict[str, Any] = {
    "serve": "fast", "role": "dark-fast", "mib": 14336, "replaced_mib": 18432, "check": "ledger",
    "note": None,
    "figures": {"capacity_mib": 32607, "reserve_mib": 4608, "committed_mib": 26112,
                "free_mib": 1887},
}

DENIED: dict[str, Any] = {"error": {
    "code": "denied",
    "message": "ocr denied on dark-fast: ledger bound: need 5120 MiB, free 351 MiB, "
               "short 4769 MiB",
    "details": {"serve": "ocr", "role": "dark-fast", "bound": "ledger", "need_mib": 5120,
                "free_mib": 351, "shortfall_mib": 4769}}}

EVENT_DENY: dict[str, Any] = {
    "id": 17, "ts": T0, "kind": "deny", "serve": "ocr", "role": "dark-fast", "mib": 5120,
    "uid": 0, "message": "ocr denied on dark-fast: ledger bound: need 5120 MiB, free 351 MiB",
    "details": {"bound": "ledger"}}

EVENT_RELOAD: dict[str, Any] = {
    "id": 18, "ts": T0 + 60, "kind": "reload", "serve": None, "role": None, "mib": None,
    "uid": 0, "message": "config reloaded from /etc/gpud/serves.toml", "details": {}}


def error_body(code: str, message: str, **details: Any) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "details": details}}


RELOADED: dict[str, Any] = {"reloaded": True, "over_committed": [], "summary": "dark-fast ok"}
RELEASED: dict[str, Any] = {"serve": "ocr", "role": "dark-fast", "released_mib": 5120,
                            "figures": dict(ADMITTED["figures"], free_mib=7007)}

# ---- the canned answers are gpud's answers ----------------------------------------------------

DOC = document()
_TEMPLATES = [(re.compile("^" + re.sub(r"\{[^}]+\}", "[^/?]+", t) + "$"), t) for t in DOC["paths"]]


def answer_problems(method: str, target: str, status: int, doc: Any) -> list[str]:
    """Where a canned answer to ``method target`` differs from what the document declares.
    Bytes are sent as they are, to test answers that are not JSON: not checked."""
    if isinstance(doc, bytes):
        return []
    path = target.split("?", 1)[0]
    template = next((t for rx, t in _TEMPLATES if rx.match(path)), None)
    if template is None:
        return [f"{method} {path}: no such route in gpud's document"]
    return [e for d in (doc if isinstance(doc, list) else [doc])
            for e in answer_errors(DOC, method, template, status, d)]


@pytest.mark.parametrize(("name", "schema", "doc"), [
    ("LEDGER_T011", "Ledger", LEDGER_T011), ("OBSERVED_SIM", "Observed", OBSERVED_SIM),
    ("STATUS", "Status", STATUS), ("SERVE_OCR", "Serve", SERVE_OCR),
    ("SERVE_FAST", "Serve", SERVE_FAST), ("ADMITTED", "Admitted", ADMITTED),
    ("DENIED", "Error", DENIED), ("EVENT_DENY", "Event", EVENT_DENY),
    ("EVENT_RELOAD", "Event", EVENT_RELOAD), ("RELOADED", "Reloaded", RELOADED),
    ("RELEASED", "Released", RELEASED),
])
def test_the_canned_answers_are_what_gpud_answers(name: str, schema: str, doc: Any) -> None:
    assert schema_errors(doc, {"$ref": f"#/components/schemas/{schema}"}, DOC) == [], name


def _fields_read(path: Path) -> set[str]:
    """The keys a module reads from JSON: ``x.get("key")`` and ``x["key"]`` with a literal."""
    import ast

    keys = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get" and node.args
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            keys.add(node.args[0].value)
        elif (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
              and isinstance(node.slice.value, str)):
            keys.add(node.slice.value)
    return keys


def test_every_field_gpuctl_reads_is_one_gpud_answers_with() -> None:
    """A formatter that reads a field no answer has prints '-' forever: caught here."""
    from dataclasses import fields

    from gpud.vllm.vllm_log import VllmMemory

    answered = {k for schema in DOC["components"]["schemas"].values()
                for k in schema.get("properties", {})}
    # free-form objects of the answers: an error's details (a denial's figures, a config's
    # problems) and vLLM's own account of a calibrated serve (gpud.life.calibration.vllm_figures)
    details = {"bound", "need_mib", "free_mib", "shortfall_mib", "problems", "role", "serve"}
    vllm = {f.name for f in fields(VllmMemory)} | {"recommended_kv_cache_mib", "context_mib",
                                                   "budget_mib", "kv_cache_fit_mib",
                                                   "kv_cache_fit", "kv_extended"}
    read = set()
    for module in ("format.py", "commands.py"):
        read |= _fields_read(REPO / "gpud" / "ctl" / module)
    assert read - answered - details - vllm == set()


def test_a_canned_answer_lacking_a_field_is_caught() -> None:
    role = copy.deepcopy(LEDGER_T011)
    del role["roles"][0]["missing"]
    assert answer_problems("GET", "/v1/ledger", 200, role) == [
        "GET /v1/ledger -> 200: /roles/0/missing: required"]
    assert answer_problems("GET", "/v1/nothing", 200, {}) == [
        "GET /v1/nothing: no such route in gpud's document"]


# ---- pure formatting ---------------------------------------------------------------------------


def test_ledger_matches_the_seed_record_exactly() -> None:
    assert format_ledger(LEDGER_T011) == SEED_LEDGER


def test_ledger_observed_lines_say_simulated_and_flag_the_reserve_excess() -> None:
    doc = copy.deepcopy(LEDGER_T011)
    doc["simulated"] = True
    doc["roles"][0]["observed"] = OBSERVED_SIM
    assert format_ledger(doc) == SEED_LEDGER + "\n" + (
        "  observed (simulated): used 30000 MiB, non-ledger draw 5837 MiB (reserve 4608 MiB), "
        "physical free 2607 MiB, effective free 1887 MiB\n"
        "  ledger free is optimistic by 1229 MiB: non-ledger draw exceeds the reserve")


def test_ledger_observed_real_backend_pending_and_no_excess() -> None:
    doc = copy.deepcopy(LEDGER_T011)
    doc["roles"][0]["observed"] = dict(OBSERVED_SIM, simulated=False, reserve_excess_mib=-100,
                                       pending_mib=512)
    lines = format_ledger(doc).splitlines()
    assert lines[-1] == ("  observed: used 30000 MiB, non-ledger draw 5837 MiB (reserve 4608 MiB),"
                         " physical free 2607 MiB, pending 512 MiB, effective free 1887 MiB")
    assert "simulated" not in format_ledger(doc).lower()


def test_ledger_says_when_the_split_is_estimated() -> None:
    doc = copy.deepcopy(LEDGER_T011)
    doc["roles"][0]["observed"] = dict(OBSERVED_SIM, simulated=False, estimated=True)
    assert format_ledger(doc).splitlines()[-2:] == [
        "  the split is estimated: the driver reports no per-process memory (WDDM); running "
        "serves are counted at their reservations",
        "  ledger free is optimistic by 1229 MiB: non-ledger draw exceeds the reserve"]


def test_ledger_says_simulated_even_without_observed_figures() -> None:
    doc = dict(LEDGER_T011, simulated=True)
    assert format_ledger(doc).splitlines()[-1].startswith("observation: SIMULATED")


def test_ledger_flags_an_over_committed_role_and_keeps_its_reservations() -> None:
    doc = copy.deepcopy(LEDGER_T011)
    role = doc["roles"][0]
    role.update(reserve_mib=7168, committed_mib=29568, free_mib=-2129, over_committed=True)
    role["reservations"][0]["mib"] = 17792
    lines = format_ledger(doc).splitlines()
    assert lines[0].endswith("free -2129 MiB")
    assert lines[1].startswith("  !! OVER-COMMITTED by 2129 MiB")
    assert lines[2] == "  fast 17792 MiB (resident, running)"
    assert len(lines) == 6


def test_ledger_flags_a_role_the_config_no_longer_has() -> None:
    """A role kept only because reservations still name it: no device, capacity 0."""
    doc = {"admission": "ledger", "simulated": False, "roles": [{
        "name": "spare", "device": "", "note": None, "missing": True, "capacity_mib": 0,
        "reserve_mib": 0, "committed_mib": 1024, "free_mib": -1024, "over_committed": True,
        "reservations": [reservation("sidecar", 1024, T0, role="spare", state="external",
                                     resident=False, external=True)],
        "observed": None}]}
    assert answer_problems("GET", "/v1/ledger", 200, doc) == []
    assert format_ledger(doc).splitlines() == [
        "gpu_role 'spare': capacity 0 MiB, reserve 0 MiB, committed 1024 MiB, free -1024 MiB",
        "  !! OVER-COMMITTED by 1024 MiB: committed exceeds capacity minus reserve; "
        "reservations are kept, release or shrink a serve",
        "  !! role 'spare' is not in the config: its reservations are kept; release them or "
        "restore the role",
        "  sidecar 1024 MiB (external)"]


def test_reservation_flags_external_and_not_resident() -> None:
    doc = copy.deepcopy(LEDGER_T011)
    doc["roles"][0]["reservations"] = [
        reservation("sidecar", 2048, T0, state="external", resident=False, external=True),
        reservation("scratch", 1024, T0, state="admitted", resident=False)]
    assert format_ledger(doc).splitlines()[1:] == [
        "  sidecar 2048 MiB (external)", "  scratch 1024 MiB (admitted)"]


def test_ledger_several_roles_and_none() -> None:
    other = dict(LEDGER_T011["roles"][0], name="heavy", reservations=[])
    doc = dict(LEDGER_T011, roles=[LEDGER_T011["roles"][0], other])
    blocks = format_ledger(doc).split("\n\n")
    assert blocks[0] == SEED_LEDGER
    assert blocks[1].startswith("gpu_role 'heavy': capacity 32607 MiB")
    assert format_ledger({"admission": "strict", "simulated": False, "roles": []}) == (
        "no roles configured")


def test_status_block() -> None:
    text = format_status(STATUS, UTC)
    assert text == """\
version:        0.1.0
host:           node1
config:         /etc/gpud/serves.toml
started:        2025-11-30T00:00:00+00:00
admission:      strict
launching:      UNAVAILABLE: system bus unreachable: no such file
observation:    simulated (SIMULATED: no real GPU behind these figures)
serves:         3 running, 1 denied
over-committed: none
summary:        dark-fast 26112/27999 MiB committed (free 1887); 4 serves: 4 running"""


def test_status_observation_unavailable_over_committed_not_ready() -> None:
    doc = dict(STATUS, ready=False, over_committed=["dark-fast"],
               observation={"backend": "nvml", "available": False, "simulated": False,
                            "reason": "NVML: driver not loaded"},
               launching={"available": True, "reason": None})
    rows = dict(line.split(":", 1) for line in format_status(doc, UTC).splitlines())
    assert rows["observation"].strip() == ("UNAVAILABLE (nvml): NVML: driver not loaded; "
                                           "strict admission falls back to the ledger bound")
    assert rows["over-committed"].strip() == "!! dark-fast"
    assert rows["launching"].strip() == "available"
    assert rows["started"].strip().endswith("(not ready yet)")


def test_status_says_when_the_file_on_disk_is_not_the_config_in_force() -> None:
    doc = dict(STATUS, config_file={"differs": True, "reason": "refused at start: x"})
    rows = dict(line.split(":", 1) for line in format_status(doc, UTC).splitlines())
    assert rows["config"].strip() == ("/etc/gpud/serves.toml (!! the file on disk is not the "
                                      "config in force: refused at start: x)")
    doc = dict(STATUS, config_file={"differs": False, "reason": None})
    assert format_status(doc, UTC) == format_status(STATUS, UTC)


def test_status_says_where_the_router_listens_and_why_it_is_degraded() -> None:
    up = dict(STATUS, router={"listen": "127.0.0.1:8000", "listening": True, "degraded": []},
              front={"degraded": []})
    rows = dict(line.split(":", 1) for line in format_status(up, UTC).splitlines())
    assert rows["router"].strip() == "listening on 127.0.0.1:8000"
    assert "front" not in rows
    taken = "router.listen: 127.0.0.1:8000 is in use by another process: ..."
    port = "serves.ocr.port: 127.0.0.1:8001 is in use by another process: ..."
    down = dict(STATUS, router={"listen": "127.0.0.1:8000", "listening": False,
                                "degraded": [taken]}, front={"degraded": [taken, port]})
    rows = dict(line.split(":", 1) for line in format_status(down, UTC).splitlines())
    text = format_status(down, UTC)
    assert "router:         !! NOT LISTENING on 127.0.0.1:8000: !! DEGRADED: " + taken in text
    # the router's own degradation is said once, on its line; the front's line keeps the rest
    assert rows["front"].strip() == "!! DEGRADED: " + port
    kept = dict(STATUS, router={"listen": "127.0.0.1:8000", "listening": True,
                                "degraded": ["router.api_keys_file: x (keeping the keys last "
                                             "read)"]})
    rows = dict(line.split(":", 1) for line in format_status(kept, UTC).splitlines())
    assert rows["router"].strip() == ("listening on 127.0.0.1:8000; !! DEGRADED: "
                                      "router.api_keys_file: x (keeping the keys last read)")
    # no [router]: no line
    assert "router" not in format_status(STATUS, UTC)


def test_status_says_why_observation_runs_on_the_last_good_state() -> None:
    reason = ("simulation state file /run/gpud/sim.json is missing: using the last good state")
    doc = dict(STATUS, observation={"backend": "simulated", "available": True,
                                    "simulated": True, "reason": reason})
    rows = dict(line.split(":", 1) for line in format_status(doc, UTC).splitlines())
    assert rows["observation"].strip() == (
        f"simulated; {reason} (SIMULATED: no real GPU behind these figures)")


def test_serves_table_marks_a_lost_device() -> None:
    lost = dict(SERVE_FAST, device_lost="device 'GPU-sim-1' of role 'dark-fast' is lost: x")
    text = format_serves({"serves": [lost]})
    assert " running (DEVICE LOST) " in text.splitlines()[1]
    assert text.splitlines()[-1] == f"fast: {lost['device_lost']}"


def test_serves_table_and_reasons() -> None:
    text = format_serves({"simulated": False, "serves": [SERVE_FAST, SERVE_OCR]})
    assert text == """\
NAME  ROLE       STATE     VRAM  RESERVED  RESIDENT  PRIO   PORT   PID  CALIBRATION
fast  dark-fast  running  14336     14336  yes         10  30001  4242  uncalibrated
ocr   dark-fast  denied    5120         -  yes         40  30007     -  uncalibrated

ocr (denied): ledger bound: need 5120 MiB, free 351 MiB, short 4769 MiB"""
    assert format_serves({"serves": []}) == "no serves"


def test_serves_table_shows_the_last_request_of_fronted_serves() -> None:
    coder = dict(SERVE_FAST, name="coder", front=True, last_activity_s_ago=12.4)
    fresh = dict(SERVE_FAST, name="fresh", front=True, priority=20)  # none since gpud started
    lines = format_serves({"serves": [coder, fresh, SERVE_OCR]}).splitlines()
    assert lines[0].endswith("CALIBRATION   LAST REQUEST")
    assert [line.split("  ")[-1].strip() for line in lines[1:4]] == ["12s ago", "-", "-"]
    assert ago(59.6) == "60s ago" and ago(600) == "10m ago" and ago(7200) == "2h ago"
    block = format_serve(coder).splitlines()
    assert "front:       yes" in block and "activity:    12s ago" in block


def test_serve_block() -> None:
    lines = format_serve(dict(SERVE_OCR, future_field=7)).splitlines()
    assert lines[:4] == ["name:         ocr", "role:         dark-fast", "state:        denied",
                         "reason:       ledger bound: need 5120 MiB, free 351 MiB, short 4769 MiB"]
    assert "vram:         5120 MiB" in lines
    assert "reserved:     -" in lines
    assert "main pid:     -" in lines
    assert lines[-1] == "future_field: 7"


def test_admit_release_lifecycle_lines() -> None:
    assert format_admit(ADMITTED) == (
        "admitted fast: 14336 MiB on dark-fast (was 18432); dark-fast free 1887 MiB")
    fresh = dict(ADMITTED, serve="ocr", mib=5120, replaced_mib=None,
                 note="observation unavailable: strict admission used the ledger bound")
    assert format_admit(fresh) == (
        "admitted ocr: 5120 MiB on dark-fast; dark-fast free 1887 MiB\n"
        "note: observation unavailable: strict admission used the ledger bound")
    released = {"serve": "ocr", "role": "dark-fast", "released_mib": 5120,
                "figures": dict(ADMITTED["figures"], committed_mib=20992, free_mib=7007)}
    assert format_release(released) == (
        "released ocr: 5120 MiB on dark-fast; dark-fast free 7007 MiB")
    assert format_release(released, stopped=True).startswith("stopped and released ocr:")
    assert format_lifecycle(dict(SERVE_FAST, state="starting")) == (
        "fast: starting on dark-fast (reserved 14336 MiB, port 30001, pid 4242, "
        "unit gpud-serve-fast.service)")


def test_events_lines() -> None:
    text = format_events({"events": [EVENT_DENY, EVENT_RELOAD]}, UTC)
    assert text.splitlines() == [
        "2025-11-30T00:00:00+00:00 deny             ocr          dark-fast      5120 MiB  "
        "ocr denied on dark-fast: ledger bound: need 5120 MiB, free 351 MiB",
        "2025-11-30T00:01:00+00:00 reload           -            -                     -  "
        "config reloaded from /etc/gpud/serves.toml",
    ]
    assert format_event(dict(EVENT_DENY, message="two\nlines"), UTC).endswith("two lines")
    east = format_event(EVENT_DENY, timezone(timedelta(hours=2)))
    assert east.startswith("2025-11-30T02:00:00+02:00 deny")


def test_denied_error_has_the_figures_line() -> None:
    err = api_error(409, "Conflict", json.dumps(DENIED).encode())
    assert err.exit_code == EXIT_REFUSED
    assert format_error(err) == (
        "gpuctl: ocr denied on dark-fast: ledger bound: need 5120 MiB, free 351 MiB, "
        "short 4769 MiB\n"
        "gpuctl: need 5120 MiB, free 351 MiB, shortfall 4769 MiB (ledger bound on dark-fast)")


def test_error_that_is_not_the_documented_shape() -> None:
    err = api_error(502, "Bad Gateway", b"<html>proxy</html>")
    assert (err.exit_code, err.code) == (EXIT_REFUSED, "http-502")
    assert err.message == "gpud answered HTTP 502 Bad Gateway: <html>proxy</html>"
    assert api_error(404, "Not Found", b"").exit_code == EXIT_USAGE


@pytest.mark.parametrize(("status", "code"), [
    (200, EXIT_OK), (201, EXIT_OK), (400, EXIT_USAGE), (403, EXIT_REFUSED), (404, EXIT_USAGE),
    (405, EXIT_USAGE), (409, EXIT_REFUSED), (413, EXIT_USAGE), (500, EXIT_REFUSED),
    (503, EXIT_REFUSED),
])
def test_exit_code_for_status(status: int, code: int) -> None:
    assert exit_code_for_status(status) == code


# ---- argument values ---------------------------------------------------------------------------

NOW = 1_800_000_000.0


@pytest.mark.parametrize(("text", "expected"), [
    ("90s", NOW - 90), ("10m", NOW - 600), ("2h", NOW - 7200), ("3d", NOW - 3 * 86400),
    ("1w", NOW - 604800), ("1h30m", NOW - 5400), ("1.5h", NOW - 5400),
    ("1764460800", 1764460800.0), ("1764460800.25", 1764460800.25),
    ("2025-11-30T00:00:00+00:00", T0), ("2025-11-30T00:00:00Z", T0),
    ("2025-11-30T02:00+02:00", T0),
])
def test_parse_since(text: str, expected: float) -> None:
    assert parse_since(text, NOW) == pytest.approx(expected)


@pytest.mark.parametrize("zone", ["UTC", "Europe/Berlin", "America/St_Johns", "Asia/Kolkata",
                                  "Africa/Monrovia"])
@given(st.floats(min_value=-2e9, max_value=4e9))
def test_local_time_is_datetimes_local_iso_8601(zone: str, ts: float) -> None:
    import time as time_module

    before = os.environ.get("TZ")
    os.environ["TZ"] = zone
    time_module.tzset()
    try:
        expected = datetime.fromtimestamp(ts).astimezone().isoformat(timespec="seconds")
        assert local_time(ts) == expected
    finally:
        if before is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = before
        time_module.tzset()


def test_parse_since_naive_is_local_time() -> None:
    assert parse_since("2026-07-13T03:00", NOW) == datetime(2026, 7, 13, 3, 0).timestamp()
    assert parse_since("2026-07-13", NOW) == datetime(2026, 7, 13).timestamp()


@pytest.mark.parametrize("text", ["", "yesterday", "10 minutes", "-5m", "10x", "2026-13-01"])
def test_parse_since_refuses(text: str) -> None:
    with pytest.raises(CtlError) as info:
        parse_since(text, NOW)
    assert info.value.exit_code == EXIT_USAGE
    assert "--since" in info.value.message


@pytest.mark.parametrize("text", ["0", "-1", "1.5", "5g", "5GiB", "", " ", "1e3", "٣", "0x10"])
def test_parse_mib_refuses(text: str) -> None:
    with pytest.raises(CtlError) as info:
        parse_mib(text)
    assert info.value.exit_code == EXIT_USAGE
    assert "positive integer" in info.value.message


def test_parse_mib() -> None:
    assert parse_mib("14336") == 14336


@given(st.text())
def test_quote_segment_is_urllib_quote_safe_nothing(text: str) -> None:
    assert quote_segment(text) == urllib.parse.quote(text, safe="")


def test_quote_segment_passes_undecodable_argv_bytes_through() -> None:
    name = os.fsdecode(b"ocr\xff")
    assert quote_segment(name) == "ocr%FF"


def test_unreachable_error_mapping() -> None:
    path = "/run/gpud/gpud.sock"
    for exc in (FileNotFoundError(errno.ENOENT, "No such file or directory"),
                ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")):
        err = unreachable_error(path, exc)
        assert (err.exit_code, err.code) == (EXIT_UNREACHABLE, "unreachable")
        assert format_error(err) == NOT_RUNNING.format(path)
    denied = unreachable_error(path, PermissionError(errno.EACCES, "Permission denied"))
    assert denied.exit_code == EXIT_UNREACHABLE
    assert denied.message.startswith(f"permission denied on {path}: join group gpud")


def test_socket_resolution() -> None:
    resolve = ctl_main.resolve_socket
    assert resolve("/a.sock", {"GPUD_SOCKET": "/b.sock"}) == "/a.sock"
    assert resolve(None, {"GPUD_SOCKET": "/b.sock"}) == "/b.sock"
    assert resolve(None, {"GPUD_SOCKET": ""}) == "/run/gpud/gpud.sock"
    assert resolve(None, {}) == "/run/gpud/gpud.sock"


# ---- a real HTTP server on a Unix socket ------------------------------------------------------

Reply = tuple[int, Any]  # (status, JSON document, or bytes sent as they are)
Route = Callable[["Handler"], Reply | None]


class Request:
    def __init__(self, method: str, path: str, headers: dict[str, str], body: bytes) -> None:
        self.method = method
        self.path = path
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        return json.loads(self.body)


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeGpud

    def address_string(self) -> str:
        return "unix"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        headers = {k.lower(): v for k, v in self.headers.items()}
        self.server.requests.append(Request(self.command, self.path, headers, body))
        route = self.server.routes.get((self.command, self.path.split("?")[0]))
        reply = route(self) if route else (404, error_body("not-found", "no such route"))
        if reply is None:  # the route answered (or hung up) by itself
            self.close_connection = True
            return
        status, doc = reply
        self.server.problems += answer_problems(self.command, self.path, status, doc)
        data = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = _handle
    do_POST = _handle


class FakeGpud(socketserver.UnixStreamServer):
    """A stand-in gpud: canned answers per (method, path), every request recorded."""

    def __init__(self, path: str) -> None:
        self.requests: list[Request] = []
        self.routes: dict[tuple[str, str], Route] = {}
        self.problems: list[str] = []  # canned answers that are not what gpud answers
        super().__init__(path, Handler)

    def answer(self, method: str, path: str, status: int, doc: Any) -> None:
        self.routes[(method, path)] = lambda h: (status, doc)

    @property
    def last(self) -> Request:
        return self.requests[-1]


@pytest.fixture
def sock_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("s")  # short: AF_UNIX paths are limited to 107 bytes


@pytest.fixture
def gpud(sock_dir: Path) -> Iterator[FakeGpud]:
    server = FakeGpud(str(sock_dir / "gpud.sock"))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02})
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        thread.join()
        server.server_close()
    assert server.problems == []


def ctl(server: FakeGpud, *argv: str) -> int:
    return main(["--socket", server.server_address, *argv])  # type: ignore[list-item]


# ---- the same commands through the in-memory transport: what is asked, what is printed --------


@pytest.fixture
def memory() -> MemoryTransport:
    """An in-memory gpud whose every answer is held to gpud's document."""

    def check(req: Any, status: int, doc: Any) -> None:
        problems = answer_problems(req.method, req.target, status, doc)
        assert problems == [], problems

    return MemoryTransport("/run/gpud/gpud.sock", check=check)


def run(transport: MemoryTransport, *argv: str) -> int:
    return main(list(argv), transport=transport)


def test_status_end_to_end(gpud: FakeGpud, capsys: pytest.CaptureFixture[str]) -> None:
    gpud.answer("GET", "/v1/status", 200, STATUS)
    assert ctl(gpud, "status") == EXIT_OK
    out = capsys.readouterr().out
    assert "SIMULATED" in out
    assert "summary:        dark-fast 26112/27999 MiB committed" in out
    req = gpud.last
    assert (req.method, req.path, req.body) == ("GET", "/v1/status", b"")
    assert req.headers["host"] == "localhost"
    assert req.headers["user-agent"].startswith("gpuctl/")


def test_ledger_end_to_end(memory: MemoryTransport, capsys: pytest.CaptureFixture[str]) -> None:
    memory.answer("GET", "/v1/ledger", 200, LEDGER_T011)
    assert run(memory, "ledger") == EXIT_OK
    assert capsys.readouterr().out == SEED_LEDGER + "\n"


@pytest.mark.parametrize("argv", [["--json", "ledger"], ["ledger", "--json"]])
def test_json_output_in_either_position(memory: MemoryTransport, capsys: pytest.CaptureFixture[str],
                                        argv: list[str]) -> None:
    memory.answer("GET", "/v1/ledger", 200, LEDGER_T011)
    assert run(memory, *argv) == EXIT_OK
    out = capsys.readouterr().out
    assert json.loads(out) == LEDGER_T011
    assert out == json.dumps(LEDGER_T011, indent=2, sort_keys=True) + "\n"


def test_socket_option_after_the_command_and_from_the_environment(
        gpud: FakeGpud, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    gpud.answer("GET", "/v1/ledger", 200, LEDGER_T011)
    path = str(gpud.server_address)
    assert main(["ledger", "--socket", path]) == EXIT_OK
    monkeypatch.setenv("GPUD_SOCKET", path)
    assert main(["ledger"]) == EXIT_OK
    assert len(gpud.requests) == 2


def test_admit_sends_post_with_mib(gpud: FakeGpud, capsys: pytest.CaptureFixture[str]) -> None:
    gpud.answer("POST", "/v1/serves/fast/admit", 200, ADMITTED)
    assert ctl(gpud, "admit", "fast", "14336") == EXIT_OK
    assert capsys.readouterr().out == (
        "admitted fast: 14336 MiB on dark-fast (was 18432); dark-fast free 1887 MiB\n")
    req = gpud.last
    assert (req.method, req.path) == ("POST", "/v1/serves/fast/admit")
    assert req.json() == {"mib": 14336}
    assert req.headers["content-type"] == "application/json"


def test_admit_external_with_role(memory: MemoryTransport) -> None:
    memory.answer("POST", "/v1/serves/sidecar/admit", 200, dict(ADMITTED, serve="sidecar"))
    assert run(memory, "admit", "sidecar", "2048", "--role", "dark-fast") == EXIT_OK
    assert memory.last.json() == {"mib": 2048, "role": "dark-fast"}


def test_admit_denied(memory: MemoryTransport, capsys: pytest.CaptureFixture[str]) -> None:
    memory.answer("POST", "/v1/serves/ocr/admit", 409, DENIED)
    assert run(memory, "admit", "ocr", "5120") == EXIT_REFUSED
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        "gpuctl: ocr denied on dark-fast: ledger bound: need 5120 MiB, free 351 MiB, "
        "short 4769 MiB",
        "gpuctl: need 5120 MiB, free 351 MiB, shortfall 4769 MiB (ledger bound on dark-fast)"]


def test_admit_denied_json(memory: MemoryTransport, capsys: pytest.CaptureFixture[str]) -> None:
    memory.answer("POST", "/v1/serves/ocr/admit", 409, DENIED)
    assert run(memory, "admit", "ocr", "5120", "--json") == EXIT_REFUSED
    captured = capsys.readouterr()
    assert json.loads(captured.out) == DENIED
    assert captured.err == ""


@pytest.mark.parametrize(("name", "quoted"), [
    ("../../etc/passwd", "..%2F..%2Fetc%2Fpasswd"),
    ("ocr bad", "ocr%20bad"),
    ("OCR?x=1#y", "OCR%3Fx%3D1%23y"),
    ("é", "%C3%A9"),
    ("a%2Fb", "a%252Fb"),
])
def test_hostile_names_reach_the_daemon_encoded(gpud: FakeGpud, name: str, quoted: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = f"/v1/serves/{quoted}/admit"
    gpud.answer("POST", path, 400, error_body("bad-request", f"invalid serve name {name!r}"))
    assert ctl(gpud, "admit", name, "5120") == EXIT_USAGE
    assert gpud.last.path == path
    assert capsys.readouterr().err.startswith("gpuctl: invalid serve name")


@pytest.mark.parametrize(("status", "code", "exit_code"), [
    (400, "bad-request", EXIT_USAGE), (400, "config-invalid", EXIT_USAGE),
    (403, "forbidden", EXIT_REFUSED), (404, "not-found", EXIT_USAGE),
    (409, "conflict", EXIT_REFUSED), (413, "payload-too-large", EXIT_USAGE),
    (500, "store-failed", EXIT_REFUSED), (500, "internal", EXIT_REFUSED),
    (503, "unavailable", EXIT_REFUSED),
])
def test_exit_code_per_http_status(memory: MemoryTransport, capsys: pytest.CaptureFixture[str],
                                   status: int, code: str, exit_code: int) -> None:
    memory.answer("POST", "/v1/serves/ocr/start", status, error_body(code, f"{code} happened"))
    assert run(memory, "start", "ocr") == exit_code
    assert capsys.readouterr().err.startswith(f"gpuctl: {code} happened")
    assert run(memory, "--json", "start", "ocr") == exit_code
    assert json.loads(capsys.readouterr().out)["error"]["code"] == code


def test_release(memory: MemoryTransport, capsys: pytest.CaptureFixture[str]) -> None:
    memory.answer("POST", "/v1/serves/ocr/release", 200, RELEASED)
    assert run(memory, "release", "ocr") == EXIT_OK
    assert memory.last.json() == {"stop": False}
    assert run(memory, "release", "ocr", "--stop") == EXIT_OK
    assert memory.last.json() == {"stop": True}
    assert capsys.readouterr().out.splitlines() == [
        "released ocr: 5120 MiB on dark-fast; dark-fast free 7007 MiB",
        "stopped and released ocr: 5120 MiB on dark-fast; dark-fast free 7007 MiB"]


@pytest.mark.parametrize("action", ["start", "stop", "restart"])
def test_lifecycle(memory: MemoryTransport, capsys: pytest.CaptureFixture[str], action: str) -> None:
    memory.answer("POST", f"/v1/serves/fast/{action}", 200, SERVE_FAST)
    assert run(memory, action, "fast") == EXIT_OK
    assert (memory.last.method, memory.last.json()) == ("POST", {})
    assert capsys.readouterr().out.startswith("fast: running on dark-fast (reserved 14336 MiB")


CRASH_LOOP = "crash-loop: 4 restarts in 60 s (limit 3)"


@pytest.mark.parametrize("action", ["start", "restart"])
def test_a_start_waits_for_its_own_launch_not_the_state_from_before_it(
        memory: MemoryTransport, capsys: pytest.CaptureFixture[str], action: str) -> None:
    """A failed serve's start is answered while its launch runs, still `failed` with the old
    reason: gpuctl waits for that launch to end (its `phase`), and says how it ended."""
    before = dict(SERVE_FAST, state="failed", reason=CRASH_LOOP, main_pid=None)
    memory.answer("POST", f"/v1/serves/fast/{action}", 200, dict(before, phase="launching"))
    views = iter([dict(before, phase="launching"), dict(SERVE_FAST, state="starting",
                                                        phase="launching"),
                  dict(SERVE_FAST, phase="idle")])
    memory.routes[("GET", "/v1/serves/fast")] = lambda req: (200, next(views))
    assert run(memory, action, "fast") == EXIT_OK
    assert [r.method for r in memory.requests] == ["POST", "GET", "GET", "GET"]
    out = capsys.readouterr().out
    assert out.startswith("fast: running on dark-fast") and "crash-loop" not in out


def test_a_start_whose_own_launch_fails_says_its_own_reason(
        memory: MemoryTransport, capsys: pytest.CaptureFixture[str]) -> None:
    before = dict(SERVE_FAST, state="failed", reason=CRASH_LOOP, main_pid=None)
    memory.answer("POST", "/v1/serves/fast/start", 200, dict(before, phase="launching"))
    memory.answer("GET", "/v1/serves/fast", 200,
                  dict(before, reason="unhealthy: no 200 from /health within 5 s"))
    assert run(memory, "start", "fast") == EXIT_REFUSED
    assert capsys.readouterr().out.splitlines()[1] == (
        "reason: unhealthy: no 200 from /health within 5 s")


def test_a_start_not_waited_on_says_its_state_is_from_before_it(
        memory: MemoryTransport, capsys: pytest.CaptureFixture[str]) -> None:
    memory.answer("POST", "/v1/serves/fast/start", 200,
                  dict(SERVE_FAST, state="failed", reason=CRASH_LOOP, phase="launching"))
    assert run(memory, "start", "fast", "--no-wait") == EXIT_OK
    assert capsys.readouterr().out.splitlines() == [
        "fast: launching (was failed) on dark-fast (reserved 14336 MiB, port 30001, pid 4242, "
        "unit gpud-serve-fast.service)", f"reason before: {CRASH_LOOP}"]


def test_reload(memory: MemoryTransport, capsys: pytest.CaptureFixture[str]) -> None:
    memory.answer("POST", "/v1/reload", 200, RELOADED)
    assert run(memory, "reload") == EXIT_OK
    assert capsys.readouterr().out == "reloaded: dark-fast ok\n"


def test_serves_list_one_and_names(memory: MemoryTransport, capsys: pytest.CaptureFixture[str]) -> None:
    memory.answer("GET", "/v1/serves", 200, {"simulated": False, "serves": [SERVE_FAST, SERVE_OCR]})
    memory.answer("GET", "/v1/serves/ocr", 200, SERVE_OCR)
    assert run(memory, "serves") == EXIT_OK
    assert capsys.readouterr().out.startswith("NAME  ROLE       STATE")
    assert run(memory, "serves", "ocr") == EXIT_OK
    assert capsys.readouterr().out.startswith("name:        ocr\n")
    assert run(memory, "serves", "--names") == EXIT_OK
    assert capsys.readouterr().out == "fast\nocr\n"
    assert run(memory, "serves", "nope") == EXIT_USAGE  # the fake's 404 not-found


def test_events_query(memory: MemoryTransport, capsys: pytest.CaptureFixture[str]) -> None:
    memory.answer("GET", "/v1/events", 200, {"events": [EVENT_DENY, EVENT_RELOAD]})
    before = time.time()
    assert run(memory, "events", "--serve", "ocr", "--role", "dark-fast", "--kind", "deny,admit",
               "--kind", "stop", "--since", "10m", "--limit", "5") == EXIT_OK
    after = time.time()
    assert memory.last.path == "/v1/events"
    params = urllib.parse.parse_qsl(memory.last.query)
    since = float(dict(params)["since"])
    assert before - 600 - 0.01 <= since <= after - 600 + 0.01
    assert [p for p in params if p[0] != "since"] == [
        ("serve", "ocr"), ("role", "dark-fast"), ("kind", "deny"), ("kind", "admit"),
        ("kind", "stop"), ("limit", "5")]
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert " deny             ocr " in lines[0]
    assert run(memory, "events") == EXIT_OK
    assert memory.last.target == "/v1/events"


@pytest.mark.parametrize("argv", [
    ["admit", "ocr", "0"], ["admit", "ocr", "-5"], ["admit", "ocr", "5.5"], ["admit", "", "5"],
    ["admit", "ocr"], ["events", "--since", "soon"], ["events", "--limit", "0"],
    ["ledger", "--interval", "0"], ["frobnicate"], [], ["release"],
])
def test_usage_errors_send_nothing(memory: MemoryTransport, capsys: pytest.CaptureFixture[str],
                                   argv: list[str]) -> None:
    assert run(memory, *argv) == EXIT_USAGE
    assert memory.requests == []
    assert capsys.readouterr().err


def test_usage_error_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--json", "admit", "ocr", "many"]) == EXIT_USAGE
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "usage"
    assert main(["--json", "admit"]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert json.loads(captured.out)["error"]["code"] == "usage"
    assert "required" in captured.err


def test_answers_that_are_not_json(gpud: FakeGpud, capsys: pytest.CaptureFixture[str]) -> None:
    gpud.answer("GET", "/v1/status", 200, b"<html>")
    assert ctl(gpud, "status") == EXIT_REFUSED
    assert "not JSON" in capsys.readouterr().err
    gpud.answer("GET", "/v1/ledger", 404, b"404: Not Found")
    assert ctl(gpud, "ledger") == EXIT_USAGE
    assert capsys.readouterr().err == "gpuctl: gpud answered HTTP 404 Not Found: 404: Not Found\n"


def _send_chunked(handler: Handler, status: int, pieces: list[bytes], finish: bool) -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", "application/x-ndjson")
    handler.send_header("Transfer-Encoding", "chunked")
    handler.end_headers()
    for piece in pieces:
        handler.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        handler.wfile.flush()
    if finish:
        handler.wfile.write(b"0\r\n\r\n")


def test_chunked_answer(gpud: FakeGpud, capsys: pytest.CaptureFixture[str]) -> None:
    data = json.dumps(LEDGER_T011).encode()
    gpud.routes[("GET", "/v1/ledger")] = lambda h: _send_chunked(
        h, 200, [data[:10], data[10:77], data[77:]], finish=True)
    assert ctl(gpud, "ledger") == EXIT_OK
    assert capsys.readouterr().out == SEED_LEDGER + "\n"


def test_events_follow_ends_with_exit_3_when_the_stream_ends(
        gpud: FakeGpud, capsys: pytest.CaptureFixture[str]) -> None:
    one, two = (json.dumps(e).encode() for e in (EVENT_DENY, EVENT_RELOAD))
    # a line split across chunks, a keepalive blank line, two events in one chunk
    gpud.routes[("GET", "/v1/events")] = lambda h: _send_chunked(
        h, 200, [one[:20], one[20:] + b"\n", b"\n", one + b"\n" + two + b"\n"], finish=True)
    assert ctl(gpud, "events", "--follow", "--kind", "deny") == EXIT_UNREACHABLE
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 3
    assert "ended the event stream" in captured.err
    assert urllib.parse.parse_qsl(gpud.last.path.partition("?")[2]) == [
        ("kind", "deny"), ("follow", "1")]


def test_events_follow_json_is_ndjson(gpud: FakeGpud, capsys: pytest.CaptureFixture[str]) -> None:
    line = json.dumps(EVENT_DENY).encode() + b"\n"
    gpud.routes[("GET", "/v1/events")] = lambda h: _send_chunked(h, 200, [line], finish=False)
    assert ctl(gpud, "events", "-f", "--json") == EXIT_UNREACHABLE
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(x) for x in lines[:1]] == [EVENT_DENY]
    assert json.loads(lines[1])["error"]["code"] == "unreachable"


def test_events_follow_error_status(gpud: FakeGpud, capsys: pytest.CaptureFixture[str]) -> None:
    gpud.answer("GET", "/v1/events", 400, error_body("bad-request", "unknown kind 'x'"))
    assert ctl(gpud, "events", "--follow", "--kind", "x") == EXIT_USAGE
    assert capsys.readouterr().err == "gpuctl: unknown kind 'x'\n"


class _InterruptedClient(Client):
    def stream(self, target: str) -> Iterator[dict[str, Any]]:
        yield EVENT_DENY
        raise KeyboardInterrupt


def test_events_follow_ctrl_c_is_a_clean_end(capsys: pytest.CaptureFixture[str]) -> None:
    c = Ctl(_InterruptedClient(MemoryTransport()), False, sys.stdout, sys.stderr)
    assert commands.follow_events(c, []) == EXIT_OK
    assert capsys.readouterr().out.count("\n") == 1


def test_ledger_watch_prints_changes_and_exits_3_when_gpud_goes(
        gpud: FakeGpud, capsys: pytest.CaptureFixture[str]) -> None:
    changed = copy.deepcopy(LEDGER_T011)
    changed["roles"][0]["reservations"].pop()
    answers = [LEDGER_T011, LEDGER_T011, changed]

    def route(h: Handler) -> Reply | None:
        return (200, answers.pop(0)) if answers else None  # then hang up unanswered

    gpud.routes[("GET", "/v1/ledger")] = route
    assert ctl(gpud, "ledger", "--watch", "--interval", "0.01") == EXIT_UNREACHABLE
    captured = capsys.readouterr()
    blocks = captured.out.split("\n-- ")
    assert len(blocks) == 2  # the unchanged second answer is not printed again
    assert blocks[0] == SEED_LEDGER + "\n"
    assert "ocr 5120" not in blocks[1]
    assert "closed the connection without answering" in captured.err
    assert len(gpud.requests) == 4


def test_timeout(gpud: FakeGpud, capsys: pytest.CaptureFixture[str]) -> None:
    given_up = threading.Event()

    def slow(h: Handler) -> Reply:
        given_up.wait(10)  # answers only once gpuctl has given up on it
        return 200, STATUS

    gpud.routes[("GET", "/v1/status")] = slow
    try:
        assert ctl(gpud, "--timeout", "0.1", "status") == EXIT_REFUSED
    finally:
        given_up.set()
    assert "did not answer within 0.1 s" in capsys.readouterr().err


def test_reader_that_goes_away(gpud: FakeGpud, monkeypatch: pytest.MonkeyPatch) -> None:
    """`gpuctl events | head -1`: no traceback, the shell's status for SIGPIPE."""
    gpud.answer("GET", "/v1/events", 200, {"events": [EVENT_DENY] * 2000})
    read_end, write_end = os.pipe()
    os.close(read_end)
    with os.fdopen(write_end, "w") as pipe:
        monkeypatch.setattr(sys, "stdout", pipe)
        assert ctl(gpud, "events") == EXIT_BROKEN_PIPE


# ---- a daemon that cannot be reached -----------------------------------------------------------


def test_no_socket_file(sock_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(sock_dir / "absent.sock")
    assert main(["--socket", path, "status"]) == EXIT_UNREACHABLE
    assert capsys.readouterr().err == NOT_RUNNING.format(path) + "\n"
    assert main(["--socket", path, "--json", "admit", "ocr", "5120"]) == EXIT_UNREACHABLE
    err = json.loads(capsys.readouterr().out)["error"]
    assert (err["code"], err["details"]["errno"]) == ("unreachable", "ENOENT")


def test_socket_file_nobody_listens_on(sock_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(sock_dir / "stale.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(path)  # bound, never listening: what a crashed daemon leaves behind
    assert os.path.exists(path)
    assert main(["--socket", path, "ledger"]) == EXIT_UNREACHABLE
    assert capsys.readouterr().err == NOT_RUNNING.format(path) + "\n"


def test_socket_that_hangs_up_without_answering(sock_dir: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = str(sock_dir / "rude.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
        srv.bind(path)
        srv.listen()

        def hang_up() -> None:
            conn, _ = srv.accept()
            conn.recv(65536)
            conn.close()

        t = threading.Thread(target=hang_up)
        t.start()
        assert main(["--socket", path, "status"]) == EXIT_UNREACHABLE
        t.join()
    assert "closed the connection without answering" in capsys.readouterr().err


def test_permission_denied_on_the_socket(gpud: FakeGpud,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    path = str(gpud.server_address)
    os.chmod(path, 0o660)
    root = os.geteuid() == 0
    if root:
        os.chmod(os.path.dirname(path), 0o755)
        os.seteuid(65534)  # root opens any socket: be nobody for the connect
    else:
        os.chmod(path, 0)
    try:
        code = main(["--socket", path, "status"])
    finally:
        if root:
            os.seteuid(0)
    assert code == EXIT_UNREACHABLE
    assert capsys.readouterr().err.startswith(
        f"gpuctl: permission denied on {path}: join group gpud")
    assert gpud.requests == []


def test_socket_path_too_long(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--socket", "/tmp/" + "x" * 103, "status"]) == EXIT_USAGE  # 108 bytes
    assert "too long" in capsys.readouterr().err
    assert main(["--socket", "/tmp/" + "x" * 102, "status"]) == EXIT_UNREACHABLE  # 107: fits
    assert "is not running" in capsys.readouterr().err


# ---- help, version, startup -------------------------------------------------------------------


def test_help_for_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == EXIT_OK
    top = capsys.readouterr().out
    assert "gpuctl admit ocr 5120" in top and "exit status:" in top
    for cmd in COMMANDS:
        assert main([cmd.name, "--help"]) == EXIT_OK
        text = capsys.readouterr().out
        assert f"usage: gpuctl {cmd.name}" in text
        assert "examples:" in text and f"gpuctl {cmd.name}" in text.split("examples:")[1]
    assert main(["--version"]) == EXIT_OK
    assert capsys.readouterr().out == "gpuctl 0.1.0\n"


@pytest.mark.parametrize(("argv", "command"), [
    (["status"], "status"), (["--json", "ledger", "--watch"], "ledger"),
    (["--socket", "admit", "serves"], "serves"), (["--socket=/x", "--timeout", "3", "admit"], "admit"),
    (["--", "events"], "events"), (["--help"], None), (["-h", "status"], None),
    (["--sock", "/x", "status"], None), (["bogus"], None), ([], None), (["--json"], None),
])
def test_command_named(argv: list[str], command: str | None) -> None:
    assert ctl_main.command_named(argv) == command


_IMPORT_PROBE = """
import sys
before = set(sys.modules)
from gpud.ctl.main import main
for argv in (["--help"], ["admit", "--help"], ["--socket", sys.argv[1], "--json", "status"],
             ["--socket", sys.argv[1], "events", "--since", "2h"]):
    main(argv)
print(" ".join(sorted(set(sys.modules) - before)))
"""

HEAVY = {"http.client", "email", "ssl", "urllib", "urllib.parse", "typing", "dataclasses",
         "inspect", "asyncio", "pydantic", "aiohttp", "dbus_fast", "pynvml", "sqlite3",
         "gpud.config", "gpud.errors", "gpud.server.api", "logging", "subprocess", "tomllib",
         "gpud.core.answers", "typing_extensions", "gpud.server.openapi"}


def test_gpuctl_imports_nothing_heavy(sock_dir: Path) -> None:
    probe = subprocess.run([sys.executable, "-c", _IMPORT_PROBE, str(sock_dir / "none.sock")],
                           cwd=REPO, capture_output=True, text=True, check=True)
    loaded = set(probe.stdout.splitlines()[-1].split())
    assert loaded & HEAVY == set()
    assert "gpud.ctl.main" in loaded


@pytest.mark.slow
def test_startup_time(gpud: FakeGpud) -> None:
    """`gpuctl status` against a live socket within 2.5x `python3 -c pass` (median of 40)."""
    gpud.answer("GET", "/v1/status", 200, STATUS)
    env = dict(os.environ, GPUD_SOCKET=str(gpud.server_address))
    base_cmd = [sys.executable, "-c", "pass"]
    ctl_cmd = [sys.executable, "-m", "gpud.ctl", "status"]
    base: list[float] = []
    run: list[float] = []
    for _ in range(40):
        for cmd, into in ((base_cmd, base), (ctl_cmd, run)):
            t = time.perf_counter()
            subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
            into.append(time.perf_counter() - t)
    ratio = statistics.median(run) / statistics.median(base)
    print(f"python3 -c pass {statistics.median(base) * 1000:.1f} ms, gpuctl status "
          f"{statistics.median(run) * 1000:.1f} ms, ratio {ratio:.2f}")
    assert ratio <= 2.5


# ---- shell completion --------------------------------------------------------------------------

COMPLETION = REPO / "contrib" / "completion" / "gpuctl.bash"


@pytest.fixture
def gpuctl_on_path(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "gpuctl"
    exe.write_text(f'#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} -m gpud.ctl "$@"\n')
    exe.chmod(0o755)
    return bin_dir


def bash_complete(line: str, env: dict[str, str]) -> list[str]:
    """What the bash completion offers for the last word of ``line`` (which may be empty)."""
    import shlex

    words = line.split(" ")
    script = (f"source {shlex.quote(str(COMPLETION))}\n"
              f"COMP_WORDS=({' '.join(shlex.quote(w) for w in words)})\n"
              f"COMP_CWORD={len(words) - 1}\n"
              '_gpuctl\nprintf "%s\\n" "${COMPREPLY[@]}"\n')
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                         check=True).stdout
    return sorted(w for w in out.splitlines() if w)


@pytest.mark.skipif(not os.path.exists("/bin/bash"), reason="no bash")
def test_bash_completion(gpud: FakeGpud, gpuctl_on_path: Path) -> None:
    gpud.answer("GET", "/v1/serves", 200, {"simulated": False, "serves": [SERVE_FAST, SERVE_OCR]})
    gpud.answer("GET", "/v1/ledger", 200, LEDGER_T011)
    env = dict(os.environ, PATH=f"{gpuctl_on_path}:{os.environ['PATH']}",
               GPUD_SOCKET=str(gpud.server_address))
    assert bash_complete("gpuctl re", env) == ["release", "reload", "restart"]
    assert bash_complete("gpuctl --json st", env) == ["start", "status", "stop"]
    assert bash_complete("gpuctl admit ", env) == ["fast", "ocr"]
    assert bash_complete("gpuctl admit o", env) == ["ocr"]
    assert bash_complete("gpuctl admit ocr ", env) == []
    assert bash_complete("gpuctl admit ocr 5120 --role ", env) == ["dark-fast"]
    assert bash_complete("gpuctl release ocr --s", env) == ["--socket", "--stop"]
    assert bash_complete("gpuctl events --kind deny re", env) == [
        "release", "reload", "reserve-exceeded", "reserve-ok", "restart"]
    assert bash_complete("gpuctl events --serve ", env) == ["fast", "ocr"]
    assert bash_complete("gpuctl ledger --w", env) == ["--watch"]
    nobody = dict(env, GPUD_SOCKET="/nonexistent/gpud.sock")
    assert bash_complete("gpuctl start ", nobody) == []
    assert bash_complete(f"gpuctl --socket {gpud.server_address} start f", nobody) == ["fast"]


# ---- against the real daemon ---------------------------------------------------------------------


def test_the_seed_rebalance_against_a_real_gpud(gpud_t015: Any,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """T015 → T011 with gpuctl alone: ocr denied (short 4769), reserve 7168 → 4608 and
    fast 18432 → 14336, then ocr fits and the ledger reads as in the seed record."""
    sock = str(gpud_t015.socket)

    def run(*argv: str) -> tuple[int, str, str]:
        code = main(["--socket", sock, *argv])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    for name, mib in (("fast", "18432"), ("embeddings", "3200"), ("reranker", "3456")):
        assert run("admit", name, mib)[0] == EXIT_OK
    code, out, err = run("admit", "ocr", "5120")
    assert (code, out) == (EXIT_REFUSED, "")
    assert err.splitlines() == [
        "gpuctl: ocr denied on dark-fast: ledger bound: need 5120 MiB, free 351 MiB, "
        "short 4769 MiB",
        "gpuctl: need 5120 MiB, free 351 MiB, shortfall 4769 MiB (ledger bound on dark-fast)"]

    config = Path(gpud_t015.config)
    config.write_text(config.read_text().replace("reserve_mib = 7168", "reserve_mib = 4608"))
    code, out, _ = run("reload")
    assert code == EXIT_OK and out.startswith("reloaded")
    assert run("admit", "fast", "14336")[1] == (
        "admitted fast: 14336 MiB on dark-fast (was 18432); dark-fast free 7007 MiB\n")
    assert run("admit", "ocr", "5120")[1] == (
        "admitted ocr: 5120 MiB on dark-fast; dark-fast free 1887 MiB\n")

    code, out, _ = run("ledger")
    assert code == EXIT_OK
    assert out.splitlines()[0] == SEED_LEDGER.splitlines()[0]
    assert sorted(line.split(" (")[0] for line in out.splitlines()[1:5]) == sorted(
        line.split(" (")[0] for line in SEED_LEDGER.splitlines()[1:])

    code, out, _ = run("events", "--serve", "ocr", "--kind", "deny", "--since", "1h")
    assert code == EXIT_OK
    assert "need 5120 MiB, free 351 MiB, short 4769 MiB" in out
    code, out, _ = run("--json", "serves", "ocr")
    assert json.loads(out)["reserved_mib"] == 5120
    assert run("admit", "no/such", "5")[0] == EXIT_USAGE
    assert run("serves", "nope")[0] == EXIT_USAGE
    assert run("release", "ocr")[0] == EXIT_OK


def test_preemption_plan_and_sleep_lines() -> None:
    from gpud.core.preempt import Candidate, plan_preemption
    from gpud.ctl.format import format_preemption, format_sleep

    plan = plan_preemption("hi", 10, 16000, 7607, [Candidate("lo", 50, 12000, "sleep", 800)])
    doc = {"serve": "hi", "preemption": plan.to_json(), "dry_run": True, "fits": True}
    assert format_preemption(doc).splitlines() == [
        "preempt for hi (priority 10): need 16000 MiB, free 7607 MiB, short 8393 MiB",
        "  1. put to sleep lo (priority 50): frees 11200 MiB; undo: wake",
        "after: free 18807 MiB, hi fits",
        "dry run: nothing changed"]
    refused = {"serve": "hi", "preemption": {"reason": "nothing lower"}}
    assert format_preemption(refused) == "no preemption can make room for hi: nothing lower"
    assert format_preemption({"serve": "hi"}) == ""
    # gpuctl start --preempt --dry-run: the serve's view (its "name"), and the refusal
    started = dict(SERVE_FAST, name="hi", dry_run=True, fits=False, preemption={
        "serve": "hi", "need_mib": 16000, "free_mib": 7607, "could_free_mib": 0,
        "reason": "nothing lower"})
    assert format_preemption(started).splitlines() == [
        "no preemption can make room for hi: nothing lower", "dry run: nothing changed"]
    started["preemption"] = {"reason": "nothing lower"}
    assert format_preemption(started).splitlines()[0] == (
        "no preemption can make room for hi: nothing lower")
    asleep = dict(SERVE_FAST, state="sleeping", reserved_mib=800,
                  sleep={"level": 1, "from_mib": 14336, "sleep_mib": 800,
                         "parked_host_mib": 14336})
    assert format_sleep(asleep).splitlines()[1] == (
        "asleep at level 1: 14336 MiB -> 800 MiB, 14336 MiB parked in host RAM")
    woke = dict(SERVE_FAST, wake={"mib": 14336, "serve_ms": 12.5})
    assert format_sleep(woke).splitlines()[1] == "awake: 14336 MiB (the serve took 12.5 ms)"
    table = format_serves({"serves": [dict(SERVE_OCR, state="sleeping", reason="asleep (level "
                                           "1, put to sleep)", parked_host_mib=5000)]})
    assert table.splitlines()[-1] == ("ocr (sleeping): asleep (level 1, put to sleep); 5000 MiB "
                                      "parked in host RAM")


def test_serves_table_shows_the_measured_bring_ups() -> None:
    """The medians of each serve's measured wakes and starts (the router's queue evicts the
    cheaper first): a column only when some serve has one."""
    assert "WAKE/START" not in format_serves({"serves": [SERVE_FAST]})
    measured = dict(SERVE_FAST, name="chat", wake_s=0.84, start_s=12.3)
    lines = format_serves({"serves": [measured, SERVE_OCR]}).splitlines()
    assert lines[0].endswith("WAKE/START")
    assert [line.split()[-1] for line in lines[1:3]] == ["0.8s/12.3s", "-/-"]
    block = format_serve(measured).splitlines()
    assert "wake time:   0.84" in block and "start time:  12.3" in block
