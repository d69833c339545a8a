"""The OpenAPI 3.1 document gpud serves at /v1/openapi.json (docs/api.md in prose)."""

from __future__ import annotations

from functools import cache
from typing import Any

from gpud import __version__
from gpud.core.vocab import NAME_PATTERN

_INT = {"type": "integer"}
_NINT = {"type": ["integer", "null"]}
_STR = {"type": "string"}
_NSTR = {"type": ["string", "null"]}
_NUM = {"type": "number"}
_BOOL = {"type": "boolean"}


def _obj(props: dict[str, Any], required: list[str] | None = None, *,
         extra: bool = True) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": props,
                              "required": required if required is not None else list(props)}
    if not extra:
        schema["additionalProperties"] = False
    return schema


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


FIGURES = _obj({"capacity_mib": _INT, "reserve_mib": _INT, "committed_mib": _INT,
                "free_mib": _INT})
OBSERVED = _obj({k: _INT for k in (
    "total_mib", "used_mib", "physical_free_mib", "managed_draw_mib", "non_ledger_draw_mib",
    "reserve_mib", "reserve_excess_mib", "pending_mib", "effective_free_mib")} | {
    "simulated": _BOOL})
# A serve on several roles (devices): every role, and which part of it this listing is ("1/2").
_ROLES = {"type": "array", "items": _STR, "minItems": 2}
_RESERVATION_REQUIRED = ["serve", "role", "mib", "since", "by_uid", "state", "resident",
                         "external"]
RESERVATION = _obj({"serve": _STR, "role": _STR, "mib": _INT, "since": _NUM, "by_uid": _NINT,
                    "state": _STR, "resident": _BOOL, "external": _BOOL,
                    "roles": _ROLES, "part": {"type": "string", "pattern": "^[0-9]+/[0-9]+$"}},
                   _RESERVATION_REQUIRED)
ROLE = _obj({"name": _STR, "device": _STR, "note": _NSTR, "missing": _BOOL,
             "capacity_mib": _INT, "reserve_mib": _INT, "committed_mib": _INT, "free_mib": _INT,
             "over_committed": _BOOL,
             "reservations": {"type": "array", "items": _ref("Reservation")},
             "observed": {"oneOf": [_ref("Observed"), {"type": "null"}]}})
SERVE = _obj({"name": _STR, "role": _NSTR, "configured": _BOOL, "external": _BOOL,
              "state": {"enum": ["declared", "admitted", "starting", "running", "stopping",
                                 "denied", "failed", "external", "orphan"]},
              "reason": _NSTR, "vram_mib": _NINT, "reserved_mib": _NINT, "resident": _BOOL,
              "priority": _NINT, "port": _NINT, "unit": _NSTR, "main_pid": _NINT,
              "n_restarts": _INT, "observed_mib": _NINT, "calibration": _STR,
              "fingerprint": _NSTR, "device_lost": _NSTR,
              "calibrated": {"oneOf": [_obj({"steady_mib": _INT, "peak_mib": _INT,
                                             "recommended_mib": _INT,
                                             "vllm": {"type": ["object", "null"]}}),
                                       {"type": "null"}]}})
SERVE["properties"]["roles"] = _ROLES  # only for a serve on several roles: not required
EVENT = _obj({"id": _INT, "ts": _NUM, "kind": _STR, "serve": _NSTR, "role": _NSTR,
              "mib": _NINT, "uid": _NINT, "message": _STR, "details": {"type": "object"}})
ERROR = _obj({"error": _obj({"code": _STR, "message": _STR, "details": {"type": "object"}})})
STATUS = _obj({"version": _STR, "config": _NSTR, "admission": {"enum": ["strict", "ledger"]},
               "started_at": _NUM, "ready": _BOOL,
               "launching": _obj({"available": _BOOL, "reason": _NSTR}),
               "observation": {"type": "object"},
               "serve_states": {"type": "object", "additionalProperties": _INT},
               "over_committed": {"type": "array", "items": _STR},
               "config_file": _obj({"differs": _BOOL, "reason": _NSTR}),
               "store_transactions": _INT, "summary": _STR})
ADMIT_BODY = _obj({"mib": {"type": "integer", "minimum": 1, "maximum": 2**31 - 1},
                   "role": {"type": ["string", "null"], "pattern": NAME_PATTERN}},
                  ["mib"], extra=False)
ADMITTED = _obj({"serve": _STR, "role": _STR, "mib": _INT, "replaced_mib": _NINT,
                 "check": {"enum": ["ledger", "strict"]}, "note": _NSTR,
                 "figures": _ref("Figures"), "roles": _ROLES,
                 "figures_by_role": {"type": "object", "additionalProperties": _ref("Figures")}},
                ["serve", "role", "mib", "replaced_mib", "check", "note", "figures"])
CONFIG_BODY = _obj({"config": {"type": "string", "maxLength": 1024 * 1024},
                    "source": {"type": ["string", "null"]}}, ["config"], extra=False)
PLAN = _obj({"source": _STR, "roles": {"type": "array"}, "serves": {"type": "array"},
             "restart": {"type": "array", "items": _STR}, "resident_fits": _BOOL,
             "denied": {"type": "array"},
             "blocked": {"type": "array", "items": _obj({"what": _STR, "role": _NSTR,
                                                         "mib": _NINT, "reason": _STR,
                                                         "message": _STR})},
             "stop_first": {"type": "array", "items": _STR}})
RELEASED = _obj({"serve": _STR, "role": _STR, "released_mib": _INT, "figures": _ref("Figures"),
                 "roles": _ROLES,
                 "figures_by_role": {"type": "object", "additionalProperties": _ref("Figures")}},
                ["serve", "role", "released_mib", "figures"])

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
    op: dict[str, Any] = {"summary": summary, "responses": _answers(ok, 400, 413, *errors)}
    if name:
        op["parameters"] = [NAME_PARAM]
    if body is not None:
        op["requestBody"] = {"required": False,
                             "content": {"application/json": {"schema": body}}}
    return {"post": op}


@cache
def document() -> dict[str, Any]:
    empty = _obj({}, [], extra=False)
    return {
        "openapi": "3.1.0",
        "info": {"title": "gpud", "version": __version__,
                 "description": "The GPU-memory ledger of one host: admission, serves, events."},
        "paths": {
            "/v1/status": {"get": {"summary": "Daemon status and a one-line ledger summary",
                                   "responses": _answers(_ref("Status"))}},
            "/v1/ledger": {"get": {"summary": "Per-role ledger figures and observed draw",
                                   "responses": _answers(_obj({
                                       "admission": _STR, "simulated": _BOOL,
                                       "roles": {"type": "array", "items": _ref("Role")}}))}},
            "/v1/serves": {"get": {"summary": "All serves", "responses": _answers(_obj({
                "simulated": _BOOL, "serves": {"type": "array", "items": _ref("Serve")}}))}},
            "/v1/serves/{name}": {"get": {"summary": "One serve", "parameters": [NAME_PARAM],
                                          "responses": _answers(_ref("Serve"), 400, 404)}},
            "/v1/serves/{name}/admit": _post("Reserve memory for a serve", _ref("Admitted"),
                                             ADMIT_BODY, 404, 409, 500, 503),
            "/v1/serves/{name}/release": _post(
                "Release a serve's reservation", _ref("Released"),
                _obj({"stop": _BOOL}, [], extra=False), 404, 409, 500, 503),
            "/v1/serves/{name}/start": _post("Admit if needed, then launch", _ref("Serve"),
                                             empty, 404, 409, 500, 503),
            "/v1/serves/{name}/stop": _post("Stop a serve and release it", _ref("Serve"),
                                            empty, 404, 409, 500, 503),
            "/v1/serves/{name}/restart": _post("Restart a serve", _ref("Serve"), empty,
                                               404, 409, 500, 503),
            "/v1/reload": _post("Reload the config file", {"type": "object"}, empty, 500, 503,
                                name=False),
            "/v1/plan": _post("The ledger a new config would give (changes nothing)",
                              _ref("Plan"), CONFIG_BODY, 500, 503, name=False),
            "/v1/apply": {"post": {
                "summary": "Rebalance to a new config; NDJSON steps, then a result line",
                "requestBody": {"required": True,
                                "content": {"application/json": {"schema": CONFIG_BODY}}},
                "responses": {
                    "200": {"description": "steps as they happen, then the result",
                            "content": {"application/x-ndjson": {"schema": {"type": "object"}}}},
                    **{str(c): {"description": "error", "content": {"application/json": {
                        "schema": _ref("Error")}}} for c in (400, 403, 409, 413, 500, 503)}}}},
            "/v1/serves/{name}/calibrate": _post(
                "Measure a running serve's draw over a window", {"type": "object"},
                _obj({"window_s": {"type": "number", "minimum": 1, "maximum": 86400}}, [],
                     extra=False), 404, 409, 500, 503),
            "/v1/serves/{name}/calibration": {"get": {
                "summary": "A serve's calibration: status, record, measurement in progress",
                "parameters": [NAME_PARAM],
                "responses": _answers({"type": "object"}, 400, 404)}},
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
                "responses": _answers(_obj({"events": {"type": "array",
                                                       "items": _ref("Event")}}), 400)}},
            "/v1/openapi.json": {"get": {"summary": "This document",
                                         "responses": _answers({"type": "object"})}},
            "/metrics": {"get": {"summary": "Prometheus text exposition", "responses": {
                "200": {"description": "ok", "content": {"text/plain": {"schema": _STR}}},
                "503": {"description": "metrics unavailable",
                        "content": {"application/json": {"schema": _ref("Error")}}}}}},
        },
        "components": {"schemas": {
            "Figures": FIGURES, "Observed": OBSERVED, "Reservation": RESERVATION,
            "Role": ROLE, "Serve": SERVE, "Event": EVENT, "Error": ERROR, "Status": STATUS,
            "Admitted": ADMITTED, "Released": RELEASED, "Plan": PLAN,
        }},
    }
