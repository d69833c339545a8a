"""Peers (docs/peers.md): other gpud hosts whose routers' models are offered here, each host
staying the only authority over its own GPUs. What a peer's answer means, its circuit, which
host takes a request and one list of every host's models: values in, values out (the poller
that asks the peers is gpud.host.peers).
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, Final

from gpud.core.vocab import ServeState

# The only route a peer is asked while its circuit is not closed: listing models never loads
# one (a request for a model would start or wake it on the peer).
PROBE_PATH: Final = "/v1/models"
# The hop marker: an entry a host lists for a model it only offers from a peer names that peer
# under its `gpud` object; a host never offers such an entry to its own peers again.
VIA_FIELD: Final = "via"
# The bounds of one /v1/models answer (gpud.host.peers): larger, slower or deeper is a fault.
MAX_MODELS_BYTES: Final = 1 << 20
MAX_MODELS: Final = 4096
# A state a peer reports for a model: one of gpud's own serve states (the peer is a gpud, whose
# router lists its serves' states), "stopped", or "unknown" for anything else it says.
PEER_STATES: Final = (*(s.value for s in ServeState), "stopped", "unknown")
AWAKE: Final = ServeState.RUNNING.value

_HOST_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,62}[A-Za-z0-9])?"
                      r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}[A-Za-z0-9])?)*\.?")


_URL_RE = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<authority>[^/?#]*)"
                     r"(?P<path>[^?#]*)(?P<rest>[?#].*)?", re.DOTALL)
_IPV6_RE = re.compile(r"[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*")


def url_problem(url: str) -> str | None:
    """Why URL is not a peer's router address: http or https, a host (a name, an IPv4 address,
    or an IPv6 one in brackets) and an optional port, no path beyond "/", no user, query or
    fragment."""
    if any(ch.isspace() or ord(ch) < 0x21 or ch == "\x7f" for ch in url):
        return f"{url!r} must not contain spaces or control characters"
    m = _URL_RE.fullmatch(url)
    if m is None or m["scheme"].lower() not in ("http", "https"):
        return f"{url!r} must be http:// or https:// (e.g. http://node2.tailnet:8000)"
    authority = m["authority"]
    if "@" in authority:
        return f"{url!r} must not carry a user or password (the key is key_file's)"
    if authority.startswith("["):
        host, close, after = authority[1:].partition("]")
        if not close or not _IPV6_RE.fullmatch(host):
            return f"{url!r}: {authority!r} is not an IPv6 address in brackets"
        if after and not after.startswith(":"):
            return f"{url!r}: {authority!r} is not HOST:PORT"
        port = after[1:] if after else None
    else:
        host, colon, port_text = authority.partition(":")
        port = port_text if colon else None
        if not host:
            return f"{url!r} names no host"
        if not _HOST_RE.fullmatch(host):
            return f"{url!r}: {host!r} is not a host name or address"
    if port is not None and (not port.isascii() or not port.isdigit()
                             or not 1 <= int(port) <= 65535):
        return f"{url!r}: the port {port!r} is not 1-65535"
    if m["path"] not in ("", "/"):
        return f"{url!r} must have no path beyond '/' (the peer's router answers at its root)"
    if m["rest"] is not None:
        return f"{url!r} must have no query or fragment"
    return None


def base_url(url: str) -> str:
    """URL without its trailing "/": the prefix of the routes asked of the peer."""
    return url.rstrip("/")


# What one exchange with a peer says of its health.
class PeerOutcome(StrEnum):
    OK = "ok"              # the answer wanted
    ANSWER = "answer"      # a typed answer of the peer's gpud (a refusal): alive, not a failure
    FAILURE = "failure"    # a connect failure, a timeout, a 5xx the peer's gpud did not write


def gpud_error_code(body: bytes) -> str | None:
    """The `code` of an error document in the shape the peer's router and gpud write (OpenAI's
    error object, `{"error": {"message": str, "type"|"details": ..., "code": str}}`: router.js
    `fail`, `refusal`, `rateLimited`; gpud.core.answers.Error), else None. vLLM's own errors
    carry an integer code, a proxy's 502 page is not JSON: neither is gpud's."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return None
    err = doc.get("error") if isinstance(doc, dict) else None
    if not isinstance(err, dict):
        return None
    code, message = err.get("code"), err.get("message")
    if isinstance(code, str) and code and isinstance(message, str):
        return code
    return None


def classify(status: int, body: bytes) -> PeerOutcome:
    """What an HTTP answer of a peer says of its health: a 5xx counts against it only when its
    gpud did not write it (a typed refusal, no memory or queue full, is an answer); below 500
    the peer answered."""
    if status >= 500:
        return PeerOutcome.ANSWER if gpud_error_code(body) is not None else PeerOutcome.FAILURE
    if 200 <= status < 300:
        return PeerOutcome.OK
    if 300 <= status < 400:
        # a peer's router never redirects: something else answers at that address
        return PeerOutcome.FAILURE
    return PeerOutcome.ANSWER


class CircuitState(StrEnum):
    CLOSED = "closed"          # requests go to the peer
    OPEN = "open"              # none do; probes (PROBE_PATH) only, each when due
    HALF_OPEN = "half-open"    # one probe in flight: its outcome closes or reopens


class CircuitEvent(StrEnum):
    OK = "ok"
    ANSWER = "answer"
    FAILURE = "failure"
    PROBE_DUE = "probe-due"     # the probe interval of an open circuit has passed


class CircuitAction(StrEnum):
    JOURNAL_OPENED = "journal-opened"   # one line: the circuit opened, and why
    JOURNAL_CLOSED = "journal-closed"   # one line: it closed again
    PROBE = "probe"                      # ask PROBE_PATH now (only that)


@dataclass(frozen=True, slots=True)
class Circuit:
    state: CircuitState = CircuitState.CLOSED
    since: float = 0.0                 # when it entered this state (the caller's clock)
    reason: str | None = None          # what opened it


_EVENT_OF: Final = {PeerOutcome.OK: CircuitEvent.OK, PeerOutcome.ANSWER: CircuitEvent.ANSWER,
                    PeerOutcome.FAILURE: CircuitEvent.FAILURE}


def event_of(outcome: PeerOutcome) -> CircuitEvent:
    return _EVENT_OF[outcome]


# (state, event) -> (next state, actions): the table a test reads too.
TRANSITIONS: Final[Mapping[tuple[CircuitState, CircuitEvent],
                           tuple[CircuitState, tuple[CircuitAction, ...]]]] = {
    (CircuitState.CLOSED, CircuitEvent.OK): (CircuitState.CLOSED, ()),
    (CircuitState.CLOSED, CircuitEvent.ANSWER): (CircuitState.CLOSED, ()),
    # opened at the first death, asked again at once: a blip closes it on the next probe
    (CircuitState.CLOSED, CircuitEvent.FAILURE): (
        CircuitState.OPEN, (CircuitAction.JOURNAL_OPENED, CircuitAction.PROBE)),
    (CircuitState.CLOSED, CircuitEvent.PROBE_DUE): (CircuitState.CLOSED, ()),
    (CircuitState.OPEN, CircuitEvent.OK): (CircuitState.CLOSED, (CircuitAction.JOURNAL_CLOSED,)),
    (CircuitState.OPEN, CircuitEvent.ANSWER): (
        CircuitState.CLOSED, (CircuitAction.JOURNAL_CLOSED,)),
    (CircuitState.OPEN, CircuitEvent.FAILURE): (CircuitState.OPEN, ()),
    (CircuitState.OPEN, CircuitEvent.PROBE_DUE): (CircuitState.HALF_OPEN, (CircuitAction.PROBE,)),
    (CircuitState.HALF_OPEN, CircuitEvent.OK): (
        CircuitState.CLOSED, (CircuitAction.JOURNAL_CLOSED,)),
    (CircuitState.HALF_OPEN, CircuitEvent.ANSWER): (
        CircuitState.CLOSED, (CircuitAction.JOURNAL_CLOSED,)),
    (CircuitState.HALF_OPEN, CircuitEvent.FAILURE): (CircuitState.OPEN, ()),
    (CircuitState.HALF_OPEN, CircuitEvent.PROBE_DUE): (CircuitState.HALF_OPEN, ()),
}


def step(circuit: Circuit, event: CircuitEvent, now: float, reason: str | None = None
         ) -> tuple[Circuit, tuple[CircuitAction, ...]]:
    """The circuit after EVENT at NOW (REASON: what failed, kept while it is open)."""
    state, actions = TRANSITIONS[(circuit.state, event)]
    if state == circuit.state:
        if state == CircuitState.OPEN and event == CircuitEvent.FAILURE and reason:
            return replace(circuit, reason=reason), actions
        return circuit, actions
    return Circuit(state, now, reason if state != CircuitState.CLOSED else None), actions


def may_send(circuit: Circuit, path: str) -> bool:
    """Whether a request for PATH may go to the peer now: anything while the circuit is
    closed; only the probe's PROBE_PATH otherwise."""
    return circuit.state == CircuitState.CLOSED or path == PROBE_PATH


@dataclass(frozen=True, slots=True)
class PeerModel:
    """One model as a host lists it for itself (its /v1/models entry)."""

    id: str
    state: str = "unknown"
    expected_wait_s: float | None = None
    queued: int = 0


class ModelsProblem(ValueError):
    """Why a peer's /v1/models answer is not one (garbage, too many, wrong shape)."""


def parse_models(body: bytes) -> tuple[PeerModel, ...]:
    """The models a peer's /v1/models answer lists for itself; entries it only offers from its
    own peers (the hop marker, VIA_FIELD) are left out, never re-offered. Raises ModelsProblem
    naming what is wrong."""
    if len(body) > MAX_MODELS_BYTES:
        raise ModelsProblem(f"answer over {MAX_MODELS_BYTES} bytes")
    try:
        doc = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ModelsProblem(f"answer not UTF-8 (byte {exc.start})") from exc
    except RecursionError as exc:
        raise ModelsProblem("answer nested too deeply") from exc
    except ValueError as exc:
        raise ModelsProblem(f"answer not JSON ({exc})") from exc
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        raise ModelsProblem("answer is not a model list (no `data` array)")
    if len(data) > MAX_MODELS:
        raise ModelsProblem(f"answer lists {len(data)} models, over {MAX_MODELS}")
    found: dict[str, PeerModel] = {}
    for i, entry in enumerate(data):
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str) \
                or not entry["id"]:
            raise ModelsProblem(f"data[{i}] is not a model (no string `id`)")
        ext = entry.get("gpud")
        ext = ext if isinstance(ext, dict) else {}
        if ext.get(VIA_FIELD) is not None:
            continue
        state = ext.get("state")
        wait = ext.get("expected_wait_s")
        queue = ext.get("queue")
        queued = sum(p.get("waiting", 0) for p in queue if isinstance(p, dict)
                     and isinstance(p.get("waiting"), int)) if isinstance(queue, list) else 0
        found[entry["id"]] = PeerModel(
            entry["id"], state if state in PEER_STATES else "unknown",
            float(wait) if isinstance(wait, (int, float)) and not isinstance(wait, bool)
            and math.isfinite(wait) and wait >= 0 else None, queued)
    return tuple(found.values())


def offered(models: Iterable[PeerModel], wanted: Sequence[str] | None) -> tuple[PeerModel, ...]:
    """The peer's models offered here: those its [peers.NAME] `models` names (unset: all)."""
    if wanted is None:
        return tuple(models)
    keep = set(wanted)
    return tuple(m for m in models if m.id in keep)


@dataclass(frozen=True, slots=True)
class HostModel:
    """A model on one host: the host's name (None: this host) and what it reports."""

    host: str | None
    model: PeerModel


@dataclass(frozen=True, slots=True)
class MergedModel:
    id: str
    hosts: tuple[HostModel, ...]   # this host first, then the peers by name


def merge(local: Iterable[PeerModel], peers: Mapping[str, Iterable[PeerModel]]
          ) -> tuple[MergedModel, ...]:
    """One list of this host's models and its peers' (each peer's already `offered`, and only
    those of peers reachable now): a model served on several hosts listed once, with each."""
    by: dict[str, list[HostModel]] = {}
    hosts: list[tuple[str | None, Iterable[PeerModel]]] = [(None, local)]
    for host, models in hosts + [(name, peers[name]) for name in sorted(peers)]:
        for m in models:
            listed = by.setdefault(m.id, [])
            if all(h.host != host for h in listed):   # a host that lists a name twice: once
                listed.append(HostModel(host, m))
    return tuple(MergedModel(mid, tuple(by[mid])) for mid in sorted(by))


def listing_entry(merged: MergedModel) -> dict[str, Any]:
    """The `gpud` object of MERGED's /v1/models entry as this host lists it to a client: its
    hosts; the hop marker (VIA_FIELD) when it is not served here, so that a peer reading this
    list never offers it again."""
    ext: dict[str, Any] = {"hosts": [h.host or "" for h in merged.hosts]}
    if all(h.host is not None for h in merged.hosts):
        ext[VIA_FIELD] = merged.hosts[0].host
    return ext


@dataclass(frozen=True, slots=True)
class Offer:
    """What one host says of a model, for choose_host: None as host is this one."""

    host: str | None
    awake: bool                 # running now
    saturated: bool = False     # running with requests waiting, or its queue full
    queue_full: bool = False    # no room in its queue for one more
    expected_wait_s: float | None = None   # as that host reports it (None: it does not say)

    @property
    def ready(self) -> bool:
        return self.awake and not self.saturated


def _rank(offer: Offer) -> tuple[int, float, int, str]:
    wait = 0.0 if offer.ready else (offer.expected_wait_s if offer.expected_wait_s is not None
                                    else math.inf)
    return (0 if offer.ready else 1, wait, 0 if offer.host is None else 1, offer.host or "")


def choose_host(offers: Sequence[Offer], *, spillover: bool = False) -> Offer | None:
    """Which host takes a request for a model the OFFERS' hosts serve (peers whose circuit is
    open left out by the caller): one where it is awake and not saturated first, then the
    smallest expected wait as each host reports it, this host on a tie. Without SPILLOVER a
    model this host serves stays here unless it is ready only on a peer (awake there beats a
    bring-up here); with it the peers compete on wait too, and a full queue here sends the
    request to a peer that has room. None: no host."""
    if not offers:
        return None
    local = next((o for o in offers if o.host is None), None)
    peers = [o for o in offers if o.host is not None and not o.queue_full]
    if local is not None and not spillover:
        ready = [o for o in peers if o.ready]
        if local.ready or not ready:
            return local
        return min(ready, key=_rank)
    pool = list(peers)
    if local is not None and (not local.queue_full or not pool):
        pool.append(local)
    if not pool:
        return min(offers, key=_rank)
    return min(pool, key=_rank)


def peer_offer(host: str, model: PeerModel) -> Offer:
    """What peer HOST's /v1/models entry MODEL says for choose_host: awake when running, saturated
    when requests wait for it there, its expected wait as it reports it. (A peer does not say
    whether its queue is full: it answers that itself, as a refusal passed on.)"""
    awake = model.state == AWAKE
    return Offer(host, awake=awake, saturated=model.queued > 0,
                 expected_wait_s=model.expected_wait_s)


def local_offer(state: str, queued: int, queue_full: bool, expected_wait_s: float | None
                ) -> Offer:
    """What this host says of its serve for choose_host: its STATE, the requests QUEUED for its
    bring-up, whether its queue takes no more (QUEUE_FULL) and the wait it expects."""
    return Offer(None, awake=state == AWAKE, saturated=queued > 0 or queue_full,
                 queue_full=queue_full, expected_wait_s=expected_wait_s)



def offers_of(local: Offer | None, peers: Mapping[str, PeerModel]) -> list[Offer]:
    """choose_host's offers: this host's (LOCAL; None when no serve of it answers to the model)
    and each peer's, from the model as each peer whose circuit is closed lists it (PEERS)."""
    return ([local] if local is not None else []) + [peer_offer(name, peers[name])
                                                      for name in sorted(peers)]



# The symbolic names IPAddressAllow= and IPAddressDeny= take (systemd.resource-control(5),
# "Special address/network names").
UNIT_NETWORKS: Final = {"any": ("0.0.0.0/0", "::/0"), "localhost": ("127.0.0.0/8", "::1/128"),
                        "link-local": ("169.254.0.0/16", "fe80::/64"),
                        "multicast": ("224.0.0.0/4", "ff00::/8")}


@dataclass(frozen=True, slots=True)
class IPAccess:
    """A unit's IPAddressAllow= and IPAddressDeny= lists, as its files leave them."""

    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()


def ip_access(texts: Iterable[str]) -> IPAccess:
    """The IP access lists of a service unit whose file and drop-ins (in the order systemd
    applies them) are TEXTS: the [Service] section's IPAddressAllow= and IPAddressDeny=, each
    assignment adding to its list, an empty one resetting it (systemd.resource-control(5))."""
    lists: dict[str, list[str]] = {"IPAddressAllow": [], "IPAddressDeny": []}
    for text in texts:
        section = ""
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line[0] in "#;":
                continue
            if line.startswith("[") and line.endswith("]"):
                section = line[1:-1]
                continue
            key, eq, value = line.partition("=")
            key = key.strip()
            if section != "Service" or not eq or key not in lists:
                continue
            if not value.strip():
                lists[key].clear()
            else:
                lists[key].extend(value.split())
    return IPAccess(tuple(lists["IPAddressAllow"]), tuple(lists["IPAddressDeny"]))


def _matches(entries: Iterable[str], address: ipaddress.IPv4Address | ipaddress.IPv6Address
             ) -> bool:
    for entry in entries:
        for net in UNIT_NETWORKS.get(entry, (entry,)):
            try:
                network = ipaddress.ip_network(net, strict=False)
            except ValueError:
                continue   # systemd refuses such an entry (logged); it matches nothing
            if network.version == address.version and address in network:
                return True
    return False


def admits(access: IPAccess, address: str) -> bool:
    """Whether a unit with ACCESS may reach ADDRESS (an IP address): granted when it matches
    IPAddressAllow=, else denied when it matches IPAddressDeny=, else granted (the order
    systemd.resource-control(5) gives)."""
    addr = ipaddress.ip_address(address)
    if _matches(access.allow, addr):
        return True
    return not _matches(access.deny, addr)
