"""The ledger against what a sleep-capable serve says it is (gpud.core.reconcile decides).

vLLM's `/wake_up` and `/sleep` answer anyone who reaches the port, so a serve can be woken or put
to sleep behind gpud's back. At every health check of such a serve (running or sleeping), and
when observation sees a sleeping serve draw over its reservation, gpud asks `GET /is_sleeping`;
when the answer disagrees with the ledger, admissions on the serve's roles are held (no one is
admitted on figures that are false) while the serve's lock is taken, the question asked again,
and the ledger put right: a serve woken outside gpud is admitted at its full size if it fits,
else put back to sleep (or stopped, when it is preempted by stopping); a serve put to sleep
outside gpud keeps its full reservation and is shown sleeping.

On vLLM 0.34 (`daemon.vllm_version`), a serve that says it sleeps is asked `GET
/checkpoint/status` too: one prepared for a process checkpoint behind gpud's back is not asleep
and gpud's wake cannot wake it (gpud.core.reconcile says why); it is restored (`POST
/checkpoint/restore`, vllm/entrypoints/serve/checkpoint/api_router.py:60 of 0.34.0), and while
that fails it is reported and keeps its reservation.
"""

from __future__ import annotations

import json
import logging

import aiohttp

from gpud.config import ServeConfig
from gpud.core.reconcile import Reconcile, disagrees, reconcile
from gpud.core.serverecord import Happened
from gpud.core.vllm_versions import behaviour
from gpud.core.vocab import EventKind, SleepAction
from gpud.errors import Denied, GpudError
from gpud.host.observer import Observer
from gpud.life.service import LedgerService
from gpud.life.sleeping import Sleeps, SleepSupervisor, meta_key

log = logging.getLogger("gpud.reconcile")
CHECKPOINT_STATUS_TIMEOUT_S = 5.0
# vllm/v1/engine/__init__.py:44-55 of 0.34.0 (CheckpointState): not serving, and not asleep
PREPARED_STATES = ("preparing", "prepared")


def _said(value: bool | None) -> str:
    return "no answer to GET /is_sleeping" if value is None else f"is_sleeping {str(value).lower()}"


class Reconciler:
    def __init__(self, serves: SleepSupervisor, svc: LedgerService, sleeps: Sleeps,
                 observer: Observer) -> None:
        self.serves = serves
        self.svc = svc
        self.sleeps = sleeps
        self.observer = observer

    def overdrawn(self, serve: str) -> bool:
        """Observation sees the serve draw over its reservation plus the tolerance."""
        res = self.svc.ledger.reservations.get(serve)
        seen = self.observer.observed_each_mib(serve) if self.observer.available else None
        return (res is not None and seen is not None
                and seen > res.mib + self.svc.config.daemon.overdraw_tolerance_mib)

    async def check(self, serve: str, spec: ServeConfig) -> Reconcile:
        """Ask the serve what it is and put the ledger right if it disagrees; what was done."""
        if not spec.sleep_level or spec.port is None:
            return Reconcile.AGREE
        said = await self.sleeps.is_sleeping(serve, spec)
        recorded = self.svc.state_of(serve)
        prepared = await self.prepared(serve, spec, said)
        if not disagrees(recorded, said, overdrawn=self.overdrawn(serve), prepared=prepared):
            return Reconcile.AGREE
        lock = self.serves.runtime.serve_lock(serve)
        if lock.locked():
            return Reconcile.AGREE  # a sleep, wake or stop is under way: the next check asks
        roles = spec.all_roles
        self.svc.hold(serve, roles, f"reconciling: {serve} says {_said(said)}, the ledger holds "
                      f"it {recorded}; admissions on {', '.join(roles)} wait until it is "
                      "put right")
        stop = False
        try:
            async with lock:
                if self.serves.runtime.life(serve).busy:
                    return Reconcile.AGREE
                recorded = self.svc.state_of(serve)
                said = await self.sleeps.is_sleeping(serve, spec)
                prepared = await self.prepared(serve, spec, said)
                over = self.overdrawn(serve)
                awake = self.sleeps.awake_mib(serve, spec)
                fits = all(self.svc.free_for(serve, r) >= awake for r in roles)
                decision = reconcile(recorded, said, overdrawn=over, awake_fits=fits,
                                     preemptible=spec.preemptible, prepared=prepared)
                if decision is Reconcile.ADMIT_AWAKE_RESTORE:
                    try:
                        await self._admit_awake(serve, spec, said, awake)
                    except Denied as exc:
                        log.warning("%s: prepared for a checkpoint outside gpud, not "
                                    "re-admitted: %s", serve, exc.message)
                        decision = Reconcile.STOP
                    else:
                        await self._restore(serve, spec)
                elif decision is Reconcile.RESTORE:
                    await self._restore(serve, spec)
                if decision is Reconcile.ADMIT_AWAKE:
                    try:
                        await self._admit_awake(serve, spec, said, awake)
                    except Denied as exc:  # the figures moved since: as if it did not fit
                        log.warning("%s: woken outside gpud, not re-admitted: %s", serve,
                                    exc.message)
                        decision = (Reconcile.STOP if spec.preemptible == SleepAction.STOP
                                    else Reconcile.SLEEP_AGAIN)
                if decision is Reconcile.SLEEP_AGAIN:
                    stop = not await self._sleep_again(serve, spec, said, awake)
                elif decision is Reconcile.STOP and prepared:
                    await self._say(serve, spec, said, awake, "stopped (prepared for a process "
                                    "checkpoint, it can be neither put back to sleep nor "
                                    "restored within its sleep reservation)", outside=True)
                    stop = True
                elif decision is Reconcile.STOP:
                    await self._say(serve, spec, said, awake, "stopped (it is preempted by "
                                    "stopping)", outside=True)
                    stop = True
                elif decision is Reconcile.SHOW_ASLEEP:
                    await self._show_asleep(serve, spec)
            if stop:
                await self.serves.stop_job.stop(serve, None)
            return decision
        finally:
            self.svc.lift(serve)

    async def prepared(self, serve: str, spec: ServeConfig, said: bool | None) -> bool:
        """Whether a serve that says it sleeps is in fact prepared for a process checkpoint
        (vLLM 0.34's `GET /checkpoint/status`, `{"state": ...}`: 200 prepared, 503 otherwise,
        500 failed: api_router.py:80-97). Asked only on a release that has the route."""
        if said is not True or not behaviour(self.svc.config.daemon.vllm_version).checkpoint_routes:
            return False
        try:
            async with self.serves.runtime.serve_http(serve, spec).get(
                    self.sleeps.url(serve, spec, "/checkpoint/status"),
                    timeout=aiohttp.ClientTimeout(total=CHECKPOINT_STATUS_TIMEOUT_S)) as resp:
                body = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, GpudError):
            return False
        return isinstance(body, dict) and body.get("state") in PREPARED_STATES

    async def _restore(self, serve: str, spec: ServeConfig) -> None:
        """POST /checkpoint/restore; reported either way, the reservation untouched."""
        res = self.svc.ledger.reservations.get(serve)
        mib = res.mib if res else None
        why = (f"{serve} was prepared for a process checkpoint outside gpud (is_sleeping true, "
               f"/checkpoint/status prepared, {self._seen(serve)})")
        try:
            await self.sleeps.post(serve, spec, "/checkpoint/restore")
        except GpudError as exc:
            log.error("%s: not restored: %s", why, exc.message)
            await self.svc.store_event(self.svc.event(
                EventKind.WAKE, f"{why}: POST /checkpoint/restore failed ({exc.message}); its "
                f"reservation of {mib} MiB is kept until it is restored", serve=serve,
                role=spec.role, mib=mib, outside=True, checkpoint="prepared"))
            return
        await self.svc.store_event(self.svc.event(
            EventKind.WAKE, f"{why}: restored (POST /checkpoint/restore) within its reservation "
            f"of {mib} MiB", serve=serve, role=spec.role, mib=mib, outside=True,
            checkpoint="restored"))

    async def _admit_awake(self, serve: str, spec: ServeConfig, said: bool | None,
                           awake: int) -> None:
        asleep = self.svc.ledger.reservations[serve].mib
        why = f"{serve} was woken outside gpud ({_said(said)}, {self._seen(serve)})"
        # An admission like any (its own event), then the wake, as gpud's own wake says both:
        # admitted at its awake size it is still recorded asleep, and awake only with the wake's
        # event, in one commit (a gpud killed between the two finds it asleep at its awake size
        # and looks again; it never finds it running with no wake recorded)
        await self.svc.admit(serve, awake, happened=Happened.WAKE_ADMITTED, event=(
            EventKind.ADMIT, f"{why}: re-admitted awake at {awake} MiB (was {asleep} MiB asleep)",
            {"outside": True, "waking": True}))
        await self.svc.store_event(self.svc.event(
            EventKind.WAKE, f"{why}: awake at {awake} MiB (was {asleep} MiB asleep)", serve=serve,
            role=spec.role, mib=awake, outside=True, from_mib=asleep),
            report=self.svc.report(serve, Happened.WOKEN), meta={meta_key(serve): None})

    async def _sleep_again(self, serve: str, spec: ServeConfig, said: bool | None,
                           awake: int) -> bool:
        """Put it back to sleep at the level it slept at; False when it would not."""
        level = self.sleeps.note(serve).get("level") or spec.sleep_level
        await self._say(serve, spec, said, awake, f"put back to sleep (level {level})",
                        outside=True)
        try:
            await self.sleeps.ask_to_sleep(serve, spec, int(level))
        except GpudError as exc:
            log.error("%s: woken outside gpud and could not be put back to sleep (%s): "
                      "stopping it", serve, exc.message)
            return False
        return True

    async def _say(self, serve: str, spec: ServeConfig, said: bool | None, awake: int,
                   what: str, *, outside: bool) -> None:
        res = self.svc.ledger.reservations.get(serve)
        free = min(self.svc.free_for(serve, r) for r in spec.all_roles)
        await self.svc.store_event(self.svc.event(
            EventKind.WAKE, f"{serve} was woken outside gpud ({_said(said)}, {self._seen(serve)}) and "
            f"does not fit awake ({awake} MiB, {free} MiB free for it): {what}",
            serve=serve, role=spec.role, mib=res.mib if res else None, outside=outside,
            awake_mib=awake, free_mib=free))

    async def _show_asleep(self, serve: str, spec: ServeConfig) -> None:
        res = self.svc.ledger.reservations[serve]
        note = {"level": None, "preempted_by": None, "parked_host_mib": 0,
                "awake_mib": res.mib, "outside": True}
        reason = "asleep (put to sleep outside gpud; reservation kept)"
        await self.svc.admit(serve, res.mib, happened=Happened.ASLEEP, shrink=True,
                             state_reason=reason,
                             event=(EventKind.SLEEP, f"{serve} was put to sleep outside gpud "
                                           f"(is_sleeping true, {self._seen(serve)}): shown "
                                           f"sleeping, its reservation of {res.mib} MiB kept",
                                           {"outside": True, "from_mib": res.mib}),
                             meta={meta_key(serve): json.dumps(note)})

    def _seen(self, serve: str) -> str:
        seen = self.observer.observed_each_mib(serve) if self.observer.available else None
        return "draw not observed" if seen is None else f"{seen} MiB drawn"
