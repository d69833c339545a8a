"""The router: one OpenAI-compatible address for every routable serve, routed by the request
body's ``model``. Data in, nginx config lines and the routing script's table out.

The router is a server of the front's own nginx (gpud-front.service, docs/front.md), with the
njs module (Debian's libnginx-mod-http-js) loaded: a ``js_content`` handler
(gpud/data/router.js) reads the body in memory, looks its ``model`` up in the table rendered
here, and redirects the request to the serve's named location, where on-demand and sleeping
serves first ask gpud to have them up (the front's ``ensure``: nginx's auth_request) and the
request is proxied to the serve's socket or port. gpud is not on the data path: a gpud restart
cuts nothing, and running serves keep answering while gpud is down (docs/router.md).

Pure: no file, process or clock here. ``gpud.nginx.front`` writes the text and runs nginx.
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from gpud.core.front import (
    KEEPALIVE,
    PATH_RE,
    READ_TIMEOUT_S,
    REQUESTER_ADDR,
    RETRY_AFTER_S,
    SEND_LOCATION,
    FrontPolicy,
)
from gpud.core.peers import PeerModel, merge
from gpud.core.queue import Histogram
from gpud.core.quota import Over
from gpud.core.text import did_you_mean, printable
from gpud.core.usage import tokens

# The client routes of vLLM (0.32/0.33: vllm/entrypoints/**/api_router.py) whose request names
# its model in the body, carried to the serve named: JSON bodies, or multipart forms with a
# `model` field (the audio routes). Every other path answers 404 from the router itself, the
# dev and checkpoint routes (/sleep, /wake_up, /collective_rpc, /v1/load_lora_adapter,
# /update_weights ...) with them.
ROUTED_PATHS: Final = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/rerank",
    "/v1/score",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/tokenize",
    "/detokenize",
)
# A name a serve answers to: a Hugging Face id ("Qwen/Qwen3-8B"), a purpose ("chat-fast"), a
# local path (vLLM answers to its --model when no --served-model-name is given, a path too:
# vllm/entrypoints/openai/cli_args.py, served_model_name). Printable, no spaces or quotes, so
# it is written into the script and the logs as it is.
MODEL_NAME_RE: Final = re.compile(r"[A-Za-z0-9/][A-Za-z0-9._:/@+-]{0,254}")
# The njs module of Debian 12 (libnginx-mod-http-js 0.7.9, built for its nginx 1.22.1).
DEFAULT_NJS_MODULE: Final = "/usr/lib/nginx/modules/ngx_http_js_module.so"
DEFAULT_MAX_BODY_MIB: Final = 64
DEFAULT_BODY_TIMEOUT_S: Final = 30
# A requester's requests with a large body open at once (LARGE_BODY_BYTES): 16 of the default
# max_body_mib's 64 MiB are 1 GiB, a third of the front's MemoryHigh= (gpud.nginx.front).
DEFAULT_LARGE_BODIES_PER_REQUESTER: Final = 16
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
# Seconds between two SSE comments to a stream waiting on a bring-up (0: none).
DEFAULT_LOADING_FEEDBACK_S: Final = 5
# The router's access log: one JSON object a line, read by gpud for its metrics by model
# (gpud.nginx.router.RouterLog): the name of its format, and its fields (nginx variables).
LOG_FORMAT: Final = "gpud_router"
LOG_FIELDS: Final = (
    ("model", "$router_model"),
    ("serve", "$router_serve"),
    ("status", "$status"),
    ("request_s", "$request_time"),
    ("upstream_s", "$upstream_response_time"),
    ("ensure_s", "$router_ensure_s"),
    ("sse", "$router_sse"),
)
# The access log's fields of usage per key (gpud.core.usage): the key's name, when the request
# ended (Unix time, ms), the tokens of the serve's own `usage` (router.js `meterScan`; "" none),
# and whether the whole answer was sent ("OK"; "": the client hung up first: nginx sets
# r->request_complete only on ngx_http_finalize_request's path of a request done, never on
# ngx_http_terminate_request's, src/http/ngx_http_request.c).
USAGE_FIELDS: Final = (
    ("key", "$router_key"),
    ("ts", "$msec"),
    ("prompt_tokens", "$router_prompt_tokens"),
    ("completion_tokens", "$router_completion_tokens"),
    ("complete", "$request_completion"),
)
# The access log's field of forwarding (docs/peers.md): the peer a request went to, "" none.
PEER_FIELDS: Final = (("peer", "$router_peer"),)
# The routes whose body vLLM reads a `priority` from (an int, lower first, under
# --scheduling-policy priority; vllm 0.32 vllm/config/scheduler.py `policy`, and the field in
# entrypoints/openai/{chat_completion,completion,responses}/protocol.py and
# entrypoints/pooling/base/protocol.py): the router sets it to the key's priority there.
PRIORITY_ROUTES: Final = ("/v1/chat/completions", "/v1/completions", "/v1/responses",
                          "/v1/embeddings")
# The routes whose stream carries its usage in a last chunk of its own only when the body asks
# (`stream_options.include_usage`; vllm 0.32 entrypoints/serve/utils/api_utils.py
# should_include_usage, and the stream generators of entrypoints/openai/chat_completion/
# serving.py and completion/serving.py): on a stream-usage serve the router asks for it
# (router.js askUsage) and the client is sent the stream it would have had.
STREAM_USAGE_ROUTES: Final = ("/v1/chat/completions", "/v1/completions")
# The requester of an ensure that names none (root's own call, an older front).
ANONYMOUS: Final = "anonymous"
# What a peer key's request may forward as its requester (X-Gpud-Requester; docs/peers.md,
# "Who is asking, across hosts"): the peer's own requester, a key's name or "addr:" and an
# address (an IPv6 one has colons), at most 64. No "/": a forwarded requester is never forwarded
# on. The router refuses anything else (400 invalid_requester, the header named).
FORWARDED_REQUESTER_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@:-]{0,63}")
# A requester as gpud keeps it: a key's name (at most 64), "addr:" and an address (an IPv6 one:
# 46), or a peer's forwarded requester, PEER/NAME (64 + 1 + 64).
MAX_REQUESTER: Final = 129


def model_name_problem(name: str) -> str | None:
    if not MODEL_NAME_RE.fullmatch(name):
        return (f"{name!r} is not a model name (a letter, digit or '/', then letters, digits and "
                ". _ : / @ + -; at most 255)")
    return None


def listen_problem(listen: str) -> str | None:
    """Why LISTEN is not HOST:PORT (an IPv4 address, or an IPv6 one in brackets)."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        return f"{listen!r} is not HOST:PORT (e.g. 127.0.0.1:8000)"
    if not re.fullmatch(r"[0-9.]+|\[[0-9A-Fa-f:.]+\]|localhost", host):
        return f"{listen!r}: the host is an IP address (IPv6 in brackets) or localhost"
    return None


def listen_port(listen: str) -> int:
    return int(listen.rpartition(":")[2])


def routing_table(names: Mapping[str, Sequence[str]]) -> dict[str, str]:
    """Model name -> serve, from each routed serve's names. One name on two serves is a
    ValueError naming both (and the name)."""
    table: dict[str, str] = {}
    for serve in sorted(names):
        for name in names[serve]:
            other = table.get(name)
            if other is not None and other != serve:
                raise ValueError(f"model name {name!r} is on two serves: {other} and {serve}")
            table[name] = serve
    return table


def duplicate_names(names: Mapping[str, Sequence[str]]) -> list[str]:
    """Every name on more than one serve, as a problem naming the serves."""
    owners: dict[str, list[str]] = {}
    for serve in sorted(names):
        for name in dict.fromkeys(names[serve]):
            owners.setdefault(name, []).append(serve)
    return [f"model name {name!r} is on serves {' and '.join(serves)}: one name, one serve"
            for name, serves in sorted(owners.items()) if len(serves) > 1]


# A key's token: long enough not to be guessed, printable, no spaces.
TOKEN_RE: Final = re.compile(r"[\x21-\x7e]{16,512}")
KEY_NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
ALL_MODELS: Final = "*"


@dataclass(frozen=True)
class ApiKey:
    """A bearer token of router.api_keys_file, kept as its SHA-256 only (the routing script
    is readable by others), with the names it may use ("*": all)."""

    name: str
    sha256: str
    models: tuple[str, ...]
    # docs/router.md, "Who is asking": in the data path (nginx's limit_conn / limit_req), and
    # gpud's queue (priority: smaller first; weight: its share among those waiting)
    max_concurrent: int | None = None
    requests_per_minute: int | None = None
    priority: int = 0
    weight: float = 1.0
    # docs/router.md, "Budgets": prompt + completion tokens a UTC day and month (gpud.core.quota)
    tokens_per_day: int | None = None
    tokens_per_month: int | None = None
    # docs/peers.md, "Who is asking, across hosts": the key another gpud host presents, whose
    # forwarded requester (X-Gpud-Requester) the router takes, as PEER/NAME (forwarded_requester)
    peer: bool = False


def parse_keys(text: str, known: Iterable[str]) -> tuple[list[ApiKey], list[str]]:
    """The keys of an api_keys_file's TOML text, and its problems (each naming its key):

        [keys.alice]
        token = "sk-..."            # at least 16 printable characters
        models = ["chat", "ocr"]    # or ["*"]: every model

    or, instead of the token, its SHA-256 (64 hex digits: the file then holds no token;
    `gpuctl keys add` writes it so): sha256 = "9f86d0..."; and `peer = true` on the key another
    gpud host presents (docs/peers.md).
    """
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        return [], [f"not TOML: {exc}"]
    problems = [f"{key}: unknown key (only [keys.NAME] tables)" for key in doc if key != "keys"]
    table = doc.get("keys", {})
    if not isinstance(table, dict):
        return [], ["keys: must be a table of [keys.NAME] tables"]
    names = set(known)
    keys: list[ApiKey] = []
    seen: dict[str, str] = {}
    for name, entry in sorted(table.items()):
        where = f"keys.{name}"
        if not KEY_NAME_RE.fullmatch(name):
            problems.append(f"{where}: not a key name (letters, digits, . _ @ -)")
            continue
        allowed = (*KEY_SECRETS, "models", *KEY_SHARES, "peer")
        if not isinstance(entry, dict):
            problems.append(f"{where}: a table of token (or sha256), models, "
                            f"{', '.join(KEY_SHARES)} and peer only")
            continue
        unknown_keys = sorted(set(entry) - set(allowed))
        if unknown_keys:
            problems += [f"{where}.{k}: unknown key{did_you_mean(k, allowed)} (a key's table "
                         f"has {', '.join(allowed)})" for k in unknown_keys]
            continue
        shares, wrong = key_shares(entry, where)
        if wrong:
            problems += wrong
            continue
        digest, wrong = key_digest(entry, where)
        if digest is None:
            problems += wrong
            continue
        peer = entry.get("peer", False)
        if not isinstance(peer, bool):
            problems.append(f"{where}.peer: true or false (got {peer!r}): true marks the key "
                            "another gpud host presents, whose forwarded requester is taken")
            continue
        models = entry.get("models")
        if not isinstance(models, list) or not models or \
                not all(isinstance(m, str) for m in models):
            problems.append(f"{where}.models: a list of model names (or [\"*\"])")
            continue
        unknown = [m for m in models if m != ALL_MODELS and m not in names]
        if unknown:
            problems.append(f"{where}.models: no serve answers to {', '.join(map(repr, unknown))}")
            continue
        if digest in seen:
            field = "token" if "token" in entry else "sha256"
            problems.append(f"{where}.{field}: the same token as keys.{seen[digest]}")
            continue
        seen[digest] = name
        mc, rpm = shares.get("max_concurrent"), shares.get("requests_per_minute")
        keys.append(ApiKey(name, digest, tuple(dict.fromkeys(models)),
                           max_concurrent=None if mc is None else int(mc),
                           requests_per_minute=None if rpm is None else int(rpm),
                           priority=int(shares.get("priority", 0)),
                           weight=float(shares.get("weight", 1.0)),
                           tokens_per_day=_whole(shares.get("tokens_per_day")),
                           tokens_per_month=_whole(shares.get("tokens_per_month")),
                           peer=peer))
    return keys, problems


def _whole(value: int | float | None) -> int | None:
    return None if value is None else int(value)


# How a key's table gives its token: the token itself, or its SHA-256 (what the router compares:
# a file of digests holds no token a reader could use).
KEY_SECRETS: Final = ("token", "sha256")
SHA256_RE: Final = re.compile(r"[0-9a-f]{64}")


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def key_digest(entry: Mapping[str, object], where: str) -> tuple[str | None, list[str]]:
    """The SHA-256 of a key's token, from its table's token or sha256 (exactly one of them),
    and the problem (naming the key) when there is none."""
    token, digest = entry.get("token"), entry.get("sha256")
    if token is not None and digest is not None:
        return None, [f"{where}: token or sha256, not both"]
    if digest is not None:
        if not isinstance(digest, str) or not SHA256_RE.fullmatch(digest.lower()):
            return None, [f"{where}.sha256: the token's SHA-256, 64 hex digits"]
        return digest.lower(), []
    if not isinstance(token, str) or not TOKEN_RE.fullmatch(token):
        return None, [f"{where}.token: at least 16 printable characters, no spaces"]
    return token_digest(token), []


# A key's limits and shares (docs/router.md, "Who is asking"): name -> (smallest, largest).
# nginx refuses a limit_conn of 65536 and more ("connection limit must be less 65536",
# ngx_http_limit_conn_module.c): the whole front's config with it.
KEY_SHARES: Final[Mapping[str, tuple[float, float]]] = {
    "max_concurrent": (1, 65_535),
    "requests_per_minute": (1, 1_000_000),
    "priority": (-1000, 1000),
    "weight": (0.01, 1000.0),
    # budgets (gpud.core.quota): 0 lets no request in
    "tokens_per_day": (0, 10**15),
    "tokens_per_month": (0, 10**15),
}


def key_shares(entry: Mapping[str, object], where: str
               ) -> tuple[dict[str, int | float], list[str]]:
    """A key's limits and shares from its table, and its problems (each naming the key)."""
    out: dict[str, int | float] = {}
    problems = []
    for field, (low, high) in KEY_SHARES.items():
        value = entry.get(field)
        if value is None:
            continue
        whole = field != "weight"
        if isinstance(value, bool) or not isinstance(value, int | float) or \
                (whole and not isinstance(value, int)) or not low <= value <= high:
            shown = (f"{int(low)} to {int(high)}" if whole else f"{low:g} to {high:g}")
            problems.append(f"{where}.{field}: {'an integer' if whole else 'a number'} from "
                            f"{shown} (got {value!r})")
            continue
        out[field] = int(value) if whole else float(value)
    return out, problems


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


def front_policy(router: RouterFront, serve: str) -> FrontPolicy:
    """The router's policy for SERVE's fronted port (its keys' counts and rates, the usage
    meter and the access log, the key's priority and the stream's usage in the body), its
    usage counted under the serve's first model name."""
    keys = router.keys or ()
    routed = next((s for s in router.serves if s.name == serve), None)
    models = routed.models if routed is not None else ()
    counted = conn_lines(keys, router.large_bodies_per_requester)
    rates = limit_lines(keys, status=FRONT_RATE_STATUS)
    server = []
    if router.access_log is not None:
        server += [f"        access_log {router.access_log} {LOG_FORMAT};",
                   # the log's fields as the router's script sets them (route())
                   f'        set $router_model "{models[0] if models else ""}";',
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
    # each proxied location: the counts before the body, then on to gpud.core.front
    # PASS_LOCATION for the rates and the meter, after the counts as on the router (a
    # request refused by max_concurrent takes none of its key's rate)
    passing = (*rates, METER)
    if routed is not None and (routed.priority_scheduling or routed.stream_usage):
        paths = tuple(p for p in ROUTED_PATHS
                      if (routed.priority_scheduling and p in PRIORITY_ROUTES)
                      or (routed.stream_usage and p in STREAM_USAGE_ROUTES))
        # the counts before the body is read, then the whole body in memory, where the script
        # reads it (as the router's server: max_body_mib); the rates where it goes on
        # (gpud.core.front SEND_LOCATION), as the router's
        read = [*counted,
                f"            client_max_body_size {router.max_body_mib}m;",
                f"            client_body_buffer_size {router.max_body_mib}m;"]
        # the body as the script rewrote it, each requester's share first (as the router's)
        send = [*rates, *([f"            proxy_set_body {FAIR_BODY};", *FAIR_LINES]
                          if routed.priority_scheduling else
                          [f"            proxy_set_body {PRIORITY_BODY};"]), METER]
    return FrontPolicy(tuple(server), tuple(counted), passing, paths, tuple(read), tuple(send))


@dataclass(frozen=True)
class RoutedServe:
    """One serve behind the router: the names it answers to, where it listens (a Unix socket
    path, or a TCP port on loopback), and whether gpud is asked to have it up before each
    request (on demand, or able to sleep), waiting at most ensure_timeout_s."""

    name: str
    models: tuple[str, ...]
    socket: str | None = None
    port: int | None = None
    ensure_timeout_s: int | None = None
    # a serve gpud does not bring up for a request (always on: its operator's or the boot's to
    # start): gpud is asked only when it does not answer (nginx's 502: starting, stopped,
    # restarting after a crash), waiting at most wait_timeout_s for a start under way
    wait_timeout_s: int | None = None
    # launched with --scheduling-policy priority (vLLM orders its waiting requests by the
    # body's `priority`, lower first): the router sets it to the key's (PRIORITY_ROUTES)
    priority_scheduling: bool = False
    # a vLLM serve (it reads stream_options.include_usage): on a streamed chat or completions
    # request whose client did not ask for usage, the router asks for it, and takes the chunk
    # that carries it out of the stream (STREAM_USAGE_ROUTES; router.js askUsage)
    stream_usage: bool = False

    def __post_init__(self) -> None:
        if (self.socket is None) == (self.port is None):
            raise ValueError(f"router: serve {self.name}: give exactly one of socket or port")
        if self.socket is not None and not PATH_RE.fullmatch(self.socket):
            raise ValueError(f"router: serve {self.name}: socket {self.socket!r} is not a "
                             "plain absolute path")
        for model in self.models:
            problem = model_name_problem(model)
            if problem:
                raise ValueError(f"router: serve {self.name}: {problem}")

    @property
    def upstream(self) -> str:
        return f"router_{self.name.replace('-', '_')}"

    @property
    def location(self) -> str:
        return f"@{self.upstream}"

    @property
    def server(self) -> str:
        return f"unix:{self.socket}" if self.socket is not None else f"127.0.0.1:{self.port}"


# Forwarding to a peer (docs/peers.md): the hop header (a request that carries it came from a
# host's router and is never forwarded again), the requester forwarded with it, the named
# location of each peer, and the seconds of Retry-After while a peer's circuit is open (its
# next probe: gpud.host.peers polls every 5 s).
VIA_HEADER: Final = "X-Gpud-Via"
REQUESTER_HEADER: Final = "X-Gpud-Requester"
PEER_PREFIX: Final = "router_peer_"
PEER_RETRY_AFTER_S: Final = 5
# A peer that does not take the connection within this long is down (its circuit's failure).
PEER_CONNECT_TIMEOUT_S: Final = 3
PEERS_LOCATION: Final = "/.gpud-router-peers"
# gpud's answer to which host takes a request for a model on several hosts (GET /v1/route)
ROUTE_LOCATION: Final = "/.gpud-router-route"
# its upstream (gpud's socket, connections kept: each worker keeps at most this many idle; gpud
# keeps the front's uid connections apart, gpud.server.connguard)
GPUD_ROUTE_UPSTREAM: Final = "router_gpud_route"
GPUD_ROUTE_KEEPALIVE: Final = 2
# A peer's key as nginx.conf carries it (proxy_set_header): no quote, backslash, `$` (nginx
# reads a variable there), `;`, brace or space.
PEER_KEY_RE: Final = re.compile(r"[A-Za-z0-9._~+/=:@%!*,^|-]{1,512}")
HOST_NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,252}")


def peer_key_problem(key: str) -> str | None:
    if not PEER_KEY_RE.fullmatch(key):
        return ("the key holds a character the router cannot send as it is (a quote, a "
                "backslash, `$`, `;`, a brace or a space)")
    return None


@dataclass(frozen=True)
class RoutedPeer:
    """A peer the router forwards requests to (docs/peers.md): its router's address (SCHEME,
    HOST, PORT), the key this host presents there, the models it offers here that no serve of
    this host answers to, its CA for https, and, while its circuit is not closed, why and since
    when (requests for its models are then answered 503 at once)."""

    name: str
    scheme: str
    host: str
    port: int
    key: str
    models: tuple[str, ...] = ()
    tls_ca: str | None = None
    open_reason: str | None = None
    open_since: float | None = None

    def __post_init__(self) -> None:
        problem = peer_key_problem(self.key)
        if problem:
            raise ValueError(f"router: peer {self.name}: {problem}")
        if self.scheme not in ("http", "https"):
            raise ValueError(f"router: peer {self.name}: scheme {self.scheme!r}")
        if self.scheme == "https" and (self.tls_ca is None or not PATH_RE.fullmatch(self.tls_ca)):
            raise ValueError(f"router: peer {self.name}: https needs the CA file nginx checks "
                             f"its certificate against, a plain absolute path (got "
                             f"{self.tls_ca!r})")
        if not re.fullmatch(r"[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\]", self.host):
            raise ValueError(f"router: peer {self.name}: host {self.host!r}")
        for model in self.models:
            problem = model_name_problem(model)
            if problem:
                raise ValueError(f"router: peer {self.name}: {problem}")

    @property
    def upstream(self) -> str:
        return f"{PEER_PREFIX}{self.name.replace('-', '_')}"

    @property
    def location(self) -> str:
        return f"@{self.upstream}"

    @property
    def authority(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def closed(self) -> bool:
        return self.open_reason is None


def peer_address(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of a peer's router URL (gpud.core.peers.url_problem's shape; the
    port the scheme's when not given)."""
    scheme, _, rest = url.partition("://")
    authority = rest.split("/", 1)[0]
    if authority.startswith("["):
        host, _, after = authority.partition("]")
        host += "]"
        port_text = after[1:]
    else:
        host, _, port_text = authority.partition(":")
    scheme = scheme.lower()
    return scheme, host, int(port_text) if port_text else 443 if scheme == "https" else 80


def peer_table(local: Iterable[str], peers: Sequence[RoutedPeer]) -> dict[str, list[str]]:
    """Model name -> the peers (by name) a request for it may go to, in the order tried: a
    model no serve of this host answers to (a local serve's name stays here), from the one
    list of every host's models (gpud.core.peers.merge: this host first, then the peers by
    name)."""
    merged = merge([PeerModel(m) for m in local],
                   {p.name: [PeerModel(m) for m in p.models] for p in peers})
    return {m.id: [h.host for h in m.hosts if h.host is not None]
            for m in merged if m.hosts[0].host is not None}


def shared_table(local: Iterable[str], peers: Sequence[RoutedPeer]) -> dict[str, list[str]]:
    """Model name -> every host that offers it ("" this host, then the peers by name), for the
    models on more than one host: a request for one of these asks gpud which host takes it
    (GET /v1/route, gpud.core.peers.choose_host); one on a single host never does."""
    merged = merge([PeerModel(m) for m in local],
                   {p.name: [PeerModel(m) for m in p.models] for p in peers})
    return {m.id: [h.host or "" for h in m.hosts] for m in merged if len(m.hosts) > 1}


@dataclass(frozen=True)
class RouterFront:
    """The router's part of the front's nginx.conf."""

    listen: str
    serves: tuple[RoutedServe, ...]
    njs_module: str = DEFAULT_NJS_MODULE
    # where gpud writes the routing script (render_script)
    script: str = "/run/gpud/front/router.js"
    gpud_socket: str = "/run/gpud/gpud.sock"
    max_body_mib: int = DEFAULT_MAX_BODY_MIB
    body_timeout_s: int = DEFAULT_BODY_TIMEOUT_S
    # a requester's requests with a large body open at once (LARGE_BODY_BYTES; 0: no bound)
    large_bodies_per_requester: int = DEFAULT_LARGE_BODIES_PER_REQUESTER
    # None: open to whoever reaches `listen`
    keys: tuple[ApiKey, ...] | None = None
    # SSE comments every this many seconds to a stream waiting on a bring-up (0: none)
    loading_feedback_s: int = DEFAULT_LOADING_FEEDBACK_S
    # the access log gpud reads (LOG_FIELDS); None: none
    access_log: str | None = None
    # Where gpud keeps a file per fronted serve that is running and awake (gpud.nginx.front.awake_dir):
    # what the router goes by when gpud does not answer, as the fronts do. None: no check.
    awake_dir: str | None = None
    # the keys past a token budget, and until when (gpud.core.quota: gpud decides it as it
    # stores usage; the script compares the time)
    over_budget: tuple[Over, ...] = ()
    # the peers whose models a request may be forwarded to (docs/peers.md), and this host's
    # name as it tells them (X-Gpud-Via, the hop header) and lists itself (gpud.host)
    peers: tuple[RoutedPeer, ...] = ()
    host: str = "localhost"

    def __post_init__(self) -> None:
        problem = listen_problem(self.listen)
        if problem:
            raise ValueError(f"router: listen: {problem}")
        for path in (self.njs_module, self.script, self.gpud_socket,
                     *([self.access_log] if self.access_log is not None else []),
                     *([self.awake_dir] if self.awake_dir is not None else [])):
            if not path.startswith("/") or not PATH_RE.fullmatch(path):
                raise ValueError(f"router: {path!r} is not a plain absolute path")
        routing_table({s.name: s.models for s in self.serves})  # one name, one serve
        if not HOST_NAME_RE.fullmatch(self.host):
            raise ValueError(f"router: host name {self.host!r} is not letters, digits, . and -")
        names = [p.name for p in self.peers]
        if len(set(names)) != len(names):
            raise ValueError(f"router: a peer named twice in {names}")

    @property
    def table(self) -> dict[str, str]:
        return routing_table({s.name: s.models for s in self.serves})


@dataclass(frozen=True)
class RouterRequest:
    """The request through the router or a front that asked gpud to have a serve up (its
    ensure's X-Gpud-Model, X-Gpud-Key and X-Gpud-Requester, set by nginx only: a client's own
    X-Gpud-* headers never reach gpud, GPUD_REQUEST_HEADERS): the model it named (None: a
    request to a serve's own port, which names none), the key it used (None: no keys), and
    who asked (its requester: the key's name, else ``addr:`` and the client's address; every
    loopback address is one, ``addr:loopback``), as the journal names it and as
    gpud's bounds and queue tell requesters apart."""

    model: str | None
    key: str | None = None
    requester: str = ""

    def __post_init__(self) -> None:
        if not self.requester:
            object.__setattr__(self, "requester", self.key or ANONYMOUS)

    @property
    def text(self) -> str:
        # printable: whatever reaches gpud's socket is logged escaped
        if self.model is None:
            return f"on-demand request from {printable(self.requester[:MAX_REQUESTER])!r}"
        key = "" if not self.key else f" with key {printable(self.key[:64])!r}"
        return f"request for model {printable(self.model[:256])!r}{key} through the router"


@dataclass(frozen=True)
class Crowded:
    """Why an ensure is refused by EnsureBound: the config key of the bound it is at, its
    figure, and the text (the router's 429 names both: router.js rateLimited)."""

    limit: str
    value: int
    text: str


@dataclass
class EnsureBound:
    """The ensures under way, by requester (gpud.server.api.ensure): at most PER_REQUESTER for one
    requester and TOTAL in all, so that one requester's waiting requests neither starve
    another's bring-up nor take the connections of the front's uid that reads need."""

    per_requester: int
    total: int
    by: dict[str, int]

    @classmethod
    def empty(cls, per_requester: int, total: int) -> EnsureBound:
        return cls(per_requester, total, {})

    @property
    def waiting(self) -> int:
        return sum(self.by.values())

    def enter(self, requester: str) -> Crowded | None:
        """Count one more ensure of REQUESTER; or why not (nothing counted)."""
        mine = self.by.get(requester, 0)
        if mine >= self.per_requester:
            limit = "daemon.ensure_waiting_per_requester"
            return Crowded(limit, self.per_requester,
                           f"{mine} requests of {requester} wait for a bring-up already ({limit})")
        if self.waiting >= self.total:
            limit = "daemon.ensure_waiting_total"
            return Crowded(limit, self.total,
                           f"{self.total} requests wait for a bring-up already ({limit})")
        self.by[requester] = mine + 1
        return None

    def leave(self, requester: str) -> None:
        left = self.by.get(requester, 1) - 1
        if left > 0:
            self.by[requester] = left
        else:
            self.by.pop(requester, None)


def router_request(headers: Mapping[str, str]) -> RouterRequest | None:
    """The RouterRequest of an ensure's headers (X-Gpud-Model, X-Gpud-Key, X-Gpud-Requester:
    nginx's, never a client's), None when it carries none (root asking by hand)."""
    model = headers.get("X-Gpud-Model") or None
    key = headers.get("X-Gpud-Key") or None
    requester = (headers.get("X-Gpud-Requester") or "")[:MAX_REQUESTER]
    if model is None and key is None and not requester:
        return None
    return RouterRequest(model, key, requester)


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


def _ensure_lines(serve: RoutedServe, timeout_s: int) -> list[str]:
    """The inside of a location that asks gpud to have SERVE up (its ensure), waiting at most
    TIMEOUT_S."""
    return ["            internal;",
            f"            proxy_pass http://{GPUD_UPSTREAM}/v1/serves/{serve.name}/ensure;",
            "            proxy_method POST;",
            "            proxy_pass_request_body off;",
            # none of the client's headers: gpud's X-Gpud-* are the router's alone
            "            proxy_pass_request_headers off;",
            '            proxy_set_header Content-Length "";',
            "            proxy_set_header X-Gpud-Model $router_model;",
            # the key's own name ($router_key is the name usage is counted under)
            "            proxy_set_header X-Gpud-Key $router_key_name;",
            "            proxy_set_header X-Gpud-Requester $router_requester;",
            f"            proxy_read_timeout {timeout_s}s;"]


def _serve_locations(serve: RoutedServe, awake_dir: str | None = None,
                     limits: Sequence[str] = ()) -> list[str]:
    # a serve under priority scheduling gets the body the script rewrote with the key's
    # priority ($router_body), else the request's own (in memory: client_body_buffer_size)
    # (a stream-usage serve's too: the body the script may have asked for usage in, or the
    # request's own)
    body = ([f"            proxy_set_body {PRIORITY_BODY};"]
            if serve.priority_scheduling or serve.stream_usage else [])
    # where the router sends it, each requester's share first (FAIR_BODY)
    fair = ([f"            proxy_set_body {FAIR_BODY};", *FAIR_LINES]
            if serve.priority_scheduling else body)
    lines = [f"        location {serve.location} {{", *limits, *fair]
    if serve.ensure_timeout_s is not None:
        # As the front's on-demand check (gpud.core.front._on_demand): 2xx yes, 403 refused
        # (503 with gpud's reason), anything else (gpud down) straight to the serve, which
        # answers if it is up (503 when it is not).
        lines += [f"            auth_request {ENSURE_PREFIX}{serve.name};",
                  "            auth_request_set $router_reason $upstream_http_x_gpud_reason;",
                  "            auth_request_set $router_retry $upstream_http_retry_after;",
                  # gpud's share (the bring-up, the queue): not the router's own latency
                  "            auth_request_set $router_ensure_s $upstream_response_time;",
                  "            error_page 403 = @router_refused;",
                  *(["            error_page 429 = @router_limited;"] if limits else []),
                  f"            error_page 500 = {serve.location}_direct;",
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
    if serve.ensure_timeout_s is None and serve.wait_timeout_s is not None:
        lines += [f"        location = {ENSURE_PREFIX}{serve.name} {{",
                  *_ensure_lines(serve, serve.wait_timeout_s),
                  "        }",
                  f"        location {serve.location}_starting {{",
                  *fair,
                  f"            auth_request {ENSURE_PREFIX}{serve.name};",
                  "            auth_request_set $router_reason $upstream_http_x_gpud_reason;",
                  "            auth_request_set $router_retry $upstream_http_retry_after;",
                  "            auth_request_set $router_ensure_s $upstream_response_time;",
                  "            error_page 403 = @router_refused;",
                  "            error_page 500 502 504 = @router_down;",
                  f"            proxy_pass http://{serve.upstream};",
                  METER,
                  "        }"]
    if serve.ensure_timeout_s is not None:
        ensure = _ensure_lines(serve, serve.ensure_timeout_s)
        lines += [f"        location = {ENSURE_PREFIX}{serve.name} {{",
                  *ensure,
                  "        }",
                  # The same ensure, asked by a stream's loading feedback (router.loading) as a
                  # detached subrequest: gpud's answer is left in $router_ensured (its header
                  # filter; a subrequest shares its parent's variables), which the script
                  # looks at, so that nothing of the script waits on it and a client that hangs
                  # up ends its request cleanly (L8). gpud unreachable: @router_ensure_failed.
                  f"        location = {ENSURE_PREFIX}{serve.name}{LOADING_SUFFIX} {{",
                  *ensure,
                  "            js_header_filter router.ensured;",
                  "            error_page 500 502 504 = @router_ensure_failed;",
                  "        }",
                  f"        location {serve.location}_direct {{",
                  *body,
                  # gpud did not answer: the serve only when gpud last said it was running
                  # and awake (its file), as the fronts do (gpud.core.front._on_demand); a
                  # serve asleep, starting or stopped answers 503 at once (the server's
                  # error page for 502: router.down) instead of holding the request
                  *([f"            if (!-f {awake_dir.rstrip('/')}/{serve.name}) {{",
                     "                return 502;",
                     "            }"] if awake_dir is not None and serve.socket is not None
                    else []),
                  f"            proxy_pass http://{serve.upstream};",
                  METER,
                  "        }",
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
    return lines


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
    mib = router.max_body_mib
    out = ["",
           "    # the router (gpud/core/router.py, docs/router.md)",
           f"    js_import router from {router.script};",
           "    js_var $router_model;",
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
           *[f"    js_set $router_error_{status} router.error{status};"
             for status in ERROR_PAGES]]
    if router.access_log is not None:
        fields = ",".join(f'"{name}":"{var}"' for name, var in (*LOG_FIELDS, *USAGE_FIELDS,
                                                             *PEER_FIELDS))
        out += [f"    log_format {LOG_FORMAT} escape=json '{{{fields}}}';"]
    out += limit_zones(router.keys or (), router.large_bodies_per_requester)
    if any(s.priority_scheduling or s.stream_usage for s in router.serves):
        out += PRIORITY_MAP
    out += [f"    upstream {GPUD_UPSTREAM} {{",
            f"        server unix:{router.gpud_socket};",
            "    }"]
    if router.peers:
        # GET /v1/route, asked at a request for a model on several hosts: its connections kept
        # (a new one per question was most of its cost)
        out += [f"    upstream {GPUD_ROUTE_UPSTREAM} {{",
                f"        server unix:{router.gpud_socket};",
                f"        keepalive {GPUD_ROUTE_KEEPALIVE};",
                "    }"]
    for serve in sorted(router.serves, key=lambda s: s.name):
        out += [f"    upstream {serve.upstream} {{",
                f"        server {serve.server};",
                f"        keepalive {KEEPALIVE};",
                "    }"]
    for peer in sorted(router.peers, key=lambda p: p.name):
        out += [f"    upstream {peer.upstream} {{",
                f"        server {peer.authority};",
                f"        keepalive {KEEPALIVE};",
                "    }"]
    # With keys, the key is checked in the rewrite phase, before the body is read (a
    # js_content handler reads it first: ngx_http_js_content_handler, njs 0.7.9
    # nginx/ngx_http_js_module.c; nginx's phases run rewrite before content, and a request
    # finalized there has its body discarded, never buffered: ngx_http_finalize_request ->
    # ngx_http_discard_request_body), so a client without one holds no body buffer. `return`
    # is one of the two directives safe inside a location's `if`.
    auth = ""
    budgets = any(k.tokens_per_day is not None or k.tokens_per_month is not None
                  for k in router.keys or ())
    if router.keys is not None:
        auth = ('            if ($router_key_name = "") {\n'
                "                return 401;\n"
                "            }\n")
    if budgets:
        # past a token budget: after the key's check, before the body is read
        auth += "".join(f"            {line}\n" for line in QUOTA_CHECK)
    error_pages = [*[f"error_page {status} {ERROR_PREFIX}{status};" for status in ERROR_PAGES],
                   *(["error_page 401 = @router_unauthorized;"]
                     if router.keys is not None else []),
                   *([f"error_page {QUOTA_STATUS} = @router_quota;"] if budgets else []),
                   "error_page 502 504 = @router_down;"]
    # the counts of requests open at once (a key's max_concurrent, a requester's large
    # bodies), after the key's check, before the body is read
    counted = conn_lines(router.keys or (), router.large_bodies_per_requester)
    # their 429 answered by nginx's `return` (@router_counted), as the body is not read: the
    # server's other error pages repeated (a location's error_page replaces the server's)
    counts = "".join(f"            {line}\n" for line in
                     [*error_pages, "error_page 429 = @router_counted;"]) if counted else ""
    counts += "".join(f"{line}\n" for line in counted)
    out += [
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
        *[f"        {line}" for line in error_pages],
        "        error_page 429 = @router_limited;",
        "        location = /v1/models {",
        "            js_content router.models;",
        "        }",
        "        location ^~ /v1/models/ {",
        "            js_content router.model;",
        "        }",
        # ssi: only the script's own output (a stream's loading feedback, then its include)
        # is looked through, never a serve's (answered in other locations). With keys, the
        # key is checked before the body is read (`auth`, above).
        *[f"        location = {path} {{\n{auth}{counts}            js_content router.route;\n"
          "            ssi on;\n            ssi_types text/event-stream;\n        }"
          for path in ROUTED_PATHS],
        f"        location = {SERVES_LOCATION} {{",
        "            internal;",
        f"            proxy_pass http://{GPUD_UPSTREAM}/v1/serves;",
        "            proxy_method GET;",
        "            proxy_pass_request_body off;",
        "            proxy_pass_request_headers off;",
        '            proxy_set_header Content-Length "";',
        "            proxy_read_timeout 5s;",
        "            subrequest_output_buffer_size 1m;",
        "        }",
    ]
    limits = limit_lines(router.keys or ())
    for serve in sorted(router.serves, key=lambda s: s.name):
        out += _serve_locations(serve, router.awake_dir, limits)
    if router.peers:
        out += [f"        location = {PEERS_LOCATION} {{",
                "            internal;",
                f"            proxy_pass http://{GPUD_UPSTREAM}/v1/peers;",
                "            proxy_method GET;",
                "            proxy_pass_request_body off;",
                "            proxy_pass_request_headers off;",
                '            proxy_set_header Content-Length "";',
                "            proxy_read_timeout 5s;",
                "            subrequest_output_buffer_size 1m;",
                "        }",
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
    out += [
        *(["        location @router_unauthorized {",
           "            add_header WWW-Authenticate Bearer always;",
           "            return 401 $router_unauthorized;",
           "        }"] if router.keys is not None else []),
        # past a count of the routed locations (conn_lines): 429 before the body is read
        *(COUNTED_PAGE if counted else ()),
        *(QUOTA_PAGE if budgets else ()),
        "        location @router_refused {",
        "            js_content router.refused;",
        "        }",
        # past a key's limits (limit_lines): 429 in OpenAI's shape, which limit, Retry-After
        *LIMITED_PAGE,
        # a stream for a serve gpud may bring up (router.loading): its key's limits first
        "        location @router_loading {",
        *limits,
        "            js_content router.loadingStream;",
        "            ssi on;",
        "            ssi_types text/event-stream;",
        "        }",
        "        location @router_down {",
        "            js_content router.down;",
        "        }",
        "        location @router_stream_down {",
        "            js_content router.streamDown;",
        "        }",
        # gpud did not answer a loading feedback's ensure: said to the script as a 502
        "        location @router_ensure_failed {",
        "            js_header_filter router.ensured;",
        '            return 502 "gpud unreachable";',
        "        }",
        *[f"        location = {ERROR_PREFIX}{status} {{\n            internal;\n"
          f"            return {400 if status == 494 else status} $router_error_{status};"
          "\n        }" for status in ERROR_PAGES],
        "        location / {",
        "            return 404 $router_error_404;",
        "        }",
        "    }",
    ]
    return out


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
            "retry_after_s": RETRY_AFTER_S, "read_timeout_s": READ_TIMEOUT_S,
            "loading_feedback_s": router.loading_feedback_s, "ensure_prefix": ENSURE_PREFIX,
            "loading_suffix": LOADING_SUFFIX,
            "stream_prefix": STREAM_PREFIX, "limits": limits, "over_budget": over,
            "large_bodies_per_requester": router.large_bodies_per_requester,
            "priority_routes": list(PRIORITY_ROUTES),
            "host": router.host, "peers_location": PEERS_LOCATION,
            "peer_retry_after_s": PEER_RETRY_AFTER_S,
            "peer_models": peer_table(router.table, router.peers),
            "route_location": ROUTE_LOCATION,
            "shared": shared_table(router.table, router.peers),
            "peers": {p.name: {"location": p.location,
                               "open": None if p.closed else
                               {"reason": p.open_reason, "since": p.open_since}}
                      for p in sorted(router.peers, key=lambda p: p.name)},
            # what a peer key may forward as its requester (router.js whoOf)
            **({"forwarded_requester": FORWARDED_REQUESTER_RE.pattern}
               if any(k.peer for k in router.keys or ()) else {}),
            "stream_usage_routes": list(STREAM_USAGE_ROUTES), "front_send": SEND_LOCATION}
    return ("// Written by gpud (gpud/core/router.py); rewritten whenever the serves change.\n"
            f"var CONFIG = {json.dumps(head, sort_keys=True, indent=1)};\n\n{code}")


# --- the access log: requests by model and the router's own latency --------------------------

# The buckets of the router's own latency (seconds): nginx times at millisecond resolution.
OVERHEAD_BUCKETS_S: Final = (0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
STATUS_CLASSES: Final = ("2xx", "3xx", "4xx", "5xx")


def _seconds(text: str) -> float | None:
    """nginx's `$upstream_response_time`: one time per upstream tried ("0.012, 0.003", "0.010
    : 0.002" across an internal redirect), "-" for none; their sum, None when none is a
    number."""
    total, found = 0.0, False
    for part in re.split(r"[,:]", text):
        try:
            total += float(part)
            found = True
        except ValueError:
            continue
    return total if found else None


@dataclass(frozen=True)
class Answered:
    """One request the router answered, from its access log line: the model it named (""
    for one the router answered itself before it knew a model of its table), that model's
    serve, the class of the answer's status, and the router's own share of its time (None
    when no serve answered it, or when it is not measured)."""

    model: str
    serve: str
    status_class: str
    overhead_s: float | None
    # usage per key (USAGE_FIELDS; gpud.core.usage): "" without a key; None: not in the line
    key: str = ""
    status: int = 0
    ts: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    hung_up: bool = False
    # the peer the request was forwarded to ("" none: answered here)
    peer: str = ""


def parse_log_line(line: str, table: Mapping[str, str]) -> Answered | None:
    """A line of the router's access log (LOG_FIELDS, a JSON object), None when it is not one.
    TABLE: model -> serve; a name not in it counts as "" (names come from the table alone).

    The router's own latency is the request's time in nginx ($request_time) less the serve's
    ($upstream_response_time) and gpud's ensure (the bring-up or the queue): what the router
    adds to a request to a serve that is up. A stream answered through the loading feedback
    (sse "stream" or "refused") has no such figure: its serve answered a subrequest. Its
    status is the 200 the feedback began with, or 503 when the bring-up was refused."""
    try:
        doc = json.loads(line)
    except ValueError:
        return None
    if not isinstance(doc, dict) or not all(isinstance(doc.get(k), str) for k, _ in LOG_FIELDS):
        return None
    peer = doc.get("peer")
    peer = peer[:MAX_REQUESTER] if isinstance(peer, str) else ""
    # a model forwarded to a peer is one of the peers' (the script sets it only for those)
    model = doc["model"] if doc["model"] in table or peer else ""
    sse = doc["sse"]
    status = 503 if sse == "refused" else int(doc["status"]) if doc["status"].isdigit() else 0
    if not 100 <= status <= 599:
        return None
    overhead = None
    upstream, request = _seconds(doc["upstream_s"]), _seconds(doc["request_s"])
    if upstream is not None and request is not None and not sse:
        # nginx times at millisecond resolution: so is the difference
        overhead = max(0.0, round(request - upstream - (_seconds(doc["ensure_s"]) or 0.0), 3))
    return Answered(model, "" if peer else table.get(model, ""), f"{status // 100}xx",
                    overhead, **_usage_fields(doc, status), peer=peer)


def _usage_fields(doc: Mapping[str, object], status: int) -> dict[str, Any]:
    """The USAGE_FIELDS of a log line (absent in a line of an older config: none)."""
    got = {k: v if isinstance(v, str) else "" for k, v in
           ((k, doc.get(k)) for k, _ in USAGE_FIELDS)}
    try:
        ts: float | None = float(got["ts"])
    except ValueError:
        ts = None
    return {"key": got["key"][:MAX_REQUESTER], "status": status, "ts": ts,
            "prompt_tokens": tokens(got["prompt_tokens"]),
            "completion_tokens": tokens(got["completion_tokens"]),
            # a line of an older config has no "complete": not known to have hung up
            "hung_up": "complete" in doc and got["complete"] != "OK"}


@dataclass
class RouterStats:
    """What the router answered since gpud started: requests by (model, serve, status class)
    and the router's own latency by model."""

    requests: dict[tuple[str, str, str], int]
    overhead: dict[str, Histogram]

    @classmethod
    def empty(cls) -> RouterStats:
        return cls({}, {})

    def add(self, answered: Answered) -> None:
        key = (answered.model, answered.serve, answered.status_class)
        self.requests[key] = self.requests.get(key, 0) + 1
        if answered.overhead_s is not None:
            self.overhead.setdefault(answered.model, Histogram.empty(OVERHEAD_BUCKETS_S)
                                     ).observe(answered.overhead_s)
