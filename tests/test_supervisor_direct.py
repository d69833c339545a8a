"""The supervisor's decisions without a daemon or systemd (the rig: tests/rig.py): start,
stop, reconciliation, boot, unit signals, resync after a bus reconnect, and health."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import stat
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from gpud.config import parse_config
from gpud.core.health import Answer, Probe
from gpud.core.lifecycle import Phase, StartAsked
from gpud.core.serverecord import Happened
from gpud.core.unitstate import UnitState
from gpud.core.vocab import ADMITTED, DECLARED, DENIED, FAILED, ORPHAN, RUNNING, STARTING, STOPPING
from gpud.errors import BadRequest, Conflict, Denied, JobFailed, NotFound, Unavailable
from gpud.life.supervisor import OUTSIDE_STOP, Handles
from gpud.life.supervisor.health import HttpProbe
from tests.reach import admitted_to
from tests.rig import Clock, Rig, entered, make_rig, unit
from tests.waiting import until, waiters

CONFIG = """
[daemon]
admission = "ledger"
state_dir = "{tmp}"
health_interval_s = {health}
health_failures = 2
crash_loop_restarts = 2
crash_loop_window_s = 600
memory_return_timeout_s = 0

[roles.r]
device = "GPU-sim-0"
capacity_mib = 1000

[roles.other]
device = "GPU-sim-0"
capacity_mib = 500

[serves.a]
role = "r"
vram_mib = 300
resident = true
priority = 10
command = ["/bin/true", "a"]

[serves.b]
role = "r"
vram_mib = 400
restart = "no"
command = ["/bin/true", "b"]

[serves.c]
role = "r"
vram_mib = 200
restart_sec = 0
command = ["/bin/true", "c"]
environment = {{ TOKEN = "s3cret", HF_HOME = "/srv/hf" }}

[serves.big]
role = "r"
vram_mib = 900
resident = true
priority = 20
command = ["/bin/true", "big"]
"""

@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    r = await make_rig(tmp_path, CONFIG)
    async for _ in entered(r):
        yield r


# ---- lifecycle ------------------------------------------------------------------------------


async def test_entering_connects_and_sets_the_services_hooks(tmp_path: Path) -> None:
    r = await make_rig(tmp_path, CONFIG)
    assert r.svc.launching() == (False, "launching is not set up in this gpud")
    async with r.sup:
        assert r.units.connected
        assert r.svc.launching() == (True, None)
        r.units.available, r.units.reason = False, "no bus here"
        assert r.svc.launching() == (False, "system bus: no bus here")
    assert r.units.closed
    assert not r.sup.runtime.tasks  # the unit and health loops were cancelled on the way out
    r.svc.close()
    r.svc.store.close()


# ---- start ----------------------------------------------------------------------------------


async def test_start_admits_launches_and_promotes(rig: Rig) -> None:
    await rig.sup.launch_job.start("a", 7, wait=True)
    assert rig.state("a") == RUNNING
    assert rig.held() == {"a": 300}
    assert rig.kinds("a") == ["admit", "start", "healthy"]
    [spec] = rig.units.started
    assert spec.serve == "a"
    assert spec.argv == ("/bin/true", "a")
    assert spec.description == "gpud serve a (r, 300 MiB)"
    assert spec.environment["GPUD_SIM_DEVICE"] == "GPU-sim-0"  # the simulated backend's
    assert spec.environment_file is None
    assert spec.start_limit_burst == 2 + 3
    assert spec.start_limit_interval_sec == 600
    start = rig.events(kinds=["start"])[0]
    assert start.uid == 7 and start.mib == 300
    assert start.message == "a: started gpud-serve-a.service (MainPID 1001): /bin/true a"
    assert rig.svc.records["a"].main_pid == 1001
    assert not rig.svc.busy("a")


async def test_start_without_wait_returns_once_admitted(rig: Rig) -> None:
    rig.units.start_gate = asyncio.Event()
    await rig.sup.launch_job.start("a", None)
    assert rig.held() == {"a": 300}
    assert rig.svc.busy("a")  # its launch is under way: a plain release is refused
    with pytest.raises(Conflict, match="is already"):
        await rig.sup.launch_job.start("a", None)
    rig.units.start_gate.set()
    await rig.wait_for("healthy", "a")
    assert rig.state("a") == RUNNING


async def test_a_serve_holding_its_reservation_is_started_on_it(rig: Rig) -> None:
    await rig.svc.admit("a", 250)
    await rig.sup.launch_job.start("a", None, wait=True)
    assert rig.held() == {"a": 250}
    assert rig.units.started[0].description == "gpud serve a (r, 250 MiB)"


async def test_the_serves_own_environment_goes_to_a_root_only_file(rig: Rig) -> None:
    await rig.sup.launch_job.start("c", None, wait=True)
    [spec] = rig.units.started
    path = rig.tmp / "env" / "c.env"
    assert spec.environment_file == str(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((rig.tmp / "env").stat().st_mode) == 0o700
    assert "s3cret" in path.read_text()
    # what the serve sets itself is not set again in Environment= (the file's value wins)
    assert "HF_HOME" not in spec.environment
    assert "TOKEN" not in spec.environment


async def test_an_environment_folder_that_cannot_be_made_fails_the_serve(rig: Rig) -> None:
    (rig.tmp / "env").write_text("a file where the folder goes")
    with pytest.raises(Conflict, match="cannot be launched: serve c: cannot make"):
        await rig.sup.launch_job.start("c", None, wait=True)
    assert rig.units.started == []
    assert rig.state("c") == FAILED
    assert rig.held() == {}  # not resident: released


@pytest.mark.parametrize(("serve", "error", "message"), [
    ("nosuch", NotFound, "unknown serve 'nosuch': not in the config"),
    ("Bad Name!", BadRequest, "serve"),
])
async def test_starting_what_is_not_configured(rig: Rig, serve: str, error: type[Exception],
                                               message: str) -> None:
    with pytest.raises(error, match=message):
        await rig.sup.launch_job.start(serve, None)
    assert rig.units.started == []


async def test_an_external_reservation_is_not_launched(rig: Rig) -> None:
    await rig.svc.admit("ext", 10, role="r")
    with pytest.raises(Conflict, match="is an external reservation"):
        await rig.sup.launch_job.start("ext", None)


async def test_a_start_refused_before_anything_is_touched(rig: Rig) -> None:
    rig.figures.sizing["a"] = "calibrated at 500 MiB, reserved 300"
    with pytest.raises(Conflict, match="not started: calibrated at 500 MiB"):
        await rig.sup.launch_job.start("a", None)
    rig.figures.sizing.clear()
    await rig.svc.adopt("b", "other", 100)
    with pytest.raises(Conflict, match="holds 100 MiB on role 'other' but is configured on 'r'"):
        await rig.sup.launch_job.start("b", None)
    await rig.svc.release("b", allow_live=True)
    rig.units.available, rig.units.reason = False, "bus gone"
    with pytest.raises(Unavailable, match="launching is unavailable: system bus: bus gone"):
        await rig.sup.launch_job.start("b", None)
    assert rig.units.started == []
    assert rig.held() == {}


async def test_a_start_on_a_lost_device_is_denied(rig: Rig) -> None:
    (rig.tmp / "sim.json").write_text(json.dumps({"lost": ["GPU-sim-0"]}))
    await rig.observer.sample()
    with pytest.raises(Denied, match="device 'GPU-sim-0' of role 'r' is lost"):
        await rig.sup.launch_job.start("a", None)
    assert rig.held() == {}


async def test_an_executable_not_in_path_fails_the_serve_with_the_reason(rig: Rig,
                                                                         tmp_path: Path) -> None:
    await rig.svc.reload(parse_config(rig.svc.config_text.replace(  # type: ignore[union-attr]
        'command = ["/bin/true", "b"]', 'command = ["no-such-program-of-gpud"]'), "t"),
        rig.svc.config_text or "", source="t")
    with pytest.raises(Conflict, match="executable 'no-such-program-of-gpud' not found in PATH"):
        await rig.sup.launch_job.start("b", None, wait=True)
    assert rig.state("b") == FAILED
    assert rig.held() == {}
    [ev] = rig.events(kinds=["exit"])
    assert ev.details["reservation"] == "released"


async def test_a_relative_executable_is_found_in_path(rig: Rig) -> None:
    text = rig.svc.config_text or ""
    text = text.replace('command = ["/bin/true", "b"]', 'command = ["true", "b"]')
    await rig.svc.reload(parse_config(text, "t"), text, source="t")
    await rig.sup.launch_job.start("b", None, wait=True)
    assert rig.units.started[0].argv[0].endswith("/true")
    assert rig.units.started[0].argv[0].startswith("/")


async def test_without_observation_no_device_is_handed_out(tmp_path: Path) -> None:
    r = await make_rig(tmp_path, CONFIG, observed=False)
    async for _ in entered(r):
        with pytest.raises(Conflict, match="observation is unavailable, so gpud cannot tell "
                                           "that device 'GPU-sim-0' exists"):
            await r.sup.launch_job.start("a", None, wait=True)
        assert r.units.started == []
        assert r.state("a") == FAILED
        assert r.held() == {"a": 300}  # resident: kept


@pytest.mark.parametrize(("serve", "kept"), [("a", {"a": 300}), ("b", {})])
async def test_a_unit_that_systemd_will_not_start_fails_the_serve(rig: Rig, serve: str,
                                                                 kept: dict[str, int]) -> None:
    rig.units.fail_start = JobFailed("job for gpud-serve-x.service ended 'failed'")
    await rig.sup.launch_job.start(serve, None, wait=True)
    assert rig.state(serve) == FAILED
    assert rig.reason(serve) == "launch failed: job for gpud-serve-x.service ended 'failed'"
    assert rig.held() == kept  # a resident serve keeps its reservation, another releases it
    assert not rig.svc.busy(serve)


async def test_a_serve_that_never_answers_fails_at_its_start_timeout(tmp_path: Path) -> None:
    clock = Clock()
    r = await make_rig(tmp_path, CONFIG, clock=clock, extra="")
    text = (r.svc.config_text or "").replace('restart = "no"', 'restart = "no"\nstart_timeout_s = 5')
    await r.svc.reload(parse_config(text, "t"), text, source="t")

    def refused() -> Answer:
        clock.now += 1.0  # each check takes a second of the test's clock
        return Answer(Probe.REFUSED, "cannot connect")

    r.sup.answers["b"] = refused
    async for _ in entered(r):
        await r.sup.launch_job.start("b", None, wait=True)
        assert r.state("b") == FAILED
        assert r.reason("b") == "unhealthy: no 200 from /health within 5 s"
        assert r.sup.asked["b"] == 5
        assert r.units.stopped == ["b"] and r.units.reset == ["b"]
        assert r.held() == {}


async def test_a_foreign_answer_is_named_when_the_start_times_out(tmp_path: Path) -> None:
    clock = Clock()
    r = await make_rig(tmp_path, CONFIG, clock=clock)
    text = (r.svc.config_text or "").replace('restart = "no"', 'restart = "no"\nstart_timeout_s = 2')
    await r.svc.reload(parse_config(text, "t"), text, source="t")

    def foreign() -> Answer:
        clock.now += 1.0
        return Answer(Probe.FOREIGN, "port 1 is held by PID 9 (x), not by the serve's unit")

    r.sup.answers["b"] = foreign
    async for _ in entered(r):
        await r.sup.launch_job.start("b", None, wait=True)
        assert r.reason("b") == ("unhealthy: no 200 from /health within 2 s; port 1 is held by "
                                 "PID 9 (x), not by the serve's unit")


async def test_a_failed_stop_at_the_start_timeout_keeps_the_reservation(tmp_path: Path) -> None:
    clock = Clock()
    r = await make_rig(tmp_path, CONFIG, clock=clock)
    text = (r.svc.config_text or "").replace('restart = "no"', 'restart = "no"\nstart_timeout_s = 1')
    await r.svc.reload(parse_config(text, "t"), text, source="t")

    def refused() -> Answer:
        clock.now += 2.0
        return Answer(Probe.REFUSED, "x")

    r.sup.answers["b"] = refused
    r.units.fail_stop = JobFailed("stop job failed")
    async for _ in entered(r):
        await r.sup.launch_job.start("b", None, wait=True)
        assert r.state("b") == FAILED
        assert r.held() == {"b": 400}  # its process may still hold the memory
        [ev] = r.events(kinds=["unhealthy"])
        assert ev.details["reservation"] == "kept (its unit may still be active)"


async def test_a_serve_whose_port_is_held_is_not_started(rig: Rig) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        text = (rig.svc.config_text or "").replace('command = ["/bin/true", "b"]',
                                                    f'command = ["/bin/true", "b"]\nport = {port}')
        await rig.svc.reload(parse_config(text, "t"), text, source="t")
        with pytest.raises(Conflict, match=f"serve 'b': port {port} is already held by") as err:
            await rig.sup.launch_job.start("b", None)
        assert err.value.details["port"] == port and err.value.details["holders"]
    assert rig.held() == {}
    assert rig.units.started == []
    [ev] = [e for e in rig.events(serves=["b"]) if e.kind == "start"]
    assert ev.details["ok"] is False and ev.details["port"] == port
    assert ev.message.startswith(f"b: not started: port {port} is already held by")


async def test_a_port_taken_in_the_start_window_is_named_at_the_start_timeout(
        tmp_path: Path) -> None:
    """A listener that is not the serve's and answers no 200 (refused or failing health
    answers all along): the failure names who holds the port."""
    clock = Clock()
    r = await make_rig(tmp_path, CONFIG, clock=clock)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        text = (r.svc.config_text or "").replace(
            'restart = "no"', f'restart = "no"\nstart_timeout_s = 2\nport = {port}')
        await r.svc.reload(parse_config(text, "t"), text, source="t")

        def failing() -> Answer:
            clock.now += 1.0
            return Answer(Probe.FAILED, "status 404")

        r.sup.answers["b"] = failing
        async for _ in entered(r):
            r.sup.units.available = True
            await r.svc.admit("b", 400)
            unit_spec = r.sup.launch_job.unit_spec("b", r.svc.config.serves["b"])
            r.sup.runtime.step("b", StartAsked())
            await r.sup.launch_job._launch("b", None, unit_spec)  # the port was free when it was asked
            reason = r.reason("b") or ""
            assert reason.startswith(f"unhealthy: no 200 from /health within 2 s; port {port} is "
                                     "held by "), reason
            assert reason.endswith("not by the serve's unit"), reason


# ---- stop -----------------------------------------------------------------------------------


async def test_stop_stops_the_unit_and_releases(rig: Rig) -> None:
    await rig.sup.launch_job.start("a", None, wait=True)
    await rig.sup.stop_job.stop("a", 3)
    assert rig.units.stopped == ["a"] and rig.units.reset == ["a"]
    assert rig.held() == {}
    assert rig.state("a") == DECLARED
    stop = rig.events(kinds=["stop"])[0]
    assert stop.message == "a: stopping (was running)" and stop.uid == 3
    assert rig.kinds("a")[-2:] == ["stop", "release"]


async def test_stop_keeping_the_reservation(rig: Rig) -> None:
    await rig.sup.launch_job.start("a", None, wait=True)
    await rig.sup.stop_job.stop("a", None, keep_reservation=True)
    assert rig.held() == {"a": 300}
    assert rig.state("a") == ADMITTED
    assert rig.events(kinds=["exit"])[-1].message == "a: stopped"


async def test_stop_of_a_serve_holding_nothing(rig: Rig) -> None:
    await rig.svc.store_event(rig.svc.event("exit", "b failed", serve="b"),
                              report=rig.svc.report("b", Happened.FAILED))
    rig.units.available = False  # not live: no unit to stop, no bus needed
    await rig.sup.stop_job.stop("b", None)
    assert rig.units.stopped == []
    assert rig.state("b") == DECLARED


async def test_a_failed_stop_stays_stopping_until_the_unit_ends(rig: Rig) -> None:
    await rig.sup.launch_job.start("a", None, wait=True)
    st = rig.units.live["a"]
    rig.units.fail_stop = JobFailed("stop gpud-serve-a.service: timed out")
    with pytest.raises(JobFailed):
        await rig.sup.stop_job.stop("a", 3)
    # Its unit still runs: the memory may still be held, so is the reservation.
    assert rig.held() == {"a": 300}
    assert rig.state("a") == STOPPING
    assert rig.reason("a") == "stop failed: stop gpud-serve-a.service: timed out"
    failed = rig.events(kinds=["stop"])[-1]
    assert failed.details["ok"] is False and "stays stopping" in failed.message
    mark = rig.last_id()
    rig.units.live.pop("a")
    rig.units.emit(replace(st, active_state="failed", sub_state="failed", result="timeout"))
    ev = await rig.wait_for("release", "a", after=mark)
    assert ev.message.startswith("a released 300 MiB on r (stopped); ")
    assert rig.held() == {} and rig.state("a") == DECLARED
    assert "since its stop gave up waiting" in rig.events(kinds=["exit"])[-1].message


async def test_a_failed_stop_whose_unit_ended_all_the_same_completes(rig: Rig) -> None:
    await rig.sup.launch_job.start("a", None, wait=True)
    rig.units.fail_stop = JobFailed("stop job finished with result 'canceled'")
    rig.units.live.pop("a")  # systemd says: no such unit any more
    await rig.sup.stop_job.stop("a", None)
    assert rig.held() == {} and rig.state("a") == DECLARED
    assert rig.kinds("a")[-2:] == ["stop", "release"]


async def test_a_failed_stop_whose_unit_ended_meanwhile_completes(rig: Rig) -> None:
    """The unit's end comes while the stop is under way (its signal unheeded), after the first
    look: the stop's last look finds it."""
    await rig.sup.launch_job.start("a", None, wait=True)
    rig.units.fail_stop = JobFailed("no")
    looks = 0
    real_state = rig.units.state

    async def state(serve: str) -> UnitState | None:
        nonlocal looks
        looks += 1
        if looks == 2:
            rig.units.live.pop(serve, None)
        return await real_state(serve)

    rig.units.state = state  # type: ignore[method-assign]
    with pytest.raises(JobFailed):
        await rig.sup.stop_job.stop("a", None)
    assert rig.held() == {} and rig.state("a") == DECLARED


async def test_stopping_a_live_serve_needs_the_bus(rig: Rig) -> None:
    await rig.sup.launch_job.start("a", None, wait=True)
    rig.units.available, rig.units.reason = False, "gone"
    with pytest.raises(Unavailable):
        await rig.sup.stop_job.stop("a", None)
    assert rig.held() == {"a": 300}
    assert rig.state("a") == RUNNING


async def orphan(rig: Rig, serve: str) -> None:
    await rig.svc.store_event(rig.svc.event("adopt", f"{serve}: an orphan", serve=serve),
                              report=rig.svc.report(serve, Happened.FOUND_ORPHAN))


async def test_stop_of_an_orphan(rig: Rig) -> None:
    await orphan(rig, "stray")
    await rig.sup.stop_job.stop("stray", None)
    assert rig.units.stopped == ["stray"]
    assert rig.state("stray") == DECLARED
    assert rig.events(kinds=["stop"])[0].message == "stray: orphan unit stopped"


async def test_a_stop_cancels_a_launch_queued_behind_another(rig: Rig) -> None:
    rig.units.start_gate = asyncio.Event()
    await rig.sup.launch_job.start("a", None)  # holds the device: its unit's start does not return yet
    await rig.sup.launch_job.start("c", None)  # queued behind it on the same device
    await rig.sup.stop_job.stop("c", None)
    assert rig.held() == {"a": 300}
    rig.units.start_gate.set()
    await rig.wait_for("healthy", "a")
    # The stop waited for c's cancelled launch to end: nothing is left that could start it.
    assert [s.serve for s in rig.units.started] == ["a"]  # c's unit never started
    assert rig.state("c") == DECLARED
    assert not rig.svc.busy("c")


async def test_a_serves_record_holds_its_launch_while_it_runs_and_nothing_after(
        rig: Rig) -> None:
    rig.units.start_gate = asyncio.Event()
    await rig.sup.launch_job.start("a", None)
    await rig.sup.launch_job.start("c", None)  # queued behind a on the device
    for serve in ("a", "c"):
        assert rig.sup.runtime.life(serve).phase is Phase.LAUNCHING
        assert rig.sup.runtime.serves[serve].launch_task is not None
    await rig.sup.stop_job.stop("c", None)
    # the stop cancelled c's launch and is over: what is left of c is where its memory goes
    c, life = rig.sup.runtime.serves.get("c", Handles()), rig.sup.runtime.life("c")  # no handles: none kept
    assert (c.launch_task, c.stop_done, c.check) == (None, None, None)
    assert life.phase is Phase.IDLE and life.unit is None
    assert life.returning == {"GPU-sim-0"}
    rig.units.start_gate.set()
    await rig.wait_for("healthy", "a")
    await until(lambda: rig.sup.runtime.serves.get("a", Handles()).launch_task is None,
                what="a's launch to end")
    assert rig.sup.runtime.life("a").phase is Phase.IDLE
    assert rig.sup.runtime.life("a").unit is not None  # its unit as last seen


async def test_restart_keeps_the_reservation_and_starts_again(rig: Rig) -> None:
    await rig.sup.launch_job.start("a", None, wait=True)
    await rig.sup.restart("a", None)
    await rig.wait_for("healthy", "a", after=rig.events(kinds=["exit"])[-1].id or 0)
    assert rig.state("a") == RUNNING
    assert rig.held() == {"a": 300}
    assert [s.serve for s in rig.units.started] == ["a", "a"]


# ---- reconciliation and boot ----------------------------------------------------------------


async def test_reconcile_without_the_bus_is_skipped(rig: Rig,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    rig.units.available, rig.units.reason = False, "no bus"
    rig.units.live["a"] = unit("a")
    with caplog.at_level(logging.WARNING, "gpud.supervisor"):
        await rig.sup.boot_job.reconcile()
    assert "reconciliation skipped: system bus unavailable (no bus)" in caplog.text
    assert rig.held() == {}


async def test_reconcile_adopts_running_units(rig: Rig) -> None:
    await admitted_to(rig.svc, "a", 300, RUNNING)
    rig.units.live = {"a": unit("a", pid=11, restarts=2), "c": unit("c", pid=12),
                      "stray": unit("stray", pid=13), "gone": unit("gone", "inactive", "dead")}
    await rig.sup.boot_job.reconcile()
    assert rig.state("a") == RUNNING  # it was running: it stays so
    assert rig.svc.records["a"].main_pid == 11 and rig.svc.records["a"].n_restarts == 2
    assert rig.held() == {"a": 300, "c": 200}  # c adopted at its vram_mib
    assert rig.events(kinds=["admit"])[-1].details["adopted"] is True
    assert rig.state("stray") == ORPHAN
    assert rig.reason("stray") == ("its unit gpud-serve-stray.service runs but the config does "
                                   "not name the serve")
    assert rig.svc.records["stray"].main_pid == 13
    assert "gone" not in rig.svc.records
    await rig.wait_for("healthy", "c")  # adopted while starting: promoted once it answers
    assert rig.state("c") == RUNNING


async def test_reconcile_marks_serves_whose_units_ended_while_away(rig: Rig) -> None:
    await admitted_to(rig.svc, "a", 300, RUNNING)
    await admitted_to(rig.svc, "b", 400, STARTING)
    await rig.sup.boot_job.reconcile()
    assert rig.state("a") == FAILED and rig.state("b") == FAILED
    assert rig.reason("b") == "its unit ended while gpud was not running"
    assert rig.held() == {"a": 300}  # a is resident: kept; b released


async def test_boot_admits_by_priority_then_starts(rig: Rig) -> None:
    await rig.sup.boot_job.boot()
    assert rig.sup.boot_job.booted.is_set()
    assert rig.state("a") == RUNNING
    assert rig.state("big") == DENIED  # 300 + 900 > 1000: recorded with its reason, not started
    assert [s.serve for s in rig.units.started] == ["a"]
    assert rig.held() == {"a": 300}
    assert rig.notes[0].startswith("STATUS=starting resident set: ")
    assert "r 300/1000 MiB committed" in rig.notes[0] and "1 denied" in rig.notes[0]


async def test_boot_leaves_alone_what_runs_or_was_stopped_by_hand(rig: Rig) -> None:
    await rig.svc.store_event(rig.svc.event("exit", "by hand", serve="a"),
                              report=rig.svc.report("a", Happened.STOPPED, OUTSIDE_STOP))
    await admitted_to(rig.svc, "big", 900, RUNNING)
    await rig.sup.boot_job.boot()
    assert rig.units.started == []
    assert rig.state("a") == DECLARED
    assert rig.held() == {"big": 900}


async def test_boot_goes_on_past_a_serve_that_fails_to_start(
        rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    rig.figures.sizing["a"] = "too small"
    text = (rig.svc.config_text or "").replace("vram_mib = 900", "vram_mib = 600")
    await rig.svc.reload(parse_config(text, "t"), text, source="t")
    with caplog.at_level(logging.WARNING, "gpud.supervisor"):
        await rig.sup.boot_job.boot()
    assert "boot: a not started: serve 'a' not started: too small" in caplog.text
    assert rig.state("big") == RUNNING


async def test_boot_without_the_bus_starts_nothing_and_is_done(rig: Rig) -> None:
    rig.units.available, rig.units.reason = False, "no bus"
    await rig.sup.boot_job.boot()
    assert rig.sup.boot_job.booted.is_set()
    assert rig.held() == {}


# ---- unit signals ---------------------------------------------------------------------------


async def running(rig: Rig, serve: str) -> UnitState:
    await rig.sup.launch_job.start(serve, None, wait=True)
    assert rig.state(serve) == RUNNING
    return rig.units.live[serve]


async def test_an_exit_without_restart_fails_and_releases(rig: Rig) -> None:
    st = await running(rig, "b")
    mark = rig.last_id()
    rig.units.emit(replace(st, active_state="failed", sub_state="failed", result="exit-code",
                           exec_main_status=3))
    ev = await rig.wait_for("exit", "b", after=mark)
    assert ev.message == ("b failed: exited (status 3, result exit-code); reservation "
                          "released")
    await rig.wait_for("release", "b", after=mark)
    assert rig.held() == {}
    assert rig.state("b") == FAILED


async def test_an_exit_says_what_the_serve_last_logged(rig: Rig) -> None:
    st = await running(rig, "b")
    asked: list[tuple[str, str | None]] = []

    async def journal(unit: str, invocation: str | None) -> list[str]:
        asked.append((unit, invocation))
        return ["INFO loading", "Traceback (most recent call last):",
                "OSError: /models/b: no such model"]

    rig.sup.stop_job.journal = journal
    mark = rig.last_id()
    rig.units.emit(replace(st, active_state="failed", sub_state="failed", result="exit-code",
                           exec_main_status=1))
    ev = await rig.wait_for("exit", "b", after=mark)
    assert ev.message == ("b failed: exited (status 1, result exit-code); its log: OSError: "
                          "/models/b: no such model; reservation released")
    assert asked == [("gpud-serve-b.service", st.invocation_id)]
    assert rig.reason("b") == ("exited (status 1, result exit-code); its log: OSError: "
                               "/models/b: no such model")


async def test_an_exit_systemd_restarts_is_starting_then_running_again(rig: Rig) -> None:
    st = await running(rig, "a")
    mark = rig.last_id()
    rig.units.emit(replace(st, active_state="activating", sub_state="auto-restart",
                           result="exit-code", exec_main_status=1))
    ev = await rig.wait_for("exit", "a", after=mark)
    assert ev.message == "a: process exited (status 1); systemd restarts it"
    assert rig.state("a") == STARTING
    rig.units.emit(replace(st, n_restarts=1, main_pid=777, invocation_id="inv-2"))
    restart = await rig.wait_for("restart", "a", after=mark)
    assert restart.details["n_restarts"] == 1
    await rig.wait_for("healthy", "a", after=restart.id or 0)
    assert rig.state("a") == RUNNING
    assert rig.held() == {"a": 300}
    assert rig.svc.records["a"].main_pid == 777


async def test_restarts_past_the_limit_are_a_crash_loop(rig: Rig) -> None:
    st = await running(rig, "a")
    mark = rig.last_id()
    rig.units.emit(replace(st, n_restarts=3, invocation_id="inv-9"))
    ev = await rig.wait_for("crash-loop", "a", after=mark)
    assert ev.message.startswith("a failed: crash-loop: 3 restarts in 600 s (limit 2)")
    assert rig.units.stopped == ["a"]
    assert rig.state("a") == FAILED
    assert rig.held() == {"a": 300}  # resident: kept


async def test_systemds_start_limit_is_a_crash_loop(rig: Rig) -> None:
    st = await running(rig, "b")
    mark = rig.last_id()
    rig.units.emit(replace(st, active_state="failed", sub_state="failed",
                           result="start-limit-hit"))
    ev = await rig.wait_for("exit", "b", after=mark)
    assert "crash-loop: systemd's start limit was hit" in ev.message


@pytest.mark.parametrize(("serve", "keep", "policy", "after"), [
    ("b", False, "released", {}),
    ("a", False, "released", {}),
    ("a", True, "kept (resident)", {"a": 300}),
])
async def test_an_operators_stop_is_recorded_as_such(tmp_path: Path, serve: str, keep: bool,
                                                     policy: str, after: dict[str, int]) -> None:
    r = await make_rig(tmp_path, CONFIG)
    text = (r.svc.config_text or "").replace(
        "memory_return_timeout_s = 0",
        f"memory_return_timeout_s = 0\nkeep_resident_on_outside_stop = {str(keep).lower()}")
    await r.svc.reload(parse_config(text, "t"), text, source="t")
    async for _ in entered(r):
        st = await running(r, serve)
        mark = r.last_id()
        r.units.emit(replace(st, active_state="inactive", sub_state="dead", active_exit_us=100, exec_main_exit_us=200))
        ev = await r.wait_for("exit", serve, after=mark)
        assert ev.details["outside"] is True and ev.details["reservation"] == policy
        await r.svc.drain()
        assert r.held() == after
        assert r.reason(serve) == OUTSIDE_STOP
        assert r.state(serve) == (ADMITTED if keep else DECLARED)
        await r.sup.boot_job.boot()  # boot does not start it again until asked
        assert [s.serve for s in r.units.started].count(serve) == 1


async def test_a_stop_at_host_shutdown_is_not_an_operators_stop(rig: Rig) -> None:
    st = await running(rig, "b")
    rig.units.shutdown = True
    mark = rig.last_id()
    rig.units.emit(replace(st, active_state="inactive", sub_state="dead", active_exit_us=100, exec_main_exit_us=200))
    ev = await rig.wait_for("exit", "b", after=mark)
    assert "outside" not in ev.details
    assert rig.reason("b") != OUTSIDE_STOP


async def test_an_orphan_unit_that_ends(rig: Rig) -> None:
    rig.units.live["stray"] = unit("stray")
    await rig.sup.boot_job.reconcile()
    mark = rig.last_id()
    rig.units.emit(unit("stray", "inactive", "dead", status=0))
    ev = await rig.wait_for("exit", "stray", after=mark)
    assert ev.message == "stray: orphan unit ended (status 0)"
    assert rig.state("stray") == DECLARED


async def test_a_failed_serve_whose_unit_ends_releases(rig: Rig) -> None:
    st = await running(rig, "c")
    rig.units.fail_stop = JobFailed("no")
    await rig.sup.stop_job.failed("c", "broken", kind="unhealthy", stop=True)
    assert rig.held() == {"c": 200}  # the unit may still run
    rig.units.fail_stop = None
    mark = rig.last_id()
    rig.units.emit(replace(st, active_state="inactive", sub_state="dead"))
    ev = await rig.wait_for("release", "c", after=mark)
    assert "failed, and its unit has now ended" in ev.message
    assert rig.state("c") == FAILED and rig.reason("c") == "broken"


async def test_a_unit_started_by_hand_is_adopted(rig: Rig) -> None:
    rig.units.emit(unit("c", "inactive", "dead"))
    mark = rig.last_id()
    rig.units.emit(unit("c", pid=555))
    ev = await rig.wait_for("adopt", "c", after=mark)
    assert ev.message == ("c: its unit gpud-serve-c.service was started outside gpud (MainPID "
                          "555): adopted")
    assert rig.held() == {"c": 200}
    await rig.wait_for("healthy", "c")
    assert rig.state("c") == RUNNING


async def test_a_failing_unit_signal_is_logged_and_the_next_one_is_heard(
        rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    st = await running(rig, "b")

    async def broken(*_a: Any, **_k: Any) -> None:
        raise RuntimeError("store on fire")

    real = rig.sup.stop_job.failed
    rig.sup.stop_job.failed = broken  # type: ignore[method-assign]
    await orphan(rig, "stray")
    mark = rig.last_id()
    with caplog.at_level(logging.ERROR, "gpud.supervisor"):
        rig.units.emit(replace(st, active_state="failed", sub_state="failed", result="exit-code"))
        rig.units.emit(unit("stray", "inactive", "dead"))
        await rig.wait_for("exit", "stray", after=mark)  # handled after the one that failed
    assert "handling a unit state change failed" in caplog.text
    rig.sup.stop_job.failed = real  # type: ignore[method-assign]
    rig.units.emit(replace(st, active_state="failed", sub_state="failed", result="exit-code",
                           invocation_id="inv-x"))
    await rig.wait_for("exit", "b", after=mark)
    assert rig.state("b") == FAILED


# ---- after a bus reconnect ------------------------------------------------------------------


async def test_resync_brings_back_a_failed_serve_whose_unit_runs(rig: Rig) -> None:
    st = await running(rig, "a")
    rig.units.available = False
    await rig.sup.stop_job.failed("a", "bus down while it failed", kind="exit")
    rig.units.available = True
    mark = rig.last_id()
    rig.units.resync([st])
    ev = await rig.wait_for("restart", "a", after=mark)
    assert "re-read from systemd after the bus came back" in ev.message
    await rig.wait_for("healthy", "a", after=ev.id or 0)
    assert rig.state("a") == RUNNING


async def test_resync_fails_a_live_serve_whose_unit_is_gone(rig: Rig) -> None:
    await running(rig, "b")
    mark = rig.last_id()
    rig.units.resync([])
    ev = await rig.wait_for("exit", "b", after=mark)
    assert "its unit is gone (seen after the bus came back)" in ev.message
    await rig.wait_for("release", "b", after=mark)
    assert rig.held() == {}


# ---- health of running serves ---------------------------------------------------------------


@pytest.fixture
async def checked(tmp_path: Path) -> AsyncIterator[Rig]:
    r = await make_rig(tmp_path, CONFIG, health=0.01)
    async for _ in entered(r):
        yield r


async def test_a_serve_that_never_answers_says_what_it_logged(tmp_path: Path) -> None:
    """A load that raised in a thread and left the server hanging: the failure names the
    exception and where it was raised, read from the serve's journal."""
    clock = Clock()
    r = await make_rig(tmp_path, CONFIG, clock=clock, extra="")
    text = (r.svc.config_text or "").replace('restart = "no"', 'restart = "no"\nstart_timeout_s = 2')
    await r.svc.reload(parse_config(text, "t"), text, source="t")

    def refused() -> Answer:
        clock.now += 1.0
        return Answer(Probe.REFUSED, "cannot connect")

    async def journal(unit: str, invocation: str | None) -> list[str]:
        return ["Traceback (most recent call last):", '  File "/srv/b.py", line 7, in load',
                "    raise MemoryError()", "MemoryError: no room for the weights",
                "INFO waiting for the loader"]

    r.sup.answers["b"] = refused
    r.sup.stop_job.journal = journal
    async for _ in entered(r):
        await r.sup.launch_job.start("b", None, wait=True)
        assert r.reason("b") == ("unhealthy: no 200 from /health within 2 s; its log: "
                                 "MemoryError: no room for the weights (at /srv/b.py:7 in load)")


def failing(detail: str = "status 500") -> Callable[[], Answer]:
    return lambda: Answer(Probe.FAILED, detail)


async def test_an_unhealthy_serve_is_restarted_through_its_unit(checked: Rig) -> None:
    r = checked
    await running(r, "a")
    mark = r.last_id()
    r.sup.answers["a"] = failing()
    ev = await r.wait_for("unhealthy", "a", after=mark)
    assert ev.message == ("a: unhealthy: 2 health checks in a row failed on /health (last: "
                          "status 500); restarting it through its unit (reservation kept)")
    del r.sup.answers["a"]
    restart = await r.wait_for("restart", "a", after=mark)
    assert restart.details["by"] == "gpud"
    await r.wait_for("healthy", "a", after=restart.id or 0)
    assert r.units.restarted == ["a"]
    assert r.held() == {"a": 300}
    assert r.state("a") == RUNNING


async def test_an_unhealthy_serve_without_restart_is_stopped_and_failed(checked: Rig) -> None:
    r = checked
    await running(r, "b")
    mark = r.last_id()
    r.sup.answers["b"] = failing()
    ev = await r.wait_for("unhealthy", "b", after=mark)
    assert ev.message.startswith("b failed: unhealthy: 2 health checks")
    assert r.units.stopped == ["b"] and r.units.restarted == []
    await r.svc.drain()
    assert r.held() == {}


async def test_unhealthy_without_the_bus_cannot_be_stopped(checked: Rig) -> None:
    r = checked
    await running(r, "c")
    r.units.available, r.units.reason = False, "gone"
    mark = r.last_id()
    r.sup.answers["c"] = failing()
    ev = await r.wait_for("unhealthy", "c", after=mark)
    assert "not stopped: system bus unavailable (gone)" in ev.message
    assert ev.details["reservation"] == "kept (its unit may still be active)"
    assert r.held() == {"c": 200}


async def test_a_restart_that_fails_fails_the_serve(checked: Rig) -> None:
    r = checked
    await running(r, "a")
    r.units.fail_restart = JobFailed("restart job failed")
    mark = r.last_id()
    r.sup.answers["a"] = failing()
    ev = await r.wait_for("unhealthy", "a", after=mark, match="the restart failed")
    assert ev.message.startswith("a failed: unhealthy: 2 health checks in a row failed on "
                                 "/health (last: status 500); the restart failed: restart job "
                                 "failed; reservation kept (resident)")
    assert r.state("a") == FAILED


async def test_a_unit_that_does_not_come_back_after_the_restart(checked: Rig) -> None:
    r = checked
    await running(r, "a")
    r.units.restart_comes_back = False
    mark = r.last_id()
    r.sup.answers["a"] = failing()
    ev = await r.wait_for("exit", "a", after=mark)
    assert "its unit did not come back after the restart" in ev.message
    assert r.state("a") == FAILED


async def test_repeated_unhealthy_restarts_are_a_crash_loop(tmp_path: Path) -> None:
    r = await make_rig(tmp_path, CONFIG, health=0.01)
    text = (r.svc.config_text or "").replace("crash_loop_restarts = 2", "crash_loop_restarts = 1")
    await r.svc.reload(parse_config(text, "t"), text, source="t")
    async for _ in entered(r):
        await running(r, "a")
        mark = r.last_id()
        r.sup.answers["a"] = failing()
        restart = await r.wait_for("restart", "a", after=mark)
        del r.sup.answers["a"]
        healthy = await r.wait_for("healthy", "a", after=restart.id or 0)
        r.sup.answers["a"] = failing()
        ev = await r.wait_for("crash-loop", "a", after=healthy.id or 0)
        assert "crash-loop: 2 restarts in 600 s (limit 1); last: unhealthy" in ev.message
        assert r.units.restarted == ["a"]
        assert r.state("a") == FAILED


async def test_a_failed_serve_whose_unit_still_runs_is_promoted_when_healthy(checked: Rig) -> None:
    r = checked
    await running(r, "a")
    r.sup.answers["a"] = failing()
    r.units.fail_restart = JobFailed("x")
    r.units.fail_stop = JobFailed("y")
    mark = r.last_id()
    ev = await r.wait_for("unhealthy", "a", after=mark, match="the restart failed")
    assert r.state("a") == FAILED
    del r.sup.answers["a"]
    healthy = await r.wait_for("healthy", "a", after=ev.id or 0)
    assert healthy.message.startswith("a: healthy again (was failed: ")
    assert healthy.details["recovered"] is True
    assert r.state("a") == RUNNING


async def test_a_failing_health_round_is_logged_and_checking_goes_on(
        checked: Rig, caplog: pytest.LogCaptureFixture) -> None:
    r = checked
    await running(r, "b")
    calls = 0

    def flaky() -> Answer:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("probe exploded")
        return Answer(Probe.FAILED, "status 500")

    mark = r.last_id()
    with caplog.at_level(logging.ERROR, "gpud.supervisor"):
        r.sup.answers["b"] = flaky
        await r.wait_for("unhealthy", "b", after=mark)
    assert "health check of b failed" in caplog.text


# ---- the health endpoint, over a real socket ------------------------------------------------


@pytest.fixture
async def endpoint() -> AsyncIterator[tuple[int, dict[str, int]]]:
    status = {"code": 200}

    async def health(_request: web.Request) -> web.Response:
        return web.Response(status=status["code"], text="x")

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield port, status
    await runner.cleanup()


async def test_health_answers_as_judged(rig: Rig, endpoint: tuple[int, dict[str, int]]) -> None:
    port, status = endpoint
    spec = rig.svc.config.serves["a"].model_copy(update={"port": port})
    probe = HttpProbe(rig.sup.runtime).probe
    status["code"] = 503
    assert await probe("a", spec) == Answer(Probe.ENGINE_DEAD, "503")
    status["code"] = 500
    assert await probe("a", spec) == Answer(Probe.FAILED, "status 500")
    status["code"] = 200
    # a 200 from a socket this test's process holds, not the serve's unit: foreign
    answer = await probe("a", spec)
    assert answer.probe is Probe.FOREIGN
    assert answer.detail.startswith(f"port {port} is held by ")
    assert await probe("a", spec.model_copy(update={"port": None})) == Answer(
        Probe.OK, "no port: an active unit is all there is")


async def test_health_of_a_port_nobody_listens_on(rig: Rig) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        spec = rig.svc.config.serves["a"].model_copy(update={"port": port})
        answer = await HttpProbe(rig.sup.runtime).probe("a", spec)
    assert answer.probe is Probe.REFUSED
    assert answer.detail.startswith("cannot connect")


async def test_a_start_with_preempt_takes_the_preemption_lock_before_the_serves(rig: Rig) -> None:
    """One lock order: a wake (or wake-back) holds preemption's lock and then waits for the
    serve's; a start with preempt that held the serve's lock while waiting for preemption's
    deadlocked with it (every later request of either kind hung)."""
    coordination = rig.sup.sleeps.coordination
    await coordination.acquire()
    task = asyncio.ensure_future(rig.sup.launch_job.start("a", None, preempt=True))
    await until(lambda: waiters(coordination) == 1, what="the start waiting for preemption's lock")
    try:
        assert not task.done()
        assert not rig.sup.runtime.serve_lock("a").locked()  # free for a wake holding the other lock
    finally:
        coordination.release()
    await asyncio.wait_for(task, 10)
    assert rig.held() == {"a": 300}


# ---- a sleep commits only for the process it asked -------------------------------------------


async def test_a_sleep_answered_by_a_process_since_replaced_is_not_committed(
        tmp_path: Path) -> None:
    """The old process answers /sleep and is gone; the unit's MainPID and InvocationID are the
    new (awake) process's: the serve keeps its full reservation and starts over."""
    asleep = {"now": False}
    rig_box: list[Rig] = []

    async def sleep(_request: web.Request) -> web.Response:
        asleep["now"] = True
        rig = rig_box[0]
        rig.units.live["s"] = unit("s", pid=5151, invocation="inv-new")  # restarted meanwhile
        return web.json_response({})

    async def is_sleeping(_request: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": asleep["now"]})

    app = web.Application()
    app.router.add_post("/sleep", sleep)
    app.router.add_get("/is_sleeping", is_sleeping)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    extra = (f'[serves.s]\nrole = "r"\nvram_mib = 500\nport = {port}\nsleep_level = 2\n'
             'sleep_mib = 100\ncommand = ["/bin/true", "s"]\nfront = false\n')  # on its port
    r = await make_rig(tmp_path, CONFIG, extra=extra)
    rig_box.append(r)
    try:
        async for _ in entered(r):
            # running under its unit (the port is this test's: no start, which would see it
            # held by another process)
            r.units.live["s"] = unit("s", pid=4242, invocation="inv-1")
            await admitted_to(r.svc, "s", 500, RUNNING)
            with pytest.raises(Conflict, match="restarted while it was put to sleep"):
                await r.sup.sleeps.sleep("s", None)
            assert r.held() == {"s": 500}
            assert r.state("s") in (STARTING, RUNNING)  # starts over, awake, at its full size
            [ev] = [e for e in r.events(serves=["s"]) if e.kind == "restart"]
            assert "MainPID 5151" in ev.message and "the sleep is not committed" in ev.message
            assert not [e for e in r.events(serves=["s"]) if e.kind == "sleep"]
    finally:
        await runner.cleanup()


async def test_the_health_restart_holds_the_serves_lock_and_a_stop_ends_it(checked: Rig) -> None:
    """The health check's restart is a lifecycle action like any: under the serve's lock (no
    sleep, wake or start of it meanwhile), its devices held while the new process loads; a
    stop does not wait for the new process, it ends the restart."""
    r = checked
    await running(r, "a")
    mark = r.last_id()
    r.sup.answers["a"] = failing()  # never healthy again: the restarted process loads forever
    await r.wait_for("restart", "a", after=mark)
    assert r.sup.runtime.serve_lock("a").locked() and r.sup.runtime.device_locks("a").locked()
    await asyncio.wait_for(r.sup.stop_job.stop("a", None), 5)
    assert r.state("a") == DECLARED and r.held() == {}
    assert not r.sup.runtime.serve_lock("a").locked() and not r.sup.runtime.device_locks("a").locked()


ROUTED = """
[daemon]
admission = "ledger"
state_dir = "{tmp}"
health_interval_s = {health}

[roles.r]
device = "GPU-sim-0"
capacity_mib = 1000

[serves.chat]
role = "r"
vram_mib = 300
port = 30601
[serves.chat.vllm]
model = "org/chat"
executable = "/bin/true"

[serves.own]
role = "r"
vram_mib = 300
port = 30602
[serves.own.vllm]
model = "org/own"
executable = "/bin/true"
extra_args = ["--scheduling-policy", "fcfs"]
"""


async def test_a_vllm_serve_behind_the_router_is_launched_with_the_priority_policy(
        tmp_path: Path) -> None:
    """The unit's argv: --scheduling-policy priority on a vllm serve the router reaches, the
    operator's own choice where extra_args make one, and nothing without a [router]."""
    for i, (router, chat) in enumerate((
            ('[router]\nlisten = "127.0.0.1:30600"\n', ["--scheduling-policy", "priority"]),
            ("", []))):
        (tmp_path / str(i)).mkdir()
        r = await make_rig(tmp_path / str(i), ROUTED + router)
        async for _ in entered(r):
            def tail(name: str, r: Rig = r) -> list[str]:
                """The argv from the shutdown timeout's value on."""
                spec = r.sup.launch_job.unit_spec(name, r.svc.config.serves[name])
                argv = list(spec.argv)
                return argv[argv.index("--shutdown-timeout") + 2:]
            assert tail("chat") == chat
            assert tail("own") == ["--scheduling-policy", "fcfs"]
