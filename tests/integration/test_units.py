"""gpud.host.units against a real systemd (252 on Debian 12) and a real system bus, in the sandbox.

The adapter must run where the system bus socket is, inside the sandbox. So this file is also
the driver: each test runs ``python3 THIS_FILE SCENARIO`` inside the sandbox, the scenario
drives ``SystemdUnits`` there and prints one JSON line of findings, and the test asserts on
them. Every scenario stops the units it started, whatever happens.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from gpud.core.unitstate import UnitState  # noqa: E402
from gpud.errors import BadRequest, Conflict, GpudError  # noqa: E402
from gpud.host.unit_properties import UnitSpec  # noqa: E402
from gpud.host.units import JobFailed, SystemdUnits  # noqa: E402
from tools.sandbox import Sandbox  # noqa: E402

# The serve stand-in: appends its argv (after the output path) and a few environment variables
# as one JSON line to the file named by argv[1], then sleeps. No '$' and no ';' in it: those are
# exactly what systemd 252 refuses to keep across a daemon-reload.
RECORDER = "\n".join(
    [
        "import json, os, sys, time",
        "record = {'argv': sys.argv[2:], 'env': {k: os.environ.get(k) for k in",
        "    ('CUDA_DEVICE_ORDER', 'CUDA_VISIBLE_DEVICES', 'NOTE', 'HOME')}}",
        "with open(sys.argv[1], 'a') as out:",
        "    out.write(json.dumps(record) + chr(10))",
        "time.sleep(3600)",
    ]
)
# Survive 252's transient-file round trip: quotes, specifiers, spaces, backslashes, control chars.
HOSTILE = ["%n", "%%", "a b", "\"q'", "back\\slash", "tab\there", "new\nline", "", "--x=y"]
# Reach the process literally at the first exec, but 252 alters them after a daemon-reload.
DOLLAR_AND_SEMICOLON = ["$HOME", "${HOME}", "$$", ";", "a;b", "\\$X"]


# --- the host side ------------------------------------------------------------------------


def _drive(sandbox: Sandbox, scenario: str, timeout: float = 90) -> dict[str, Any]:
    result = sandbox.run(
        [sys.executable, str(Path(__file__).resolve()), scenario],
        env={"PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1"},
        check=False,
        timeout=timeout,
    )
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 0 and lines, (
        f"scenario {scenario} failed (rc {result.returncode}):\n"
        f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-4000:]}"
    )
    found: dict[str, Any] = json.loads(lines[-1])
    return found


def test_start_state_cgroup_and_literal_argv(sandbox: Sandbox) -> None:
    found = _drive(sandbox, "start")
    assert found["systemd_version"] >= 252
    started = found["started"]
    assert started["active_state"] == "active" and started["sub_state"] == "running"
    assert started["main_pid"] > 0 and started["n_restarts"] == 0
    assert started["control_group"] == "/gpud.slice/gpud-serve-it-start.service"
    assert found["proc_cgroup"] == "0::/gpud.slice/gpud-serve-it-start.service"
    assert found["records"][0]["argv"] == HOSTILE
    env = found["records"][0]["env"]
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" and env["CUDA_VISIBLE_DEVICES"] == "3"
    assert env["NOTE"] == "$HOME; %n"  # Environment= values are not expanded either
    assert found["journal_identifier"] == "gpud-serve-it-start"
    assert found["state_after_stop"] is None


def test_dollar_and_semicolon_reach_the_process_literally(sandbox: Sandbox) -> None:
    found = _drive(sandbox, "dollar")
    # the $$ encoding works on every version at the first exec ...
    assert found["first_exec"] == DOLLAR_AND_SEMICOLON
    if found["systemd_version"] <= 252:
        # ... but 252 refuses to keep it across a daemon-reload, so gpud refuses it there
        assert found["refused"] is not None and "daemon-reload" in found["refused"]
        assert found["after_reload"] != DOLLAR_AND_SEMICOLON
    else:
        assert found["refused"] is None


def test_command_survives_daemon_reload(sandbox: Sandbox) -> None:
    found = _drive(sandbox, "reload")
    # ExecStartEx would leave the unit 'bad-setting' here and the restart would fail
    assert found["load_state_after_reload"] == "loaded"
    assert found["n_restarts"] >= 1
    assert [r["argv"] for r in found["records"]] == [HOSTILE, HOSTILE]


def test_watch_sees_running_then_a_restart_after_kill(sandbox: Sandbox) -> None:
    found = _drive(sandbox, "watch")
    seen = found["seen"]
    # The first run: running, after at most its start (a watch reports each state it reads,
    # systemd's "activating" of the start included when the signals come apart).
    first = next(i for i, s in enumerate(seen) if s["sub_state"] == "running")
    assert all(s["active_state"] == "activating" for s in seen[:first]), seen
    assert seen[first]["active_state"] == "active" and seen[first]["n_restarts"] == 0
    first_pid = seen[first]["main_pid"]
    after = [s for s in seen if s["n_restarts"] >= 1 and s["sub_state"] == "running"]
    assert after, f"no restarted state seen: {seen}"
    assert after[0]["main_pid"] not in (0, first_pid)
    assert after[0]["invocation_id"] != seen[first]["invocation_id"]
    # the crash itself is visible between the two: the kill, then systemd's restart wait
    assert any(s["result"] == "signal" and s["exec_main_status"] == 9 for s in seen)
    assert seen[-1]["active_state"] == "inactive"  # the stop, seen before the unit went away
    assert found["signals_only"], "the watch must not poll"


def test_second_start_is_a_conflict_and_stop_is_idempotent(sandbox: Sandbox) -> None:
    found = _drive(sandbox, "conflict")
    assert found["second_start"] == "Conflict"
    assert "never starts a second copy" in found["conflict_message"]
    assert found["units_named_like_it"] == 1
    assert found["same_pid_after_conflict"]
    assert found["stops"] == ["ok", "ok", "ok"]
    assert found["state_after_stop"] is None


def test_list_serves_finds_only_gpud_serves(sandbox: Sandbox) -> None:
    found = _drive(sandbox, "list")
    assert found["listed"] == ["gpud-serve-it-list-a.service", "gpud-serve-it-list-b.service"]
    assert found["listed_after_stop"] == []


def test_failed_start_leaves_no_unit(sandbox: Sandbox) -> None:
    found = _drive(sandbox, "failed_start")
    assert found["error"] == "JobFailed" and found["result"] == "failed"
    assert found["state_after"] is None
    assert found["refused_property"] == "BadRequest"
    assert "Invalid Restart setting" in found["refused_message"]
    assert found["state_after_refusal"] is None
    assert found["unknown_user"] == "failed"
    assert found["state_after_unknown_user"] is None


def test_reconnects_after_the_bus_restarts(sandbox: Sandbox) -> None:
    found = _drive(sandbox, "bus_restart", timeout=120)
    assert found["went_unavailable"]
    assert found["connects"] == 2
    assert found["resync_units"] == ["gpud-serve-it-bus.service"]
    assert found["seconds_to_resync"] < 15
    # signals flow over the new connection: a crash after the restart is seen
    assert found["restart_seen_after_reconnect"]
    # daemon-reexec: systemd keeps its subscribers; the adapter follows the new owner
    assert found["restart_seen_after_reexec"]


# --- the sandbox side: scenarios ----------------------------------------------------------


def _spec(serve: str, args: list[str], out: str, **kw: Any) -> UnitSpec:
    fields: dict[str, Any] = {
        "serve": serve,
        "argv": (sys.executable, "-c", RECORDER, out, *args),
        "device_index": 0,
        "description": f"gpud integration test {serve}",
        "restart_sec": 0.2,
        "timeout_stop_sec": 5,
    }
    fields.update(kw)
    return UnitSpec(**fields)


def _records(path: str, count: int, timeout: float = 10) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            lines = Path(path).read_text().splitlines()
        except FileNotFoundError:
            lines = []
        if len(lines) >= count or time.monotonic() > deadline:
            return [json.loads(line) for line in lines]
        time.sleep(0.05)


async def _until(check: Callable[[], bool], timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


def _state(state: UnitState | None) -> dict[str, Any] | None:
    return None if state is None else dict(state.__dict__)


def _sh(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


async def scenario_start(units: SystemdUnits) -> dict[str, Any]:
    out = "/tmp/it-start.jsonl"
    spec = _spec("it-start", HOSTILE, out, device_index=3, environment={"NOTE": "$HOME; %n"})
    try:
        started = await units.start(spec, timeout=10)
        records = _records(out, 1)
        # the unified (v2) line; a hybrid host lists its v1 hierarchies too
        proc_cgroup = next(
            line
            for line in Path(f"/proc/{started.main_pid}/cgroup").read_text().splitlines()
            if line.startswith("0::")
        )
        identifier = _sh("systemctl", "show", "-p", "SyslogIdentifier", "--value", spec.unit).strip()
    finally:
        await units.stop("it-start", timeout=10)
    return {
        "systemd_version": units.systemd_version,
        "started": _state(started),
        "records": records,
        "proc_cgroup": proc_cgroup,
        "journal_identifier": identifier,
        "state_after_stop": _state(await units.state("it-start")),
    }


async def scenario_dollar(units: SystemdUnits) -> dict[str, Any]:
    out = "/tmp/it-dollar.jsonl"
    spec = _spec("it-dollar", DOLLAR_AND_SEMICOLON, out)
    refused = None
    try:
        await units.start(spec, timeout=10)
    except BadRequest as exc:
        refused = exc.message
    version = units.systemd_version
    if refused is not None:
        # Show why: pretend to be a newer systemd, so the $$ encoding goes out anyway.
        units._systemd_version = 999
        await units.start(spec, timeout=10)
    try:
        first = _records(out, 1)[0]["argv"]
        _sh("systemctl", "daemon-reload")
        state = await units.state("it-dollar")
        assert state is not None
        os.kill(state.main_pid, 9)
        records = _records(out, 2)
    finally:
        units._systemd_version = version
        await units.stop("it-dollar", timeout=10)
    return {
        "systemd_version": version,
        "refused": refused,
        "first_exec": first,
        "after_reload": records[1]["argv"] if len(records) > 1 else None,
    }


async def scenario_reload(units: SystemdUnits) -> dict[str, Any]:
    out = "/tmp/it-reload.jsonl"
    try:
        await units.start(_spec("it-reload", HOSTILE, out), timeout=10)
        _records(out, 1)
        _sh("systemctl", "daemon-reload")
        load_state = _sh(
            "systemctl", "show", "-p", "LoadState", "--value", "gpud-serve-it-reload.service"
        ).strip()
        state = await units.state("it-reload")
        assert state is not None
        os.kill(state.main_pid, 9)
        records = _records(out, 2)
        after = await units.state("it-reload")
    finally:
        await units.stop("it-reload", timeout=10)
    return {
        "load_state_after_reload": load_state,
        "records": records,
        "n_restarts": after.n_restarts if after else -1,
    }


async def scenario_watch(units: SystemdUnits) -> dict[str, Any]:
    seen: list[UnitState] = []
    units.watch(lambda s: seen.append(s) if s.serve == "it-watch" else None)
    calls: list[str] = []
    original = units._call

    async def counting(*args: Any, **kw: Any) -> list[Any]:
        calls.append(args[2])
        return await original(*args, **kw)

    units._call = counting  # type: ignore[method-assign]
    try:
        started = await units.start(_spec("it-watch", [], "/tmp/it-watch.jsonl"), timeout=10)
        await _until(lambda: any(s.sub_state == "running" for s in seen))
        os.kill(started.main_pid, 9)
        await _until(lambda: any(s.n_restarts >= 1 and s.sub_state == "running" for s in seen))
    finally:
        await units.stop("it-watch", timeout=10)
    await _until(lambda: bool(seen) and seen[-1].active_state == "inactive", timeout=5)
    return {
        "seen": [_state(s) for s in seen],
        # two GetAll (Unit, Service) after start, per new invocation and once per unit first
        # seen, plus slack: a polling loop would make dozens
        "signals_only": calls.count("GetAll") <= 8,
    }


async def scenario_conflict(units: SystemdUnits) -> dict[str, Any]:
    spec = _spec("it-conflict", [], "/tmp/it-conflict.jsonl")
    stops: list[str] = []
    try:
        first = await units.start(spec, timeout=10)
        try:
            await units.start(spec, timeout=10)
            second = "started"
        except Conflict as exc:
            second = "Conflict"
            conflict_message = exc.message
        listed = _sh("systemctl", "list-units", "--all", "--no-legend", "--plain", "gpud-serve-*")
        again = await units.state("it-conflict")
    finally:
        for _ in range(2):
            await units.stop("it-conflict", timeout=10)
            stops.append("ok")
    await units.stop("it-never-started", timeout=10)
    stops.append("ok")
    return {
        "second_start": second,
        "conflict_message": conflict_message if second == "Conflict" else None,
        "units_named_like_it": sum(1 for line in listed.splitlines() if "gpud-serve-it-conflict" in line),
        "same_pid_after_conflict": again is not None and again.main_pid == first.main_pid,
        "stops": stops,
        "state_after_stop": _state(await units.state("it-conflict")),
    }


async def scenario_list(units: SystemdUnits) -> dict[str, Any]:
    try:
        for name in ("it-list-b", "it-list-a"):
            await units.start(_spec(name, [], f"/tmp/{name}.jsonl"), timeout=10)
        # a unit that only looks similar is not gpud's
        _sh("systemd-run", "--unit", "gpud-servex.service", "/bin/sleep", "600")
        listed = [s.unit for s in await units.list_serves() if s.serve.startswith("it-list")]
        others = [s.unit for s in await units.list_serves() if not s.serve.startswith("it-")]
    finally:
        for name in ("it-list-a", "it-list-b"):
            await units.stop(name, timeout=10)
        _sh("systemctl", "stop", "gpud-servex.service")
    after = [s.unit for s in await units.list_serves() if s.serve.startswith("it-list")]
    return {"listed": listed, "others": others, "listed_after_stop": after}


async def scenario_failed_start(units: SystemdUnits) -> dict[str, Any]:
    spec = UnitSpec(serve="it-fail", argv=("/nonexistent/serve",), device_index=0, description="fails")
    found: dict[str, Any] = {}
    try:
        await units.start(spec, timeout=10)
        found["error"] = None
    except JobFailed as exc:
        found["error"] = type(exc).__name__
        found["result"] = exc.details["result"]
    found["state_after"] = _state(await units.state("it-fail"))
    # systemd refuses the property itself: the spec is at fault, nothing was created
    bogus = UnitSpec(
        serve="it-fail-prop",
        argv=("/bin/true",),
        device_index=0,
        description="x",
        restart="sometimes",  # type: ignore[arg-type]
    )
    try:
        await units.start(bogus, timeout=10)
        found["refused_property"] = None
    except GpudError as exc:
        found["refused_property"] = type(exc).__name__
        found["refused_message"] = exc.message
    found["state_after_refusal"] = _state(await units.state("it-fail-prop"))
    # an unknown user: accepted as a property, the start job fails, no unit stays
    nobody = UnitSpec(
        serve="it-fail-user",
        argv=("/bin/true",),
        device_index=0,
        description="x",
        user="gpud-no-such-user",
    )
    try:
        await units.start(nobody, timeout=10)
        found["unknown_user"] = None
    except JobFailed as exc:
        found["unknown_user"] = exc.details["result"]
    found["state_after_unknown_user"] = _state(await units.state("it-fail-user"))
    return found


async def scenario_bus_restart(units: SystemdUnits) -> dict[str, Any]:
    seen: list[UnitState] = []
    resyncs: list[tuple[float, list[str]]] = []
    units.watch(
        lambda s: seen.append(s) if s.serve == "it-bus" else None,
        lambda states: resyncs.append((time.monotonic(), [s.unit for s in states])),
    )
    # Recorded, not polled: the adapter may be back within a poll interval.
    reasons: list[str] = []
    mark_unavailable = units._mark_unavailable

    def recording(reason: str) -> None:
        reasons.append(reason)
        mark_unavailable(reason)

    units._mark_unavailable = recording  # type: ignore[method-assign]
    found: dict[str, Any] = {}
    try:
        await units.start(_spec("it-bus", [], "/tmp/it-bus.jsonl"), timeout=10)
        restarted = time.monotonic()
        _sh("systemctl", "restart", "dbus.service")
        await _until(lambda: bool(resyncs), 30)
        found["went_unavailable"] = any("connection" in reason for reason in reasons)
        found["unavailable_reasons"] = reasons
        found["connects"] = units.connects
        found["resync_units"] = [u for u in resyncs[0][1] if "it-" in u] if resyncs else None
        found["seconds_to_resync"] = resyncs[0][0] - restarted if resyncs else None
        found["restart_seen_after_reconnect"] = await _kill_and_see_restart(units, seen, 1)
        _sh("systemctl", "daemon-reexec")
        await _until(lambda: len(resyncs) >= 2, 15)
        found["restart_seen_after_reexec"] = await _kill_and_see_restart(units, seen, 2)
    finally:
        await units.stop("it-bus", timeout=10)
    return found


async def _kill_and_see_restart(units: SystemdUnits, seen: list[UnitState], n: int) -> bool:
    state = await units.state("it-bus")
    if state is None:
        return False
    os.kill(state.main_pid, 9)
    return await _until(lambda: any(s.n_restarts >= n and s.sub_state == "running" for s in seen))


SCENARIOS: dict[str, Callable[[SystemdUnits], Awaitable[dict[str, Any]]]] = {
    "start": scenario_start,
    "dollar": scenario_dollar,
    "reload": scenario_reload,
    "watch": scenario_watch,
    "conflict": scenario_conflict,
    "list": scenario_list,
    "failed_start": scenario_failed_start,
    "bus_restart": scenario_bus_restart,
}


async def _main(name: str) -> None:
    units = SystemdUnits()
    await units.connect()
    try:
        if not units.available:
            raise SystemExit(f"system bus unavailable: {units.reason}")
        found = await SCENARIOS[name](units)
    finally:
        await units.close()
    print(json.dumps(found))


if __name__ == "__main__":
    asyncio.run(_main(sys.argv[1]))
