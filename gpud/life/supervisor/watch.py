"""The serves' units from D-Bus signals: each change carried out as gpud.core.lifecycle.step
decides (through gpud.core.unitstate.on_unit), systemd's restarts counted toward the crash-loop
limit, a restart's health awaited, the state re-read after the bus came back."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from gpud.core.launch import unit_restart
from gpud.core.lifecycle import (
    LifeAction,
    Restarted,
    UnitChanged,
    UnitGone,
)
from gpud.core.serverecord import Happened, UnitPid, UnitRestarts
from gpud.core.unitstate import (
    ACTIVE,
    AdoptOutsideStart,
    AskShutdown,
    Fail,
    OrphanEnded,
    OutsideStop,
    ReleaseEnded,
    Restarting,
    StopEnded,
    UnitState,
    WatchRestart,
)
from gpud.core.vocab import (
    FAILED,
    LIVE_STATES,
    STARTING,
    EventKind,
)
from gpud.life.supervisor.base import (
    Ending,
    Healthy,
    Runtime,
    log,
    pid_text,
)


class UnitWatch:
    """What a serve's unit does, heard from systemd."""

    def __init__(self, rt: Runtime, health: Healthy, stops: Ending) -> None:
        self.rt = rt
        self.svc = rt.svc
        self.health = health
        self.stops = stops
        self._events: asyncio.Queue[UnitState | list[UnitState]] = asyncio.Queue()

    def heard(self, item: UnitState | list[UnitState]) -> None:
        """A unit's change, or every unit re-read after the bus came back (gpud.host.units)."""
        self._events.put_nowait(item)

    async def loop(self) -> None:
        """Carry out the units' changes in the order heard, until cancelled."""
        while True:
            item = await self._events.get()
            try:
                if isinstance(item, list):
                    await self._resync(item)
                else:
                    await self._on_unit(item)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("handling a unit state change failed")

    async def _resync(self, states: list[UnitState]) -> None:
        """After a bus reconnect: the state is re-read from systemd, not kept from before."""
        live = {s.serve for s in states if s.active_state in ACTIVE}
        for st in states:
            await self._on_unit(st)
            rec = self.svc.records.get(st.serve)
            if (rec is not None and rec.state == FAILED and st.active_state in ACTIVE
                    and not self.svc.records.of(st.serve).stopping and self.svc.serve_spec(st.serve)):
                # Marked failed while the bus was down (it could not be stopped or restarted),
                # and its unit runs: it is starting again until its health says otherwise.
                await self.svc.store_event(self.svc.event(
                    EventKind.RESTART, f"{st.serve}: its unit {st.unit} is active (re-read from systemd "
                    f"after the bus came back; was failed: {rec.reason})", serve=st.serve,
                    main_pid=st.main_pid, n_restarts=st.n_restarts),
                    report=self.svc.report(st.serve, Happened.RESTARTING,
                                           "re-read after the bus came back"))
                self.rt.spawn(self.health.watch_restart(st.serve))
        for serve, rec in list(self.svc.records.items()):
            if rec.state in LIVE_STATES and serve not in live and not rec.stopping:
                # systemd has no unit of it: what was last seen of the unit is past.
                self.rt.step(serve, UnitGone())
                await self.stops.ended(serve, "its unit is gone (seen after the bus came back)")

    async def _on_unit(self, st: UnitState) -> None:
        """Carry out what the change of a serve's unit means (gpud.core.lifecycle.step, which
        asks gpud.core.unitstate.on_unit)."""
        serve = st.serve
        prev = self.rt.life(serve).unit
        if st.main_pid and not self.svc.records.of(serve).stopping:
            self.svc.records.apply(serve, UnitPid(st.main_pid))
        spec = self.svc.serve_spec(serve)
        daemon = self.svc.config.daemon
        changed = UnitChanged(
            unit=st, prev=prev, state=self.svc.state_of(serve),
            holds=serve in self.svc.ledger.reservations, configured=spec is not None,
            resident=bool(spec and spec.resident), restart=unit_restart(spec) if spec else "no",
            now=self.rt.clock(), window_s=daemon.crash_loop_window_s,
            limit=daemon.crash_loop_restarts)
        actions = self.rt.step(serve, changed)
        if actions and isinstance(actions[-1], AskShutdown):
            # Decided again on the same change (its `prev`), once the answer is known.
            shutting_down = await self.rt.units.shutting_down()
            actions = self.rt.step(serve, replace(changed, shutting_down=shutting_down))
        for action in actions:
            await self._carry_out(serve, st, action)

    async def _carry_out(self, serve: str, st: UnitState, action: LifeAction) -> None:
        """One action of what the unit's change means."""
        rec = self.svc.records.get(serve)
        if isinstance(action, Restarted):
            self.svc.records.apply(serve, UnitRestarts(st.n_restarts))
            await self._restarted(serve, st, action.crash_loop)
        elif isinstance(action, OrphanEnded):
            await self.svc.store_event(self.svc.event(
                EventKind.EXIT, f"{serve}: orphan unit ended ({action.how})", serve=serve),
                report=self.svc.report(serve, Happened.ORPHAN_ENDED))
        elif isinstance(action, ReleaseEnded):
            await self.svc.release(serve, reason="failed, and its unit has now ended",
                                   allow_live=True, happened=Happened.FAILED,
                                   state_reason=rec.reason if rec else None)
        elif isinstance(action, StopEnded):
            await self.svc.store_event(self.svc.event(
                EventKind.EXIT, f"{serve}: its unit {st.unit} has ended ({action.how}) since its stop "
                "gave up waiting: the stop is complete", serve=serve, exit_status=st.exec_main_status))
            await self.stops.stopped(serve, None, keep=False)
        elif isinstance(action, OutsideStop):
            await self.stops.outside_stop(serve, st)
        elif isinstance(action, Restarting):
            await self.svc.store_event(self.svc.event(
                EventKind.EXIT, f"{serve}: process exited ({action.how}); systemd restarts it",
                serve=serve, exit_status=st.exec_main_status, result=st.result),
                report=self.svc.report(serve, Happened.RESTARTING,
                                       f"restarting: its process exited ({action.how})"))
            self.rt.spawn(self._confirm_restart(serve, action.invocation))
        elif isinstance(action, Fail):
            await self.stops.failed(serve, action.reason, stop=action.stop,
                                    kind=EventKind.CRASH_LOOP if action.crash_loop
                                    else EventKind.EXIT, exit_status=st.exec_main_status,
                                    **({"n_restarts": st.n_restarts} if action.crash_loop
                                       else {}))
        elif isinstance(action, WatchRestart):
            self.rt.spawn(self.health.watch_restart(serve))
        elif isinstance(action, AdoptOutsideStart):
            await self._adopt_outside_start(serve, st)

    async def _confirm_restart(self, serve: str, invocation: str) -> None:
        spec = self.svc.serve_spec(serve)
        await asyncio.sleep((spec.restart_sec if spec else 2.0) + 5.0)
        if self.svc.state_of(serve) != STARTING or self.svc.records.of(serve).stopping:
            return
        last = self.rt.life(serve).unit
        if last is not None and last.invocation_id != invocation and last.active_state in ACTIVE:
            return
        fresh = await self.rt.units.state(serve)
        if fresh is not None and fresh.active_state in ACTIVE:
            return
        await self.stops.failed(serve, "exited and systemd did not restart it", kind=EventKind.EXIT)

    async def _restarted(self, serve: str, st: UnitState, loop: str | None) -> None:
        """Record a restart systemd made; with a crash loop it made, the serve fails (its unit
        stopped)."""
        await self.svc.store_event(self.svc.event(
            EventKind.RESTART, f"{serve}: restarted by systemd (restart #{st.n_restarts}, "
            f"{pid_text(st.main_pid)})", serve=serve, n_restarts=st.n_restarts,
            main_pid=st.main_pid or None))
        if loop is not None:
            await self.stops.failed(serve, loop, kind=EventKind.CRASH_LOOP, stop=True,
                               n_restarts=st.n_restarts)

    async def _adopt_outside_start(self, serve: str, st: UnitState) -> None:
        """The unit runs again though gpud did not start it (`systemctl start` or `restart` by
        hand): it holds memory, so it gets its reservation back, as at adoption."""
        spec = self.svc.serve_spec(serve)
        if spec is None:
            return
        if serve not in self.svc.ledger.reservations:
            await self.svc.adopt(serve, spec.all_roles, spec.vram_mib)
        await self.svc.store_event(self.svc.event(
            EventKind.ADOPT, f"{serve}: its unit {st.unit} was started outside gpud (MainPID "
            f"{st.main_pid}): adopted", serve=serve, role=spec.role,
            mib=self.svc.ledger.reservations[serve].mib, main_pid=st.main_pid),
            report=self.svc.report(serve, Happened.STARTED_OUTSIDE))
        self.rt.spawn(self.health.watch_restart(serve))

