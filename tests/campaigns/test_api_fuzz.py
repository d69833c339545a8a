"""Campaign 3a: hostile input against the served OpenAPI document. Requests generated from the
document that gpud itself serves at /v1/openapi.json (valid ones, and ones broken on purpose:
wrong types, extra keys, hostile names, arbitrary JSON and bytes) go to a real gpud. Every answer:

- is never a 5xx, except a 503 `unavailable` where the document declares it (launching without
  a system bus);
- has a status the document declares for the operation;
- is JSON matching the document's schema for that status (errors: exactly the one error shape).

Afterwards gpud is alive, its ledger figures hold and its store passes integrity_check.

Two generators: a focused one written here with hypothesis from the document's schemas (always
runs), and schemathesis over the same document (runs when schemathesis is installed). Short
forms in the default run; long forms: ``python3 -m pytest -m slow tests/campaigns -k api``
(GPUD_CAMPAIGN_EXAMPLES).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

from tests.campaigns.conftest import SEED, check_ledger_figures, knob, read_store, rss_kib
from tests.campaigns.test_config_fuzz import TOMLISH
from tests.conftest import T015, GpudProcess, UnixHTTPConnection, start_gpud
from tests.schema import schema_errors

KNOWN_NAMES = ["fast", "embeddings", "reranker", "ocr", "sidecar", "nope", "0", "a_b-c"]
FUZZ_CONFIG = T015 + '\n[roles.spare]\ndevice = "1"\ncapacity_mib = 1000\nreserve_mib = 0\n'


@pytest.fixture(scope="module")
def fuzz_gpud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GpudProcess]:
    gp = start_gpud(tmp_path_factory.mktemp("fuzz"), FUZZ_CONFIG)
    yield gp
    gp.stop()


class Conformance:
    """Checks answers against the document gpud serves."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        self.seen: dict[tuple[str, str, int], int] = {}

    def check(self, method: str, template: str, status: int, ctype: str, raw: bytes) -> list[str]:
        self.seen[(method, template, status)] = self.seen.get((method, template, status), 0) + 1
        where = f"{method.upper()} {template} -> {status}"
        problems = []
        responses = self.doc["paths"][template][method]["responses"]
        if status >= 500 and not (status == 503 and "503" in responses):
            problems.append(f"{where}: server error")
        body: Any = None
        if ctype.startswith("application/json"):
            try:
                body = json.loads(raw)
            except ValueError:
                return [*problems, f"{where}: body is not JSON: {raw[:200]!r}"]
        if status >= 400:
            if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(
                    body["error"], dict) or set(body["error"]) != {"code", "message", "details"}:
                return [*problems, f"{where}: not the error shape: {raw[:300]!r}"]
            if status == 503 and body["error"]["code"] != "unavailable":
                problems.append(f"{where}: 503 with code {body['error']['code']}")
        if str(status) not in responses:
            # a hostile name that is not a path segment of the template is routed elsewhere:
            # 404 (no such route) and 405 are the router's answers, in the error shape
            if status not in (404, 405):
                problems.append(f"{where}: status not declared in the document")
            return problems
        content = responses[str(status)].get("content", {})
        if "application/json" in content:
            if not ctype.startswith("application/json"):
                return [*problems, f"{where}: content type {ctype}, declared JSON"]
            errors = schema_errors(body, content["application/json"]["schema"], self.doc)
            problems += [f"{where}: {e}" for e in errors[:3]]
        elif "text/plain" in content and not ctype.startswith("text/plain"):
            problems.append(f"{where}: content type {ctype}, declared text/plain")
        return problems


def send(sock: Path, method: str, path: str, body: bytes | None,
         headers: dict[str, str]) -> tuple[int, str, bytes]:
    conn = UnixHTTPConnection(str(sock), timeout=30)
    try:
        conn.request(method.upper(), path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type", ""), resp.read()
    finally:
        conn.close()


# ---- the focused generator: JSON Schema -> hypothesis -------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def from_schema(schema: dict[str, Any], doc: dict[str, Any], depth: int = 0) -> st.SearchStrategy[Any]:
    """Values valid against SCHEMA (the subset of JSON Schema gpud's document uses)."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return from_schema(doc["components"]["schemas"][name], doc, depth)
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    for alternatives in ("oneOf", "anyOf"):  # anyOf: pydantic's `X | None`
        if alternatives in schema:
            return st.one_of(*[from_schema(s, doc, depth + 1) for s in schema[alternatives]])
    types = schema.get("type", "object")
    if isinstance(types, list):
        return st.one_of(*[from_schema({**schema, "type": t}, doc, depth) for t in types])
    if types == "null":
        return st.none()
    if types == "boolean":
        return st.booleans()
    if types == "integer":
        low = schema.get("minimum", schema["exclusiveMinimum"] + 1 if "exclusiveMinimum" in schema
                         else None)
        return st.integers(min_value=low, max_value=schema.get("maximum"))
    if types == "number":
        return st.floats(allow_nan=False, allow_infinity=False)
    if types == "string":
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True)
        return st.text(max_size=20)
    if types == "array":
        return st.lists(from_schema(schema.get("items", {}), doc, depth + 1), max_size=3)
    props = schema.get("properties", {})
    required = schema.get("required", [])
    return st.fixed_dictionaries(
        {k: from_schema(v, doc, depth + 1) for k, v in props.items() if k in required},
        optional={k: from_schema(v, doc, depth + 1) for k, v in props.items() if k not in required})


def mutated(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Valid values, and values broken on purpose."""
    return st.one_of(
        valid, valid,
        valid.flatmap(lambda v: st.dictionaries(st.text(min_size=1, max_size=6), JSON_VALUES,
                                                min_size=1, max_size=2).map(
            lambda extra: {**extra, **v} if isinstance(v, dict) else extra)),
        valid.flatmap(lambda v: st.sampled_from(sorted(v)).flatmap(
            lambda k: JSON_VALUES.map(lambda x: {**v, k: x})) if isinstance(v, dict) and v else st.just(v)),
        JSON_VALUES,
    )


NAME_TEXT = st.one_of(st.sampled_from(KNOWN_NAMES), st.from_regex(r"[a-z0-9][a-z0-9_-]{0,62}", fullmatch=True),
                      st.text(min_size=1, max_size=80),
                      st.sampled_from(["..", "%2e%2e", "a/b", "Fast", "x" * 64, "-x", "%00", "é"]))


def _nested(depth: int, inner: str) -> str:
    return "[" * depth + inner + "]" * depth


# Bodies the parsers themselves choke on: a decimal number of more digits than Python's int()
# converts (4300), nesting deeper than json's recursion or gpud's MAX_DEPTH, the same inside a
# config's TOML, and a float that overflows to infinity.
OUT_OF_BOUNDS = st.one_of(
    st.builds(lambda n, sign, key: f'{{"{key}": {sign}{"9" * n}}}'.encode(),
              st.integers(4301, 20000), st.sampled_from(["", "-"]),
              st.sampled_from(["mib", "n", "config", "level", "window_s"])),
    st.builds(lambda d: f'{{"mib": {_nested(d, "1")}}}'.encode(), st.integers(33, 5000)),
    st.builds(lambda d: _nested(d, "").encode(), st.integers(33, 100_000)),
    st.builds(lambda d: ('{"a": ' + "[" * d).encode(), st.integers(33, 100_000)),
    st.builds(lambda n: json.dumps({"config": f"[roles.r]\ndevice = \"0\"\nreserve_mib = "
                                               f"{'9' * n}\n"}).encode(), st.integers(4301, 9000)),
    st.builds(lambda d: json.dumps({"config": f"a = {_nested(d, '1')}"}).encode(),
              st.integers(33, 3000)),
    st.just(b'{"mib": 1e999, "window_s": -1e999}'),
)


@st.composite
def requests_from(draw: st.DrawFn, doc: dict[str, Any]) -> tuple[str, str, str, bytes | None, dict[str, str]]:
    """(method, template, path with query, body, headers) for one operation of the document."""
    ops = [(p, m) for p, item in doc["paths"].items() for m in item]
    template, method = draw(st.sampled_from(ops))
    op = doc["paths"][template][method]
    path = template
    query: list[tuple[str, str]] = []
    for param in op.get("parameters", []):
        if param["in"] == "path":
            name = draw(NAME_TEXT)
            path = path.replace("{" + param["name"] + "}", quote(name, safe=""))
        elif draw(st.booleans()):
            value = draw(st.one_of(from_schema(param["schema"], doc), st.text(max_size=12),
                                   st.integers(-(2**64), 2**64), st.sampled_from(["nan", "inf", "", "1e400"])))
            query.append((param["name"], str(value)))
    if draw(st.integers(0, 9)) == 0:
        query.append((draw(st.text(min_size=1, max_size=8).filter(lambda k: k != "follow")),
                      draw(st.text(max_size=8))))
    if query:
        path += "?" + urlencode(query)
    headers = {"Content-Type": draw(st.sampled_from(["application/json"] * 4 + ["text/plain", "x/y"]))}
    body: bytes | None = None
    if method == "post":
        schema = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
        kind = draw(st.integers(0, 9))
        if kind == 0:
            body = None
        elif kind == 1:
            body = draw(st.binary(max_size=200))
        elif kind == 3:
            body = draw(OUT_OF_BOUNDS)
        elif kind == 2 and template in ("/v1/plan", "/v1/apply"):
            # hostile config text, from the config campaign's generator
            body = json.dumps({"config": draw(TOMLISH)}).encode()
        elif schema is not None:
            body = json.dumps(draw(mutated(from_schema(schema, doc)))).encode()
        else:
            body = json.dumps(draw(JSON_VALUES)).encode()
    return method, template, path, body, headers


def fuzz(gp: GpudProcess, examples: int) -> None:
    doc = gp.call("GET", "/v1/openapi.json").body
    conformance = Conformance(doc)
    rss0 = rss_kib(gp.proc.pid)
    problems: list[str] = []

    @seed(SEED)
    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))
    @given(requests_from(doc))
    def one(req: tuple[str, str, str, bytes | None, dict[str, str]]) -> None:
        method, template, path, body, headers = req
        try:
            status, ctype, raw = send(gp.socket, method, path, body, headers)
        except (OSError, http.client.HTTPException) as exc:
            problems.append(f"{method} {path}: no answer: {exc!r}")
            return
        found = conformance.check(method, template, status, ctype, raw)
        problems.extend(f"{p} (request: {method.upper()} {path} {body[:120] if body else body!r})"
                        for p in found)

    one()
    assert gp.alive(), gp.output()[-3000:]
    assert not problems, "\n".join(dict.fromkeys(problems[:20]))
    ledger = gp.call("GET", "/v1/ledger").body
    assert not check_ledger_figures(ledger)
    assert read_store(gp.state_dir).integrity == "ok"
    statuses = sorted({s for (_, _, s) in conformance.seen})
    growth = rss_kib(gp.proc.pid) - rss0
    print(f"api fuzz: {examples} requests, statuses {statuses}, "
          f"{len({(m, t) for (m, t, _) in conformance.seen})} operations, RSS +{growth} KiB")
    assert 200 in statuses and 400 in statuses, statuses
    assert growth < 64 * 1024, f"gpud's RSS grew by {growth} KiB over {examples} requests"


def test_api_fuzz_short(fuzz_gpud: GpudProcess) -> None:
    fuzz(fuzz_gpud, 300)


@pytest.mark.slow
def test_api_fuzz_long(fuzz_gpud: GpudProcess) -> None:
    fuzz(fuzz_gpud, knob("EXAMPLES", 5000))


OUT_OF_BOUNDS_EXAMPLES = {
    "huge-integer": b'{"config": "", "n": ' + b"9" * 4301 + b"}",
    "huge-negative": b'{"mib": -' + b"9" * 20000 + b"}",
    "deep-nesting": b'{"mib": ' + b"[" * 3000 + b"]" * 3000 + b"}",
    "deeper-than-max-depth": b'{"mib": ' + b"[" * 40 + b"]" * 40 + b"}",
    "deep-unclosed": b"[" * 200_000,
    "infinite-float": b'{"mib": 1e999}',
    "toml-huge-integer": json.dumps({"config": FUZZ_CONFIG.replace(
        "vram_mib = 5120", "vram_mib = " + "9" * 5000)}).encode(),
    "toml-deep": json.dumps({"config": "a = " + "[" * 2000 + "]" * 2000}).encode(),
}


@pytest.mark.parametrize("name", list(OUT_OF_BOUNDS_EXAMPLES))
def test_out_of_bounds_bodies_on_every_post_route(fuzz_gpud: GpudProcess, name: str) -> None:
    """The issue's report: a huge integer made every POST route answer 500. Each route of the
    document answers such a body 4xx in the error shape (a 400 names the offending value)."""
    doc = fuzz_gpud.call("GET", "/v1/openapi.json").body
    conformance = Conformance(doc)
    problems = []
    for template, item in doc["paths"].items():
        if "post" not in item:
            continue
        path = template.replace("{name}", "ocr")
        status, ctype, raw = send(fuzz_gpud.socket, "post", path, OUT_OF_BOUNDS_EXAMPLES[name],
                                  {"Content-Type": "application/json"})
        problems += conformance.check("post", template, status, ctype, raw)
        if not 400 <= status < 500:
            problems.append(f"POST {path}: {status} {raw[:200]!r}")
        elif status == 400 and b"path" not in raw \
                and b"problems" not in raw:
            problems.append(f"POST {path}: 400 without the offending path: {raw[:200]!r}")
    assert fuzz_gpud.alive()
    assert not problems, "\n".join(problems)


SLOW_DEADLINE_S = 1.0


def _slow_request(sock: Path, head: bytes, body: bytes, results: dict[str, bytes],
                  key: str) -> None:
    """HEAD at once, then BODY a byte every tenth of the deadline; what gpud answered (b"":
    it closed the connection) into results[key]."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10 * SLOW_DEADLINE_S)
    answer = b""
    try:
        s.connect(str(sock))
        s.sendall(head)
        until = time.monotonic() + 4 * SLOW_DEADLINE_S
        for byte in body:
            if time.monotonic() > until:
                break
            try:
                s.send(bytes([byte]))
            except OSError:
                break
            time.sleep(SLOW_DEADLINE_S / 10)
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(65536):
                answer += chunk
    except TimeoutError:
        answer = b"(kept open past the deadline)"
    finally:
        s.close()
    results[key] = answer


def test_slow_bodies_and_headers_on_every_route(tmp_path: Path) -> None:
    """A body or headers sent a byte at a time, to every route of the document: each is cut at
    daemon.request_read_timeout_s, a body with a 408 in the error shape (or the connection
    closed), never a 5xx, never kept open. All at once, as one peer (root) could."""
    gp = start_gpud(tmp_path, FUZZ_CONFIG.replace(
        "[daemon]", f"[daemon]\nrequest_read_timeout_s = {SLOW_DEADLINE_S}"))
    try:
        doc = gp.call("GET", "/v1/openapi.json").body
        conformance = Conformance(doc)
        results: dict[str, bytes] = {}
        threads = []
        body = json.dumps({"config": FUZZ_CONFIG}).encode()
        for template, item in doc["paths"].items():
            path = template.replace("{name}", "ocr").encode()
            for method in item:
                head = (method.upper().encode() + b" " + path + b" HTTP/1.1\r\nHost: x\r\n"
                        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                        % len(body))
                threads.append(threading.Thread(target=_slow_request, args=(
                    gp.socket, head, body, results, f"{method} {template} body")))
            threads.append(threading.Thread(target=_slow_request, args=(
                gp.socket, b"", b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 200,
                results, f"get {template} headers")))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        problems = []
        for key, answer in sorted(results.items()):
            method, template, _what = key.split(" ")
            if answer == b"":
                continue  # closed at the deadline
            if not answer.startswith(b"HTTP/1.1 "):
                problems.append(f"{key}: {answer[:100]!r}")
                continue
            head, _, raw = answer.partition(b"\r\n\r\n")
            status = int(head.split(b" ")[1])
            ctype = next((line.split(b":", 1)[1].strip().decode() for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-type")), "")
            problems += conformance.check(method, template, status, ctype, raw)
            # 429: plan, apply and reload take the peer's slot before reading the body, and
            # these dribblers hold three of them at once
            # a read answers from its query alone, at once: 200, or 400 where the query lacks
            # what the route needs (GET /v1/route without ?model=)
            if status not in (408, 429) and not (method == "get" and status in (200, 400)):
                problems.append(f"{key}: {status} {raw[:200]!r}")
        assert gp.alive()
        assert gp.call("GET", "/v1/status").status == 200
        assert not problems, "\n".join(problems)
        assert any(a.startswith(b"HTTP/1.1 408") for a in results.values())
    finally:
        gp.stop()


def test_conformance_checker_catches_a_bad_answer(tmp_path: Path) -> None:
    """The checker is not vacuous: answers that break the document are reported. (Its own gpud:
    the fuzzers may apply or reload a generated config on the shared one.)"""
    fuzz_gpud = start_gpud(tmp_path, FUZZ_CONFIG)
    try:
        _check_the_checker(fuzz_gpud)
    finally:
        fuzz_gpud.stop()


def _check_the_checker(fuzz_gpud: GpudProcess) -> None:
    c = Conformance(fuzz_gpud.call("GET", "/v1/openapi.json").body)
    assert c.check("get", "/v1/ledger", 500, "application/json",
                   b'{"error": {"code": "internal", "message": "x", "details": {}}}')
    assert c.check("get", "/v1/ledger", 200, "application/json", b'{"roles": 5}')
    assert c.check("post", "/v1/serves/{name}/admit", 409, "application/json", b'{"error": "x"}')
    assert c.check("get", "/v1/serves/{name}", 200, "application/json", b'{"name": "x"}')
    assert not c.check("get", "/v1/ledger", 200, "application/json",
                       json.dumps(fuzz_gpud.call("GET", "/v1/ledger").body).encode())
    serve = fuzz_gpud.call("GET", "/v1/serves/ocr").body
    assert not c.check("get", "/v1/serves/{name}", 200, "application/json", json.dumps(serve).encode())
    for broken in ({**serve, "state": "bogus"}, {**serve, "vram_mib": "5120"},
                   {k: v for k, v in serve.items() if k != "port"}):
        assert c.check("get", "/v1/serves/{name}", 200, "application/json", json.dumps(broken).encode())


# ---- schemathesis over the same document ---------------------------------------------------------


def schemathesis_operation(gp: GpudProcess, conformance: Conformance, op: Any, template: str,
                           method: str, mode: Any, examples: int, problems: list[str]) -> int:
    """Send EXAMPLES schemathesis cases of one operation in one generation mode; returns how
    many were answered."""
    sent = 0

    @seed(SEED)
    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))
    @given(op.as_strategy(generation_mode=mode))
    def one(case: Any) -> None:
        nonlocal sent
        path = case.formatted_path
        if case.query:
            path += "?" + urlencode({k: v if isinstance(v, str) else json.dumps(v)
                                     for k, v in case.query.items()})
        body = None
        if isinstance(case.body, bytes | bytearray):
            body = bytes(case.body)
        elif type(case.body).__name__ != "NotSet":
            body = json.dumps(case.body, default=str).encode()
        headers = {k: str(v) for k, v in (case.headers or {}).items()
                   if re.fullmatch(r"[!-9;-~]+", k) and "\n" not in str(v)}
        headers.setdefault("Content-Type", case.media_type or "application/json")
        try:
            status, ctype, raw = send(gp.socket, method, quote(path, safe="/?=&%"), body, headers)
        except (OSError, http.client.HTTPException) as exc:
            problems.append(f"{method} {path}: no answer: {exc!r}")
            return
        sent += 1
        found = conformance.check(method, template, status, ctype, raw)
        problems.extend(f"{p} ({mode.value}: {method.upper()} {path} {body!r:.150})" for p in found)

    with contextlib.suppress(Unsatisfiable):  # nothing to break in an operation without inputs
        one()
    return sent


def schemathesis_fuzz(gp: GpudProcess, examples_per_operation: int) -> None:
    import schemathesis  # a declared test dependency: missing is a failure, not a skip
    from schemathesis import GenerationMode

    doc = gp.call("GET", "/v1/openapi.json").body
    conformance = Conformance(doc)
    schema = schemathesis.openapi.from_dict(doc)
    problems: list[str] = []
    per_operation: dict[str, int] = {}
    for template, item in doc["paths"].items():
        for method, spec in item.items():
            if template == "/v1/events":
                continue  # covered by the focused generator (schemathesis could add follow=1)
            has_inputs = "parameters" in spec or "requestBody" in spec
            key = f"{method.upper()} {template}"
            for mode in GenerationMode if has_inputs else [GenerationMode.POSITIVE]:
                per_operation[key] = per_operation.get(key, 0) + schemathesis_operation(
                    gp, conformance, schema[template][method.upper()], template, method, mode,
                    examples_per_operation, problems)
    sent = sum(per_operation.values())
    assert gp.alive(), gp.output()[-3000:]
    # Nothing passes by not running: every operation was exercised.
    idle = sorted(k for k, n in per_operation.items() if n == 0)
    assert not idle, f"no request answered for: {idle}"
    assert not problems, "\n".join(dict.fromkeys(problems[:20]))
    assert not check_ledger_figures(gp.call("GET", "/v1/ledger").body)
    assert read_store(gp.state_dir).integrity == "ok"
    print(f"schemathesis: {sent} requests over {len(doc['paths'])} paths, "
          f"statuses {sorted({s for (_, _, s) in conformance.seen})}")


def test_schemathesis_short(fuzz_gpud: GpudProcess) -> None:
    schemathesis_fuzz(fuzz_gpud, 8)


@pytest.mark.slow
def test_schemathesis_long(fuzz_gpud: GpudProcess) -> None:
    schemathesis_fuzz(fuzz_gpud, max(1, knob("EXAMPLES", 5000) // 20))


def test_undocumented_methods_and_routes(fuzz_gpud: GpudProcess) -> None:
    """Methods and paths the document does not have: 404 / 405 in the error shape, never 5xx."""
    doc = fuzz_gpud.call("GET", "/v1/openapi.json").body
    problems = []
    paths = [p.replace("{name}", "ocr") for p in doc["paths"]]
    paths += ["/", "/v1", "/v2/ledger", "/v1/serves/ocr/admit/x", "/v1/%00", "/v1/../etc/passwd",
              "/v1/serves//admit", "/metrics/x", "/" + "a" * 5000]
    for path in paths:
        for method in ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"):
            documented = path in doc["paths"] or any(
                p.replace("{name}", "ocr") == path and method.lower() in item
                for p, item in doc["paths"].items())
            if documented and method.lower() in doc["paths"].get(path, {method.lower(): 1}):
                continue
            status, ctype, raw = send(fuzz_gpud.socket, method, path, None, {})
            if status >= 500 or (status < 400 and method != "HEAD"):
                problems.append(f"{method} {path[:60]}: {status}")
            elif method != "HEAD" and status != 200:
                body = json.loads(raw) if ctype.startswith("application/json") else None
                if not isinstance(body, dict) or set(body.get("error", {})) != {
                        "code", "message", "details"}:
                    problems.append(f"{method} {path[:60]}: {status} not in the error shape: {raw[:100]!r}")
    assert fuzz_gpud.alive()
    assert not problems, "\n".join(problems[:20])


MALFORMED = {
    "bad-method": b"FOO /v1/status HTTP/1.1\r\nHost: x\r\n\r\n",
    "bad-version": b"GET /v1/status HTTP/9.9\r\nHost: x\r\n\r\n",
    "binary-request-line": b"\x00\x01\x02\r\n\r\n",
    "header-over-8k": b"GET /v1/status HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 9000 + b"\r\n\r\n",
    "header-without-colon": b"GET /v1/status HTTP/1.1\r\nHost: x\r\nNo colon here\r\n\r\n",
    "bad-chunk-size": (b"POST /v1/serves/ocr/admit HTTP/1.1\r\nHost: x\r\n"
                       b"Transfer-Encoding: chunked\r\n\r\nZZ\r\n"),
    "length-and-chunked": (b"POST /v1/serves/ocr/admit HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                           b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
    "negative-length": b"POST /v1/serves/ocr/admit HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    "url-over-8k": b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    "200-headers": (b"GET /v1/status HTTP/1.1\r\nHost: x\r\n"
                    + b"".join(b"X-%d: y\r\n" % i for i in range(200)) + b"\r\n"),
}


def raw_exchange(sock: Path, raw: bytes) -> tuple[int, bytes, bytes]:
    """(status, head, body) of the answer to RAW bytes."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    try:
        s.connect(str(sock))
        s.sendall(raw)
        data = b""
        while b"\r\n\r\n" not in data or len(data) < 20:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    finally:
        s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1]) if head.startswith(b"HTTP/") else 0
    return status, head, body


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_http_refused_safely(fuzz_gpud: GpudProcess, name: str) -> None:
    status, _, _ = raw_exchange(fuzz_gpud.socket, MALFORMED[name])
    assert 400 <= status < 500, status
    assert fuzz_gpud.call("GET", "/v1/status").status == 200


def test_malformed_http_answers_in_the_error_shape(fuzz_gpud: GpudProcess) -> None:
    problems = []
    for name, raw in MALFORMED.items():
        status, _head, body = raw_exchange(fuzz_gpud.socket, raw)
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict) or set(parsed.get("error", {})) != {"code", "message", "details"}:
            problems.append(f"{name}: {status} {body[:60]!r}")
    assert not problems, "\n".join(problems)
