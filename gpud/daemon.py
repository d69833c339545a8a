"""gpud's process: arguments, lifecycle, the socket, signals and sd_notify.

Resources are entered in order and left in reverse (an AsyncExitStack): store, observer, bus,
API listener, supervisor. SIGTERM/SIGINT set an event; SIGHUP reloads the config. Stopping gpud
never stops the serves: they are systemd units of their own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import fcntl
import grp
import logging
import os
import pwd
import resource
import signal
import socket
import stat
import sys
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpud import __version__
from gpud.config import (
    Config,
    apply_overrides,
    config_warnings,
    device_ids,
    device_totals,
    parse_config,
    read_config_text,
    summary,
    vllm_release_notes,
)
from gpud.core import answers
from gpud.core.observation import normalize_bus_id
from gpud.errors import ConfigError, Conflict, GpudError
from gpud.life.offload import INLINE_ENV, Offload
from gpud.life.service import LedgerService, resolve_budgets

if TYPE_CHECKING:
    from aiohttp import web

    from gpud.core.quota import BudgetState
    from gpud.host.observer import Observer
    from gpud.host.peers import PeerPoller
    from gpud.life.alerts import Alerts
    from gpud.life.calibration import Calibrator
    from gpud.life.rebalance import Recovery
    from gpud.life.supervisor import ServeClients, Supervisor
    from gpud.life.traffic import Traffic
    from gpud.nginx.front import Front
    from gpud.nginx.router import RouterLog
    from gpud.server.api import Api
    from gpud.server.ondemand import OnDemand

log = logging.getLogger("gpud")

SD_LISTEN_FDS_START = 3


@dataclass(frozen=True)
class Parts:
    """The components gpud's run makes over its ledger (Daemon._parts), in the order made."""

    svc: LedgerService
    observer: Observer
    alerts: Alerts
    calibrator: Calibrator
    supervisor: Supervisor
    traffic: Traffic
    on_demand: OnDemand
    peers: PeerPoller
    router_log: RouterLog


class SocketInUse(GpudError):
    code = "socket-in-use"


class StateDirInUse(GpudError):
    code = "state-dir-in-use"


def lock_state_dir(state_dir: Path) -> int:
    """Take the state directory for this gpud's whole life (one writer per ledger): an
    exclusive lock on `gpud.lock`, which holds the owner's PID. Returns the open descriptor."""
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
    path = state_dir / "gpud.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StateDirInUse(f"the state directory {state_dir} is in use by another gpud "
                            f"(pid {holder}): one gpud per ledger") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def inherited_socket() -> socket.socket | None:
    """The listening socket systemd passed us (gpud.socket), if any."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return None
    try:
        count = int(os.environ.get("LISTEN_FDS", "0"))
    except ValueError:
        return None
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(name, None)
    if count < 1:
        return None
    sock = socket.socket(fileno=SD_LISTEN_FDS_START)
    sock.setblocking(False)
    return sock


def bind_unix_socket(path: Path, group: str | None) -> socket.socket:
    """Bind the API socket: refuse when another gpud answers on it, replace a stale one only
    when nothing answers, mode 0660 and group `group` when it exists."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise SocketInUse(f"{path} exists and is not a socket: refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)  # stale: nothing listens
        except OSError as exc:
            raise SocketInUse(f"cannot tell whether {path} is in use: {exc.strerror}") from exc
        else:
            raise SocketInUse(f"another gpud is already answering on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o117)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o660)
    if group:
        with contextlib.suppress(KeyError, PermissionError):
            os.chown(path, -1, grp.getgrnam(group).gr_gid)
    sock.listen(128)
    sock.setblocking(False)
    return sock


class Notifier:
    """sd_notify, when systemd asked for it (NOTIFY_SOCKET); silent otherwise."""

    def __init__(self) -> None:
        self._notifier: Any = None
        if os.environ.get("NOTIFY_SOCKET"):
            import sdnotify

            self._notifier = sdnotify.SystemdNotifier()

    def __call__(self, message: str) -> None:
        if self._notifier is not None:
            self._notifier.notify(message)


def watchdog_interval() -> float | None:
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec or os.environ.get("WATCHDOG_PID", str(os.getpid())) != str(os.getpid()):
        return None
    try:
        return int(usec) / 1e6 / 2
    except ValueError:
        return None


class Daemon:
    def __init__(self, config: Config, *, config_path: Path | None,
                 notify: Callable[[str], None] | None = None,
                 overrides: dict[str, Any] | None = None,
                 config_text: str | None = None) -> None:
        self.overrides = overrides or {}
        self.config = apply_overrides(config, self.overrides)
        self.config_text = config_text
        self.config_path = config_path
        self.notify = notify or Notifier()
        self.stopping = asyncio.Event()
        # Set once reconciliation and the recovery of an apply cut short are done.
        self.ready = asyncio.Event()
        self.svc: LedgerService | None = None
        self.api: Api | None = None
        # Parsing and planning configs off the event loop (gpud.life.offload); GPUD_EXPENSIVE_INLINE=1
        # keeps them on it, as before, for the benchmark that compares the two.
        self.offload = Offload(inline=os.environ.get(INLINE_ENV) == "1")
        self.front: Front | None = None
        self._signal_tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        """gpud's life: each component built with what it needs, in dependency order, and
        entered on one exit stack (left in reverse); then ready, until SIGTERM or SIGINT."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
        async with AsyncExitStack() as stack:
            svc, observer, recovery = await self._ledger(stack)
            parts = await self._parts(stack, svc, observer)
            await self._serve_api(stack, parts)
            front = await self._reconcile(parts, recovery)
            self._ready(parts)
            self._background(stack, parts, front)
            await self.stopping.wait()
            self.notify("STOPPING=1")
            log.info("gpud stopping; serves keep running")

    async def _ledger(self, stack: AsyncExitStack) -> tuple[LedgerService, Observer, Recovery]:
        """The state directory's lock, the store, observation and the ledger, loaded (under
        the config of an apply cut short, when there was one: its recovery goes on later)."""
        # Imported here, not at the top: `gpud --check-config` needs none of it (aiohttp alone
        # costs about 130 ms, its client and TLS set-up included).
        from gpud.durable.store import Store
        from gpud.life.rebalance import Recovery

        cfg = self.config
        stack.callback(os.close, lock_state_dir(Path(cfg.daemon.state_dir)))
        stack.callback(self.offload.close)
        store = Store(Path(cfg.daemon.state_dir) / "gpud.sqlite3")
        stack.callback(store.close)
        observer = await self._observer(stack)
        svc = LedgerService(cfg, store, config_path=self.config_path, observer=observer,
                            config_text=self.config_text,
                            overrides=lambda c: apply_overrides(c, self.overrides))
        self.svc = svc
        stack.callback(svc.close)
        recovery = Recovery(svc, self.config_path)
        if recovery.prepare() and recovery.text is not None:
            # Started under the config in force when the apply was cut short: its rollback
            # (recovery.finish) goes from there, as a failed apply's would.
            self.config_text = recovery.text
            svc.config = apply_overrides(parse_config(self.config_text,
                                                      str(self.config_path),
                                                      checkpoints=False), self.overrides)
            svc.config_text = self.config_text
        svc.load()
        self.config = svc.config
        return svc, observer, recovery

    async def _parts(self, stack: AsyncExitStack, svc: LedgerService,
                     observer: Observer) -> Parts:
        """The components over the ledger, each made with what it needs: alerts, calibration,
        the serves' HTTP clients, what is in flight on each serve, the supervisor (its
        preemptions drain through the traffic), the on-demand orchestrator, the peers and the
        router's log."""
        from gpud.host.peers import PeerPoller
        from gpud.host.traffic import InFlightReader
        from gpud.life.alerts import Alerts
        from gpud.life.calibration import Calibrator
        from gpud.life.supervisor import ServeClients
        from gpud.life.traffic import Traffic
        from gpud.nginx.router import KeyShares, RouterLog
        from gpud.server.ondemand import OnDemand

        alerts = Alerts(svc, observer)
        observer.listen(alerts)
        calibrator = Calibrator(svc, observer)
        calibrator.load()
        clients = await stack.enter_async_context(
            ServeClients(lambda: svc.config.daemon.serve_socket_dir))
        # What is in flight on each serve: idle times count from the last request's end,
        # preemptions drain first (gpud.life.traffic).
        traffic = Traffic(svc, InFlightReader(clients.serve_http))
        supervisor = await self._supervisor(stack, svc, observer, calibrator, clients, traffic)
        stack.push_async_callback(calibrator.close)
        on_demand = OnDemand(svc, supervisor, traffic=traffic,
                             share=KeyShares(lambda: svc.config))
        # What a request through the front waits on: a stored state, a serve's life, a drain.
        svc.watch_states(on_demand.changed)
        svc.records.watch_lives(lambda serve: on_demand.changed((serve,)))
        traffic.watch(lambda serve: on_demand.changed((serve,)))
        # counting from now (before the front); usage per key into the store
        peers = PeerPoller(lambda: svc.config)
        router_log = RouterLog(lambda: svc.config, svc.store, peer=peers.count)
        return Parts(svc, observer, alerts, calibrator, supervisor, traffic, on_demand, peers,
                     router_log)

    async def _serve_api(self, stack: AsyncExitStack, parts: Parts) -> None:
        """The API and its listeners. What comes later (the front: its budgets, what it
        listens on, what it left dark) the API and the rebalancer ask the daemon for."""
        from gpud.life.rebalance import Rebalancer
        from gpud.server.api import Api
        from gpud.server.metrics import render

        svc, router_log = parts.svc, parts.router_log

        def metrics() -> str:
            router_log.read()
            return render(svc, parts.observer, parts.calibrator, parts.on_demand, router_log,
                          self._front_degraded, parts.peers)

        def budgets() -> Sequence[BudgetState]:
            # each key's use of its token budgets (GET /v1/usage): none before the front
            return router_log.budget_states(self.front.keys()) if self.front is not None else []

        self.api = Api(svc, draws=parts.observer, supervisor=parts.supervisor,
                       calibrations=parts.calibrator, metrics=metrics, reload=self.reload,
                       rebalancer=Rebalancer(svc, parts.supervisor, parts.observer,
                                             config_path=self.config_path,
                                             reload=self._apply_reload,
                                             offload=self.offload,
                                             overrides=self.overrides,
                                             front_listens=self._front_listens),
                       offload=self.offload, on_demand=parts.on_demand,
                       front_degraded=self._front_degraded, peers=parts.peers.answer,
                       budgets=budgets)
        await self._listen(stack, self.api.app)
        stack.callback(svc.end_streams)  # before the listener waits for open requests
        # the requests waiting for a serve are answered (typed: gpud stopping), not cut
        stack.push_async_callback(parts.on_demand.stopping)

    async def _reconcile(self, parts: Parts, recovery: Recovery) -> Front:
        """Reconcile the ledger with systemd, then sync the front, finish the recovery of an
        apply cut short, and take a refused config again."""
        from gpud.nginx.front import Front

        svc, supervisor = parts.svc, parts.supervisor
        await supervisor.boot_job.reconcile()
        # keys past a token budget, decided as usage is stored (docs/router.md, "Budgets")
        self.front = front = Front(supervisor.units, states=svc.states,
                                   over_budget=parts.router_log.over_budget,
                                   peers=parts.peers.routed)
        # the router forwards to the peers (docs/peers.md): rendered again when a peer's
        # models or circuit change, never on a poll that changed nothing of them
        parts.peers.watch(front.peers_changed)
        svc.watch_states(lambda _serves: front.mark_awake())
        await front.sync_logged(self.config)
        await recovery.finish(supervisor, self._apply_reload)
        if svc.config_refused is not None:
            # Serves found dead at reconciliation may no longer stand in the way.
            with contextlib.suppress(GpudError):
                await self.reload(None)
        if parts.observer.latest is not None:
            await parts.alerts(parts.observer.latest)
        return front

    def _ready(self, parts: Parts) -> None:
        svc = parts.svc
        svc.ready = True
        parts.on_demand.changed()  # the requests that came while gpud reconciled go on
        self.ready.set()
        self.notify(f"READY=1\nSTATUS={svc.summary()}")
        log.info("gpud %s ready: %s", __version__, svc.summary())

    def _background(self, stack: AsyncExitStack, parts: Parts, front: Front) -> None:
        """The loops that run while gpud does, each cancelled on the way out."""
        loop = asyncio.get_running_loop()
        interval = watchdog_interval()
        if interval:
            stack.push_async_callback(_cancel, loop.create_task(self._watchdog(interval)))
        stack.push_async_callback(_cancel, loop.create_task(self._boot(parts.supervisor)))
        stack.push_async_callback(_cancel, loop.create_task(parts.traffic.loop()))
        stack.push_async_callback(_cancel, loop.create_task(parts.on_demand.idle_loop()))
        stack.push_async_callback(_cancel, loop.create_task(parts.router_log.loop(
            stored=front.budgets_changed)))
        stack.push_async_callback(_cancel, loop.create_task(parts.peers.run()))

    async def _observer(self, stack: AsyncExitStack) -> Observer:
        from gpud.host.observer import make_observer

        observer = make_observer(self.config)
        await stack.enter_async_context(observer)
        status = observer.status()
        if status["available"]:
            log.info("observing %d device(s) through %s%s", len(status["devices"]),
                     status["backend"], " (simulated)" if status["simulated"] else "")
        else:
            log.warning("observation unavailable (%s): strict admission falls back to the "
                        "ledger bound", status["reason"])
        return observer

    async def _supervisor(self, stack: AsyncExitStack, svc: LedgerService,
                          observer: Observer, calibrator: Calibrator, clients: ServeClients,
                          traffic: Traffic) -> Supervisor:
        from gpud.life.supervisor import make_supervisor

        supervisor = make_supervisor(svc, self.config, observer=observer, notify=self.notify,
                                     calibrated=calibrator, clients=clients, traffic=traffic)
        await stack.enter_async_context(supervisor)
        available, why = supervisor.launching()
        if not available:
            log.warning("launching unavailable (%s): the ledger works, starts answer 503", why)
        return supervisor

    async def _boot(self, supervisor: Supervisor) -> None:
        await supervisor.boot_job.boot()
        if self.svc is not None:
            self.notify(f"STATUS={self.svc.summary()}")

    def _front_degraded(self) -> tuple[str, ...]:
        return self.front.degraded if self.front is not None else ()

    def _front_listens(self) -> frozenset[str] | None:
        return self.front.listening() if self.front is not None else None

    def _front_cap(self, uid: int) -> int | None:
        """The front's uid may hold every ensure gpud lets wait and a reserve for reads
        (gpud.server.connguard.FRONT_READ_RESERVE); other uids the default cap (None)."""
        from gpud.server.api import _uid_of
        from gpud.server.connguard import FRONT_READ_RESERVE

        d = self.config.daemon
        if uid != _uid_of(d.front_user):
            return None
        return d.ensure_waiting_total + FRONT_READ_RESERVE

    async def _listen(self, stack: AsyncExitStack, app: web.Application) -> None:
        from aiohttp import web

        from gpud.server.connguard import GuardedSockSite, GuardedTCPSite, Limiter

        # Idle keep-alive connections are closed after 15 s (aiohttp's default is an hour).
        runner = web.AppRunner(app, access_log=None, handle_signals=False, keepalive_timeout=15)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        sock = inherited_socket()
        path = Path(self.config.daemon.socket)
        if sock is None:
            sock = bind_unix_socket(path, self.config.daemon.socket_group)
            stack.callback(_unlink_if_ours, path, os.stat(path).st_ino)
        site = GuardedSockSite(runner, sock, Limiter(cap_of=self._front_cap),
                               lambda: self.config.daemon.request_read_timeout_s)
        await site.start()
        listen = self.config.daemon.metrics_listen
        if listen:
            host, _, port = listen.rpartition(":")
            await GuardedTCPSite(runner, host or "127.0.0.1", int(port),
                                 lambda: self.config.daemon.request_read_timeout_s).start()
            log.info("metrics on http://%s/metrics", listen)
        log.info("listening on %s", path if sock.family == socket.AF_UNIX else sock)

    async def _watchdog(self, interval: float) -> None:
        while True:
            self.notify("WATCHDOG=1")
            await asyncio.sleep(interval)

    def _on_sighup(self) -> None:
        # The task is kept until it is done: the loop holds only a weak reference to it.
        task = asyncio.get_running_loop().create_task(self._sighup())
        self._signal_tasks.add(task)
        task.add_done_callback(self._signal_tasks.discard)

    async def _sighup(self) -> None:
        # Not before gpud is ready: a reload during reconciliation or during the rollback of an
        # apply cut short would decide the file against a ledger still being put right. It
        # waits, and is not lost.
        if not self.ready.is_set():
            log.info("SIGHUP during start-up: the reload waits until gpud is ready")
            await self.ready.wait()
        try:
            await self.reload(None)
        except GpudError as exc:
            log.error("reload refused, keeping the running config: %s", exc.message)

    async def reload(self, uid: int | None, text: str | None = None, *,
                     during_apply: bool = False) -> answers.Reloaded:
        """Read the config file (or take `text`, which apply has just written there) and decide
        it against the ledger. Refused while an apply is under way, except by that apply."""
        if self.config_path is None or self.svc is None:
            raise GpudError("no config file to reload")
        if self.applying() and not during_apply:
            raise Conflict("an apply is in progress: reload refused (the apply reloads itself)")
        self.notify("RELOADING=1")
        try:
            if text is None:
                text = read_config_text(self.config_path)
            # in a worker thread: a config of 1 MiB takes the better part of a second
            parsed = await self.offload.run(parse_config, text, str(self.config_path))
            cfg = apply_overrides(parsed, self.overrides)
            if cfg.daemon.vllm_version != self.config.daemon.vllm_version:
                for note in vllm_release_notes(cfg):
                    log.warning("%s", note)
            if self.front is not None:
                # refused before anything changes: what would leave the router or a front dark
                dark = self.front.problems(cfg)
                if dark:
                    raise ConfigError(str(self.config_path), [
                        f"{d.message} (the running config is kept)" for d in dark])
            over = await self.svc.reload(cfg, text, source=str(self.config_path), uid=uid)
            self.config = cfg
            if self.front is not None:
                await self.front.sync_logged(cfg)
            if self.api is not None:
                self.api.config_changed()
                if self.api.on_demand is not None:
                    self.api.on_demand.changed()  # the serves' roles and priorities: all look
            return {"reloaded": True, "over_committed": over, "summary": self.svc.summary()}
        finally:
            self.notify(f"READY=1\nSTATUS={self.svc.summary()}")

    async def _apply_reload(self, uid: int | None, text: str) -> answers.Reloaded:
        return await self.reload(uid, text, during_apply=True)

    def applying(self) -> bool:
        return self.api is not None and self.api.rebalancer is not None and \
            self.api.rebalancer.busy


async def _cancel(task: asyncio.Task[Any]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _unlink_if_ours(path: Path, inode: int) -> None:
    with contextlib.suppress(OSError):
        if os.stat(path).st_ino == inode:
            path.unlink()


def check_config(path: Path, *, show_commands: bool = False) -> int:
    try:
        cfg = parse_config(read_config_text(path), str(path))
        known = {normalize_bus_id(k) if ":" in k else k: v for k, v in device_totals(cfg).items()}
        devices = ([f"{d.uuid} (index {d.index if d.index is not None else i})"
                    for i, d in enumerate(cfg.simulation.devices)] if cfg.simulation else None)
        ids = {normalize_bus_id(k) if ":" in k else k: v for k, v in device_ids(cfg).items()}
        resolve_budgets(cfg, lambda ref: known.get(normalize_bus_id(ref) if ":" in ref else ref),
                        devices, None,
                        lambda ref: ids.get(normalize_bus_id(ref) if ":" in ref else ref),
                        source=str(path))
    except ConfigError as exc:
        print(exc.message, file=sys.stderr)
        return 2
    unknown = _unknown_users(cfg) + _dark(cfg)
    if unknown:
        print("\n".join(f"{path}: {problem}" for problem in unknown), file=sys.stderr)
        return 2
    print(f"{path}: ok")
    print(summary(cfg))
    for warning in _warnings(cfg):
        print(f"warning: {warning}")
    if show_commands:
        print("\n".join(_commands(cfg)))
    return 0


def _unknown_users(cfg: Config) -> list[str]:
    """The serves' own `user`s that this host does not have (systemd would fail their starts
    with 217/USER). The default identity, daemon.serve_user, is a warning (_warnings): a config
    may be checked before the package made it."""
    from gpud.host.unit_properties import host_identity

    found = []
    for name, serve in sorted(cfg.serves.items()):
        if serve.user is None:
            continue
        try:
            host_identity(name, serve, cfg.daemon, {}, front_group=None)
        except GpudError as exc:
            found.append(exc.message)
    return found


def _warnings(cfg: Config, cdi_dirs: tuple[Path, ...] | None = None,
              unit_dirs: tuple[Path, ...] | None = None) -> list[str]:
    """What --check-config warns about: images not pinned, container serves on a host whose
    CDI specs offer no GPU, peers that do not answer or that gpud's installed unit (found in
    UNIT_DIRS) does not let it reach."""
    from gpud.host import cdi

    found = config_warnings(cfg) + _front_warnings(cfg) + _router_warnings(cfg)
    if cfg.peers:
        from gpud.host.peers import UNIT_DIRS, check_peers, unit_warnings

        found += check_peers(cfg) + unit_warnings(cfg, UNIT_DIRS if unit_dirs is None
                                                  else unit_dirs)
    if cfg.daemon.serve_user not in ("root", "0") and any(
            s.user is None and s.container is None for s in cfg.serves.values()):
        try:
            pwd.getpwnam(cfg.daemon.serve_user)
        except KeyError:
            found.append(f"daemon.serve_user: no user {cfg.daemon.serve_user!r} on this host: "
                         "the serves without their own `user` cannot start (the package "
                         "creates it with systemd-sysusers)")
    engines = sorted({s.container.engine for s in cfg.serves.values() if s.container})
    if engines:
        import shutil

        found += [f"{e} is not installed (not found in PATH): the container serves cannot start"
                  for e in engines if shutil.which(e) is None]
        specs = cdi.scan(cdi.SPEC_DIRS if cdi_dirs is None else cdi_dirs)
        found += [f"container serves: CDI spec {problem}" for problem in specs.problems]
        if not specs.names:
            found.append(f"container serves: {cdi.missing_spec_message()}")
    return found


def _front_warnings(cfg: Config) -> list[str]:
    """A fronted serve (the default for one that sleeps) is reached only through the front:
    without nginx or the front's user its port answers nothing."""
    import pwd

    serves = sorted(name for name, s in cfg.serves.items() if s.front)
    if not serves:
        return []
    found = []
    d = cfg.daemon
    if not os.access(d.front_nginx, os.X_OK):
        found.append(f"daemon.front_nginx: {d.front_nginx} is not an executable here, so the "
                     f"front of {', '.join(serves)} cannot run and their ports answer nothing "
                     "(apt-get install nginx; docs/front.md)")
    try:
        pwd.getpwnam(d.front_user)
    except KeyError:
        found.append(f"daemon.front_user: no user {d.front_user!r} on this host, so the front "
                     f"of {', '.join(serves)} cannot run (the package creates it; docs/front.md)")
    return found


def _router_warnings(cfg: Config) -> list[str]:
    """A router listening beyond loopback without keys: open to whoever reaches it (L6)."""
    r = cfg.router
    if r is None or r.api_keys_file is not None:
        return []
    host = r.listen.rpartition(":")[0].strip("[]")
    if host == "localhost" or host.startswith("127.") or host == "::1":
        return []
    return [f"router.listen: {r.listen} is reachable beyond this host and router.api_keys_file "
            "is not set: anyone who reaches it may use every model (docs/router.md, keys)"]


def _dark(cfg: Config) -> list[str]:
    """What would leave the router or a front dark (gpud.nginx.front.check_front: the njs module
    missing, the keys file refused, a model name the router cannot carry, an address another
    process holds; the front's own, in its nginx.conf, are its): --check-config refuses them,
    as a reload, a plan and an apply do."""
    from gpud.nginx.front import check_front, running_listens

    return [d.message for d in check_front(cfg, running_listens(cfg.daemon)).dark]


def _commands(cfg: Config) -> list[str]:
    """--show-commands: the device totals come from the simulation table, else NVML."""
    from gpud.core.launch import show_commands
    from gpud.core.observation import DeviceSample
    from gpud.host import cdi

    if cfg.simulation is not None:
        from gpud.host.simulation import SimulatedBackend, SimulatedDevice

        sim = SimulatedBackend([SimulatedDevice(d.uuid, d.total_mib, d.index, d.pci_bus_id, d.name)
                                for d in cfg.simulation.devices], Path(cfg.simulation.state_file))
        devices = tuple(DeviceSample(d.uuid, d.index if d.index is not None else i,
                                     d.pci_bus_id or "", d.name or "", d.total_mib, None, None)
                        for i, d in enumerate(sim.devices))
        return show_commands(cfg, devices, "the simulation table (no real GPU)",
                             sim.environment_for, cdi.gpu_names()[0])
    from gpud.host.nvml import NvmlBackend

    backend = NvmlBackend()
    try:
        obs = backend.sample()
    finally:
        backend.close()
    source = "NVML" if obs.available else f"NVML: unavailable ({obs.reason})"
    return show_commands(cfg, obs.devices if obs.available else (), source,
                         cdi_names=cdi.gpu_names()[0])


def build_parser() -> argparse.ArgumentParser:
    """gpud's command line (also the source of gpud(8): scripts/manpage.py)."""
    parser = argparse.ArgumentParser(
        prog="gpud",
        description="gpud: the GPU-memory ledger of this host. Admits or denies reservations "
                    "with a reason, launches serves as systemd units, and reports on a Unix "
                    "socket (see gpuctl).",
    )
    parser.add_argument("--config", type=Path, default=Path("/etc/gpud/serves.toml"),
                        help="serves.toml to run with (default: %(default)s)")
    parser.add_argument("--socket", help="API socket path (overrides daemon.socket)")
    parser.add_argument("--state-dir", help="state directory (overrides daemon.state_dir)")
    parser.add_argument("--check-config", type=Path, metavar="PATH",
                        help="validate PATH, print a summary or the errors (exit 2), and exit")
    parser.add_argument("--show-commands", action="store_true",
                        help="with --check-config: print each serve's environment and argv as "
                             "gpud would launch it, from the device totals it knows")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"],
                        help="least severe messages logged (default: %(default)s)")
    parser.add_argument("--log-target", default="auto", choices=["auto", "journal", "stderr"],
                        help="journald with structured fields, or stderr; auto: journald when "
                             "stderr is connected to the journal (default: %(default)s)")
    parser.add_argument("--version", action="version", version=f"gpud {__version__}")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def raise_nofile_limit() -> None:
    """Lift the soft descriptor limit to the hard one (systemd's default soft limit is 1024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.show_commands and args.check_config is None:
        print("gpud: --show-commands needs --check-config PATH", file=sys.stderr)
        return 2
    if args.check_config is not None:
        return check_config(args.check_config, show_commands=args.show_commands)
    from gpud.durable.journal import setup_logging

    setup_logging(getattr(logging, args.log_level.upper()), target=args.log_target)
    raise_nofile_limit()
    try:
        text = read_config_text(args.config)
        cfg = parse_config(text, str(args.config))
    except ConfigError as exc:
        log.error("%s", exc.message)
        return 2
    for note in vllm_release_notes(cfg):
        log.warning("%s", note)
    overrides: dict[str, Any] = {}
    if args.socket:
        overrides["socket"] = args.socket
    if args.state_dir:
        overrides["state_dir"] = args.state_dir
    try:
        asyncio.run(Daemon(cfg, config_path=args.config.resolve(), overrides=overrides,
                           config_text=text).run())
    except ConfigError as exc:
        print(f"gpud: {exc.message}", file=sys.stderr)
        return 2
    except GpudError as exc:
        log.error("gpud cannot run: %s", exc.message)
        print(f"gpud: {exc.message}", file=sys.stderr)
        return 1
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM):
            print(f"gpud: permission denied: {exc.filename or exc}", file=sys.stderr)
            return 1
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
