"""A serve's end: gpud's stop (and a restart's), an orphan's, an operator's stop seen from its
unit, a failure; and the wait of the next start on a device for the memory of the serves that
stopped there (`MemoryReturn`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from gpud.config import ServeConfig
from gpud.core.lifecycle import (
    CancelLaunch,
    Job,
    JobBegan,
    JobEnded,
    LaunchEnded,
    LifeAction,
    MemoryBack,
    MemoryLeaving,
    PortChecked,
)
from gpud.core.serverecord import Happened
from gpud.core.traffic import Drain
from gpud.core.unitstate import UnitState
from gpud.core.vocab import (
    LIVE_STATES,
    ORPHAN,
    SLEEPING,
    EventKind,
    serve_unit,
)
from gpud.errors import GpudError
from gpud.life.service import check_serve_name
from gpud.life.sleeping import meta_key
from gpud.life.supervisor.base import (
    OUTSIDE_STOP,
    UNIT_JOB_TIMEOUT_S,
    Runtime,
    log,
)
from gpud.vllm.vllm_log import exit_reason, last_words


class MemoryReturn:
    """The memory of stopped serves coming back: a start on a device waits for it."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def leaving(self, serve: str) -> None:
        """The serve is stopping or ended: the next start on any of its devices waits for its
        memory to come back there."""
        self.rt.step(serve, MemoryLeaving(frozenset(self.rt.device_keys(serve))))

    async def back_all(self, serve: str) -> None:
        """Wait (bounded) until the stops in progress on the serve's devices are done and
        their memory shows as free."""
        for device in self.rt.device_keys(serve):
            await self.back(device)

    async def back(self, device: str) -> None:
        """Before a start: wait (bounded by memory_return_timeout_s) until the stops in progress
        on the device have ended and observation no longer sees the stopped serves' memory
        there, so the next admission and vLLM's own check see it free."""
        rt = self.rt
        waiting = rt.returning(device)
        timeout = rt.svc.config.daemon.memory_return_timeout_s
        if not waiting or timeout <= 0:
            return
        deadline = rt.clock() + timeout
        held: set[str] = set()
        while (left := deadline - rt.clock()) > 0:
            stopping = [done for s in sorted(waiting) if (done := self._stop_done(s)) is not None]
            if stopping:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping[0].wait(), left)
                continue
            if not rt.observer.available:
                break
            held = waiting & set(rt.observer.draws.get(device, {}))
            if not held:
                break
            await rt.observer.next_sample(min(1.0, left))
        else:
            still = sorted(held | {s for s in waiting if self._stop_done(s) is not None})
            log.warning("memory of %s on %s not back after %g s; starting anyway", still,
                        device, timeout, extra={"journal": {
                            "GPUD_EVENT": EventKind.MEMORY_NOT_BACK, "GPUD_SERVES": ",".join(still)}})
        for serve in waiting:
            if self._stop_done(serve) is None:  # a stop still in progress stays waited on
                rt.step(serve, MemoryBack(device))

    def _stop_done(self, serve: str) -> asyncio.Event | None:
        rec = self.rt.serves.get(serve)
        return rec.stop_done if rec is not None else None


class StopJob:
    """Stopping serves, failing them, and what an end of their unit means."""

    def __init__(self, rt: Runtime, memory: MemoryReturn, *,
                 journal: Callable[[str, str | None], Awaitable[list[str]]]) -> None:
        self.rt = rt
        self.svc = rt.svc
        self.memory = memory
        # The last lines of a serve's unit, read when it exits: why it said it did.
        self.journal = journal

    async def stop(self, serve: str, uid: int | None, *,
                   keep_reservation: bool = False, idle_s: float | None = None,
                   drained: Drain | None = None) -> None:
        """Stop the unit and release the reservation (kept only for a restart, and not for a
        sleeping serve: asleep it holds its sleep reservation, which no launch may be sized on;
        its restart is admitted again at vram_mib). `idle_s`: an on-demand serve stopped idle
        for that long, which its stop event says; `drained`: what a drain before it did to the
        requests in flight (a preemption's), said in the event too."""
        check_serve_name(serve)
        if self.svc.state_of(serve) == ORPHAN and self.svc.serve_spec(serve) is None:
            await self._stop_orphan(serve, uid)
            return
        spec = self.rt.spec(serve)
        state = self.svc.state_of(serve)
        if state in LIVE_STATES or self.rt.life(serve).launching:
            self.rt.need_bus()
        await self._end_check(serve)
        failed: GpudError | None = None
        async with self.rt.serve_lock(serve):
            actions = self._stop_began(serve)
            try:
                if CancelLaunch() in actions:
                    await self._cancel_launch(serve)
                res = self.svc.ledger.reservations.get(serve)
                asleep = self.svc.state_of(serve) == SLEEPING
                await self.svc.store_event(self.svc.event(
                    EventKind.STOP, f"{serve}: stopping (was {state}{_why(idle_s, drained)})",
                    serve=serve, role=spec.role, mib=res.mib if res else None, uid=uid,
                    **_stop_details(idle_s, drained)),
                    report=self.svc.report(serve, Happened.STOP_BEGUN))
                failed = await self._stop_its_unit(serve, spec, state)
                if failed is None:
                    await self.stopped(serve, uid, keep=keep_reservation and not asleep)
                else:
                    await self.svc.store_event(self.svc.event(
                        EventKind.STOP, f"{serve}: the stop failed ({failed.message}) and its unit "
                        "has not ended: it stays stopping, its reservation held, until the unit "
                        "ends (gpuctl stop tries again)", serve=serve, role=spec.role,
                        mib=res.mib if res else None, uid=uid, ok=False),
                        report=self.svc.report(serve, Happened.STOP_BEGUN,
                                               f"stop failed: {failed.message}"))
            finally:
                self._stop_over(serve)
        if failed is not None:
            # Its unit's end, had it come while the stop was under way, went unheeded: read once
            # more. Later ends complete the stop through the unit's signal (StopEnded).
            if self.svc.records.of(serve).stop_recorded and await self._unit_ended(serve):
                await self.stopped(serve, uid, keep=False)
            raise failed

    async def _end_check(self, serve: str) -> None:
        """A health check restarting the serve holds its lock while the new process loads
        (minutes for vLLM): a stop does not wait for that, it ends it."""
        check = self.rt.handles(serve).check
        self.rt.prune(serve)
        if check is not None and check is not asyncio.current_task() and not check.done():
            check.cancel()
            await asyncio.wait({check})

    def _stop_began(self, serve: str) -> list[LifeAction]:
        """The stop's job begins (the caller holds the serve's lock): a start on the serve's
        devices from now on waits for it and for the memory to come back (a serve ignoring
        SIGTERM takes its stop timeout to go)."""
        actions = self.rt.step(serve, JobBegan(Job.STOP))
        self.rt.handles(serve).stop_done = asyncio.Event()
        self.memory.leaving(serve)
        return actions

    def _stop_over(self, serve: str) -> None:
        """The stop's job is over, however it ended: the starts waiting on it go on."""
        self.rt.step(serve, JobEnded(Job.STOP))
        rec = self.rt.handles(serve)
        done, rec.stop_done = rec.stop_done, None
        self.rt.prune(serve)
        assert done is not None
        done.set()

    async def _cancel_launch(self, serve: str) -> None:
        """A launch queued behind another start on the device, or starting, must not go on to
        run a unit whose reservation this stop releases."""
        launch = self.rt.handles(serve).launch_task
        if launch is None or launch.done():
            return
        launch.cancel()
        await asyncio.wait({launch})
        # A launch cancelled before it began never ran its own clean-up.
        self.rt.step(serve, LaunchEnded())
        rec = self.rt.handles(serve)
        if rec.launch_task is launch:
            rec.launch_task = None

    async def _stop_its_unit(self, serve: str, spec: ServeConfig,
                             state: str) -> GpudError | None:
        """Stop the serve's unit (its devices held when its memory comes back: not inside a
        neighbour's start window); the failure, when the unit has not ended despite it."""
        if not self.rt.units.available:
            return None
        try:
            async with contextlib.AsyncExitStack() as memory:
                if self.rt.unit_active(serve) or state in LIVE_STATES:
                    await memory.enter_async_context(self.rt.device_locks(serve))
                await self.rt.stop_unit(serve, spec.stop_timeout_s + 15)
        except GpudError as exc:
            if not await self._unit_ended(serve):
                return exc
        return None

    async def _unit_ended(self, serve: str) -> bool:
        """The serve's unit is gone or has ended, as systemd says now (False when it cannot be
        read)."""
        try:
            st = await self.rt.units.state(serve)
        except GpudError:
            return False
        return st is None or st.gone

    async def stopped(self, serve: str, uid: int | None, *, keep: bool) -> None:
        """A stop's end: the unit has ended; its reservation released (unless `keep`: a restart
        keeps it), and what a sleep noted of it (level, awake size) is over."""
        spec = self.svc.serve_spec(serve)
        role = spec.role if spec else None
        res = self.svc.ledger.reservations.get(serve)
        if res is not None and not keep:
            await self.svc.release(serve, uid=uid, reason="stopped", allow_live=True,
                                   happened=Happened.STOPPED)
        else:
            await self.svc.store_event(self.svc.event(
                EventKind.EXIT, f"{serve}: stopped", serve=serve, role=role),
                report=self.svc.report(serve, Happened.STOPPED))
        if self.svc.store.meta(meta_key(serve)) is not None:
            await self.svc.put_meta(meta_key(serve), None)

    async def _stop_orphan(self, serve: str, uid: int | None) -> None:
        self.rt.need_bus()
        async with self.rt.serve_lock(serve):
            self.rt.step(serve, JobBegan(Job.STOP))
            try:
                await self.rt.stop_unit(serve, UNIT_JOB_TIMEOUT_S)
                await self.svc.store_event(self.svc.event(
                    EventKind.STOP, f"{serve}: orphan unit stopped", serve=serve, uid=uid),
                    report=self.svc.report(serve, Happened.ORPHAN_ENDED))
            finally:
                self.rt.step(serve, JobEnded(Job.STOP))

    async def failed(self, serve: str, reason: str, *, kind: EventKind, stop: bool = False,
                     **details: Any) -> None:
        """A serve ends `failed`. With `stop` its unit is stopped first. A serve whose unit may
        still be active (the stop failed, the bus is down) keeps its reservation: its process
        may still hold the memory. Otherwise a resident serve keeps it (it is meant to run) and
        any other releases it. The event says which."""
        spec = self.svc.serve_spec(serve)
        # A serve that was asleep holds its sleep reservation, not what it starts with: kept,
        # a later start would launch it on too little.
        resident = bool(spec and spec.resident) and self.svc.state_of(serve) != SLEEPING
        still_active = not stop and self.rt.unit_active(serve)
        if stop:
            still_active = True
            if self.rt.units.available:
                self.rt.step(serve, JobBegan(Job.FAIL_STOP))
                try:
                    await self.rt.stop_unit(serve, (spec.stop_timeout_s if spec else 30) + 15)
                    still_active = False
                except GpudError as exc:
                    log.error("could not stop %s: %s", serve, exc.message)
                finally:
                    self.rt.step(serve, JobEnded(Job.FAIL_STOP))
            else:
                reason += f"; not stopped: system bus unavailable ({self.rt.units.reason})"
        # What the serve said last: why it exited, or why it never answered (a load that
        # raised and hung, an unhealthy serve's complaint).
        if kind in (EventKind.EXIT, EventKind.CRASH_LOOP, EventKind.UNHEALTHY):
            last = self.rt.life(serve).unit
            lines = await self.journal(serve_unit(serve), last.invocation_id if last else None)
            said = exit_reason(lines) or last_words(lines)
            if said is not None:
                reason += f"; its log: {said}"
        res = self.svc.ledger.reservations.get(serve)
        policy = "kept (resident)" if resident else "released"
        if still_active and not resident:
            policy = "kept (its unit may still be active)"
        if res is None:
            policy = "none held"
        if res is not None and not resident and not still_active:
            # Released before the failure is recorded: the release's own transaction makes the
            # serve failed, so nobody reads it failed while it still holds what it released.
            await self.svc.release(serve, reason=f"failed: {reason}", allow_live=True,
                                   happened=Happened.FAILED, state_reason=reason)
        await self.svc.store_event(self.svc.event(
            kind, f"{serve} failed: {reason}; reservation {policy}", serve=serve,
            role=spec.role if spec else None, mib=res.mib if res else None,
            reservation=policy, **details), report=self.svc.report(serve, Happened.FAILED, reason))
        self.memory.leaving(serve)

    async def ended(self, serve: str, reason: str) -> None:
        await self.failed(serve, reason, kind=EventKind.EXIT)

    async def outside_stop(self, serve: str, st: UnitState) -> None:
        """An operator stopped the unit (`systemctl stop`): recorded as such, not as a failure.
        The reservation goes as with `gpuctl stop`, unless the serve is resident and
        daemon.keep_resident_on_outside_stop; boot does not start it again until asked."""
        spec = self.svc.serve_spec(serve)
        keep = bool(spec and spec.resident
                    and self.svc.config.daemon.keep_resident_on_outside_stop)
        res = self.svc.ledger.reservations.get(serve)
        policy = "none held" if res is None else "kept (resident)" if keep else "released"
        await self.svc.store_event(self.svc.event(
            EventKind.EXIT, f"{serve}: {OUTSIDE_STOP}: its unit {st.unit} was stopped by a job gpud did "
            f"not start ({st.how}, result {st.result}); reservation {policy}", serve=serve,
            role=spec.role if spec else None, mib=res.mib if res else None, reservation=policy,
            outside=True, exit_status=st.exec_main_status),
            # "stopping" until the release below is committed too: never "declared" while a
            # reservation is still held.
            report=self.svc.report(serve, Happened.STOP_BEGUN if res is not None and not keep
                                   else Happened.STOPPED, OUTSIDE_STOP))
        if res is not None and not keep:
            await self.svc.release(serve, reason=OUTSIDE_STOP, allow_live=True,
                                   happened=Happened.STOPPED, state_reason=OUTSIDE_STOP)
        self.memory.leaving(serve)
        self.rt.step(serve, PortChecked(own=False, pid=0, at=self.rt.clock()))


def _why(idle_s: float | None, drained: Drain | None) -> str:
    """What a stop's event adds to "stopping (was STATE": the idle time, the drain."""
    why = "" if idle_s is None else f", idle {idle_s:g} s without a request"
    return why if drained is None else why + f"; {drained.line()}"


def _stop_details(idle_s: float | None, drained: Drain | None) -> dict[str, Any]:
    details: dict[str, Any] = {} if idle_s is None else {"idle_s": idle_s}
    if drained is not None:
        details["in_flight"] = drained.details()
    return details
