"""The router's adapter: what of the config in force the router is made of, and its script's
text (gpud/data/router.js with the table gpud.core.router renders). gpud.front writes both
beside the front's nginx.conf and reloads the front (docs/router.md)."""

from __future__ import annotations

import math
import os
import stat
from functools import cache
from pathlib import Path
from typing import Final

from gpud.config import Config, routed
from gpud.core.front import socket_path
from gpud.core.router import ApiKey, RoutedServe, RouterFront, parse_keys, render_script
from gpud.errors import ConfigError

SCRIPT_SOURCE: Final = Path(__file__).parent / "data" / "router.js"
SCRIPT_NAME: Final = "router.js"
# The router waits for gpud's ensure a little longer than gpud does (as the front).
ENSURE_MARGIN_S: Final = 5


@cache
def script_code() -> str:
    return SCRIPT_SOURCE.read_text()


def asks_gpud(cfg: Config, name: str) -> bool:
    """Whether the router asks gpud to have serve NAME up before each request: an on-demand
    serve (started or woken) and one that can sleep (woken)."""
    s = cfg.serves[name]
    return s.on_demand or (bool(s.front) and bool(s.sleep_level))


def wakes_through_router(cfg: Config, name: str) -> bool:
    """Whether gpud's ensure wakes NAME for the router, though it is not on demand: a routed
    serve that can sleep (one the router asks gpud about)."""
    return name in routed(cfg) and name in cfg.serves and asks_gpud(cfg, name)


def queue_wait_s(cfg: Config) -> int:
    """How long gpud may hold an ensure in the queue before the bring-up's own wait
    (router.queue_timeout_s; 0 without a router or with max_queued 0): nginx's wait for the
    ensure is that much longer (docs/router.md, "Queue instead of thrash")."""
    r = cfg.router
    return r.queue_timeout_s if r is not None and r.max_queued > 0 else 0


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


def router_front(cfg: Config) -> RouterFront | None:
    r = cfg.router
    if r is None:
        return None
    d = cfg.daemon
    serves = []
    for name, names in routed(cfg).items():
        s = cfg.serves[name]
        serves.append(RoutedServe(
            name, names,
            socket=socket_path(d.serve_socket_dir, name) if s.front else None,
            port=None if s.front else s.port,
            ensure_timeout_s=(math.ceil(max(s.start_timeout_s, d.wake_timeout_s))
                              + queue_wait_s(cfg) + ENSURE_MARGIN_S
                              if asks_gpud(cfg, name) else None)))
    keys = None if r.api_keys_file is None else load_keys(
        r.api_keys_file, [m for s in serves for m in s.models])
    return RouterFront(listen=r.listen, serves=tuple(serves), njs_module=r.njs_module, keys=keys,
                       script=f"{d.front_dir.rstrip('/')}/{SCRIPT_NAME}", gpud_socket=d.socket,
                       max_body_mib=r.max_body_mib, body_timeout_s=r.body_timeout_s)


def script_text(router: RouterFront) -> str:
    return render_script(router, script_code())
