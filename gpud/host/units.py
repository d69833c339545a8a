"""The adapter to systemd's service manager: serves as transient units, over the system bus.

All D-Bus traffic goes through ``SystemdUnits._call`` and every D-Bus or connection error
becomes a gpud error in ``map_error`` (gpud.host.unitbus, with the bus's names and the
unit state's properties): the one choke point for dbus-fast, nothing above it
sees a dbus-fast error.

Calls are raw ``dbus_fast.Message`` objects with explicit signatures, not proxy objects:
systemd's Manager introspection is ~100 KiB of XML that a proxy would fetch and parse before
the first call (and again after every reconnect), and an explicit signature at the call site is
the wire format in plain sight, as the property table in ``gpud.host.unit_properties`` is.

Signals, not polling:

- ``Manager.Subscribe()`` is called on every connection: systemd sends unit and job signals on
  the system bus only while someone is subscribed.
- ``JobRemoved`` ends ``start`` and ``stop``. The match rule and the per-unit job watch exist
  before the method call, so a job that finishes before the reply is read is not missed.
- ``PropertiesChanged`` on ``/org/freedesktop/systemd1/unit/*`` drives ``watch`` callbacks.
  systemd sends one signal per interface (Service, then Unit); signals read in one batch are
  coalesced into one callback, but never across a change: a signal that would overwrite a
  value not yet reported (a process's exit, then its restart, read together on a loaded host)
  or that begins a new invocation first has the state so far reported. Properties a signal
  does not carry (never seen, invalidated, or a new invocation) are fetched once with
  ``GetAll``.
- Signals are accepted only from the current owner of ``org.freedesktop.systemd1``: the bus
  delivers unicast signals from anybody, and a forged ``JobRemoved`` must not end a wait.

When the connection drops (dbus-daemon restarted) the adapter marks itself unavailable,
reconnects with backoff, subscribes again and hands every callback the fresh state of every
gpud serve unit (and ``on_resync`` the whole list: a serve missing from it has no unit).

This adapter is how gpud manages its serves' units, but not the only way gpud reaches systemd:
the podman commands of a container serve (``podman image exists``, ``podman pull``:
gpud.host.containers) run through systemd's own clients, as subprocesses. Such a command runs
outside gpud.service's sandbox, as a transient unit, with its output piped back to gpud and its
exit status returned: that is ``systemd-run --wait --pipe``, which hands the client's own
stdin/stdout/stderr to the unit (file descriptors passed over the bus:
``StandardInputFileDescriptor`` and the like, systemd's src/run/run.c ``ARG_STDIO_DIRECT``) and
waits for the unit's end and exit status. Doing that here would mean passing descriptors over
dbus-fast and writing systemd-run's wait again, for a command that runs once before a container
serve's start, outside the serves' unit watch and their locks. The stop of such a command cut
short (``systemctl stop`` of its unit, and of ``gpud-image-*.service`` left by a gpud that
died mid-pull: systemctl matches the pattern against the loaded units) goes with it. These are
the only runs of the service manager's clients (systemctl, systemd-run) in gpud, and nothing of
a serve's own unit goes through them; journalctl, which gpud also runs, reads the journal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import dbus_fast
import dbus_fast.aio
from dbus_fast import BusType, Message, MessageType, Variant
from dbus_fast.errors import DBusError, InvalidAddressError

from gpud.core.unitstate import UnitState
from gpud.core.vocab import UnitActiveState, serve_of_unit
from gpud.errors import (
    Conflict,
    GpudError,
    JobFailed,
    NotFound,
    Unavailable,
)
from gpud.host.unit_properties import (
    UnitSpec,
    build_properties,
    unit_name,
)
from gpud.host.unitbus import (
    ALREADY_SUBSCRIBED,
    CONNECTION_ERRORS,
    DBUS,
    DBUS_PATH,
    MANAGER_IFACE,
    MANAGER_PATH,
    MATCH_RULES,
    PROPERTIES_IFACE,
    SERVE_UNIT_PATTERN,
    STATE_INTERFACES,
    STATE_PROPERTIES,
    SYSTEMD,
    UNIT_EXISTS,
    UNIT_IFACE,
    map_error,
    state_from,
    systemd_major,
    typed_properties,
    unit_of_path,
)

log = logging.getLogger("gpud.units")


# --- job waits ------------------------------------------------------------------------------


@dataclass
class _JobWatch:
    """Collects JobRemoved results for one unit from before the method call on."""

    unit: str
    results: dict[str, str] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    error: GpudError | None = None

    def put(self, job: str, result: str) -> None:
        self.results[job] = result
        self.changed.set()

    def fail(self, error: GpudError) -> None:
        self.error = error
        self.changed.set()

    async def wait(self, job: str) -> str:
        while job not in self.results:
            if self.error is not None:
                raise self.error
            self.changed.clear()
            await self.changed.wait()
        return self.results[job]


@dataclass
class _Tracked:
    """What the adapter knows of one serve unit's properties."""

    props: dict[str, Any] = field(default_factory=dict)
    fetching: bool = False
    touched: set[str] = field(default_factory=set)
    # Properties changed since the last callback: what the next one reports.
    pending: set[str] = field(default_factory=set)
    emitted: UnitState | None = None


StateCallback = Callable[[UnitState], None]
ResyncCallback = Callable[[list[UnitState]], None]


class SystemdUnits:
    """Serves as transient systemd units: start, stop, state, list, watch."""

    def __init__(
        self,
        bus_address: str | None = None,
        *,
        call_timeout: float = 25.0,
        reconnect_delays: Sequence[float] = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0),
    ) -> None:
        self._bus_address = bus_address
        self._call_timeout = call_timeout
        self._reconnect_delays = tuple(reconnect_delays)
        self._bus: dbus_fast.aio.MessageBus | None = None
        self._systemd_owner: str | None = None
        self._systemd_version: int | None = None
        self._reason: str | None = "not connected"
        self._closing = False
        self._supervisor: asyncio.Task[None] | None = None
        # Ends (with the reason) when the current connection does.
        self._bus_gone: asyncio.Task[str] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._job_watches: dict[str, list[_JobWatch]] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._dirty: set[str] = set()
        self._flush_scheduled = False
        self._callbacks: list[StateCallback] = []
        self._resync_callbacks: list[ResyncCallback] = []
        self.connects = 0  # successful connections so far; a reconnect makes it > 1

    # --- lifecycle --------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        return self._reason is None

    @property
    def reason(self) -> str | None:
        """Why units cannot be managed now; None while they can."""
        return self._reason

    @property
    def systemd_version(self) -> int | None:
        return self._systemd_version

    async def connect(self) -> None:
        """Connect and subscribe. Never raises for an unreachable bus: ``available`` says so,
        and a background task keeps trying (gpud's ledger works without systemd)."""
        self._closing = False
        try:
            await self._open()
        except GpudError as exc:
            self._mark_unavailable(exc.message)
        self._supervisor = asyncio.create_task(self._supervise(), name="gpud-units-supervisor")

    async def close(self) -> None:
        self._closing = True
        tasks = [t for t in (self._supervisor, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._supervisor = None
        gone = self._bus_gone
        self._drop_bus("closed")
        if gone is not None:
            # Let dbus-fast close its socket before the loop goes away.
            await asyncio.wait({gone}, timeout=2)
            gone.cancel()

    def watch(self, callback: StateCallback, on_resync: ResyncCallback | None = None) -> None:
        """Call ``callback`` on every change of a gpud serve unit's state; after a reconnect,
        with the fresh state of each, and ``on_resync`` with all of them."""
        self._callbacks.append(callback)
        if on_resync is not None:
            self._resync_callbacks.append(on_resync)

    # --- operations -------------------------------------------------------------------------

    async def start(self, spec: UnitSpec, timeout: float) -> UnitState:
        """Start ``spec`` as a transient unit and wait for its start job.

        An existing unit of the same name is a Conflict: gpud never starts a second copy.
        """
        unit = spec.unit
        properties = build_properties(spec, self._systemd_version)
        async with self._watch_jobs(unit) as jobs:
            try:
                (job,) = await self._call(
                    MANAGER_PATH,
                    MANAGER_IFACE,
                    "StartTransientUnit",
                    "ssa(sv)a(sa(sv))",
                    [unit, "fail", properties, []],
                    action=f"start {unit}",
                )
            except Conflict as exc:
                if exc.details.get("dbus_error") != UNIT_EXISTS:
                    raise
                raise Conflict(
                    f"serve {spec.serve} already has a unit ({unit}: running, stopping or "
                    "failed); gpud never starts a second copy",
                    {**exc.details, "serve": spec.serve, "unit": unit},
                ) from exc
            result = await self._wait_job(jobs, job, timeout, f"start {unit}")
        if result != "done":
            # With Restart= systemd would keep retrying a command that could not even be
            # started (missing binary, unknown user): gpud's start failed, so no unit stays.
            await self._discard(spec.serve, timeout)
            raise JobFailed(
                f"start {unit}: systemd job finished with result {result!r} (see journalctl -u {unit})",
                {"unit": unit, "serve": spec.serve, "result": result},
            )
        state = await self.state(spec.serve)
        if state is None:
            raise JobFailed(
                f"start {unit}: the unit ended and was collected right after starting "
                f"(see journalctl -u {unit})",
                {"unit": unit, "serve": spec.serve, "result": "collected"},
            )
        return state

    async def stop(self, serve: str, timeout: float) -> None:
        """Stop a serve's unit and wait for the stop job; a unit that is not loaded is fine."""
        await self.stop_unit(unit_name(serve), timeout, serve=serve)

    async def restart(self, serve: str, timeout: float) -> UnitState | None:
        """Restart a serve's unit (stop, then start the same unit) and wait for the job; the
        fresh state, None when the unit is gone."""
        unit = unit_name(serve)
        async with self._watch_jobs(unit) as jobs:
            (job,) = await self._call(
                MANAGER_PATH,
                MANAGER_IFACE,
                "RestartUnit",
                "ss",
                [unit, "replace"],
                action=f"restart {unit}",
            )
            result = await self._wait_job(jobs, job, timeout, f"restart {unit}")
        if result != "done":
            raise JobFailed(
                f"restart {unit}: systemd job finished with result {result!r}",
                {"unit": unit, "serve": serve, "result": result},
            )
        return await self.state(serve)

    async def shutting_down(self) -> bool:
        """Whether systemd is stopping the system (SystemState "stopping"); False when unknown."""
        try:
            (state,) = await self._call(
                MANAGER_PATH,
                PROPERTIES_IFACE,
                "Get",
                "ss",
                [MANAGER_IFACE, "SystemState"],
                action="read the system state",
            )
        except GpudError:
            return False
        return bool(state.value == "stopping")

    async def _discard(self, serve: str, timeout: float) -> None:
        try:
            await self.stop(serve, timeout)
            await self.reset_failed(serve)
        except GpudError as exc:
            log.warning("could not remove the unit of %s after a failed start: %s", serve, exc)

    async def reset_failed(self, serve: str) -> None:
        unit = unit_name(serve)
        with contextlib.suppress(NotFound):
            await self._call(
                MANAGER_PATH,
                MANAGER_IFACE,
                "ResetFailedUnit",
                "s",
                [unit],
                action=f"reset-failed {unit}",
            )

    async def list_serves(self) -> list[UnitState]:
        """The state of every loaded gpud serve unit (for adoption at startup)."""
        (units,) = await self._call(
            MANAGER_PATH,
            MANAGER_IFACE,
            "ListUnitsByPatterns",
            "asas",
            [[], [SERVE_UNIT_PATTERN]],
            action="list serve units",
        )
        # a(ssssssouso): name, description, load state, active, sub, following, path, ...
        # A running unit counts whatever its load state ("bad-setting" after a reload that
        # failed): gpud must never start a second copy. An inactive "not-found" one is a ghost.
        paths = {
            name: path
            for name, _desc, load, active, _sub, _following, path, *_job in units
            if serve_of_unit(name) and not (load == "not-found" and active == UnitActiveState.INACTIVE)
        }
        states = await asyncio.gather(*(self._fetch(unit, path) for unit, path in paths.items()))
        return sorted((s for s in states if s is not None), key=lambda s: s.unit)

    async def state(self, serve: str) -> UnitState | None:
        """The state of a serve's unit; None when it is not loaded."""
        unit = unit_name(serve)
        try:
            (path,) = await self._call(
                MANAGER_PATH, MANAGER_IFACE, "GetUnit", "s", [unit], action=f"state of {unit}"
            )
        except NotFound:
            return None
        return await self._fetch(unit, path)

    # --- units that are not serves (the front) ----------------------------------------------

    async def active_state(self, unit: str) -> str | None:
        """ActiveState of any unit; None when it is not loaded."""
        value = await self.unit_property(unit, "ActiveState")
        return None if value is None else str(value)

    async def unit_property(self, unit: str, name: str) -> Any:
        """One property of any unit's org.freedesktop.systemd1.Unit interface (ActiveState,
        Description...); None when the unit is not loaded."""
        try:
            (path,) = await self._call(
                MANAGER_PATH, MANAGER_IFACE, "GetUnit", "s", [unit], action=f"state of {unit}"
            )
            (value,) = await self._call(path, PROPERTIES_IFACE, "Get", "ss", [UNIT_IFACE, name],
                                        action=f"{name} of {unit}")
        except NotFound:
            return None
        return value.value

    async def stop_unit(self, unit: str, timeout: float, **details: str) -> None:
        """Stop any UNIT and wait for the stop job; a unit that is not loaded is fine. DETAILS
        go into the error of a stop that fails."""
        async with self._watch_jobs(unit) as jobs:
            try:
                (job,) = await self._call(MANAGER_PATH, MANAGER_IFACE, "StopUnit", "ss",
                                          [unit, "replace"], action=f"stop {unit}")
            except NotFound:
                return
            result = await self._wait_job(jobs, job, timeout, f"stop {unit}")
        if result != "done":
            raise JobFailed(f"stop {unit}: systemd job finished with result {result!r}",
                            {"unit": unit, **details, "result": result})

    async def start_transient(self, unit: str, properties: list[tuple[str, Variant]],
                              timeout: float) -> None:
        """Start UNIT, not a serve's, as a transient unit and wait for its start job."""
        async with self._watch_jobs(unit) as jobs:
            (job,) = await self._call(MANAGER_PATH, MANAGER_IFACE, "StartTransientUnit",
                                      "ssa(sv)a(sa(sv))", [unit, "fail", properties, []],
                                      action=f"start {unit}")
            result = await self._wait_job(jobs, job, timeout, f"start {unit}")
        if result != "done":
            raise JobFailed(f"start {unit}: systemd job finished with result {result!r} "
                            f"(see journalctl -u {unit})", {"unit": unit, "result": result})

    async def kill_main(self, unit: str, signal: int) -> None:
        """Send SIGNAL to UNIT's main process (nginx reloads its config on SIGHUP)."""
        await self._call(MANAGER_PATH, MANAGER_IFACE, "KillUnit", "ssi", [unit, "main", signal],
                         action=f"signal {unit}")

    async def reset_failed_unit(self, unit: str) -> None:
        with contextlib.suppress(NotFound):
            await self._call(MANAGER_PATH, MANAGER_IFACE, "ResetFailedUnit", "s", [unit],
                             action=f"reset-failed {unit}")

    # --- the choke point --------------------------------------------------------------------

    async def _call(
        self,
        path: str,
        interface: str,
        member: str,
        signature: str = "",
        body: Sequence[Any] = (),
        *,
        action: str,
        destination: str = SYSTEMD,
    ) -> list[Any]:
        bus = self._bus
        if bus is None or not bus.connected:
            raise Unavailable(
                f"{action}: system bus unavailable ({self._reason or 'not connected'})",
                {"reason": self._reason},
            )
        message = Message(
            destination=destination,
            path=path,
            interface=interface,
            member=member,
            signature=signature,
            body=list(body),
        )
        try:
            # A bus that drops while the message is queued never answers: bound every call.
            async with asyncio.timeout(self._call_timeout):
                reply = await bus.call(message)
            if reply is None:
                raise EOFError("connection closed before the reply")
            if reply.message_type is MessageType.ERROR:
                text = reply.body[0] if reply.body and isinstance(reply.body[0], str) else ""
                raise DBusError(reply.error_name or "org.freedesktop.DBus.Error.Failed", text)
        except (DBusError, *CONNECTION_ERRORS) as exc:
            raise map_error(exc, action) from exc
        return list(reply.body)

    # --- connection -------------------------------------------------------------------------

    async def _open(self) -> None:
        """Connect, add match rules, find systemd, subscribe. Unavailable on any failure."""
        try:
            bus = dbus_fast.aio.MessageBus(bus_address=self._bus_address, bus_type=BusType.SYSTEM)
            async with asyncio.timeout(self._call_timeout):
                await bus.connect()
        except InvalidAddressError as exc:
            raise Unavailable(f"invalid system bus address: {exc}") from exc
        except (DBusError, *CONNECTION_ERRORS) as exc:
            raise map_error(exc, "connect to the system bus") from exc
        bus.add_message_handler(self._on_message)
        self._bus = bus
        self._bus_gone = asyncio.create_task(_disconnected(bus), name="gpud-units-bus")
        try:
            for rule in MATCH_RULES:
                await self._call(
                    DBUS_PATH,
                    DBUS,
                    "AddMatch",
                    "s",
                    [rule],
                    action="add match rule",
                    destination=DBUS,
                )
            (owner,) = await self._call(
                DBUS_PATH,
                DBUS,
                "GetNameOwner",
                "s",
                [SYSTEMD],
                action="find systemd on the bus",
                destination=DBUS,
            )
            self._systemd_owner = owner
            await self._subscribe()
        except GpudError:
            self._drop_bus("connection setup failed")
            raise
        self._reason = None
        self.connects += 1
        log.info("connected to systemd %s on the system bus", self._systemd_version or "(version ?)")

    async def _subscribe(self) -> None:
        try:
            await self._call(MANAGER_PATH, MANAGER_IFACE, "Subscribe", action="subscribe to systemd")
        except Conflict as exc:
            # systemd keeps its subscribers across daemon-reexec: already subscribed is fine.
            if exc.details.get("dbus_error") != ALREADY_SUBSCRIBED:
                raise
        (version,) = await self._call(
            MANAGER_PATH,
            PROPERTIES_IFACE,
            "Get",
            "ss",
            [MANAGER_IFACE, "Version"],
            action="read the systemd version",
        )
        self._systemd_version = systemd_major(version.value)

    def _drop_bus(self, reason: str) -> None:
        bus, self._bus = self._bus, None
        self._bus_gone = None
        self._systemd_owner = None
        self._mark_unavailable(reason)
        if bus is not None:
            bus.remove_message_handler(self._on_message)
            bus.disconnect()

    def _mark_unavailable(self, reason: str) -> None:
        self._reason = reason
        error = Unavailable(f"system bus unavailable ({reason})", {"reason": reason})
        for watches in self._job_watches.values():
            for watch in watches:
                watch.fail(error)
        self._tracked.clear()
        self._dirty.clear()

    async def _supervise(self) -> None:
        attempt = 0
        while not self._closing:
            gone = self._bus_gone
            if self._bus is not None and gone is not None:
                # asyncio.wait, not await: cancelling this task must not cancel dbus-fast's
                # own disconnect future.
                await asyncio.wait({gone})
                reason = gone.result()
                if self._closing:
                    return
                log.warning("%s; reconnecting", reason)
                self._drop_bus(reason)
                attempt = 0
            delay = self._reconnect_delays[min(attempt, len(self._reconnect_delays) - 1)]
            attempt += 1
            await asyncio.sleep(delay)
            try:
                await self._open()
            except GpudError as exc:  # whatever it was, keep trying
                self._mark_unavailable(exc.message)
                continue
            await self._resync()

    async def _resync(self) -> None:
        """After a reconnect: every callback gets every serve unit's fresh state."""
        try:
            states = await self.list_serves()
        except GpudError as exc:
            log.warning("resync after reconnect failed: %s", exc.message)
            return
        for state in states:
            self._tracked.setdefault(state.unit, _Tracked()).emitted = state
            self._emit(state)
        for resync in self._resync_callbacks:
            try:
                resync(states)
            except Exception:
                log.exception("unit resync callback failed")

    # --- jobs -------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _watch_jobs(self, unit: str) -> AsyncIterator[_JobWatch]:
        watch = _JobWatch(unit)
        self._job_watches.setdefault(unit, []).append(watch)
        try:
            yield watch
        finally:
            watches = self._job_watches[unit]
            watches.remove(watch)
            if not watches:
                del self._job_watches[unit]

    async def _wait_job(self, watch: _JobWatch, job: str, timeout: float, action: str) -> str:
        try:
            async with asyncio.timeout(timeout):
                return await watch.wait(job)
        except TimeoutError:
            raise JobFailed(
                f"{action}: no result after {timeout:g} s; the job {job} may still finish",
                {"unit": watch.unit, "job": job, "result": "wait-timeout"},
            ) from None

    # --- signals ----------------------------------------------------------------------------

    def _on_message(self, msg: Message) -> None:
        if msg.message_type is not MessageType.SIGNAL:
            return
        if msg.sender == DBUS and msg.member == "NameOwnerChanged":
            self._on_owner_changed(msg.body)
            return
        if self._systemd_owner is None or msg.sender != self._systemd_owner:
            return
        if msg.member == "PropertiesChanged" and msg.interface == PROPERTIES_IFACE:
            self._on_properties_changed(msg.path or "", msg.body)
        elif msg.interface == MANAGER_IFACE and msg.path == MANAGER_PATH:
            if msg.member == "JobRemoved":
                _id, job, unit, result = msg.body
                for watch in self._job_watches.get(unit, ()):
                    watch.put(job, result)
            elif msg.member == "UnitRemoved":
                unit = msg.body[0]
                # The last state (inactive, failed) may still wait for the batched flush.
                if unit in self._dirty:
                    self._dirty.discard(unit)
                    self._flush_unit(unit)
                self._tracked.pop(unit, None)

    def _on_owner_changed(self, body: list[Any]) -> None:
        name, _old, new = body
        if name != SYSTEMD:
            return
        # systemd re-executed (or left the bus): it keeps subscriptions across daemon-reexec,
        # but signals sent meanwhile are gone, so subscribe again (AlreadySubscribed is fine)
        # and resync.
        self._systemd_owner = new or None
        if new:
            self._spawn(self._reattach())

    async def _reattach(self) -> None:
        try:
            await self._subscribe()
        except GpudError as exc:
            log.warning("subscribing to the new systemd failed: %s", exc.message)
            return
        await self._resync()

    def _on_properties_changed(self, path: str, body: list[Any]) -> None:
        unit = unit_of_path(path)
        if unit is None or serve_of_unit(unit) is None:
            return
        interface, changed, invalidated = body
        if interface not in STATE_INTERFACES:
            return
        tracked = self._tracked.setdefault(unit, _Tracked())
        values = {name: variant.value for name, variant in changed.items()
                  if STATE_PROPERTIES.get(name) == (interface, variant.signature)}
        invocation = tracked.props.get("InvocationID")
        new_invocation = invocation is not None and values.get("InvocationID",
                                                                invocation) != invocation
        if unit in self._dirty and (new_invocation or any(
                tracked.props.get(name) != value for name, value in values.items()
                if name in tracked.pending)):
            # The state read so far is one of its own (a process's exit before its restart):
            # reported before this signal changes it.
            self._dirty.discard(unit)
            self._flush_unit(unit)
        for name, value in values.items():
            tracked.props[name] = value
            tracked.touched.add(name)
            tracked.pending.add(name)
        for name in invalidated:
            if name in STATE_PROPERTIES:
                tracked.props.pop(name, None)
        if new_invocation or not STATE_PROPERTIES.keys() <= tracked.props.keys():
            if not tracked.fetching:
                tracked.fetching = True
                tracked.touched.clear()
                self._spawn(self._refresh(unit, path))
            return
        self._mark_dirty(unit)

    async def _refresh(self, unit: str, path: str) -> None:
        tracked = self._tracked.get(unit)
        try:
            props = await self._get_all(unit, path)
        except GpudError as exc:
            # Gone (collected) between signal and fetch, or the bus dropped: nothing to tell.
            log.debug("fetching %s failed: %s", unit, exc.message)
            props = None
        if tracked is None or self._tracked.get(unit) is not tracked:
            return
        tracked.fetching = False
        if props is None:
            return
        # Values a signal brought while the fetch was under way are newer than the fetch.
        for name in tracked.touched:
            if name in tracked.props:
                props[name] = tracked.props[name]
        tracked.props = props
        self._mark_dirty(unit)

    def _mark_dirty(self, unit: str) -> None:
        self._dirty.add(unit)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            # Signals read in the same batch (Service, then Unit) become one callback.
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        dirty, self._dirty = self._dirty, set()
        for unit in sorted(dirty):
            self._flush_unit(unit)

    def _flush_unit(self, unit: str) -> None:
        tracked = self._tracked.get(unit)
        if tracked is None or tracked.fetching:  # the fetch marks it dirty again
            return
        tracked.pending.clear()
        state = state_from(unit, tracked.props)
        if state is None or state == tracked.emitted:
            return
        tracked.emitted = state
        self._emit(state)

    def _emit(self, state: UnitState) -> None:
        for callback in self._callbacks:
            try:
                callback(state)
            except Exception:
                log.exception("unit state callback failed for %s", state.unit)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task: asyncio.Task[None] = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- property reads ---------------------------------------------------------------------

    async def _get_all(self, unit: str, path: str) -> dict[str, Any]:
        replies = await asyncio.gather(
            *(
                self._call(path, PROPERTIES_IFACE, "GetAll", "s", [iface], action=f"state of {unit}")
                for iface in STATE_INTERFACES
            )
        )
        props: dict[str, Any] = {}
        for iface, (values,) in zip(STATE_INTERFACES, replies, strict=True):
            props.update(typed_properties(iface, values.items()))
        return props

    async def _fetch(self, unit: str, path: str) -> UnitState | None:
        try:
            props = await self._get_all(unit, path)
        except NotFound:
            return None
        # Reading a unit's object loads it again if it was just collected: a ghost, not a unit.
        if props.get("LoadState") == "not-found":
            return None
        return state_from(unit, props)


async def _disconnected(bus: dbus_fast.aio.MessageBus) -> str:
    """Waits until the connection ends; says why."""
    try:
        await bus.wait_for_disconnect()  # type: ignore[no-untyped-call]  # untyped in dbus-fast
    except Exception as exc:  # dbus-fast hands over whatever ended the socket
        return f"system bus connection lost: {str(exc) or type(exc).__name__}"
    return "system bus connection closed"
