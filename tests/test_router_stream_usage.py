"""Usage for a stream that did not ask (docs/router.md, "Who is asking"): the router asks a vLLM
serve for a streamed chat or completions request's usage (`stream_options.include_usage`, put
in after the body's brace, every other byte as sent), meters the chunk vLLM then adds and
takes it out, so that the client is sent byte for byte the stream it would have had. The real
nginx and njs with the router gpud renders, before a serve that records the bytes it is sent
and answers them as vLLM 0.32 does."""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpud.core.keys import parse_keys
from gpud.core.router import RoutedServe, RouterFront
from gpud.core.routerlog import Answered, parse_log_line
from tests.ports import free_port
from tests.routerrig import NJS, Handler, router_dir, router_running, serving, tcp_server
from tests.waiting import wait_until

TOKEN = "sk-alice-0123456789"
KEYS = f"""\
[keys.alice]
token = "{TOKEN}"
models = ["m"]
priority = 3
"""
FINGERPRINT = "vllm-0.32.0-5e918640"
WORDS = ("H\u00e9llo", " \U0001F600", ' "q" \\ /')


def _dumps(doc: object) -> bytes:
    # pydantic's model_dump_json: no spaces, UTF-8 as it is
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


def vllm_stream(route: str, doc: dict[str, Any]) -> list[bytes]:
    """The events vLLM 0.32 streams for DOC (chat_completion/serving.py
    chat_completion_stream_generator, completion/serving.py completion_stream_generator): a
    chunk per token, the last with its finish_reason and, unless the body asked for usage, the
    server's system_fingerprint; asked (stream_options.include_usage), a last chunk with no
    choices, the usage and the fingerprint; then [DONE]."""
    options = doc.get("stream_options") or {}
    include = isinstance(options, dict) and options.get("include_usage") is True
    chat = route == "/v1/chat/completions"
    head: dict[str, Any] = {"id": "chatcmpl-1" if chat else "cmpl-1",
                            "object": "chat.completion.chunk" if chat else "text_completion",
                            "created": 1700000000, "model": "m"}
    events = []
    for i, word in enumerate(WORDS):
        finish = "length" if i == len(WORDS) - 1 else None
        choice = ({"index": 0, "delta": {"content": word}, "logprobs": None,
                   "finish_reason": finish} if chat else
                  {"index": 0, "text": word, "logprobs": None, "finish_reason": finish,
                   "stop_reason": None})
        chunk = {**head, "choices": [choice]}
        if finish is not None and not include:
            chunk["system_fingerprint"] = FINGERPRINT
        events.append(b"data: " + _dumps(chunk) + b"\n\n")
    if include:
        usage = {"prompt_tokens": 11, "total_tokens": 11 + len(WORDS),
                 "completion_tokens": len(WORDS)}
        events.append(b"data: " + _dumps({**head, "choices": [], "usage": usage,
                                          "system_fingerprint": FINGERPRINT}) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return events


@dataclass
class UsageRig:
    port: int
    bodies: list[bytes]
    log: Path
    priority: bool  # the serve under priority scheduling: the key's priority put in too


@pytest.fixture(params=[False, True], ids=["fcfs", "priority"])
def usage_rig(request: pytest.FixtureRequest) -> Iterator[UsageRig]:
    bodies: list[bytes] = []

    class Serve(Handler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = self.read_body()
            bodies.append(body)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for event in vllm_stream(self.path, json.loads(body)):
                # each event in two writes, cut inside a character where it has one
                cut = len(event) // 2
                for part in (event[:cut], event[cut:]):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                    self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")

    with _router_before(Serve, request.param) as (port, log):
        yield UsageRig(port, bodies, log, request.param)


@contextlib.contextmanager
def _router_before(handler: type[http.server.BaseHTTPRequestHandler],
                   priority: bool) -> Iterator[tuple[int, Path]]:
    """The router's port and its access log, before a serve `m` answered by HANDLER."""
    keys, problems = parse_keys(KEYS, ["m"])
    assert problems == []
    server = tcp_server(handler)
    with router_dir("gpud-router-usage-") as tmp, serving(server):
        port = free_port()
        router = RouterFront(f"127.0.0.1:{port}",
                             (RoutedServe("m", ("m",), port=server.server_address[1],
                                          priority_scheduling=priority, stream_usage=True),),
                             njs_module=str(NJS), script=str(tmp / "router.js"),
                             gpud_socket=str(tmp / "no-gpud.sock"), max_body_mib=4,
                             body_timeout_s=5, keys=tuple(keys),
                             access_log=str(tmp / "access.log"))
        with router_running(tmp, router):
            yield port, tmp / "access.log"


def _stream(rig: UsageRig, route: str, body: bytes) -> tuple[bytes, bytes, Answered]:
    """The answer the client read, the body the serve got, and the request's log line."""
    before = len(rig.bodies)
    lines_before = len(_lines(rig))
    conn = http.client.HTTPConnection("127.0.0.1", rig.port, timeout=10)
    try:
        conn.request("POST", route, body=body, headers={
            "Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
        resp = conn.getresponse()
        answer = resp.read()
        assert resp.status == 200, answer
    finally:
        conn.close()
    assert len(rig.bodies) == before + 1
    wait_until(lambda: len(_lines(rig)) > lines_before, what="the request's log line")
    return answer, rig.bodies[before], _lines(rig)[-1]


def _lines(rig: UsageRig) -> list[Answered]:
    text = rig.log.read_text() if rig.log.exists() else ""
    got = [parse_log_line(line, {"m": "m"}) for line in text.splitlines()]
    return [a for a in got if a is not None]


def _sent_on(body: bytes, prio: bool, member: bytes) -> bytes:
    """BODY as the serve is sent it: MEMBER (and, under priority scheduling, the key's
    priority) put in after the brace, every other byte as the client sent it."""
    brace = body.index(b"{") + 1
    return body[:brace] + member + (b'"priority":3,' if prio else b"") + body[brace:]


ASKED = b'"stream_options":{"include_usage":true},'


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("pad", [0, 70_000])  # parsed, and walked (64 KiB and more)
def test_a_stream_that_did_not_ask_is_metered_and_sent_as_it_would_have_been(
        usage_rig: UsageRig, route: str, pad: int) -> None:
    body = (b'{ "model" : "m", "stream": true, "seed": 123456789012345678901234567890,'
            b' "prompt": "a \\ud800 \\"q\\" ' + "\U0001F600".encode() + b'", "n": 1, "n": 1'
            + (b', "pad": "' + b"p" * pad + b'"' if pad else b"") + b"}")
    answer, sent, line = _stream(usage_rig, route, body)
    assert sent == _sent_on(body, usage_rig.priority, ASKED)
    # the client got exactly what the serve would have sent for its own body
    assert answer == b"".join(vllm_stream(route, json.loads(body))), answer
    assert b'"usage"' not in answer
    assert (line.key, line.status, line.prompt_tokens, line.completion_tokens,
            line.hung_up) == ("alice", 200, 11, len(WORDS), False), line


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_a_stream_that_asked_gets_its_usage_chunk_as_the_serve_sent_it(
        usage_rig: UsageRig, route: str) -> None:
    body = b'{"model": "m", "stream": true, "stream_options": {"include_usage": true}}'
    answer, sent, line = _stream(usage_rig, route, body)
    assert b'"stream_options": {"include_usage": true}' in sent
    assert sent.count(b"stream_options") == 1
    assert answer == b"".join(vllm_stream(route, json.loads(body)))
    assert b'"choices":[],"usage"' in answer
    assert (line.prompt_tokens, line.completion_tokens) == (11, len(WORDS)), line


def test_a_clients_own_stream_options_go_as_sent_and_unmetered(usage_rig: UsageRig) -> None:
    # the client chose its stream_options (no usage): the router does not change them
    body = b'{"model": "m", "stream": true, "stream_options": {"continuous_usage_stats": false}}'
    answer, sent, line = _stream(usage_rig, "/v1/chat/completions", body)
    assert sent.count(b"stream_options") == 1 and b"include_usage" not in sent, sent
    assert answer == b"".join(vllm_stream("/v1/chat/completions", json.loads(body)))
    assert (line.prompt_tokens, line.completion_tokens) == (None, None), line


def test_a_request_that_does_not_stream_goes_as_sent(usage_rig: UsageRig) -> None:
    # not a stream: nothing asked (the serve's single answer carries its usage)
    body = b'{"model": "m", "stream": false}'
    _answer, sent, _line = _stream(usage_rig, "/v1/chat/completions", body)
    assert b"stream_options" not in sent, sent


def test_with_n_above_one_only_each_choices_last_chunk_waits_for_the_usage() -> None:
    """n = 2, usage not asked: choice 0 ends first; choice 1's next chunk reaches the client
    while the serve waits for it to (by construction: the serve sends nothing more until the
    client has it), and each choice's last chunk comes once the usage chunk is in, with its
    fingerprint back."""
    head = {"id": "chatcmpl-2", "object": "chat.completion.chunk", "created": 1700000000,
            "model": "m"}

    def chunk(index: int, text: str, finish: str | None, fingerprint: bool = False) -> bytes:
        doc: dict[str, Any] = {**head, "choices": [{"index": index, "delta": {"content": text},
                                                    "logprobs": None,
                                                    "finish_reason": finish}]}
        if fingerprint:
            doc["system_fingerprint"] = FINGERPRINT
        return b"data: " + _dumps(doc) + b"\n\n"

    usage = b"data: " + _dumps({**head, "choices": [], "usage": {
        "prompt_tokens": 4, "total_tokens": 9, "completion_tokens": 5},
        "system_fingerprint": FINGERPRINT}) + b"\n\n"
    told, waited = threading.Event(), []

    class Serve(Handler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def send(event: bytes) -> None:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
            for event in (chunk(0, "A", None), chunk(1, "B", None), chunk(0, "C", "stop"),
                          chunk(1, "D", None)):
                send(event)
            # nothing more until the client has D (a bound, so that a router that holds D
            # fails the test instead of hanging it)
            waited.append(told.wait(timeout=10))
            for event in (chunk(1, "E", "length"), usage, b"data: [DONE]\n\n"):
                send(event)
            self.wfile.write(b"0\r\n\r\n")

    with _router_before(Serve, False) as (port, log):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        try:
            conn.request("POST", "/v1/chat/completions", body=b'{"model": "m", "stream": true,'
                         b' "n": 2}', headers={"Authorization": f"Bearer {TOKEN}",
                                               "Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200
            got = b""
            while b'"D"' not in got:
                line = resp.readline()
                assert line, got
                got += line
            told.set()
            got += resp.read()
        finally:
            told.set()
            conn.close()
        assert waited == [True], "choice 1's chunk waited with choice 0's last for the usage"
        # each choice's chunks in their order, its last one last with its fingerprint; the
        # usage chunk the client did not ask for taken out
        assert got == b"".join([chunk(0, "A", None), chunk(1, "B", None), chunk(1, "D", None),
                                chunk(0, "C", "stop", True), chunk(1, "E", "length", True),
                                b"data: [DONE]\n\n"]), got
        wait_until(lambda: log.exists() and '"completion_tokens":"5"' in log.read_text()
                   .replace(" ", ""), what="the usage in the log")
