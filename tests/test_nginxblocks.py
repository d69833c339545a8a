"""The nginx blocks a fronted port and the router share (gpud.core.nginxblocks): which lines each
renders and what they make nginx do. nginx running them is proven in tests/test_front.py and
tests/test_router*.py (real nginx); here, the lines themselves."""

from __future__ import annotations

import json
from pathlib import Path

from gpud.core.nginxblocks import (
    GPUD_REQUEST_HEADERS,
    KEEPALIVE,
    READ_TIMEOUT_S,
    REQUESTER_ADDR,
    REQUESTER_ADDR_MAP,
    RETRY_AFTER_S,
    ask_lines,
    direct_location,
    ensure_answers,
    ensure_lines,
    ensure_location,
    not_running,
    unauthorized_location,
    upstream,
)

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_a_serves_upstream_keeps_idle_connections_and_gpuds_none() -> None:
    assert upstream("serve_a", "unix:/s/a.sock") == [
        "    upstream serve_a {",
        "        server unix:/s/a.sock;",
        "        keepalive 32;",
        "    }"]
    assert upstream("peer", "10.0.0.2:8000", 2)[2] == "        keepalive 2;"
    assert upstream("gpud_api", "unix:/run/gpud/gpud.sock", keepalive=None) == [
        "    upstream gpud_api {",
        "        server unix:/run/gpud/gpud.sock;",
        "    }"]


def test_the_constants_are_what_the_docs_promise() -> None:
    router = (DOCS / "router.md").read_text()
    front = (DOCS / "front.md").read_text()
    assert f"({KEEPALIVE} idle per serve)" in router
    assert f"`model_not_running`, `Retry-After: {RETRY_AFTER_S}`" in router
    # "a read timeout of an hour"
    assert "an hour" in front and READ_TIMEOUT_S == 60 * 60


def test_the_ensure_posts_to_gpud_with_no_body_and_only_gpuds_headers() -> None:
    lines = ensure_lines("gpud_api", "od", 65, requester="addr:$gpud_requester_addr")
    assert lines == [
        "            internal;",
        "            proxy_pass http://gpud_api/v1/serves/od/ensure;",
        "            proxy_method POST;",
        "            proxy_pass_request_body off;",
        "            proxy_pass_request_headers off;",
        '            proxy_set_header Content-Length "";',
        "            proxy_set_header X-Gpud-Requester addr:$gpud_requester_addr;",
        "            proxy_read_timeout 65s;"]


def test_the_ensure_names_the_model_and_key_where_known_in_gpuds_order() -> None:
    lines = ensure_lines("router_gpud", "chat", 7, requester="$router_requester",
                         model="$router_model", key="$router_key_name")
    sets = [line.split()[1:] for line in lines if "proxy_set_header X-Gpud-" in line]
    assert sets == [["X-Gpud-Model", "$router_model;"], ["X-Gpud-Key", "$router_key_name;"],
                    ["X-Gpud-Requester", "$router_requester;"]]
    assert [name for name, _ in sets] == list(GPUD_REQUEST_HEADERS)
    assert lines[-1] == "            proxy_read_timeout 7s;"
    only_key = ensure_lines("g", "s", 1, requester="r", key="k")
    assert [line.split()[1] for line in only_key if "X-Gpud-" in line] == [
        "X-Gpud-Key", "X-Gpud-Requester"]


def test_an_ensure_location_is_exact_and_ends_after_its_own_lines() -> None:
    inside = ensure_lines("g", "s", 5, requester="r")
    assert ensure_location("/.gpud-ensure", inside) == [
        "        location = /.gpud-ensure {", *inside, "        }"]
    own = ["            js_header_filter router.ensured;"]
    assert ensure_location("/e/s/loading", inside, own) == [
        "        location = /e/s/loading {", *inside, *own, "        }"]


def test_a_location_asks_the_ensure_and_keeps_gpuds_reason_and_retry() -> None:
    assert ask_lines("/.gpud-ensure", "gpud") == [
        "            auth_request /.gpud-ensure;",
        "            auth_request_set $gpud_reason $upstream_http_x_gpud_reason;",
        "            auth_request_set $gpud_retry $upstream_http_retry_after;"]
    timed = ask_lines("/e/chat", "router", timed=True)
    assert timed[0] == "            auth_request /e/chat;"
    assert timed[-1] == "            auth_request_set $router_ensure_s $upstream_response_time;"
    assert len(timed) == 4


def test_a_refusal_and_gpud_unreachable_go_to_their_locations() -> None:
    assert ensure_answers("@refused", "@direct", "        ") == [
        "        error_page 403 = @refused;",
        "        error_page 500 = @direct;"]
    between = ["            error_page 429 = @router_limited;"]
    assert ensure_answers("@r", "@d", "            ", between) == [
        "            error_page 403 = @r;", *between, "            error_page 500 = @d;"]


def test_the_serve_is_reached_directly_only_when_its_awake_file_is_there() -> None:
    assert direct_location("@direct", "serve_od", "od", None, "502") == [
        "        location @direct {",
        "            proxy_pass http://serve_od;",
        "        }"]
    checked = direct_location("@router_od_direct", "router_od", "od", "/run/gpud/awake/",
                              "502", before=["            proxy_set_body $b;"],
                              after=["            js_body_filter router.meter;"])
    assert checked == [
        "        location @router_od_direct {",
        "            proxy_set_body $b;",
        "            if (!-f /run/gpud/awake/od) {",
        "                return 502;",
        "            }",
        "            proxy_pass http://router_od;",
        "            js_body_filter router.meter;",
        "        }"]


def test_a_refused_key_is_answered_401_with_the_bearer_challenge() -> None:
    assert unauthorized_location("@unauthorized") == [
        "        location @unauthorized {",
        "            add_header WWW-Authenticate Bearer always;",
        "            return 401 $router_unauthorized;",
        "        }"]


def test_the_not_running_body_is_json_naming_the_serve() -> None:
    # OpenAI's error document, as the router's (router.js `down`)
    assert json.loads(not_running("ocr-2")) == {"error": {
        "message": "serve ocr-2 is not running", "type": "server_error", "param": None,
        "code": "model_not_running"}}
    assert json.loads(not_running("od", " (gpud unreachable)"))["error"]["message"] == (
        "serve od is not running (gpud unreachable)")


def test_every_loopback_address_is_one_requester() -> None:
    assert REQUESTER_ADDR_MAP[0] == f"    map $remote_addr {REQUESTER_ADDR} {{"
    assert '        "::1" loopback;' in REQUESTER_ADDR_MAP
    assert REQUESTER_ADDR_MAP[-2:] == ("        default $remote_addr;", "    }")
