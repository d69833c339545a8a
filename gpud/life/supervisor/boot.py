"""At gpud's start: adopt the units that run (reconciliation), then start the resident set by
priority, per device in boot steps (gpud.core.launch.boot_steps: exactly sized serves of a
device start together, every other serve alone), devices in parallel."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from gpud.core.launch import start_sharing
from gpud.core.lifecycle import UnitSeen
from gpud.core.serverecord import Happened, UnitPid, UnitRestarts
from gpud.core.unitstate import ACTIVE
from gpud.core.vocab import (
    LIVE_STATES,
    SLEEPING,
    STARTING,
    EventKind,
)
from gpud.errors import Denied, GpudError
from gpud.host import containers
from gpud.life.reconciling import Reconciler
from gpud.life.sleeping import Sleeps
from gpud.life.supervisor.base import (
    OUTSIDE_STOP,
    Failing,
    Healthy,
    Runtime,
    Starts,
    log,
    pid_text,
)


class BootJob:
    """Reconciliation and the boot of the resident set."""

    def __init__(self, rt: Runtime, launch: Starts, health: Healthy, stops: Failing,
                 sleeps: Sleeps, reconciler: Reconciler, *,
                 notify: Callable[[str], None]) -> None:
        self.rt = rt
        self.svc = rt.svc
        self.launch = launch
        self.health = health
        self.stops = stops
        self.sleeps = sleeps
        self.reconciler = reconciler
        self.notify = notify
        # Set once the resident set's boot is over, however it went.
        self.booted = asyncio.Event()

    async def reconcile(self) -> None:
        """Adopt running gpud-serve-* units (never a second copy), keep their reservations, and
        mark serves that died while gpud was away."""
        if not self.rt.units.available:
            log.warning("reconciliation skipped: system bus unavailable (%s)", self.rt.units.reason)
            return
        if any(spec.container is not None for spec in self.svc.config.serves.values()):
            # A pull a gpud that ended mid-start left: nothing waits for it any more.
            problem = await containers.stop_leftovers()
            if problem is not None:
                log.warning("image pulls left by an earlier gpud may still run: %s", problem)
        live = {st.serve: st for st in await self.rt.units.list_serves() if st.active_state in ACTIVE}
        for serve, st in sorted(live.items()):
            self.rt.step(serve, UnitSeen(st))
            spec = self.svc.serve_spec(serve)
            rec_state = self.svc.state_of(serve)
            res = self.svc.ledger.reservations.get(serve)
            if spec is None:
                # Not gpud's to run any more, still gpud's to stop: an orphan, said loudly.
                reason = f"its unit {st.unit} runs but the config does not name the serve"
                log.warning("%s: %s; gpuctl stop %s stops it", serve, reason, serve)
                await self.svc.store_event(self.svc.event(
                    EventKind.ADOPT, f"{serve}: {reason}: adopted as an orphan ({pid_text(st.main_pid)}); "
                    f"gpuctl stop {serve} stops it", serve=serve, main_pid=st.main_pid or None,
                    orphan=True), report=self.svc.report(serve, Happened.FOUND_ORPHAN, reason))
                self.svc.records.apply(serve, UnitPid(st.main_pid or None))
                continue
            if res is None:
                await self.svc.adopt(serve, spec.all_roles, spec.vram_mib)
            found = Happened.FOUND_ACTIVE
            asked = self.sleeps.last_said(serve, spec, rec_state)
            if asked is not None:
                # Asked, not assumed: asleep it keeps its reservation unchanged.
                found = await self.sleeps.found(serve, spec, asked,
                                                overdrawn=self.reconciler.overdrawn(serve))
            self.svc.records.apply(serve, UnitPid(st.main_pid or None))
            self.svc.records.apply(serve, UnitRestarts(st.n_restarts))
            await self.svc.store_event(self.svc.event(
                EventKind.ADOPT, f"{serve}: adopted running unit {st.unit} ({pid_text(st.main_pid)})",
                serve=serve, role=spec.role if spec else None,
                mib=self.svc.ledger.reservations[serve].mib, main_pid=st.main_pid),
                # asleep, it keeps the reason it sleeps (who preempted it)
                report=self.svc.report(serve, found, self._sleep_reason(serve, found)))
            if self.svc.state_of(serve) == STARTING:
                self.rt.spawn(self.health.watch_restart(serve))  # promoted once its health answers
        for serve, rec in list(self.svc.records.items()):
            if rec.state in LIVE_STATES and serve not in live:
                await self.stops.ended(serve, "its unit ended while gpud was not running")

    def _sleep_reason(self, serve: str, found: Happened) -> str | None:
        """The reason a serve found asleep keeps (who put it to sleep, why)."""
        rec = self.svc.records.get(serve)
        if rec is None:
            return None
        asleep = found is Happened.FOUND_ASLEEP or (found is Happened.FOUND_AS_RECORDED
                                                    and rec.state == SLEEPING)
        return rec.reason if asleep else None

    async def boot(self) -> None:
        """Start the resident set: by priority, per device in boot steps (exactly sized serves
        together, every other serve alone), devices in parallel."""
        try:
            if not self.rt.units.available:
                log.warning("resident set not started: launching unavailable (%s)",
                            self.rt.units.reason)
                return
            by_device: dict[str, list[str]] = {}
            order = sorted((s.priority, name) for name, s in self.svc.config.serves.items()
                           if s.resident)
            # Admission first, in priority order over all devices: the whole set's outcome is in
            # the ledger at once (denials with their reasons), and starts need not wait on it.
            for _, name in order:
                if self.svc.state_of(name) in LIVE_STATES or name in self.svc.ledger.reservations:
                    continue
                if self._stopped_outside(name):
                    continue
                with contextlib.suppress(Denied):  # recorded with its reason; it stays denied
                    if self.svc.config.daemon.preempt_at_boot:
                        await self.sleeps.preemption.admit_preempting(
                            name, self.svc.config.serves[name].vram_mib, None)
                    else:
                        await self.svc.admit(name, self.svc.config.serves[name].vram_mib)
            self.notify(f"STATUS=starting resident set: {self.svc.summary()}")
            for _, name in order:
                if name in self.svc.ledger.reservations and not self._stopped_outside(name):
                    # A serve on several devices goes in the queue of its first; its launch
                    # waits for every one of them (see _launch).
                    by_device.setdefault(self.rt.device_key(name), []).append(name)
            await asyncio.gather(*(self._boot_device(names) for names in by_device.values()))
        finally:
            self.booted.set()
            log.info("resident set done: %s", self.svc.summary())
            # Serves a preemption put to sleep before this gpud started (one cut short by its
            # stop, say) wake now if they fit, as after any release.
            for role in sorted(self.svc.ledger.roles):
                self.sleeps.freed(role)

    def _stopped_outside(self, serve: str) -> bool:
        """An operator stopped the serve's unit by hand: it stays down until asked."""
        rec = self.svc.records.get(serve)
        if rec is not None and rec.state not in LIVE_STATES and rec.reason == OUTSIDE_STOP:
            log.info("boot: %s not started: %s; gpuctl start %s starts it", serve, OUTSIDE_STOP,
                     serve)
            return True
        return False

    async def _boot_device(self, names: list[str]) -> None:
        """The device's serves in priority order: each util-sized one alone, each run of exactly
        sized ones between them launched at once (their device locks shared: gpud.life.locks,
        gpud.core.launch.start_sharing). A serve alone waits for the ones before it to be up
        before it is started: the locks alone do not keep the order, since a launch may reach
        its devices' locks after a serve started later (one on several devices) reached them."""
        log.info("boot on %s: %s", self.rt.device_key(names[0]) or "the device", "; ".join(
            f"{name} {start_sharing(self.rt.sized(name, self.rt.spec(name)))[1]}"
            for name in names))
        launches: list[asyncio.Task[Any]] = []

        async def settle() -> None:
            if launches:
                # Not gathered: a stop that cancels a launch must not cancel the boot.
                await asyncio.wait(launches)
                launches.clear()

        for name in names:
            if self.svc.state_of(name) in LIVE_STATES or self.rt.life(name).launching:
                continue
            shared, _why = start_sharing(self.rt.sized(name, self.rt.spec(name)))
            if not shared:
                await settle()
            try:
                await self.launch.start(name, None)
            except GpudError as exc:
                log.log(logging.WARNING if exc.http_status < 500 else logging.ERROR,
                        "boot: %s not started: %s", name, exc.message)
                continue
            task = self.rt.handles(name).launch_task
            self.rt.prune(name)
            if task is not None:
                task.add_done_callback(lambda _t: self.notify(
                    f"STATUS=starting resident set: {self.svc.summary()}"))
                launches.append(task)
            if not shared:
                await settle()
        await settle()

