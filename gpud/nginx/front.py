"""The adapter that runs the front: writes its nginx.conf, prepares the serves' socket
directory, and starts or reloads ``gpud-front.service`` over D-Bus.

The front is a transient unit of its own in gpud.slice, not a child of gpud: stopping or
restarting gpud leaves it (and every client connection through it) alone; gpud finds it
running when it comes back and only reloads it. A reload is nginx's graceful one (SIGHUP: new
workers take the new config, the old ones finish their requests and exit). nginx keeps the
config it has when a new one does not load; the text comes from ``gpud.core.front.render``,
whose output is checked with ``nginx -t`` in the tests.

Who may reach a fronted serve: its socket lies in ``daemon.serve_socket_dir``, mode 0770,
owned by root and the front user's group, so other local users get EACCES at the directory.
The serve runs in that group too (SupplementaryGroups=: an unprivileged serve must create its
socket there) and binds its socket with UMask=0007 (0770, its own user and group); gpud gives
the socket to root and the front's group before each health check (``open_to_front``: a chown,
which gpud's CAP_CHOWN allows; a setgid directory would do the group without gpud, but
gpud.service's RestrictSUIDSGID=yes refuses to make one). Until then the front answers 503,
and the serve is not "running" before a health check passed. Root (gpud, for its health
checks and sleep calls) and the front's workers connect.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import grp
import hashlib
import json
import logging
import os
import pwd
import re
import signal
import socket
import stat
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import aiohttp
from dbus_fast import Variant

from gpud.config import Config, DaemonConfig
from gpud.core.front import (
    MAX_WORKERS,
    MEMORY_HIGH_BYTES,
    MEMORY_MAX_BYTES,
    NOFILE,
    FrontConfig,
    FrontServe,
    render,
    socket_path,
)
from gpud.core.keys import ApiKey
from gpud.core.quota import Over
from gpud.core.router import RoutedPeer, RouterFront
from gpud.core.routerconf import front_policy
from gpud.core.routerconf import http_lines as router_http_lines
from gpud.core.routerconf import main_lines as router_main_lines
from gpud.core.vocab import ServeState
from gpud.errors import ConfigError, GpudError, Unavailable
from gpud.files import write_atomically
from gpud.host.unit_properties import SLICE, encode
from gpud.host.units import SystemdUnits
from gpud.nginx.router import (
    SCRIPT_NAME,
    awake_dir,
    cut_dir,
    ensure_timeout_s,
    host_name,
    log_dir,
    log_path,
    router_front,
    script_text,
)

log = logging.getLogger("gpud.front")

FRONT_UNIT: Final = "gpud-front.service"
# Group-writable: an unprivileged serve binds its socket here as a member of the front's group
# (SupplementaryGroups=, gpud.core.launch.serve_identity).
SOCKET_DIR_MODE: Final = 0o770
SOCKET_MODE: Final = 0o660
# A fronted serve's mask: its socket (bound 0777 & ~umask) is then writable by the group.
SERVE_UMASK: Final = 0o007
START_TIMEOUT_S: Final = 30.0


def fronted(cfg: Config) -> dict[str, int]:
    """The fronted serves and their ports."""
    return {name: s.port for name, s in cfg.serves.items() if s.front and s.port is not None}


_COMPUTE: Final = object()


def front_config(cfg: Config, router: RouterFront | object | None = _COMPUTE,
                 leave_out: frozenset[str] = frozenset()) -> FrontConfig:
    """The front's config for CFG, with ROUTER (computed from CFG when not given: a sync
    computes it once, gpud.nginx.front.check_front, and hands it here), without the fronted serves
    LEAVE_OUT (whose port another process holds)."""
    d = cfg.daemon
    if router is _COMPUTE:
        router = router_front(cfg)
    assert router is None or isinstance(router, RouterFront)
    return FrontConfig(
        serves=tuple(FrontServe(name, port, socket_path(d.serve_socket_dir, name),
                                ensure_timeout_s=(ensure_timeout_s(cfg, name)
                                                  if cfg.serves[name].on_demand else None))
                     for name, port in sorted(fronted(cfg).items()) if name not in leave_out),
        paths=tuple(d.front_paths), run_dir=f"{d.front_dir.rstrip('/')}/run",
        gpud_socket=d.socket, workers=front_workers(), awake_dir=awake_dir(d),
        main_extra=tuple(router_main_lines(router)) if router else (),
        http_extra=tuple(router_http_lines(router)) if router else (),
        keys=router is not None and router.keys is not None,
        # with a router, each fronted port takes its policy (a key's limits, the share's
        # priority, usage), with keys or without
        policies=tuple((name, front_policy(router, name))
                       for name in sorted(fronted(cfg)) if name not in leave_out
                       and router is not None))


def front_workers() -> int:
    """nginx's workers: one per core gpud may run on, at most MAX_WORKERS."""
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))


def _front_ids(d: DaemonConfig) -> tuple[int, int]:
    try:
        user = pwd.getpwnam(d.front_user)
    except KeyError:
        raise Unavailable(f"daemon.front_user: no user {d.front_user!r} on this host (the "
                          "package creates it: useradd --system gpud-front)",
                          {"user": d.front_user}) from None
    return user.pw_uid, user.pw_gid


def front_group(d: DaemonConfig) -> str:
    """The name of the front user's group: a fronted serve joins it to bind its socket."""
    _uid, gid = _front_ids(d)
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        raise Unavailable(f"daemon.front_user: {d.front_user!r} has no group {gid} on this host",
                          {"user": d.front_user, "gid": gid}) from None


def _directory(path: Path, mode: int, uid: int, gid: int) -> None:
    path.mkdir(mode=mode, parents=True, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise GpudError(f"{path} is not a directory")
    if (st.st_uid, st.st_gid) != (uid, gid):
        os.chown(path, uid, gid)
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)


def _log_file(path: Path, gid: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o660)
    try:
        st = os.fstat(fd)
        if (st.st_uid, st.st_gid) != (0, gid):
            os.fchown(fd, 0, gid)
        if stat.S_IMODE(st.st_mode) != 0o660:
            os.fchmod(fd, 0o660)
    finally:
        os.close(fd)


def prepare_socket_dir(d: DaemonConfig) -> str:
    """Make the serves' socket directory (root, the front's group, 02750); its path."""
    _uid, gid = _front_ids(d)
    try:
        _directory(Path(d.serve_socket_dir), SOCKET_DIR_MODE, 0, gid)
    except OSError as exc:
        raise GpudError(f"daemon.serve_socket_dir: cannot prepare {d.serve_socket_dir}: "
                        f"{exc.strerror or exc}") from exc
    return d.serve_socket_dir


_SAID: set[str] = set()


def open_to_front(d: DaemonConfig, serve: str) -> None:
    """Give a fronted serve's socket, once it is bound, to the front's group (0660)."""
    path = socket_path(d.serve_socket_dir, serve)
    try:
        st = os.lstat(path)
        if not stat.S_ISSOCK(st.st_mode):
            return
        _uid, gid = _front_ids(d)
        if (st.st_uid, st.st_gid) != (0, gid):
            # Root's too: gpud (uid 0 without CAP_DAC_OVERRIDE) connects as the socket's owner,
            # and an unprivileged serve's own socket would otherwise shut it out.
            os.chown(path, 0, gid)
        if stat.S_IMODE(st.st_mode) & SOCKET_MODE != SOCKET_MODE:
            os.chmod(path, stat.S_IMODE(st.st_mode) | SOCKET_MODE)
    except FileNotFoundError:
        return
    except (OSError, GpudError) as exc:
        # Once per serve and reason: this runs before every health check.
        said = f"{serve}: {exc}"
        if said not in _SAID:
            _SAID.add(said)
            log.warning("serve %s: cannot give its socket to the front: %s", serve, exc)


def nginx_argv(d: DaemonConfig) -> tuple[str, ...]:
    front = d.front_dir.rstrip("/")
    return (d.front_nginx, "-c", f"{front}/nginx.conf", "-p", f"{front}/run/")


def unit_properties(d: DaemonConfig) -> list[tuple[str, Variant]]:
    values = _unit_values(d)
    return [encode(name, value) for name, value in
            [("Description", description(d)), *values]]


def description(d: DaemonConfig) -> str:
    """The front unit's Description: what it is, and a digest of every other property it is
    started with. A front found running with another (started by an earlier gpud, whose unit
    lacked a path this one's nginx.conf writes to, or by hand) is started again, since a
    transient unit's properties are fixed at its start and nginx's reload cannot change them."""
    digest = hashlib.sha256(repr(_unit_values(d)).encode()).hexdigest()[:12]
    return f"gpud front: the client API of fronted serves (unit {digest})"


def _unit_values(d: DaemonConfig) -> list[tuple[str, object]]:
    return [
        ("Type", "exec"),
        ("ExecStart", nginx_argv(d)),
        ("Slice", SLICE),
        ("User", d.front_user),
        ("Restart", "on-failure"),
        ("RestartUSec", 1.0),
        ("SyslogIdentifier", "gpud-front"),
        ("StandardInput", "null"),
        ("StandardOutput", "journal"),
        ("StandardError", "journal"),
        ("CollectMode", "inactive-or-failed"),
        # The descriptors of worker_rlimit_nofile (gpud.core.front.NOFILE), soft and hard:
        # systemd's default soft limit of 1024 let one user's idle connections take every
        # fronted port (accept4() failed: Too many open files).
        ("LimitNOFILE", NOFILE),
        # Bodies in memory (docs/security.md): a bound of the front's own, not the host's.
        ("MemoryHigh", MEMORY_HIGH_BYTES),
        ("MemoryMax", MEMORY_MAX_BYTES),
        # nginx needs its config (read), its run directory (write), the serves' sockets and
        # TCP listeners; nothing else. (MemoryDenyWriteExecute= is left out: Debian's nginx
        # is built --with-pcre-jit.)
        ("UMask", 0o077),
        ("NoNewPrivileges", True),
        ("ProtectSystem", "strict"),
        # and the router's access log (gpud.nginx.router.LOG_DIR)
        ("ReadWritePaths", [f"{d.front_dir.rstrip('/')}/run", log_dir(d)]),
        ("ProtectHome", "yes"),
        ("PrivateTmp", True),
        ("PrivateDevices", True),
        ("ProtectKernelTunables", True),
        ("ProtectKernelModules", True),
        ("ProtectKernelLogs", True),
        ("ProtectControlGroups", True),
        ("ProtectClock", True),
        ("ProtectHostname", True),
        ("ProtectProc", "invisible"),
        ("RestrictRealtime", True),
        ("RestrictSUIDSGID", True),
        ("LockPersonality", True),
        ("CapabilityBoundingSet", 0),
        ("SystemCallArchitectures", ["native"]),
        ("RestrictAddressFamilies", ["AF_UNIX", "AF_INET", "AF_INET6"]),
        ("SystemCallFilter", ["@system-service"]),
    ]


def listens(text: str) -> frozenset[str]:
    """The addresses a front's nginx.conf listens on (its `listen` lines)."""
    return frozenset(re.findall(r"^\s*listen (\S+);", text, re.MULTILINE))


def running_listens(d: DaemonConfig) -> frozenset[str]:
    """What the front's nginx.conf on disk listens on: the ports the front holds while it runs
    (none when there is no such file, or it cannot be read)."""
    try:
        return listens((Path(d.front_dir) / "nginx.conf").read_text())
    except (OSError, UnicodeDecodeError):
        return frozenset()


def _host_port(listen: str) -> tuple[str, int]:
    """HOST:PORT of a `listen` line as an address to bind or connect to."""
    host, _, port = listen.rpartition(":")
    return ("127.0.0.1" if host == "localhost" else host.strip("[]")), int(port)


def in_use(listen: str) -> bool:
    """Whether HOST:PORT is bound by some process (the bind gpud would have nginx make fails
    with EADDRINUSE; SO_REUSEADDR, as nginx's, so that a socket in TIME_WAIT is not one)."""
    host, port = _host_port(listen)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


# How long a started or reloaded front has to listen on every address of its config before
# gpud says it does not (nginx binds in a few milliseconds; a front that exits at once, or keeps
# its old config on a reload, never does).
LISTEN_WAIT_S: Final = 5.0


async def not_listening(addresses: frozenset[str], wait_s: float = LISTEN_WAIT_S,
                        every_s: float = 0.02) -> list[str]:
    """Of ADDRESSES (HOST:PORT), those that accept no connection within WAIT_S, sorted. Each is
    tried by a connection that sends nothing and is closed at once: nginx answers no request
    and writes no access-log line for it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    left = sorted(addresses)
    while left:
        for listen in list(left):
            with contextlib.suppress(OSError, asyncio.TimeoutError):
                _reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(*_host_port(listen)), timeout=max(every_s, 0.2))
                writer.close()
                left.remove(listen)
        if not left or loop.time() >= deadline:
            break
        await asyncio.sleep(every_s)
    return left


@dataclass(frozen=True)
class Dark:
    """Something that would leave the router or a front's port dark: the config key it is
    about (router.listen, router.api_keys_file, serves.NAME.port, ...) and why."""

    what: str
    reason: str

    @property
    def message(self) -> str:
        return f"{self.what}: {self.reason}"


@dataclass(frozen=True)
class FrontCheck:
    """What the front of a config is made of, found once (the keys file read once): the
    router (None: off) and what would leave the router or a front dark (``dark``)."""

    router: RouterFront | None
    dark: tuple[Dark, ...]
    # the fronted serves whose port another process holds: left out of nginx.conf (nginx
    # would refuse the whole config, every other port with it)
    taken: frozenset[str] = frozenset()


def check_front(cfg: Config, running: frozenset[str] = frozenset()) -> FrontCheck:
    """The router of CFG and what would leave it or a front dark: the njs module missing, the
    keys file refused (unreadable, invalid, a key naming a model no serve answers to), a
    model name the router cannot carry, an address another process holds (RUNNING: what the
    front listens on already, its own)."""
    dark: list[Dark] = []
    router: RouterFront | None = None
    r = cfg.router
    if r is not None:
        if not os.path.isfile(r.njs_module):
            dark.append(Dark("router.njs_module", f"{r.njs_module} not found, so the router "
                             "would be off (apt-get install libnginx-mod-http-js)"))
        else:
            try:
                router = router_front(cfg)
            except ConfigError as exc:
                dark += [Dark("router.api_keys_file", f"{exc.source}: {p}")
                         for p in exc.problems]
            except ValueError as exc:
                dark.append(Dark("router", str(exc).removeprefix("router: ")))
        if r.listen not in running and in_use(r.listen):
            dark.append(Dark("router.listen", f"{r.listen} is in use by another process: the "
                             "router could not listen there"))
            router = None
    taken = set()
    for name, port in sorted(fronted(cfg).items()):
        where = f"127.0.0.1:{port}"
        if where not in running and in_use(where):
            taken.add(name)
            dark.append(Dark(f"serves.{name}.port", f"{where} is in use by another process: "
                             f"the front of {name} could not listen there"))
    return FrontCheck(router, tuple(dark), frozenset(taken))


def keys_on_disk(d: DaemonConfig) -> tuple[ApiKey, ...] | None:
    """The keys of the router's script as gpud last wrote it (its CONFIG's digests and
    models, gpud.core.routerconf.render_script), None when there is none or it has no keys."""
    try:
        head = (Path(d.front_dir) / SCRIPT_NAME).read_text().split("\n\n", 1)[0]
        doc = json.loads(head.split("var CONFIG = ", 1)[1].rstrip().rstrip(";"))
        keys = doc["keys"]
        if keys is None:
            return None
        return tuple(ApiKey(k["name"], digest, tuple(k["models"]))
                     for digest, k in sorted(keys.items()))
    except (OSError, UnicodeDecodeError, IndexError, ValueError, KeyError, TypeError):
        return None


def _write_if_changed(path: Path, text: str, gid: int) -> bool:
    """Write PATH when its text changed: root's, read by the front's group (nginx runs as the
    front's user), nobody else (the router's script holds the keys' digests)."""
    with contextlib.suppress(OSError):
        if path.read_text() == text:
            return False
    write_atomically(path, text, mode=0o640, gid=gid)
    return True


class Front:
    """Keeps gpud-front.service serving the fronted serves of the config in force."""

    def __init__(self, units: SystemdUnits,
                 states: Callable[[], Mapping[str, ServeState]] = dict,
                 listening: Callable[[frozenset[str]], Awaitable[list[str]]] = not_listening,
                 over_budget: Callable[[Sequence[ApiKey]], tuple[Over, ...]] | None = None,
                 peers: Callable[[], tuple[RoutedPeer, ...]] | None = None) -> None:
        self.units = units
        self.states = states
        # what of the front's addresses does not listen after a start or reload (not_listening)
        self.not_listening = listening
        self.text: str | None = None
        # The config last synced, and the awake files as last written (None: not yet).
        self._config: Config | None = None
        self._awake: frozenset[str] | None = None
        # The router last written (its keys kept while the keys file is refused), and what
        # the last sync left dark (GET /v1/status: front.degraded).
        self._router: RouterFront | None = None
        self.degraded: tuple[str, ...] = ()
        # The keys past a token budget (gpud.nginx.router.RouterLog.over_budget; None: no
        # budgets checked), rendered into the router's script at each sync.
        self.over_budget = over_budget
        # The peers the router forwards to (gpud.host.peers.PeerPoller.routed; None: none),
        # rendered at each sync and when they change (peers_changed).
        self.peers = peers
        self._syncing = asyncio.Lock()

    def _over(self, router: RouterFront | None) -> tuple[Over, ...]:
        """ROUTER's keys past a budget now; what was rendered last when the store cannot
        be read (said)."""
        if router is None or not router.keys or self.over_budget is None:
            return ()
        try:
            return self.over_budget(router.keys)
        except GpudError as exc:
            log.warning("router: budgets not checked: %s", exc.message)
            return self._router.over_budget if self._router is not None else ()

    def keys(self) -> tuple[ApiKey, ...]:
        """The router's keys as last synced (none: no router, or keys off)."""
        return self._router.keys or () if self._router is not None else ()

    async def budgets_changed(self) -> None:
        """Sync the front when the keys past a token budget are not those its router was
        told (a key crossed its budget, a period ended): after usage is stored. A rare event:
        nothing is rendered otherwise. Under the config last synced (a reload's sync, which
        checks budgets itself, is not raced)."""
        async with self._syncing:
            router, cfg = self._router, self._config
            if router is None or not router.keys or cfg is None:
                return
            over = await asyncio.to_thread(self._over, router)
            if over == router.over_budget:
                return
            for o in sorted(set(over) - set(router.over_budget)):
                log.warning("router: key %s has used its tokens_per_%s (%d of %d tokens): "
                            "refused until %s", o.key, o.period, o.used, o.limit,
                            time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(o.until)))
            try:
                await self._sync(cfg)
            except GpudError as exc:
                log.error("front not in line with the config: %s", exc.message)

    async def peers_changed(self) -> None:
        """Sync the front when what the router is told of the peers changed (a model offered
        or gone, a circuit opened or closed: gpud.host.peers.PeerPoller.watch). A rare event,
        as a budget's; under the config last synced."""
        async with self._syncing:
            router, cfg = self._router, self._config
            if router is None or cfg is None or self.peers is None:
                return
            if self.peers() == router.peers:
                return
            try:
                await self._sync(cfg)
            except GpudError as exc:
                log.error("front not in line with the config: %s", exc.message)

    def write(self, cfg: Config, router: RouterFront | None, text: str) -> bool:
        """Write nginx.conf (TEXT), ROUTER's script and the front's own directories; whether
        either changed."""
        d = cfg.daemon
        uid, gid = _front_ids(d)
        front = Path(d.front_dir)
        try:
            _directory(front, 0o755, 0, 0)
            # The front's own: nginx makes its temporary directories in it at start (gpud,
            # root without CAP_DAC_OVERRIDE, could not enter them to check).
            _directory(front / "run", 0o700, uid, gid)
            _directory(Path(awake_dir(d)), 0o750, 0, gid)
            _directory(Path(cut_dir(d)), 0o750, 0, gid)
            # The router's access log: gpud's file, written by the front's group (nginx
            # opens it, and gpud reads and empties it, gpud.nginx.router.RouterLog).
            _directory(Path(log_dir(d)), 0o750, 0, gid)
            _log_file(Path(log_path(d)), gid)
        except OSError as exc:
            raise GpudError(f"daemon.front_dir: cannot prepare {d.front_dir}: "
                            f"{exc.strerror or exc}") from exc
        # The router's script first: nginx reads it when it loads the config.
        script_changed = router is not None and _write_if_changed(
            front / SCRIPT_NAME, script_text(router), gid)
        conf = front / "nginx.conf"
        if not _write_if_changed(conf, text, gid):
            return script_changed
        return True

    def listening(self) -> frozenset[str]:
        """What the front this gpud synced listens on (its own ports: none before a sync)."""
        cfg = self._config
        return running_listens(cfg.daemon) if cfg is not None else frozenset()

    def problems(self, cfg: Config) -> list[Dark]:
        """What CFG would leave dark, as a reload, an apply or a plan refuses it."""
        return list(check_front(cfg, self.listening()).dark)

    def _checked(self, cfg: Config, running: frozenset[str]) -> FrontCheck:
        """check_front, but keeping the keys last read while the keys file is refused (the
        world changed under a running config: the router stays up with what it had)."""
        check = check_front(cfg, running)
        refused = [d for d in check.dark if d.what == "router.api_keys_file"]
        if not refused or \
                len(refused) != len([d for d in check.dark if d.what.startswith("router")]):
            return check
        # the keys this gpud last wrote, else those of the script the front runs (a gpud
        # restarted under a keys file refused since)
        last = self._router.keys if self._router is not None else keys_on_disk(cfg.daemon)
        if last is not None:
            with contextlib.suppress(ConfigError, ValueError):
                kept = router_front(cfg, keys=last)
                check = FrontCheck(kept, tuple(
                    Dark(d.what, d.reason + " (keeping the keys last read)")
                    if d in refused else d for d in check.dark), check.taken)
        return check

    def mark_awake(self) -> None:
        """Keep one file per fronted serve that is running (awake) in the awake directory, none
        for any other: what the front goes by while gpud does not answer. Called after every
        committed change of states and at each sync; touches only what changed since the last
        call (all of it the first time)."""
        cfg = self._config
        if cfg is None:
            return
        states = self.states()
        awake = frozenset(name for name in fronted(cfg) if states.get(name) == ServeState.RUNNING)
        if awake == self._awake:
            return
        where = Path(awake_dir(cfg.daemon))
        try:
            if self._awake is None:
                present = {p.name for p in where.iterdir() if not p.name.startswith(".")}
            else:
                present = set(self._awake)
            for name in present - awake:
                (where / name).unlink(missing_ok=True)
            for name in awake - present:
                write_atomically(where / name, "", mode=0o640)
        except (OSError, GpudError) as exc:
            self._awake = None  # found out again next time
            log.error("front: cannot keep the awake files in %s: %s", where, exc)
            return
        self._awake = awake

    async def sync(self, cfg: Config) -> None:
        """Bring the front in line with CFG: started when there are fronted serves and it is
        not running, reloaded when its config changed. What would be dark (the router's keys
        refused, its module missing, a port another process holds) is left out and said
        (``degraded``, GET /v1/status); the keys last read are kept while the keys file is
        refused. The router's part is computed once, its keys file read once. One sync at a
        time (a reload's and a budget's: budgets_changed)."""
        async with self._syncing:
            await self._sync(cfg)

    async def _sync(self, cfg: Config) -> None:
        if not fronted(cfg) and cfg.router is None and self.text is None:
            # Nothing to front, and no front started by this gpud: no D-Bus traffic (a
            # front left from before keeps its config until a fronted serve comes back).
            return
        state = await self.units.active_state(FRONT_UNIT)
        active = state in ("active", "reloading", "activating")
        check = self._checked(cfg, running_listens(cfg.daemon) if active else frozenset())
        self.degraded = tuple(d.message for d in check.dark)
        for message in self.degraded:
            log.error("front degraded: %s", message)
        router = check.router
        if router is not None and router.keys:
            router = dataclasses.replace(router, over_budget=self._over(router))
        if router is not None and self.peers is not None:
            router = dataclasses.replace(router, peers=self.peers(), host=host_name())
        if router is None and cfg.router is not None:
            cfg = cfg.model_copy(update={"router": None})
        prepare_socket_dir(cfg.daemon)
        text = render(front_config(cfg, router, check.taken))
        changed = self.write(cfg, router, text)
        self.text, self._router = text, router
        self._config, self._awake = cfg, None
        self.mark_awake()
        if active:
            running = await self.units.unit_property(FRONT_UNIT, "Description")
            if running == description(cfg.daemon):
                if changed:
                    await self.units.kill_main(FRONT_UNIT, signal.SIGHUP)
                    await self._listening("reloaded", cfg, text)
                return
            log.warning("front: %s runs with other unit properties than this gpud starts it "
                        "with (%r: started by an earlier gpud, or by hand); starting it again, "
                        "which ends the connections through it", FRONT_UNIT, running)
            await self.units.stop_unit(FRONT_UNIT, START_TIMEOUT_S)
            state = await self.units.active_state(FRONT_UNIT)
        if state is not None:
            await self.units.reset_failed_unit(FRONT_UNIT)
        await self.units.start_transient(FRONT_UNIT, unit_properties(cfg.daemon),
                                         START_TIMEOUT_S)
        await self._listening("started", cfg, text)

    async def _listening(self, how: str, cfg: Config, text: str) -> None:
        """Say the front started or reloaded once it listens on every address of TEXT (its
        unit is Type=exec: active once nginx is executed, before it has bound them); one that
        does not within LISTEN_WAIT_S is dark there, said as an error and in `degraded`."""
        dark = await self.not_listening(listens(text))
        if not dark:
            log.info("front %s: %d fronted serve(s)", how, len(fronted(cfg)))
            return
        message = (f"{', '.join(dark)}: the front {how} but does not listen there after "
                   f"{LISTEN_WAIT_S:.0f} s (its log: journalctl -u {FRONT_UNIT})")
        log.error("front degraded: %s", message)
        self.degraded = (*self.degraded, message)

    async def sync_logged(self, cfg: Config) -> None:
        """sync, with a failure logged: the serves and the ledger go on without the front."""
        try:
            await self.sync(cfg)
        except GpudError as exc:
            log.error("front not in line with the config: %s", exc.message)


class SocketSessions:
    """HTTP clients of fronted serves, one per socket (aiohttp binds a connector, and so a
    Unix socket, to a session)."""

    def __init__(self, timeout_s: float = 2.0) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._sessions: dict[str, aiohttp.ClientSession] = {}

    def session(self, path: str) -> aiohttp.ClientSession:
        found = self._sessions.get(path)
        if found is None or found.closed:
            found = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path),
                                          timeout=self._timeout)
            self._sessions[path] = found
        return found

    async def close(self) -> None:
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            await session.close()
