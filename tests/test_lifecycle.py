"""A serve's life as data: every (phase, input) pair from a table, the fields each input
changes, and properties over sequences of inputs."""

from __future__ import annotations

from dataclasses import replace
from typing import get_args

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpud.core import lifecycle
from gpud.core.lifecycle import (
    IDLE_LIFE,
    CancelLaunch,
    CrashLoop,
    HealthCounted,
    Input,
    Job,
    JobBegan,
    JobEnded,
    LaunchEnded,
    MemoryBack,
    MemoryLeaving,
    Phase,
    PortChecked,
    Refuse,
    Restarted,
    RestartsCounted,
    ServeLife,
    SleepAsked,
    Slumber,
    SlumberEnded,
    StartAsked,
    UnitChanged,
    UnitGone,
    UnitSeen,
    UnitStarted,
    WakeAsked,
    Watch,
    WatchAsked,
    WatchEnded,
    own_listener_trusted,
    start_refused,
    step,
)
from gpud.core.unitstate import AskShutdown, Fail, OutsideStop, Restarting, UnitState, WatchRestart
from gpud.core.vocab import FAILED, RUNNING, STARTING


def unit(active: str = "active", sub: str = "running", result: str = "success",
         restarts: int = 0, invocation: str = "i1", pid: int = 42,
         stopped_by_job: bool = False) -> UnitState:
    exits = (100, 200) if stopped_by_job else (200, 100)
    return UnitState("s", "gpud-serve-s.service", active, sub, result, restarts, pid, 1,
                     invocation, "/gpud.slice/gpud-serve-s.service", 1,
                     active_exit_us=exits[0], exec_main_exit_us=exits[1])


RUNNING_UNIT = unit()
EXITED = unit("failed", "failed", "exit-code")


def changed(st: UnitState = EXITED, prev: UnitState | None = RUNNING_UNIT, *,
            state: str = RUNNING, restart: str = "no", now: float = 100.0,
            shutting_down: bool | None = None) -> UnitChanged:
    return UnitChanged(unit=st, prev=prev, state=state, holds=True, configured=True,
                       resident=False, restart=restart, now=now, window_s=60.0, limit=2,
                       shutting_down=shutting_down)


# One life in each phase: the table's rows start from it.
IN_PHASE = {
    Phase.IDLE: IDLE_LIFE,
    Phase.LAUNCHING: ServeLife(launching=True),
    Phase.AWAITING_HEALTH: ServeLife(watching=True),
    Phase.STOPPING: ServeLife(job=Job.STOP),
    Phase.RESTARTING: ServeLife(job=Job.RESTART),
    Phase.FAILING: ServeLife(job=Job.FAIL_STOP),
    Phase.FALLING_ASLEEP: ServeLife(slumber=Slumber.FALLING_ASLEEP),
    Phase.WAKING: ServeLife(slumber=Slumber.WAKING),
}


def samples() -> dict[str, Input]:
    """One input of each kind, by name; one per job where the input names a job. Built from
    the Input union and the Job enum: a new kind or job without its rows fails the table."""
    made: dict[str, Input] = {}
    for kind in get_args(Input):
        if kind in (JobBegan, JobEnded):
            for job in Job:
                if job is not Job.NONE:
                    made[f"{kind.__name__}({job})"] = kind(job)
            continue
        made[kind.__name__] = {
            UnitChanged: changed(),
            UnitStarted: UnitStarted(RUNNING_UNIT),
            UnitSeen: UnitSeen(RUNNING_UNIT),
            RestartsCounted: RestartsCounted(3, 100.0, 60.0, 2),
            HealthCounted: HealthCounted(2),
            PortChecked: PortChecked(own=True, pid=42, at=1.0),
            MemoryLeaving: MemoryLeaving(frozenset({"GPU-a"})),
            MemoryBack: MemoryBack("GPU-a"),
        }.get(kind) or kind()
    return made


# phase, input -> phase after, the kinds of the actions ("-": none)
TABLE = """
idle             StartAsked           launching        -
launching        StartAsked           launching        Refuse
awaiting-health  StartAsked           launching        -
stopping         StartAsked           stopping         Refuse
restarting       StartAsked           restarting       Refuse
failing          StartAsked           failing          Refuse
idle             LaunchEnded          idle             -
launching        LaunchEnded          idle             -
awaiting-health  LaunchEnded          awaiting-health  -
stopping         LaunchEnded          stopping         -
restarting       LaunchEnded          restarting       -
failing          LaunchEnded          failing          -
idle             JobBegan(stop)       stopping         -
launching        JobBegan(stop)       stopping         CancelLaunch
awaiting-health  JobBegan(stop)       stopping         -
stopping         JobBegan(stop)       stopping         -
restarting       JobBegan(stop)       stopping         -
failing          JobBegan(stop)       stopping         -
idle             JobBegan(restart)    restarting       -
launching        JobBegan(restart)    restarting       -
awaiting-health  JobBegan(restart)    restarting       -
stopping         JobBegan(restart)    restarting       -
restarting       JobBegan(restart)    restarting       -
failing          JobBegan(restart)    restarting       -
idle             JobBegan(fail-stop)  failing          -
launching        JobBegan(fail-stop)  failing          -
awaiting-health  JobBegan(fail-stop)  failing          -
stopping         JobBegan(fail-stop)  failing          -
restarting       JobBegan(fail-stop)  failing          -
failing          JobBegan(fail-stop)  failing          -
idle             JobEnded(stop)       idle             -
launching        JobEnded(stop)       launching        -
awaiting-health  JobEnded(stop)       awaiting-health  -
stopping         JobEnded(stop)       idle             -
restarting       JobEnded(stop)       restarting       -
failing          JobEnded(stop)       failing          -
idle             JobEnded(restart)    idle             -
launching        JobEnded(restart)    launching        -
awaiting-health  JobEnded(restart)    awaiting-health  -
stopping         JobEnded(restart)    stopping         -
restarting       JobEnded(restart)    idle             -
failing          JobEnded(restart)    failing          -
idle             JobEnded(fail-stop)  idle             -
launching        JobEnded(fail-stop)  launching        -
awaiting-health  JobEnded(fail-stop)  awaiting-health  -
stopping         JobEnded(fail-stop)  stopping         -
restarting       JobEnded(fail-stop)  restarting       -
failing          JobEnded(fail-stop)  idle             -
idle             WatchAsked           awaiting-health  Watch
launching        WatchAsked           launching        Watch
awaiting-health  WatchAsked           awaiting-health  -
stopping         WatchAsked           stopping         Watch
restarting       WatchAsked           restarting       Watch
failing          WatchAsked           failing          Watch
idle             WatchEnded           idle             -
launching        WatchEnded           launching        -
awaiting-health  WatchEnded           idle             -
stopping         WatchEnded           stopping         -
restarting       WatchEnded           restarting       -
failing          WatchEnded           failing          -
idle             UnitStarted          idle             -
launching        UnitStarted          launching        -
awaiting-health  UnitStarted          awaiting-health  -
stopping         UnitStarted          stopping         -
restarting       UnitStarted          restarting       -
failing          UnitStarted          failing          -
idle             UnitSeen             idle             -
launching        UnitSeen             launching        -
awaiting-health  UnitSeen             awaiting-health  -
stopping         UnitSeen             stopping         -
restarting       UnitSeen             restarting       -
failing          UnitSeen             failing          -
idle             UnitGone             idle             -
launching        UnitGone             launching        -
awaiting-health  UnitGone             awaiting-health  -
stopping         UnitGone             stopping         -
restarting       UnitGone             restarting       -
failing          UnitGone             failing          -
idle             UnitChanged          idle             Fail
launching        UnitChanged          launching        Fail
awaiting-health  UnitChanged          awaiting-health  Fail
stopping         UnitChanged          stopping         -
restarting       UnitChanged          restarting       -
failing          UnitChanged          failing          -
idle             RestartsCounted      idle             CrashLoop
launching        RestartsCounted      launching        CrashLoop
awaiting-health  RestartsCounted      awaiting-health  CrashLoop
stopping         RestartsCounted      stopping         CrashLoop
restarting       RestartsCounted      restarting       CrashLoop
failing          RestartsCounted      failing          CrashLoop
idle             HealthCounted        idle             -
launching        HealthCounted        launching        -
awaiting-health  HealthCounted        awaiting-health  -
stopping         HealthCounted        stopping         -
restarting       HealthCounted        restarting       -
failing          HealthCounted        failing          -
idle             PortChecked          idle             -
launching        PortChecked          launching        -
awaiting-health  PortChecked          awaiting-health  -
stopping         PortChecked          stopping         -
restarting       PortChecked          restarting       -
failing          PortChecked          failing          -
idle             MemoryLeaving        idle             -
launching        MemoryLeaving        launching        -
awaiting-health  MemoryLeaving        awaiting-health  -
stopping         MemoryLeaving        stopping         -
restarting       MemoryLeaving        restarting       -
failing          MemoryLeaving        failing          -
idle             MemoryBack           idle             -
launching        MemoryBack           launching        -
awaiting-health  MemoryBack           awaiting-health  -
stopping         MemoryBack           stopping         -
restarting       MemoryBack           restarting       -
failing          MemoryBack           failing          -
falling-asleep   StartAsked           falling-asleep   Refuse
falling-asleep   LaunchEnded          falling-asleep   -
falling-asleep   JobBegan(stop)       stopping         -
falling-asleep   JobBegan(restart)    restarting       -
falling-asleep   JobBegan(fail-stop)  failing          -
falling-asleep   JobEnded(stop)       falling-asleep   -
falling-asleep   JobEnded(restart)    falling-asleep   -
falling-asleep   JobEnded(fail-stop)  falling-asleep   -
falling-asleep   WatchAsked           falling-asleep   Watch
falling-asleep   WatchEnded           falling-asleep   -
falling-asleep   UnitStarted          falling-asleep   -
falling-asleep   UnitSeen             falling-asleep   -
falling-asleep   UnitGone             falling-asleep   -
falling-asleep   UnitChanged          falling-asleep   Fail
falling-asleep   RestartsCounted      falling-asleep   CrashLoop
falling-asleep   HealthCounted        falling-asleep   -
falling-asleep   PortChecked          falling-asleep   -
falling-asleep   MemoryLeaving        falling-asleep   -
falling-asleep   MemoryBack           falling-asleep   -
waking           StartAsked           waking           Refuse
waking           LaunchEnded          waking           -
waking           JobBegan(stop)       stopping         -
waking           JobBegan(restart)    restarting       -
waking           JobBegan(fail-stop)  failing          -
waking           JobEnded(stop)       waking           -
waking           JobEnded(restart)    waking           -
waking           JobEnded(fail-stop)  waking           -
waking           WatchAsked           waking           Watch
waking           WatchEnded           waking           -
waking           UnitStarted          waking           -
waking           UnitSeen             waking           -
waking           UnitGone             waking           -
waking           UnitChanged          waking           Fail
waking           RestartsCounted      waking           CrashLoop
waking           HealthCounted        waking           -
waking           PortChecked          waking           -
waking           MemoryLeaving        waking           -
waking           MemoryBack           waking           -
idle             SleepAsked           falling-asleep   -
launching        SleepAsked           launching        Refuse
awaiting-health  SleepAsked           falling-asleep   -
stopping         SleepAsked           stopping         Refuse
restarting       SleepAsked           restarting       Refuse
failing          SleepAsked           failing          Refuse
falling-asleep   SleepAsked           falling-asleep   Refuse
waking           SleepAsked           waking           Refuse
idle             WakeAsked            waking           -
launching        WakeAsked            launching        -
awaiting-health  WakeAsked            waking           -
stopping         WakeAsked            stopping         -
restarting       WakeAsked            restarting       -
failing          WakeAsked            failing          -
falling-asleep   WakeAsked            waking           -
waking           WakeAsked            waking           -
idle             SlumberEnded         idle             -
launching        SlumberEnded         launching        -
awaiting-health  SlumberEnded         awaiting-health  -
stopping         SlumberEnded         stopping         -
restarting       SlumberEnded         restarting       -
failing          SlumberEnded         failing          -
falling-asleep   SlumberEnded         idle             -
waking           SlumberEnded         idle             -
"""


def rows() -> dict[tuple[Phase, str], tuple[Phase, str]]:
    table: dict[tuple[Phase, str], tuple[Phase, str]] = {}
    for line in TABLE.strip().splitlines():
        phase, name, after, actions = line.split()
        assert (Phase(phase), name) not in table, f"two rows for {phase} {name}"
        table[(Phase(phase), name)] = (Phase(after), actions)
    return table


def test_the_representatives_are_in_their_phases() -> None:
    assert set(IN_PHASE) == set(Phase)
    for phase, life in IN_PHASE.items():
        assert life.phase is phase


def test_the_table_has_a_row_for_every_phase_and_input_and_no_other() -> None:
    wanted = {(phase, name) for phase in Phase for name in samples()}
    assert set(rows()) == wanted


@pytest.mark.parametrize(("phase", "name"), sorted(rows()))
def test_table(phase: Phase, name: str) -> None:
    after, kinds = rows()[(phase, name)]
    life, actions = step(IN_PHASE[phase], samples()[name])
    assert life.phase is after
    assert (" ".join(type(a).__name__ for a in actions) or "-") == kinds


# ---- what each input changes beyond the phase ----------------------------------------------

def test_a_refused_start_names_the_phase_in_its_way_and_changes_nothing() -> None:
    stopping = ServeLife(job=Job.STOP, launching=False)
    assert step(stopping, StartAsked()) == (stopping, [Refuse(Phase.STOPPING)])
    assert start_refused(ServeLife(launching=True)) is Phase.LAUNCHING
    assert start_refused(ServeLife(watching=True)) is None


def test_a_stop_ends_what_was_seen_of_the_unit_and_its_listener() -> None:
    life = ServeLife(job=Job.STOP, unit=RUNNING_UNIT, port_owner=(42, 1.0), health_failures=1)
    assert step(life, JobEnded(Job.STOP))[0] == ServeLife(health_failures=1)
    # a fail-stop begun during the stop took over: the stop's end leaves it be, but the unit
    # seen before is past all the same
    taken = replace(life, job=Job.FAIL_STOP)
    assert step(taken, JobEnded(Job.STOP))[0] == ServeLife(job=Job.FAIL_STOP, health_failures=1)


def test_a_restart_forgets_the_listener_keeps_the_unit() -> None:
    life = ServeLife(job=Job.RESTART, unit=RUNNING_UNIT, port_owner=(42, 1.0))
    assert step(life, JobEnded(Job.RESTART))[0] == ServeLife(unit=RUNNING_UNIT)
    assert step(replace(life, job=Job.FAIL_STOP), JobEnded(Job.RESTART))[0] == ServeLife(
        job=Job.FAIL_STOP, unit=RUNNING_UNIT)


def test_a_failing_stop_keeps_unit_and_listener() -> None:
    life = ServeLife(job=Job.FAIL_STOP, unit=RUNNING_UNIT, port_owner=(42, 1.0))
    assert step(life, JobEnded(Job.FAIL_STOP))[0] == ServeLife(unit=RUNNING_UNIT,
                                                                port_owner=(42, 1.0))


def test_a_launch_ending_leaves_the_watch_and_the_job() -> None:
    life = ServeLife(launching=True, watching=True, job=Job.FAIL_STOP)
    assert step(life, LaunchEnded())[0] == ServeLife(watching=True, job=Job.FAIL_STOP)


def test_units_started_seen_and_gone() -> None:
    fresh = unit(invocation="i2")
    life = ServeLife(unit=RUNNING_UNIT, restarts=(1.0, 2.0))
    assert step(life, UnitStarted(fresh))[0] == ServeLife(unit=fresh)
    assert step(life, UnitSeen(fresh))[0] == ServeLife(unit=fresh, restarts=(1.0, 2.0))
    assert step(life, UnitGone())[0] == ServeLife(restarts=(1.0, 2.0))


def test_restarts_are_counted_in_the_window_up_to_the_limit() -> None:
    life, actions = step(IDLE_LIFE, RestartsCounted(1, 10.0, 60.0, 2))
    assert (life.restarts, actions) == ((10.0,), [])
    life, actions = step(life, RestartsCounted(1, 70.0, 60.0, 2))  # 10.0 is exactly 60 s back
    assert (life.restarts, actions) == ((10.0, 70.0), [])
    life, actions = step(life, RestartsCounted(1, 70.5, 60.0, 2))  # 10.0 has left the window
    assert (life.restarts, actions) == ((70.0, 70.5), [])
    life, actions = step(life, RestartsCounted(1, 71.0, 60.0, 2))
    assert life.restarts == ()  # counted afresh after a crash loop
    assert actions == [CrashLoop("crash-loop: 3 restarts in 60 s (limit 2)")]
    assert step(IDLE_LIFE, RestartsCounted(2, 0.0, 1.5, 2)) == (ServeLife(restarts=(0.0, 0.0)),
                                                                 [])


def test_health_failures_count() -> None:
    assert step(IDLE_LIFE, HealthCounted(2))[0].health_failures == 2
    assert step(ServeLife(health_failures=2), HealthCounted(0))[0] == IDLE_LIFE
    assert step(IDLE_LIFE, HealthCounted(-1))[0] == IDLE_LIFE


def test_the_own_listener_is_trusted_for_its_pid_for_a_while() -> None:
    life = step(IDLE_LIFE, PortChecked(own=True, pid=42, at=100.0))[0]
    assert life.port_owner == (42, 100.0)
    assert own_listener_trusted(life, 42, 109.9, 10.0)
    assert not own_listener_trusted(life, 42, 110.0, 10.0)
    assert not own_listener_trusted(life, 43, 101.0, 10.0)  # another process now
    assert not own_listener_trusted(life, 0, 101.0, 10.0)
    assert not own_listener_trusted(IDLE_LIFE, 42, 101.0, 10.0)
    assert step(life, PortChecked(own=False, pid=42, at=101.0))[0].port_owner is None
    assert step(life, PortChecked(own=True, pid=0, at=101.0))[0].port_owner is None
    zero = ServeLife(port_owner=(0, 100.0))
    assert not own_listener_trusted(zero, 0, 101.0, 10.0)


def test_memory_leaves_for_devices_and_comes_back_one_by_one() -> None:
    life = step(IDLE_LIFE, MemoryLeaving(frozenset({"a", "b"})))[0]
    life = step(life, MemoryLeaving(frozenset({"c"})))[0]
    assert life.returning == {"a", "b", "c"}
    life = step(life, MemoryBack("b"))[0]
    assert life.returning == {"a", "c"}
    assert step(life, MemoryBack("z"))[0] == life


# ---- the unit's signal, through the record --------------------------------------------------

def test_a_unit_change_is_remembered_and_its_exit_handled_once() -> None:
    inp = changed(restart="on-failure")
    life, actions = step(IDLE_LIFE, inp)
    assert actions == [Restarting("status 1", "i1")]
    assert (life.unit, life.exit_seen) == (EXITED, "i1")
    # the same exit again, on its way through auto-restart: nothing more to do
    again = unit("activating", "auto-restart", "exit-code")
    assert step(life, changed(again, EXITED, restart="on-failure")) == (replace(life, unit=again),
                                                                        [])


def test_a_crash_loop_found_while_counting_ends_the_signals_actions() -> None:
    restarted = unit("failed", "failed", "exit-code", restarts=3)
    life, actions = step(IDLE_LIFE, changed(restarted, RUNNING_UNIT, restart="on-failure"))
    assert actions == [Restarted(3, "crash-loop: 3 restarts in 60 s (limit 2)")]
    # its exit not marked handled: nothing after the crash loop was done
    assert (life.exit_seen, life.restarts, life.unit) == (None, (), restarted)


def test_restarts_below_the_limit_go_on_to_the_rest() -> None:
    back = unit(restarts=1, invocation="i2")
    life, actions = step(IDLE_LIFE, changed(back, RUNNING_UNIT, state=STARTING))
    assert actions == [Restarted(1, None), WatchRestart()]
    assert life.restarts == (100.0,)


def test_no_restart_counted_for_a_failed_serve() -> None:
    back = unit(restarts=1, invocation="i2")
    assert step(IDLE_LIFE, changed(back, RUNNING_UNIT, state=FAILED))[1] == []


def test_the_shutdown_question_is_asked_then_decided_on_the_same_change() -> None:
    stopped = unit("inactive", "dead", "success", stopped_by_job=True)
    life, actions = step(IDLE_LIFE, changed(stopped, RUNNING_UNIT))
    assert actions == [AskShutdown()]
    assert life.unit == stopped
    # decided again with the unit seen before the change as its prev
    _, actions = step(life, changed(stopped, RUNNING_UNIT, shutting_down=False))
    assert actions == [OutsideStop()]


def test_a_launch_under_way_is_the_records() -> None:
    # a start of gpud's is under way: the unit going away before it was ever seen is its start
    inactive = unit("inactive", "dead")
    life = ServeLife(launching=True)
    assert step(life, changed(inactive, None, state=STARTING))[1] == []
    assert step(IDLE_LIFE, changed(inactive, None, state=STARTING))[1] == [
        Fail("exited (status 1, result success)")]


# ---- properties over sequences --------------------------------------------------------------

JOBS = [job for job in Job if job is not Job.NONE]
UNITS = st.sampled_from([RUNNING_UNIT, EXITED, unit(restarts=1, invocation="i2"),
                         unit("inactive", "dead", stopped_by_job=True),
                         unit("activating", "auto-restart", "exit-code")])
INPUTS: st.SearchStrategy[Input] = st.one_of(
    st.just(StartAsked()), st.just(LaunchEnded()), st.just(SleepAsked()), st.just(WakeAsked()),
    st.just(SlumberEnded()), st.builds(JobBegan, st.sampled_from(JOBS)),
    st.builds(JobEnded, st.sampled_from(JOBS)), st.just(WatchAsked()), st.just(WatchEnded()),
    st.builds(UnitStarted, UNITS), st.builds(UnitSeen, UNITS), st.just(UnitGone()),
    st.builds(lambda u, p, s, r, d: changed(u, p, state=s, restart=r, shutting_down=d),
              UNITS, st.none() | UNITS, st.sampled_from([RUNNING, STARTING, FAILED]),
              st.sampled_from(["no", "on-failure", "always"]), st.none() | st.booleans()),
    st.builds(RestartsCounted, st.integers(0, 3), st.floats(0, 200), st.just(60.0),
              st.integers(1, 3)),
    st.builds(HealthCounted, st.integers(-1, 3)),
    st.builds(PortChecked, st.booleans(), st.integers(0, 2), st.floats(0, 100)),
    st.builds(MemoryLeaving, st.frozensets(st.sampled_from("ab"))),
    st.builds(MemoryBack, st.sampled_from("ab")))


@settings(max_examples=400)
@given(st.lists(INPUTS, max_size=30))
def test_no_launch_begins_during_another_or_a_job_and_one_wait_at_a_time(
        inputs: list[Input]) -> None:
    life = IDLE_LIFE
    waits = 0
    for inp in inputs:
        before = life
        life, actions = step(life, inp)
        if isinstance(inp, StartAsked):
            # a start goes on exactly when nothing of gpud's is under way
            occupied = before.busy or before.slumber is not Slumber.NONE
            assert (Refuse(before.phase) in actions) == occupied
            assert life.launching == (before.launching or not occupied)
        if life.launching and not before.launching:
            assert isinstance(inp, StartAsked) and not before.busy
            assert before.slumber is Slumber.NONE, "a launch began during a sleep or a wake"
        if isinstance(inp, SleepAsked):
            went = life.slumber is Slumber.FALLING_ASLEEP and Refuse(before.phase) not in actions
            assert went == (not before.busy and before.slumber is Slumber.NONE)
        if isinstance(inp, WatchEnded):
            waits = 0
        waits += actions.count(Watch())
        assert waits <= 1, "two waits on the serve's health at once"
        # a stop never lets the launch run on unasked
        if isinstance(inp, JobBegan) and inp.job is Job.STOP:
            assert (CancelLaunch() in actions) == before.launching
        else:
            assert CancelLaunch() not in actions
        assert life.health_failures >= 0
        assert life.phase is Phase.IDLE or life != IDLE_LIFE
        assert (life.phase is Phase.IDLE) == (not life.busy and not life.watching
                                              and life.slumber is Slumber.NONE)


@settings(max_examples=300)
@given(st.lists(INPUTS, max_size=30))
def test_the_crash_loop_count_stays_in_its_window_under_its_limit(inputs: list[Input]) -> None:
    life = IDLE_LIFE
    for inp in inputs:
        life, actions = step(life, inp)
        if isinstance(inp, RestartsCounted):
            assert len(life.restarts) <= inp.limit
            assert all(inp.now - t <= inp.window_s for t in life.restarts)
            if actions:  # a crash loop: counted afresh from here
                assert [type(a) for a in actions] == [CrashLoop] and life.restarts == ()


def test_every_job_and_slumber_has_its_phase() -> None:
    assert lifecycle.PHASE_OF_JOB.keys() == set(Job) - {Job.NONE}
    assert lifecycle.PHASE_OF_SLUMBER.keys() == set(Slumber) - {Slumber.NONE}


def test_a_sleep_is_refused_during_a_launch_and_a_wake_is_not() -> None:
    launching = ServeLife(launching=True)
    assert step(launching, SleepAsked()) == (launching, [Refuse(Phase.LAUNCHING)])
    woken, actions = step(launching, WakeAsked())
    assert (woken.slumber, actions) == (Slumber.WAKING, [])
    assert step(ServeLife(slumber=Slumber.WAKING, health_failures=1), SlumberEnded())[0] == \
        ServeLife(health_failures=1)
