"""The router's access log read (gpud.core.routerlog): a line into what the router answered,
its own latency, a key's usage, and the counts gpud keeps. The lines nginx writes are read in
tests/test_router*.py against the real nginx; here, every field's reading."""

from __future__ import annotations

import json

import pytest

from gpud.core.router import MAX_REQUESTER
from gpud.core.routerlog import (
    LOG_FIELDS,
    OVERHEAD_BUCKETS_S,
    USAGE_FIELDS,
    Answered,
    RouterStats,
    _seconds,
    parse_log_line,
)

TABLE = {"chat": "chat-serve", "ocr": "ocr-serve"}


def line(**fields: object) -> str:
    doc: dict[str, object] = {"model": "chat", "serve": "chat-serve", "status": "200",
                              "request_s": "0.100", "upstream_s": "0.050", "ensure_s": "0.020",
                              "sse": ""}
    doc.update(fields)
    return json.dumps({k: v for k, v in doc.items() if v is not None})


@pytest.mark.parametrize(("text", "seconds"), [
    ("0.012", 0.012), ("0.012, 0.003", 0.015), ("0.010 : 0.002", 0.012), ("-", None), ("", None),
    ("0", 0.0), ("-, 0.004", 0.004), ("0.001, -", 0.001),
])
def test_nginxs_times_are_summed(text: str, seconds: float | None) -> None:
    got = _seconds(text)
    assert got == pytest.approx(seconds) if seconds is not None else got is None


def test_a_request_to_a_serve_and_the_routers_own_share_of_its_time() -> None:
    answered = parse_log_line(line(), TABLE)
    # 0.100 in nginx, 0.050 the serve's, 0.020 gpud's ensure: 0.030 the router's
    assert answered == Answered("chat", "chat-serve", "2xx", 0.03, status=200)
    assert parse_log_line(line(ensure_s=""), TABLE) == Answered(
        "chat", "chat-serve", "2xx", 0.05, status=200)
    # at nginx's millisecond resolution, never below 0
    assert parse_log_line(line(request_s="0.1004", ensure_s="-"), TABLE) == Answered(
        "chat", "chat-serve", "2xx", 0.05, status=200)
    assert parse_log_line(line(request_s="0.010"), TABLE) == Answered(
        "chat", "chat-serve", "2xx", 0.0, status=200)
    assert parse_log_line(line(request_s="0.1234", upstream_s="0.1", ensure_s="-"),
                          TABLE) == Answered("chat", "chat-serve", "2xx", 0.023, status=200)


def test_without_a_serves_time_or_through_the_loading_feedback_no_share_is_measured() -> None:
    assert parse_log_line(line(upstream_s="-"), TABLE) == Answered(
        "chat", "chat-serve", "2xx", None, status=200)
    assert parse_log_line(line(request_s="-"), TABLE) == Answered(
        "chat", "chat-serve", "2xx", None, status=200)
    assert parse_log_line(line(sse="stream"), TABLE) == Answered(
        "chat", "chat-serve", "2xx", None, status=200)
    # a bring-up refused while its stream waited: the 200 the stream began with is a 503
    assert parse_log_line(line(sse="refused", status="200"), TABLE) == Answered(
        "chat", "chat-serve", "5xx", None, status=503)


def test_a_model_not_in_the_table_counts_as_none() -> None:
    assert parse_log_line(line(model="other", serve="x"), TABLE) == Answered(
        "", "", "2xx", 0.03, status=200)
    assert parse_log_line(line(model="ocr", status="404"), TABLE) == Answered(
        "ocr", "ocr-serve", "4xx", 0.03, status=404)


def test_a_request_forwarded_to_a_peer_keeps_its_model_and_names_the_peer() -> None:
    long = "p" * (MAX_REQUESTER + 5)
    assert parse_log_line(line(model="far", peer="b-host"), TABLE) == Answered(
        "far", "", "2xx", 0.03, status=200, peer="b-host")
    assert parse_log_line(line(model="chat", peer=long), TABLE) == Answered(
        "chat", "", "2xx", 0.03, status=200, peer=long[:MAX_REQUESTER])
    assert parse_log_line(line(peer=3), TABLE) == Answered(
        "chat", "chat-serve", "2xx", 0.03, status=200)


@pytest.mark.parametrize("text", [
    "not json", "[1, 2]", '"a line"', line(status="abc"), line(status="99"), line(status="600"),
    line(status=""), line(model=None), line(sse=None), line(ensure_s=None), line(request_s=3),
    json.dumps({name: "" for name, _ in LOG_FIELDS[:-1]}),
])
def test_a_line_that_is_not_the_routers_is_none(text: str) -> None:
    assert parse_log_line(text, TABLE) is None


@pytest.mark.parametrize(("status", "status_class"), [("100", "1xx"), ("599", "5xx"),
                                                      ("302", "3xx")])
def test_the_statuses_nginx_may_write(status: str, status_class: str) -> None:
    answered = parse_log_line(line(status=status), TABLE)
    assert answered is not None
    assert (answered.status, answered.status_class) == (int(status), status_class)


def test_a_keys_usage_from_its_line() -> None:
    assert {name for name, _ in USAGE_FIELDS} == {"key", "ts", "prompt_tokens",
                                                  "completion_tokens", "complete"}
    got = parse_log_line(line(key="alice", ts="1700000000.123", prompt_tokens="12",
                              completion_tokens="7", complete="OK"), TABLE)
    assert got == Answered("chat", "chat-serve", "2xx", 0.03, key="alice", status=200,
                           ts=1700000000.123, prompt_tokens=12, completion_tokens=7,
                           hung_up=False)
    # the client hung up before the whole answer went; no usage in the answer
    got = parse_log_line(line(key="k" * (MAX_REQUESTER + 1), ts="x", prompt_tokens="",
                              completion_tokens="-", complete=""), TABLE)
    assert got == Answered("chat", "chat-serve", "2xx", 0.03, key="k" * MAX_REQUESTER,
                           status=200, ts=None, hung_up=True)
    # a field of another type is none; a line of an older config has no "complete"
    got = parse_log_line(line(key=5, ts=7, complete=None), TABLE)
    assert got == Answered("chat", "chat-serve", "2xx", 0.03, status=200)


def test_the_stats_count_by_model_serve_and_class_and_time_the_router_by_model() -> None:
    stats = RouterStats.empty()
    for text in (line(), line(), line(status="503"), line(model="ocr", request_s="0.5501",
                                                          upstream_s="0.05", ensure_s="-"),
                 line(sse="stream")):
        answered = parse_log_line(text, TABLE)
        assert answered is not None
        stats.add(answered)
    assert stats.requests == {("chat", "chat-serve", "2xx"): 3, ("chat", "chat-serve", "5xx"): 1,
                              ("ocr", "ocr-serve", "2xx"): 1}
    assert set(stats.overhead) == {"chat", "ocr"}
    chat, ocr = stats.overhead["chat"], stats.overhead["ocr"]
    assert chat.bounds == ocr.bounds == OVERHEAD_BUCKETS_S
    # the streamed one measured nothing
    assert (chat.n, chat.total_s) == (3, pytest.approx(0.09))
    assert chat.cumulative()[3:5] == [("0.01", 0), ("0.025", 0)]
    assert chat.cumulative()[5] == ("0.05", 3)
    assert (ocr.n, ocr.total_s) == (1, pytest.approx(0.5))
    assert ocr.cumulative()[-3:] == [("0.25", 0), ("1.0", 1), ("+Inf", 1)]
