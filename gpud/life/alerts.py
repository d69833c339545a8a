"""Events from observation: reserve-exceeded / reserve-ok per device, overdraw per serve.

Each fires once per crossing (gpud.host.observer.Crossings), not once per poll.
"""

from __future__ import annotations

from gpud.core.ledger import DeviceDraw
from gpud.core.observation import Observation
from gpud.core.vocab import LIVE_STATES, EventKind
from gpud.host.observer import Crossings, Observer, all_draws, overdraws
from gpud.life.service import LedgerService


class Alerts:
    def __init__(self, svc: LedgerService, observer: Observer) -> None:
        self.svc = svc
        self.observer = observer
        self.reserve = Crossings()
        self.overdraw = Crossings()
        self.lost: dict[str, str] = {}  # device uuid -> problem
        self.strays: set[int] = set()  # PIDs already reported as container-outside-unit

    async def __call__(self, obs: Observation) -> None:
        if not obs.available:
            return
        await self._devices(obs)
        await self._reserve(obs)
        await self._overdraw()
        await self._container_strays(obs)

    async def _container_strays(self, obs: Observation) -> None:
        """container-outside-unit, once per process: a container's process draws GPU memory
        from outside every serve unit (an engine that keeps its containers in a cgroup of its
        own, as docker does, or podman without --cgroups=split), so that memory counts as
        non-ledger draw although a container runs it."""
        strays = self.observer.strays
        for dev in obs.devices:
            for proc in dev.processes or ():
                found = strays.get(proc.pid)
                if found is None or proc.pid in self.strays:
                    continue
                container, path = found
                await self.svc.store_event(self.svc.event(
                    EventKind.CONTAINER_OUTSIDE_UNIT,
                    f"pid {proc.pid} of container {container} draws {proc.mib} MiB on "
                    f"{dev.uuid} from outside every serve unit (cgroup {path}): counted as "
                    "non-ledger draw, not as a serve's; gpud runs its container serves with "
                    "podman --cgroups=split inside their unit", pid=proc.pid,
                    container=container, cgroup=path, device=dev.uuid, mib_drawn=proc.mib))
        self.strays = set(strays)

    async def _devices(self, obs: Observation) -> None:
        """device-lost when a device turns unreadable, device-back when it reads again; each
        names the roles and serves on it."""
        now = {d.uuid: d.problem or "device unhealthy" for d in obs.devices if not d.healthy}
        ledger = self.svc.ledger
        for uuid in sorted(now.keys() ^ self.lost.keys()):
            roles = sorted(n for n, b in ledger.roles.items() if not b.missing
                           and (d := self.observer.device(b.device)) is not None
                           and d.uuid == uuid)
            serves = sorted(s for s, r in ledger.reservations.items()
                            if any(r.on(role) for role in roles))
            live = [s for s in serves if self.svc.state_of(s) in LIVE_STATES]
            on = f"roles {', '.join(roles) or 'none'}; serves {', '.join(serves) or 'none'}"
            if uuid in now:
                await self.svc.store_event(self.svc.event(
                    EventKind.DEVICE_LOST, f"device {uuid} lost ({now[uuid]}): admissions and starts on "
                    f"it are denied; {on}" + (f"; running: {', '.join(live)}" if live else ""),
                    role=",".join(roles) or None, device=uuid, problem=now[uuid],
                    serves=",".join(serves)))
            else:
                await self.svc.store_event(self.svc.event(
                    EventKind.DEVICE_BACK, f"device {uuid} is readable again (was: {self.lost[uuid]}); "
                    f"{on}", role=",".join(roles) or None, device=uuid, serves=",".join(serves)))
        self.lost = now

    async def _reserve(self, obs: Observation) -> None:
        ledger, states = self.svc.ledger, self.svc.states()
        excess: dict[str, int] = {}
        figures: dict[str, tuple[str, DeviceDraw]] = {}
        for dev in obs.devices:
            roles = [n for n, b in ledger.roles.items() if not b.missing
                     and (d := self.observer.device(b.device)) is not None and d.uuid == dev.uuid]
            if not roles:
                continue
            draw = self.observer.draw_for(dev.uuid, ledger, states)
            if draw is None:
                continue
            excess[dev.uuid] = draw.reserve_excess_mib
            figures[dev.uuid] = (",".join(sorted(roles)), draw)
        rose, fell = self.reserve.update(excess)
        tag = " (simulated)" if self.observer.simulated else ""
        for uuid in rose:
            names, draw = figures[uuid]
            unseen = (f"; {draw.pending_mib} MiB of serves still starting left out"
                      if draw.pending_mib else "")
            est = f" (estimated: no per-process memory{unseen})" if draw.estimated else ""
            await self.svc.store_event(self.svc.event(
                EventKind.RESERVE_EXCEEDED,
                f"non-ledger draw on {names}{tag}{est} is {draw.non_ledger_draw_mib} MiB, above the "
                f"reserve of {draw.reserve_mib} MiB: ledger free is optimistic by "
                f"{draw.reserve_excess_mib} MiB",
                role=names, mib=draw.reserve_excess_mib, device=uuid,
                non_ledger_draw_mib=draw.non_ledger_draw_mib, reserve_mib=draw.reserve_mib,
                simulated=self.observer.simulated))
        for uuid in fell:
            if uuid not in figures:
                continue
            names, draw = figures[uuid]
            await self.svc.store_event(self.svc.event(
                EventKind.RESERVE_OK,
                f"non-ledger draw on {names}{tag} is back within the reserve: "
                f"{draw.non_ledger_draw_mib} of {draw.reserve_mib} MiB",
                role=names, mib=draw.non_ledger_draw_mib, device=uuid,
                reserve_mib=draw.reserve_mib, simulated=self.observer.simulated))

    async def _overdraw(self) -> None:
        tolerance = self.svc.config.daemon.overdraw_tolerance_mib
        observed = all_draws(self.observer.draws.values())
        reserved = {s: r.mib for s, r in self.svc.ledger.reservations.items()
                    if self.svc.state_of(s) in LIVE_STATES}
        # A serve on several devices is judged on each: its reservation is per device, and
        # its draw there is that of its processes on that device (vLLM: one worker per GPU).
        per_device: dict[str, tuple[str, str, int]] = {}  # key -> (serve, role, MiB drawn)
        for serve in list(reserved):
            res = self.svc.ledger.reservations[serve]
            if not res.extra_roles:
                continue
            del reserved[serve]
            for role in res.all_roles:
                budget = self.svc.ledger.roles.get(role)
                dev = self.observer.device(budget.device) if budget else None
                if dev is None:
                    continue
                key = f"{serve}@{role}"
                drawn = self.observer.draws.get(dev.uuid, {}).get(serve, 0)
                per_device[key] = (serve, role, drawn)
                observed[key] = drawn
                reserved[key] = res.mib
        over = overdraws(observed, reserved, tolerance)
        rose, _ = self.overdraw.update(over)
        for key in rose:
            if key in per_device:
                serve, role, drawn = per_device[key]
                res = self.svc.ledger.reservations[serve]
                await self.svc.store_event(self.svc.event(
                    EventKind.OVERDRAW,
                    f"{serve} draws {drawn} MiB on {role}, over its reservation there of "
                    f"{res.mib} MiB plus the tolerance of {tolerance} MiB",
                    serve=serve, role=role, mib=drawn, reservation_mib=res.mib,
                    tolerance_mib=tolerance, over_mib=drawn - res.mib,
                    roles=list(res.all_roles)))
                continue
            serve = key
            res = self.svc.ledger.reservations[serve]
            await self.svc.store_event(self.svc.event(
                EventKind.OVERDRAW,
                f"{serve} draws {observed.get(serve, 0)} MiB, over its reservation of {res.mib} "
                f"MiB plus the tolerance of {tolerance} MiB",
                serve=serve, role=res.role, mib=observed.get(serve, 0),
                reservation_mib=res.mib, tolerance_mib=tolerance,
                over_mib=observed.get(serve, 0) - res.mib))
