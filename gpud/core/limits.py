"""The keys' limits in the router's nginx (docs/router.md, "Who is asking"): the zones of the
http block (limit_zones), a routed location's counts (conn_lines) and rates (limit_lines), and
the named locations of their 429s and of a key past its token budget (the pages).

Pure: keys in, nginx config lines out (gpud.core.routerconf puts them in place).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Final

from gpud.core.keys import ApiKey
from gpud.core.nginxblocks import REQUESTER_ADDR

# A body this large or larger (10^6 bytes), or of a length not given (chunked), is a large
# body: nginx holds up to max_body_mib of it in memory while it is read (client_body_buffer_size),
# so a requester's large bodies open at once are bounded (router.large_bodies_per_requester).
LARGE_BODY_BYTES: Final = 10**6
# The shared memory of the zone that counts them (one entry a requester: a 1m zone holds
# thousands).
BODIES_ZONE: Final = "router_bodies"


def limit_zones(keys: Sequence[ApiKey], large_bodies: int = 0) -> list[str]:
    """The http block's lines of the keys' limits: per limited key, a variable that is its name
    for its requests and empty for any other's (nginx counts no empty key), a limit_conn zone
    and a limit_req zone keyed by it (nginx's core ngx_http_limit_conn_module and
    ngx_http_limit_req_module: one number per zone, so one zone per key). Keyed by the js_set
    $router_key_name, known in the rewrite phase, so limit_conn (the preaccess phase) counts a
    request in the routed location, before its body is read. LARGE_BODIES (0: none): the zone
    of the requests with a large body open at once (conn_lines), by requester: the key's name,
    else the client's address."""
    out = []
    for i, k in enumerate(keys):
        if k.max_concurrent is None and k.requests_per_minute is None:
            continue
        out += [f"    map $router_key_name $router_limit_{i} {{",
                f"        {json.dumps(k.name)} {json.dumps(k.name)};",
                '        default "";',
                "    }"]
        if k.max_concurrent is not None:
            out.append(f"    limit_conn_zone $router_limit_{i} zone=router_conn_{i}:1m;")
        if k.requests_per_minute is not None:
            out.append(f"    limit_req_zone $router_limit_{i} zone=router_rpm_{i}:1m "
                       f"rate={k.requests_per_minute}r/m;")
    if large_bodies:
        digits = len(str(LARGE_BODY_BYTES - 1))
        out += [# "1": a body of LARGE_BODY_BYTES or more, or chunked (no Content-Length); ""
                # none (no body, GET) or a smaller one. nginx 1.22 refuses a request that gives
                # both (400), so the two never join.
                "    map $content_length$http_transfer_encoding $router_body_large {",
                f'        "~^[0-9]{{1,{digits}}}$" "";',
                '        "" "";',
                "        default 1;",
                "    }",
                "    map $router_key_name $router_requester_early {",
                f'        "" "addr:{REQUESTER_ADDR}";',
                "        default $router_key_name;",
                "    }",
                "    map $router_body_large $router_body_of {",
                '        "" "";',
                "        default $router_requester_early;",
                "    }",
                f"    limit_conn_zone $router_body_of zone={BODIES_ZONE}:1m;"]
    return out


def conn_lines(keys: Sequence[ApiKey], large_bodies: int = 0,
               indent: str = "            ") -> list[str]:
    """The routed locations' lines of the counts of requests open at once: a key's
    max_concurrent, and a requester's requests with a large body (LARGE_BODIES, 0: none),
    past either 429 in OpenAI's shape (@router_counted). Here, in the preaccess phase, before
    the body is read, and nowhere else: nginx counts a request once, in the first location
    whose limit_conn has a non-empty key (ngx_http_limit_conn_handler returns at once when
    r->main->limit_conn_status is set, src/http/modules/ngx_http_limit_conn_module.c), and
    holds the count until the request ends, its internal redirects included."""
    out = [f"{indent}limit_conn router_conn_{i} {k.max_concurrent};"
           for i, k in enumerate(keys) if k.max_concurrent is not None]
    if large_bodies:
        out.append(f"{indent}limit_conn {BODIES_ZONE} {large_bodies};")
    if out:
        out.append(f"{indent}limit_conn_status 429;")
    return out


def limit_lines(keys: Sequence[ApiKey], indent: str = "            ",
                status: int = 429) -> list[str]:
    """A routed location's lines of the keys' request rates (where the router sends a request
    once it knows its key: a serve's named location, the loading feedback's), past them 429 in
    OpenAI's shape (@router_limited; STATUS: nginx's own, which an error_page makes that).
    requests_per_minute: a minute's worth at once (burst), then at the rate (nginx's leaky
    bucket, `nodelay`)."""
    out = []
    for i, k in enumerate(keys):
        if k.requests_per_minute is not None:
            # nginx refuses "burst=0" (ngx_http_limit_req: a burst must be positive): one a
            # minute is no burst at all
            burst = k.requests_per_minute - 1
            out.append(f"{indent}limit_req zone=router_rpm_{i}"
                       f"{f' burst={burst}' if burst > 0 else ''} nodelay;")
    if out:
        out.append(f"{indent}limit_req_status {status};")
    return out


# A fronted port's rate refusals: nginx's status for them there, which its error page makes the
# router's 429 (@router_limited): both counts and rates are in one location there, and nginx
# says which refused a request by its status only.
FRONT_RATE_STATUS: Final = 430
COUNTED_PAGE: Final = ("        location @router_counted {",
                       # the access log's key (usage per key: the key's 429), as route() would
                       # set it
                       "            set $router_key $router_key_name;",
                       "            default_type application/json;",
                       "            add_header Retry-After 1 always;",
                       "            return 429 $router_counted_text;",
                       "        }")
LIMITED_PAGE: Final = ("        location @router_limited {",
                       "            js_content router.limited;",
                       "        }")
# A key past a token budget (gpud.core.quota; router.js quota): refused in the rewrite phase,
# before the body is read, on every way in, through this status of nginx's own (an error page
# makes it the 429 of @router_quota: code insufficient_quota, Retry-After at the period's end).
QUOTA_STATUS: Final = 432
QUOTA_CHECK: Final = ('if ($router_quota != "") {', f"    return {QUOTA_STATUS};", "}")
QUOTA_PAGE: Final = ("        location @router_quota {",
                     "            set $router_key $router_key_name;",
                     "            default_type application/json;",
                     "            add_header Retry-After $router_quota always;",
                     # OpenAI's Python client retries a 429 unless told not to (its
                     # _base_client.py _should_retry reads x-should-retry first): a used-up
                     # budget is not worth the retries
                     "            add_header x-should-retry false always;",
                     "            return 429 $router_quota_text;",
                     "        }")
