"""No stream ends silently (docs/router.md, "A bound on holding a device"): a stream the serve ends
with vLLM's abort (gpud put it to sleep, or paused it to stop it, past daemon.drain_timeout_s
for a waiting request, router.evict_busy) gets an error event in its route's own shape after the
event that says so: OpenAI's (`data: {"error": {... "code": "request_aborted"}}`, before [DONE])
on /v1/chat/completions, Anthropic's (`event: error`, `{"type": "error", "error": {type,
message}}`) on /v1/messages, through the router and through the serve's own fronted port. The
real nginx and njs before a serve on a Unix socket that streams as vLLM 0.32 does when a request
is aborted, each event cut in two writes."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from gpud.core.front import FrontConfig, FrontServe
from gpud.core.router import RoutedServe, RouterFront
from gpud.core.routerconf import front_policy
from tests.ports import free_port
from tests.routerrig import NJS, Handler, router_dir, router_running, serving, unix_server


def _dumps(doc: object) -> bytes:
    # pydantic's model_dump_json: no spaces
    return json.dumps(doc, separators=(",", ":")).encode()


def openai_events(finish: str) -> list[bytes]:
    """A chat stream as vLLM 0.32 sends it, its last chunk's finish_reason FINISH ("abort":
    the engine aborted it, vllm/v1/engine/core.py pause_scheduler mode=abort)."""
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000,
            "model": "m"}
    return [b"data: " + _dumps({**head, "choices": [{"index": 0, "delta": {"content": w},
                                                      "logprobs": None, "finish_reason": f}]})
            + b"\n\n" for w, f in (("Hi", None), (" there", finish))] + [b"data: [DONE]\n\n"]


def anthropic_events(stop_reason: str | None) -> list[bytes]:
    """A /v1/messages stream as vLLM 0.32 sends it (vllm/entrypoints/anthropic/serving.py
    message_stream_converter): an aborted request's message_delta has stop_reason null
    (_to_anthropic_stop_reason maps a finish_reason "abort" to None), then message_stop."""
    def event(name: str, doc: dict[str, Any]) -> bytes:
        return b"event: " + name.encode() + b"\ndata: " + _dumps(doc) + b"\n\n"
    return [
        event("message_start", {"type": "message_start", "message": {
            "id": "chatcmpl-1", "type": "message", "role": "assistant", "content": [],
            "model": "m", "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 7, "output_tokens": 0}}}),
        event("content_block_start", {"type": "content_block_start", "index": 0,
                                      "content_block": {"type": "text", "text": ""}}),
        event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                      "delta": {"type": "text_delta", "text": "Hi"}}),
        event("content_block_stop", {"type": "content_block_stop", "index": 0}),
        event("message_delta", {"type": "message_delta",
                                "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                                "usage": {"input_tokens": 7, "output_tokens": 1}}),
        event("message_stop", {"type": "message_stop"}),
    ]


def responses_events() -> list[bytes]:
    """A /v1/responses stream as vLLM 0.32 sends it (openai/responses/serving.py,
    streaming_events.py), whole or aborted alike: an aborted one (a model without Harmony)
    ends with response.completed, its status "completed" (tests/vllm/test_contract.py
    test_an_aborted_responses_stream_ends_as_a_whole_one)."""
    done = {"id": "resp_1", "object": "response", "model": "m", "status": "completed",
            "output": [{"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": "Hi"}]}],
            "usage": {"input_tokens": 7, "output_tokens": 1, "total_tokens": 8}}
    kinds = [("response.created", {"response": {**done, "status": "in_progress",
                                                "output": [], "usage": None}}),
             ("response.output_text.delta", {"delta": "Hi"}),
             ("response.output_text.done", {"text": "Hi"}),
             ("response.completed", {"response": done})]
    return [b"event: " + kind.encode() + b"\ndata: "
            + _dumps({"type": kind, "sequence_number": n, **data}) + b"\n\n"
            for n, (kind, data) in enumerate(kinds)]


def _events(route: str, doc: dict[str, Any]) -> list[bytes]:
    cut = str(doc.get("user")).startswith("cut")
    if route == "/v1/messages":
        return anthropic_events(None if cut else "end_turn")
    if route == "/v1/responses":
        return responses_events()
    return openai_events("abort" if cut else "length")


# A chat answer (not streamed) of a request vLLM aborted, a blank line (JSON's whitespace)
# after its finish_reason: the marks a cut stream's event is put in after, in a single answer
SINGLE = (b'{"id":"chatcmpl-1","object":"chat.completion","model":"m","choices":[{"index":0,'
          b'"message":{"role":"assistant","content":"Hi"},"finish_reason":"abort"\n\n}]}')


@dataclass
class Rig:
    router: int
    front: int
    # set by a test once its client has the first event of a /v1/responses stream the serve is
    # to cut: the serve then writes gpud's note, after the stream's first bytes by construction
    seen: threading.Event


@pytest.fixture
def rig() -> Iterator[Rig]:
    class Serve(Handler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            doc = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if not doc.get("stream"):
                # a single answer (SINGLE), in two writes (chunked)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for part in (SINGLE[:40], SINGLE[40:]):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            user = str(doc.get("user"))
            where = user.partition(":")[2]
            if "note" in doc and not user.startswith("cut"):
                # gpud's note of a cut before this stream began, whatever it holds
                cuts.mkdir(exist_ok=True)
                (cuts / "m").write_text(doc["note"])
            for event in _events(self.path, doc):
                # each event in two writes: the one that says the stream was cut too, at its
                # middle, inside the mark the router looks for, or between its blank line's two
                # newlines
                half = len(event) // 2
                last = event.startswith(b"event: response.completed")
                if last and user.startswith("cut"):
                    # gpud's note that it ends what is in flight, written before the abort
                    assert seen.wait(10), "the client never had the stream's first event"
                    seen.clear()
                    cuts.mkdir(exist_ok=True)
                    (cuts / "m").write_text(doc.get("note", str(time.time_ns())))
                if where != "middle" and last:
                    half = (event.index(b'completed') if where == "mark" else len(event) - 1)
                if where != "middle" and (b'"abort"' in event or b'"delta":{"stop_reason":null' in event):
                    half = (event.index(b'_reason') if where == "mark" else len(event) - 1)
                for part in (event[:half], event[half:]):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                    self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")

    seen = threading.Event()
    with router_dir("gpud-abort-") as tmp:
        sock = tmp / "m.sock"
        cuts = tmp / "cut"
        port, fport = free_port(), free_port()
        router = RouterFront(f"127.0.0.1:{port}", (RoutedServe("m", ("m",), socket=str(sock)),),
                             njs_module=str(NJS), script=str(tmp / "router.js"),
                             gpud_socket=str(tmp / "no-gpud.sock"),
                             access_log=str(tmp / "a.log"), cut_dir=str(cuts))
        front = FrontConfig(serves=(FrontServe("m", fport, str(sock)),), listen="127.0.0.1",
                            policies=(("m", front_policy(router, "m")),))
        with serving(unix_server(sock, Serve)), router_running(tmp, router, fport, front=front):
            yield Rig(port, fport, seen)
            assert "js exception" not in (tmp / "nginx.log").read_text()


def _stream(port: int, route: str, user: str, stream: bool = True,
            seen: threading.Event | None = None, note: str | None = None) -> bytes:
    """The answer, whole; with SEEN, set once its first event came (a cut /v1/responses
    stream's serve waits for it); with NOTE, what the serve writes as gpud's note of a cut
    (before the stream's first bytes unless the stream is cut)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", route, headers={"Content-Type": "application/json"},
                     body=json.dumps({"model": "m", "stream": stream, "user": user,
                                      "max_tokens": 2, "messages": [],
                                      **({} if note is None else {"note": note})}))
        resp = conn.getresponse()
        answer = b""
        if seen is not None:
            while not answer.endswith(b"\n\n"):
                answer += resp.readline()
            seen.set()
        answer += resp.read()
        assert resp.status == 200, answer
        return answer
    finally:
        conn.close()


def _sse(answer: bytes) -> list[tuple[str | None, str]]:
    """(event name, data) of each event, as an SSE client reads them."""
    out = []
    for block in answer.decode().split("\n\n"):
        if not block:
            continue
        name, data = None, []
        for line in block.split("\n"):
            field, _, value = line.partition(": ")
            if field == "event":
                name = value
            elif field == "data":
                data.append(value)
        out.append((name, "\n".join(data)))
    return out


@pytest.mark.parametrize("where", ["middle", "mark", "blank"])
@pytest.mark.parametrize("door", ["router", "front"])
def test_an_aborted_anthropic_stream_ends_with_anthropics_error_event(rig: Rig, door: str,
                                                                     where: str) -> None:
    port = rig.router if door == "router" else rig.front
    answer = _stream(port, "/v1/messages", f"cut:{where}")
    sent = b"".join(anthropic_events(None))
    events = _sse(answer)
    # the serve's events as they came, Anthropic's error event after the message_delta that
    # said no stop_reason (anthropic-sdk-python raises an event named "error" as its error)
    names = [name for name, _ in events]
    assert names == ["message_start", "content_block_start", "content_block_delta",
                     "content_block_stop", "message_delta", "error", "message_stop"], answer
    assert answer.replace(answer[answer.index(b"event: error"):
                                 answer.index(b"event: message_stop")], b"") == sent
    error = json.loads(events[5][1])
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}, error
    assert error["error"]["type"] == "overloaded_error"
    assert "daemon.drain_timeout_s" in error["error"]["message"]
    assert b"[DONE]" not in answer


@pytest.mark.parametrize("where", ["middle", "mark", "blank"])
@pytest.mark.parametrize("door", ["router", "front"])
def test_an_aborted_openai_stream_ends_with_openais_error_event(rig: Rig, door: str,
                                                               where: str) -> None:
    port = rig.router if door == "router" else rig.front
    answer = _stream(port, "/v1/chat/completions", f"cut:{where}")
    events = _sse(answer)
    assert [json.loads(d)["choices"][0]["finish_reason"] for _, d in events[:2]] == [
        None, "abort"], answer
    error = json.loads(events[2][1])["error"]
    assert error["code"] == "request_aborted" and error["type"] == "server_error", error
    assert events[3:] == [(None, "[DONE]")], answer


@pytest.mark.parametrize("where", ["middle", "mark", "blank"])
@pytest.mark.parametrize("door", ["router", "front"])
def test_a_responses_stream_gpud_cut_ends_with_an_error_event(rig: Rig, door: str,
                                                              where: str) -> None:
    """vLLM ends an aborted /v1/responses stream as a whole one: gpud's note (written just
    before its abort, after the stream's first bytes) has the router put an error event after
    its response.completed: the Responses API's error event, OpenAI's error document under
    `error` (openai-python raises it as an APIError). The serve's bytes pass as they came."""
    port = rig.router if door == "router" else rig.front
    answer = _stream(port, "/v1/responses", f"cut:{where}", seen=rig.seen)
    sent = b"".join(responses_events())
    assert answer.startswith(sent), answer
    events = _sse(answer[len(sent):])
    assert [name for name, _ in events] == ["error"], answer
    error = json.loads(events[0][1])
    assert (error["type"], error["code"], error["param"]) == ("error", "request_aborted", None)
    assert error["error"]["code"] == "request_aborted" and error["error"]["type"] == "server_error"
    assert "daemon.drain_timeout_s" in error["message"] == error["error"]["message"]


@pytest.mark.parametrize("route", ["/v1/messages", "/v1/chat/completions", "/v1/responses"])
@pytest.mark.parametrize("door", ["router", "front"])
def test_a_stream_that_ends_as_streams_end_is_passed_as_it_came(rig: Rig, door: str,
                                                                route: str) -> None:
    # a note of gpud's from before the stream began (an earlier cut) says nothing of it
    port = rig.router if door == "router" else rig.front
    assert _stream(port, route, "cut:middle" if route == "/v1/responses" else "whole",
                   seen=rig.seen if route == "/v1/responses" else None)
    assert _stream(port, route, "whole") == b"".join(_events(route, {"user": "whole"}))


@pytest.mark.parametrize("door", ["router", "front"])
def test_a_responses_stream_is_told_by_the_order_of_the_notes_not_by_a_clock(rig: Rig,
                                                                            door: str) -> None:
    """A note is told apart from an earlier one by being new, not by the time it holds: a note
    written just before a stream began, in the same millisecond or by a clock ahead of the
    router's, says nothing of it (a full CI run once saw a whole stream told, its note and its
    first bytes in one millisecond); one written during a stream, by a clock set back since,
    tells it."""
    port = rig.router if door == "router" else rig.front
    whole = b"".join(responses_events())
    ahead = str(time.time_ns() + 3600 * 10**9)
    assert _stream(port, "/v1/responses", "whole", note=ahead) == whole
    assert _stream(port, "/v1/responses", "whole",
                   note=str((time.time_ns() + 10**6) // 10**6)) == whole
    answer = _stream(port, "/v1/responses", "cut:middle", seen=rig.seen, note="1")
    assert answer.startswith(whole) and [n for n, _ in _sse(answer[len(whole):])] == ["error"]


@pytest.mark.parametrize("door", ["router", "front"])
def test_a_single_answer_of_an_aborted_request_is_passed_as_it_came(rig: Rig, door: str) -> None:
    # the error event is a stream's: a JSON answer gets none, whatever its text holds
    port = rig.router if door == "router" else rig.front
    assert _stream(port, "/v1/chat/completions", "cut:middle", stream=False) == SINGLE
