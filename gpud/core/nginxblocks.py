"""The nginx blocks that a fronted port (gpud.core.front) and the router (gpud.core.routerconf)
both render, written here once: a serve's upstream; the ensure, that is the internal location
that asks gpud to have a serve up before a request, the lines of a location that ask it, where
gpud's answers go, and the serve reached directly when gpud does not answer (only when its
awake file says it is up); the 401 of a key's check; the fronted port's "not running" body; and
the constants both servers read.

nginx's auth_request (ngx_http_auth_request_module) takes the subrequest's 2xx as yes, 401 and
403 as no (the request answered with that status, so an `error_page 403` sends it on) and
anything else, gpud not answering included, as an error (500).

Pure: values in, lines of nginx.conf out.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Final

# Idle keepalive connections to each serve (the front's and the router's upstreams): a new
# connect per request would add its cost to every request's latency.
KEEPALIVE: Final = 32
# Generations run for minutes and stream tokens with pauses in between: nginx's default read
# timeout of 60 s would cut a long one.
READ_TIMEOUT_S: Final = 3600
# Retry-After of a refusal when gpud gives none, and of a serve that is not running (the
# front's and the router's).
RETRY_AFTER_S: Final = 30

# The request headers gpud reads from the front's and the router's ensure (gpud.server.api.ensure):
# set by nginx only. No client header reaches gpud at all (its ensures pass none:
# proxy_pass_request_headers off); these are dropped on the way to a serve too (the http
# block's proxy_set_header to "", which nginx does not pass on: nginx has no way to drop
# headers by prefix, and a serve reads none of gpud's).
GPUD_REQUEST_HEADERS: Final = ("X-Gpud-Model", "X-Gpud-Key", "X-Gpud-Requester")

# A requester without a key is its address (docs/security.md, "Local users"): every loopback
# address is one, "loopback": any local user may send from any of 127.0.0.0/8 (and ::1), so an
# address there says nothing of who sends, and a bound per address would be one per address a
# user cares to use. Used by the router's script too (router.js requesterOf).
REQUESTER_ADDR: Final = "$gpud_requester_addr"
REQUESTER_ADDR_MAP: Final = (
    f"    map $remote_addr {REQUESTER_ADDR} {{",
    r'        "~^127\." loopback;',
    '        "::1" loopback;',
    r'        "~^::ffff:127\." loopback;',
    "        default $remote_addr;",
    "    }")


def upstream(name: str, server: str, keepalive: int | None = KEEPALIVE) -> list[str]:
    """An upstream of the http block: NAME, its one SERVER (``unix:PATH`` or ``HOST:PORT``),
    KEEPALIVE idle connections kept to it (None: none kept)."""
    return [f"    upstream {name} {{",
            f"        server {server};",
            *([f"        keepalive {keepalive};"] if keepalive is not None else []),
            "    }"]


def ensure_lines(gpud: str, serve: str, timeout_s: int, *, requester: str,
                 model: str | None = None, key: str | None = None) -> list[str]:
    """The inside of the internal location that asks gpud (its upstream GPUD) to have SERVE up
    (POST /v1/serves/SERVE/ensure), waiting at most TIMEOUT_S: no body and none of the
    client's headers, only gpud's own (GPUD_REQUEST_HEADERS): who asks (REQUESTER, an nginx
    value: gpud bounds each requester), the MODEL named and the name of the KEY, where known."""
    values = dict(zip(GPUD_REQUEST_HEADERS, (model, key, requester), strict=True))
    return ["            internal;",
            f"            proxy_pass http://{gpud}/v1/serves/{serve}/ensure;",
            "            proxy_method POST;",
            "            proxy_pass_request_body off;",
            "            proxy_pass_request_headers off;",
            '            proxy_set_header Content-Length "";',
            *(f"            proxy_set_header {name} {value};"
              for name, value in values.items() if value is not None),
            f"            proxy_read_timeout {timeout_s}s;"]


def ensure_location(uri: str, inside: Sequence[str], then: Sequence[str] = ()) -> list[str]:
    """The exact location URI of an ensure: INSIDE (ensure_lines), then lines of its own."""
    return [f"        location = {uri} {{", *inside, *then, "        }"]


def ask_lines(uri: str, prefix: str, *, timed: bool = False) -> list[str]:
    """The lines of a location that asks the ensure at URI before its request goes on: gpud's
    reason and Retry-After kept in $PREFIX_reason and $PREFIX_retry (for the refusal's answer)
    and, TIMED, how long gpud took in $PREFIX_ensure_s (gpud's share of the request's time)."""
    return [f"            auth_request {uri};",
            f"            auth_request_set ${prefix}_reason $upstream_http_x_gpud_reason;",
            f"            auth_request_set ${prefix}_retry $upstream_http_retry_after;",
            *([f"            auth_request_set ${prefix}_ensure_s $upstream_response_time;"]
              if timed else [])]


def ensure_answers(refused: str, unreachable: str, indent: str,
                   between: Sequence[str] = ()) -> list[str]:
    """Where an ensure's answers go: gpud's refusal (403) to the location REFUSED, gpud not
    answering (auth_request's 500) to UNREACHABLE; BETWEEN, lines of the location's own that
    stand between the two."""
    return [f"{indent}error_page 403 = {refused};", *between,
            f"{indent}error_page 500 = {unreachable};"]


def direct_location(name: str, upstream: str, serve: str, awake_dir: str | None,
                    asleep: str, before: Sequence[str] = (),
                    after: Sequence[str] = ()) -> list[str]:
    """The location NAME that sends a request on to SERVE's UPSTREAM when gpud did not answer
    its ensure: only when gpud last said it was running and awake (its file in AWAKE_DIR), else
    `return ASLEEP` at once, without reaching a serve asleep, starting or stopped (None: no
    such file is kept, the request goes on). BEFORE and AFTER: lines of the location's own
    around those."""
    check = [] if awake_dir is None else [
        f"            if (!-f {awake_dir.rstrip('/')}/{serve}) {{",
        f"                return {asleep};",
        "            }"]
    return [f"        location {name} {{", *before, *check,
            f"            proxy_pass http://{upstream};", *after,
            "        }"]


def unauthorized_location(name: str) -> list[str]:
    """The named location of a request whose key is refused: 401 with the router's document
    (router.js unauthorizedText, a js_set variable) and the challenge of a bearer token."""
    return [f"        location {name} {{",
            "            add_header WWW-Authenticate Bearer always;",
            "            return 401 $router_unauthorized;",
            "        }"]


def not_running(serve: str, why: str = "") -> str:
    """The body a fronted port answers for SERVE when it is not running (WHY: more of it):
    OpenAI's error document with the router's code (router.js `down`: `model_not_running`),
    written as JSON.stringify writes it, so a client reads one shape on every door."""
    return json.dumps({"error": {"message": f"serve {serve} is not running{why}",
                                 "type": "server_error", "param": None,
                                 "code": "model_not_running"}}, separators=(",", ":"))
