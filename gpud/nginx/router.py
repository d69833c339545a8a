"""The router's adapter: what of the config in force the router is made of, and its script's
text (gpud/data/router.js with the table gpud.core.routerconf renders). gpud.nginx.front writes both
beside the front's nginx.conf and reloads the front (docs/router.md)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import socket
import stat
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import cache
from pathlib import Path
from typing import Final

from gpud.config import Config, DaemonConfig, ServeConfig, routed
from gpud.core.front import socket_path
from gpud.core.keys import ApiKey, parse_keys
from gpud.core.launch import scheduling_policy
from gpud.core.queue import KEY_PRIORITY, WEIGHT
from gpud.core.quota import Budget, BudgetState, Over, budget_states, month_bounds
from gpud.core.router import HOST_NAME_RE, RoutedServe, RouterFront, routing_table
from gpud.core.routerconf import render_script
from gpud.core.routerlog import Answered, RouterStats, parse_log_line
from gpud.core.usage import Counts, UsageKey, add, charged_to, hour_of, one
from gpud.durable.store import Store
from gpud.errors import ConfigError, GpudError

log = logging.getLogger("gpud.router")

SCRIPT_SOURCE: Final = Path(__file__).parents[1] / "data" / "router.js"
SCRIPT_NAME: Final = "router.js"
# nginx waits for gpud's ensure a little longer than gpud does (ensure_timeout_s).
ENSURE_MARGIN_S: Final = 5
# The router's access log (gpud.core.routerlog.LOG_FIELDS), in a directory of the front's that
# gpud keeps (root's, the front's group may enter): gpud makes the file (root's, the front's
# group writes it) before nginx opens it, and empties it once it has read past LOG_MAX_BYTES.
LOG_DIR: Final = "log"
LOG_NAME: Final = "router.log"
LOG_MAX_BYTES: Final = 4 << 20
# How often gpud stores what it read of the log, besides each scrape of /metrics (the log
# stays small).
LOG_READ_S: Final = 5.0
# How often gpud reads the log (only the bytes added since): a forwarded request a peer did not
# take (the router's 502) has the peer asked within this long, so that its circuit opens within
# a second or two of a peer's death seen on the data path (docs/peers.md).
LOG_PEEK_S: Final = 1.0
# The store's meta entry of how far the log is counted (RouterLog), and the bytes before that
# position kept with it: on a new start, the log's own bytes there say it is the same log.
LOG_POSITION: Final = "router_log_position"
TAIL_BYTES: Final = 64


def log_dir(d: DaemonConfig) -> str:
    return f"{d.front_dir.rstrip('/')}/{LOG_DIR}"


def awake_dir(d: DaemonConfig) -> str:
    """Where gpud keeps one empty file per fronted serve that is running and awake, for the
    front and the router to go by while gpud does not answer (root's, readable by the front's
    group; gpud.nginx.front.Front.mark_awake)."""
    return f"{d.front_dir.rstrip('/')}/awake"


def cut_dir(d: DaemonConfig) -> str:
    """Where gpud keeps, per serve, a note written anew each time it ends what is in flight on
    it (the epoch in nanoseconds, just before the abort: gpud.life.traffic.Traffic.mark_cut),
    for the router's script to tell a /v1/responses stream that vLLM ends as a whole one: one
    whose note changed between its first bytes and its end (router.js cutSince). Root's,
    readable by the front's group."""
    return f"{d.front_dir.rstrip('/')}/cut"


def host_name() -> str:
    """This host's name as its router tells its peers (X-Gpud-Via) and lists its own models
    (gpud.host): the kernel's host name, each character outside letters, digits, . and - made
    a -."""
    name = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname()).strip(".-")[:253]
    return name if HOST_NAME_RE.fullmatch(name) else "localhost"


def log_path(d: DaemonConfig) -> str:
    return f"{log_dir(d)}/{LOG_NAME}"


@cache
def script_code() -> str:
    return SCRIPT_SOURCE.read_text()


def asks_gpud(cfg: Config, name: str) -> bool:
    """Whether the router asks gpud to have serve NAME up before each request: an on-demand
    serve (started or woken) and one that can sleep (woken)."""
    s = cfg.serves[name]
    return s.on_demand or (bool(s.front) and bool(s.sleep_level))


def queue_wait_s(cfg: Config) -> int:
    """How long gpud may hold an ensure in the queue before the bring-up's own wait
    (router.queue_timeout_s; 0 without a router or with max_queued 0): nginx's wait for the
    ensure is that much longer (docs/router.md, "Queue instead of thrash")."""
    r = cfg.router
    return r.queue_timeout_s if r is not None and r.max_queued > 0 else 0


def ensure_timeout_s(cfg: Config, name: str) -> int:
    """How long nginx (the router, a fronted port) waits for gpud's answer to an ensure of
    serve NAME: its start bound (the longer of it and the wake bound when it can sleep), the
    queue's wait, and ENSURE_MARGIN_S (nginx waits a little longer than gpud does, so that
    gpud's own answer comes first)."""
    s = cfg.serves[name]
    bound_s = max(s.start_timeout_s, cfg.daemon.wake_timeout_s if s.sleep_level else 0.0)
    return math.ceil(bound_s) + queue_wait_s(cfg) + ENSURE_MARGIN_S


def load_keys(path: str, known: list[str], *, require_root: bool | None = None
              ) -> tuple[ApiKey, ...]:
    """router.api_keys_file's keys; a ConfigError naming the file and each problem (the
    front is then not rewritten: it keeps the keys it has)."""
    if require_root is None:
        require_root = os.geteuid() == 0
    try:
        st = os.stat(path)
        if require_root and (st.st_uid != 0 or stat.S_IMODE(st.st_mode) & 0o077):
            raise ConfigError(path, [f"must be root's and 0600 (owner uid {st.st_uid}, mode "
                                     f"{stat.S_IMODE(st.st_mode):04o}): it holds tokens"])
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(path, [f"cannot read: {exc.strerror or exc}"]) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(path, [f"not UTF-8 (byte {exc.start})"]) from exc
    keys, problems = parse_keys(text, known)
    if problems:
        raise ConfigError(path, problems)
    return tuple(keys)


class KeyShares:
    """Each key's priority and weight in gpud's queue (keys.NAME.priority, .weight;
    docs/router.md, "Who is asking"), read from router.api_keys_file again only when it
    changed (its size and modification time). A requester that is no key (an address, or
    keys off), or a file that cannot be read now: the defaults (the router keeps its last good
    keys; the problem is the front sync's to report)."""

    def __init__(self, config: Callable[[], Config]) -> None:
        self.config = config
        self._seen: tuple[str, int, int] | None = None
        self._shares: dict[str, tuple[int, float]] = {}

    def __call__(self, requester: str) -> tuple[int, float]:
        # a peer's forwarded requester (PEER/NAME) waits with the peer key's priority and
        # weight: this host's word on what that peer's requests weigh, never the peer's
        requester = charged_to(requester)
        cfg = self.config()
        path = cfg.router.api_keys_file if cfg.router is not None else None
        if path is None:
            return KEY_PRIORITY, WEIGHT
        try:
            st = os.stat(path)
        except OSError:
            return self._shares.get(requester, (KEY_PRIORITY, WEIGHT))
        seen = (path, st.st_size, st.st_mtime_ns)
        if seen != self._seen:
            try:
                keys = load_keys(path, [m for names in routed(cfg).values() for m in names])
            except ConfigError:
                return self._shares.get(requester, (KEY_PRIORITY, WEIGHT))
            self._seen = seen
            self._shares = {k.name: (k.priority, k.weight) for k in keys}
        return self._shares.get(requester, (KEY_PRIORITY, WEIGHT))


def priority_scheduling(spec: ServeConfig) -> bool:
    """Whether the serve runs vLLM with --scheduling-policy priority: a vllm serve behind the
    router does unless its extra_args choose another policy (gpud.core.launch.vllm_arg_parts);
    a command serve when its own argv says so (vLLM's flag and the stand-in's)."""
    if spec.vllm is not None:
        return scheduling_policy(spec.vllm.extra_args) in (None, "priority")
    return scheduling_policy(spec.command or ()) == "priority"


def router_front(cfg: Config, keys: tuple[ApiKey, ...] | None = None) -> RouterFront | None:
    """The router of CFG (None: no [router]); its keys read from router.api_keys_file, or
    KEYS when given (the keys last read, kept while the file is refused)."""
    r = cfg.router
    if r is None:
        return None
    d = cfg.daemon
    serves = []
    for name, names in routed(cfg).items():
        s = cfg.serves[name]
        serves.append(RoutedServe(
            name, names, priority_scheduling=priority_scheduling(s),
            stream_usage=s.vllm is not None,
            socket=socket_path(d.serve_socket_dir, name) if s.front else None,
            port=None if s.front else s.port,
            ensure_timeout_s=ensure_timeout_s(cfg, name) if asks_gpud(cfg, name) else None,
            wait_timeout_s=None if asks_gpud(cfg, name) else ensure_timeout_s(cfg, name)))
    if r.api_keys_file is None:
        keys = None
    elif keys is None:
        # a key may name a model a peer offers here ([peers.NAME] models)
        keys = load_keys(r.api_keys_file, [*(m for s in serves for m in s.models),
                                           *(m for p in cfg.peers.values()
                                             for m in p.models or ())])
    return RouterFront(listen=r.listen, serves=tuple(serves), njs_module=r.njs_module, keys=keys,
                       script=f"{d.front_dir.rstrip('/')}/{SCRIPT_NAME}", gpud_socket=d.socket,
                       max_body_mib=r.max_body_mib, body_timeout_s=r.body_timeout_s,
                       large_bodies_per_requester=r.large_bodies_per_requester,
                       loading_feedback_s=r.loading_feedback_s, access_log=log_path(d),
                       awake_dir=awake_dir(d), cut_dir=cut_dir(d))


def script_text(router: RouterFront) -> str:
    return render_script(router, script_code())


class RouterLog:
    """Reads the router's access log into RouterStats: requests by model and status class,
    and the router's own latency (docs/router.md, "Seeing it"), and usage per key into the
    store. Made by the daemon before the front is synced.

    Usage is counted exactly once per line, across crashes: the hourly rows and how far the
    log is counted (the byte after the last whole line, and the 64 bytes before it) commit in
    one transaction (Store.add_usage), and a new gpud goes on from there, so the lines nginx
    wrote while gpud was down are counted too. A log found emptied or replaced since (its bytes
    before that position not the ones stored) is counted from its start: the lines the old one
    had past the position are not counted (gpud empties the log itself only once what it read
    of it is stored). With no position stored yet (a store older than this), what the log
    holds is skipped."""

    def __init__(self, config: Callable[[], Config], store: Store | None = None,
                 clock: Callable[[], float] = time.time,
                 peer: Callable[[str, str, int], None] | None = None) -> None:
        self.config = config
        # each request forwarded to a peer: its name, the class of the answer's status and the
        # status (gpud.host.peers.PeerPoller.count: gpud_peer_requests_total)
        self.peer = peer
        self.stats = RouterStats.empty()
        # usage per key (gpud.core.usage): since gpud started (the metrics'), and the hourly
        # rows not yet in the store (`flush`, each LOG_READ_S)
        self.store, self.clock = store, clock
        self.by_key: dict[tuple[str, str, str], Counts] = {}
        self.pending: dict[UsageKey, Counts] = {}
        self._pruned_hour = 0
        self._partial = b""
        # the bytes before the position counted (its check on the next start)
        self._tail = b""
        # read() (the loop: each scrape) and flush() (a thread) change the rows and the
        # position together: one at a time
        self._lock = threading.Lock()
        self._offset = self._resume()
        self._stored: str | None = None
        self.flush()  # the position from which this gpud counts, even before any line

    def _resume(self) -> int:
        path = log_path(self.config().daemon)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                stored = self._stored_position()
                if stored is None:
                    f.seek(max(0, size - TAIL_BYTES))
                    self._tail = f.read(TAIL_BYTES)
                    return size
                offset, tail = stored
                f.seek(max(0, offset - len(tail)))
                if size >= offset and f.read(len(tail)) == tail:
                    self._tail = tail
                    return offset
        except OSError:
            return 0
        log.warning("router: its log %s was emptied or replaced while gpud was not reading it: "
                    "counted from its start (lines of the one before past byte %d are not "
                    "counted)", path, offset)
        return 0

    def _stored_position(self) -> tuple[int, bytes] | None:
        if self.store is None:
            return None
        try:
            text = self.store.meta(LOG_POSITION)
            doc = json.loads(text) if text is not None else None
            return (int(doc["offset"]), bytes.fromhex(doc["tail"])) if doc else None
        except (GpudError, ValueError, KeyError, TypeError) as exc:
            log.warning("router: the stored position in its log is unreadable (%s): what the "
                        "log holds is skipped", exc)
            return None

    def _position(self) -> str:
        return json.dumps({"offset": self._offset - len(self._partial),
                           "tail": self._tail.hex()})

    def table(self) -> dict[str, str]:
        """Model name -> serve of the config in force (none without a router)."""
        cfg = self.config()
        if cfg.router is None:
            return {}
        try:
            return routing_table(routed(cfg))
        except ValueError:
            return {}

    def read(self) -> None:
        with self._lock:
            self._read()

    def _read(self) -> None:
        path = log_path(self.config().daemon)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < self._offset:  # emptied or made anew
                    self._offset, self._partial, self._tail = 0, b"", b""
                f.seek(self._offset)
                data = f.read(size - self._offset)
        except OSError:
            return
        self._offset += len(data)
        joined = self._partial + data
        lines = joined.split(b"\n")
        self._partial = lines.pop()
        self._tail = (self._tail + joined[:len(joined) - len(self._partial)])[-TAIL_BYTES:]
        table = self.table()
        for line in lines:
            answered = parse_log_line(line.decode(errors="replace"), table)
            if answered is not None:
                self.stats.add(answered)
                self._count(answered)
                if answered.peer and self.peer is not None:
                    self.peer(answered.peer, answered.status_class, answered.status)
        if self._offset >= LOG_MAX_BYTES and not self._partial:
            # what was read of it stored first (with the position at its end): else kept
            self._flush()
            if self.store is not None and self.pending:
                return
            try:
                os.truncate(path, 0)
            except OSError as exc:
                log.warning("router: cannot empty its log %s: %s", path, exc)
                return
            # a crash before the next flush finds the stored tail gone: from 0, as here
            self._offset, self._tail = 0, b""

    def _count(self, a: Answered) -> None:
        counts = one(a.prompt_tokens, a.completion_tokens, a.hung_up)
        at = (a.key, a.model, a.status_class)
        self.by_key[at] = self.by_key.get(at, Counts()) + counts
        ts = a.ts if a.ts is not None else self.clock()
        self.pending = add(self.pending, UsageKey(hour_of(ts), a.key, a.model, a.status),
                           counts)

    def budget_states(self, keys: Sequence[ApiKey]) -> list[BudgetState]:
        """Each of KEYS with a token budget: what it used of it this UTC day and month, from
        the stored rows and those read but not stored yet (gpud.core.quota)."""
        budgets = {k.name: Budget(k.tokens_per_day, k.tokens_per_month) for k in keys
                   if k.tokens_per_day is not None or k.tokens_per_month is not None}
        if not budgets or self.store is None:
            return []
        now = self.clock()
        with self._lock:
            rows = self.store.usage(month_bounds(now)[0])
            pending = list(self.pending.items())
        return budget_states([*rows, *pending], budgets, now)

    def over_budget(self, keys: Sequence[ApiKey]) -> tuple[Over, ...]:
        """The KEYS past a token budget now, and until when (gpud.core.quota): from the
        stored rows of this UTC month and those read but not stored yet. None past any when
        no key has a budget, or without a store (nothing durable to go by), or when the store
        cannot be read (kept as it was: the caller keeps what it rendered)."""
        return tuple(o for s in self.budget_states(keys) for o in [s.over()] if o is not None)

    def flush(self) -> None:
        """The usage read since the last flush into the store's hourly rows, with the
        position in the log they were read up to, in one transaction; pruned to
        daemon.events_keep rows once an hour (as events are). Kept for the next flush when
        the store fails."""
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        if self.store is None:
            return
        position = self._position()
        if not self.pending and position == self._stored:
            return
        try:
            self.store.add_usage(self.pending, (LOG_POSITION, position))
        except GpudError as exc:
            log.warning("router: usage not stored yet: %s", exc.message)
            return
        self.pending, self._stored = {}, position
        hour = hour_of(self.clock())
        if hour != self._pruned_hour:
            self._pruned_hour = hour
            try:
                gone = self.store.prune_usage(self.config().daemon.events_keep)
            except GpudError as exc:
                log.warning("router: old usage rows not pruned: %s", exc.message)
                return
            if gone:
                log.info("pruned %d old usage rows", gone)

    async def loop(self, stored: Callable[[], Awaitable[None]] | None = None, *,
                   peek_s: float = LOG_PEEK_S, read_s: float = LOG_READ_S) -> None:
        """Read each PEEK_S; store each READ_S, then STORED (the front's budget check:
        gpud.nginx.front.Front.budgets_changed)."""
        every = max(1, round(read_s / peek_s))
        try:
            rounds = 0
            while True:
                await asyncio.sleep(peek_s)
                self.read()
                rounds += 1
                if rounds % every:
                    continue
                await asyncio.to_thread(self.flush)
                if stored is not None:
                    await stored()
        finally:
            # gpud stops: what was read is stored
            self.read()
            self.flush()
