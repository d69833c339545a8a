"""The system bus as systemd's service manager speaks it: its names (the Manager, the unit and
service interfaces, the units' object paths and their escaping), the match rules gpud's unit
adapter (gpud.host.units) subscribes with, the properties a unit's state is made of and how
they are read into a `UnitState`, and the one mapping of a D-Bus or connection error to a gpud
error (`map_error`). Values only: the connection, the calls and the watch are the adapter's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any, Final

from dbus_fast import Variant
from dbus_fast.errors import AuthError, DBusError

from gpud.core.unitstate import UnitState
from gpud.core.vocab import serve_of_unit
from gpud.errors import BadRequest, Conflict, GpudError, NotFound, Unavailable
from gpud.host.unit_properties import UNIT_PREFIX, UNIT_SUFFIX

SYSTEMD: Final = "org.freedesktop.systemd1"
MANAGER_PATH: Final = "/org/freedesktop/systemd1"
MANAGER_IFACE: Final = "org.freedesktop.systemd1.Manager"
UNIT_IFACE: Final = "org.freedesktop.systemd1.Unit"
SERVICE_IFACE: Final = "org.freedesktop.systemd1.Service"
PROPERTIES_IFACE: Final = "org.freedesktop.DBus.Properties"
UNIT_PATH_PREFIX: Final = "/org/freedesktop/systemd1/unit/"
DBUS: Final = "org.freedesktop.DBus"
DBUS_PATH: Final = "/org/freedesktop/DBus"

ALREADY_SUBSCRIBED: Final = "org.freedesktop.systemd1.AlreadySubscribed"
UNIT_EXISTS: Final = "org.freedesktop.systemd1.UnitExists"
SERVE_UNIT_PATTERN: Final = f"{UNIT_PREFIX}*{UNIT_SUFFIX}"

# Match rules; `sender` is a well-known name, which the bus resolves to its current owner.
MATCH_RULES: Final = (
    f"type='signal',sender='{SYSTEMD}',path='{MANAGER_PATH}',interface='{MANAGER_IFACE}',member='JobRemoved'",
    f"type='signal',sender='{SYSTEMD}',path='{MANAGER_PATH}',interface='{MANAGER_IFACE}',"
    "member='UnitRemoved'",
    f"type='signal',sender='{SYSTEMD}',interface='{PROPERTIES_IFACE}',"
    f"member='PropertiesChanged',path_namespace='{UNIT_PATH_PREFIX.rstrip('/')}'",
    f"type='signal',sender='{DBUS}',path='{DBUS_PATH}',interface='{DBUS}',"
    f"member='NameOwnerChanged',arg0='{SYSTEMD}'",
)

# The properties a UnitState is made of: name -> (interface, D-Bus signature).
STATE_PROPERTIES: Final[Mapping[str, tuple[str, str]]] = MappingProxyType(
    {
        "LoadState": (UNIT_IFACE, "s"),
        "ActiveState": (UNIT_IFACE, "s"),
        "SubState": (UNIT_IFACE, "s"),
        "InvocationID": (UNIT_IFACE, "ay"),
        "Result": (SERVICE_IFACE, "s"),
        "NRestarts": (SERVICE_IFACE, "u"),
        "MainPID": (SERVICE_IFACE, "u"),
        "ExecMainStatus": (SERVICE_IFACE, "i"),
        "ExecMainCode": (SERVICE_IFACE, "i"),
        # Sent in no PropertiesChanged signal: fetched with the rest, again per invocation.
        "ControlGroup": (SERVICE_IFACE, "s"),
        # When the unit left "active" and when its main process exited (µs, realtime): a unit
        # stopped by a job left active before its process exited; a process that exited by
        # itself did so first. That tells an operator's `systemctl stop` from an exit.
        "ActiveExitTimestamp": (UNIT_IFACE, "t"),
        "ExecMainExitTimestamp": (SERVICE_IFACE, "t"),
    }
)
STATE_INTERFACES: Final = (UNIT_IFACE, SERVICE_IFACE)


# --- object path labels ---------------------------------------------------------------------


def bus_path_escape(label: str) -> str:
    """systemd's ``bus_label_escape``: keep [A-Za-z] (and digits after the first char),
    everything else byte-wise as ``_xx``; the empty label is ``_``."""
    if not label:
        return "_"
    out: list[str] = []
    for i, ch in enumerate(label):
        if ch.isascii() and (ch.isalpha() or (i > 0 and ch.isdigit())):
            out.append(ch)
        else:
            out.extend(f"_{byte:02x}" for byte in ch.encode())
    return "".join(out)


_HEX: Final = re.compile(r"_([0-9a-fA-F]{2})")


def bus_path_unescape(label: str) -> str:
    """Inverse of ``bus_path_escape`` (systemd's ``bus_label_unescape``)."""
    if label == "_":
        return ""
    raw = bytearray()
    pos = 0
    for match in _HEX.finditer(label):
        raw += label[pos : match.start()].encode()
        raw.append(int(match.group(1), 16))
        pos = match.end()
    raw += label[pos:].encode()
    return raw.decode("utf-8", errors="replace")


def unit_of_path(path: str) -> str | None:
    if not path.startswith(UNIT_PATH_PREFIX):
        return None
    label = path[len(UNIT_PATH_PREFIX) :]
    return bus_path_unescape(label) if label and "/" not in label else None


def systemd_major(version: str) -> int | None:
    """252 from "252.38-1~deb12u1", 256 from "v256.4"; None when there is no number."""
    match = re.match(r"^\D*(\d+)", version)
    return int(match.group(1)) if match else None


# --- the one error mapping ------------------------------------------------------------------

_DBUS_ERRORS: Final[Mapping[str, type[GpudError]]] = MappingProxyType(
    {
        UNIT_EXISTS: Conflict,
        "org.freedesktop.systemd1.NoSuchUnit": NotFound,
        "org.freedesktop.systemd1.NoSuchJob": NotFound,
        "org.freedesktop.DBus.Error.UnknownObject": NotFound,
        "org.freedesktop.systemd1.UnitMasked": Conflict,
        "org.freedesktop.systemd1.AlreadySubscribed": Conflict,
        "org.freedesktop.systemd1.TransactionIsDestructive": Conflict,
        "org.freedesktop.systemd1.TransactionJobsConflicting": Conflict,
        "org.freedesktop.systemd1.TransactionOrderIsCyclic": Conflict,
        "org.freedesktop.systemd1.JobTypeNotApplicable": Conflict,
        "org.freedesktop.systemd1.OnlyByDependency": Conflict,
        # The unit or a property was refused: the spec (from gpud's config) is at fault.
        "org.freedesktop.DBus.Error.InvalidArgs": BadRequest,
        "org.freedesktop.DBus.Error.PropertyReadOnly": BadRequest,
        "org.freedesktop.DBus.Error.UnknownProperty": BadRequest,
        "org.freedesktop.systemd1.BadUnitSetting": BadRequest,
        # gpud itself may not manage units (not root, polkit): a deployment fault, not the
        # client's; 503 rather than 403 so nobody thinks the *client* lacks a right.
        "org.freedesktop.DBus.Error.AccessDenied": Unavailable,
        "org.freedesktop.DBus.Error.InteractiveAuthorizationRequired": Unavailable,
        "org.freedesktop.systemd1.ShuttingDown": Unavailable,
        "org.freedesktop.DBus.Error.ServiceUnknown": Unavailable,
        "org.freedesktop.DBus.Error.NameHasNoOwner": Unavailable,
        "org.freedesktop.DBus.Error.NoReply": Unavailable,
        "org.freedesktop.DBus.Error.Disconnected": Unavailable,
        "org.freedesktop.DBus.Error.NoServer": Unavailable,
        "org.freedesktop.DBus.Error.Timeout": Unavailable,
        "org.freedesktop.DBus.Error.TimedOut": Unavailable,
        "org.freedesktop.DBus.Error.LimitsExceeded": Unavailable,
        "org.freedesktop.DBus.Error.UnknownMethod": Unavailable,
    }
)

# Exceptions that mean "no usable connection" rather than a bug in gpud.
CONNECTION_ERRORS: Final = (OSError, EOFError, TimeoutError, AuthError)


def map_error(exc: BaseException, action: str) -> GpudError:
    """The gpud error for a D-Bus or connection failure while doing ``action``."""
    if isinstance(exc, GpudError):
        return exc
    if isinstance(exc, DBusError):
        kind = _DBUS_ERRORS.get(exc.type, GpudError)
        details = {"dbus_error": exc.type}
        if kind is Unavailable and exc.type.endswith(("AccessDenied", "InteractiveAuthorizationRequired")):
            return Unavailable(f"{action}: systemd refused gpud ({exc.text}); run gpud as root", details)
        return kind(f"{action}: {exc.text}", details)
    if isinstance(exc, CONNECTION_ERRORS):
        what = str(exc) or type(exc).__name__
        return Unavailable(f"{action}: system bus unavailable ({what})", {"cause": what})
    raise TypeError(f"not a D-Bus or connection error: {exc!r}") from exc


def typed_properties(interface: str, values: Iterable[tuple[str, Variant]]) -> dict[str, Any]:
    """The state properties of one interface, checked against STATE_PROPERTIES."""
    out: dict[str, Any] = {}
    for name, variant in values:
        spec = STATE_PROPERTIES.get(name)
        if spec is not None and spec == (interface, variant.signature):
            out[name] = variant.value
    return out


def state_from(unit: str, props: Mapping[str, Any]) -> UnitState | None:
    serve = serve_of_unit(unit)
    if serve is None or not STATE_PROPERTIES.keys() <= props.keys():
        return None
    return UnitState(
        serve=serve,
        unit=unit,
        active_state=props["ActiveState"],
        sub_state=props["SubState"],
        result=props["Result"],
        n_restarts=props["NRestarts"],
        main_pid=props["MainPID"],
        exec_main_status=props["ExecMainStatus"],
        invocation_id=bytes(props["InvocationID"]).hex(),
        control_group=props["ControlGroup"],
        exec_main_code=props["ExecMainCode"],
        load_state=props["LoadState"],
        active_exit_us=props["ActiveExitTimestamp"],
        exec_main_exit_us=props["ExecMainExitTimestamp"],
    )
