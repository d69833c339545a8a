"""A serve's unit as systemd reports it, and what gpud does when it changes: the serve state
machine as a pure function, `on_unit(runtime, unit) -> actions`, tested from a table
(tests/test_unitstate.py). The supervisor hears the D-Bus signal, gathers the runtime, and only
carries the actions out.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpud.core.vocab import (
    FAILED,
    LIVE_STATES,
    ORPHAN,
    RUNNING,
    SLEEPING,
    STARTING,
    STOPPING,
    ServeState,
    UnitActiveState,
)

# systemd's ActiveState values in which the unit's processes may run.
ACTIVE = frozenset({UnitActiveState.ACTIVE, UnitActiveState.ACTIVATING,
                    UnitActiveState.RELOADING, UnitActiveState.DEACTIVATING})


@dataclass(frozen=True)
class UnitState:
    serve: str
    unit: str
    active_state: str
    sub_state: str
    result: str
    n_restarts: int
    main_pid: int
    exec_main_status: int
    invocation_id: str
    control_group: str
    # CLD_EXITED (1): exec_main_status is an exit status; CLD_KILLED/CLD_DUMPED (2/3): a signal.
    exec_main_code: int = 0
    # "loaded"; "bad-setting" when systemd could not re-read the unit (it keeps running, but
    # cannot be restarted).
    load_state: str = "loaded"
    active_exit_us: int = 0
    exec_main_exit_us: int = 0

    @property
    def stopped_by_job(self) -> bool:
        """The unit left "active" before its main process exited: a stop job (or a restart
        job) ended it, not the process by itself."""
        return 0 < self.active_exit_us < self.exec_main_exit_us

    @property
    def ended(self) -> bool:
        """Its process is gone (for good, or until systemd's restart)."""
        return (self.active_state in (UnitActiveState.FAILED, UnitActiveState.INACTIVE)
                or self.sub_state == "auto-restart")

    @property
    def gone(self) -> bool:
        """Its process is gone and systemd is not restarting it."""
        return self.ended and self.sub_state != "auto-restart"

    @property
    def how(self) -> str:
        if self.exec_main_code in (2, 3):
            return f"killed by signal {self.exec_main_status}"
        return f"status {self.exec_main_status}"


@dataclass(frozen=True)
class ServeRuntime:
    """What gpud knows of one serve when its unit changes."""

    state: ServeState
    holds: bool  # the serve holds a reservation
    configured: bool
    resident: bool
    restart: str  # the serve's restart policy ("no" when not configured)
    launching: bool  # a start of gpud's is under way
    stopping: bool  # a stop of gpud's is under way
    prev: UnitState | None  # the unit as last seen
    exit_seen: str | None  # the invocation whose exit was already handled
    # Whether the host is shutting down; None until asked (it costs a D-Bus call).
    shutting_down: bool | None = None


# The actions, each a value; the supervisor carries them out in order.
@dataclass(frozen=True)
class CountRestarts:
    count: int  # systemd restarted the unit this many times since last seen; a crash loop
    #             found while counting ends the list


@dataclass(frozen=True)
class AskShutdown:
    """Decide again once it is known whether the host is shutting down."""


@dataclass(frozen=True)
class OrphanEnded:
    how: str


@dataclass(frozen=True)
class ReleaseEnded:
    """A failed, non-resident serve kept its reservation while its unit ran on: gone now."""


@dataclass(frozen=True)
class StopEnded:
    """gpud's stop gave up waiting (its job failed or timed out) and left the serve stopping,
    its reservation held: the unit has ended since, and the stop is complete."""

    how: str


@dataclass(frozen=True)
class OutsideStop:
    """Someone stopped the unit by hand: the operator's stop."""


@dataclass(frozen=True)
class SeenExit:
    invocation: str


@dataclass(frozen=True)
class Restarting:
    """The process exited and systemd restarts it; whether it did is confirmed later."""

    how: str
    invocation: str


@dataclass(frozen=True)
class Fail:
    reason: str
    # Stop the unit first: a serve that died asleep must not come back through systemd's
    # restart at its full size while its reservation is its sleep reservation.
    stop: bool = False
    crash_loop: bool = False  # a crash loop (its event says so), not a single exit


@dataclass(frozen=True)
class WatchRestart:
    """Active again, still starting: wait for its health."""


@dataclass(frozen=True)
class AdoptOutsideStart:
    """Started by hand while gpud had it stopped: adopt it."""


Action = (CountRestarts | AskShutdown | OrphanEnded | ReleaseEnded | StopEnded | OutsideStop
          | SeenExit | Restarting | Fail | WatchRestart | AdoptOutsideStart)


def will_restart(restart: str, unit: UnitState) -> bool:
    """Whether systemd restarts the unit after this exit (Restart= no, on-failure, always)."""
    if restart == "no":
        return False
    return restart == "always" or unit.result != "success"


def on_unit(rt: ServeRuntime, st: UnitState) -> list[Action]:
    """What a change of the serve's unit means, as actions."""
    if rt.stopping:
        return []  # gpud's own stop: it records what happens itself
    prev, state = rt.prev, rt.state
    actions: list[Action] = []
    if prev is not None and st.n_restarts > prev.n_restarts and state != FAILED:
        actions.append(CountRestarts(st.n_restarts - prev.n_restarts))
    restarting = st.sub_state == "auto-restart"
    if st.ended and state == ORPHAN and not restarting:
        return [*actions, OrphanEnded(st.how)]
    if st.ended and state == FAILED and rt.holds:
        if rt.configured and not rt.resident and not restarting:
            actions.append(ReleaseEnded())
        return actions
    if st.gone and state == STOPPING:
        return [*actions, StopEnded(st.how)]
    if st.ended and state in (RUNNING, STARTING, SLEEPING):
        if st.stopped_by_job and not rt.launching and not restarting:
            if rt.shutting_down is None:
                return [*actions, AskShutdown()]
            if not rt.shutting_down:
                # (At a host shutdown systemd stops every unit: no operator's choice, and the
                # resident set must come back at the next boot.)
                return [*actions, OutsideStop()]
        if rt.launching and st.active_state == UnitActiveState.INACTIVE and prev is None:
            return actions
        if st.result == "start-limit-hit":
            return [*actions, Fail("crash-loop: systemd's start limit was hit")]
        if rt.exit_seen == st.invocation_id:
            return actions  # the same exit, seen again on its way through the restart states
        actions.append(SeenExit(st.invocation_id))
        if state == SLEEPING:
            return [*actions, Fail(f"exited while asleep ({st.how}, result {st.result})",
                                   stop=True)]
        if rt.launching and state == STARTING and st.n_restarts > 0:
            # Exited again during gpud's start, after systemd's restart: a crash loop before it
            # ever answered. Its start fails now, not at the crash-loop limit or the start
            # timeout (a load that dies after seconds never reaches either), and the unit is
            # stopped so that systemd does not go on restarting it. NRestarts counts systemd's
            # restarts since the unit's last start that was not one of them (systemd,
            # src/core/service.c: service_enter_restart() counts, service_start() flushes
            # the count on any other start).
            return [*actions, Fail(f"crash-loop: exited {st.n_restarts + 1} times during its start, "
                                   f"before it ever answered (last: {st.how}, result "
                                   f"{st.result})", stop=True, crash_loop=True)]
        if will_restart(rt.restart, st):
            # systemd passes through failed, auto-restart and inactive before the restart:
            # whether the serve is gone for good is known only once the restart did or did not
            # come.
            return [*actions, Restarting(st.how, st.invocation_id)]
        return [*actions, Fail(f"exited ({st.how}, result {st.result})")]
    if st.active_state == UnitActiveState.ACTIVE and state == STARTING and not rt.launching:
        actions.append(WatchRestart())
    elif (st.active_state == UnitActiveState.ACTIVE and state not in LIVE_STATES and state != FAILED
          and not rt.launching and prev is not None and prev.active_state not in ACTIVE):
        actions.append(AdoptOutsideStart())
    return actions

