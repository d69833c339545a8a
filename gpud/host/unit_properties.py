"""The typed table of the properties gpud gives a serve's transient systemd unit.

Each property systemd accepts in ``StartTransientUnit`` is a name, a D-Bus signature and a value
in systemd's own units. ``PROPERTIES`` maps every name gpud sends to its signature and to the
converter that turns gpud's value (seconds, a mapping, an argv) into the wire value, so seconds
become microseconds, and a literal argv becomes ExecStart syntax, in exactly one place.
``build_properties`` is pure: a ``UnitSpec`` (and the systemd version, for what differs between
versions) in, the ``a(sv)`` list out. The exact encoding is pinned by
``tests/test_unit_properties.py``.

Decisions worth knowing (measured on systemd 252, Debian 12):

- The command travels as ``ExecStart`` (``a(sasb)``: path, argv, ignore-failure) with every
  ``$`` doubled. systemd expands ``$VAR``/``${VAR}`` in ExecStart arguments when it executes
  them and turns ``$$`` into ``$``, so ``$HOME`` reaches the process literally. Commands given
  over D-Bus get no ``%`` specifier expansion (only unit files do) and no shell: ``;``, quotes
  and spaces are plain bytes of one argument.
- Not ``ExecStartEx`` with the ``no-env-expand`` flag, although 252 accepts it: systemd 252
  writes the transient unit file (``/run/systemd/transient/UNIT``) with an ``ExecStartEx=`` line
  that its own unit-file parser does not know. After any ``systemctl daemon-reload`` (package
  upgrades run one) the unit is ``bad-setting`` with no command: still running, but the next
  Restart= fails and the unit is gone. (Current systemd writes ``ExecStart=:...`` instead.)
- Even ``ExecStart=`` does not survive that file round trip intact on 252: an argument holding
  ``$`` or ``;`` comes back altered (``\\$``, ``\\;``). On systemd <= 252 (and when the version is
  unknown) such arguments are refused rather than silently changed at the first restart after
  a daemon-reload.
- ``RestartSteps=``/``RestartMaxDelaySec=`` (exponential restart backoff) exist only since
  systemd 254; 252 refuses the whole unit with "Cannot set property RestartSteps, or unknown
  property". They are sent only when the caller says systemd is new enough.
- ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` makes CUDA's device numbering the same as NVML's (by PCI bus
  id), so ``CUDA_VISIBLE_DEVICES=<NVML index>`` pins the serve to the device the ledger charged.
  A serve's own environment may therefore not set either variable.
- ``KillMode=mixed``: SIGTERM to the main process only (vLLM's API server shuts its engine
  core down itself), SIGKILL to the whole cgroup once ``TimeoutStopUSec`` passes.
- A container serve (``podman run ... -d``, as quadlet writes it) is ``Type=notify`` with
  ``NotifyAccess=all`` and ``Delegate=yes``: conmon becomes the main PID and sends READY=1 once
  the container runs; on stop systemd's SIGTERM reaches conmon, which hands it to the container
  (measured on podman 4.3.1: the payload got SIGTERM and shut down gracefully).
"""

from __future__ import annotations

import math
import pwd
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final, Literal

import dbus_fast

from gpud.config import DaemonConfig, ServeConfig
from gpud.core.launch import (
    ALTERED_BY_RELOAD,
    Hardening,
    Identity,
    reload_alters_arguments,
    serve_identity,
)
from gpud.core.vocab import (
    ENV_NAME_RE,
    NAME_RE,
    SERVE_UNIT_PREFIX,
    SERVE_UNIT_SUFFIX,
    serve_unit,
)
from gpud.errors import BadRequest
from gpud.host.simulation import GPUD_SIM_PROCS_DIR

UNIT_PREFIX: Final = SERVE_UNIT_PREFIX
UNIT_SUFFIX: Final = SERVE_UNIT_SUFFIX
SLICE: Final = "gpud.slice"

# The first systemd with RestartSteps= and RestartMaxDelaySec= (NEWS for v254).
RESTART_BACKOFF_SINCE: Final = 254
# The newest systemd seen to alter '$' and ';' in ExecStart= arguments across daemon-reload.

# Variables gpud sets itself; a serve's environment may not override them.
PINNED_ENVIRONMENT: Final = frozenset({"CUDA_DEVICE_ORDER", "CUDA_VISIBLE_DEVICES"})

# systemd's USEC_INFINITY: "no limit" for any *USec property.
USEC_INFINITY: Final = 2**64 - 1
_UINT32_MAX: Final = 2**32 - 1

Restart = Literal["no", "on-failure", "always"]


def unit_name(serve: str) -> str:
    """The unit of a serve (``gpud-serve-NAME.service``); BadRequest for an invalid name."""
    _check_serve(serve)
    return serve_unit(serve)


def _check_serve(serve: str) -> None:
    if not NAME_RE.match(serve):
        raise BadRequest(
            f"invalid serve name {serve!r}: must match {NAME_RE.pattern}",
            {"serve": serve},
        )


@dataclass(frozen=True)
class UnitSpec:
    """Everything gpud decides about one serve's unit; validated again here on purpose."""

    serve: str
    argv: tuple[str, ...]
    device_index: int
    description: str
    # A serve on several devices (tensor parallel): every index, the first being device_index,
    # in the order of its roles. Empty: device_index alone.
    device_indexes: tuple[int, ...] = ()
    environment: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}), hash=False)
    user: str | None = None
    restart: Restart = "on-failure"
    restart_sec: float = 5.0
    # Backoff (systemd >= 254 only): restart delay grows from restart_sec to
    # restart_max_delay_sec in restart_steps steps. Left out on older systemd.
    restart_steps: int | None = None
    restart_max_delay_sec: float | None = None
    start_limit_burst: int = 5
    start_limit_interval_sec: float = 600.0
    timeout_start_sec: float = 90.0
    timeout_stop_sec: float = 90.0
    working_directory: str | None = None
    # A root-only file holding the serve's own environment (tokens live there): sent as
    # EnvironmentFiles=, so `systemctl show -p Environment` does not show it to every user.
    environment_file: str | None = None
    # `podman run` the way quadlet runs it: Type=notify with NotifyAccess=all (conmon sends
    # MAINPID= and READY=1, --sdnotify=conmon) and Delegate=yes (podman makes the payload's
    # sub-cgroup below the unit's, --cgroups=split).
    container: bool = False
    # The serve's file mode creation mask: a fronted serve's socket must be writable by the
    # front's group (connect(2) needs write permission on a socket), and vLLM binds it with
    # whatever mask it has (0o007).
    umask: int | None = None
    # A fronted serve's Unix socket: removed before each start (vLLM's bind fails on a stale
    # one, and systemd's own restarts of the unit do not pass through gpud).
    socket: str | None = None
    # An unprivileged serve's sandbox (gpud.core.launch.serve_identity); None: unhardened.
    hardening: Hardening | None = None

    def __post_init__(self) -> None:
        _check_serve(self.serve)
        if not self.argv or not self.argv[0].startswith("/"):
            raise BadRequest(
                f"serve {self.serve}: the command must start with an absolute path",
                {"serve": self.serve, "argv": list(self.argv)},
            )
        for arg in self.argv:
            if "\0" in arg:
                raise BadRequest(f"serve {self.serve}: NUL in a command argument")
        if self.device_index < 0:
            raise BadRequest(f"serve {self.serve}: negative device index {self.device_index}")
        if self.device_indexes and (self.device_indexes[0] != self.device_index
                                    or len(set(self.device_indexes)) != len(self.device_indexes)
                                    or min(self.device_indexes) < 0):
            raise BadRequest(f"serve {self.serve}: device indexes {list(self.device_indexes)} "
                             f"must be distinct, >= 0 and start with {self.device_index}")
        for name, value in self.environment.items():
            if not ENV_NAME_RE.match(name) or "\0" in value:
                raise BadRequest(
                    f"serve {self.serve}: invalid environment variable {name!r}",
                    {"serve": self.serve, "variable": name},
                )
            if name in PINNED_ENVIRONMENT:
                raise BadRequest(
                    f"serve {self.serve}: environment may not set {name}: gpud pins the device itself",
                    {"serve": self.serve, "variable": name},
                )
        if self.socket is not None and not self.socket.startswith("/"):
            raise BadRequest(f"serve {self.serve}: socket must be an absolute path")
        if self.working_directory is not None and not self.working_directory.startswith("/"):
            raise BadRequest(f"serve {self.serve}: working_directory must be an absolute path")
        if (self.restart_steps is None) != (self.restart_max_delay_sec is None):
            raise BadRequest(f"serve {self.serve}: restart_steps and restart_max_delay_sec go together")
        # A copy nobody can change behind the frozen dataclass's back.
        object.__setattr__(self, "environment", MappingProxyType(dict(self.environment)))

    @property
    def unit(self) -> str:
        return unit_name(self.serve)


def host_home(user: str) -> str | None:
    """A user's home directory in this host's user database (a name or a uid), None when the
    host has no such user."""
    try:
        return (pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)).pw_dir
    except KeyError:
        return None


def host_identity(name: str, serve: ServeConfig, daemon: DaemonConfig,
                  environment: Mapping[str, str], *, front_group: str | None,
                  home_of: Callable[[str], str | None] = host_home) -> Identity:
    """serve_identity with this host's user database (`home_of`): the front's group for a
    fronted serve (gpud.nginx.front.front_group), the simulation's registration folder writable for
    a stand-in (GPUD_SIM_PROCS_DIR)."""
    procs = environment.get(GPUD_SIM_PROCS_DIR)
    return serve_identity(name, serve, daemon, home_of=home_of, front_group=front_group,
                          writable=(procs,) if procs else ())


# --- converters: gpud's value -> the D-Bus value systemd expects -------------------------------


def _string(value: str) -> str:
    return value


def _uint32(value: int) -> int:
    if not 0 <= value <= _UINT32_MAX:
        raise BadRequest(f"{value} is out of range for a 32-bit unsigned property")
    return value


def _uint64(value: int) -> int:
    if not 0 <= value < 2**64:
        raise BadRequest(f"{value} is out of range for a 64-bit unsigned property")
    return value


def _usec(seconds: float) -> int:
    """Seconds (may be fractional; ``inf`` means no limit) to systemd's microseconds."""
    if math.isinf(seconds) and seconds > 0:
        return USEC_INFINITY
    if math.isnan(seconds) or seconds < 0:
        raise BadRequest(f"invalid duration {seconds!r} s")
    return min(round(seconds * 1_000_000), USEC_INFINITY - 1)


def _exec_literal(argv: tuple[str, ...]) -> list[tuple[str, list[str], bool]]:
    """One command whose arguments reach the process byte for byte: ``$`` becomes ``$$``,
    which systemd's variable expansion turns back into ``$``; ignore-failure is off."""
    return [(argv[0], [arg.replace("$", "$$") for arg in argv], False)]


def _environment(assignments: Mapping[str, str]) -> list[str]:
    return [f"{name}={value}" for name, value in assignments.items()]


def environment_file_text(assignments: Mapping[str, str]) -> str:
    """`assignments` in systemd's environment-file syntax, each value reaching the process as
    it is: single-quoted (literal) where it can be, else double-quoted with the four characters
    systemd unescapes there (backslash, double quote, backtick, dollar) escaped."""
    lines = []
    for name, value in assignments.items():
        if "'" not in value:
            lines.append(f"{name}='{value}'")
        else:
            escaped = "".join("\\" + ch if ch in '\\"`$' else ch for ch in value)
            lines.append(f'{name}="{escaped}"')
    return "".join(line + "\n" for line in lines)


@dataclass(frozen=True)
class PropertyType:
    signature: str
    convert: Callable[[Any], Any]


def _p(signature: str, convert: Callable[[Any], Any]) -> PropertyType:
    return PropertyType(signature, convert)


# name -> (signature, converter). Only names listed here can be sent.
PROPERTIES: Final[Mapping[str, PropertyType]] = MappingProxyType(
    {
        "Description": _p("s", _string),
        "Type": _p("s", _string),
        "NotifyAccess": _p("s", _string),
        "Delegate": _p("b", bool),
        "ExecStart": _p("a(sasb)", _exec_literal),
        "ExecStartPre": _p("a(sasb)", _exec_literal),
        "Slice": _p("s", _string),
        "Environment": _p("as", _environment),
        "EnvironmentFiles": _p("a(sb)", lambda path: [(_string(path), False)]),
        "User": _p("s", _string),
        "SupplementaryGroups": _p("as", list),
        "CacheDirectory": _p("as", list),
        # the mode systemd gives the cache directory it makes (CacheDirectoryMode=, "u")
        "CacheDirectoryMode": _p("u", _uint32),
        "UMask": _p("u", _uint32),
        "WorkingDirectory": _p("s", _string),
        "Restart": _p("s", _string),
        "RestartUSec": _p("t", _usec),
        "RestartSteps": _p("u", _uint32),
        "RestartMaxDelayUSec": _p("t", _usec),
        "StartLimitBurst": _p("u", _uint32),
        "StartLimitIntervalUSec": _p("t", _usec),
        "TimeoutStartUSec": _p("t", _usec),
        "TimeoutStopUSec": _p("t", _usec),
        "KillMode": _p("s", _string),
        "CollectMode": _p("s", _string),
        "SyslogIdentifier": _p("s", _string),
        "StandardInput": _p("s", _string),
        "StandardOutput": _p("s", _string),
        "StandardError": _p("s", _string),
        # RLIMIT_NOFILE, soft and hard ("t"; systemd sets both when only LimitNOFILE is sent,
        # src/core/dbus-execute.c, the "Limit" branch of bus_exec_context_set_transient_property)
        "LimitNOFILE": _p("t", _uint64),
        # cgroup v2 memory bounds in bytes ("t": src/core/dbus-cgroup.c, bus_cgroup_set_property,
        # the "Memory" limits) (the front's unit, gpud/nginx/front.py)
        "MemoryHigh": _p("t", _uint64),
        "MemoryMax": _p("t", _uint64),
        # Sandboxing (the front's unit, gpud/nginx/front.py)
        "NoNewPrivileges": _p("b", bool),
        "ProtectSystem": _p("s", _string),
        "ProtectHome": _p("s", _string),
        "ReadWritePaths": _p("as", list),
        "PrivateTmp": _p("b", bool),
        "PrivateDevices": _p("b", bool),
        "ProtectKernelTunables": _p("b", bool),
        "ProtectKernelModules": _p("b", bool),
        "ProtectKernelLogs": _p("b", bool),
        "ProtectControlGroups": _p("b", bool),
        "ProtectClock": _p("b", bool),
        "ProtectHostname": _p("b", bool),
        "ProtectProc": _p("s", _string),
        # the namespace types the unit may create: 0 is none (RestrictNamespaces=yes)
        "RestrictNamespaces": _p("t", int),
        "RestrictRealtime": _p("b", bool),
        "RestrictSUIDSGID": _p("b", bool),
        "LockPersonality": _p("b", bool),
        # bitmask of capabilities; 0: none
        "CapabilityBoundingSet": _p("t", int),
        "SystemCallArchitectures": _p("as", list),
        # (allow-list?, names): an allow-list of address families / system call groups
        "RestrictAddressFamilies": _p("(bas)", lambda names: (True, list(names))),
        "SystemCallFilter": _p("(bas)", lambda names: (True, list(names))),
    }
)


def encode(name: str, value: Any) -> tuple[str, dbus_fast.Variant]:
    """One ``(name, Variant)`` pair through the table; Variant checks value against signature."""
    prop = PROPERTIES[name]
    return name, dbus_fast.Variant(prop.signature, prop.convert(value))


def build_properties(
    spec: UnitSpec, systemd_version: int | None = None
) -> list[tuple[str, dbus_fast.Variant]]:
    """The ``a(sv)`` properties of ``spec``'s transient unit, in a stable order.

    ``systemd_version`` (the major number) decides whether properties newer than 252 are sent
    and whether arguments that 252 alters across daemon-reload are refused; None means
    "unknown" and is treated as 252.
    """
    unit = spec.unit
    if reload_alters_arguments(systemd_version):
        _refuse_altered_arguments(spec, systemd_version)
    environment = {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in spec.device_indexes
                                         or (spec.device_index,)),
        **({} if spec.environment_file else spec.environment),
    }
    values: list[tuple[str, Any]] = [
        ("Description", spec.description),
        ("Type", "notify" if spec.container else "exec"),
        ("ExecStart", spec.argv),
        ("Slice", SLICE),
        ("Environment", environment),
    ]
    if spec.container:
        values += [("NotifyAccess", "all"), ("Delegate", True)]
    if spec.environment_file is not None:
        values.append(("EnvironmentFiles", spec.environment_file))
    if spec.user is not None:
        values.append(("User", spec.user))
    if spec.hardening is not None and spec.hardening.supplementary_groups:
        values.append(("SupplementaryGroups", list(spec.hardening.supplementary_groups)))
    if spec.working_directory is not None:
        values.append(("WorkingDirectory", spec.working_directory))
    if spec.umask is not None:
        values.append(("UMask", spec.umask))
    if spec.socket is not None:
        values.append(("ExecStartPre", ("/bin/rm", "-f", "--", spec.socket)))
    values += [
        ("Restart", spec.restart),
        ("RestartUSec", spec.restart_sec),
    ]
    if (
        spec.restart_steps is not None
        and spec.restart_max_delay_sec is not None
        and systemd_version is not None
        and systemd_version >= RESTART_BACKOFF_SINCE
    ):
        values += [
            ("RestartSteps", spec.restart_steps),
            ("RestartMaxDelayUSec", spec.restart_max_delay_sec),
        ]
    values += [
        ("StartLimitBurst", spec.start_limit_burst),
        ("StartLimitIntervalUSec", spec.start_limit_interval_sec),
        ("TimeoutStartUSec", spec.timeout_start_sec),
        ("TimeoutStopUSec", spec.timeout_stop_sec),
        ("KillMode", "mixed"),
        ("CollectMode", "inactive-or-failed"),
        ("SyslogIdentifier", unit.removesuffix(UNIT_SUFFIX)),
        ("StandardInput", "null"),
        ("StandardOutput", "journal"),
        ("StandardError", "journal"),
    ]
    if spec.hardening is not None:
        values += _hardening(spec.hardening, umask=spec.umask is None)
    return [encode(name, value) for name, value in values]


def _hardening(h: Hardening, *, umask: bool) -> list[tuple[str, Any]]:
    """The sandbox a model server tolerates (`systemd-analyze security`: 9.6 as root, unhardened;
    see docs/security.md for what each line costs and what is left out, and why)."""
    values: list[tuple[str, Any]] = []
    if h.cache_directory is not None:
        values.append(("CacheDirectory", [h.cache_directory]))
        # Not systemd's default 0755: the weights and whatever the serve caches are its own
        # and its group's (the front's group reads nothing there; other users nothing at all).
        values.append(("CacheDirectoryMode", 0o750))
    if umask:
        # (a fronted serve has its own, spec.umask: its socket is for the front's group)
        values.append(("UMask", 0o027))
    values += [
        ("NoNewPrivileges", True),
        ("ProtectSystem", "strict"),
    ]
    if h.read_write_paths:
        values.append(("ReadWritePaths", list(h.read_write_paths)))
    if h.protect_home != "no":
        values.append(("ProtectHome", h.protect_home))
    values += [
        # /tmp and /var/tmp of its own (torch's and triton's scratch files); /dev/shm stays the
        # host's, where vLLM's workers share memory.
        ("PrivateTmp", True),
        ("ProtectKernelTunables", True),
        ("ProtectKernelModules", True),
        ("ProtectKernelLogs", True),
        ("ProtectControlGroups", True),
        ("ProtectHostname", True),
        ("ProtectProc", "invisible"),
        ("RestrictNamespaces", 0),
        ("RestrictRealtime", True),
        ("RestrictSUIDSGID", True),
        ("LockPersonality", True),
        ("CapabilityBoundingSet", 0),
        ("SystemCallArchitectures", ["native"]),
        # AF_NETLINK: glibc's getaddrinfo(AI_ADDRCONFIG) asks the kernel over netlink which
        # address families are configured (as for gpud.service).
        ("RestrictAddressFamilies", ["AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"]),
    ]
    return values


def _refuse_altered_arguments(spec: UnitSpec, systemd_version: int | None) -> None:
    for position, arg in enumerate(spec.argv):
        bad = [ch for ch in ALTERED_BY_RELOAD if ch in arg]
        if bad:
            version = "an unknown systemd" if systemd_version is None else (f"systemd {systemd_version}")
            raise BadRequest(
                f"serve {spec.serve}: command argument {position} ({arg!r}) contains "
                f"{' and '.join(repr(ch) for ch in bad)}, which {version} alters when it "
                "reloads the unit (daemon-reload); the serve would restart with a different "
                "command",
                {"serve": spec.serve, "argument": position, "characters": bad},
            )
