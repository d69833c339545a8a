"""The OpenAPI 3.1 document gpud serves at /v1/openapi.json (docs/api.md in prose).

The answers' schemas are generated from their types in gpud.core.answers, the request bodies'
from the pydantic models gpud.server.api validates them with (gpud.core.bodies); the parameters are
described here.
tests/test_api_schema.py holds the document to the routes the app registers."""

from __future__ import annotations

from functools import cache
from typing import Any

from pydantic import BaseModel, TypeAdapter
from pydantic.json_schema import GenerateJsonSchema

from gpud import __version__
from gpud.core import answers
from gpud.core.bodies import (
    AdmitBody,
    CalibrateBody,
    ConfigBody,
    EmptyBody,
    ReleaseBody,
    SleepBody,
    StartBody,
)
from gpud.core.peers import CircuitState
from gpud.core.vocab import EVENT_KINDS, NAME_PATTERN, PHASES, STATES

_STR = {"type": "string"}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


REF = "#/components/schemas/{model}"


class _Schemas(GenerateJsonSchema):
    """pydantic's JSON Schema, without the titles it makes up for every field."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


# Where a field is a string of one of the vocabulary's lists (typed str in gpud.core.answers).
_ENUMS: dict[tuple[str, str], tuple[str, ...]] = {
    ("Reservation", "state"): STATES,
    ("Serve", "state"): STATES,
    ("Serve", "phase"): PHASES,
    ("Started", "state"): STATES,
    ("Started", "phase"): PHASES,
    ("Slept", "state"): STATES,
    ("Slept", "phase"): PHASES,
    ("Woken", "state"): STATES,
    ("Woken", "phase"): PHASES,
    ("Event", "kind"): EVENT_KINDS,
    ("Peer", "circuit"): tuple(str(s) for s in CircuitState),
}


@cache
def component_schemas() -> dict[str, Any]:
    """The schemas of every answer, from the TypedDicts of gpud.core.answers. An answer holds
    exactly the fields described: a field not there fails validation (additionalProperties)."""
    _, top = TypeAdapter.json_schemas(
        [(t.__name__, "serialization", TypeAdapter(t)) for t in answers.COMPONENTS],
        ref_template=REF, schema_generator=_Schemas)
    defs: dict[str, Any] = top["$defs"]
    for schema in defs.values():
        if schema.get("type") == "object" and "properties" in schema:
            schema["additionalProperties"] = False
    for (name, field), values in _ENUMS.items():
        defs[name]["properties"][field]["enum"] = list(values)
    return defs


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """A request body's schema, as the model that validates it says (extra="forbid" becomes
    additionalProperties false). What a model checks beyond its fields (AdmitBody's dry_run goes
    with preempt) is said in docs/api.md."""
    schema = model.model_json_schema(ref_template=REF, schema_generator=_Schemas)
    schema.pop("title", None)
    return schema


ADMIT_BODY = body_schema(AdmitBody)
START_BODY = body_schema(StartBody)
SLEEP_BODY = body_schema(SleepBody)
CONFIG_BODY = body_schema(ConfigBody)

NAME_PARAM = {"name": "name", "in": "path", "required": True,
              "schema": {"type": "string", "pattern": NAME_PATTERN}}


def _answers(ok: dict[str, Any], *errors: int) -> dict[str, Any]:
    out: dict[str, Any] = {"200": {"description": "ok",
                                   "content": {"application/json": {"schema": ok}}}}
    for code in (*errors, 403):
        out[str(code)] = {"description": "error",
                          "content": {"application/json": {"schema": _ref("Error")}}}
    return out


def _post(summary: str, ok: dict[str, Any], body: dict[str, Any] | None, *errors: int,
          name: bool = True) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": _answers(ok, 400, 408, 413, *errors)}
    if name:
        op["parameters"] = [NAME_PARAM]
    if body is not None:
        op["requestBody"] = {"required": False,
                             "content": {"application/json": {"schema": body}}}
    return {"post": op}


def _ensure(empty: dict[str, Any]) -> dict[str, Any]:
    """The front's check before each request to an on-demand serve (docs/front.md): no answer
    body when the serve is up; a 403 is either a caller other than root and the front's user or
    a serve that cannot be brought up (then with X-Gpud-Reason and Retry-After)."""
    op = _post("Have an on-demand serve running (admit and start it, or wake it) before the "
               "front forwards a request to it; root and daemon.front_user only",
               {}, empty, 404, 500, 503)
    responses = op["post"]["responses"]
    del responses["200"]
    responses["204"] = {"description": "the serve is running"}
    responses["403"] = {
        "description": "not the front's user nor root, or the serve cannot be brought up "
                       "(denied, failed, not healthy within its start_timeout_s)",
        "headers": {"X-Gpud-Reason": {"description": "an error document, JSON, that says "
                                                     "only the reason's class (details.class) "
                                                     "and details.retry_after_s: the front's "
                                                     "503 body, seen by any local user",
                                      "schema": _STR},
                    "Retry-After": {"description": "seconds until gpud tries again",
                                    "schema": _STR}},
        "content": {"application/json": {"schema": _ref("Error")}}}
    return op


@cache
def document() -> dict[str, Any]:
    empty = body_schema(EmptyBody)
    return {
        "openapi": "3.1.0",
        "info": {"title": "gpud", "version": __version__,
                 "description": "The GPU-memory ledger of one host: admission, serves, events."},
        "paths": {
            "/v1/status": {"get": {"summary": "Daemon status and a one-line ledger summary",
                                   "responses": _answers(_ref("Status"))}},
            "/v1/ledger": {"get": {"summary": "Per-role ledger figures and observed draw",
                                   "responses": _answers(_ref("Ledger"))}},
            "/v1/serves": {"get": {"summary": "All serves", "responses": _answers(_ref("Serves"))}},
            "/v1/serves/{name}": {"get": {"summary": "One serve", "parameters": [NAME_PARAM],
                                          "responses": _answers(_ref("Serve"), 400, 404)}},
            "/v1/serves/{name}/admit": _post(
                "Reserve memory for a serve (with preempt: putting lower priorities to sleep)",
                {"anyOf": [_ref("Admitted"), _ref("PreemptionDryRun")]}, ADMIT_BODY,
                404, 409, 500, 503),
            "/v1/serves/{name}/release": _post(
                "Release a serve's reservation", _ref("Released"),
                body_schema(ReleaseBody), 404, 409, 500, 503),
            "/v1/serves/{name}/start": _post(
                "Admit if needed (with preempt: putting lower priorities to sleep), then launch",
                _ref("Started"), START_BODY, 404, 409, 500, 503),
            "/v1/serves/{name}/sleep": _post(
                "Put a running serve to sleep (vLLM sleep mode); its reservation shrinks",
                _ref("Slept"), SLEEP_BODY, 404, 409, 500, 503),
            "/v1/serves/{name}/wake": _post(
                "Wake a sleeping serve (admitted at its awake size first)", _ref("Woken"), empty,
                404, 409, 500, 503),
            "/v1/serves/{name}/stop": _post("Stop a serve and release it", _ref("Serve"),
                                            empty, 404, 409, 500, 503),
            "/v1/serves/{name}/restart": _post("Restart a serve", _ref("Serve"), empty,
                                               404, 409, 500, 503),
            "/v1/reload": _post("Reload the config file", _ref("Reloaded"), empty, 429, 500, 503,
                                name=False),
            "/v1/plan": _post("The ledger a new config would give (changes nothing)",
                              _ref("Plan"), CONFIG_BODY, 429, 500, 503, name=False),
            "/v1/apply": {"post": {
                "summary": "Rebalance to a new config; NDJSON steps, then a result line",
                "requestBody": {"required": True,
                                "content": {"application/json": {"schema": CONFIG_BODY}}},
                "responses": {
                    "200": {"description": "steps as they happen, then the result",
                            "content": {"application/x-ndjson": {"schema": {"anyOf": [
                                _ref("ApplyStep"), _ref("ApplyResult")]}}}},
                    **{str(c): {"description": "error", "content": {"application/json": {
                        "schema": _ref("Error")}}} for c in (400, 403, 408, 409, 413, 429, 500,
                                                               503)}}}},
            "/v1/serves/{name}/calibrate": _post(
                "Measure a running serve's draw over a window", _ref("CalibrationRun"),
                body_schema(CalibrateBody), 404, 409, 500, 503),
            "/v1/serves/{name}/ensure": _ensure(empty),
            "/v1/serves/{name}/calibration": {"get": {
                "summary": "A serve's calibration: status, record, measurement in progress",
                "parameters": [NAME_PARAM],
                "responses": _answers(_ref("Calibration"), 400, 404)}},
            "/v1/events": {"get": {
                "summary": "Stored events, oldest first; follow=1 streams NDJSON",
                "parameters": [
                    {"name": "serve", "in": "query", "schema": _STR},
                    {"name": "role", "in": "query", "schema": _STR},
                    {"name": "kind", "in": "query", "schema": _STR},
                    {"name": "since", "in": "query", "schema": _STR},
                    {"name": "after", "in": "query", "schema": {"type": "integer", "minimum": 0}},
                    {"name": "limit", "in": "query",
                     "schema": {"type": "integer", "minimum": 1, "maximum": 10000}},
                ],
                "responses": _answers(_ref("Events"), 400)}},
            "/v1/usage": {"get": {
                "summary": "Usage per key and model through the router (hourly rows summed)",
                "parameters": [
                    {"name": "since", "in": "query", "schema": _STR},
                    {"name": "key", "in": "query", "schema": _STR},
                ],
                "responses": _answers(_ref("Usage"), 400)}},
            "/ui": {"get": {"summary": "The status page (HTML; its script reads the routes "
                                       "above)", "responses": {
                "200": {"description": "ok", "content": {"text/html": {"schema": _STR}}}}}},
            "/v1/peers": {"get": {
                "summary": "The peers ([peers.NAME]): reachable or not, circuit, models, round "
                           "trip, last error",
                "responses": _answers(_ref("Peers"))}},
            "/v1/route": {"get": {
                "summary": "Which host takes a request for a model now: this one, a peer, or "
                           "none (gpud.core.peers.choose_host)",
                "parameters": [{"name": "model", "in": "query", "required": True,
                                "schema": _STR}],
                "responses": _answers(_ref("RouteChoice"), 400)}},
            "/v1/openapi.json": {"get": {"summary": "This document",
                                         "responses": _answers({"type": "object"})}},
            "/metrics": {"get": {"summary": "Prometheus text exposition", "responses": {
                "200": {"description": "ok", "content": {"text/plain": {"schema": _STR}}},
                "503": {"description": "metrics unavailable",
                        "content": {"application/json": {"schema": _ref("Error")}}}}}},
        },
        "components": {"schemas": component_schemas()},
    }
