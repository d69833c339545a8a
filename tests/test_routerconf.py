"""The router's nginx config and script as gpud.core.routerconf renders them from a RouterFront:
the directives each location must carry, for each kind of serve (on demand or asleep, always on,
plain; priority scheduling, stream usage), with and without keys, limits, budgets, an access log
and peers, and the script's CONFIG. Pure: the rendered text only (tests/test_router*.py run it in
a real nginx)."""

from __future__ import annotations

import json

import pytest

from gpud.core.keys import ApiKey, parse_keys
from gpud.core.quota import Over
from gpud.core.router import ROUTED_PATHS, RoutedPeer, RoutedServe, RouterFront
from gpud.core.routerconf import front_policy, http_lines, main_lines, render_script

KEYS = """
[keys.alice]
token = "sk-alice-0123456789abcdef"
models = ["chat"]
max_concurrent = 2
requests_per_minute = 60
tokens_per_day = 1000
priority = 3

[keys.bob]
token = "sk-bob-0123456789abcdef00"
models = ["*"]
peer = true
"""
ERRORS = (400, 404, 405, 412, 413, 414, 494, 500, 501, 505)


def keys(text: str = KEYS) -> tuple[ApiKey, ...]:
    parsed, problems = parse_keys(text, ["chat", "prio", "su", "ocr", "tool"])
    assert problems == []
    return tuple(parsed)


PLAIN_KEY = keys('[keys.carol]\ntoken = "sk-carol-0123456789abcdef"\nmodels = ["*"]\n')


def serves() -> tuple[RoutedServe, ...]:
    return (RoutedServe("chat", ("chat", "chat-fast"), socket="/run/gpud/serves/chat.sock",
                        ensure_timeout_s=300),
            RoutedServe("ocr", ("ocr",), port=30002, wait_timeout_s=60),
            RoutedServe("tool", ("tool",), port=30003))


def plain(**kw: object) -> RouterFront:
    return RouterFront("127.0.0.1:8000", serves(), **kw)  # type: ignore[arg-type]


def full(**kw: object) -> RouterFront:
    fields: dict[str, object] = {
        "keys": keys(), "access_log": "/var/log/gpud/router.log", "awake_dir": "/run/awake/",
        "host": "node1", "max_body_mib": 8, "body_timeout_s": 7,
        "peers": (RoutedPeer("n2", "https", "[fd00::2]", 8443, "sk-peer-2", ("far",),
                             tls_ca="/etc/gpud/n2-ca.pem"),
                  RoutedPeer("n1", "http", "node0", 8000, "sk-peer-1", ("chat", "near"),
                             open_reason="connect refused", open_since=12.5))}
    fields.update(kw)
    return RouterFront("127.0.0.1:8000", (
        RoutedServe("chat", ("chat",), socket="/run/gpud/serves/chat.sock", ensure_timeout_s=300),
        RoutedServe("prio", ("prio",), port=2, priority_scheduling=True, wait_timeout_s=60),
        RoutedServe("su", ("su",), port=3, stream_usage=True, ensure_timeout_s=10),
    ), **fields)  # type: ignore[arg-type]


def text(router: RouterFront) -> list[str]:
    """The http block's lines, one a line (some entries hold several)."""
    return "\n".join(http_lines(router)).split("\n")


def block(lines: list[str], header: str) -> list[str]:
    """The lines of the location (or upstream) whose first line is HEADER, its `}` included."""
    start = lines.index(header)
    indent = header[:len(header) - len(header.lstrip())]
    return lines[start:lines.index(f"{indent}}}", start) + 1]


def location(lines: list[str], name: str) -> list[str]:
    return block(lines, f"        location {name} {{")


def has(lines: list[str], header: str) -> bool:
    return header in lines


def test_the_main_context_loads_the_njs_module() -> None:
    assert main_lines(plain(njs_module="/opt/njs.so")) == ["load_module /opt/njs.so;"]


def test_the_upstreams_are_gpud_each_serve_and_each_peer() -> None:
    lines = text(plain())
    assert block(lines, "    upstream router_gpud {") == [
        "    upstream router_gpud {", "        server unix:/run/gpud/gpud.sock;", "    }"]
    assert block(lines, "    upstream router_chat {") == [
        "    upstream router_chat {", "        server unix:/run/gpud/serves/chat.sock;",
        "        keepalive 32;", "    }"]
    assert block(lines, "    upstream router_ocr {")[1] == "        server 127.0.0.1:30002;"
    # no peers: no upstream for GET /v1/route, no peer's
    assert not any("router_gpud_route" in line or "router_peer_" in line for line in lines)
    with_peers = text(full(gpud_socket="/run/g.sock"))
    assert block(with_peers, "    upstream router_gpud_route {") == [
        "    upstream router_gpud_route {", "        server unix:/run/g.sock;",
        "        keepalive 2;", "    }"]
    assert block(with_peers, "    upstream router_peer_n2 {") == [
        "    upstream router_peer_n2 {", "        server [fd00::2]:8443;", "        keepalive 32;",
        "    }"]
    # by name
    assert with_peers.index("    upstream router_peer_n1 {") < with_peers.index(
        "    upstream router_peer_n2 {")


def test_the_server_reads_the_whole_body_in_memory_within_its_bounds() -> None:
    lines = text(full())
    head = lines[lines.index("    server {"):lines.index("        location = /v1/models {")]
    for line in ("        listen 127.0.0.1:8000;", "        client_max_body_size 8m;",
                 "        client_body_buffer_size 8m;", "        client_body_timeout 7s;",
                 "        client_header_timeout 7s;", "        recursive_error_pages on;",
                 "        postpone_output 0;",
                 "        access_log /var/log/gpud/router.log gpud_router;",
                 "        error_page 401 = @router_unauthorized;",
                 "        error_page 432 = @router_quota;",
                 "        error_page 502 504 = @router_down;",
                 "        error_page 429 = @router_limited;",
                 *(f"        error_page {s} /.gpud-router-error/{s};" for s in ERRORS)):
        assert line in head, line
    log_format = next(x for x in lines if x.startswith("    log_format gpud_router escape=json '{"))
    fields = json.loads(log_format.split("'", 1)[1].rsplit("'", 1)[0])
    assert fields["model"] == "$router_model" and fields["peer"] == "$router_peer"
    assert fields["prompt_tokens"] == "$router_prompt_tokens"
    # without keys, budgets or an access log: none of theirs
    bare = text(plain())
    assert not any(x.startswith(("    log_format", "        access_log")) for x in bare)
    assert "        error_page 401 = @router_unauthorized;" not in bare
    assert not any("432" in x for x in bare)
    assert not has(bare, "        location @router_unauthorized {")
    assert not has(bare, "        location @router_quota {")


def test_each_routed_path_is_routed_by_the_script_after_the_checks() -> None:
    bare = text(plain(large_bodies_per_requester=0))
    for path in ROUTED_PATHS:
        assert location(bare, f"= {path}") == [
            f"        location = {path} {{", "            js_content router.route;",
            "            ssi on;", "            ssi_types text/event-stream;", "        }"]
    checked = location(text(full()), "= /v1/chat/completions")
    assert checked[1:7] == ['            if ($router_key_name = "") {', "                return 401;",
                            "            }", '            if ($router_quota != "") {',
                            "                return 432;", "            }"]
    # a location's error pages replace the server's: repeated, then the counts' 429
    for s in ERRORS:
        assert f"            error_page {s} /.gpud-router-error/{s};" in checked
    assert checked[-9:] == ["            error_page 502 504 = @router_down;",
                            "            error_page 429 = @router_counted;",
                            "            limit_conn router_conn_0 2;",
                            "            limit_conn router_bodies 16;",
                            "            limit_conn_status 429;",
                            "            js_content router.route;", "            ssi on;",
                            "            ssi_types text/event-stream;", "        }"]
    assert "            error_page 401 = @router_unauthorized;" in checked
    # keys without limits or budgets: the key's check alone
    keyed = location(text(plain(keys=PLAIN_KEY, large_bodies_per_requester=0)),
                     "= /v1/completions")
    assert keyed == ["        location = /v1/completions {",
                     '            if ($router_key_name = "") {', "                return 401;",
                     "            }", "            js_content router.route;",
                     "            ssi on;", "            ssi_types text/event-stream;", "        }"]


def test_the_models_list_and_gpuds_list_of_serves() -> None:
    lines = text(plain())
    assert location(lines, "= /v1/models")[1] == "            js_content router.models;"
    assert location(lines, "^~ /v1/models/")[1] == "            js_content router.model;"
    assert location(lines, "= /.gpud-router-serves") == [
        "        location = /.gpud-router-serves {", "            internal;",
        "            proxy_pass http://router_gpud/v1/serves;", "            proxy_method GET;",
        "            proxy_pass_request_body off;", "            proxy_pass_request_headers off;",
        '            proxy_set_header Content-Length "";', "            proxy_read_timeout 5s;",
        "            subrequest_output_buffer_size 1m;", "        }"]


def test_an_on_demand_serve_asks_gpud_first_then_goes_straight_when_gpud_is_down() -> None:
    lines = text(plain(awake_dir="/run/awake/"))
    assert location(lines, "@router_chat") == [
        "        location @router_chat {",
        "            auth_request /.gpud-router-ensure/chat;",
        "            auth_request_set $router_reason $upstream_http_x_gpud_reason;",
        "            auth_request_set $router_retry $upstream_http_retry_after;",
        "            auth_request_set $router_ensure_s $upstream_response_time;",
        "            error_page 403 = @router_refused;",
        "            error_page 500 = @router_chat_direct;",
        "            error_page 502 504 = @router_down;",
        "            proxy_pass http://router_chat;",
        "            js_body_filter router.meter buffer_type=buffer;", "        }"]
    ensure = ["            internal;",
              "            proxy_pass http://router_gpud/v1/serves/chat/ensure;",
              "            proxy_method POST;", "            proxy_pass_request_body off;",
              "            proxy_pass_request_headers off;",
              '            proxy_set_header Content-Length "";',
              "            proxy_set_header X-Gpud-Model $router_model;",
              "            proxy_set_header X-Gpud-Key $router_key_name;",
              "            proxy_set_header X-Gpud-Requester $router_requester;",
              "            proxy_read_timeout 300s;"]
    assert location(lines, "= /.gpud-router-ensure/chat") == [
        "        location = /.gpud-router-ensure/chat {", *ensure, "        }"]
    assert location(lines, "= /.gpud-router-ensure/chat/loading") == [
        "        location = /.gpud-router-ensure/chat/loading {", *ensure,
        "            js_header_filter router.ensured;",
        "            error_page 500 502 504 = @router_ensure_failed;", "        }"]
    # gpud down: the serve only when gpud last said it was awake (its file)
    assert location(lines, "@router_chat_direct") == [
        "        location @router_chat_direct {", "            if (!-f /run/awake/chat) {",
        "                return 502;", "            }", "            proxy_pass http://router_chat;",
        "            js_body_filter router.meter buffer_type=buffer;", "        }"]
    assert location(lines, "^~ /.gpud-router-stream/chat/") == [
        "        location ^~ /.gpud-router-stream/chat/ {", "            internal;",
        r"            rewrite ^/\.gpud\-router\-stream/chat(/.*)$ $1 break;",
        "            proxy_method POST;", "            proxy_pass http://router_chat;",
        "            js_body_filter router.streamed buffer_type=buffer;",
        "            error_page 502 504 = @router_stream_down;", "        }"]
    # no awake dir: no check
    assert not any("-f " in x for x in location(text(plain()), "@router_chat_direct"))


def test_a_serve_on_a_port_has_no_awake_check() -> None:
    lines = text(full())
    assert location(lines, "@router_su_direct") == [
        "        location @router_su_direct {", "            proxy_set_body $router_send_body;",
        "            proxy_pass http://router_su;",
        "            js_body_filter router.meter buffer_type=buffer;", "        }"]
    assert location(lines, "@router_chat_direct")[1] == "            if (!-f /run/awake/chat) {"


def test_an_always_on_serve_waits_for_a_start_only_when_it_does_not_answer() -> None:
    lines = text(plain())
    assert location(lines, "@router_ocr") == [
        "        location @router_ocr {", "            error_page 502 = @router_ocr_starting;",
        "            error_page 504 = @router_down;", "            proxy_pass http://router_ocr;",
        "            js_body_filter router.meter buffer_type=buffer;", "        }"]
    assert location(lines, "= /.gpud-router-ensure/ocr")[-2:] == [
        "            proxy_read_timeout 60s;", "        }"]
    assert location(lines, "@router_ocr_starting") == [
        "        location @router_ocr_starting {",
        "            auth_request /.gpud-router-ensure/ocr;",
        "            auth_request_set $router_reason $upstream_http_x_gpud_reason;",
        "            auth_request_set $router_retry $upstream_http_retry_after;",
        "            auth_request_set $router_ensure_s $upstream_response_time;",
        "            error_page 403 = @router_refused;",
        "            error_page 500 502 504 = @router_down;",
        "            proxy_pass http://router_ocr;",
        "            js_body_filter router.meter buffer_type=buffer;", "        }"]
    assert not has(lines, "        location = /.gpud-router-ensure/ocr/loading {")
    # a plain serve: nothing asked of gpud, ever
    assert location(lines, "@router_tool") == [
        "        location @router_tool {", "            proxy_pass http://router_tool;",
        "            js_body_filter router.meter buffer_type=buffer;", "        }"]
    assert not any("ensure/tool" in x or "router_tool_" in x for x in lines)


def test_a_keys_rates_count_where_the_router_sends_the_request() -> None:
    lines = text(full())
    chat = location(lines, "@router_chat")
    assert chat[1:3] == ["            limit_req zone=router_rpm_0 burst=59 nodelay;",
                         "            limit_req_status 429;"]
    assert chat.index("            error_page 429 = @router_limited;") == chat.index(
        "            error_page 403 = @router_refused;") + 1
    prio = location(lines, "@router_prio")
    assert prio[1] == "            limit_req zone=router_rpm_0 burst=59 nodelay;"
    assert "            error_page 429 = @router_limited;" in prio
    assert location(lines, "@router_loading")[1] == (
        "            limit_req zone=router_rpm_0 burst=59 nodelay;")
    # no rates: no 429 of theirs there
    bare = text(plain())
    for name in ("@router_chat", "@router_ocr", "@router_tool"):
        assert not any("429" in x or "limit_req" in x for x in location(bare, name)), name


def test_priority_scheduling_sends_the_rewritten_body_each_requesters_share_first() -> None:
    lines = text(full())
    fair = ["            proxy_set_body $router_fair_body;", "            limit_conn router_fair 1;",
            "            limit_conn_dry_run on;", "            limit_conn_log_level info;"]
    assert location(lines, "@router_prio")[3:7] == fair
    assert location(lines, "@router_prio_starting")[1:5] == fair
    # a stream-usage serve: the body the script may have rewritten, no share
    su = location(lines, "@router_su")
    assert su[3] == "            proxy_set_body $router_send_body;"
    assert not any("router_fair" in x for x in su)
    assert location(lines, "^~ /.gpud-router-stream/su/")[4] == (
        "            proxy_set_body $router_send_body;")
    assert "    map $router_body_head $router_send_body {" in lines
    assert '    limit_conn_zone "$router_serve $router_requester" zone=router_fair:1m;' in lines
    # neither: the request's own body, and no map of theirs
    bare = text(plain())
    assert not any("proxy_set_body" in x or "$router_send_body" in x for x in bare)
    only_usage = text(RouterFront("127.0.0.1:8000", (RoutedServe("su", ("su",), port=3,
                                                                 stream_usage=True),)))
    assert "    map $router_body_head $router_send_body {" in only_usage
    assert location(only_usage, "@router_su")[1] == "            proxy_set_body $router_send_body;"


def test_the_named_locations_of_refusals_and_errors() -> None:
    lines = text(full())
    assert location(lines, "@router_unauthorized") == [
        "        location @router_unauthorized {",
        "            add_header WWW-Authenticate Bearer always;",
        "            return 401 $router_unauthorized;", "        }"]
    assert location(lines, "@router_counted")[-2:] == [
        "            return 429 $router_counted_text;", "        }"]
    assert has(lines, "        location @router_quota {")
    for name, content in (("@router_refused", "router.refused"), ("@router_down", "router.down"),
                          ("@router_stream_down", "router.streamDown"),
                          ("@router_limited", "router.limited")):
        assert location(lines, name)[1] == f"            js_content {content};"
    assert location(lines, "@router_ensure_failed")[1:] == [
        "            js_header_filter router.ensured;", '            return 502 "gpud unreachable";',
        "        }"]
    for s in ERRORS:
        assert location(lines, f"= /.gpud-router-error/{s}") == [
            f"        location = /.gpud-router-error/{s} {{", "            internal;",
            f"            return {400 if s == 494 else s} $router_error_{s};", "        }"]
    # a route it does not carry: the 404 page above, whose handler reads its status in its URI
    assert location(lines, "/")[1] == "            return 404;"
    assert has(lines, "        error_page 404 /.gpud-router-error/404;")
    assert lines[-1] == "    }"
    # no counts (no max_concurrent, no bound on large bodies): no @router_counted
    assert not has(text(plain(large_bodies_per_requester=0)), "        location @router_counted {")
    assert has(text(plain()), "        location @router_counted {")


def test_a_request_for_a_peers_model_goes_to_its_router_with_this_hosts_key() -> None:
    lines = text(full())
    n2 = location(lines, "@router_peer_n2")
    assert n2 == [
        "        location @router_peer_n2 {",
        "            limit_req zone=router_rpm_0 burst=59 nodelay;",
        "            limit_req_status 430;", "            error_page 430 = @router_limited;",
        "            proxy_pass https://router_peer_n2;", "            proxy_http_version 1.1;",
        '            proxy_set_header Connection "";',
        '            proxy_set_header Host "[fd00::2]:8443";',
        '            proxy_set_header Authorization "Bearer sk-peer-2";',
        '            proxy_set_header X-Api-Key "";',
        "            proxy_set_header X-Gpud-Requester $router_requester;",
        '            proxy_set_header X-Gpud-Via "node1";',
        "            proxy_ssl_server_name on;", "            proxy_ssl_name fd00::2;",
        "            proxy_ssl_verify on;", "            proxy_ssl_verify_depth 4;",
        "            proxy_ssl_trusted_certificate /etc/gpud/n2-ca.pem;",
        "            proxy_buffering off;", "            proxy_connect_timeout 3s;",
        "            proxy_read_timeout 3600s;", "            proxy_send_timeout 3600s;",
        "            proxy_next_upstream off;", "            proxy_intercept_errors on;",
        "            error_page 502 504 = @router_peer_down;",
        "            js_body_filter router.peerStreamed buffer_type=buffer;", "        }"]
    stream = location(lines, "@router_peer_n2_stream")
    assert stream[4:6] == ["            proxy_pass https://router_peer_n2;",
                           "            proxy_http_version 1.0;"]
    assert '            proxy_set_header Connection "";' not in stream
    # http: no TLS; no limits: no 430
    n1 = location(text(full(keys=PLAIN_KEY)), "@router_peer_n1")
    assert n1[1:3] == ["            proxy_pass http://router_peer_n1;",
                       "            proxy_http_version 1.1;"]
    assert not any("ssl" in x for x in n1)
    assert location(lines, "= /.gpud-router-peers")[2] == (
        "            proxy_pass http://router_gpud/v1/peers;")
    assert location(lines, "= /.gpud-router-route")[1:4] == [
        "            internal;", "            proxy_pass http://router_gpud_route/v1/route;",
        "            proxy_http_version 1.1;"]
    assert location(lines, "@router_peer_down")[1] == "            js_content router.peerDown;"
    assert lines.index("        location @router_peer_n1 {") < lines.index(
        "        location @router_peer_n2 {")
    bare = text(plain())
    assert not any("peer" in x for x in bare if x.lstrip().startswith("location"))


def script_config(router: RouterFront) -> dict[str, object]:
    text = render_script(router, "// code")
    assert text.endswith("\n\n// code")
    doc: dict[str, object] = json.loads(text.split("var CONFIG = ", 1)[1].rsplit(";\n\n", 1)[0])
    return doc


def test_the_script_is_told_the_table_keys_limits_and_peers() -> None:
    over = (Over("alice", 1_800_000_000, "day", 1000, 1200),)
    doc = script_config(full(over_budget=over, loading_feedback_s=2))
    assert doc["models"] == {
        "chat": {"serve": "chat", "location": "@router_chat", "ensure": True},
        "prio": {"serve": "prio", "location": "@router_prio", "ensure": False,
                 "priority": True},
        "su": {"serve": "su", "location": "@router_su", "ensure": True, "stream_usage": True}}
    alice, bob = keys()
    assert doc["keys"] == {alice.sha256: {"name": "alice", "models": ["chat"], "priority": 3},
                           bob.sha256: {"name": "bob", "models": ["*"], "priority": 0,
                                        "peer": True}}
    assert doc["key_digests"] == {"alice": alice.sha256, "bob": bob.sha256}
    assert doc["limits"] == {"alice": {"max_concurrent": 2, "requests_per_minute": 60}}
    assert doc["over_budget"] == {"alice": {"until": 1_800_000_000, "period": "day",
                                            "limit": 1000}}
    assert (doc["max_body_mib"], doc["loading_feedback_s"], doc["host"]) == (8, 2, "node1")
    assert doc["large_bodies_per_requester"] == 16
    assert doc["peer_models"] == {"far": ["n2"], "near": ["n1"]}
    assert doc["shared"] == {"chat": ["", "n1"]}
    assert doc["peers"] == {
        "n1": {"location": "@router_peer_n1",
               "open": {"reason": "connect refused", "since": 12.5}},
        "n2": {"location": "@router_peer_n2", "open": None}}
    assert isinstance(doc["forwarded_requester"], str)
    # a peer's circuit open: Retry-After its next probe (docs/peers.md); gpud's own figures and
    # names are plain variables before CONFIG, not members of it
    assert "\nvar PEER_RETRY_AFTER_S = 5;\n" in render_script(full(), "")
    assert "peer_retry_after_s" not in doc
    bare = script_config(plain())
    assert bare["keys"] is None and bare["key_digests"] is None
    assert bare["limits"] == {} and bare["over_budget"] == {} and bare["peers"] == {}
    assert "forwarded_requester" not in bare
    assert "forwarded_requester" not in script_config(plain(keys=PLAIN_KEY))
    # a key with one limit of the two is told both
    one = keys('[keys.dave]\ntoken = "sk-dave-0123456789abcdef"\nmodels = ["*"]\n'
               'requests_per_minute = 5\n')
    assert script_config(plain(keys=one))["limits"] == {
        "dave": {"max_concurrent": None, "requests_per_minute": 5}}


@pytest.mark.parametrize("serve", ["chat", "prio", "su"])
def test_a_fronted_port_keeps_the_routers_policy(serve: str) -> None:
    policy = front_policy(full(), serve)
    # the model the script read from the body kept (the ensure's subrequest passes through
    # the server's rewrite phase too, sharing its request's variables)
    assert policy.server[:6] == (
        "        access_log /var/log/gpud/router.log gpud_router;",
        '        if ($router_model = "") {', f'            set $router_model "{serve}";',
        "        }", f"        set $router_serve {serve};",
        "        set $router_key $router_key_name;")
    assert "        error_page 429 = @router_counted;" in policy.server
    assert "        error_page 430 = @router_limited;" in policy.server
    assert "        error_page 432 = @router_quota;" in policy.server
    assert '        if ($router_quota != "") {' in policy.server
    assert policy.location == ("            limit_conn router_conn_0 2;",
                              "            limit_conn router_bodies 16;",
                              "            limit_conn_status 429;")
    assert policy.passing[-1] == "            js_body_filter router.meter buffer_type=buffer;"
    assert policy.passing[0] == "            limit_req zone=router_rpm_0 burst=59 nodelay;"


def test_a_fronted_port_under_priority_scheduling_reads_the_body_first() -> None:
    prio = front_policy(full(), "prio")
    assert prio.body_paths == ("/v1/chat/completions", "/v1/completions", "/v1/embeddings",
                          "/v1/responses")
    # the body read whole as the router's server reads it; past its bound the router's 413; a
    # location's error pages replace the server's: the counts' 429 said again
    assert prio.read[-4:] == ("            client_max_body_size 8m;",
                              "            client_body_buffer_size 8m;",
                              "            error_page 413 /.gpud-router-error/413;",
                              "            error_page 429 = @router_counted;")
    assert prio.server[-4:] == ("        location = /.gpud-router-error/413 {",
                                "            internal;", "            return 413 $router_error_413;",
                                "        }")
    assert prio.read[0] == "            limit_conn router_conn_0 2;"
    assert prio.send[2:] == ("            proxy_set_body $router_fair_body;",
                             "            limit_conn router_fair 1;",
                             "            limit_conn_dry_run on;",
                             "            limit_conn_log_level info;",
                             "            js_body_filter router.meter buffer_type=buffer;")
    su = front_policy(full(), "su")
    assert su.body_paths == ("/v1/chat/completions", "/v1/completions")
    assert su.send[2:] == ("            proxy_set_body $router_send_body;",
                           "            js_body_filter router.meter buffer_type=buffer;")
    # a serve under neither: no body rewritten; read only for its loading feedback (on
    # demand), sent as it came
    chat = front_policy(full(), "chat")
    assert chat.body_paths == () and chat.loading_paths == ROUTED_PATHS
    assert chat.read == prio.read
    assert chat.send == ("            limit_req zone=router_rpm_0 burst=59 nodelay;",
                         "            limit_req_status 430;",
                         "            js_body_filter router.meter buffer_type=buffer;")
    assert (prio.loading, prio.loading_paths) == ((), ())  # always on: gpud not asked
    assert not front_policy(full(loading_feedback_s=0), "chat").read


def test_a_fronted_port_on_demand_has_the_routers_loading_feedback() -> None:
    """The locations of the router's loading feedback, from the router's own lines
    (loading_locations, loading_named), in the fronted port's server: the script's ensure,
    the serve once gpud answered, the stream's include, the named locations, gpud's list."""
    router = full()
    chat = front_policy(router, "chat")
    lines = "\n".join(chat.loading).split("\n")
    assert lines[0] == "        set $gpud_loading 1;"
    http = text(router)
    for name in ("= /.gpud-router-ensure/chat/loading", "@router_chat_direct",
                 "^~ /.gpud-router-stream/chat/", "@router_stream_down",
                 "@router_ensure_failed", "= /.gpud-router-serves",
                 "= /.gpud-router-error/413"):
        assert location(lines, name) == location(http, name), name
    # the stream's location: the port's key rates (its own status) where the router has its
    loading = location(lines, "@router_loading")
    assert loading[1:3] == ["            limit_req zone=router_rpm_0 burst=59 nodelay;",
                            "            limit_req_status 430;"], loading
    assert loading[3:] == location(http, "@router_loading")[3:], loading


def test_a_fronted_port_without_keys_or_log_names_its_serve_and_has_the_meter() -> None:
    # without keys the port's serve is set for the script (with keys the key's check sets it)
    policy = front_policy(plain(large_bodies_per_requester=0), "tool")
    assert policy.server == ("        set $gpud_serve tool;",) and policy.location == ()
    assert policy.passing == ("            js_body_filter router.meter buffer_type=buffer;",)
    # a serve the router does not carry: counted under no model
    unknown = front_policy(plain(access_log="/l.log"), "gone")
    assert unknown.server[:4] == ("        set $gpud_serve gone;",
                                  "        access_log /l.log gpud_router;",
                                  '        if ($router_model = "") {',
                                  '            set $router_model "";')
    assert "        error_page 429 = @router_counted;" in unknown.server
    # a serve of several names: counted under its first
    assert front_policy(plain(access_log="/l.log"), "chat").server[3] == (
        '            set $router_model "chat";')
    keyed = front_policy(plain(keys=PLAIN_KEY, large_bodies_per_requester=0), "tool")
    assert keyed.server == ()


def test_a_keys_limits_are_zones_of_the_http_block() -> None:
    # alice (key 0) has max_concurrent = 2 and requests_per_minute = 60: a count zone and a
    # rate zone keyed by her name alone, in the http block the routed locations count in
    lines = http_lines(full())
    assert "    limit_conn_zone $router_limit_0 zone=router_conn_0:1m;" in lines
    assert "    limit_req_zone $router_limit_0 zone=router_rpm_0:1m rate=60r/m;" in lines
    assert lines.index("    map $router_key_name $router_limit_0 {") < lines.index(
        "    limit_conn_zone $router_limit_0 zone=router_conn_0:1m;")
    # bob has no limits: no zone of his
    assert not any("router_limit_1" in line for line in lines)
