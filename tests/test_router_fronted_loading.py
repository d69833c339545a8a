"""Loading feedback on a serve's own fronted port (docs/router.md, "Loading feedback"): a
stream there for an on-demand serve is the same request as one through the router, its
loading comments, then the serve's stream, its error events and its hang-up by the router's
own locations and script (gpud.core.routerconf front_policy: loading_locations,
loading_named; router.js fronted, loadingStream). The router's cases (tests/test_router.py)
are run here again through the fronted port, under the real nginx and njs, before a stand-in
serve and a stand-in gpud that takes its time."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from gpud.core.front import FrontServe, render
from gpud.core.router import RoutedServe, RouterFront
from gpud.core.routerconf import front_policy
from gpud.core.routerlog import parse_log_line

# The router's cases (test_*) are collected here again: each takes this module's `fed`,
# whose port is the fronted port of `a`.
from tests.test_router import (  # noqa: F401
    NGINX,
    NJS,
    Fed,
    _Ensure,
    _events,
    _Gpud,
    _openai_error,
    _req,
    _stream,
    a_front,
    fed_rig,
    test_a_client_that_goes_away_while_its_stream_waits_leaves_gpuds_queue,
    test_a_hang_up_during_loading_comments_ends_the_request_cleanly,
    test_a_hang_up_while_the_queue_note_is_asked_ends_the_request_cleanly,
    test_a_refusal_after_loading_feedback_is_an_error_event,
    test_a_stream_waiting_on_a_bring_up_is_sent_comments_then_the_stream,
    test_a_streams_ensure_that_gpud_does_not_answer_goes_by_the_awake_file,
    test_an_error_after_loading_feedback_is_anthropics_event_on_messages,
    test_an_error_answer_after_loading_feedback_is_an_error_event,
)
from tests.waiting import wait_until


@pytest.fixture
def fed() -> Iterator[Fed]:
    with fed_rig(fronted=True) as made:
        yield made


@pytest.fixture
def unlogged() -> Iterator[Fed]:
    """`fed` without the access log (whose server-level default names the serve's first
    model for a request that names none)."""
    with fed_rig(fronted=True, logged=False) as made:
        yield made


def test_only_a_stream_is_sent_comments_on_the_fronted_port(fed: Fed) -> None:
    """A request that does not stream waits silently, its answer the serve's one JSON
    document; a stream, at the same wait, is sent comments first, one that names no model
    too (the serve's port takes it as its first name's)."""
    fed.gpud.delay_s = 1.8
    code, headers, body = _req(fed.port, "POST", "/v1/completions",
                               b'{"model": "a", "prompt": "x"}')
    assert code == 200 and headers["Content-Type"] == "application/json", body
    assert json.loads(body)["model"] == "a"
    status, headers, lines = _stream(fed.port, {"model": "a", "prompt": "x"})
    events = _events(lines)
    assert status == 200 and headers["Content-Type"] == "text/event-stream", lines
    assert events[0] == ": loading a" and events[-1] == "data: [DONE]", lines
    status, _h, lines = _stream(fed.port, {"prompt": "x"})
    events = _events(lines)
    assert status == 200 and events[0] == ": loading a" and events[-1] == "data: [DONE]", lines
    # gpud was asked once for each, the streams by the router's own ensure (the model named;
    # the access log's default, the serve's first name, for none)
    assert fed.gpud.seen == [("", ""), ("a", ""), ("a", "")], fed.gpud.seen


def test_a_stream_that_names_no_model_is_said_by_its_serve(unlogged: Fed) -> None:
    """Without the access log's default, a stream that names no model (the serve's port takes
    it as its first name's) is said by its serve's name, and gpud is told no model, as by
    the port's own ensure."""
    unlogged.gpud.delay_s = 1.5
    status, _h, lines = _stream(unlogged.port, {"prompt": "x"})
    events = _events(lines)
    assert status == 200 and events[0] == ": loading a" and events[-1] == "data: [DONE]", lines
    unlogged.gpud.status = 403
    status, _h, lines = _stream(unlogged.port, {"prompt": "x"})
    events = _events(lines)
    assert status == 200 and events[0] == ": loading a" and events[-1] == "data: [DONE]", lines
    error = _openai_error(json.loads(events[-2].removeprefix("data: ")))
    assert error["code"] == "model_unavailable" and "(serve a)" in str(error["message"]), lines
    assert unlogged.gpud.seen == [("", ""), ("", "")], unlogged.gpud.seen


def test_the_model_a_request_named_on_the_fronted_port_is_the_one_gpud_and_the_log_get(
        fed: Fed) -> None:
    """The model the script read from the body (a-fast, the serve's second name) is the
    access log's and gpud's, for a stream and for a request that does not: before, the
    port's server-level default (the serve's first name, for a request that names none) was
    set again by the ensure's subrequest (it passes through the server's rewrite phase and
    shares its request's variables), so the log said a."""
    fed.log.write_text("")
    code, _h, body = _req(fed.port, "POST", "/v1/completions",
                          b'{"model": "a-fast", "prompt": "x", "max_tokens": 1}')
    assert code == 200 and json.loads(body)["model"] == "a-fast", body
    fed.gpud.delay_s = 1.5
    status, _h, lines = _stream(fed.port, {"model": "a-fast", "prompt": "x"})
    assert status == 200 and _events(lines)[0] == ": loading a-fast", lines
    wait_until(lambda: len(fed.log.read_text().splitlines()) == 2, what="two lines")
    table = {"a": "a", "a-fast": "a"}
    logged = [parse_log_line(line, table) for line in fed.log.read_text().splitlines()]
    assert [(a.model, a.serve, a.status) for a in logged if a is not None] == [
        ("a-fast", "a", 200), ("a-fast", "a", 200)], logged
    assert fed.gpud.seen[-1] == ("a-fast", ""), fed.gpud.seen


def test_a_refusal_with_nothing_sent_is_the_routers_503_on_the_fronted_port(fed: Fed) -> None:
    """gpud refusing within the first second: nothing was sent, and the stream is answered
    the router's 503 (model_unavailable, gpud's reason under error.gpud), as the router
    answers it."""
    fed.gpud.status = 403
    status, headers, lines = _stream(fed.port, {"model": "a", "prompt": "x y"})
    assert status == 503 and headers["Retry-After"] == "7", lines
    error = _openai_error(json.loads(_events(lines)[0]))
    assert error["code"] == "model_unavailable" and error["gpud"] is not None, error


def test_without_loading_feedback_a_fronted_ports_stream_waits_silently() -> None:
    """loading_feedback_s = 0 (or a port that asks gpud nothing): no loading feedback on the
    port, its streams wait silently as the router's do."""
    tmp, sock = Path("/run/x"), Path("/run/x/a.sock")
    router = RouterFront("127.0.0.1:8000", (RoutedServe("a", ("a",), socket=str(sock),
                                                        ensure_timeout_s=60),),
                         loading_feedback_s=0)
    assert front_policy(router, "a").loading == ()
    text = render(a_front(tmp, sock, tmp / "gpud.sock", 9000, router))
    assert "set $gpud_loading 1;" not in text and "js_content router.fronted;" not in text
    on = replace(router, loading_feedback_s=1)
    cfg = a_front(tmp, sock, tmp / "gpud.sock", 9000, on)
    server = render(cfg).split("    # serve a\n")[1]
    assert "set $gpud_loading 1;" in server and "location @router_loading {" in server
    assert "location = /v1/completions {" in server
    # a port that asks gpud nothing (a serve that sleeps, not on demand): none
    asleep = replace(cfg, serves=(FrontServe("a", 9000, str(sock)),))
    assert "@router_loading" not in render(asleep).split("    # serve a\n")[1]
