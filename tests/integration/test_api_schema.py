"""The answers that need real systemd (start, restart, stop of a live unit, a calibration of a
running serve) validate against the document gpud serves, as every other route's answer does
in tests/test_api_schema.py. Stand-in serve, simulated GPU."""

from __future__ import annotations

from typing import Any

from tests.integration.gpudctl import SandboxGpud, sim_config, standin
from tests.schema import answer_errors

ROLE = """
[roles.dark-fast]
device = "GPU-sim-0"
reserve_mib = 4608
"""


def checked(gpud: SandboxGpud, doc: dict[str, Any], method: str, template: str, path: str,
            body: Any = None) -> Any:
    reply = gpud.call(method, path, body)
    assert reply.status == 200, reply.raw
    errors = answer_errors(doc, method, template, reply.status, reply.body)
    assert not errors, errors
    return reply.body


def test_lifecycle_and_calibration_answers_match_the_document(gpud: SandboxGpud) -> None:
    serves = (f'[serves.emb]\nrole = "dark-fast"\nvram_mib = 3200\nport = 30033\n'
              f'command = {standin()}\n')
    gpud.configure(sim_config(ROLE, serves))
    doc = gpud.get("/v1/openapi.json")
    started = checked(gpud, doc, "POST", "/v1/serves/{name}/start", "/v1/serves/emb/start", {})
    assert started["state"] in ("admitted", "starting", "running")  # launch queued per device
    gpud.wait_state("emb", "running")
    serve = checked(gpud, doc, "GET", "/v1/serves/{name}", "/v1/serves/emb")
    assert serve["main_pid"] is not None
    checked(gpud, doc, "GET", "/v1/ledger", "/v1/ledger")
    checked(gpud, doc, "GET", "/v1/status", "/v1/status")
    run = checked(gpud, doc, "POST", "/v1/serves/{name}/calibrate", "/v1/serves/emb/calibrate",
                  {"window_s": 2})
    assert run["running"] is True
    checked(gpud, doc, "GET", "/v1/serves/{name}/calibration", "/v1/serves/emb/calibration")
    gpud.wait_event("calibrate", serve="emb")
    view = checked(gpud, doc, "GET", "/v1/serves/{name}/calibration",
                   "/v1/serves/emb/calibration")
    assert view["record"] is not None and view["status"] == "calibrated"
    checked(gpud, doc, "GET", "/v1/serves/{name}", "/v1/serves/emb")  # with its calibration
    restarted = checked(gpud, doc, "POST", "/v1/serves/{name}/restart",
                        "/v1/serves/emb/restart", {})
    assert restarted["name"] == "emb"
    gpud.wait_state("emb", "running")
    stopped = checked(gpud, doc, "POST", "/v1/serves/{name}/stop", "/v1/serves/emb/stop", {})
    assert stopped["reserved_mib"] is None
    events = checked(gpud, doc, "GET", "/v1/events", "/v1/events?serve=emb")
    assert {"start", "healthy", "calibrate"} <= {e["kind"] for e in events["events"]}
