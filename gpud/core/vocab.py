"""gpud's vocabulary: the words it acts on, defined once, standard library only (gpuctl imports
this module, and it costs it nothing).

Members are `StrEnum`s: they compare equal to, and serialize as, the plain strings the API,
the store and journald carry.
"""

from __future__ import annotations

import re
from enum import StrEnum


class ServeState(StrEnum):
    DECLARED = "declared"  # configured, no reservation
    ADMITTED = "admitted"  # reserved, not launched
    STARTING = "starting"  # unit started, health not yet 200
    RUNNING = "running"  # healthy
    STOPPING = "stopping"
    DENIED = "denied"  # the last admission failed, with its reason
    FAILED = "failed"  # exited, unhealthy or crash-looping, with the reason
    EXTERNAL = "external"  # a reservation for a process gpud did not launch
    ORPHAN = "orphan"  # a unit of gpud's that runs for a serve the config does not name
    SLEEPING = "sleeping"  # its unit runs, vLLM's sleep mode holds it at its sleep reservation


(DECLARED, ADMITTED, STARTING, RUNNING, STOPPING, DENIED, FAILED, EXTERNAL, ORPHAN,
 SLEEPING) = ServeState
STATES: tuple[ServeState, ...] = tuple(ServeState)
# A process of the serve may hold memory in these.
LIVE_STATES = frozenset({STARTING, RUNNING, STOPPING, SLEEPING})
# These must hold a reservation (a stopping serve gives its back once its unit is gone).
HOLDING_STATES = frozenset({STARTING, RUNNING, SLEEPING})
# Reserved but not (fully) drawing yet: the shortfall is "pending" memory that physical free
# cannot give to anyone else. A sleeping serve is one of them: asleep it may draw less than its
# sleep reservation, and while it wakes it holds its full reservation before drawing it.
PENDING_STATES = frozenset({ADMITTED, STARTING, SLEEPING})


class Phase(StrEnum):
    """What gpud is doing with the serve, the most telling first: a job on its unit, else its
    launch, else a sleep or a wake, else a wait on a restart's health, else nothing
    (gpud.core.lifecycle.ServeLife.phase). A serve's answer carries it: gpuctl waits for
    the start it began until it is `idle` again, never on a state from before it."""

    IDLE = "idle"  # nothing: what its unit does is the serve's own doing (or an operator's)
    LAUNCHING = "launching"  # a start: from its admission until healthy, failed or cancelled
    AWAITING_HEALTH = "awaiting-health"  # its unit came back (a restart, an adoption): until
    #                                      its health answers or its start timeout
    STOPPING = "stopping"
    RESTARTING = "restarting"
    FAILING = "failing"
    FALLING_ASLEEP = "falling-asleep"
    WAKING = "waking"


PHASES: tuple[Phase, ...] = tuple(Phase)


class UnitActiveState(StrEnum):
    """A systemd unit's ActiveState, as systemd names it (systemd src/basic/unit-def.c,
    `unit_active_state_table`; the D-Bus property ActiveState carries these strings)."""

    ACTIVE = "active"
    RELOADING = "reloading"
    INACTIVE = "inactive"
    FAILED = "failed"
    ACTIVATING = "activating"
    DEACTIVATING = "deactivating"
    MAINTENANCE = "maintenance"
    REFRESHING = "refreshing"


class DenialBound(StrEnum):
    """What refused an admission (a denial's `bound`, in its details and event): the ledger's
    arithmetic, the device's physical free memory, a lost device, admissions held (the
    invariant, a change under way), the host's RAM a sleep parks memory in."""

    LEDGER = "ledger"
    PHYSICAL = "physical"
    DEVICE = "device"
    HELD = "held"
    HOST_RAM = "host-ram"


class SleepAction(StrEnum):
    """What a preemption does to a serve of lower priority (`serves.NAME.preemptible`)."""

    SLEEP = "sleep"  # vLLM's sleep mode: its reservation shrinks to sleep_mib
    STOP = "stop"  # its unit is stopped and its reservation released


class StepKind(StrEnum):
    """A step of an apply or a preemption (gpud.core.actions): what it does to the config or a
    serve. Several are named like the events they cause; they are steps, not events."""

    BACKUP = "backup"
    STOP = "stop"
    RELEASE = "release"
    WRITE = "write"
    RELOAD = "reload"
    RESTART = "restart"
    RESIZE = "resize"
    START = "start"
    VERIFY = "verify"
    RESTORE = "restore"
    ADMIT = "admit"
    SLEEP = "sleep"
    WAKE = "wake"


class ApplyOutcome(StrEnum):
    """How an apply ended (POST /v1/apply's last line, `result`)."""

    APPLIED = "applied"
    ROLLED_BACK = "rolled-back"  # a step failed: the steps done were undone
    REFUSED = "refused"  # nothing was changed
    FAILED = "failed"  # gpud's own fault, mid-apply


class Gone(StrEnum):
    """Where a rebalance plan shows a serve the new config no longer names (its state_after):
    not a serve state, since such a serve has none after the apply."""

    REMOVED = "removed"


class EventKind(StrEnum):
    ADMIT = "admit"
    DENY = "deny"
    RELEASE = "release"
    START = "start"
    HEALTHY = "healthy"
    EXIT = "exit"
    RESTART = "restart"
    CRASH_LOOP = "crash-loop"
    STOP = "stop"
    UNHEALTHY = "unhealthy"
    OVERDRAW = "overdraw"
    RESERVE_EXCEEDED = "reserve-exceeded"
    RESERVE_OK = "reserve-ok"
    RELOAD = "reload"
    ADOPT = "adopt"
    OVER_COMMITTED = "over-committed"
    CALIBRATE = "calibrate"
    APPLY = "apply"
    DEVICE_LOST = "device-lost"  # NVML or the simulation reports a device unreadable
    DEVICE_BACK = "device-back"
    SLEEP = "sleep"  # a serve put to sleep, its reservation shrunk in the same transaction
    WAKE = "wake"
    PREEMPT = "preempt"  # a plan to make room for a serve by putting lower ones to sleep
    PULL = "pull"  # a container serve's image pulled before its start (pull = "missing")
    # GPU memory held by a container process outside every serve unit (an engine that does not
    # keep its containers in the unit's cgroup): counted as non-ledger draw, and said so
    CONTAINER_OUTSIDE_UNIT = "container-outside-unit"
    # The invariant (gpud.core.transition.violations) found false after a commit, or true again
    INVARIANT = "invariant"
    # Journaled (GPUD_EVENT) but never stored as an event: a mutation refused to a peer that
    # may not make it, and a start that waited past daemon.memory_return_timeout_s for NVML
    # to show a stopped serve's memory back.
    FORBIDDEN = "forbidden"
    MEMORY_NOT_BACK = "memory-not-back"


JOURNAL_ONLY_KINDS: frozenset[EventKind] = frozenset({EventKind.FORBIDDEN,
                                                      EventKind.MEMORY_NOT_BACK})
# The kinds of the events gpud stores and answers (GET /v1/events, metrics, gpuctl events).
EVENT_KINDS: tuple[EventKind, ...] = tuple(k for k in EventKind if k not in JOURNAL_ONLY_KINDS)
# Logged as warnings: something was refused or is wrong.
WARNING_KINDS: frozenset[EventKind] = frozenset({
    EventKind.DENY, EventKind.CRASH_LOOP, EventKind.OVERDRAW, EventKind.RESERVE_EXCEEDED,
    EventKind.OVER_COMMITTED})
# The kinds whose rate the Grafana dashboard's "Events per minute" panel shows
# (scripts/dashboard.py): the warnings, and what happens to serves without an operator's command.
WATCHED_KINDS: tuple[EventKind, ...] = tuple(
    k for k in EVENT_KINDS
    if k in WARNING_KINDS or k in {EventKind.EXIT, EventKind.RESTART, EventKind.UNHEALTHY,
                                   EventKind.SLEEP, EventKind.WAKE, EventKind.PREEMPT,
                                   EventKind.DEVICE_LOST, EventKind.CONTAINER_OUTSIDE_UNIT})

# Serve and role names become systemd unit names and URL path segments.
NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"
NAME_RE = re.compile(NAME_PATTERN)
# Environment variable names a serve may set.
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# A serve's systemd unit is SERVE_UNIT_PREFIX + NAME + SERVE_UNIT_SUFFIX; serve_unit spells it,
# serve_of_unit reads it back, and nothing else in gpud writes the name out.
SERVE_UNIT_PREFIX = "gpud-serve-"
SERVE_UNIT_SUFFIX = ".service"


def serve_unit(name: str) -> str:
    """The systemd unit of serve NAME: ``gpud-serve-NAME.service``. Does not check the name
    (the callers that take one from outside check it against NAME_RE first)."""
    return f"{SERVE_UNIT_PREFIX}{name}{SERVE_UNIT_SUFFIX}"


def serve_of_unit(unit: str) -> str | None:
    """The serve a unit name belongs to, or None for any unit gpud does not own."""
    if not (unit.startswith(SERVE_UNIT_PREFIX) and unit.endswith(SERVE_UNIT_SUFFIX)):
        return None
    name = unit[len(SERVE_UNIT_PREFIX) : -len(SERVE_UNIT_SUFFIX)]
    return name if NAME_RE.match(name) else None


# gpuctl's exit code for each error.code the daemon answers with (docs/api.md): 2 for bad input,
# 1 for a refusal or a fault. The error tree (gpud.errors, the floor below) states each class's
# exit code itself; tests/test_errors.py holds it equal to this table.
EXIT_CODES: dict[str, int] = {
    "internal": 1,
    "bad-request": 2,
    "config-invalid": 2,
    "forbidden": 1,
    "not-found": 2,
    "payload-too-large": 2,
    "request-timeout": 1,
    "too-many-requests": 1,
    "refused": 1,
    "denied": 1,
    "conflict": 1,
    "unavailable": 1,
    "unit-job-failed": 1,
    "store-failed": 1,
}
