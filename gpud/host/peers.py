"""The peer poller (docs/peers.md): asks each peer's router for its /v1/models with the key this
host presents there, bounded in time and bytes, on an interval and at once after a failure;
each answer is sorted by gpud.core.peers (a death, a typed answer, a model list) and fed to
the peer's circuit, whose opening and closing it logs once each. It reports; the core decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from gpud.config import Config, PeerConfig, read_peer_key
from gpud.core import answers
from gpud.core.peers import (
    MAX_MODELS_BYTES,
    PROBE_PATH,
    Circuit,
    CircuitAction,
    CircuitEvent,
    CircuitState,
    ModelsProblem,
    PeerModel,
    PeerOutcome,
    admits,
    base_url,
    classify,
    event_of,
    gpud_error_code,
    ip_access,
    offered,
    parse_models,
    step,
)
from gpud.core.router import RoutedPeer, peer_address

log = logging.getLogger("gpud.peers")

# The status the router answers for a forwarded request the peer did not take.
PEER_DOWN_STATUS = 502
# The CAs an https peer's certificate is checked against without its tls_ca (Debian's
# ca-certificates bundle).
SYSTEM_CA = "/etc/ssl/certs/ca-certificates.crt"

DEFAULT_INTERVAL_S = 5.0
# One /v1/models answer, whole, within this long: a peer that drips its answer byte by byte, or
# never ends it, is a timeout.
DEFAULT_TIMEOUT_S = 3.0


@dataclass(frozen=True, slots=True)
class Fetched:
    """One ask of a peer's PROBE_PATH: what it says of its health, the models it lists (None
    unless it answered them), the round trip and, when not OK, what went wrong."""

    outcome: PeerOutcome
    models: tuple[PeerModel, ...] | None
    rtt_s: float | None
    error: str | None


def tls_context(peer: PeerConfig) -> ssl.SSLContext | None:
    if not peer.url.startswith("https:"):
        return None
    return ssl.create_default_context(cafile=peer.tls_ca)


async def _read_bounded(stream: aiohttp.StreamReader, max_bytes: int) -> bytes:
    """The body whole, or its first MAX_BYTES + 1 (a read returns what has arrived, not
    what was asked: read on until the end or past the bound)."""
    parts: list[bytes] = []
    size = 0
    while size <= max_bytes:
        chunk = await stream.read(max_bytes + 1 - size)
        if not chunk:
            break
        parts.append(chunk)
        size += len(chunk)
    return b"".join(parts)


async def fetch_models(session: aiohttp.ClientSession, peer: PeerConfig, key: str, *,
                       timeout_s: float = DEFAULT_TIMEOUT_S, max_bytes: int = MAX_MODELS_BYTES,
                       clock: Callable[[], float] = time.monotonic) -> Fetched:
    """GET the peer's PROBE_PATH with KEY: never redirected, its answer read whole within
    TIMEOUT_S and at most MAX_BYTES, or named as the fault it is."""
    url = base_url(peer.url) + PROBE_PATH
    started = clock()
    try:
        async with asyncio.timeout(timeout_s):
            async with session.get(url, headers={"Authorization": f"Bearer {key}"},
                                   allow_redirects=False, ssl=tls_context(peer) or True) as resp:
                body = await _read_bounded(resp.content, max_bytes)
                status, location = resp.status, resp.headers.get("Location")
    except TimeoutError:
        return Fetched(PeerOutcome.FAILURE, None, None, f"no whole answer within {timeout_s:g} s")
    except aiohttp.ClientConnectorError as exc:
        return Fetched(PeerOutcome.FAILURE, None, None, f"cannot connect: {exc.os_error or exc}")
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        return Fetched(PeerOutcome.FAILURE, None, None,
                       f"{type(exc).__name__}: {exc}".rstrip(": "))
    rtt = clock() - started
    if len(body) > max_bytes:
        return Fetched(PeerOutcome.FAILURE, None, rtt, f"answer over {max_bytes} bytes")
    outcome = classify(status, body)
    if 300 <= status < 400:
        return Fetched(outcome, None, rtt, f"redirected ({status}) to {location or '?'}: a "
                       "peer's router answers itself")
    if status in (401, 403):
        return Fetched(outcome, None, rtt, f"the key was refused ({status} "
                       f"{gpud_error_code(body) or 'not gpud'}): check key_file and the "
                       "peer's keys file")
    if status != 200:
        what = gpud_error_code(body)
        return Fetched(outcome, None, rtt, f"answered {status}" + (f" ({what})" if what
                                                                     else " (not gpud's)"))
    try:
        models = parse_models(body)
    except ModelsProblem as exc:
        return Fetched(PeerOutcome.FAILURE, None, rtt, f"garbage: {exc}")
    return Fetched(PeerOutcome.OK, offered(models, peer.models), rtt, None)


@dataclass
class PeerView:
    """What this host knows of one peer now (GET /v1/peers, gpuctl peers)."""

    name: str
    url: str
    circuit: Circuit
    reachable: bool | None = None       # None: not asked yet
    reachable_since: float | None = None
    models: tuple[PeerModel, ...] = ()
    rtt_s: float | None = None
    last_error: str | None = None
    checked_at: float | None = None
    requests: dict[str, int] = field(default_factory=dict)  # by status class (the data path)
    # the models it last listed, kept while it does not answer: the router lists them
    # unreachable and answers their requests 503 at once (None: never listed any)
    offered: tuple[str, ...] | None = None


class PeerPoller:
    """Keeps a PeerView of each [peers.NAME] of the current config; `run` polls them until
    cancelled (its own HTTP client session), `poll_all` once with the caller's. The clock (wall
    time, for `since`) and the key reader are passed in."""

    def __init__(self, config: Callable[[], Config], *, interval_s: float = DEFAULT_INTERVAL_S,
                 timeout_s: float = DEFAULT_TIMEOUT_S, clock: Callable[[], float] = time.time,
                 read_key: Callable[[str], str] = read_peer_key, journal: bool = True) -> None:
        self.config = config
        # one line when a circuit opens or closes; off for --check-config's single ask
        self.journal = journal
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.clock, self.read_key = clock, read_key
        self.views: dict[str, PeerView] = {}
        self._kick = asyncio.Event()
        self._changed: Callable[[], Awaitable[None]] | None = None

    def peers(self) -> Mapping[str, PeerConfig]:
        return self.config().peers

    def view(self, name: str) -> PeerView:
        peer = self.peers()[name]
        v = self.views.get(name)
        if v is None or v.url != peer.url:
            v = self.views[name] = PeerView(name, peer.url, Circuit(CircuitState.CLOSED,
                                                                     self.clock()))
        return v

    def feed(self, name: str, event: CircuitEvent, reason: str | None = None
             ) -> tuple[CircuitAction, ...]:
        """Steps NAME's circuit by EVENT and carries out its journal actions; the actions
        returned (a probe) are the caller's."""
        v = self.view(name)
        before = v.circuit
        v.circuit, actions = step(before, event, self.clock(), reason)
        for action in actions if self.journal else ():
            if action == CircuitAction.JOURNAL_OPENED:
                log.warning("peer %s: circuit opened (%s): its models are unreachable until "
                            "%s answers again", name, reason or "failure", v.url)
            elif action == CircuitAction.JOURNAL_CLOSED:
                log.warning("peer %s: circuit closed: %s answers again (open %.0f s)", name,
                            v.url, max(0.0, v.circuit.since - before.since))
        return actions

    async def poll(self, session: aiohttp.ClientSession, name: str) -> tuple[CircuitAction, ...]:
        """Asks NAME's /v1/models once and records what it said."""
        peer = self.peers()[name]
        try:
            key = self.read_key(peer.key_file)
        except ValueError as exc:
            fetched = Fetched(PeerOutcome.FAILURE, None, None, f"key_file: {exc}")
        else:
            fetched = await fetch_models(session, peer, key, timeout_s=self.timeout_s)
        v = self.view(name)
        now = self.clock()
        reachable = fetched.outcome != PeerOutcome.FAILURE
        if reachable != v.reachable:
            v.reachable, v.reachable_since = reachable, now
        v.checked_at, v.last_error = now, fetched.error
        v.rtt_s = fetched.rtt_s if fetched.rtt_s is not None else v.rtt_s
        v.models = fetched.models or ()
        if fetched.models is not None:
            v.offered = tuple(m.id for m in fetched.models)
        return self.feed(name, event_of(fetched.outcome), fetched.error)

    def count(self, name: str, status_class: str, status: int = 0) -> None:
        """One request the router forwarded to NAME, by the class of its answer's status. A
        502 is the router's own for a peer that did not answer (router.js peerDown): NAME is
        asked at once, not at the next interval, so that its circuit opens now."""
        if name in self.peers():
            v = self.view(name)
            v.requests[status_class] = v.requests.get(status_class, 0) + 1
            if status == PEER_DOWN_STATUS:
                self.kick()

    def routing(self) -> tuple[tuple[str, tuple[str, ...], bool], ...]:
        """What of the peers the router is made of (docs/peers.md): each peer's models offered
        here and whether its circuit is closed. It changes rarely (a model added or gone, a
        circuit opened or closed), never with a state or a queue: the router is rendered again
        only when this changes (watch)."""
        out = []
        for name, peer in sorted(self.peers().items()):
            v = self.view(name)
            models = v.offered if v.offered is not None else tuple(peer.models or ())
            out.append((name, models, v.circuit.state == CircuitState.CLOSED))
        return tuple(out)

    def routed(self) -> tuple[RoutedPeer, ...]:
        """The peers as the router forwards to them: address, key (read from key_file now),
        models and circuit. A peer whose key cannot be read or sent is left out (said: its
        models are then not offered; gpuctl peers names the key file's problem)."""
        out = []
        for (name, models, closed) in self.routing():
            peer, v = self.peers()[name], self.view(name)
            try:
                scheme, host, port = peer_address(peer.url)
                ca = peer.tls_ca
                if scheme == "https" and ca is None:
                    # nginx verifies against the system's CAs then: a file it must find, or
                    # the whole front's config would be refused
                    if not os.path.isfile(SYSTEM_CA):
                        raise ValueError(f"https without tls_ca, and no system CA bundle at "
                                         f"{SYSTEM_CA}")
                    ca = SYSTEM_CA
                out.append(RoutedPeer(
                    name, scheme, host, port, self.read_key(peer.key_file), models,
                    tls_ca=ca,
                    open_reason=None if closed else (v.circuit.reason or "failure"),
                    open_since=None if closed else (v.reachable_since or v.circuit.since)))
            except ValueError as exc:
                log.error("peer %s: not offered through the router: %s", name, exc)
        return tuple(out)

    def watch(self, changed: Callable[[], Awaitable[None]]) -> None:
        """CHANGED is awaited after a round of polls that changed `routing`."""
        self._changed = changed

    def answer(self) -> answers.Peers:
        """GET /v1/peers: every peer of the config in force, asked or not yet."""
        out: list[answers.Peer] = []
        for name in sorted(self.peers()):
            v = self.view(name)
            out.append({"name": name, "url": v.url, "reachable": v.reachable,
                        "reachable_since": v.reachable_since, "circuit": str(v.circuit.state),
                        "circuit_since": v.circuit.since, "circuit_reason": v.circuit.reason,
                        "models": [{"id": m.id, "state": m.state,
                                    "expected_wait_s": m.expected_wait_s, "queued": m.queued}
                                   for m in v.models],
                        "rtt_s": v.rtt_s, "last_error": v.last_error,
                        "checked_at": v.checked_at})
        return {"peers": out}

    def kick(self) -> None:
        """Polls every peer now (a failure on the data path, a config change)."""
        self._kick.set()

    async def poll_all(self, session: aiohttp.ClientSession) -> None:
        names = sorted(self.peers())
        for name in list(self.views):
            if name not in names:
                del self.views[name]
        for name in names:
            v = self.view(name)
            if v.circuit.state == CircuitState.OPEN:
                self.feed(name, CircuitEvent.PROBE_DUE)
        results = await asyncio.gather(*(self.poll(session, n) for n in names))
        # at once after a failure that opened a circuit: a blip closes it again now
        again = [n for n, actions in zip(names, results, strict=True)
                 if CircuitAction.PROBE in actions]
        for name in again:
            self.feed(name, CircuitEvent.PROBE_DUE)
        await asyncio.gather(*(self.poll(session, n) for n in again))

    async def run(self) -> None:
        async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit_per_host=4),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as session:
            routing = self.routing()
            while True:
                await self.poll_all(session)
                self._kick.clear()
                now = self.routing()
                if now != routing and self._changed is not None:
                    routing = now
                    await self._changed()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.interval_s):
                        await self._kick.wait()


def check_peers(cfg: Config, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[str]:
    """`gpud --check-config`'s warnings of the peers that do not answer now (never a refusal:
    a peer may be down while this host's config is checked)."""
    if not cfg.peers:
        return []

    async def ask() -> list[str]:
        poller = PeerPoller(lambda: cfg, timeout_s=timeout_s, journal=False)
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(poller.poll(session, n) for n in sorted(cfg.peers)))
        return [f"peers.{name}: {v.url} does not answer its {PROBE_PATH} ({v.last_error}); "
                "its models are offered when it does" if not v.reachable else
                f"peers.{name}: {v.url}: {v.last_error}"
                for name, v in sorted(poller.views.items()) if v.last_error]

    return asyncio.run(ask())



# Where systemd finds gpud's unit and its drop-ins, the first the strongest (systemd.unit(5),
# "Unit File Load Path": /etc, then /run, then the package's).
UNIT_NAME = "gpud.service"
UNIT_DIRS: tuple[Path, ...] = (Path("/etc/systemd/system"), Path("/run/systemd/system"),
                               Path("/usr/local/lib/systemd/system"), Path("/lib/systemd/system"),
                               Path("/usr/lib/systemd/system"))
PEERS_DROP_IN = f"/etc/systemd/system/{UNIT_NAME}.d/peers.conf"


def unit_files(dirs: Sequence[Path], name: str = UNIT_NAME) -> list[Path]:
    """NAME's unit file as systemd loads it (the first of DIRS that holds it), then its
    drop-ins (NAME.d/*.conf of every dir, a file name in a stronger dir hiding the same one in
    a weaker, applied in the order of their names: systemd.unit(5)); [] when not installed."""
    unit = next((d / name for d in dirs if (d / name).is_file()), None)
    if unit is None:
        return []
    drop_ins: dict[str, Path] = {}
    for d in dirs:
        with contextlib.suppress(OSError):
            for path in (d / f"{name}.d").glob("*.conf"):
                drop_ins.setdefault(path.name, path)
    return [unit, *(drop_ins[n] for n in sorted(drop_ins))]


def _addresses(host: str) -> list[str]:
    """HOST's addresses: itself when it is one, else what the resolver says now ([]: none)."""
    host = host.strip("[]")
    with contextlib.suppress(ValueError):
        return [str(ipaddress.ip_address(host))]
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return []
    return sorted({str(info[4][0]) for info in infos})


def unit_warnings(cfg: Config, dirs: Sequence[Path] = UNIT_DIRS,
                  addresses: Callable[[str], list[str]] = _addresses) -> list[str]:
    """`gpud --check-config`'s warnings of the peers gpud's installed unit does not let it
    reach (its IPAddressDeny=any and IPAddressAllow=localhost: docs/peers.md, "The config"),
    each with the drop-in that admits them. None when the unit is not installed here."""
    if not cfg.peers:
        return []
    files = unit_files(dirs)
    if not files:
        return []
    texts = []
    for path in files:
        try:
            texts.append(path.read_text(errors="replace"))
        except OSError as exc:
            return [f"{path}: cannot be read ({exc.strerror}): whether gpud may reach its "
                    "peers is not checked"]
    access = ip_access(texts)
    found = []
    for name, peer in sorted(cfg.peers.items()):
        denied = [a for a in addresses(peer_address(peer.url)[1]) if not admits(access, a)]
        if denied:
            allow = " ".join(denied)
            found.append(
                f"peers.{name}: {UNIT_NAME} ({', '.join(str(p) for p in files)}) does not let "
                f"gpud reach {allow} (IPAddressDeny={' '.join(access.deny) or '-'}, "
                f"IPAddressAllow={' '.join(access.allow) or '-'}): its every poll would time "
                f"out. Add the drop-in {PEERS_DROP_IN} with \"[Service]\" and "
                f"\"IPAddressAllow={allow}\" (or the peers' network), then systemctl "
                "daemon-reload && systemctl restart gpud (docs/peers.md, \"The config\")")
    return found
