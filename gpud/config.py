"""``serves.toml``: reading it, parsing it and checking it whole (the models, with the checks
each makes of its own fields, are gpud.core.config's, re-exported here).

Loading fails loudly: every problem is reported as ``key.path: reason`` (``serves.ocr.vram_mib:
must be > 0``), all of them at once. A resident set that does not fit is NOT a config error: it is
an admission outcome, decided by the ledger.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import string
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from gpud import bounded
from gpud.core.config import MAX_MIB as MAX_MIB
from gpud.core.config import Config as Config
from gpud.core.config import ContainerConfig as ContainerConfig
from gpud.core.config import DaemonConfig as DaemonConfig
from gpud.core.config import PeerConfig as PeerConfig
from gpud.core.config import RoleConfig as RoleConfig
from gpud.core.config import ServeConfig as ServeConfig
from gpud.core.config import SimulatedDeviceConfig as SimulatedDeviceConfig
from gpud.core.config import SimulationConfig as SimulationConfig
from gpud.core.config import VllmConfig as VllmConfig
from gpud.core.front import path_problem
from gpud.core.launch import (
    GPUD_SET_OPTIONS,
    NO_HTTP_OPTIONS,
    SLEEP_OFF_OPTIONS,
    uses_utilization,
    vllm_arg_parts,
    vllm_budget_mib,
    vllm_environment,
)
from gpud.core.ledger import gpu_memory_utilization
from gpud.core.peers import url_problem
from gpud.core.router import duplicate_names, listen_port, listen_problem, model_name_problem
from gpud.core.text import did_you_mean
from gpud.core.vllm_versions import CHECKPOINT_ROUTES, VllmBehaviour, borrowed_rules_note, extra_args_problems
from gpud.core.vllm_versions import behaviour as vllm_behaviour
from gpud.core.vocab import ENV_NAME_RE, NAME_PATTERN, NAME_RE
from gpud.errors import ConfigError, GpudError
from gpud.files import write_atomically
from gpud.vllm.learn import LearnError, learn
from gpud.vllm.vllm_flags import (
    LEARNED_DIR,
    SHIPPED,
    FlagTable,
    TableError,
    check_serve_args,
    load_table,
    table_name,
)

_ABBREVIATED_SHA = re.compile(r"[0-9a-f]{7,39}")
# Where a vLLM bound to this host answers on 127.0.0.1 (gpud's health checks): loopback itself,
# or every interface ("::" is dual-stack: vLLM does not set IPV6_V6ONLY).
HEALTH_REACHABLE_HOSTS = frozenset({"127.0.0.1", "0.0.0.0", "::"})

PLACEHOLDERS = frozenset({"port", "gpu_memory_utilization", "device_index", "device_indexes",
                          "vram_mib", "socket"})
# gpud pins the serve to its device itself; a serve's environment may not override that.
RESERVED_ENV = frozenset({"CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"})


def check_name(kind: str, name: str) -> str:
    """Serve and role names become systemd unit names and URL path segments."""
    if not NAME_RE.fullmatch(name):
        shown = name if len(name) <= 80 else name[:77] + "..."
        raise ValueError(f"invalid {kind} name {shown!r}: must match {NAME_PATTERN}")
    return name


# An image reference pinned to its content: NAME@sha256:<64 hex>.
IMAGE_DIGEST_RE = re.compile(r"^[^@\s]+@sha256:[0-9a-f]{64}$")
# podman's --shm-size: a number and an optional unit (b, k, m, g).
SHM_SIZE_RE = re.compile(r"^[0-9]+[bkmgBKMG]?$")
# A volume: SOURCE:DEST[:OPTIONS]; SOURCE an absolute host path or a named volume.
_VOLUME_OPTIONS = frozenset({"ro", "rw", "z", "Z", "U", "O", "noexec", "exec", "nosuid", "suid",
                             "nodev", "dev", "rbind", "bind", "private", "rprivate", "shared",
                             "rshared", "slave", "rslave", "copy", "nocopy"})


def _reason(err: Mapping[str, Any]) -> str:
    kind = err["type"]
    ctx = err.get("ctx") or {}
    simple = {
        "missing": "required",
        "extra_forbidden": "unknown key",
        "int_type": "must be an integer",
        "float_type": "must be a number",
        "string_type": "must be a string",
        "bool_type": "must be true or false",
        "dict_type": "must be a table",
        "model_type": "must be a table",
        "tuple_type": "must be an array",
        "list_type": "must be an array",
    }
    if kind in simple:
        return simple[kind]
    if kind == "greater_than":
        return f"must be > {ctx['gt']}"
    if kind == "greater_than_equal":
        return f"must be >= {ctx['ge']}"
    if kind == "less_than_equal":
        return f"must be <= {ctx['le']}"
    if kind in ("literal_error", "enum"):
        return f"must be one of {ctx.get('expected')}"
    if kind == "value_error":
        return str(ctx.get("error", err["msg"]))
    return str(err["msg"])


def _keys_at(loc: tuple[Any, ...]) -> list[str]:
    """The keys the config allows in the table at `loc` (pydantic's path to an unknown key, less
    the key), read from the models' fields down from Config; empty when the path leads to no
    table of known keys."""
    kind: Any = Config
    for part in (p for p in loc if not str(p).startswith("function-")):
        kind = _table_of(kind)
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            found = kind.model_fields.get(str(part))
            if found is None:
                return []
            kind = found.annotation
        elif typing.get_origin(kind) is dict:
            kind = typing.get_args(kind)[1]  # part: a table's name ([serves.NAME])
        elif typing.get_origin(kind) in (list, tuple):
            kind = typing.get_args(kind)[0]  # part: an array's index
        else:
            return []
    kind = _table_of(kind)
    if not (isinstance(kind, type) and issubclass(kind, BaseModel)):
        return []
    return list(kind.model_fields)


def _table_of(kind: Any) -> Any:
    """`X | None` as X (the one member that is not None)."""
    members = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(members) == 1:
        return members[0]
    return kind


def _key_path(loc: tuple[Any, ...]) -> str:
    # pydantic puts "function-after[...]" or the union member name into loc for some models.
    parts = [str(p) for p in loc if not str(p).startswith("function-")]
    return ".".join(parts) if parts else "(top level)"


def _semantic_problems(cfg: Config) -> list[str]:
    problems: list[str] = []
    for name in cfg.roles:
        try:
            check_name("role", name)
        except ValueError as exc:
            problems.append(f"roles.{name}: {exc}")
    for name, role in cfg.roles.items():
        if role.capacity_mib is not None and role.reserve_mib >= role.capacity_mib:
            problems.append(
                f"roles.{name}.reserve_mib: {role.reserve_mib} must be < capacity_mib "
                f"{role.capacity_mib}"
            )
    ports: dict[int, str] = {}
    for name, serve in cfg.serves.items():
        try:
            check_name("serve", name)
        except ValueError as exc:
            problems.append(f"serves.{name}: {exc}")
        devices: dict[str, str] = {}
        for i, role_name in enumerate(serve.all_roles):
            where = f"serves.{name}.roles[{i}]" if serve.roles else f"serves.{name}.role"
            if role_name in serve.all_roles[:i]:
                problems.append(f"{where}: role {role_name!r} is named twice")
                continue
            target = cfg.roles.get(role_name)
            if target is None:
                known = ", ".join(sorted(cfg.roles)) or "none"
                problems.append(f"{where}: unknown role {role_name!r} (roles: {known})")
                continue
            if target.device in devices:
                problems.append(f"{where}: role {role_name!r} is on device {target.device!r}, "
                                f"like role {devices[target.device]!r}: each role of a serve "
                                "must be on a different device")
            devices.setdefault(target.device, role_name)
            if target.capacity_mib is not None and serve.vram_mib > target.capacity_mib:
                problems.append(
                    f"serves.{name}.vram_mib: {serve.vram_mib} exceeds role {role_name!r} "
                    f"capacity_mib {target.capacity_mib}"
                )
        if serve.port is not None:
            if serve.port in ports:
                problems.append(
                    f"serves.{name}.port: {serve.port} is already used by serve {ports[serve.port]!r}"
                )
            else:
                ports[serve.port] = name
        for key, value in serve.environment.items():
            if not ENV_NAME_RE.fullmatch(key):
                problems.append(f"serves.{name}.environment.{key}: not a valid variable name")
            elif key in RESERVED_ENV:
                problems.append(f"serves.{name}.environment.{key}: set by gpud, may not be overridden")
            if "\0" in value or "\n" in value:
                problems.append(f"serves.{name}.environment.{key}: must not contain NUL or newline")
        for i, arg in enumerate(serve.command or ()):
            problem = _placeholder_problem(arg)
            if problem:
                problems.append(f"serves.{name}.command[{i}]: {problem}")
            if "\0" in arg:
                problems.append(f"serves.{name}.command[{i}]: must not contain NUL")
        if serve.container is not None:
            problems += [f"serves.{name}.container.{p}" for p in _container_problems(serve.container)]
    problems += _vllm_problems(cfg)
    problems += _router_problems(cfg, ports)
    problems += peer_problems(cfg)
    problems += [f"daemon.front_paths[{i}]: {problem}"
                 for i, path in enumerate(cfg.daemon.front_paths)
                 if (problem := path_problem(path)) is not None]
    for name, serve in cfg.serves.items():
        host = serve.vllm.host if serve.vllm is not None else None
        if serve.sleep_level and host not in (None, "127.0.0.1"):
            # VLLM_SERVER_DEV_MODE exposes /sleep, /wake_up and more (collective_rpc): those
            # must not face the network.
            problems.append(f"serves.{name}.vllm.host: a serve with sleep_level binds "
                            f"127.0.0.1 (its dev endpoints must not face the network), "
                            f"not {host!r}")
    if cfg.simulation is not None:
        seen: set[str] = set()
        for i, dev in enumerate(cfg.simulation.devices):
            if dev.uuid in seen:
                problems.append(f"simulation.devices[{i}].uuid: duplicate {dev.uuid!r}")
            seen.add(dev.uuid)
    return problems


SERVED_MODEL_NAME = "--served-model-name"


def model_names(name: str, serve: ServeConfig) -> tuple[str, ...]:
    """The names the router routes to serve NAME (docs/router.md): its `models`; unset, a
    vllm serve's --served-model-name of its extra_args, else its model id (what vLLM answers
    to unless told otherwise); any other serve's name."""
    if serve.models is not None:
        return tuple(dict.fromkeys(serve.models))
    if serve.vllm is None:
        return (name,)
    args = serve.vllm.extra_args
    for i, arg in enumerate(args):
        if arg.startswith(SERVED_MODEL_NAME + "="):
            return (arg.split("=", 1)[1],)
        if arg == SERVED_MODEL_NAME:
            given = []
            for value in args[i + 1:]:
                if value.startswith("-"):
                    break
                given.append(value)
            return tuple(given) or (serve.vllm.model,)
    return (serve.vllm.model,)


def routed(cfg: Config) -> dict[str, tuple[str, ...]]:
    """The serves the router reaches (each with a port: its own, or its front's) and their
    names; none when there is no [router]."""
    if cfg.router is None:
        return {}
    return {name: model_names(name, s) for name, s in sorted(cfg.serves.items())
            if s.port is not None}


def _router_problems(cfg: Config, ports: Mapping[int, str]) -> list[str]:
    problems: list[str] = []
    for name, serve in cfg.serves.items():
        for i, model in enumerate(serve.models or ()):
            problem = model_name_problem(model)
            if problem:
                problems.append(f"serves.{name}.models[{i}]: {problem}")
        if serve.models is not None and not serve.models:
            problems.append(f"serves.{name}.models: name at least one model (or leave it out)")
        if serve.models is not None and serve.vllm is not None and any(
                a == SERVED_MODEL_NAME or a.startswith(SERVED_MODEL_NAME + "=")
                for a in serve.vllm.extra_args):
            problems.append(f"serves.{name}.vllm.extra_args: {SERVED_MODEL_NAME} is set from "
                            "models (vLLM answers to every name in it): give the names there")
    if cfg.router is None:
        return problems
    problem = listen_problem(cfg.router.listen)
    if problem:
        problems.append(f"router.listen: {problem}")
    elif (port := listen_port(cfg.router.listen)) in ports:
        problems.append(f"router.listen: port {port} is serve {ports[port]!r}'s")
    problems += [f"serves: {p}" for p in duplicate_names(routed(cfg))]
    return problems


def peer_problems(cfg: Config) -> list[str]:
    """[peers.NAME] as a whole: the name (the serve-name rule), the url, the models named (a
    name a local serve answers to is refused: which host would take it?), tls_ca only with
    https. Its files are peer_file_problems'."""
    problems: list[str] = []
    local = {m: name for name, s in sorted(cfg.serves.items()) for m in model_names(name, s)}
    for name, peer in sorted(cfg.peers.items()):
        try:
            check_name("peer", name)
        except ValueError as exc:
            problems.append(f"peers.{name}: {exc}")
        problem = url_problem(peer.url)
        if problem:
            problems.append(f"peers.{name}.url: {problem}")
        elif peer.tls_ca is not None and not peer.url.startswith("https:"):
            problems.append(f"peers.{name}.tls_ca: only for an https url (url is {peer.url!r})")
        if peer.models is not None and not peer.models:
            problems.append(f"peers.{name}.models: name at least one model (or leave it out: "
                            "all the peer lists)")
        seen: set[str] = set()
        for i, model in enumerate(peer.models or ()):
            problem = model_name_problem(model)
            if problem:
                problems.append(f"peers.{name}.models[{i}]: {problem}")
            elif model in seen:
                problems.append(f"peers.{name}.models[{i}]: {model!r} is named twice")
            elif model in local:
                problems.append(f"peers.{name}.models[{i}]: {model!r} is also serve "
                                f"{local[model]!r}'s here: a model offered from a peer must "
                                "not be one of this host's")
            seen.add(model)
    return problems


def read_peer_key(path: str, *, require_root: bool | None = None) -> str:
    """The key in a peer's key_file: root's (when gpud runs as root), readable by its owner
    only, one line. Raises ValueError naming what is wrong."""
    if require_root is None:
        require_root = os.geteuid() == 0
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path}: not a regular file")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise ValueError(f"{path}: readable or writable by group or others (mode "
                             f"{mode:04o}): it holds a key; run `chmod 600 {path}`")
        if require_root and st.st_uid != 0:
            raise ValueError(f"{path}: must be root's (owner uid {st.st_uid}): it holds a key")
        raw = Path(path).read_bytes()
    except FileNotFoundError as exc:
        raise ValueError(f"{path}: file not found") from exc
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    if len(raw) > 4096:
        raise ValueError(f"{path}: over 4096 bytes: not a key")
    try:
        key = raw.decode("ascii").strip()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not ASCII (byte {exc.start})") from exc
    if not key or any(ch.isspace() or not ch.isprintable() for ch in key):
        raise ValueError(f"{path}: must hold one key, one line of printable characters")
    return key


def peer_file_problems(cfg: Config) -> list[str]:
    """The files of [peers.NAME]: its key_file (read_peer_key) and its tls_ca."""
    problems: list[str] = []
    for name, peer in sorted(cfg.peers.items()):
        try:
            read_peer_key(peer.key_file)
        except ValueError as exc:
            problems.append(f"peers.{name}.key_file: {exc}")
        if peer.tls_ca is not None and not os.path.isfile(peer.tls_ca):
            problems.append(f"peers.{name}.tls_ca: {peer.tls_ca}: no such file")
    return problems


def _container_problems(c: ContainerConfig) -> list[str]:
    problems: list[str] = []
    if c.image.startswith("-") or any(ch.isspace() or ch == "\0" for ch in c.image):
        problems.append(f"image: {c.image!r} is not an image reference")
    for i, arg in enumerate(c.args or ()):
        problem = _placeholder_problem(arg)
        if problem:
            problems.append(f"args[{i}]: {problem}")
        if "\0" in arg:
            problems.append(f"args[{i}]: must not contain NUL")
    for i, volume in enumerate(c.volumes):
        problem = _volume_problem(volume)
        if problem:
            problems.append(f"volumes[{i}]: {problem}")
    if c.shm_size is not None and c.ipc == "host":
        # podman 4.3.1: "cannot set shmsize when running in the host IPC Namespace"
        problems.append("shm_size: not with ipc = \"host\": the container shares the host's "
                        "/dev/shm, whose size podman cannot set")
    elif c.shm_size is not None and not SHM_SIZE_RE.fullmatch(c.shm_size):
        problems.append(f"shm_size: {c.shm_size!r} must be a number with an optional unit "
                        "(b, k, m or g), e.g. \"16g\"")
    return problems


def _volume_problem(volume: str) -> str | None:
    parts = volume.split(":")
    if len(parts) not in (2, 3) or not parts[0] or not parts[1]:
        return f"{volume!r} must be SOURCE:DESTINATION[:OPTIONS]"
    if not parts[1].startswith("/"):
        return f"{volume!r}: the destination must be an absolute path"
    if "\0" in volume or "," in parts[0]:
        return f"{volume!r}: the source must not contain NUL or ','"
    unknown = [o for o in (parts[2].split(",") if len(parts) == 3 else ()) if o not in _VOLUME_OPTIONS]
    if unknown:
        return f"{volume!r}: unknown option {unknown[0]!r}"
    return None


def config_warnings(cfg: Config) -> list[str]:
    """What `gpud --check-config` warns about in a valid config (nothing it refuses)."""
    warnings = vllm_release_notes(cfg)
    for name, serve in sorted(cfg.serves.items()):
        c = serve.container
        if c is not None and not IMAGE_DIGEST_RE.fullmatch(c.image):
            warnings.append(f"serves.{name}.container.image: {c.image!r} is not pinned to a "
                            "digest (NAME@sha256:...): the image a tag names can change under "
                            "the same config, and its calibration with it")
        if c is not None and len(serve.all_roles) > 1 and c.ipc is None and c.shm_size is None:
            # vLLM's docs, "Deploying with Docker": PyTorch shares data between the tensor
            # parallel workers through shared memory; a container's /dev/shm is 64 MiB unless
            # given more (podman run --shm-size) or the host's (--ipc=host).
            warnings.append(f"serves.{name}.container: tensor parallel over "
                            f"{len(serve.all_roles)} devices in a container with podman's 64 MiB "
                            "/dev/shm: set container.shm_size (e.g. \"16g\") or container.ipc "
                            "= \"host\"")
        if serve.sleep_level and not serve.front and serve.port is not None:
            known = vllm_behaviour(cfg.daemon.vllm_version)
            # vLLM 0.34 registers /checkpoint/* on every sleep-mode serve, without dev mode or
            # --api-key (vllm/entrypoints/launchers/api_server/routers.py:68-73 of 0.34.0)
            checkpoint = (f"; on vLLM {known.version} also {', '.join(CHECKPOINT_ROUTES)} "
                          "(a prepared serve stops serving until restored)"
                          if known.checkpoint_routes and serve.vllm else "")
            warnings.append(f"serves.{name}.front: a serve with sleep_level runs with vLLM's "
                            "dev routes (/sleep, /wake_up, /collective_rpc)"
                            f"{checkpoint}, open to every local user on port {serve.port}: "
                            "without front = false the front answers them 404 (docs/front.md)")
    return warnings


def _simulated_refs(cfg: Config) -> list[tuple[str, SimulatedDeviceConfig]]:
    """Each simulated device under every reference that names it: UUID, index, bus id."""
    refs: list[tuple[str, SimulatedDeviceConfig]] = []
    if cfg.simulation:
        for i, dev in enumerate(cfg.simulation.devices):
            refs += [(dev.uuid, dev), (str(dev.index if dev.index is not None else i), dev)]
            if dev.pci_bus_id:
                refs.append((dev.pci_bus_id, dev))
    return refs


def device_totals(cfg: Config) -> dict[str, int]:
    """Device totals the config itself knows: the simulated devices, by UUID and by index."""
    return {ref: dev.total_mib for ref, dev in _simulated_refs(cfg)}


def device_ids(cfg: Config) -> dict[str, str]:
    """The UUID of each simulated device, by UUID, index and bus id (which name one device)."""
    return {ref: dev.uuid for ref, dev in _simulated_refs(cfg)}


def _vllm_problems(cfg: Config) -> list[str]:
    """What vLLM would refuse, found before anything is launched: every vllm serve's argv
    against the flag table of daemon.vllm_version, and utilizations that floor to 0."""
    problems: list[str] = []
    vllm_serves = {n: s for n, s in cfg.serves.items() if s.vllm is not None}
    # Any vLLM release runs: one gpud has no rules of its own for borrows the newest known
    # release's (gpud.core.vllm_versions.behaviour, said by config_warnings); its flag table
    # is gpud's own, an operator's, or learned from the installed vLLM (vllm_flag_table).
    table: FlagTable | None = None
    try:
        behaviour: VllmBehaviour | None = vllm_behaviour(cfg.daemon.vllm_version)
    except KeyError as exc:
        behaviour = None
        problems.append(f"daemon.vllm_version: {exc.args[0]}")
    if behaviour is not None and vllm_serves:
        try:
            table = vllm_flag_table(cfg.daemon)
        except ConfigError as exc:
            problems += exc.problems
    totals = device_totals(cfg)
    for name, serve in cfg.serves.items():
        roles = [cfg.roles.get(r) for r in serve.all_roles]
        if any(r is None for r in roles) or not uses_utilization(serve):
            continue
        # util = floor(budget / total): 0 whenever budget x 10000 < total, and capacity <= total.
        # On several devices it is computed against the smallest total (the largest figure).
        known = [t for r in roles if r is not None and (t := totals.get(r.device))]
        total = min(known) if len(known) == len(roles) else None
        caps = [r.capacity_mib for r in roles if r is not None and r.capacity_mib]
        bound = total or (max(caps) if caps else None)
        budget = vllm_budget_mib(serve, serve.vram_mib)
        if bound and budget > 0 and budget * 10_000 < bound:
            util = gpu_memory_utilization(budget, total) if total else "0.0000"
            problems.append(
                f"serves.{name}.vram_mib: {serve.vram_mib} MiB is --gpu-memory-utilization "
                f"{util} of {'the device total' if total else 'at most'} {bound} MiB; vLLM "
                "requires > 0")
    for name, serve in vllm_serves.items():
        v = serve.vllm
        assert v is not None
        if v.host is not None and v.host not in HEALTH_REACHABLE_HOSTS:
            problems.append(f"serves.{name}.vllm.host: {v.host!r} is not reached by gpud's "
                            f"health checks (http://127.0.0.1:PORT): use one of "
                            f"{', '.join(sorted(HEALTH_REACHABLE_HOSTS))}")
        if v.revision is not None and _ABBREVIATED_SHA.fullmatch(v.revision):
            problems.append(f"serves.{name}.vllm.revision: {v.revision!r} is an abbreviated "
                            "commit; pin the full 40-hex SHA (the model cache is keyed by it)")
        if v.context_mib >= serve.vram_mib:
            problems.append(f"serves.{name}.vllm.context_mib: {v.context_mib} must be below "
                            f"vram_mib {serve.vram_mib}")
        elif isinstance(v.kv_cache_mib, int) and v.kv_cache_mib + v.context_mib >= serve.vram_mib:
            problems.append(f"serves.{name}.vllm.kv_cache_mib: {v.kv_cache_mib} (+ context_mib "
                            f"{v.context_mib}) must be below vram_mib {serve.vram_mib} (the "
                            "weights need room too)")
        for i, why in tensor_parallel_problems(serve):
            problems.append(f"serves.{name}.vllm.extra_args[{i}]: {why}")
        if behaviour is not None:
            for i, why in extra_args_problems(v.extra_args, behaviour,
                                              sleep_level=serve.sleep_level or 0):
                problems.append(f"serves.{name}.vllm.extra_args[{i}]: {why}")
        for i, arg in enumerate(v.extra_args):
            option = _option_name(arg)
            key = GPUD_SET_OPTIONS.get(option)
            if key is not None:
                problems.append(f"serves.{name}.vllm.extra_args[{i}]: {option} is "
                                f"set by gpud from serves.{name}.{key}: set that instead")
            elif option in SLEEP_OFF_OPTIONS and serve.sleep_level:
                problems.append(f"serves.{name}.vllm.extra_args[{i}]: {option} turns off the "
                                f"sleep mode serves.{name}.sleep_level = {serve.sleep_level} "
                                "needs: drop it, or set sleep_level = 0")
            elif option in NO_HTTP_OPTIONS:
                problems.append(f"serves.{name}.vllm.extra_args[{i}]: {option} "
                                f"{NO_HTTP_OPTIONS[option]}: gpud cannot watch such a serve")
        env = vllm_environment(serve) | serve.environment
        ready = env["VLLM_ENGINE_READY_TIMEOUT_S"]
        if not ready.isdigit() or int(ready) < serve.start_timeout_s:
            problems.append(
                f"serves.{name}.environment.VLLM_ENGINE_READY_TIMEOUT_S: {ready!r} must be a "
                f"whole number of seconds >= start_timeout_s {serve.start_timeout_s:g} (vLLM "
                "would give up on its engine before gpud does)")
        if table is None or behaviour is None:
            continue
        parts = vllm_arg_parts(serve, executable=cfg.daemon.vllm_executable, util="0.5000",
                               vllm_version=cfg.daemon.vllm_version)
        args = parts[2:]  # after `vllm serve`
        for problem in check_serve_args([a for a, _ in args], table):
            problems.append(f"serves.{name}.{args[problem.index][1]}: {problem.message}")
    return problems


def vllm_release_notes(cfg: Config) -> list[str]:
    """What is said of a vLLM release gpud has no rules or table of its own for (by
    --check-config, and in the journal when gpud starts or reloads): whose sizing rules it
    borrows, and where the serve flags were read."""
    try:
        b = vllm_behaviour(cfg.daemon.vllm_version)
    except KeyError:
        return []
    notes = []
    borrowed = borrowed_rules_note(b)
    if borrowed is not None:
        notes.append(f"daemon.vllm_version: {borrowed}")
    if any(s.vllm is not None for s in cfg.serves.values()):
        with contextlib.suppress(KeyError, TableError):
            table = load_table(cfg.daemon.vllm_version, flag_table_dirs(cfg.daemon))
            if table.source != SHIPPED:
                notes.append(f"daemon.vllm_version: vLLM {b.version}'s serve flags are read "
                             f"from {table.source}")
    return notes


def flag_table_dirs(d: DaemonConfig) -> tuple[str, ...]:
    """Where the flag table of a release gpud ships none for is looked for: the operator's
    directory, then what gpud learned (under its state directory)."""
    return d.vllm_flags_dir, str(Path(d.state_dir) / LEARNED_DIR)


def vllm_flag_table(d: DaemonConfig) -> FlagTable:
    """The flag table of daemon.vllm_version: gpud's own, the operator's (vllm_flags_dir), one
    learned before, or else learned now from the vLLM the serves run (its own parser, once:
    gpud.vllm.learn; tens of seconds) and kept in the state directory, keyed by version. When
    the state directory cannot be written (--check-config by a user), the table is used and
    learned again next time. ConfigError (daemon.vllm_version) saying what was tried."""
    version = d.vllm_version
    try:
        return load_table(version, flag_table_dirs(d))
    except TableError as exc:
        raise ConfigError("config", [f"daemon.vllm_version: {exc}"]) from None
    except KeyError as exc:
        missing = exc.args[0]
    try:
        table, text = learn(d.vllm_executable, version)
    except LearnError as exc:
        raise ConfigError("config", [
            f"daemon.vllm_version: {missing}; learning it from the installed vLLM failed: "
            f"{exc}. Put the table of vLLM {version} in {d.vllm_flags_dir} "
            f"(scripts/vllm-flags {version} writes it), or set daemon.vllm_executable to the "
            "vllm the serves run"]) from None
    learned = Path(d.state_dir) / LEARNED_DIR
    with contextlib.suppress(OSError, GpudError):
        learned.mkdir(mode=0o755, parents=True, exist_ok=True)
        write_atomically(learned / table_name(version), text, mode=0o644)
    return table


TENSOR_PARALLEL_OPTIONS = ("--tensor-parallel-size", "-tp")
# vLLM's world size is pipeline x tensor parallel, and data parallel runs that many engines of it
# (vllm/config/parallel.py: ParallelConfig.__post_init__): gpud gives a serve one device per role
# and the tensor-parallel size over them, so the other sizes must stay 1.
OTHER_PARALLEL_OPTIONS = ("--pipeline-parallel-size", "-pp", "--data-parallel-size", "-dp")


def tensor_parallel_problems(serve: ServeConfig) -> list[tuple[int, str]]:
    """An explicit --tensor-parallel-size (or -tp) in extra_args that disagrees with the number
    of roles: gpud passes the number of roles itself, and argparse would keep the last one. A
    pipeline- or data-parallel size other than 1 would want more devices than the serve has."""
    v = serve.vllm
    if v is None:
        return []
    want = len(serve.all_roles)
    problems: list[tuple[int, str]] = []
    for i, arg in enumerate(v.extra_args):
        name, eq, value = arg.partition("=")
        option = _option_name(name)
        if option not in TENSOR_PARALLEL_OPTIONS + OTHER_PARALLEL_OPTIONS:
            continue
        if not eq:
            value = v.extra_args[i + 1] if i + 1 < len(v.extra_args) else ""
        if option in OTHER_PARALLEL_OPTIONS:
            if value.strip() != "1":
                problems.append((i, f"{name} {value or '(no value)'}: gpud runs the serve on "
                                    f"its {want} role(s), one device each, tensor parallel "
                                    "over them; other parallel sizes must stay 1"))
        elif value.strip() != str(want):
            problems.append((i, f"{name} {value or '(no value)'} disagrees with the serve's "
                                f"{want} role(s): gpud passes --tensor-parallel-size {want} "
                                "(one device per role); drop it or change the roles"))
    return problems


def _option_name(arg: str) -> str:
    name = arg.partition("=")[0]
    if name.startswith("--"):
        return "--" + name[2:].partition(".")[0].replace("_", "-")
    return name


def _placeholder_problem(arg: str) -> str | None:
    try:
        parsed = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(arg)
                  if f is not None]
    except ValueError as exc:
        return f"bad placeholder syntax ({exc}); write literal braces as {{{{ and }}}}"
    fields = [f for f, _, _ in parsed]
    for f, spec, conv in parsed:
        if spec or conv:
            return (f"placeholder {{{f}}} may not carry a conversion or format spec "
                    f"(write {{{f}}} alone)")
    unknown = [f for f in fields if f not in PLACEHOLDERS]
    if unknown:
        allowed = ", ".join("{" + p + "}" for p in sorted(PLACEHOLDERS))
        return f"unknown placeholder {{{unknown[0]}}} (allowed: {allowed})"
    return None


def parse_config(text: str, source: str, *, checkpoints: bool = True) -> Config:
    """Parse and validate config text. Raises ConfigError naming every problem. With
    `checkpoints`, each peer's key file is read and each vllm serve's reservation is checked
    against its checkpoint on disk
    (gpud.vllm.model_size; off for a config gpud already ran with, read back to recover from: a
    checkpoint changed since must not make it unreadable)."""
    try:
        data = bounded.parse_toml(text)
    except bounded.TOMLDecodeError as exc:
        raise ConfigError(source, [f"TOML syntax: {exc}"]) from exc
    except bounded.OutOfBounds as exc:
        raise ConfigError(source, [f"{exc.path}: {exc.reason}"]) from exc
    try:
        cfg = Config.model_validate(data)
    except RecursionError as exc:
        raise ConfigError(source, ["nested too deeply"]) from exc
    except ValidationError as exc:
        problems = [f"{_key_path(e['loc'])}: {_reason(e)}"
                    + (did_you_mean(str(e["loc"][-1]), _keys_at(e["loc"][:-1]))
                       if e["type"] == "extra_forbidden" and e["loc"] else "")
                    for e in exc.errors()]
        raise ConfigError(source, problems) from exc
    problems = _semantic_problems(cfg)
    if checkpoints:
        problems += peer_file_problems(cfg)
    if not problems and checkpoints:
        from gpud.vllm.model_size import checkpoint_problems

        problems = checkpoint_problems(cfg)
    if problems:
        raise ConfigError(source, problems)
    return cfg


def read_config_text(path: Path, *, require_private: bool | None = None) -> str:
    """Read a config file, refusing one that others could have written.

    Serve commands come only from this file and run as root's transient units, so when gpud runs
    as root a config writable by group or others would hand root to whoever can write it.
    """
    source = str(path)
    if require_private is None:
        require_private = os.geteuid() == 0
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(source, ["not a regular file"])
        if require_private and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise ConfigError(
                source,
                [f"writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}): "
                 f"run `chmod go-w {source}`"],
            )
        raw = path.read_bytes()
    except FileNotFoundError as exc:
        raise ConfigError(source, ["file not found"]) from exc
    except PermissionError as exc:
        raise ConfigError(source, ["permission denied"]) from exc
    except OSError as exc:
        raise ConfigError(source, [f"cannot read: {exc.strerror}"]) from exc
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(source, [f"not UTF-8 (byte {exc.start})"]) from exc


def load_config(path: Path, *, require_private: bool | None = None) -> Config:
    return parse_config(read_config_text(path, require_private=require_private), str(path))


def apply_overrides(cfg: Config, overrides: Mapping[str, Any]) -> Config:
    """--socket and --state-dir win over the file, also across reloads."""
    if not overrides:
        return cfg
    return cfg.model_copy(update={"daemon": cfg.daemon.model_copy(update=dict(overrides))})


def summary(cfg: Config) -> str:
    """The lines `gpud --check-config` prints for a valid config."""
    lines = [f"admission {cfg.daemon.admission}; socket {cfg.daemon.socket}; "
             f"state {cfg.daemon.state_dir}"]
    for rname, role in sorted(cfg.roles.items()):
        cap = f"{role.capacity_mib} MiB" if role.capacity_mib else "device total"
        lines.append(f"role {rname!r} on {role.device}: capacity {cap}, reserve {role.reserve_mib} MiB")
        serves = sorted(
            ((s.priority, n, s) for n, s in cfg.serves.items() if rname in s.all_roles),
            key=lambda t: (t[0], t[1]),
        )
        for _, sname, s in serves:
            # Neither resident nor on_demand: nothing starts it but an operator (gpuctl start)
            flags = ("resident" if s.resident else "on demand" if s.on_demand
                     else "started by gpuctl start")
            part = ""
            if s.roles and len(s.all_roles) > 1:
                part = (f"; {s.all_roles.index(rname) + 1}/{len(s.all_roles)} of "
                        f"{', '.join(s.all_roles)}")
            lines.append(f"  {sname} {s.vram_mib} MiB ({flags}, priority {s.priority}{part})")
    if cfg.simulation:
        devs = ", ".join(f"{d.uuid} {d.total_mib} MiB" for d in cfg.simulation.devices)
        lines.append(f"simulated devices: {devs}")
    return "\n".join(lines)
