"""The front: one nginx in front of the serves that have one, as data in and config text out.

A fronted serve listens on a Unix socket (vLLM's ``--uds PATH``) in a directory only root and
the front's group may enter; the front listens on the serve's configured port on 127.0.0.1 and
forwards only the routes clients use. vLLM's dev routes (``/sleep``, ``/wake_up``,
``/is_sleeping``, ``/collective_rpc``, present with VLLM_SERVER_DEV_MODE=1) and anything else
not on the allow-list answer 404 from nginx itself and never reach the serve.

Pure: no file, process or clock here. ``gpud.nginx.front`` writes the text and runs nginx.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from gpud.core.nginxblocks import (
    GPUD_REQUEST_HEADERS,
    READ_TIMEOUT_S,
    REQUESTER_ADDR,
    REQUESTER_ADDR_MAP,
    ask_lines,
    direct_location,
    ensure_answers,
    ensure_lines,
    ensure_location,
    not_running,
    unauthorized_location,
    upstream,
)
from gpud.core.vocab import NAME_RE

# What clients of an OpenAI-compatible server use: a path ending in "/" is a prefix, any other
# an exact path.
DEFAULT_PATHS: Final = ("/v1/", "/health", "/ping", "/version", "/tokenize", "/detokenize",
                        "/metrics")
# A path on the allow-list: plain URL path characters only, so it can be written into nginx's
# config unquoted (no spaces, braces, semicolons, quotes or regex operators).
PATH_RE: Final = re.compile(r"/(?:[A-Za-z0-9._~-]+/?)*")

# What one local user may hold of the front (docs/front.md, "Holding connections"). nginx
# counts every connection against worker_connections (client and upstream alike: a proxied
# request costs two, and each is one descriptor), per worker. When a worker runs short
# (fewer than 1/16 free) it closes the oldest *reusable* connections, those waiting for a
# first request or idle between requests, to make room (ngx_drain_connections, nginx
# src/core/ngx_connection.c, called from ngx_get_connection). That only happens while the
# descriptor limit is not reached first: accept4() failing with EMFILE reuses nothing and
# stops the worker accepting for 500 ms at a time. So the descriptor limit is twice the
# connections (LimitNOFILE= on the unit, worker_rlimit_nofile here) and idle holds can never
# take the front; what bounds one user is connections that are not reusable (a header being
# sent, a request in flight), worker_connections per worker.
WORKER_CONNECTIONS: Final = 8192
NOFILE: Final = 2 * WORKER_CONNECTIONS
# The front's memory (its unit's MemoryHigh= and MemoryMax=): request bodies are buffered in
# memory up to router.max_body_mib each, so many held at once could take the host's; past
# MemoryHigh the kernel reclaims and throttles the front, at MemoryMax its OOM killer ends a
# worker (nginx's master starts another) inside the unit, never a process elsewhere.
MEMORY_HIGH_BYTES: Final = 3 << 30
MEMORY_MAX_BYTES: Final = 4 << 30
# Workers for the host's cores, at most this many: each preallocates its connections (about
# 7 MiB resident at 8192); streaming tokens through is cheap, and one worker carries tens
# of thousands of connections.
MAX_WORKERS: Final = 4
# The whole request header (request line and fields) must arrive within this long of the
# connection's accept: nginx sets the timer once and does not reset it on each read
# (ngx_http_read_request_header: `if (!rev->timer_set)`), so a client dribbling a header
# (slowloris) is answered 408 and closed after it.
CLIENT_HEADER_TIMEOUT_S: Final = 10
# Between two reads of a request body (not the whole body): a prompt arrives at once.
CLIENT_BODY_TIMEOUT_S: Final = 10
# Between two writes to a client that does not take what it was sent (not the whole
# response: a stream waiting for its next token has nothing to send and is not timed).
SEND_TIMEOUT_S: Final = 30
# An idle keep-alive connection: reusable (reclaimed under pressure), so no shorter than
# the pools of common clients expect.
KEEPALIVE_TIMEOUT_S: Final = 60
KEEPALIVE_REQUESTS: Final = 1000
# After an answer to a request whose body was not read: how long nginx still reads and
# discards what the client sends, at most, and between two reads.
LINGERING_TIME_S: Final = 10
LINGERING_TIMEOUT_S: Final = 5


def socket_path(socket_dir: str, serve: str) -> str:
    """Where a fronted serve listens."""
    return f"{socket_dir.rstrip('/')}/{serve}.sock"


def path_problem(path: str) -> str | None:
    """Why PATH cannot be on the allow-list; None when it can."""
    if not PATH_RE.fullmatch(path):
        return (f"{path!r} is not a plain URL path (starts with '/', letters, digits and . _ ~ - "
                "between slashes; a trailing '/' makes it a prefix)")
    if path == "/":
        return "'/' would forward everything, the dev routes included"
    return None


@dataclass(frozen=True)
class FrontServe:
    """One fronted serve: its name, the port clients use, the socket it listens on. An
    on-demand one (``ensure_timeout_s`` set) asks gpud before each request to have it up,
    waiting at most that long."""

    name: str
    port: int
    socket: str
    ensure_timeout_s: int | None = None

    def __post_init__(self) -> None:
        if not NAME_RE.fullmatch(self.name):
            raise ValueError(f"front: invalid serve name {self.name!r}")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"front: serve {self.name}: port {self.port} out of range")
        if not self.socket.startswith("/") or not PATH_RE.fullmatch(self.socket):
            raise ValueError(f"front: serve {self.name}: socket {self.socket!r} is not a plain "
                             "absolute path")


@dataclass(frozen=True)
class FrontPolicy:
    """What a fronted port of a serve takes of the router's policy (docs/security.md, "Keys
    cover every way in"), made by gpud.core.routerconf.front_policy from the same parts as the
    router's own locations (conn_lines, limit_lines, METER, the access log, the script), so
    that a key's limits are one limit (the same nginx zones), its usage one count (the same
    log) and its priority one priority, whichever way its requests come.

    SERVER: lines of its server, before its locations. LOCATION: lines of each proxied location
    (the counts, before the body), which then goes on to PASS_LOCATION (lines PASSING: the rates,
    the meter; none: the location proxies itself). BODY_PATHS: the routes whose body the
    router's script rewrites for the serve, each a location of its own (lines READ, then the
    script reads the body in memory: router.js `fronted`) that goes on to SEND_LOCATION (lines
    SEND: the rates, the body as rewritten, the meter); only where the allow-list lets them
    through. LOADING: lines of the server of a port that asks gpud's ensure itself (an
    on-demand serve's), where a stream gets the router's loading feedback (docs/router.md),
    by the router's own locations; the script reads the body of LOADING_PATHS there (as
    BODY_PATHS) to tell a stream."""

    server: tuple[str, ...] = ()
    location: tuple[str, ...] = ()
    passing: tuple[str, ...] = ()
    body_paths: tuple[str, ...] = ()
    read: tuple[str, ...] = ()
    send: tuple[str, ...] = ()
    loading: tuple[str, ...] = ()
    loading_paths: tuple[str, ...] = ()


@dataclass(frozen=True)
class FrontConfig:
    """What the front's nginx.conf is made of. ``run_dir``: where nginx keeps its pid file and
    temporary files (written by the front's own user)."""

    serves: tuple[FrontServe, ...]
    paths: tuple[str, ...] = DEFAULT_PATHS
    run_dir: str = "/run/gpud/front"
    listen: str = "127.0.0.1"
    # gpud's API socket: where on-demand serves are ensured
    gpud_socket: str = "/run/gpud/gpud.sock"
    workers: int = 1
    # Where gpud keeps a file per fronted serve that is running and awake (NAME): what the
    # front goes by when gpud does not answer. None: no such check (requests go through).
    awake_dir: str | None = None
    # Lines of other servers of the same nginx (the router's, gpud.core.routerconf): in the main
    # context (load_module) and in the http block.
    main_extra: tuple[str, ...] = ()
    http_extra: tuple[str, ...] = ()
    # With the router's keys (router.api_keys_file): each fronted port takes the same keys,
    # checked by the router's script before anything else (its js_set variables
    # $router_key_ok, $router_unauthorized and $router_requester_of: gpud.core.routerconf), so no
    # port is a way around them (docs/security.md).
    keys: bool = False
    # The router's policy for each fronted port (gpud.core.routerconf.front_policy): (serve, its
    # FrontPolicy): a key's limits, the usage meter and the access log, the key's priority and
    # a stream's usage in the body, the same as the router's.
    policies: tuple[tuple[str, FrontPolicy], ...] = ()

    def policy(self, serve: str) -> FrontPolicy:
        for name, policy in self.policies:
            if name == serve:
                return policy
        return FrontPolicy()

    def __post_init__(self) -> None:
        for path in self.paths:
            problem = path_problem(path)
            if problem:
                raise ValueError(f"front: paths: {problem}")
        if not PATH_RE.fullmatch(self.gpud_socket):
            raise ValueError(f"front: gpud_socket {self.gpud_socket!r} is not a plain path")
        if not PATH_RE.fullmatch(self.run_dir):
            raise ValueError(f"front: run_dir {self.run_dir!r} is not a plain absolute path")
        if self.awake_dir is not None and not PATH_RE.fullmatch(self.awake_dir):
            raise ValueError(f"front: awake_dir {self.awake_dir!r} is not a plain absolute path")
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ValueError(f"front: workers {self.workers} not within 1..{MAX_WORKERS}")
        ports = [s.port for s in self.serves]
        if len(set(ports)) != len(ports):
            raise ValueError("front: two serves on one port")


# The internal location of an on-demand serve's check with gpud (no client can name it:
# `internal`), and gpud's upstream.
ENSURE_LOCATION: Final = "/.gpud-ensure"
GPUD_UPSTREAM: Final = "gpud_api"


# A fronted port's named location that sends on a body the router's script read and rewrote
# (router.js `fronted`), and the one its other proxied locations go on to after the counts
# (FrontPolicy.passing). nginx runs a location's limit_req before its limit_conn (the phase's
# handlers in the reverse of the modules' order: src/http/ngx_http.c
# ngx_http_init_phase_handlers, auto/modules), so the rates are in a location of their own,
# after the counts, as on the router: a request refused by max_concurrent takes none of its
# key's rate. `try_files` with no file that exists is nginx's way on to a named location after
# the access phase (a `return` would come before the counts).
SEND_LOCATION: Final = "@gpud_send"
PASS_LOCATION: Final = "@gpud_pass"
ENSURE_LINES: Final = tuple(ask_lines(ENSURE_LOCATION, "gpud"))


def _locations(upstream: str, paths: Sequence[str], on_demand: bool,
               policy: FrontPolicy = FrontPolicy()) -> list[str]:
    lines = []
    for path in paths:
        # "^~" on a prefix: no regex location can take it over; "=" on an exact path.
        match = f"^~ {path}" if path.endswith("/") else f"= {path}"
        lines.append(f"        location {match} {{")
        lines += policy.location
        if policy.passing:
            lines += [f"            try_files /.gpud-none {PASS_LOCATION};",
                      "        }"]
            continue
        if on_demand:
            lines += ENSURE_LINES
        lines += [f"            proxy_pass http://{upstream};",
                  "        }"]
    if policy.passing and paths:
        lines += [f"        location {PASS_LOCATION} {{",
                  *policy.passing,
                  *(ENSURE_LINES if on_demand else ()),
                  f"            proxy_pass http://{upstream};",
                  "        }"]
    return lines


def _allowed(path: str, paths: Sequence[str]) -> bool:
    """Whether the allow-list PATHS lets PATH through (an exact path, or under a prefix)."""
    return any(path == p or (p.endswith("/") and path.startswith(p)) for p in paths)


def _body_routes(cfg: FrontConfig, serve: FrontServe,
                 upstream: str) -> tuple[list[str], frozenset[str]]:
    """The locations of SERVE's routes whose body the router's script reads (its policy's
    body_paths), and those routes (no other location of the port may name them exactly)."""
    policy = cfg.policy(serve.name)
    # a port that asks gpud's ensure itself gives a stream the router's loading feedback
    loading = serve.ensure_timeout_s is not None and bool(policy.loading)
    wanted = [*policy.body_paths,
              *(p for p in policy.loading_paths if loading and p not in policy.body_paths)]
    routes = [p for p in wanted if _allowed(p, cfg.paths)]
    if not routes:
        return [], frozenset()
    lines = [*(policy.loading if loading else ())]
    for path in routes:
        lines += [f"        location = {path} {{", *policy.read,
                  "            js_content router.fronted;",
                  "        }"]
    lines += [f"        location {SEND_LOCATION} {{",
              *policy.send,
              *(ENSURE_LINES if serve.ensure_timeout_s is not None else ()),
              f"            proxy_pass http://{upstream};",
              "        }"]
    return lines, frozenset(routes)


def _keyed(serve: str) -> list[str]:
    """A fronted server's key check (FrontConfig.keys): in the rewrite phase, so a client
    without a key is answered 401 before its body is read; a key that may use none of the
    serve's names is refused alike."""
    return [f"        set $gpud_serve {serve};",
            '        if ($router_key_ok != "1") {',
            "            return 401;",
            "        }",
            "        error_page 401 = @unauthorized;",
            *unauthorized_location("@unauthorized")]


def _on_demand(serve: FrontServe, upstream: str, awake_dir: str | None,
               keys: bool = False) -> list[str]:
    """gpud answers 204 once the serve is up, 403 with X-Gpud-Reason and Retry-After when it
    is refused; nginx's auth_request takes 2xx as yes, 401/403 as no and anything else (gpud
    down: no connection) as an error, 500. A refusal answers 503 with the reason; an error
    goes to the serve directly (@direct) only when gpud last said it was running and awake
    (its file in `awake_dir`), so a serve that is awake answers as before while gpud is down
    and one that is asleep, starting or stopped answers 503 without being reached. (An `if`
    whose block is a `return` is one of the uses nginx documents as safe.)"""
    assert serve.ensure_timeout_s is not None
    # who asked (gpud bounds each requester): the key's name with keys, else the client's
    # address, as the router's requester
    requester = "$router_requester_of" if keys else f"addr:{REQUESTER_ADDR}"
    asleep = f"503 '{not_running(serve.name, ' (gpud unreachable)')}'"
    return [
        *ensure_location(ENSURE_LOCATION, ensure_lines(GPUD_UPSTREAM, serve.name,
                                                       serve.ensure_timeout_s,
                                                       requester=requester)),
        *ensure_answers("@refused", "@direct", "        "),
        # @direct's 502 (the serve not up either) goes on to @down
        "        recursive_error_pages on;",
        "        location @refused {",
        "            add_header Retry-After $gpud_retry always;",
        "            return 503 $gpud_reason;",
        "        }",
        *direct_location("@direct", upstream, serve.name, awake_dir, asleep),
    ]


def render(cfg: FrontConfig) -> str:
    """nginx.conf for the front: deterministic for equal input (a reload only when it changed)."""
    run = cfg.run_dir
    out = [
        "# Written by gpud (gpud/core/front.py); rewritten whenever the serves change.",
        *cfg.main_extra,
        "daemon off;",
        f"worker_processes {cfg.workers};",
        # The unit's LimitNOFILE= is the same (gpud.nginx.front.unit_properties): nginx sets it
        # for its workers, and one that may not (a front started before) says so in its log.
        f"worker_rlimit_nofile {NOFILE};",
        f"pid {run}/nginx.pid;",
        "error_log stderr warn;",
        "events {",
        f"    worker_connections {WORKER_CONNECTIONS};",
        "}",
        "http {",
        "    access_log off;",
        "    server_tokens off;",
        # Slow and idle clients (see the constants above and docs/front.md).
        f"    client_header_timeout {CLIENT_HEADER_TIMEOUT_S}s;",
        f"    client_body_timeout {CLIENT_BODY_TIMEOUT_S}s;",
        f"    send_timeout {SEND_TIMEOUT_S}s;",
        f"    keepalive_timeout {KEEPALIVE_TIMEOUT_S}s;",
        f"    keepalive_requests {KEEPALIVE_REQUESTS};",
        f"    lingering_time {LINGERING_TIME_S}s;",
        f"    lingering_timeout {LINGERING_TIMEOUT_S}s;",
        # A timed-out client is closed with a reset: its socket's unsent data is dropped at
        # once instead of lingering in FIN_WAIT.
        "    reset_timedout_connection on;",
        # nginx's defaults, said: a header fits in 1k, or in at most 4 buffers of 8k
        # (longer: 414/400), so a slow header holds 33 KiB at most.
        "    client_header_buffer_size 1k;",
        "    large_client_header_buffers 4 8k;",
        f"    client_body_temp_path {run}/body;",
        f"    proxy_temp_path {run}/proxy;",
        f"    fastcgi_temp_path {run}/fastcgi;",
        f"    uwsgi_temp_path {run}/uwsgi;",
        f"    scgi_temp_path {run}/scgi;",
        "    default_type application/json;",
        # Requests carry prompts: nginx's 1 MiB default would refuse long ones.
        "    client_max_body_size 64m;",
        # Server-sent events go through as they come: no buffering of the response, nor of
        # the request (a client's upload reaches the serve as it arrives).
        "    proxy_buffering off;",
        "    proxy_request_buffering off;",
        "    proxy_http_version 1.1;",
        '    proxy_set_header Connection "";',
        "    proxy_set_header Host $host;",
        *[f'    proxy_set_header {name} "";' for name in GPUD_REQUEST_HEADERS],
        f"    proxy_read_timeout {READ_TIMEOUT_S}s;",
        f"    proxy_send_timeout {READ_TIMEOUT_S}s;",
        *REQUESTER_ADDR_MAP,
        # the router's (its script, maps, zones, log format: the fronted ports' policy reads
        # them, and nginx reads a log format before a server may name it)
        *cfg.http_extra,
    ]
    if any(s.ensure_timeout_s is not None for s in cfg.serves):
        out += ["",
                "    # gpud's API (on-demand serves)",
                *upstream(GPUD_UPSTREAM, f"unix:{cfg.gpud_socket}", keepalive=None)]
    for serve in sorted(cfg.serves, key=lambda s: s.port):
        name = f"serve_{serve.name.replace('-', '_')}"
        body_lines, body_paths = _body_routes(cfg, serve, name)
        out += [
            "",
            f"    # serve {serve.name}",
            *upstream(name, f"unix:{serve.socket}"),
            "    server {",
            f"        listen {cfg.listen}:{serve.port};",
            # A serve that is not up (stopped, starting, restarting): 503, not nginx's 502.
            "        error_page 502 =503 @down;",
            *(_keyed(serve.name) if cfg.keys else []),
            *cfg.policy(serve.name).server,
            *body_lines,
            *_locations(name, [p for p in cfg.paths if p not in body_paths],
                        serve.ensure_timeout_s is not None, cfg.policy(serve.name)),
            *(_on_demand(serve, name, cfg.awake_dir, cfg.keys)
              if serve.ensure_timeout_s is not None else []),
            "        location / {",
            "            return 404;",
            "        }",
            "        location @down {",
            f"            return 503 '{not_running(serve.name)}';",
            "        }",
            "    }",
        ]
    out.append("}")
    return "\n".join(out) + "\n"

