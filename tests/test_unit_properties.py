"""The exact D-Bus encoding of a serve's transient unit, and the pure helpers of gpud.host.units.

The golden lists below are the wire format: a change to one of them is a change of what gpud
asks systemd for, and must be deliberate.
"""

from __future__ import annotations

import ast
import asyncio
import io
import math
from pathlib import Path
from typing import Any

import pytest
from dbus_fast import Message, MessageType, Variant
from dbus_fast._private.unmarshaller import Unmarshaller
from dbus_fast.errors import AuthError, DBusError

from gpud.core.launch import Hardening
from gpud.core.unitstate import UnitState
from gpud.core.vocab import serve_of_unit, serve_unit
from gpud.errors import BadRequest, Conflict, GpudError, JobFailed, NotFound, Unavailable
from gpud.host.unit_properties import (
    PROPERTIES,
    USEC_INFINITY,
    UnitSpec,
    build_properties,
    encode,
    environment_file_text,
    unit_name,
)
from gpud.host.unitbus import (
    _DBUS_ERRORS,
    MANAGER_IFACE,
    MANAGER_PATH,
    PROPERTIES_IFACE,
    SERVICE_IFACE,
    UNIT_IFACE,
    UNIT_PATH_PREFIX,
    bus_path_escape,
    bus_path_unescape,
    map_error,
    systemd_major,
    unit_of_path,
)
from gpud.host.unitbus import state_from as _state_from
from gpud.host.units import SystemdUnits, _JobWatch, _Tracked
from tests.waiting import until, waiters

# Quotes, a specifier, spaces, a backslash, a tab: all must reach the process as they are.
HOSTILE = "a b \"c\" 'd' %n \\x\ty"

SPEC = UnitSpec(
    serve="ocr",
    argv=("/opt/serves/bin/ocr-serve", "--port", "30007", "--label", HOSTILE),
    environment={"HF_HOME": "/var/lib/gpud/hf", "NOTE": "$HOME; %n"},
    device_index=1,
    user="gpud-serve",
    description="gpud serve ocr",
    restart_sec=2.5,
    start_limit_burst=5,
    start_limit_interval_sec=600,
    timeout_start_sec=90,
    timeout_stop_sec=30.0,
    working_directory="/var/lib/gpud",
)


def _triples(props: list[tuple[str, Variant]]) -> list[tuple[str, str, Any]]:
    return [(name, v.signature, v.value) for name, v in props]


GOLDEN_252: list[tuple[str, str, Any]] = [
    ("Description", "s", "gpud serve ocr"),
    ("Type", "s", "exec"),
    (
        "ExecStart",
        "a(sasb)",
        [
            (
                "/opt/serves/bin/ocr-serve",
                ["/opt/serves/bin/ocr-serve", "--port", "30007", "--label", HOSTILE],
                False,
            )
        ],
    ),
    ("Slice", "s", "gpud.slice"),
    (
        "Environment",
        "as",
        [
            "CUDA_DEVICE_ORDER=PCI_BUS_ID",
            "CUDA_VISIBLE_DEVICES=1",
            "HF_HOME=/var/lib/gpud/hf",
            # Environment= values are never $-expanded by systemd: they travel as they are.
            "NOTE=$HOME; %n",
        ],
    ),
    ("User", "s", "gpud-serve"),
    ("WorkingDirectory", "s", "/var/lib/gpud"),
    ("Restart", "s", "on-failure"),
    ("RestartUSec", "t", 2_500_000),
    ("StartLimitBurst", "u", 5),
    ("StartLimitIntervalUSec", "t", 600_000_000),
    ("TimeoutStartUSec", "t", 90_000_000),
    ("TimeoutStopUSec", "t", 30_000_000),
    ("KillMode", "s", "mixed"),
    ("CollectMode", "s", "inactive-or-failed"),
    ("SyslogIdentifier", "s", "gpud-serve-ocr"),
    ("StandardInput", "s", "null"),
    ("StandardOutput", "s", "journal"),
    ("StandardError", "s", "journal"),
]


def test_golden_encoding_systemd_252() -> None:
    assert _triples(build_properties(SPEC, 252)) == GOLDEN_252
    # an unknown version is treated as the oldest supported one
    assert _triples(build_properties(SPEC, None)) == GOLDEN_252


# The sandbox of an unprivileged, fronted serve on the simulated GPU (core.launch.serve_identity
# makes its Hardening); after the common list, in this order.
HARDENED = UnitSpec(serve="chat", argv=("/bin/x",), device_index=0, description="d",
                    user="gpud-serve", umask=0o007,
                    hardening=Hardening("yes", ("/run/gpud/sim-procs", "/run/gpud/serves"),
                                        "gpud-serve", ("gpud-front",)))
GOLDEN_HARDENED: list[tuple[str, str, Any]] = [
    ("CacheDirectory", "as", ["gpud-serve"]),
    ("CacheDirectoryMode", "u", 0o750),
    ("NoNewPrivileges", "b", True),
    ("ProtectSystem", "s", "strict"),
    ("ReadWritePaths", "as", ["/run/gpud/sim-procs", "/run/gpud/serves"]),
    ("ProtectHome", "s", "yes"),
    ("PrivateTmp", "b", True),
    ("ProtectKernelTunables", "b", True),
    ("ProtectKernelModules", "b", True),
    ("ProtectKernelLogs", "b", True),
    ("ProtectControlGroups", "b", True),
    ("ProtectHostname", "b", True),
    ("ProtectProc", "s", "invisible"),
    ("RestrictNamespaces", "t", 0),
    ("RestrictRealtime", "b", True),
    ("RestrictSUIDSGID", "b", True),
    ("LockPersonality", "b", True),
    ("CapabilityBoundingSet", "t", 0),
    ("SystemCallArchitectures", "as", ["native"]),
    ("RestrictAddressFamilies", "(bas)", (True, ["AF_UNIX", "AF_INET", "AF_INET6",
                                                 "AF_NETLINK"])),
]


def test_golden_encoding_of_a_hardened_serve() -> None:
    props = _triples(build_properties(HARDENED, 252))
    names = [name for name, _, _ in props]
    assert props[names.index("CacheDirectory"):] == GOLDEN_HARDENED
    assert props[names.index("User"):names.index("User") + 2] == [
        ("User", "s", "gpud-serve"), ("SupplementaryGroups", "as", ["gpud-front"])]
    assert ("UMask", "u", 0o007) in props  # the fronted serve's own, sent once
    assert names.count("UMask") == 1
    # What a model server does not tolerate is never sent: GPUs are device nodes, torch and
    # triton write code they then run, and the CUDA driver's system calls are not listed.
    for name in ("PrivateDevices", "MemoryDenyWriteExecute", "SystemCallFilter", "ProtectClock",
                 "DevicePolicy", "RemoveIPC"):
        assert name not in names


def test_an_unfronted_hardened_serve_gets_a_private_umask() -> None:
    spec = UnitSpec(serve="x", argv=("/bin/x",), device_index=0, description="d", user="alice",
                    hardening=Hardening("no", ("-/home/alice",)))
    props = dict((name, (sig, value)) for name, sig, value in _triples(build_properties(spec)))
    assert props["UMask"] == ("u", 0o027)
    assert "ProtectHome" not in props and "CacheDirectory" not in props
    assert "SupplementaryGroups" not in props
    assert props["ReadWritePaths"] == ("as", ["-/home/alice"])


def test_an_environment_file_carries_the_serves_own_variables() -> None:
    spec = UnitSpec(serve="ocr", argv=("/bin/x",), device_index=1, description="d",
                    environment={"HF_TOKEN": "secret"},
                    environment_file="/var/lib/gpud/env/ocr.env")
    props = dict((name, (sig, value)) for name, sig, value in _triples(build_properties(spec)))
    assert props["Environment"] == ("as", ["CUDA_DEVICE_ORDER=PCI_BUS_ID",
                                           "CUDA_VISIBLE_DEVICES=1"])
    assert props["EnvironmentFiles"] == ("a(sb)", [("/var/lib/gpud/env/ocr.env", False)])
    assert "secret" not in repr(props)


def test_environment_file_text_quotes_for_systemds_parser() -> None:
    text = environment_file_text({"A": "x y $HOME", "B": "it's \"q\" \\ $X `c`", "C": ""})
    assert text == ("A='x y $HOME'\n"
                    'B="it\'s \\"q\\" \\\\ \\$X \\`c\\`"\n'
                    "C=''\n")


def test_golden_encoding_newer_systemd_doubles_dollars_and_adds_backoff() -> None:
    spec = UnitSpec(
        serve="fast",
        argv=("/usr/bin/vllm", "serve", "$HOME", ";", "${X:-y}", "100%"),
        device_index=0,
        description="gpud serve fast",
        restart="always",
        restart_sec=0.1,
        restart_steps=5,
        restart_max_delay_sec=60,
        timeout_stop_sec=math.inf,
    )
    assert _triples(build_properties(spec, 256)) == [
        ("Description", "s", "gpud serve fast"),
        ("Type", "s", "exec"),
        (
            "ExecStart",
            "a(sasb)",
            [
                (
                    "/usr/bin/vllm",
                    # systemd turns $$ back into $ when it executes: the process sees "$HOME"
                    ["/usr/bin/vllm", "serve", "$$HOME", ";", "$${X:-y}", "100%"],
                    False,
                )
            ],
        ),
        ("Slice", "s", "gpud.slice"),
        ("Environment", "as", ["CUDA_DEVICE_ORDER=PCI_BUS_ID", "CUDA_VISIBLE_DEVICES=0"]),
        ("Restart", "s", "always"),
        ("RestartUSec", "t", 100_000),
        ("RestartSteps", "u", 5),
        ("RestartMaxDelayUSec", "t", 60_000_000),
        ("StartLimitBurst", "u", 5),
        ("StartLimitIntervalUSec", "t", 600_000_000),
        ("TimeoutStartUSec", "t", 90_000_000),
        ("TimeoutStopUSec", "t", USEC_INFINITY),
        ("KillMode", "s", "mixed"),
        ("CollectMode", "s", "inactive-or-failed"),
        ("SyslogIdentifier", "s", "gpud-serve-fast"),
        ("StandardInput", "s", "null"),
        ("StandardOutput", "s", "journal"),
        ("StandardError", "s", "journal"),
    ]


def test_backoff_is_left_out_before_systemd_254() -> None:
    spec = UnitSpec(
        serve="x",
        argv=("/bin/true",),
        device_index=0,
        description="x",
        restart_steps=3,
        restart_max_delay_sec=30,
    )
    for version in (None, 252, 253):
        names = [name for name, _ in build_properties(spec, version)]
        assert "RestartSteps" not in names and "RestartMaxDelayUSec" not in names
    names = [name for name, _ in build_properties(spec, 254)]
    assert "RestartSteps" in names and "RestartMaxDelayUSec" in names


@pytest.mark.parametrize("arg", ["$HOME", "a;b", ";", "${X}", "$"])
@pytest.mark.parametrize("version", [None, 250, 252])
def test_arguments_252_would_alter_on_reload_are_refused(arg: str, version: int | None) -> None:
    spec = UnitSpec(serve="x", argv=("/bin/echo", arg), device_index=0, description="x")
    with pytest.raises(BadRequest, match="daemon-reload") as info:
        build_properties(spec, version)
    assert info.value.details["argument"] == 1


def _round_trip(message: Message) -> Message:
    """The message as the receiving end reads it off the wire (dbus-fast's own unmarshaller)."""
    reader = Unmarshaller(io.BytesIO(message._marshall(False)))  # type: ignore[arg-type]
    reader.unmarshall()
    assert reader.message is not None
    return reader.message


# One sample gpud value per table entry: a new entry without one fails here.
SAMPLES: dict[str, Any] = {
    "Description": "d",
    "Type": "exec",
    "NotifyAccess": "all",
    "Delegate": True,
    "ExecStart": ("/bin/x", "a$b", ""),
    "Slice": "gpud.slice",
    "Environment": {"A": "1", "B": ""},
    "EnvironmentFiles": "/var/lib/gpud/env/x.env",
    "User": "u",
    "SupplementaryGroups": ["gpud-front"],
    "CacheDirectory": ["gpud-serve"],
    "CacheDirectoryMode": 0o750,
    "LimitNOFILE": 32768,
    "MemoryHigh": 3 << 30,
    "MemoryMax": 4 << 30,
    "RestrictNamespaces": 0,
    "WorkingDirectory": "/",
    "Restart": "no",
    "RestartUSec": 0.25,
    "RestartSteps": 10,
    "RestartMaxDelayUSec": math.inf,
    "StartLimitBurst": 0,
    "StartLimitIntervalUSec": 0,
    "TimeoutStartUSec": 1e-6,
    "TimeoutStopUSec": 3600,
    "KillMode": "mixed",
    "CollectMode": "inactive-or-failed",
    "SyslogIdentifier": "gpud-serve-x",
    "StandardInput": "null",
    "StandardOutput": "journal",
    "StandardError": "journal",
    "UMask": 0o007,
    "ExecStartPre": ("/bin/rm", "-f", "--", "/run/gpud/serves/x.sock"),
    "NoNewPrivileges": True,
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "ReadWritePaths": ["/run/gpud/front/run"],
    "PrivateTmp": True,
    "PrivateDevices": True,
    "ProtectKernelTunables": True,
    "ProtectKernelModules": True,
    "ProtectKernelLogs": True,
    "ProtectControlGroups": True,
    "ProtectClock": True,
    "ProtectHostname": True,
    "ProtectProc": "invisible",
    "RestrictRealtime": True,
    "RestrictSUIDSGID": True,
    "LockPersonality": True,
    "CapabilityBoundingSet": 0,
    "SystemCallArchitectures": ["native"],
    "RestrictAddressFamilies": ["AF_UNIX", "AF_INET"],
    "SystemCallFilter": ["@system-service"],
}


def test_every_table_entry_has_a_sample() -> None:
    assert set(SAMPLES) == set(PROPERTIES)


@pytest.mark.parametrize("name", sorted(PROPERTIES))
def test_converter_output_matches_its_signature(name: str) -> None:
    # Variant() verifies the value against the signature; then the real marshaller, both ways:
    # what comes back from the wire (structs as tuples, arrays as lists) equals what was sent.
    _, variant = encode(name, SAMPLES[name])
    message = Message(
        destination=MANAGER_IFACE.rsplit(".", 1)[0],
        path=MANAGER_PATH,
        interface=MANAGER_IFACE,
        member="StartTransientUnit",
        signature="ssa(sv)a(sa(sv))",
        body=["x.service", "fail", [(name, variant)], []],
        serial=1,
    )
    (back_name, back_variant) = _round_trip(message).body[2][0]
    assert back_name == name
    assert back_variant.signature == PROPERTIES[name].signature
    assert back_variant.value == variant.value


def test_whole_property_list_marshals() -> None:
    props = build_properties(SPEC, 252)
    message = Message(
        destination="org.freedesktop.systemd1",
        path=MANAGER_PATH,
        interface=MANAGER_IFACE,
        member="StartTransientUnit",
        signature="ssa(sv)a(sa(sv))",
        body=[SPEC.unit, "fail", props, []],
        serial=1,
    )
    assert _triples(_round_trip(message).body[2]) == GOLDEN_252


@pytest.mark.parametrize(
    ("seconds", "usec"),
    [(0, 0), (0.1, 100_000), (1e-7, 0), (2.5, 2_500_000), (math.inf, USEC_INFINITY)],
)
def test_seconds_become_microseconds(seconds: float, usec: int) -> None:
    assert encode("TimeoutStopUSec", seconds)[1].value == usec


@pytest.mark.parametrize("seconds", [-1, math.nan, -math.inf])
def test_invalid_durations_are_refused(seconds: float) -> None:
    with pytest.raises(BadRequest):
        encode("RestartUSec", seconds)


def test_uint32_range_is_checked() -> None:
    with pytest.raises(BadRequest):
        encode("StartLimitBurst", 2**32)
    with pytest.raises(BadRequest):
        encode("LimitNOFILE", 2**64)
    with pytest.raises(BadRequest):
        encode("LimitNOFILE", -1)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"serve": "Bad"}, "invalid serve name"),
        ({"serve": "-x"}, "invalid serve name"),
        ({"serve": "a" * 64}, "invalid serve name"),
        ({"serve": "x.y"}, "invalid serve name"),
        ({"argv": ()}, "absolute path"),
        ({"argv": ("vllm", "serve")}, "absolute path"),
        ({"argv": ("/bin/x", "a\0b")}, "NUL"),
        ({"device_index": -1}, "negative device index"),
        ({"environment": {"CUDA_VISIBLE_DEVICES": "0,1"}}, "pins the device"),
        ({"environment": {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}}, "pins the device"),
        ({"environment": {"A-B": "1"}}, "invalid environment variable"),
        ({"environment": {"A": "x\0y"}}, "invalid environment variable"),
        ({"working_directory": "relative"}, "absolute path"),
        ({"restart_steps": 3}, "go together"),
    ],
)
def test_unit_spec_refuses_what_systemd_or_gpud_cannot_use(changes: dict[str, Any], match: str) -> None:
    fields: dict[str, Any] = {
        "serve": "x",
        "argv": ("/bin/true",),
        "device_index": 0,
        "description": "x",
    }
    fields.update(changes)
    with pytest.raises(BadRequest, match=match):
        UnitSpec(**fields)


def test_unit_spec_environment_is_a_frozen_copy() -> None:
    env = {"A": "1"}
    spec = UnitSpec(serve="x", argv=("/bin/true",), device_index=0, description="x", environment=env)
    env["A"] = "2"
    assert spec.environment["A"] == "1"
    with pytest.raises(TypeError):
        spec.environment["A"] = "3"  # type: ignore[index]


def test_unit_names() -> None:
    assert unit_name("ocr") == "gpud-serve-ocr.service"
    assert serve_of_unit("gpud-serve-ocr.service") == "ocr"
    assert serve_of_unit("gpud-serve-a_b-c.service") == "a_b-c"
    for other in ("gpud.service", "gpud-serve-.service", "gpud-serve-X.service", "ocr.service"):
        assert serve_of_unit(other) is None
    with pytest.raises(BadRequest):
        unit_name("../x")


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes of a module, its classes and functions."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def test_only_vocab_spells_a_serve_unit() -> None:
    """gpud.core.vocab.serve_unit is the one place that writes a serve's unit name out: no
    string in gpud's code (docstrings and comments aside) holds its prefix."""
    root = Path(__file__).resolve().parent.parent / "gpud"
    spelt: list[str] = []
    for path in sorted(root.rglob("*.py")):
        if path == root / "core" / "vocab.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        docs = _docstrings(tree)
        spelt += [f"{path.relative_to(root.parent)}:{node.lineno}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and "gpud-serve-" in node.value and id(node) not in docs]
    assert spelt == []
    assert serve_unit("ocr") == unit_name("ocr") == "gpud-serve-ocr.service"


# --- pure helpers of gpud.host.units -------------------------------------------------------------


@pytest.mark.parametrize(
    ("unit", "label"),
    [
        ("gpud-serve-x.service", "gpud_2dserve_2dx_2eservice"),
        ("gpud-serve-a_b.service", "gpud_2dserve_2da_5fb_2eservice"),
        ("gpud-serve-0.service", "gpud_2dserve_2d0_2eservice"),
        ("0day.service", "_30day_2eservice"),
        ("", "_"),
    ],
)
def test_object_path_labels_escape_like_systemd(unit: str, label: str) -> None:
    assert bus_path_escape(unit) == label
    assert bus_path_unescape(label) == unit
    assert unit_of_path(UNIT_PATH_PREFIX + label) == unit


def test_unit_of_path_ignores_other_objects() -> None:
    assert unit_of_path("/org/freedesktop/systemd1") is None
    assert unit_of_path("/org/freedesktop/systemd1/job/12") is None
    assert unit_of_path("/org/freedesktop/systemd1/unit/") is None


@pytest.mark.parametrize(
    ("version", "major"), [("252.38-1~deb12u1", 252), ("v256.4", 256), ("257", 257), ("", None)]
)
def test_systemd_major(version: str, major: int | None) -> None:
    assert systemd_major(version) == major


@pytest.mark.parametrize("name", sorted(_DBUS_ERRORS))
def test_every_mapped_dbus_error_becomes_its_gpud_error(name: str) -> None:
    exc = DBusError(name, "text from systemd")
    mapped = map_error(exc, "start gpud-serve-x.service")
    assert type(mapped) is _DBUS_ERRORS[name]
    assert mapped.details["dbus_error"] == name
    assert mapped.message.startswith("start gpud-serve-x.service: ")


def test_the_important_dbus_errors_map_as_documented() -> None:
    assert _DBUS_ERRORS["org.freedesktop.systemd1.UnitExists"] is Conflict
    assert _DBUS_ERRORS["org.freedesktop.systemd1.NoSuchUnit"] is NotFound
    assert _DBUS_ERRORS["org.freedesktop.DBus.Error.AccessDenied"] is Unavailable
    assert _DBUS_ERRORS["org.freedesktop.DBus.Error.PropertyReadOnly"] is BadRequest


def test_unknown_dbus_errors_and_connection_errors() -> None:
    unknown = map_error(DBusError("org.example.Weird", "odd"), "x")
    assert type(unknown) is GpudError
    assert unknown.details == {"dbus_error": "org.example.Weird"}
    for exc in (
        ConnectionRefusedError(111, "refused"),
        FileNotFoundError(2, "no socket"),
        EOFError(),
        TimeoutError(),
        AuthError("rejected"),
    ):
        assert type(map_error(exc, "x")) is Unavailable
    with pytest.raises(TypeError):
        map_error(ValueError("a bug, not a bus failure"), "x")


def test_job_failed_is_a_gpud_error() -> None:
    assert issubclass(JobFailed, GpudError)
    assert JobFailed("x").to_json()["error"]["code"] == "unit-job-failed"


FULL_PROPS: dict[str, Any] = {
    "LoadState": "loaded",
    "ActiveState": "active",
    "SubState": "running",
    "InvocationID": bytes(range(16)),
    "Result": "success",
    "NRestarts": 2,
    "MainPID": 4242,
    "ExecMainStatus": 0,
    "ExecMainCode": 0,
    "ControlGroup": "/gpud.slice/gpud-serve-x.service",
    "ActiveExitTimestamp": 1_000_000,
    "ExecMainExitTimestamp": 1_250_000,
}


def test_state_from_properties() -> None:
    assert _state_from("gpud-serve-x.service", FULL_PROPS) == UnitState(
        serve="x",
        unit="gpud-serve-x.service",
        active_state="active",
        sub_state="running",
        result="success",
        n_restarts=2,
        main_pid=4242,
        exec_main_status=0,
        invocation_id="000102030405060708090a0b0c0d0e0f",
        control_group="/gpud.slice/gpud-serve-x.service",
        exec_main_code=0,
        load_state="loaded",
        active_exit_us=1_000_000,
        exec_main_exit_us=1_250_000,
    )
    partial = dict(FULL_PROPS)
    del partial["ControlGroup"]
    assert _state_from("gpud-serve-x.service", partial) is None
    assert _state_from("other.service", FULL_PROPS) is None


def test_stopped_by_job_from_the_order_of_exits() -> None:
    stopped = _state_from("gpud-serve-x.service", FULL_PROPS)
    assert stopped is not None and stopped.stopped_by_job  # left active, then the process ended
    exited = _state_from("gpud-serve-x.service", {**FULL_PROPS, "ActiveExitTimestamp": 1_250_010})
    assert exited is not None and not exited.stopped_by_job  # the process ended, then the unit
    never = _state_from("gpud-serve-x.service", {**FULL_PROPS, "ActiveExitTimestamp": 0})
    assert never is not None and not never.stopped_by_job


def _signal(sender: str, member: str, signature: str, body: list[Any], **kw: Any) -> Message:
    return Message(
        message_type=MessageType.SIGNAL,
        sender=sender,
        member=member,
        signature=signature,
        body=body,
        **kw,
    )


async def test_job_removed_only_counts_from_systemd() -> None:
    units = SystemdUnits()
    units._systemd_owner = ":1.1"
    async with units._watch_jobs("gpud-serve-x.service") as watch:
        job = "/org/freedesktop/systemd1/job/7"
        body = [7, job, "gpud-serve-x.service", "done"]
        manager = {"path": MANAGER_PATH, "interface": MANAGER_IFACE}
        # a unicast signal forged by another peer on the bus is ignored
        units._on_message(_signal(":1.99", "JobRemoved", "uoss", body, **manager))
        assert watch.results == {}
        units._on_message(_signal(":1.1", "JobRemoved", "uoss", body, **manager))
        assert await asyncio.wait_for(watch.wait(job), 1) == "done"
    assert units._job_watches == {}


def _changed(interface: str, **values: Variant) -> Message:
    return _signal(":1.1", "PropertiesChanged", "sa{sv}as", [interface, values, []],
                   path=UNIT_PATH_PREFIX + bus_path_escape("gpud-serve-x.service"),
                   interface=PROPERTIES_IFACE)


async def test_a_watch_reports_an_exit_read_together_with_the_restart() -> None:
    """A loaded host reads a kill's signals and the restart's in one batch: the watch reports
    the crash (result signal, status 9) before the restart, not only the restarted state; the
    two halves of one change (Service, then Unit) stay one callback."""
    units = SystemdUnits()
    units._systemd_owner = ":1.1"
    units._tracked["gpud-serve-x.service"] = _Tracked(props=dict(FULL_PROPS))
    seen: list[UnitState] = []
    units.watch(seen.append)
    for message in (
        # the kill: the process ended by signal 9, systemd waits RestartSec
        _changed(SERVICE_IFACE, Result=Variant("s", "signal"), MainPID=Variant("u", 0),
                 ExecMainStatus=Variant("i", 9), ExecMainCode=Variant("i", 2)),
        _changed(UNIT_IFACE, ActiveState=Variant("s", "activating"),
                 SubState=Variant("s", "auto-restart")),
        # the restart, read in the same batch
        _changed(SERVICE_IFACE, Result=Variant("s", "success"), MainPID=Variant("u", 4343),
                 ExecMainStatus=Variant("i", 0), ExecMainCode=Variant("i", 0),
                 NRestarts=Variant("u", 3)),
        _changed(UNIT_IFACE, ActiveState=Variant("s", "active"), SubState=Variant("s", "running")),
    ):
        units._on_message(message)
    await until(lambda: seen and seen[-1].sub_state == "running", what="the restarted state")
    assert [(s.sub_state, s.result, s.exec_main_status, s.main_pid, s.n_restarts)
            for s in seen] == [("auto-restart", "signal", 9, 0, 2),
                               ("running", "success", 0, 4343, 3)]


async def test_job_watch_fails_when_the_bus_goes() -> None:
    watch = _JobWatch("gpud-serve-x.service")
    waiter = asyncio.ensure_future(watch.wait("/org/freedesktop/systemd1/job/1"))
    await until(lambda: waiters(watch.changed) == 1, what="the job's waiter")
    watch.fail(Unavailable("gone"))
    with pytest.raises(Unavailable):
        await asyncio.wait_for(waiter, 1)


async def test_unconnected_adapter_is_unavailable_not_crashing() -> None:
    units = SystemdUnits("unix:path=/nonexistent/gpud-test-bus", reconnect_delays=(30,))
    await units.connect()
    try:
        assert not units.available
        assert units.reason is not None and "system bus" in units.reason
        spec = UnitSpec(serve="x", argv=("/bin/true",), device_index=0, description="x")
        with pytest.raises(Unavailable):
            await units.start(spec, timeout=1)
        with pytest.raises(Unavailable):
            await units.list_serves()
    finally:
        await units.close()


def test_a_fronted_serve_gets_its_mask_and_a_fresh_socket() -> None:
    spec = UnitSpec(serve="ocr", argv=("/usr/bin/vllm", "serve", "m"), device_index=0,
                    description="d", umask=0o007, socket="/run/gpud/serves/ocr.sock")
    props = {n: (sig, v) for n, sig, v in _triples(build_properties(spec, 252))}
    assert props["UMask"] == ("u", 0o007)
    assert props["ExecStartPre"] == ("a(sasb)", [
        ("/bin/rm", ["/bin/rm", "-f", "--", "/run/gpud/serves/ocr.sock"], False)])
    assert not {"UMask", "ExecStartPre"} & {n for n, _s, _v in _triples(build_properties(SPEC, 252))}
