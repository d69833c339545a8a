"""Answers held to the OpenAPI document gpud serves: a checker of the JSON Schema subset the
document uses, and the schema of one route's answer.

Used by the live-answer test (tests/test_api_schema.py), gpuctl's canned answers
(tests/test_gpuctl.py) and the API campaign (tests/campaigns/test_api_fuzz.py).
"""

from __future__ import annotations

import re
from typing import Any


def schema_errors(value: Any, schema: dict[str, Any], doc: dict[str, Any],
                  where: str = "") -> list[str]:
    """Where VALUE breaks SCHEMA: the JSON Schema (2020-12) subset gpud's document uses, checked
    here so the tests need no validator package."""
    if "$ref" in schema:
        return schema_errors(value, doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]],
                             doc, where)
    if "oneOf" in schema:
        matching = [s for s in schema["oneOf"] if not schema_errors(value, s, doc, where)]
        return [] if len(matching) == 1 else [f"{where or '/'}: {len(matching)} of oneOf match"]
    if "anyOf" in schema:
        tried = [schema_errors(value, s, doc, where) for s in schema["anyOf"]]
        return [] if any(not t for t in tried) else min(tried, key=len)
    if "enum" in schema and value not in schema["enum"]:
        return [f"{where or '/'}: {value!r} not one of {schema['enum']}"]
    types = schema.get("type")
    if types is not None:
        allowed = types if isinstance(types, list) else [types]
        kinds = {"null": value is None, "boolean": isinstance(value, bool),
                 "integer": isinstance(value, int) and not isinstance(value, bool),
                 "number": isinstance(value, int | float) and not isinstance(value, bool),
                 "string": isinstance(value, str), "array": isinstance(value, list),
                 "object": isinstance(value, dict)}
        if not any(kinds[t] for t in allowed):
            return [f"{where or '/'}: {type(value).__name__} is not {types}"]
    errors: list[str] = []
    if isinstance(value, dict):
        props = schema.get("properties", {})
        errors += [f"{where}/{k}: required" for k in schema.get("required", []) if k not in value]
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in props:
                errors += schema_errors(item, props[key], doc, f"{where}/{key}")
            elif extra is False:
                errors.append(f"{where}/{key}: not allowed")
            elif isinstance(extra, dict):
                errors += schema_errors(item, extra, doc, f"{where}/{key}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += schema_errors(item, schema["items"], doc, f"{where}/{i}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{where or '/'}: {value} < {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{where or '/'}: {value} > {schema['maximum']}")
    if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
        errors.append(f"{where or '/'}: {value!r} does not match {schema['pattern']}")
    return errors


def answer_schema(doc: dict[str, Any], method: str, template: str, status: int) -> dict[str, Any]:
    """The JSON schema ``doc`` declares for ``method template`` answering ``status``; raises
    AssertionError when the document does not declare that answer."""
    responses = doc["paths"][template][method.lower()]["responses"]
    assert str(status) in responses, f"{method} {template} -> {status}: not declared"
    if "content" not in responses[str(status)]:
        return {"type": "null"}  # no body (204)
    content = responses[str(status)]["content"]
    media = "application/json" if "application/json" in content else next(iter(content))
    schema: dict[str, Any] = content[media]["schema"]
    return schema


def answer_errors(doc: dict[str, Any], method: str, template: str, status: int,
                  body: Any) -> list[str]:
    """Where ``body`` breaks what ``doc`` declares for that answer ([] when it conforms)."""
    where = f"{method} {template} -> {status}"
    return [f"{where}: {e}" for e in
            schema_errors(body, answer_schema(doc, method, template, status), doc)]
