"""The router's part of the front's nginx.conf and its routing script, rendered from a
RouterFront (gpud.core.router): the main context's lines (main_lines), the http block's
(http_lines: the script, the zones, the upstreams, the router's server with its locations, a
serve's and a peer's), the policy of a fronted port (front_policy), and the script's CONFIG
(render_script).

Pure: data in, text out. ``gpud.nginx.front`` writes the text and runs nginx.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Final

from gpud.core.front import SEND_LOCATION, FrontPolicy
from gpud.core.limits import (
    COUNTED_PAGE,
    FRONT_RATE_STATUS,
    LIMITED_PAGE,
    QUOTA_CHECK,
    QUOTA_PAGE,
    QUOTA_STATUS,
    conn_lines,
    limit_lines,
    limit_zones,
)
from gpud.core.nginxblocks import (
    READ_TIMEOUT_S,
    RETRY_AFTER_S,
    ask_lines,
    direct_location,
    ensure_answers,
    ensure_lines,
    ensure_location,
    unauthorized_location,
    upstream,
)
from gpud.core.router import (
    FORWARDED_REQUESTER_RE,
    GPUD_ROUTE_KEEPALIVE,
    GPUD_ROUTE_UPSTREAM,
    PEER_CONNECT_TIMEOUT_S,
    PEER_RETRY_AFTER_S,
    PEERS_LOCATION,
    PRIORITY_ROUTES,
    REQUESTER_HEADER,
    ROUTE_LOCATION,
    ROUTED_PATHS,
    STREAM_USAGE_ROUTES,
    VIA_HEADER,
    RoutedPeer,
    RoutedServe,
    RouterFront,
    peer_table,
    shared_table,
)
from gpud.core.routerlog import LOG_FIELDS, LOG_FORMAT, PEER_FIELDS, USAGE_FIELDS

# The internal locations of the router's server (no client can name them: `internal`).
ENSURE_PREFIX: Final = "/.gpud-router-ensure/"
# ENSURE_PREFIX + serve + this: the ensure of a stream's loading feedback (router.loading).
LOADING_SUFFIX: Final = "/loading"
SERVES_LOCATION: Final = "/.gpud-router-serves"
ERROR_PREFIX: Final = "/.gpud-router-error/"
# nginx's own error answers the router gives in OpenAI's shape (router.js ERRORS): a malformed
# request, a header too large (494, nginx's own code, answered 400), a body over max_body_mib,
# a URI too long, a route it does not carry, its own internal error. Each an error page (a URI:
# a request whose line did not parse has none, and nginx redirects no such request to a named
# location) that returns the text of a js_set variable of the script: nginx's `return` reads
# no body. Also a TRACE (405), a precondition of the script's own answers (412), a
# Transfer-Encoding nginx does not read (501) and an HTTP version past 1.1 (505).
ERROR_PAGES: Final = (400, 404, 405, 412, 413, 414, 494, 500, 501, 505)
GPUD_UPSTREAM: Final = "router_gpud"
# Where the script hands a stream that waited with loading feedback to its serve: an SSI
# include of STREAM_PREFIX + serve + the route (docs/router.md, "Loading feedback").
STREAM_PREFIX: Final = "/.gpud-router-stream/"


def front_policy(router: RouterFront, serve: str) -> FrontPolicy:
    """The router's policy for SERVE's fronted port (its keys' counts and rates, the usage
    meter and the access log, the key's priority and the stream's usage in the body), its
    usage counted under the serve's first model name. Without keys, the same: the share's
    priority of each requester (its address, all of loopback one) and the usage in the
    router's one bucket without a key ("")."""
    keys = router.keys or ()
    routed = next((s for s in router.serves if s.name == serve), None)
    models = routed.models if routed is not None else ()
    counted = conn_lines(keys, router.large_bodies_per_requester)
    rates = limit_lines(keys, status=FRONT_RATE_STATUS)
    # the port's serve, which the script reads (router.js fronted; with keys, gpud.core.front
    # _keyed sets it before the key's check)
    server = [f"        set $gpud_serve {serve};"] if router.keys is None else []
    if router.access_log is not None:
        server += [f"        access_log {router.access_log} {LOG_FORMAT};",
                   # the log's fields as the router's script sets them (route()); the
                   # model the script read from the body (router.js fronted) is kept: a
                   # subrequest (the ensure) passes through the server's rewrite phase too,
                   # and shares its request's variables
                   '        if ($router_model = "") {',
                   f'            set $router_model "{models[0] if models else ""}";',
                   "        }",
                   f"        set $router_serve {serve};",
                   "        set $router_key $router_key_name;"]
    if counted:
        server += ["        error_page 429 = @router_counted;", *COUNTED_PAGE]
    if rates:
        server += [f"        error_page {FRONT_RATE_STATUS} = @router_limited;", *LIMITED_PAGE]
    if any(k.tokens_per_day is not None or k.tokens_per_month is not None for k in keys):
        server += [*(f"        {line}" for line in QUOTA_CHECK),
                   f"        error_page {QUOTA_STATUS} = @router_quota;", *QUOTA_PAGE]
    paths: tuple[str, ...] = ()
    read: list[str] = []
    send: list[str] = []
    loading: list[str] = []
    loading_paths: tuple[str, ...] = ()
    # each proxied location: the counts before the body, then on to gpud.core.front
    # PASS_LOCATION for the rates and the meter, after the counts as on the router (a
    # request refused by max_concurrent takes none of its key's rate)
    passing = (*rates, METER)
    if routed is not None and (routed.priority_scheduling or routed.stream_usage):
        paths = tuple(p for p in ROUTED_PATHS
                      if (routed.priority_scheduling and p in PRIORITY_ROUTES)
                      or (routed.stream_usage and p in STREAM_USAGE_ROUTES))
    # the 413 of a body read whole (below), the router's (its error page, in OpenAI's shape)
    too_large = [f"        location = {ERROR_PREFIX}413 {{", "            internal;",
                 "            return 413 $router_error_413;", "        }"]
    if routed is not None and routed.ensure_timeout_s is not None and \
            router.loading_feedback_s > 0:
        # Loading feedback (docs/router.md), where the port asks gpud's ensure itself
        # (gpud.core.front renders these only for such a port: FrontServe.ensure_timeout_s):
        # every routed path's body read by the script (router.js fronted), and a stream
        # sent on to the router's own loading feedback (@router_loading and the locations
        # it reaches, the router's lines: loading_locations, loading_named), its key's rates
        # there as where a request goes on (SEND_LOCATION). $gpud_loading tells the script
        # the port has them.
        loading_paths = ROUTED_PATHS
        loading = ["        set $gpud_loading 1;",
                   *(too_large if not paths else []),
                   *loading_locations(routed, routed.ensure_timeout_s, router.awake_dir),
                   *loading_named(rates),
                   # the queue's note in the comments (router.js queueNote)
                   *_gpud_list(SERVES_LOCATION, "/v1/serves")]
    if paths or loading_paths:
        # the counts before the body is read, then the whole body in memory, where the script
        # reads it (as the router's server: max_body_mib); the rates where it goes on
        # (gpud.core.front SEND_LOCATION), as the router's
        # past it the router's 413 (too_large); a location's error
        # pages replace the server's: the counts' 429 said again
        read = [*counted,
                f"            client_max_body_size {router.max_body_mib}m;",
                f"            client_body_buffer_size {router.max_body_mib}m;",
                f"            error_page 413 {ERROR_PREFIX}413;",
                *(["            error_page 429 = @router_counted;"] if counted else [])]
        server += too_large if paths else []
        # the body as the script rewrote it, each requester's share first (as the router's);
        # the request's own where the script rewrites none (a serve read for its loading
        # feedback only)
        assert routed is not None
        body = ([f"            proxy_set_body {FAIR_BODY};", *FAIR_LINES]
                if routed.priority_scheduling else _body(routed))
        send = [*rates, *body, METER]
    return FrontPolicy(tuple(server), tuple(counted), passing, paths, tuple(read), tuple(send),
                       tuple(loading), loading_paths)



def main_lines(router: RouterFront) -> list[str]:
    """Lines of the main context (before `events`): the njs module."""
    return [f"load_module {router.njs_module};"]


# What a serve under priority scheduling is sent: the body with the key's priority (0 without
# one) in its top-level "priority", every other byte as the client sent it, when the script
# set it (router.js prioritize: the bytes before the value, the value, the bytes after), else
# the request's own (a map of the http block: PRIORITY_MAP).
PRIORITY_BODY: Final = "$router_send_body"
# Its routed location sends the same, but one step behind (priority + 1: the script's
# $router_prio_over) for a request whose requester already has FAIR_SHARE requests in flight
# on the serve: so each requester's first request goes ahead of everyone's others inside the
# engine, with no setting (docs/router.md, "Who is asking"). Counted by nginx's own limit_conn,
# in dry run (nginx 1.22: ngx_http_limit_conn_handler counts a request within the limit and,
# past it, sets $limit_conn_status to REJECTED_DRY_RUN and counts nothing: the request goes on).
# A request already counted where the router took it in (a key's max_concurrent, a large body:
# conn_lines) is not counted again, as nginx counts a request once: it keeps its priority.
FAIR_BODY: Final = "$router_fair_body"
FAIR_ZONE: Final = "router_fair"
FAIR_SHARE: Final = 1
PRIORITY_MAP: Final = ("    map $router_body_head $router_send_body {",
                       '        "" $request_body;',
                       '        default "$router_body_head$router_prio$router_body_tail";',
                       "    }",
                       "    map $limit_conn_status $router_fair_prio {",
                       "        REJECTED_DRY_RUN $router_prio_over;",
                       "        default $router_prio;",
                       "    }",
                       f"    map $router_body_head {FAIR_BODY} {{",
                       '        "" $request_body;',
                       '        default "$router_body_head$router_fair_prio$router_body_tail";',
                       "    }",
                       # a requester's count on each serve (one entry a pair: a 1m zone holds
                       # thousands)
                       f'    limit_conn_zone "$router_serve $router_requester" zone={FAIR_ZONE}:1m;')
FAIR_LINES: Final = (f"            limit_conn {FAIR_ZONE} {FAIR_SHARE};",
                     "            limit_conn_dry_run on;",
                     # past the share is no error: nginx's line says so at `info`
                     "            limit_conn_log_level info;")
# The serve's own usage read as its answer passes (router.js `meter`; gpud.core.usage).
METER: Final = "            js_body_filter router.meter buffer_type=buffer;"


def _body(serve: RoutedServe) -> list[str]:
    """What SERVE is sent as the body: under priority scheduling the body the script rewrote
    with the key's priority ($router_body), else the request's own (in memory:
    client_body_buffer_size) (a stream-usage serve's too: the body the script may have asked
    for usage in, or the request's own)."""
    return ([f"            proxy_set_body {PRIORITY_BODY};"]
            if serve.priority_scheduling or serve.stream_usage else [])


def _serve_locations(serve: RoutedServe, awake_dir: str | None = None,
                     limits: Sequence[str] = ()) -> list[str]:
    body = _body(serve)
    # where the router sends it, each requester's share first (FAIR_BODY)
    fair = ([f"            proxy_set_body {FAIR_BODY};", *FAIR_LINES]
            if serve.priority_scheduling else body)
    lines = [f"        location {serve.location} {{", *limits, *fair]
    if serve.ensure_timeout_s is not None:
        # As the front's on-demand check (gpud.core.front._on_demand): 2xx yes, 403 refused
        # (503 with gpud's reason), anything else (gpud down) straight to the serve, which
        # answers if it is up (503 when it is not).
        # gpud's share (the bring-up, the queue) timed: not the router's own latency
        lines += [*ask_lines(f"{ENSURE_PREFIX}{serve.name}", "router", timed=True),
                  *ensure_answers("@router_refused", f"{serve.location}_direct", " " * 12,
                                  ["            error_page 429 = @router_limited;"]
                                  if limits else []),
                  # a location's error pages replace the server's: the serve gone between
                  # gpud's yes and the connect (nginx's 502) is named here too
                  "            error_page 502 504 = @router_down;"]
    elif serve.wait_timeout_s is not None:
        # An always-on serve: nothing asked of gpud while it answers; when it does not (no
        # connection: nginx's 502), the request waits for gpud's ensure (_starting), which is
        # answered once a start under way ends, or refused with why (stopped, failed)
        lines += [f"            error_page 502 = {serve.location}_starting;",
                  *(["            error_page 429 = @router_limited;"] if limits else []),
                  "            error_page 504 = @router_down;"]
    lines += [f"            proxy_pass http://{serve.upstream};",
              METER,
              "        }"]
    if serve.ensure_timeout_s is not None:
        lines += [*ensure_location(f"{ENSURE_PREFIX}{serve.name}",
                                   _ensure_lines(serve, serve.ensure_timeout_s)),
                  *loading_locations(serve, serve.ensure_timeout_s, awake_dir)]
    elif serve.wait_timeout_s is not None:
        lines += _starting_locations(serve, serve.wait_timeout_s, fair)
    return lines


def _ensure_lines(serve: RoutedServe, timeout_s: int) -> list[str]:
    """The inside of a location that asks gpud to have SERVE up (its ensure), waiting at most
    TIMEOUT_S: the key's own name ($router_key is the name usage is counted under)."""
    return ensure_lines(GPUD_UPSTREAM, serve.name, timeout_s, requester="$router_requester",
                        model="$router_model", key="$router_key_name")


def _starting_locations(serve: RoutedServe, timeout_s: int,
                        fair: Sequence[str]) -> list[str]:
    """The locations of an always-on serve that did not answer: its ensure (waiting at most
    TIMEOUT_S for a start under way) and the request sent again once gpud says it is up."""
    return [*ensure_location(f"{ENSURE_PREFIX}{serve.name}", _ensure_lines(serve, timeout_s)),
            f"        location {serve.location}_starting {{",
            *fair,
            *ask_lines(f"{ENSURE_PREFIX}{serve.name}", "router", timed=True),
            "            error_page 403 = @router_refused;",
            "            error_page 500 502 504 = @router_down;",
            f"            proxy_pass http://{serve.upstream};",
            METER,
            "        }"]


def loading_locations(serve: RoutedServe, timeout_s: int, awake_dir: str | None) -> list[str]:
    """The locations of SERVE's loading feedback (docs/router.md), in the router's server and
    in the server of SERVE's fronted port alike (front_policy): the ensure the script asks
    (waiting at most TIMEOUT_S), the serve once gpud answered before anything was sent (or
    did not answer), and the include of a stream that waited with loading feedback."""
    body = _body(serve)
    return [
        # The serve's ensure, asked by a stream's loading feedback (router.loading) as a
        # detached subrequest: gpud's answer is left in $router_ensured (its header
        # filter; a subrequest shares its parent's variables), which the script
        # looks at, so that nothing of the script waits on it and a client that hangs
        # up ends its request cleanly (L8). gpud unreachable: @router_ensure_failed.
        *ensure_location(f"{ENSURE_PREFIX}{serve.name}{LOADING_SUFFIX}",
                         _ensure_lines(serve, timeout_s),
                         ["            js_header_filter router.ensured;",
                          "            error_page 500 502 504 = @router_ensure_failed;"]),
        # gpud did not answer: the serve only when gpud last said it was running
        # and awake (its file), as the fronts do (gpud.core.front._on_demand); a
        # serve asleep, starting or stopped answers 503 at once (the server's
        # error page for 502: router.down, a fronted port's @down) instead of holding the
        # request. (The router's own location goes here too when its auth_request finds
        # gpud unreachable.)
        *direct_location(f"{serve.location}_direct", serve.upstream, serve.name,
                         awake_dir if serve.socket is not None else None, "502",
                         before=body, after=[METER]),
        # A stream that waited with loading feedback (the script's SSI include,
        # a subrequest: its answer goes into the stream the script began): the
        # route after the prefix, POSTed with the request's body and headers; an
        # error answer made an SSE event (router.streamed), a serve that does not
        # answer too (router.streamDown).
        f"        location ^~ {STREAM_PREFIX}{serve.name}/ {{",
        "            internal;",
        f"            rewrite ^{re.escape(STREAM_PREFIX + serve.name)}(/.*)$ $1 break;",
        "            proxy_method POST;",
        *body,
        f"            proxy_pass http://{serve.upstream};",
        "            js_body_filter router.streamed buffer_type=buffer;",
        "            error_page 502 504 = @router_stream_down;",
        "        }"]


def loading_named(limits: Sequence[str]) -> list[str]:
    """The named locations of the loading feedback, in the router's server and in a fronted
    port's alike: the stream itself (router.loadingStream: LIMITS, a key's rates, first),
    the serve not answering its include, gpud not answering the script's ensure."""
    return [
        # a stream for a serve gpud may bring up (router.loading): its key's limits first;
        # its comments leave at once (nginx holds writes under 1460 bytes otherwise:
        # ngx_http_write_filter, postpone_output; the include's output is written as the
        # main request's, under its location's setting)
        "        location @router_loading {",
        *limits,
        "            postpone_output 0;",
        "            js_content router.loadingStream;",
        "            ssi on;",
        "            ssi_types text/event-stream;",
        "        }",
        "        location @router_stream_down {",
        "            js_content router.streamDown;",
        "        }",
        # gpud did not answer a loading feedback's ensure: said to the script as a 502
        "        location @router_ensure_failed {",
        "            js_header_filter router.ensured;",
        '            return 502 "gpud unreachable";',
        "        }"]


def _peer_location(peer: RoutedPeer, host: str, limits: Sequence[str]) -> list[str]:
    """The named location a request for PEER's model is sent to (router.js route): proxied to
    the peer's router as it came (route, body, the client's other headers), with this host's
    key there in place of the client's, the requester and the hop header set by the router
    alone, and the answer streamed back as it comes. Only a connect failure, a timeout, or a
    proxy's 502/504 between the hosts (a gpud router answers neither: its own are 503s) is
    answered here, by @router_peer_down; any other answer of the peer passes as it came. No
    retry anywhere once the request went (proxy_next_upstream off)."""
    ssl = []
    if peer.scheme == "https":
        ssl = ["            proxy_ssl_server_name on;",
               f"            proxy_ssl_name {peer.host.strip('[]')};",
               "            proxy_ssl_verify on;",
               "            proxy_ssl_verify_depth 4;",
               *([f"            proxy_ssl_trusted_certificate {peer.tls_ca};"]
                 if peer.tls_ca is not None else [])]
    out: list[str] = []
    for stream in (False, True):
        out += [f"        location {peer.location}{'_stream' if stream else ''} {{",
                # a key's requests_per_minute counts here too (its own status: a peer's 429
                # is the peer's answer, passed on)
                *limits,
                *([f"            error_page {FRONT_RATE_STATUS} = @router_limited;"]
                  if limits else []),
                f"            proxy_pass {peer.scheme}://{peer.upstream};",
                # A stream is asked in HTTP/1.0, its end the connection's: a peer gone
                # mid-stream then ends the answer as a whole one (nginx finalizes an answer
                # of unknown length at the upstream's EOF with its last buffer, where a
                # chunked one cut short is an error that closes the client's connection with
                # no last buffer: ngx_http_upstream_process_non_buffered_request), which
                # router.peerStreamed sees and ends with an error event. Other requests keep
                # their connections (HTTP/1.1, keepalive).
                *(["            proxy_http_version 1.0;"] if stream else
                  ["            proxy_http_version 1.1;",
                   '            proxy_set_header Connection "";']),
                *_peer_common(peer, host, ssl)]
    return out


def _peer_common(peer: RoutedPeer, host: str, ssl: Sequence[str]) -> list[str]:
    return [f'            proxy_set_header Host "{peer.authority}";',
            f'            proxy_set_header Authorization "Bearer {peer.key}";',
            '            proxy_set_header X-Api-Key "";',
            f"            proxy_set_header {REQUESTER_HEADER} $router_requester;",
            f'            proxy_set_header {VIA_HEADER} "{host}";',
            *ssl,
            "            proxy_buffering off;",
            f"            proxy_connect_timeout {PEER_CONNECT_TIMEOUT_S}s;",
            f"            proxy_read_timeout {READ_TIMEOUT_S}s;",
            f"            proxy_send_timeout {READ_TIMEOUT_S}s;",
            "            proxy_next_upstream off;",
            "            proxy_intercept_errors on;",
            "            error_page 502 504 = @router_peer_down;",
            "            js_body_filter router.peerStreamed buffer_type=buffer;",
            "        }"]


def http_lines(router: RouterFront) -> list[str]:
    """The router's lines in the `http` block: the script, the upstreams, its server."""
    out = ["",
           "    # the router (gpud/core/router.py, docs/router.md)",
           f"    js_import router from {router.script};",
           *_script_variables()]
    if router.access_log is not None:
        fields = ",".join(f'"{name}":"{var}"' for name, var in (*LOG_FIELDS, *USAGE_FIELDS,
                                                             *PEER_FIELDS))
        out += [f"    log_format {LOG_FORMAT} escape=json '{{{fields}}}';"]
    out += limit_zones(router.keys or (), router.large_bodies_per_requester)
    if any(s.priority_scheduling or s.stream_usage for s in router.serves):
        out += PRIORITY_MAP
    out += _upstreams(router)
    limits = limit_lines(router.keys or ())
    out += _server_head(router)
    for serve in sorted(router.serves, key=lambda s: s.name):
        out += _serve_locations(serve, router.awake_dir, limits)
    out += _peers_locations(router)
    out += _server_tail(router, limits)
    return out


def _script_variables() -> list[str]:
    """The http block's variables of the script: those it sets (js_var), and those it answers
    when nginx reads them (js_set)."""
    return ["    js_var $router_model;",
            "    js_var $router_serve;",
            "    js_var $router_key;",
            "    js_var $router_requester;",
            "    js_var $router_ensure_s;",
            "    js_var $router_sse;",
            # gpud's answer to a loading feedback's ensure (router.ensured)
            "    js_var $router_ensured;",
            "    js_var $router_prompt_tokens;",
            # the body a serve under priority scheduling is sent (router.js prioritize)
            "    js_var $router_body_head;",
            "    js_var $router_body_tail;",
            "    js_var $router_prio;",
            "    js_var $router_prio_over;",
            "    js_var $router_completion_tokens;",
            # the peer a request was forwarded to (docs/peers.md), "" none
            "    js_var $router_peer;",
            # "1": the script asked the serve for a stream's usage (router.js askUsage), which
            # the meter takes out of the stream
            "    js_var $router_usage_asked;",
            # the error pages' documents (router.js: the one place of their shape)
            "    js_set $router_unauthorized router.unauthorizedText;",
            # the name of the request's key, "" none (router.js keyName: one SHA-256 a request,
            # its value kept for the request once asked)
            "    js_set $router_key_name router.keyName;",
            # the 429 of the routed locations' counts (conn_lines; @router_counted)
            "    js_set $router_counted_text router.countedText;",
            # the fronted ports' key check and requester (gpud.core.front, FrontConfig.keys)
            "    js_set $router_key_ok router.keyOk;",
            # a key past a token budget: the seconds to its period's end, "" none (router.js
            # quota), and its 429's document (QUOTA_PAGE)
            "    js_set $router_quota router.quota;",
            "    js_set $router_quota_text router.quotaText;",
            "    js_set $router_requester_of router.requesterOf;",
            # one handler, which reads the status in the URI of the error page's location
            # (ERROR_PREFIX + status), the one place each variable is asked
            *[f"    js_set $router_error_{status} router.errorPage;" for status in ERROR_PAGES]]


def _upstreams(router: RouterFront) -> list[str]:
    """The upstreams: gpud's socket (and its kept connections for GET /v1/route where there
    are peers), each serve's, each peer's router."""
    out = upstream(GPUD_UPSTREAM, f"unix:{router.gpud_socket}", keepalive=None)
    if router.peers:
        # GET /v1/route, asked at a request for a model on several hosts: its connections kept
        # (a new one per question was most of its cost)
        out += upstream(GPUD_ROUTE_UPSTREAM, f"unix:{router.gpud_socket}", GPUD_ROUTE_KEEPALIVE)
    for serve in sorted(router.serves, key=lambda s: s.name):
        out += upstream(serve.upstream, serve.server)
    for peer in sorted(router.peers, key=lambda p: p.name):
        out += upstream(peer.upstream, peer.authority)
    return out


def _budgets(router: RouterFront) -> bool:
    """Whether a key has a token budget."""
    return any(k.tokens_per_day is not None or k.tokens_per_month is not None
               for k in router.keys or ())


def _error_pages(router: RouterFront) -> list[str]:
    """The server's error pages (without their indent)."""
    return [*[f"error_page {status} {ERROR_PREFIX}{status};" for status in ERROR_PAGES],
            *(["error_page 401 = @router_unauthorized;"]
              if router.keys is not None else []),
            *([f"error_page {QUOTA_STATUS} = @router_quota;"] if _budgets(router) else []),
            "error_page 502 504 = @router_down;"]


def _routed_checks(router: RouterFront) -> str:
    """What a routed location checks before the body is read, as text to put in it: the key,
    its token budget, and the counts of its requests open at once."""
    # With keys, the key is checked in the rewrite phase, before the body is read (a
    # js_content handler reads it first: ngx_http_js_content_handler, njs 0.7.9
    # nginx/ngx_http_js_module.c; nginx's phases run rewrite before content, and a request
    # finalized there has its body discarded, never buffered: ngx_http_finalize_request ->
    # ngx_http_discard_request_body), so a client without one holds no body buffer. `return`
    # is one of the two directives safe inside a location's `if`.
    auth = ""
    if router.keys is not None:
        auth = ('            if ($router_key_name = "") {\n'
                "                return 401;\n"
                "            }\n")
    if _budgets(router):
        # past a token budget: after the key's check, before the body is read
        auth += "".join(f"            {line}\n" for line in QUOTA_CHECK)
    # the counts of requests open at once (a key's max_concurrent, a requester's large
    # bodies), after the key's check, before the body is read
    counted = conn_lines(router.keys or (), router.large_bodies_per_requester)
    # their 429 answered by nginx's `return` (@router_counted), as the body is not read: the
    # server's other error pages repeated (a location's error_page replaces the server's)
    counts = "".join(f"            {line}\n" for line in
                     [*_error_pages(router), "error_page 429 = @router_counted;"]
                     ) if counted else ""
    counts += "".join(f"{line}\n" for line in counted)
    return auth + counts


def _server_head(router: RouterFront) -> list[str]:
    """The router's server up to its serves' locations: its settings, its error pages, the
    models' list, the routed paths and gpud's list of serves."""
    mib = router.max_body_mib
    checks = _routed_checks(router)
    return [
        "    server {",
        f"        listen {router.listen};",
        # The whole body in memory, where the script reads its `model`: up to max_body_mib.
        f"        client_max_body_size {mib}m;",
        f"        client_body_buffer_size {mib}m;",
        # A body slower than this: nginx closes the connection, with no answer (a read
        # timeout ends the request in ngx_http_finalize_request: NGX_HTTP_REQUEST_TIME_OUT
        # goes to ngx_http_terminate_request, src/http/ngx_http_request.c; error_page 408
        # is never reached).
        f"        client_body_timeout {router.body_timeout_s}s;",
        f"        client_header_timeout {router.body_timeout_s}s;",
        "        recursive_error_pages on;",
        # the loading feedback's comments leave at once (nginx holds writes under 1460
        # bytes otherwise: ngx_http_write_filter, postpone_output)
        "        postpone_output 0;",
        *([f"        access_log {router.access_log} {LOG_FORMAT};"]
          if router.access_log is not None else []),
        # Every answer is OpenAI-shaped JSON, nginx's own errors too (ERROR_PAGES), their
        # text the script's (router.js errorText: the one place of the document's shape).
        # The key's check before the body (the routed locations' `if`): at the server's
        # level, so that the routed locations keep the error pages above.
        *[f"        {line}" for line in _error_pages(router)],
        "        error_page 429 = @router_limited;",
        "        location = /v1/models {",
        "            js_content router.models;",
        "        }",
        "        location ^~ /v1/models/ {",
        "            js_content router.model;",
        "        }",
        # ssi: only the script's own output (a stream's loading feedback, then its include)
        # is looked through, never a serve's (answered in other locations). With keys, the
        # key is checked before the body is read (`checks`, above).
        *[f"        location = {path} {{\n{checks}            js_content router.route;\n"
          "            ssi on;\n            ssi_types text/event-stream;\n        }"
          for path in ROUTED_PATHS],
        *_gpud_list(SERVES_LOCATION, "/v1/serves"),
    ]


def _gpud_list(location: str, path: str) -> list[str]:
    """An internal location the script asks gpud's list at (its serves, its peers)."""
    return [f"        location = {location} {{",
            "            internal;",
            f"            proxy_pass http://{GPUD_UPSTREAM}{path};",
            "            proxy_method GET;",
            "            proxy_pass_request_body off;",
            "            proxy_pass_request_headers off;",
            '            proxy_set_header Content-Length "";',
            "            proxy_read_timeout 5s;",
            "            subrequest_output_buffer_size 1m;",
            "        }"]


def _peers_locations(router: RouterFront) -> list[str]:
    """The locations of forwarding (docs/peers.md): gpud's list of peers, its answer to which
    host takes a request (GET /v1/route), the answer of a peer gone, each peer's."""
    out = []
    if router.peers:
        out += [*_gpud_list(PEERS_LOCATION, "/v1/peers"),
                f"        location = {ROUTE_LOCATION} {{",
                "            internal;",
                # the subrequest's args (model=NAME) go with it
                f"            proxy_pass http://{GPUD_ROUTE_UPSTREAM}/v1/route;",
                "            proxy_http_version 1.1;",
                '            proxy_set_header Connection "";',
                "            proxy_method GET;",
                "            proxy_pass_request_body off;",
                "            proxy_pass_request_headers off;",
                '            proxy_set_header Content-Length "";',
                "            proxy_read_timeout 5s;",
                "        }",
                "        location @router_peer_down {",
                "            js_content router.peerDown;",
                "        }"]
    peer_limits = limit_lines(router.keys or (), status=FRONT_RATE_STATUS)
    for peer in sorted(router.peers, key=lambda p: p.name):
        out += _peer_location(peer, router.host, peer_limits)
    return out


def _server_tail(router: RouterFront, limits: Sequence[str]) -> list[str]:
    """The router's server after its serves' and peers' locations: its named locations (the
    refusals, the loading feedback, a serve down), the error pages' and the default."""
    counted = conn_lines(router.keys or (), router.large_bodies_per_requester)
    return [
        *(unauthorized_location("@router_unauthorized") if router.keys is not None else []),
        # past a count of the routed locations (conn_lines): 429 before the body is read
        *(COUNTED_PAGE if counted else ()),
        *(QUOTA_PAGE if _budgets(router) else ()),
        "        location @router_refused {",
        "            js_content router.refused;",
        "        }",
        # past a key's limits (limit_lines): 429 in OpenAI's shape, which limit, Retry-After
        *LIMITED_PAGE,
        *loading_named(limits),
        "        location @router_down {",
        "            js_content router.down;",
        "        }",
        *[f"        location = {ERROR_PREFIX}{status} {{\n            internal;\n"
          f"            return {400 if status == 494 else status} $router_error_{status};"
          "\n        }" for status in ERROR_PAGES],
        # a route the router does not carry: its 404 page (ERROR_PREFIX + 404), as nginx's own
        "        location / {",
        "            return 404;",
        "        }",
        "    }",
    ]


def render_script(router: RouterFront, code: str) -> str:
    """The routing script: the table (model -> serve and its named location), then CODE
    (gpud/data/router.js). Deterministic for equal input."""
    by_name = {s.name: s for s in router.serves}
    table = {name: {"serve": serve, "location": by_name[serve].location,
                    "ensure": by_name[serve].ensure_timeout_s is not None,
                    **({"priority": True} if by_name[serve].priority_scheduling else {}),
                    **({"stream_usage": True} if by_name[serve].stream_usage else {})}
             for name, serve in sorted(router.table.items())}
    keys = None if router.keys is None else {
        k.sha256: {"name": k.name, "models": list(k.models), "priority": k.priority,
                   **({"peer": True} if k.peer else {})}
        for k in router.keys}
    limits = {k.name: {"max_concurrent": k.max_concurrent,
                       "requests_per_minute": k.requests_per_minute}
              for k in router.keys or () if k.max_concurrent or k.requests_per_minute}
    over = {o.key: {"until": o.until, "period": o.period, "limit": o.limit}
            for o in router.over_budget}
    # a key's digest by its name (router.js lookUp: the name is $router_key_name's)
    digests = None if router.keys is None else {k.name: k.sha256 for k in router.keys}
    head = {"models": table, "keys": keys, "key_digests": digests,
            "max_body_mib": router.max_body_mib,
            "retry_after_s": RETRY_AFTER_S,
            "loading_feedback_s": router.loading_feedback_s, "ensure_prefix": ENSURE_PREFIX,
            "loading_suffix": LOADING_SUFFIX,
            "stream_prefix": STREAM_PREFIX, "limits": limits, "over_budget": over,
            "large_bodies_per_requester": router.large_bodies_per_requester,
            "host": router.host,
            "peer_models": peer_table(router.table, router.peers),
            "shared": shared_table(router.table, router.peers),
            "peers": {p.name: {"location": p.location,
                               "open": None if p.closed else
                               {"reason": p.open_reason, "since": p.open_since}}
                      for p in sorted(router.peers, key=lambda p: p.name)},
            # what a peer key may forward as its requester (router.js whoOf)
            **({"forwarded_requester": FORWARDED_REQUESTER_RE.pattern}
               if any(k.peer for k in router.keys or ()) else {})}
    # gpud's own names and figures, the same for every config: plain variables, not members
    # of CONFIG (njs 0.7.9 runs the script's top level again for every request: ngx_http_js_
    # init_vm, njs_vm_clone then njs_vm_start; each member of an object literal is made again,
    # a variable with a plain value costs next to nothing)
    consts = {"FRONT_SEND": SEND_LOCATION, "PEERS_LOCATION": PEERS_LOCATION,
              "PEER_RETRY_AFTER_S": PEER_RETRY_AFTER_S, "PRIORITY_ROUTES": list(PRIORITY_ROUTES),
              "ROUTE_LOCATION": ROUTE_LOCATION, "STREAM_USAGE_ROUTES": list(STREAM_USAGE_ROUTES),
              "CUT_DIR": router.cut_dir}
    return ("// Written by gpud (gpud/core/router.py); rewritten whenever the serves change.\n"
            + "".join(f"var {name} = {json.dumps(value)};\n" for name, value in consts.items())
            + f"var CONFIG = {json.dumps(head, sort_keys=True, indent=1)};\n\n{code}")
