"""A stream that waited with loading feedback, whose serve answers an error that is not JSON:
the client gets an error event and [DONE], never a stream that hangs or ends silently (the
router.js `streamed` filter). Real nginx and njs, a stand-in gpud that takes its time, a serve
that fails in plain text."""

from __future__ import annotations

import contextlib
import http.client
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpud.core.router import RoutedServe, RouterFront
from tests.ports import free_port
from tests.routerrig import NJS, Handler, need_nginx, router_dir, router_running, serving, unix_server


class _Handler(Handler):
    """gpud's ensure: 204 after 1.5 s (the stream gets its loading comments first); the serve:
    a 500 in plain text, or (model "big") one of 100 KiB."""

    def do_POST(self) -> None:
        body = self.read_body()
        if self.path.endswith("/ensure"):
            time.sleep(1.5)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # nginx gone
                self.send_response(204)
                self.send_header("Content-Length", "0")
                self.end_headers()
            return
        text = b"x" * (100 << 10) if b'"big"' in body else b"upstream exploded"
        self.answer(500, text, "text/plain")


@dataclass
class Rig:
    port: int
    log: Path


@pytest.fixture
def rig() -> Iterator[Rig]:
    need_nginx()
    with router_dir("gpud-stream-") as tmp:
        port = free_port()
        router = RouterFront(f"127.0.0.1:{port}",
                             (RoutedServe("t", ("t", "big"), socket=str(tmp / "t.sock"),
                                          ensure_timeout_s=30),
                              # a serve nobody answers for (its socket never made)
                              RoutedServe("gone", ("gone",), socket=str(tmp / "gone.sock"),
                                          ensure_timeout_s=30)),
                             njs_module=str(NJS), script=str(tmp / "router.js"),
                             gpud_socket=str(tmp / "gpud.sock"), loading_feedback_s=1)
        with serving(*(unix_server(tmp / sock, _Handler) for sock in ("gpud.sock", "t.sock"))), \
                router_running(tmp, router):
            yield Rig(port, tmp / "nginx.log")


def _stream(port: int, model: str, route: str = "/v1/completions") -> list[str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.request("POST", route,
                     body=json.dumps({"model": model, "prompt": "x", "stream": True}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        return [e for e in resp.read().decode().split("\n\n") if e.strip()]
    finally:
        conn.close()


@pytest.mark.parametrize("model", ["t", "big"])
def test_an_error_that_is_not_json_after_loading_feedback_is_an_error_event(
        rig: Rig, model: str) -> None:
    """At e8f41a4 a plain-text error under 64 KiB was never passed on: the stream ended with
    the loading comments only."""
    events = _stream(rig.port, model)
    assert events[0] == f": loading {model}", events
    assert events[-1] == "data: [DONE]", events
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and error["code"] == 500, error
    assert error["message"].startswith("upstream exploded" if model == "t" else "xxx"), error


@pytest.mark.parametrize(("model", "kind", "message"), [
    ("t", "api_error", "upstream exploded"),
    ("gone", "overloaded_error", 'model "gone": serve gone is not running'),
])
def test_on_messages_the_error_is_anthropics_event(rig: Rig, model: str, kind: str,
                                                   message: str) -> None:
    """Anthropic's clients read named events only (anthropic/_streaming.py): a serve's error
    that is not JSON, and a serve that does not answer, end a /v1/messages stream with
    `event: error` and Anthropic's document, no [DONE] (at 310a618: OpenAI's data event)."""
    events = _stream(rig.port, model, "/v1/messages")
    assert events[0] == f": loading {model}", events
    assert not any("[DONE]" in e for e in events), events
    name, data = events[-1].split("\n")
    assert name == "event: error", events
    doc = json.loads(data.removeprefix("data: "))
    assert doc == {"type": "error", "error": {"type": kind, "message": message}}, doc


def test_a_serve_that_does_not_answer_after_loading_feedback_is_an_error_event(
        rig: Rig) -> None:
    events = _stream(rig.port, "gone")
    assert events[0] == ": loading gone" and events[-1] == "data: [DONE]", events
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "model_not_running", error
