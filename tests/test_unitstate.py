"""The serve state machine as data: what a change of a serve's unit means, from a table."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpud.core.unitstate import (
    AdoptOutsideStart,
    AskShutdown,
    CountRestarts,
    Fail,
    OrphanEnded,
    OutsideStop,
    ReleaseEnded,
    Restarting,
    SeenExit,
    ServeRuntime,
    StopEnded,
    UnitState,
    WatchRestart,
    on_unit,
    will_restart,
)


def unit(active: str = "active", sub: str = "running", result: str = "success",
         restarts: int = 0, invocation: str = "i1", code: int = 1, status: int = 0,
         stopped_by_job: bool = False) -> UnitState:
    exits = (100, 200) if stopped_by_job else (200, 100)
    return UnitState("s", "gpud-serve-s.service", active, sub, result, restarts, 42, status,
                     invocation, "/gpud.slice/gpud-serve-s.service", code,
                     active_exit_us=exits[0], exec_main_exit_us=exits[1])


RUNNING_UNIT = unit()
RT = ServeRuntime(state="running", holds=True, configured=True, resident=False,
                  restart="on-failure", launching=False, stopping=False, prev=RUNNING_UNIT,
                  exit_seen=None)

CASES = [
    # (what happened, runtime changes, unit, actions)
    ("gpud's own stop", {"stopping": True}, unit("inactive", "dead"), []),
    ("crash: systemd restarts it", {}, unit("failed", "failed", "exit-code", status=1),
     [SeenExit("i1"), Restarting("status 1", "i1")]),
    ("the same exit seen again", {"exit_seen": "i1"}, unit("inactive", "dead", "exit-code"), []),
    ("killed, restart=no", {"restart": "no"}, unit("failed", "failed", "signal", code=2, status=9),
     [SeenExit("i1"), Fail("exited (killed by signal 9, result signal)")]),
    ("clean exit, on-failure", {}, unit("inactive", "dead"),
     [SeenExit("i1"), Fail("exited (status 0, result success)")]),
    ("clean exit, always", {"restart": "always"}, unit("inactive", "dead"),
     [SeenExit("i1"), Restarting("status 0", "i1")]),
    ("start limit hit", {}, unit("failed", "failed", "start-limit-hit"),
     [Fail("crash-loop: systemd's start limit was hit")]),
    ("restarted twice by systemd", {}, unit(restarts=2), [CountRestarts(2)]),
    ("restarted, and exited again", {}, unit("activating", "auto-restart", "exit-code",
                                            restarts=1, status=3),
     [CountRestarts(1), SeenExit("i1"), Restarting("status 3", "i1")]),
    ("failed: restarts are not counted", {"state": "failed", "holds": False}, unit(restarts=3), []),
    ("stopped by hand: ask about a shutdown first", {},
     unit("inactive", "dead", stopped_by_job=True), [AskShutdown()]),
    ("stopped by hand, no shutdown", {"shutting_down": False},
     unit("inactive", "dead", stopped_by_job=True), [OutsideStop()]),
    ("stopped at a host shutdown: an exit", {"shutting_down": True},
     unit("inactive", "dead", stopped_by_job=True), [SeenExit("i1"), Fail(
         "exited (status 0, result success)")]),
    ("exited during gpud's start: systemd restarts it once",
     {"launching": True, "state": "starting"},
     unit("activating", "auto-restart", "exit-code", status=3),
     [SeenExit("i1"), Restarting("status 3", "i1")]),
    ("exited again during gpud's start, after systemd's restart: a crash loop, stopped",
     {"launching": True, "state": "starting", "prev": unit(restarts=1)},
     unit("activating", "auto-restart", "exit-code", restarts=1, status=3),
     [SeenExit("i1"), Fail("crash-loop: exited 2 times during its start, before it ever "
                           "answered (last: status 3, result exit-code)", stop=True,
                           crash_loop=True)]),
    ("exited again after systemd's restart, no start of gpud's: systemd restarts it",
     {"state": "starting", "prev": unit(restarts=1)},
     unit("activating", "auto-restart", "exit-code", restarts=1, status=3),
     [SeenExit("i1"), Restarting("status 3", "i1")]),
    ("exited again during gpud's start while running: its crash-loop count decides",
     {"launching": True, "prev": unit(restarts=1)},
     unit("activating", "auto-restart", "exit-code", restarts=1, status=3),
     [SeenExit("i1"), Restarting("status 3", "i1")]),
    ("a launch's own first inactive", {"launching": True, "prev": None, "state": "starting"},
     unit("inactive", "dead"), []),
    ("orphan ended", {"state": "orphan", "holds": False}, unit("inactive", "dead"),
     [OrphanEnded("status 0")]),
    ("orphan in auto-restart", {"state": "orphan", "holds": False},
     unit("activating", "auto-restart"), []),
    ("failed unit, finally gone", {"state": "failed"}, unit("inactive", "dead"), [ReleaseEnded()]),
    ("failed resident unit gone: kept", {"state": "failed", "resident": True},
     unit("inactive", "dead"), []),
    ("ended after gpud's stop gave up waiting", {"state": "stopping"},
     unit("failed", "failed", "timeout", code=2, status=9), [StopEnded("killed by signal 9")]),
    ("still stopping, its stop gave up", {"state": "stopping"}, unit("deactivating", "stop-sigterm"),
     []),
    ("stopping, in systemd's restart", {"state": "stopping"},
     unit("activating", "auto-restart", "exit-code", status=1), []),
    ("active again while starting", {"state": "starting"}, unit(), [WatchRestart()]),
    ("started by hand after gpud's stop", {"state": "declared", "holds": False,
                                           "prev": unit("inactive", "dead")}, unit(),
     [AdoptOutsideStart()]),
    ("active, unknown before", {"state": "declared", "holds": False, "prev": None}, unit(), []),
    ("died asleep: stopped before systemd brings it back at full size", {"state": "sleeping"},
     unit("failed", "failed", "exit-code", status=1),
     [SeenExit("i1"), Fail("exited while asleep (status 1, result exit-code)", stop=True)]),
    ("died asleep, restart=no", {"state": "sleeping", "restart": "no"},
     unit("inactive", "dead"),
     [SeenExit("i1"), Fail("exited while asleep (status 0, result success)", stop=True)]),
    ("asleep, stopped by hand", {"state": "sleeping", "shutting_down": False},
     unit("inactive", "dead", stopped_by_job=True), [OutsideStop()]),
    ("asleep and active: nothing to do", {"state": "sleeping"}, unit(), []),
]


@pytest.mark.parametrize("what, changes, st, expected", CASES, ids=[c[0] for c in CASES])
def test_on_unit(what: str, changes: dict, st: UnitState, expected: list) -> None:
    assert on_unit(replace(RT, **changes), st) == expected


def test_will_restart_follows_systemds_restart_setting() -> None:
    ok, bad = unit("inactive", "dead"), unit("failed", "failed", "exit-code")
    assert [will_restart(r, u) for r in ("no", "on-failure", "always") for u in (ok, bad)] == [
        False, False, False, True, True, True]


def test_a_restart_count_is_the_difference_since_last_seen() -> None:
    rt = replace(RT, prev=unit(restarts=2))
    assert on_unit(rt, unit(restarts=3)) == [CountRestarts(1)]


@pytest.mark.parametrize(("active_exit_us", "exec_main_exit_us", "by_job"), [
    (100, 200, True),   # left active before its process exited: a stop job ended it
    (1, 2, True),       # the earliest timestamps are timestamps too
    (200, 100, False),  # the process exited first: the unit followed it
    (150, 150, False),  # together: the process's exit ended the unit
    (0, 200, False),    # never left active (0: systemd has no such timestamp)
])
def test_stopped_by_job_from_the_timestamps(active_exit_us: int, exec_main_exit_us: int,
                                            by_job: bool) -> None:
    st = replace(unit(), active_exit_us=active_exit_us, exec_main_exit_us=exec_main_exit_us)
    assert st.stopped_by_job is by_job


@pytest.mark.parametrize(("code", "how"), [
    (1, "status 9"), (2, "killed by signal 9"), (3, "killed by signal 9"), (4, "status 9")])
def test_how_a_process_ended(code: int, how: str) -> None:
    """CLD_EXITED (1): an exit status; CLD_KILLED (2) and CLD_DUMPED (3): a signal."""
    assert replace(unit(), exec_main_code=code, exec_main_status=9).how == how


def test_a_unit_state_without_exit_details_knows_none() -> None:
    """Fields systemd did not report read as 0 ("no such value"): not a stop job, no signal."""
    st = UnitState("s", "gpud-serve-s.service", "active", "running", "success", 0, 42, 0, "i",
                   "/g")
    assert (st.exec_main_code, st.active_exit_us, st.exec_main_exit_us) == (0, 0, 0)
    assert st.load_state == "loaded"
    assert not st.stopped_by_job and st.how == "status 0"
