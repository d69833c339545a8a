"""Every route's live answer, from a real gpud on its socket, validates against the document that
gpud serves at /v1/openapi.json, whose answer schemas come from gpud.core.answers.

Start, restart and calibrate answer 200 only with a system bus and a running serve: here they
answer their documented errors; tests/integration/test_api_schema.py holds their 200 answers
(and a running serve's, a calibration's) to the same document under real systemd."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpud.config import parse_config
from gpud.core.bodies import AdmitBody
from gpud.durable.store import Store
from gpud.life.service import LedgerService
from gpud.server.api import Api
from gpud.server.openapi import body_schema, document
from tests.conftest import REPO, GpudProcess, start_gpud
from tests.schema import answer_errors, schema_errors

CONFIG = """
[daemon]
admission = "strict"
observe_interval_s = 0.2

[roles.dark-fast]
device = "GPU-sim-0"
capacity_mib = 28511  # the device, less dark-side
reserve_mib = 4608
note = "display + voice sidecars"

[roles.dark-side]
device = "GPU-sim-0"
capacity_mib = 4096
reserve_mib = 0

[serves.fast]
role = "dark-fast"
vram_mib = 14336
resident = false
port = 30001
[serves.fast.vllm]
model = "google/gemma-4-E4B-it"

[serves.ocr]
role = "dark-fast"
vram_mib = 5120
resident = false
port = 30007
command = ["/bin/true", "--port", "{port}"]

[serves.od]
role = "dark-fast"
vram_mib = 1024
port = 30008
on_demand = true
front = true
command = ["/bin/true", "--uds", "{socket}"]

[simulation]
state_file = "{state}"
[[simulation.devices]]
uuid = "GPU-sim-0"
total_mib = 32607
"""


@pytest.fixture
def gp(tmp_path: Path) -> Iterator[GpudProcess]:
    state = tmp_path / "sim.json"
    state.write_text(json.dumps({"external": [{"device": "GPU-sim-0", "label": "display",
                                               "mib": 5837}]}))
    proc = start_gpud(tmp_path, CONFIG.replace("{state}", str(state)))
    yield proc
    proc.stop()


class Checked:
    """Calls through the socket, each answer held to the served document."""

    def __init__(self, gp: GpudProcess) -> None:
        self.gp = gp
        reply = gp.call("GET", "/v1/openapi.json")
        assert reply.status == 200
        self.doc: dict[str, Any] = reply.body
        self.seen: set[tuple[str, str, int]] = set()

    def __call__(self, method: str, template: str, path: str | None = None,
                 body: Any = None, status: int = 200) -> Any:
        reply = self.gp.call(method, path or template, body)
        assert reply.status == status, (method, path or template, reply.status, reply.body)
        self.seen.add((method, template, reply.status))
        if template == "/metrics":
            assert reply.raw.startswith(b"# HELP")
            return reply.raw
        if template == "/ui":
            assert reply.headers["Content-Type"].startswith("text/html"), reply.headers
            assert reply.raw.startswith(b"<!doctype html>")
            return reply.raw
        if template == "/v1/apply":
            lines = [json.loads(line) for line in reply.raw.splitlines() if line.strip()]
            for line in lines:
                errors = answer_errors(self.doc, method, template, reply.status, line)
                assert not errors, errors
            return lines
        errors = answer_errors(self.doc, method, template, reply.status, reply.body)
        assert not errors, errors
        return reply.body


def test_the_served_document_is_the_generated_one(gp: GpudProcess) -> None:
    served = gp.call("GET", "/v1/openapi.json").body
    assert served == json.loads(json.dumps(document()))
    assert {"Ledger", "Role", "Serve", "Status", "Plan", "Calibration", "Error"} <= set(
        served["components"]["schemas"])


def test_every_route_answers_as_the_document_says(gp: GpudProcess, tmp_path: Path) -> None:
    check = Checked(gp)
    status = check("GET", "/v1/status")
    assert status["observation"]["simulated"] is True
    check("GET", "/v1/ledger")
    check("GET", "/v1/serves")
    check("GET", "/v1/serves/{name}", "/v1/serves/fast")
    check("GET", "/v1/serves/{name}", "/v1/serves/nobody", status=404)
    check("GET", "/v1/serves/{name}", "/v1/serves/Bad%20Name", status=400)
    check("GET", "/v1/openapi.json")
    check("GET", "/metrics")
    check("GET", "/ui")

    admitted = check("POST", "/v1/serves/{name}/admit", "/v1/serves/fast/admit", {"mib": 14336})
    assert admitted["figures"]["committed_mib"] == 14336
    check("POST", "/v1/serves/{name}/admit", "/v1/serves/ocr/admit", {"mib": 30000},
          status=409)
    check("POST", "/v1/serves/{name}/admit", "/v1/serves/sidecar/admit",
          {"mib": 1024, "role": "dark-side"})
    check("POST", "/v1/serves/{name}/admit", "/v1/serves/ocr/admit", {"mib": "many"},
          status=400)
    ledger = check("GET", "/v1/ledger")
    fast_role = next(r for r in ledger["roles"] if r["name"] == "dark-fast")
    assert [r["serve"] for r in fast_role["reservations"]] == ["fast"]
    assert fast_role["observed"] is not None  # the simulated device's split, validated too
    check("GET", "/v1/serves")
    check("GET", "/v1/serves/{name}", "/v1/serves/sidecar")
    check("POST", "/v1/serves/{name}/release", "/v1/serves/sidecar/release", {})
    check("POST", "/v1/serves/{name}/release", "/v1/serves/sidecar/release", {}, status=409)

    for action in ("start", "restart"):  # no system bus here: launching unavailable
        check("POST", f"/v1/serves/{{name}}/{action}", f"/v1/serves/fast/{action}", {},
              status=503)
    # nothing runs without a bus: nothing to put to sleep or wake
    check("POST", "/v1/serves/{name}/sleep", "/v1/serves/fast/sleep", {}, status=409)
    check("POST", "/v1/serves/{name}/wake", "/v1/serves/fast/wake", {}, status=409)
    stopped = check("POST", "/v1/serves/{name}/stop", "/v1/serves/fast/stop", {})
    assert (stopped["state"], stopped["reserved_mib"]) == ("declared", None)  # and released
    check("POST", "/v1/serves/{name}/admit", "/v1/serves/fast/admit", {"mib": 14336})
    check("GET", "/v1/serves/{name}/calibration", "/v1/serves/fast/calibration")
    check("POST", "/v1/serves/{name}/calibrate", "/v1/serves/fast/calibrate",
          {"window_s": 60}, status=409)  # fast is admitted, not running
    # the front's check: fast is not on demand; od cannot be started without a bus, which the
    # refusal says in its body and in the header the front reads
    check("POST", "/v1/serves/{name}/ensure", "/v1/serves/fast/ensure", status=404)
    refused = gp.call("POST", "/v1/serves/od/ensure")
    held = check("POST", "/v1/serves/{name}/ensure", "/v1/serves/od/ensure", status=403)
    # the header (the front's 503 body, seen by any local user) is an error document too, of
    # the reason's class only; the body is the whole error (held: not tried again so soon)
    said = json.loads(refused.headers["X-Gpud-Reason"])
    assert not answer_errors(check.doc, "POST", "/v1/serves/{name}/ensure", 403, said)
    assert said["error"]["details"] == {"serve": "od", "class": "unavailable",
                                        "retry_after_s": 5}, said
    assert refused.headers["Retry-After"] == "5"
    assert refused.body["error"]["code"] == "unavailable", refused.body
    assert held["error"]["details"]["held"] is True, held

    text = gp.config.read_text()
    check("POST", "/v1/reload", body={})
    grown = text.replace("vram_mib = 5120", "vram_mib = 6144").replace(
        "reserve_mib = 4608", "reserve_mib = 4096")
    plan = check("POST", "/v1/plan", body={"config": grown, "source": "grown.toml"})
    assert plan["serves"] and plan["roles"] and plan["resident_fits"]
    too_big = text.replace("vram_mib = 5120\nresident = false",
                           "vram_mib = 27000\nresident = true")
    plan = check("POST", "/v1/plan", body={"config": too_big, "source": "big.toml"})
    assert plan["denied"] and not plan["resident_fits"]
    check("POST", "/v1/plan", body={"config": "[roles.x]\ndevice = 5"}, status=400)
    check("POST", "/v1/serves/{name}/release", "/v1/serves/fast/release", {})  # none to start
    lines = check("POST", "/v1/apply", body={"config": grown, "source": "grown.toml"})
    assert lines[-1]["result"] == "applied", lines
    lines = check("POST", "/v1/apply", body={"config": too_big, "source": "big.toml"})
    assert lines[-1]["result"] == "refused" and lines[-1]["error"]["code"] == "denied", lines

    events = check("GET", "/v1/events")
    assert {"admit", "deny", "release", "reload", "apply"} <= {e["kind"] for e in
                                                                 events["events"]}
    check("GET", "/v1/events", "/v1/events?limit=0", status=400)
    usage = check("GET", "/v1/usage", "/v1/usage?since=3700&key=alice")
    assert usage == {"since": 3600, "rows": [], "budgets": []}, usage
    check("GET", "/v1/usage", "/v1/usage?colour=blue", status=400)
    assert check("GET", "/v1/peers") == {"peers": []}
    assert check("GET", "/v1/route", "/v1/route?model=m") == {
        "model": "m", "found": False, "peer": None, "hosts": []}
    check("GET", "/v1/route", "/v1/route?model=a%20b", status=400)
    check("GET", "/v1/status")

    # every route of the document was asked, and all but those that need a bus answered 200
    routes = {(m.upper(), p) for p, ops in check.doc["paths"].items() for m in ops}
    assert routes == {(m, t) for m, t, _ in check.seen}
    needs_bus = {"/v1/serves/{name}/start", "/v1/serves/{name}/restart",
                 "/v1/serves/{name}/calibrate", "/v1/serves/{name}/sleep",
                 "/v1/serves/{name}/wake", "/v1/serves/{name}/ensure"}  # 204 when it can
    ok = {t for _, t, s in check.seen if s == 200}
    assert {t for _, t in routes} - ok == needs_bus


def test_every_field_of_every_answer_is_named_in_the_api_page() -> None:
    """docs/api.md is prose by hand: it names every field the document says an answer has."""
    text = (REPO / "docs" / "api.md").read_text()
    unnamed = {f"{name}.{field}" for name, schema in document()["components"]["schemas"].items()
               for field in schema.get("properties", {})
               if not re.search(rf"\b{re.escape(field)}\b", text)}
    assert unnamed == set()


@pytest.mark.parametrize(("change", "problem"), [
    (lambda d: d.pop("missing"), "/missing: required"),
    (lambda d: d.update(colour="blue"), "/colour: not allowed"),
    (lambda d: d.update(capacity_mib="32607"), "/capacity_mib: str is not integer"),
    (lambda d: d.update(note=3), "/note: int is not"),
    (lambda d: d["reservations"][0].update(state="hibernating"), "not one of"),
])
def test_the_checker_finds_what_breaks_the_schema(change: Any, problem: str) -> None:
    doc = document()
    role = {"name": "r", "device": "0", "note": None, "missing": False, "capacity_mib": 1,
            "reserve_mib": 0, "committed_mib": 0, "free_mib": 1, "over_committed": False,
            "reservations": [{"serve": "a", "role": "r", "mib": 1, "since": 1.0, "by_uid": 0,
                              "state": "running", "resident": True, "external": False}],
            "observed": None}
    ref = {"$ref": "#/components/schemas/Role"}
    assert schema_errors(role, ref, doc) == []
    change(role)
    errors = schema_errors(role, ref, doc)
    assert errors and problem in errors[0], errors


def _api(tmp_path: Path, extra_routes: Any = None) -> tuple[Api, Store]:
    text = '[roles.r]\ndevice = "0"\ncapacity_mib = 1000\nreserve_mib = 0\n'
    store = Store(tmp_path / "gpud.sqlite3")
    svc = LedgerService(parse_config(text, "test"), store, config_text=text)
    return Api(svc, extra_routes=extra_routes), store


def registered(api: Api) -> set[tuple[str, str]]:
    """(METHOD, path template) of every route the aiohttp app has."""
    return {(r.method, r.resource.canonical) for r in api.app.router.routes() if r.resource}


def documented(doc: dict[str, Any]) -> set[tuple[str, str]]:
    return {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}


def test_every_registered_route_is_in_the_document(tmp_path: Path) -> None:
    api, store = _api(tmp_path)
    try:
        routes = registered(api)
    finally:
        store.close()
    doc = document()
    assert routes == documented(doc), (routes ^ documented(doc))
    # and every POST says its body, generated from the model that validates it
    for method, path in routes:
        if method == "POST":
            body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
            assert body["schema"]["additionalProperties"] is False, path
    admit = doc["paths"]["/v1/serves/{name}/admit"]["post"]["requestBody"]["content"]
    assert admit["application/json"]["schema"] == body_schema(AdmitBody)
    assert body_schema(AdmitBody)["required"] == ["mib"]


def test_a_route_added_without_its_schema_is_found(tmp_path: Path) -> None:
    async def handler(request: Any) -> Any:
        raise AssertionError("not called")

    api, store = _api(tmp_path, extra_routes=lambda a: a.route("POST", "/v1/serves/{name}/x", handler))
    try:
        assert registered(api) - documented(document()) == {("POST", "/v1/serves/{name}/x")}
    finally:
        store.close()


def test_methods_the_document_leaves_out_answer_405(gp: GpudProcess) -> None:
    """On every documented path the methods it does not document answer 405 in the error shape,
    naming the documented ones as allowed; the documented ones never do."""
    doc = gp.call("GET", "/v1/openapi.json").body
    for template, ops in doc["paths"].items():
        path = template.replace("{name}", "fast")
        allowed = sorted(m.upper() for m in ops)
        for method in ("GET", "POST", "PUT", "DELETE", "PATCH"):
            reply = gp.call(method, path, {} if method != "GET" else None)
            if method in allowed:
                assert reply.status != 405, (method, path)
                continue
            assert reply.status == 405, (method, path, reply.status)
            error = {"$ref": "#/components/schemas/Error"}
            assert schema_errors(reply.body, error, doc) == [], reply.body
            assert reply.body["error"]["details"]["allowed"] == allowed, (method, path)
