"""Per-key limits in the data path (docs/router.md, "Who is asking"): max_concurrent and
requests_per_minute enforced by nginx's own limit_conn / limit_req in the location the router
sends a request to, past them 429 in OpenAI's shape with Retry-After; the real nginx and njs
before two stand-ins (tests/test_router.py's rig)."""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpud.config import parse_config
from gpud.core.keys import KEY_SECRETS, KEY_SHARES, ApiKey, parse_keys
from gpud.core.quota import Budget, Over, over_budget
from gpud.core.router import FORWARDED_REQUESTER_RE, ROUTED_PATHS, RoutedServe, RouterFront, router_request
from gpud.core.routerconf import http_lines
from gpud.core.routerlog import Answered, parse_log_line
from gpud.core.usage import Counts, UsageKey, add, one
from gpud.nginx.router import KeyShares, script_text
from tests.test_router import (  # noqa: F401 (fed: a fixture)
    RIG_TOKEN,
    TOML,
    Fed,
    Rig,
    _events,
    _req,
    _stream,
    fed,
    router_rig,
)
from tests.waiting import wait_until

KEYS = f"""\
[keys.alice]
token = "sk-alice-0123456789"
models = ["a"]
max_concurrent = 1
priority = -1
[keys.bob]
token = "sk-bob-01234567890"
models = ["*"]
requests_per_minute = 2
weight = 2.5
[keys.probe]
token = "{RIG_TOKEN}"
models = ["*"]
"""


def test_limits_and_shares_are_parsed_and_checked() -> None:
    keys, problems = parse_keys(KEYS, ["a", "a-fast", "b"])
    assert problems == []
    by = {k.name: k for k in keys}
    assert (by["alice"].max_concurrent, by["alice"].requests_per_minute, by["alice"].priority,
            by["alice"].weight) == (1, None, -1, 1.0)
    assert (by["bob"].requests_per_minute, by["bob"].weight) == (2, 2.5)
    assert (by["probe"].max_concurrent, by["probe"].priority) == (None, 0)
    bad = KEYS.replace("max_concurrent = 1", "max_concurrent = 0").replace(
        "weight = 2.5", 'weight = "x"').replace("priority = -1", "priority = 1.5")
    _, problems = parse_keys(bad, ["a", "a-fast", "b"])
    assert problems == [
        "keys.alice.max_concurrent: an integer from 1 to 65535 (got 0)",
        "keys.alice.priority: an integer from -1000 to 1000 (got 1.5)",
        "keys.bob.weight: a number from 0.01 to 1000 (got 'x')"]
    _, problems = parse_keys(KEYS.replace("priority = -1", "budget = 5"), ["a", "b"])
    allowed = ", ".join((*KEY_SECRETS, "models", *KEY_SHARES, "peer"))
    assert problems == [f"keys.alice.budget: unknown key (a key's table has {allowed})"]
    # a mistyped key is named with the key it was meant to be
    _, problems = parse_keys(KEYS.replace("max_concurrent = 1", "mx_concurrent = 1"),
                             ["a", "a-fast", "b"])
    assert problems == [f"keys.alice.mx_concurrent: unknown key; did you mean 'max_concurrent'? "
                        f"(a key's table has {allowed})"]


def test_without_limits_nginx_counts_nothing() -> None:
    keys, _ = parse_keys(KEYS.replace("max_concurrent = 1\n", "").replace(
        "requests_per_minute = 2\n", ""), ["a"])
    text = "\n".join(http_lines(RouterFront("127.0.0.1:8000", (RoutedServe("a", ("a",), port=1),),
                                            keys=tuple(keys), large_bodies_per_requester=0)))
    assert "limit_conn" not in text and "limit_req" not in text
    # the requesters' large bodies alone (router.large_bodies_per_requester, on by default)
    text = "\n".join(http_lines(RouterFront("127.0.0.1:8000", (RoutedServe("a", ("a",), port=1),),
                                            keys=tuple(keys))))
    assert "limit_req" not in text and [line.strip() for line in text.splitlines()
                                         if "limit_conn " in line] == [
        "limit_conn router_bodies 16;"] * len(ROUTED_PATHS)  # each routed path


def test_the_limits_are_in_every_location_a_request_is_sent_to() -> None:
    keys, _ = parse_keys(KEYS, ["a", "b"])
    text = "\n".join(http_lines(RouterFront(
        "127.0.0.1:8000", (RoutedServe("a", ("a",), port=1),
                           RoutedServe("b", ("b",), port=2, ensure_timeout_s=30)),
        keys=tuple(keys))))
    # one zone per limited key, keyed by a variable that is empty for every other key's
    # request: of the js_set $router_key_name, known before the body is read
    assert 'map $router_key_name $router_limit_0 {\n        "alice" "alice";\n' \
        '        default "";' in text
    assert "limit_conn_zone $router_limit_0 zone=router_conn_0:1m;" in text
    assert "limit_req_zone $router_limit_1 zone=router_rpm_1:1m rate=2r/m;" in text
    assert "router_limit_2" not in text  # probe: no limits
    # the counts in the routed locations (before the body; nginx counts a request in the first
    # location that counts it, so nowhere else), the rates where the request is sent, before
    # gpud is asked (auth_request)
    for path in ROUTED_PATHS:
        block = text.split(f"location = {path} {{", 1)[1].split("js_content", 1)[0]
        assert "limit_conn router_conn_0 1;" in block and \
            "limit_conn router_bodies 16;" in block, block
    for location in ("location @router_a {", "location @router_b {",
                     "location @router_loading {"):
        block = text.split(location, 1)[1].split("}", 1)[0]
        assert "limit_conn" not in block, block
        assert "limit_req zone=router_rpm_1 burst=1 nodelay;" in block, block
    assert "error_page 429 = @router_limited;" in text.split("location @router_b {")[1]


def test_the_largest_limits_are_valid_for_nginx(tmp_path: Path) -> None:
    """Each limit at the top of its range (nginx refuses a limit_conn of 65536: the whole
    front's config would go with it)."""
    from gpud.core.front import FrontConfig, render
    from gpud.core.routerconf import main_lines
    from gpud.nginx.router import script_text
    from tests.test_router import NGINX, NJS

    top = KEYS.replace("max_concurrent = 1", "max_concurrent = "
                       f"{int(KEY_SHARES['max_concurrent'][1])}").replace(
        "requests_per_minute = 2",
        f"requests_per_minute = {int(KEY_SHARES['requests_per_minute'][1])}")
    keys, problems = parse_keys(top, ["a"])
    assert problems == [] and keys[0].max_concurrent == 65535
    run = tmp_path / "run"
    run.mkdir()
    router = RouterFront("127.0.0.1:8000", (RoutedServe("a", ("a",), port=1,
                                                        ensure_timeout_s=9),),
                         njs_module=str(NJS), script=str(tmp_path / "router.js"),
                         keys=tuple(keys))
    (tmp_path / "router.js").write_text(script_text(router))
    conf = tmp_path / "nginx.conf"
    conf.write_text(render(FrontConfig(serves=(), run_dir=str(run),
                                       main_extra=tuple(main_lines(router)),
                                       http_extra=tuple(http_lines(router)))))
    result = subprocess.run([str(NGINX), "-t", "-c", str(conf), "-p", f"{run}/"],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


@pytest.fixture
def limited() -> Iterator[Rig]:
    keys, problems = parse_keys(KEYS, ["a", "a-fast", "b", "org/b-model"])
    assert problems == []
    with router_rig(tuple(keys)) as rig:
        yield rig


def _ask(port: int, token: str, model: str = "a", max_tokens: int = 1, stream: bool = False
         ) -> tuple[int, dict[str, str], bytes]:
    body = json.dumps({"model": model, "prompt": "x y z w v u t s", "max_tokens": max_tokens,
                       "stream": stream}).encode()
    return _req(port, "POST", "/v1/completions", body,
                {"Authorization": f"Bearer {token}", "Content-Type": "application/json"})


def _limit_error(status: int, headers: dict[str, str], body: bytes) -> dict[str, object]:
    assert status == 429, (status, body)
    err = json.loads(body)["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests", err
    assert set(err) >= {"message", "type", "param", "code"}
    assert int(headers["Retry-After"]) == err["gpud"]["retry_after_s"], (headers, err)
    return dict(err["gpud"])


def test_max_concurrent_answers_429_while_the_keys_request_is_in_flight(limited: Rig) -> None:
    port = limited.port
    first: list[int] = []
    # the stand-in streams a token each 0.3 s: 8 tokens hold the request about 2.4 s
    slow = threading.Thread(target=lambda: first.append(_ask(port, "sk-alice-0123456789",
                                                             max_tokens=8, stream=True)[0]))
    slow.start()
    try:
        time.sleep(0.8)
        status, headers, body = _ask(port, "sk-alice-0123456789")
        said = _limit_error(status, headers, body)
        assert said == {"key": "alice", "limit": "max_concurrent", "value": 1,
                        "retry_after_s": 1}, said
        assert "1 requests in flight, its max_concurrent" in json.loads(body)["error"]["message"]
        # another key is not held by alice's limit
        assert _ask(port, RIG_TOKEN)[0] == 200
    finally:
        slow.join(timeout=30)
    assert first == [200]
    assert _ask(port, "sk-alice-0123456789")[0] == 200  # its request ended: room again


def test_requests_per_minute_answers_429_with_the_wait(limited: Rig) -> None:
    port = limited.port
    # a minute's worth at once (2), then one each 30 s
    assert [_ask(port, "sk-bob-01234567890", "b")[0] for _ in range(2)] == [200, 200]
    said = _limit_error(*_ask(port, "sk-bob-01234567890", "b"))
    assert said == {"key": "bob", "limit": "requests_per_minute", "value": 2,
                    "retry_after_s": 30}, said
    # per key, across models: its next request for a is refused too, the probe's is not
    assert _ask(port, "sk-bob-01234567890", "a")[0] == 429
    assert [_ask(port, RIG_TOKEN, "b")[0] for _ in range(5)] == [200] * 5


def test_keys_shares_reach_the_api_key() -> None:
    keys, _ = parse_keys(KEYS, ["a"])
    assert isinstance(keys[0], ApiKey) and keys[0].priority == -1


def test_gpud_reads_each_keys_priority_and_weight_once_per_change(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS.replace('models = ["a"]', 'models = ["chat"]'))
    keys.chmod(0o600)
    cfg = parse_config(TOML.replace('listen = "127.0.0.1:8000"\n',
                                    f'listen = "127.0.0.1:8000"\napi_keys_file = "{keys}"\n'),
                       "t")
    shares = KeyShares(lambda: cfg)
    assert shares("alice") == (-1, 1.0) and shares("bob") == (0, 2.5)
    # a requester that is no key (an address): the defaults
    assert shares("addr:127.0.0.1") == (0, 1.0)
    keys.write_text(KEYS.replace('models = ["a"]', 'models = ["chat"]').replace(
        "priority = -1", "priority = -7  # changed"))
    assert shares("alice") == (-7, 1.0)
    # a file broken now: the last good shares are kept
    keys.write_text("not toml [")
    assert shares("alice") == (-7, 1.0)


def test_anthropics_x_api_key_is_the_key_on_its_routes(metered: Rig) -> None:
    doc = json.dumps({"model": "a", "max_tokens": 2,
                      "messages": [{"role": "user", "content": "hi"}]}).encode()
    json_type = {"Content-Type": "application/json"}
    before = len(_logged(metered, 0))
    # Anthropic's SDK default: x-api-key, no Authorization
    status, _h, body = _req(metered.port, "POST", "/v1/messages", doc,
                            {"x-api-key": RIG_TOKEN, **json_type})
    assert status == 200, body
    assert json.loads(body)["type"] == "message"
    status, _h, body = _req(metered.port, "POST", "/v1/messages/count_tokens", doc,
                            {"X-Api-Key": RIG_TOKEN, **json_type})
    assert status == 200, body
    status, _h, body = _req(metered.port, "POST", "/v1/messages", doc,
                            {"x-api-key": "sk-not-a-key-0000000", **json_type})
    assert status == 401 and json.loads(body)["error"]["message"] == (
        "Incorrect API key provided"), body
    status, _h, body = _req(metered.port, "POST", "/v1/messages", doc, json_type)
    assert status == 401 and "x-api-key: KEY" in json.loads(body)["error"]["message"], body
    # OpenAI's routes take Authorization only
    chat = json.dumps({"model": "a", "max_tokens": 2,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    status, _h, body = _req(metered.port, "POST", "/v1/chat/completions", chat,
                            {"x-api-key": RIG_TOKEN, **json_type})
    assert status == 401 and json.loads(body)["error"]["message"] == (
        "No API key provided (Authorization: Bearer KEY)"), body
    # counted under its key, as any other request
    logged = _logged(metered, before + 2)[before:]  # (the 401s name no model)
    assert [(a.key, a.status) for a in logged] == [("probe", 200), ("probe", 200)]


# --- usage: the serve's own usage object, as the router saw it pass ---------------------------

@pytest.fixture
def metered() -> Iterator[Rig]:
    keys, problems = parse_keys(KEYS, ["a", "a-fast", "b", "org/b-model"])
    assert problems == []
    with router_rig(tuple(keys), access_log=True) as rig:
        yield rig


def _logged(rig: Rig, n: int) -> list[Answered]:
    path = Path(rig.script).parent / "access.log"
    table = {"a": "a", "a-fast": "a", "b": "b", "org/b-model": "b"}

    def lines() -> list[Answered]:
        text = path.read_text() if path.exists() else ""
        got = [parse_log_line(line, table) for line in text.splitlines()]
        return [a for a in got if a is not None and a.model]
    wait_until(lambda: len(lines()) >= n, what=f"{n} lines in the router's access log")
    return lines()


def _post(rig: Rig, token: str, doc: dict[str, object]) -> tuple[int, bytes]:
    status, _h, body = _req(rig.port, "POST", "/v1/chat/completions", json.dumps(doc).encode(),
                            {"Authorization": f"Bearer {token}",
                             "Content-Type": "application/json"})
    return status, body


def test_usage_is_the_serves_own_and_a_stream_without_it_is_unmetered(metered: Rig) -> None:
    messages = [{"role": "user", "content": 'say "prompt_tokens": 999 please'}]
    before = len(_logged(metered, 0))  # the rig's readiness probes
    # a non-streamed answer: its usage object
    status, body = _post(metered, RIG_TOKEN, {"model": "b", "messages": messages,
                                              "max_tokens": 3})
    assert status == 200
    usage = json.loads(body)["usage"]
    # a stream that asked for usage: its last chunk's; one that did not: none
    status, streamed = _post(metered, RIG_TOKEN, {
        "model": "a", "messages": messages, "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True}})
    assert status == 200 and b'"usage": {' in streamed, streamed
    last = [json.loads(line[6:]) for line in streamed.decode().splitlines()
            if line.startswith("data: {")][-1]["usage"]
    status, _ = _post(metered, "sk-bob-01234567890", {"model": "a", "messages": messages,
                                                      "max_tokens": 2, "stream": True})
    assert status == 200
    one, two, three = _logged(metered, before + 3)[before:]
    assert (one.key, one.model, one.status) == ("probe", "b", 200)
    assert (one.prompt_tokens, one.completion_tokens) == (usage["prompt_tokens"],
                                                          usage["completion_tokens"])
    # the prompt's own text ('"prompt_tokens": 999', escaped inside a JSON string) is not it
    assert one.prompt_tokens != 999 and two.prompt_tokens != 999
    assert (two.key, two.prompt_tokens, two.completion_tokens) == (
        "probe", last["prompt_tokens"], last["completion_tokens"])
    assert (three.key, three.prompt_tokens, three.completion_tokens) == ("bob", None, None)
    assert one.ts is not None and abs(one.ts - time.time()) < 60


def _post_route(rig: Rig, route: str, doc: dict[str, object]) -> tuple[int, bytes]:
    status, _h, body = _req(rig.port, "POST", route, json.dumps(doc).encode(),
                            {"Authorization": f"Bearer {RIG_TOKEN}",
                             "Content-Type": "application/json"})
    return status, body


def _data(streamed: bytes) -> list[dict[str, object]]:
    return [json.loads(line[6:]) for line in streamed.decode().splitlines()
            if line.startswith("data: {")]


# a tool whose schema holds usage-shaped keys: /v1/responses echoes it in its answer (its
# `tools`, and the response in response.created / response.completed of a stream)
SCHEMA_TOOL = {"type": "function", "name": "f", "parameters": {
    "type": "object", "properties": {"usage": {"prompt_tokens": 999999999999,
                                               "input_tokens": 999999999999,
                                               "output_tokens": 999999999999}},
    "prompt_tokens": 999999999999, "input_tokens": 999999999999,
    "completion_tokens": 999999999999, "output_tokens": 999999999999}}


def test_usage_is_the_answers_top_level_usage_by_each_routes_names(metered: Rig) -> None:
    before = len(_logged(metered, 0))
    sent: list[tuple[int, int]] = []
    # /v1/responses, single and streamed: input_tokens/output_tokens of the top-level usage
    # (a stream's response.completed), never the tool schema's counts the answer echoes
    for stream in (False, True):
        status, body = _post_route(metered, "/v1/responses", {
            "model": "b", "input": "hi there", "max_output_tokens": 3, "stream": stream,
            "tools": [SCHEMA_TOOL], "metadata": {"prompt_tokens": "999999999999"}})
        assert status == 200, body
        assert b"999999999999" in body  # the echo is there, and not taken
        doc = _data(body)[-1]["response"] if stream else json.loads(body)
        usage = doc["usage"]  # type: ignore[index]
        sent.append((usage["input_tokens"], usage["output_tokens"]))
    # /v1/messages, single and streamed: message_start's input, message_delta's output
    for stream in (False, True):
        status, body = _post_route(metered, "/v1/messages", {
            "model": "a", "max_tokens": 4, "stream": stream,
            "messages": [{"role": "user", "content": '"input_tokens": 999999999999'}]})
        assert status == 200, body
        if stream:
            events = _data(body)
            start = events[0]["message"]["usage"]  # type: ignore[index]
            delta = next(e for e in events if e["type"] == "message_delta")["usage"]
            sent.append((start["input_tokens"], delta["output_tokens"]))  # type: ignore[index]
        else:
            usage = json.loads(body)["usage"]
            sent.append((usage["input_tokens"], usage["output_tokens"]))
    # embeddings-like answers aside, a completions stream with continuous usage: the last
    status, body = _post_route(metered, "/v1/completions", {
        "model": "a", "prompt": "x y", "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert status == 200
    usage = _data(body)[-1]["usage"]
    sent.append((usage["prompt_tokens"], usage["completion_tokens"]))  # type: ignore[index]
    got = _logged(metered, before + len(sent))[before:]
    assert [(a.prompt_tokens, a.completion_tokens) for a in got] == sent
    assert all(0 < p < 1000 and 0 < c < 1000 for p, c in sent)
    assert not any(a.hung_up for a in got)


def test_a_single_answer_held_whole_is_read_to_its_top_level_usage(metered: Rig) -> None:
    # an answer the meter holds whole (under 256 KiB), whose last "usage" key is a client's
    # object echoed after the answer's own (the stand-in echoes `user` last): the answer's own
    # is taken, not the client's
    before = len(_logged(metered, 0))
    status, body = _post_route(metered, "/v1/responses", {
        "model": "b", "input": "hi", "max_output_tokens": 2, "tools": [SCHEMA_TOOL],
        "user": {"usage": {"input_tokens": 999999999999, "output_tokens": 999999999999}}})
    assert status == 200, body[:300]
    assert len(body) < 256 * 1024 and body.rindex(b'"usage"') > body.index(b'"user"')
    usage = json.loads(body)["usage"]
    (got,) = _logged(metered, before + 1)[before:]
    assert (got.prompt_tokens, got.completion_tokens) == (usage["input_tokens"],
                                                          usage["output_tokens"])


def test_a_large_single_answer_is_walked_to_its_top_level_usage(metered: Rig) -> None:
    # an answer past what the meter holds whole (256 KiB): walked by its brackets as it
    # passes, through escapes, non-ASCII text and the echoed schema's usage-shaped keys
    before = len(_logged(metered, 0))
    text = ' "usage": {"input_tokens": 999999999999} \\ é 😀 {[' * 6000
    status, body = _post_route(metered, "/v1/responses", {
        "model": "b", "input": "hi", "instructions": text, "max_output_tokens": 2,
        "tools": [SCHEMA_TOOL], "metadata": {"usage": {"input_tokens": 999999999999}},
        # echoed after the answer's own usage by the stand-in (vLLM takes a string here)
        "user": {"usage": {"input_tokens": 999999999999, "output_tokens": 999999999999}}})
    assert status == 200, body[:300]
    assert len(body) > 300_000
    usage = json.loads(body)["usage"]
    (got,) = _logged(metered, before + 1)[before:]
    assert (got.prompt_tokens, got.completion_tokens) == (usage["input_tokens"],
                                                          usage["output_tokens"])


def test_a_stream_that_waited_with_loading_feedback_is_metered(fed: Fed) -> None:  # noqa: F811
    """The serve's answer to a stream that waited for a bring-up comes through the script's
    include (router.streamed): its usage is read there, for the main request's log line."""
    fed.gpud.delay_s = 1.5
    fed.log.write_text("")
    status, _h, lines = _stream(fed.port, {"model": "a", "prompt": "x y", "max_tokens": 3,
                                           "stream_options": {"include_usage": True}})
    events = _events(lines)
    assert status == 200 and events[0] == ": loading a", lines
    usage = [json.loads(e[6:]) for e in events if e.startswith("data: {")][-1]["usage"]

    def logged() -> list[Answered]:
        got = [parse_log_line(line, {"a": "a"}) for line in fed.log.read_text().splitlines()]
        return [a for a in got if a is not None and a.model == "a"]
    wait_until(lambda: len(logged()) == 1, what="the stream's line")
    (line,) = logged()
    assert (line.prompt_tokens, line.completion_tokens, line.hung_up) == (
        usage["prompt_tokens"], usage["completion_tokens"], False)


def test_a_stream_that_waited_and_did_not_ask_is_metered_and_sent_without_usage(
        fed: Fed) -> None:  # noqa: F811
    """The same, for a stream whose client did not ask for usage: the router asked the serve
    (a vLLM serve: stream_usage), meters the usage chunk in the include and takes it out."""
    fed.gpud.delay_s = 1.5
    fed.log.write_text("")
    status, _h, lines = _stream(fed.port, {"model": "a", "prompt": "x y", "max_tokens": 3})
    events = _events(lines)
    assert status == 200 and events[0] == ": loading a", lines
    chunks = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
    assert len(chunks) == 3 and all(c["choices"] and "usage" not in c for c in chunks), events
    assert events[-1] == "data: [DONE]", events

    def logged() -> list[Answered]:
        got = [parse_log_line(line, {"a": "a"}) for line in fed.log.read_text().splitlines()]
        return [a for a in got if a is not None and a.model == "a"]
    wait_until(lambda: len(logged()) == 1, what="the stream's line")
    (line,) = logged()
    assert (line.completion_tokens, line.hung_up) == (3, False), line
    assert line.prompt_tokens is not None and line.prompt_tokens > 0, line


def test_a_stream_the_client_hung_up_on_is_counted_as_such(metered: Rig) -> None:
    before = len(_logged(metered, 0))
    conn = http.client.HTTPConnection("127.0.0.1", metered.port, timeout=10)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({
        "model": "a", "max_tokens": 50, "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "go on"}]}),
        headers={"Authorization": f"Bearer {RIG_TOKEN}", "Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: {")  # the stream began
    conn.close()  # and its client went away (50 tokens at 0.3 s each: long before its end)
    (gone,) = _logged(metered, before + 1)[before:]
    assert (gone.status, gone.hung_up) == (200, True)
    # nothing reported by the serve before it: unmetered
    assert (gone.prompt_tokens, gone.completion_tokens) == (None, None)
    rows = add({}, UsageKey(0, gone.key, gone.model, gone.status),
               one(gone.prompt_tokens, gone.completion_tokens, gone.hung_up))
    assert list(rows.values()) == [Counts(1, 0, 0, 1, 1)]


# --- priority: the key's, in gpud's queue and inside the engine -------------------------------

PRIORITY_KEYS = f"""\
[keys.batch]
token = "sk-batch-0123456789"
models = ["*"]
priority = 5
[keys.chat]
token = "sk-chat-01234567890"
models = ["*"]
priority = -1
[keys.probe]
token = "{RIG_TOKEN}"
models = ["*"]
"""


def _ends(keys_text: str, asks: list[tuple[str, str, dict[str, object]]]) -> dict[str, float]:
    """Serve a runs with one place (--max-num-seqs 1) and --scheduling-policy priority (the
    stand-in's scheduler as vLLM's: lower priority first). The first of ASKS (name, token, body)
    holds the place with a stream, the second asks 0.5 s after it, the third 0.3 s after that:
    when each ended."""
    keys, problems = parse_keys(keys_text, ["a", "a-fast", "b", "org/b-model"])
    assert problems == []
    with router_rig(tuple(keys), ("--max-num-seqs", "1", "--scheduling-policy", "priority"),
                    priority_scheduling=True) as rig:
        done: dict[str, float] = {}

        def ask(name: str, token: str, doc: dict[str, object]) -> None:
            status, _h, body = _req(rig.port, "POST", "/v1/completions", json.dumps(doc).encode(),
                                    {"Authorization": f"Bearer {token}",
                                     "Content-Type": "application/json"})
            assert status == 200, body
            done[name] = time.monotonic()

        threads = []
        for pause, args in zip((0.0, 0.5, 0.3), asks, strict=True):
            time.sleep(pause)
            threads.append(threading.Thread(target=ask, args=args))
            threads[-1].start()
        for t in threads:
            t.join(timeout=60)
        assert set(done) == {name for name, _t, _d in asks}, done
        return done


LONG = {"model": "a", "prompt": "x y z w v u t s", "max_tokens": 8, "stream": True}
SHORT = {"model": "a", "prompt": "x", "max_tokens": 1}


def test_a_keys_priority_orders_its_requests_inside_the_engine() -> None:
    """The batch key holds the place with a stream, then asks again writing priority -100
    itself; the chat key (priority -1) asks after it: the router sends each key's own
    priority, so chat's request runs first."""
    jump = {"model": "a", "prompt": "x y z w", "max_tokens": 4, "stream": True,
            "priority": -100}
    done = _ends(PRIORITY_KEYS, [("holder", "sk-batch-0123456789", LONG),
                                 ("batch", "sk-batch-0123456789", jump),
                                 ("chat", "sk-chat-01234567890", SHORT)])
    assert done["holder"] < done["chat"] < done["batch"], done


def test_without_priority_scheduling_the_body_goes_as_it_came() -> None:
    keys, _ = parse_keys(PRIORITY_KEYS, ["a"])
    plain = "\n".join(http_lines(RouterFront("127.0.0.1:8000", (RoutedServe("a", ("a",), port=1),),
                                             keys=tuple(keys))))
    assert "proxy_set_body" not in plain and "router_send_body" not in plain
    prio = "\n".join(http_lines(RouterFront(
        "127.0.0.1:8000", (RoutedServe("a", ("a",), port=1, ensure_timeout_s=9,
                                       priority_scheduling=True),), keys=tuple(keys))))
    # the serve's location (each requester's share first), its direct one and the loading
    # feedback's include
    assert prio.count("proxy_set_body $router_fair_body;") == 1
    assert prio.count("proxy_set_body $router_send_body;") == 2
    assert '        "" $request_body;' in prio
    assert prio.count("limit_conn_dry_run on;") == 1 and "zone=router_fair:" in prio


SHARE_KEYS = f"""\
[keys.greedy]
token = "sk-greedy-123456789"
models = ["*"]
[keys.polite]
token = "sk-polite-123456789"
models = ["*"]
[keys.probe]
token = "{RIG_TOKEN}"
models = ["*"]
"""


def _greedy_then_polite(keys_text: str) -> dict[str, float]:
    """The greedy key holds the place with a stream, then asks again; the polite key asks
    after it."""
    again = {"model": "a", "prompt": "x y z w", "max_tokens": 4, "stream": True}
    return _ends(keys_text, [("holder", "sk-greedy-123456789", LONG),
                             ("again", "sk-greedy-123456789", again),
                             ("polite", "sk-polite-123456789", SHORT)])


def test_each_requesters_first_request_goes_ahead_of_anyones_others_with_no_setting() -> None:
    """Neither key has a setting: the greedy key's second request in flight goes one step
    behind (priority 1), so the polite key's first, which came later, runs before it."""
    done = _greedy_then_polite(SHARE_KEYS)
    assert done["holder"] < done["polite"] < done["again"], done


def test_a_request_counted_by_its_keys_max_concurrent_keeps_its_priority() -> None:
    """nginx counts a request once (its key's max_concurrent, where the router took it in): a
    key with a limit is held to that instead, and its requests go in the order they came."""
    limited = SHARE_KEYS.replace("[keys.polite]", "max_concurrent = 10\n[keys.polite]")
    done = _greedy_then_polite(limited)
    assert done["holder"] < done["again"] < done["polite"], done


def test_a_waiting_streams_comments_say_its_place_and_the_wait(fed: Fed) -> None:  # noqa: F811
    """Issue 42 item 6: gpud's queue for the serve (GET /v1/serves: by requester, in the fair
    order, and the wait to expect) in the loading comments of a stream that waits in it."""
    fed.gpud.delay_s = 2.5
    fed.gpud.serves = [{"name": "a", "state": "declared", "expected_wait_s": 12.4, "queue": [
        {"requester": "batch", "waiting": 3, "position": 1},
        {"requester": "addr:loopback", "waiting": 1, "position": 2}]}]
    status, _h, lines = _stream(fed.port, {"model": "a", "prompt": "x", "max_tokens": 2})
    events = _events(lines)
    assert status == 200 and events[0] == ": loading a", lines
    assert ": queued: position 2, 4 waiting for a, expected wait 12 s (measured bring-ups)" \
        in events, lines
    assert events[-1] == "data: [DONE]", lines
    # another requester's place is not this one's: nothing said
    fed.gpud.serves[0]["queue"] = [{"requester": "batch", "waiting": 3, "position": 1}]
    _s, _h, lines = _stream(fed.port, {"model": "a", "prompt": "x", "max_tokens": 2})
    assert not any("queued" in line for line in lines), lines


def test_v1_models_shows_the_requesters_own_place_and_only_counts_of_others(
        fed: Fed) -> None:  # noqa: F811
    """Issue 50 item 8: /v1/models gives each model's queue in the fair order with every
    requester's count and place, but no other requester's name."""
    fed.gpud.serves = [{"name": "a", "state": "declared", "expected_wait_s": 12.4, "queue": [
        {"requester": "batch", "waiting": 3, "position": 1},
        {"requester": "addr:loopback", "waiting": 1, "position": 2},
        {"requester": "addr:192.0.2.7", "waiting": 2, "position": 3}]}]
    for path in ("/v1/models", "/v1/models/a"):
        status, _h, body = _req(fed.port, "GET", path)
        assert status == 200, body
        doc = json.loads(body)
        (a,) = [m for m in doc["data"] if m["id"] == "a"] if "data" in doc else [doc]
        assert a["gpud"]["queue"] == [
            {"requester": None, "waiting": 3, "position": 1},
            {"requester": "addr:loopback", "waiting": 1, "position": 2},
            {"requester": None, "waiting": 2, "position": 3}], a
        assert a["gpud"]["expected_wait_s"] == 12.4
        assert b"batch" not in body and b"192.0.2.7" not in body


def test_v1_models_says_what_a_waiting_serve_waits_for_and_until_when(
        fed: Fed) -> None:  # noqa: F811
    """Issue 51 item 4: a serve with requests waiting for memory carries gpud's `waiting`
    (GET /v1/serves: how many, what for, in how long) on /v1/models and /v1/models/ID, and
    still no other requester's name; a serve nobody waits for has none."""
    waiting = {"requests": 16, "reason": "a may be evicted in 287 s (min_awake_s)",
               "in_s": 286.4}
    fed.gpud.serves = [{"name": "a", "state": "declared", "expected_wait_s": 12.4,
                        "waiting": waiting, "queue": [
                            {"requester": "batch", "waiting": 15, "position": 1},
                            {"requester": "addr:loopback", "waiting": 1, "position": 2}]}]
    for path in ("/v1/models", "/v1/models/a"):
        status, _h, body = _req(fed.port, "GET", path)
        assert status == 200, body
        doc = json.loads(body)
        (a,) = [m for m in doc["data"] if m["id"] == "a"] if "data" in doc else [doc]
        assert a["gpud"]["waiting"] == waiting, a
        assert a["gpud"]["queue"][0] == {"requester": None, "waiting": 15, "position": 1}, a
        assert b"batch" not in body
    fed.gpud.serves = [{"name": "a", "state": "running"}]
    _s, _h, body = _req(fed.port, "GET", "/v1/models/a")
    assert json.loads(body)["gpud"] == {"host": "localhost", "serve": "a", "state": "running"}, body


# --- a requester's large bodies (router.large_bodies_per_requester) ------------------------------

TWO_KEYS = f"""
[keys.probe]
token = "{RIG_TOKEN}"
models = ["*"]

[keys.carol]
token = "sk-carol-0123456789"
models = ["*"]
"""
# a large body (10^6 bytes or more) that still fits the rig's max_body_mib (1 MiB)
LARGE = 1_040_000


def _head(token: str, length: int | None) -> bytes:
    size = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (f"POST /v1/completions HTTP/1.1\r\nHost: router\r\nAuthorization: Bearer {token}"
            f"\r\nContent-Type: application/json\r\n{size}\r\n\r\n").encode()


def _answer(sock: socket.socket) -> tuple[int, bytes]:
    """The status and body of the answer on SOCK (Content-Length framed)."""
    data = b""
    while b"\r\n\r\n" not in data:
        got = sock.recv(65536)
        assert got, data
        data += got
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(re.search(rb"(?im)^content-length:\s*(\d+)", head).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        got = sock.recv(65536)
        assert got, (head, body)
        body += got
    return int(head.split(b" ", 2)[1]), body[:length]


def test_a_requesters_large_bodies_open_at_once_are_bounded_before_they_are_read() -> None:
    """Issue 41 H3: bodies stalled mid-upload by a key holder. With
    large_bodies_per_requester = 2, two stalled large bodies of one key (kept alive under
    body_timeout_s by a byte now and then) hold its count: its third is refused 429 in
    OpenAI's shape at once, before any of its body is sent; its small requests and another
    key's are served; once one stalled body goes, the key is served again."""
    keys, problems = parse_keys(TWO_KEYS, ["a"])
    assert problems == []
    with router_rig(tuple(keys), large_bodies=2, access_log=True) as rig:
        stop = threading.Event()
        stalled = [socket.create_connection(("127.0.0.1", rig.port), timeout=10)
                   for _ in range(2)]

        def trickle() -> None:  # under the rig's body_timeout_s of 1 s
            while not stop.wait(0.25):
                for s in stalled:
                    with contextlib.suppress(OSError):
                        s.sendall(b" ")

        for s in stalled:
            s.sendall(_head(RIG_TOKEN, LARGE) + b'{"model": "a", "prompt": "')
        feeder = threading.Thread(target=trickle)
        feeder.start()
        try:
            time.sleep(0.5)  # both counted (nginx reads their heads at once)
            third = socket.create_connection(("127.0.0.1", rig.port), timeout=10)
            with third:
                third.sendall(_head(RIG_TOKEN, LARGE))  # no byte of its body
                status, body = _answer(third)
            err = json.loads(body)["error"]
            assert status == 429 and err["code"] == "rate_limit_exceeded", body
            assert err["gpud"] == {"key": "probe", "limit": "large_bodies_per_requester",
                                   "value": 2, "retry_after_s": 1}, err
            assert "key probe has 2 requests with a large body" in err["message"], err
            # counted as the key's in its usage (a 4xx of no model: its body was never read)
            # (nginx writes a request's line once it is freed, after its answer is sent:
            # ngx_http_free_request -> ngx_http_log_request, so it is waited for)
            log = rig.router.access_log
            assert log is not None

            def refused() -> list[tuple[str, str, str]]:
                return [(d["key"], d["status"], d["model"]) for d in
                        map(json.loads, Path(log).read_text().splitlines())
                        if d["status"] == "429"]

            wait_until(lambda: refused() != [], what="the 429's access-log line")
            assert refused() == [("probe", "429", "")], Path(log).read_text()
            # a chunked body (its length unknown) counts as large too
            chunked = socket.create_connection(("127.0.0.1", rig.port), timeout=10)
            with chunked:
                chunked.sendall(_head(RIG_TOKEN, None))
                assert _answer(chunked)[0] == 429
            # small bodies are not counted; another key has its own count
            assert _ask(rig.port, RIG_TOKEN)[0] == 200
            assert _ask(rig.port, "sk-carol-0123456789")[0] == 200
            stalled.pop().close()
            time.sleep(0.3)  # nginx sees the close and ends that request
            doc = json.dumps({"model": "a", "prompt": "x", "max_tokens": 1}).encode()
            again = socket.create_connection(("127.0.0.1", rig.port), timeout=10)
            with again:
                again.sendall(_head(RIG_TOKEN, None) + b"%x\r\n%s\r\n0\r\n\r\n"
                              % (len(doc), doc))
                assert _answer(again)[0] == 200
        finally:
            stop.set()
            feeder.join(timeout=5)
            for s in stalled:
                s.close()


def test_without_keys_a_clients_large_bodies_are_counted_by_its_address() -> None:
    """Keys off: the requester is the client's address (on loopback every local client is
    one): its second stalled large body is refused 429 at once, naming the client."""
    with router_rig(large_bodies=1) as rig:
        stalled = socket.create_connection(("127.0.0.1", rig.port), timeout=10)
        with stalled:
            stalled.sendall(_head("-", LARGE) + b'{"model": "a"')
            time.sleep(0.3)
            second = socket.create_connection(("127.0.0.1", rig.port), timeout=10)
            with second:
                second.sendall(_head("-", LARGE))
                status, body = _answer(second)
        err = json.loads(body)["error"]
        assert status == 429 and err["gpud"] == {
            "key": "", "limit": "large_bodies_per_requester", "value": 1,
            "retry_after_s": 1}, err
        assert err["message"].startswith("client loopback has 1 requests with a large body"), err
        assert _ask(rig.port, "-")[0] == 200  # a small body is not counted


def test_without_keys_all_of_loopback_is_one_requester_of_large_bodies() -> None:
    """Issue 50 item 5: a local user sending from many loopback addresses holds no more
    stalled large bodies than from one (the front's memory stays bounded): past the bound,
    from any of them, 429 at once."""
    with router_rig(large_bodies=2) as rig, contextlib.ExitStack() as open_:
        held = []
        for last in range(2, 4):
            s = open_.enter_context(socket.create_connection(
                ("127.0.0.1", rig.port), timeout=10, source_address=(f"127.0.0.{last}", 0)))
            s.sendall(_head("-", LARGE) + b'{"model": "a"')
            held.append(s)

        def refused(last: int) -> dict[str, object] | None:
            with socket.create_connection(("127.0.0.1", rig.port), timeout=10,
                                          source_address=(f"127.0.0.{last}", 0)) as more:
                more.sendall(_head("-", LARGE))
                status, body = _answer(more)
            err: dict[str, object] = json.loads(body)["error"]
            return err if status == 429 else None
        # once nginx counts the two held (their heads read), every other address is refused
        wait_until(lambda: refused(4) is not None, what="the held bodies counted")
        for last in range(5, 12):
            err = refused(last)
            assert err is not None and err["gpud"]["limit"] == (  # type: ignore[index]
                "large_bodies_per_requester"), err
            assert str(err["message"]).startswith("client loopback has 2 requests"), err


BUDGETED = KEYS.replace("priority = -1\n", "priority = -1\ntokens_per_day = 10\n").replace(
    "weight = 2.5\n", "weight = 2.5\ntokens_per_month = 10\n")


def test_a_key_past_its_budget_is_refused_until_the_periods_end_by_the_time_alone() -> None:
    """What gpud renders (gpud.core.quota.Over) is all the data path goes by: alice, past her
    day until an hour from now, is answered 429 insufficient_quota on every routed path, with
    Retry-After the seconds left and x-should-retry false; bob's month, past until a moment
    ago, has ended: let in, with no word from gpud; the probe has no budget."""
    keys, problems = parse_keys(BUDGETED, ["a", "a-fast", "b", "org/b-model"])
    assert problems == []
    now = int(time.time())
    over = (Over("alice", now + 3600, "day", 10, 12), Over("bob", now - 1, "month", 10, 10))
    with router_rig(tuple(keys), over_budget=over) as rig:
        for path in ROUTED_PATHS:
            status, headers, body = _req(rig.port, "POST", path, b'{"model": "a"}',
                                         {"Authorization": "Bearer sk-alice-0123456789",
                                          "Content-Type": "application/json"})
            assert status == 429, (path, status, body)
            err = json.loads(body)["error"]
            assert (err["type"], err["code"]) == ("insufficient_quota", "insufficient_quota")
            assert err["gpud"]["until"] == now + 3600 and err["gpud"]["limit"] == "tokens_per_day"
            assert 3590 <= int(headers["Retry-After"]) <= 3600, headers
            assert err["gpud"]["retry_after_s"] == int(headers["Retry-After"])
            assert headers["x-should-retry"] == "false", headers
        assert _ask(rig.port, "sk-bob-01234567890", "b")[0] == 200
        assert _ask(rig.port, RIG_TOKEN)[0] == 200


# --- who is asking, across hosts: a peer key's forwarded requester (docs/peers.md) -----------

PEER_KEYS = KEYS + """\
[keys.front-ws]
token = "sk-front-ws-0123456789"
models = ["*"]
max_concurrent = 4
priority = 3
weight = 2.0
tokens_per_day = 100
peer = true
"""


def test_the_script_knows_the_peer_keys_and_what_they_may_forward() -> None:
    keys, problems = parse_keys(PEER_KEYS, ["a", "b"])
    assert problems == []
    router = RouterFront("127.0.0.1:8000", (RoutedServe("a", ("a",), port=1),), keys=tuple(keys))
    def config_of(router: RouterFront) -> dict[str, Any]:
        return dict(json.loads(script_text(router).split("var CONFIG = ", 1)[1]
                               .split(";\n\n", 1)[0]))

    config = config_of(router)
    peers = [k["name"] for k in config["keys"].values() if k.get("peer")]
    assert peers == ["front-ws"]
    assert config["forwarded_requester"] == FORWARDED_REQUESTER_RE.pattern
    # without a peer key the script is as it was: nothing forwarded is ever read
    plain = RouterFront("127.0.0.1:8000", (RoutedServe("a", ("a",), port=1),),
                        keys=tuple(k for k in keys if not k.peer))
    assert "forwarded_requester" not in config_of(plain)
    # gpud's ensure is told the key's own name; the access log's key is the usage name
    text = "\n".join(http_lines(RouterFront(
        "127.0.0.1:8000", (RoutedServe("b", ("b",), port=2, ensure_timeout_s=30),),
        keys=tuple(keys))))
    assert "proxy_set_header X-Gpud-Key $router_key_name;" in text


def test_what_a_peer_may_forward_is_a_requester_of_its_own_and_nothing_more() -> None:
    ok = ["alice", "bob@ci", "addr:loopback", "addr:10.0.0.7", "addr:fd00::1:2", "a" * 64]
    bad = ["", "-alice", "a/b", "al ice", "alice,mallory", "a" * 65, "é", "alice\n",
           'x"y', "front-ws/alice"]
    assert [FORWARDED_REQUESTER_RE.fullmatch(s) is not None for s in ok] == [True] * len(ok)
    assert [FORWARDED_REQUESTER_RE.fullmatch(s) is not None for s in bad] == [False] * len(bad)
    # PEER/NAME at its longest is kept whole by gpud (its bounds, its journal) and in usage
    longest = "k" * 64 + "/" + "a" * 64
    assert router_request({"X-Gpud-Requester": longest}).requester == longest  # type: ignore[union-attr]
    assert parse_log_line(json.dumps({**dict.fromkeys(
        ("model", "serve", "upstream_s", "request_s", "ensure_s", "sse"), ""),
        "status": "200", "key": longest}), {}).key == longest  # type: ignore[union-attr]


def test_a_peers_forwarded_requester_weighs_what_the_peer_key_weighs(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(PEER_KEYS.replace('models = ["a"]', 'models = ["chat"]'))
    keys.chmod(0o600)
    cfg = parse_config(TOML.replace('listen = "127.0.0.1:8000"\n',
                                    f'listen = "127.0.0.1:8000"\napi_keys_file = "{keys}"\n'),
                       "t")
    shares = KeyShares(lambda: cfg)
    # this host's word on the peer's requests: the peer key's priority and weight, whoever
    # the peer names (a forwarded "alice" is not this host's key alice)
    assert shares("front-ws/alice") == shares("front-ws") == (3, 2.0)
    assert shares("front-ws/addr:10.0.0.7") == (3, 2.0)
    assert shares("alice") == (-1, 1.0)


def test_a_peers_forwarded_requesters_tokens_are_the_peer_keys_budget() -> None:
    hour = 1_700_000_000 // 3600 * 3600
    rows = [(UsageKey(hour, "front-ws/alice", "a", 200), Counts(1, 40, 20)),
            (UsageKey(hour, "front-ws/bob", "a", 200), Counts(1, 30, 20)),
            (UsageKey(hour, "alice", "a", 200), Counts(1, 500, 500))]
    over = over_budget(rows, {"front-ws": Budget(100, None), "alice": Budget(None, None)},
                       hour + 60)
    assert [(o.key, o.used) for o in over] == [("front-ws", 110)]


@pytest.fixture
def peered() -> Iterator[Rig]:
    keys, problems = parse_keys(PEER_KEYS.replace("tokens_per_day = 100\n", ""),
                                ["a", "a-fast", "b", "org/b-model"])
    assert problems == []
    with router_rig(tuple(keys), access_log=True) as rig:
        yield rig


def _as(rig: Rig, token: str, requester: str | None) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    if requester is not None:
        headers["X-Gpud-Requester"] = requester
    status, _h, body = _req(rig.port, "POST", "/v1/completions", json.dumps(
        {"model": "b", "prompt": "x", "max_tokens": 1}).encode(), headers)
    return status, body


def test_only_a_peer_keys_forwarded_requester_is_taken(peered: Rig) -> None:
    before = len(_logged(peered, 0))
    # a client's own header: ignored, its usage its key's
    assert _as(peered, "sk-bob-01234567890", "alice")[0] == 200
    # a peer key's: counted as PEER/NAME; without the header, as the peer key itself
    assert _as(peered, "sk-front-ws-0123456789", "alice")[0] == 200
    assert _as(peered, "sk-front-ws-0123456789", None)[0] == 200
    got = _logged(peered, before + 3)[before:]
    assert [a.key for a in got] == ["bob", "front-ws/alice", "front-ws"]
    # a value that is no requester: refused, the header named, nothing sent on
    for wrong in ("x/y", "al ice", "a" * 65):
        status, body = _as(peered, "sk-front-ws-0123456789", wrong)
        error = json.loads(body)["error"]
        assert status == 400 and error["code"] == "invalid_requester", body
        assert error["param"] == "X-Gpud-Requester" and "peer key front-ws" in error["message"]
    # the header given twice reaches the script joined: refused too, never the first taken
    conn = http.client.HTTPConnection("127.0.0.1", peered.port, timeout=10)
    try:
        conn.putrequest("POST", "/v1/completions")
        body = json.dumps({"model": "b", "prompt": "x", "max_tokens": 1}).encode()
        for name, value in (("Authorization", "Bearer sk-front-ws-0123456789"),
                            ("Content-Type", "application/json"),
                            ("X-Gpud-Requester", "alice"), ("X-Gpud-Requester", "mallory"),
                            ("Content-Length", str(len(body)))):
            conn.putheader(name, value)
        conn.endheaders(body)
        resp = conn.getresponse()
        assert resp.status == 400, resp.read()
    finally:
        conn.close()
