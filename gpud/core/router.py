"""The router: one OpenAI-compatible address for every routable serve, routed by the request
body's ``model``. This module holds what the router is made of: the routes it carries, the
model names and the routing table, the serves and peers behind it (RoutedServe, RoutedPeer, the
peers' table), its settings (RouterFront), and who asked (RouterRequest, EnsureBound).

The router is a server of the front's own nginx (gpud-front.service, docs/front.md), with the
njs module (Debian's libnginx-mod-http-js) loaded: a ``js_content`` handler
(gpud/data/router.js) reads the body in memory, looks its ``model`` up in the table rendered
by gpud.core.routerconf, and redirects the request to the serve's named location, where
on-demand and sleeping serves first ask gpud to have them up (the front's ``ensure``: nginx's
auth_request) and the request is proxied to the serve's socket or port. gpud is not on the data
path: a gpud restart cuts nothing, and running serves keep answering while gpud is down
(docs/router.md).

Its neighbours: the API keys (gpud.core.keys), their limits in nginx (gpud.core.limits), the
rendering of the config and the script (gpud.core.routerconf), the access log
(gpud.core.routerlog). Pure: no file, process or clock here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from gpud.core.front import PATH_RE
from gpud.core.keys import ApiKey
from gpud.core.peers import PeerModel, merge
from gpud.core.quota import Over
from gpud.core.text import printable

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
# Seconds between two SSE comments to a stream waiting on a bring-up (0: none).
DEFAULT_LOADING_FEEDBACK_S: Final = 5
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
    # Where gpud keeps, per serve, when it last ended what was in flight on it
    # (gpud.nginx.router.cut_dir): what the script reads at the end of a /v1/responses stream.
    # None: no such check.
    cut_dir: str | None = None
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
                     *([self.awake_dir] if self.awake_dir is not None else []),
                     *([self.cut_dir] if self.cut_dir is not None else [])):
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
