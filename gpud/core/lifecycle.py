"""A serve's life under the supervisor as one record and one pure function.

`ServeLife` is everything gpud itself knows of a serve's runtime beyond its recorded state: the
work of gpud's under way on it (its `phase`), its unit as last seen, the exit already handled,
the restarts counted toward the crash-loop limit, the health checks failed in a row, the
listener confirmed as its own, and the devices its memory is on its way back to.

`step(life, input) -> (life, actions)` is how it changes: every input is something the
supervisor does or hears (a start asked, a launch ended, a job of gpud's on the unit begun or
ended, the unit's signal, a restart counted, a health verdict, a port check, memory going and
coming back); the actions are what the supervisor carries out. The unit's signal is decided by
`gpud.core.unitstate.on_unit`, fed from the record. Tested from a table over every (phase,
input) pair and a property over sequences of inputs (tests/test_lifecycle.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum

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
)
from gpud.core.vocab import Phase, ServeState


class Job(StrEnum):
    """A job of gpud's on the serve's unit, under way. While one is, the unit's signals are
    gpud's own doing, and the job records what happens itself."""

    NONE = "none"
    STOP = "stop"  # gpuctl stop, the first half of a restart, an orphan's stop
    RESTART = "restart"  # the health check's restart through the unit
    FAIL_STOP = "fail-stop"  # the unit stopped because the serve failed


class Slumber(StrEnum):
    """A sleep or a wake of gpud's under way (gpud.life.sleeping): from its checks to its commit."""

    NONE = "none"
    FALLING_ASLEEP = "falling-asleep"
    WAKING = "waking"


PHASE_OF_JOB = {Job.STOP: Phase.STOPPING, Job.RESTART: Phase.RESTARTING,
                Job.FAIL_STOP: Phase.FAILING}
PHASE_OF_SLUMBER = {Slumber.FALLING_ASLEEP: Phase.FALLING_ASLEEP, Slumber.WAKING: Phase.WAKING}


@dataclass(frozen=True)
class ServeLife:
    job: Job = Job.NONE
    launching: bool = False  # a start's launch task is under way
    watching: bool = False  # one wait on a restart's health is under way (never two)
    slumber: Slumber = Slumber.NONE
    unit: UnitState | None = None  # the unit as last seen
    exit_seen: str | None = None  # the invocation whose exit was already handled
    restarts: tuple[float, ...] = ()  # when each restart in the crash-loop window was counted
    health_failures: int = 0  # health checks failed in a row while running
    port_owner: tuple[int, float] | None = None  # (MainPID, when) its own listener was confirmed
    returning: frozenset[str] = field(default_factory=frozenset)  # devices its memory goes back to

    @property
    def phase(self) -> Phase:
        if self.job is not Job.NONE:
            return PHASE_OF_JOB[self.job]
        if self.launching:
            return Phase.LAUNCHING
        if self.slumber is not Slumber.NONE:
            return PHASE_OF_SLUMBER[self.slumber]
        return Phase.AWAITING_HEALTH if self.watching else Phase.IDLE

    @property
    def stopping(self) -> bool:
        """A job of gpud's on the unit is under way."""
        return self.job is not Job.NONE

    @property
    def busy(self) -> bool:
        """A lifecycle action of gpud's is under way: a launch or a job on the unit."""
        return self.launching or self.stopping


IDLE_LIFE = ServeLife()


# ---- inputs ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class StartAsked:
    """A start of the serve, admitted, is about to launch it."""


@dataclass(frozen=True)
class LaunchEnded:
    """The launch task ended (healthy, failed or cancelled)."""


@dataclass(frozen=True)
class JobBegan:
    job: Job


@dataclass(frozen=True)
class JobEnded:
    job: Job


@dataclass(frozen=True)
class WatchAsked:
    """Something asks to wait for the serve's health after its unit came back."""


@dataclass(frozen=True)
class WatchEnded:
    pass


@dataclass(frozen=True)
class SleepAsked:
    """A sleep of the serve is asked (its lock held, the serve running)."""


@dataclass(frozen=True)
class WakeAsked:
    """A wake of the serve is asked (its lock held, the serve sleeping)."""


@dataclass(frozen=True)
class SlumberEnded:
    """The sleep or the wake under way ended (done, refused or failed)."""


@dataclass(frozen=True)
class UnitStarted:
    """gpud's launch started the unit: a fresh run, no restarts counted yet."""

    unit: UnitState


@dataclass(frozen=True)
class UnitSeen:
    """The unit as gpud read it (adoption, a restart's answer)."""

    unit: UnitState


@dataclass(frozen=True)
class UnitGone:
    """systemd has no unit of the serve: what was last seen of it is past."""


@dataclass(frozen=True)
class UnitChanged:
    """The unit's signal, with what the supervisor knows of the serve outside the record.
    `prev` is the unit as last seen before this signal (given, so that deciding again once the
    host's shutdown is known decides on the same change)."""

    unit: UnitState
    prev: UnitState | None
    state: ServeState
    holds: bool
    configured: bool
    resident: bool
    restart: str
    # for the restarts systemd made: daemon.crash_loop_window_s and crash_loop_restarts
    now: float
    window_s: float
    limit: int
    shutting_down: bool | None = None


@dataclass(frozen=True)
class RestartsCounted:
    count: int
    now: float
    window_s: float
    limit: int


@dataclass(frozen=True)
class HealthCounted:
    """A running serve's health verdict: `failures` checks failed in a row (0: healthy)."""

    failures: int


@dataclass(frozen=True)
class PortChecked:
    """Who listens on the serve's port was looked up at `at`: its own unit (`own`, MainPID
    `pid`), or not."""

    own: bool
    pid: int
    at: float


@dataclass(frozen=True)
class MemoryLeaving:
    """The serve stops or ended: its memory goes back to these devices."""

    devices: frozenset[str]


@dataclass(frozen=True)
class MemoryBack:
    """A start on `device` waited for the serve's memory there (back, or given up on)."""

    device: str


Input = (StartAsked | LaunchEnded | JobBegan | JobEnded | WatchAsked | WatchEnded
         | SleepAsked | WakeAsked | SlumberEnded | UnitStarted | UnitSeen | UnitGone
         | UnitChanged | RestartsCounted | HealthCounted | PortChecked | MemoryLeaving
         | MemoryBack)


# ---- actions --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Refuse:
    """The start (or the sleep) is not to go on: something of gpud's is already under way."""

    phase: Phase


@dataclass(frozen=True)
class CancelLaunch:
    """A stop begins while the serve's launch runs: the launch must not go on to run a unit
    whose reservation the stop releases."""


@dataclass(frozen=True)
class Watch:
    """Wait for the serve's health (no other wait is under way)."""


@dataclass(frozen=True)
class CrashLoop:
    reason: str


@dataclass(frozen=True)
class Restarted:
    """systemd restarted the unit `count` times since it was last seen; with `crash_loop`,
    that made a crash loop, and nothing of the signal is done after it (the serve fails)."""

    count: int
    crash_loop: str | None


LifeAction = (Refuse | CancelLaunch | Watch | CrashLoop | Restarted | AskShutdown | OrphanEnded
              | ReleaseEnded | StopEnded | OutsideStop | Restarting | Fail | WatchRestart
              | AdoptOutsideStart)


def start_refused(life: ServeLife) -> Phase | None:
    """Why a start may not begin (the phase in its way), or None: one launch at a time, and
    none while a job of gpud's on the unit, a sleep or a wake is under way."""
    return life.phase if life.busy or life.slumber is not Slumber.NONE else None


def _count(life: ServeLife, count: int, now: float, window_s: float,
           limit: int) -> tuple[ServeLife, str | None]:
    """Restarts (systemd's or gpud's) counted in the crash-loop window; the crash-loop reason
    once there are more than `limit` in it (the count starts again)."""
    times = [t for t in (*life.restarts, *([now] * count)) if now - t <= window_s]
    if len(times) > limit:
        return (replace(life, restarts=()),
                f"crash-loop: {len(times)} restarts in {window_s:g} s (limit {limit})")
    return replace(life, restarts=tuple(times)), None


def _unit_changed(life: ServeLife, inp: UnitChanged) -> tuple[ServeLife, list[LifeAction]]:
    rt = ServeRuntime(state=inp.state, holds=inp.holds, configured=inp.configured,
                      resident=inp.resident, restart=inp.restart, launching=life.launching,
                      stopping=life.stopping, prev=inp.prev, exit_seen=life.exit_seen,
                      shutting_down=inp.shutting_down)
    life = replace(life, unit=inp.unit)
    out: list[LifeAction] = []
    for action in on_unit(rt, inp.unit):
        if isinstance(action, CountRestarts):
            life, loop = _count(life, action.count, inp.now, inp.window_s, inp.limit)
            out.append(Restarted(action.count, loop))
            if loop is not None:
                return life, out
        elif isinstance(action, SeenExit):
            life = replace(life, exit_seen=action.invocation)
        else:
            out.append(action)
    return life, out


def step(life: ServeLife, inp: Input) -> tuple[ServeLife, list[LifeAction]]:
    """The serve's life after `inp`, and what the supervisor is to do about it."""
    if isinstance(inp, StartAsked):
        refused = start_refused(life)
        if refused is not None:
            return life, [Refuse(refused)]
        return replace(life, launching=True), []
    if isinstance(inp, LaunchEnded):
        return replace(life, launching=False), []
    if isinstance(inp, JobBegan):
        # The launch's own clean-up (LaunchEnded) comes once its cancellation is through.
        cancel: list[LifeAction] = ([CancelLaunch()] if inp.job is Job.STOP and life.launching
                                    else [])
        return replace(life, job=inp.job), cancel
    if isinstance(inp, JobEnded):
        # A job begun during another takes over; the earlier one's end leaves it be.
        job = Job.NONE if life.job is inp.job else life.job
        if inp.job is Job.STOP:
            # Whatever the unit does next is a new run's.
            return replace(life, job=job, unit=None, port_owner=None), []
        if inp.job is Job.RESTART:
            # a new process: its listener is looked up again
            return replace(life, job=job, port_owner=None), []
        return replace(life, job=job), []
    if isinstance(inp, WatchAsked):
        if life.watching:
            return life, []
        return replace(life, watching=True), [Watch()]
    if isinstance(inp, WatchEnded):
        return replace(life, watching=False), []
    if isinstance(inp, SleepAsked):
        # A launch, a job on the unit or another sleep or wake decides the serve's memory now.
        refused = start_refused(life)
        if refused is not None:
            return life, [Refuse(refused)]
        return replace(life, slumber=Slumber.FALLING_ASLEEP), []
    if isinstance(inp, WakeAsked):
        # Never refused: a sleeping serve is woken whatever else is under way (a failing stop
        # of it ends it either way).
        return replace(life, slumber=Slumber.WAKING), []
    if isinstance(inp, SlumberEnded):
        return replace(life, slumber=Slumber.NONE), []
    if isinstance(inp, UnitStarted):
        return replace(life, unit=inp.unit, restarts=()), []
    if isinstance(inp, UnitSeen):
        return replace(life, unit=inp.unit), []
    if isinstance(inp, UnitGone):
        return replace(life, unit=None), []
    if isinstance(inp, UnitChanged):
        return _unit_changed(life, inp)
    if isinstance(inp, RestartsCounted):
        life, loop = _count(life, inp.count, inp.now, inp.window_s, inp.limit)
        return life, [] if loop is None else [CrashLoop(loop)]
    if isinstance(inp, HealthCounted):
        return replace(life, health_failures=max(0, inp.failures)), []
    if isinstance(inp, PortChecked):
        owner = (inp.pid, inp.at) if inp.own and inp.pid else None
        return replace(life, port_owner=owner), []
    if isinstance(inp, MemoryLeaving):
        return replace(life, returning=life.returning | inp.devices), []
    return replace(life, returning=life.returning - {inp.device}), []


def own_listener_trusted(life: ServeLife, pid: int, now: float, recheck_s: float) -> bool:
    """The serve's own listener was confirmed for this MainPID less than `recheck_s` ago."""
    owner = life.port_owner
    return owner is not None and pid != 0 and owner[0] == pid and now - owner[1] < recheck_s
