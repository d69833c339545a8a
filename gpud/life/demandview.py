"""What the on-demand orchestrator (gpud.life.ondemand) reads of the serves to decide: whether a
serve is settling (being put to sleep or stopped) or starting by someone else's hand, what is in
flight on it and since when it has been quiet, what bringing it back costs, which running serves
a queued request may evict and what each would free, and whether a serve can ever fit. Reads
only: the decisions on these values are the pure core's (gpud.core.queue, gpud.core.bringup,
gpud.core.traffic), the acts the orchestrator's."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpud.core import bringup
from gpud.core.queue import (
    Ask,
    EvictionCandidate,
    Freeing,
    Held,
    could_fit,
    evictable,
    idle_in,
    may_evict,
)
from gpud.core.serverecord import settling
from gpud.core.traffic import Flight, idle_from
from gpud.core.vocab import RUNNING, SLEEPING, STARTING, SleepAction, StepKind
from gpud.life.counts import DemandCounts

if TYPE_CHECKING:
    from gpud.config import ServeConfig
    from gpud.life.service import LedgerService
    from gpud.life.supervisor import Supervisor
    from gpud.life.traffic import Traffic


class DemandView:
    def __init__(self, svc: LedgerService, supervisor: Supervisor, *,
                 clock: Callable[[], float] = time.monotonic,
                 traffic: Traffic | None = None) -> None:
        self.svc = svc
        self.sup = supervisor
        self.clock = clock
        self.traffic = traffic
        # what it has done, counted by serve (the metrics', read when scraped)
        self.counts = DemandCounts()


    def start_under_way(self, name: str) -> bool:
        """A start of NAME that is not a request's is under way: its state is starting, or its
        launch (a boot's, an operator's) or the health wait of its restart after a crash runs.
        A request waits for it rather than start it again or be refused."""
        life = self.sup.runtime.life(name)
        return self.svc.state_of(name) == STARTING or life.launching or life.watching

    def settling(self, name: str) -> bool:
        """A sleep or a stop of NAME is under way (or the drain before one, or the idle
        check's decision to): a request must not reach it now."""
        return settling(self.svc.records.demand(name), self.sup.runtime.life(name).phase,
                        self.traffic is not None and self.traffic.draining(name))

    def never_fits(self, name: str) -> str | None:
        """Why serve NAME can never fit as configured (gpud.core.bringup.never_fits)."""
        spec = self.svc.serve_spec(name)
        roles = self.svc.ledger.roles
        if spec is None:
            return None
        return bringup.never_fits(spec.vram_mib, {
            r: roles[r].capacity_mib - roles[r].reserve_mib for r in spec.all_roles if r in roles})

    def _holds(self, name: str, role: str) -> int:
        res = self.svc.ledger.reservations.get(name)
        return res.mib if res is not None and role in res.all_roles else 0

    def _ask(self, name: str, spec: ServeConfig) -> Ask:
        """NAME as the backfill sees it: what its bring-up adds on each of its roles (a sleeping
        serve wakes to its awake reservation), and what each serve it may evict would free on
        each role, once it may evict it (router.min_awake_s, the idle time)."""
        router = self.svc.config.router
        min_awake_s = router.min_awake_s if router is not None else 0.0
        need = self.sup.sleeps.awake_mib(name, spec) \
            if self.svc.state_of(name) == SLEEPING else spec.vram_mib
        takes = {r: need - self._holds(name, r) for r in spec.all_roles}
        frees = []
        for h in self._running_beside(name, spec):
            # as `victims` takes them: evictable at its min_awake_s, or once idle if sooner
            awake_s = evictable(h, spec.priority, min_awake_s)
            in_s = min(awake_s, idle_in(h))
            res = self.svc.ledger.reservations.get(h.serve)
            if res is None or math.isinf(awake_s):
                continue
            o = self.svc.config.serves[h.serve]
            keeps = self.sup.sleeps.sleep_mib(h.serve, o) if o.sleep_level else 0
            mib = res.mib - (res.mib if keeps is None else min(keeps, res.mib))
            why = "min_awake_s" if in_s == awake_s and awake_s > 0 else "idle time"
            frees += [Freeing(r, mib, in_s, h.serve, why) for r in res.all_roles if r in takes]
        return Ask(name, takes, tuple(frees))

    @staticmethod
    def _candidate(name: str, o: ServeConfig) -> EvictionCandidate:
        return EvictionCandidate(name, o.priority, o.on_demand,
                         bool(o.sleep_level or o.preemptible == SleepAction.STOP))

    def _could_fit(self, name: str, spec: ServeConfig, need: int) -> bool:
        """Whether NAME (needing NEED MiB on each of its roles) would fit were every serve
        the queue may evict for it evicted (gpud.core.queue.could_fit): else waiting is
        pointless."""
        for role in spec.all_roles:
            freed = []
            for other, o in self.svc.config.serves.items():
                res = self.svc.ledger.reservations.get(other)
                # any that holds memory: running, starting, or being evicted now (it frees
                # what it holds once stopped); one asleep frees nothing more
                if other == name or res is None or role not in res.all_roles \
                        or self.svc.state_of(other) == SLEEPING \
                        or not may_evict(spec.priority, self._candidate(other, o)):
                    continue
                keeps = self.sup.sleeps.sleep_mib(other, o) if o.sleep_level else 0
                freed.append(res.mib - (res.mib if keeps is None else min(keeps, res.mib)))
            if not could_fit(need, self.svc.free_for(name, role), freed):
                return False
        return True

    def _running_beside(self, name: str, spec: ServeConfig) -> list[Held]:
        """The running serves on NAME's roles that a request may evict (may_evict); none
        being brought up, put to sleep or stopped."""
        now = self.clock()
        roles = set(spec.all_roles)
        out = []
        for other, o in self.svc.config.serves.items():
            if (other == name or self.svc.state_of(other) != RUNNING
                    or self.sup.bringup(other) is not None or self.settling(other)
                    or not roles & set(o.all_roles)):
                continue
            if not may_evict(spec.priority, self._candidate(other, o)):
                continue
            up_at = self.svc.records.demand(other).up_at
            out.append(Held(other, o.priority, self.in_flight(other), self.activity_s_ago(other),
                            None if up_at is None else now - up_at, self.cost_s(other, o)))
        return out

    def cost_s(self, name: str, spec: ServeConfig) -> float | None:
        """What bringing NAME back would take: the median of its last wakes when it can sleep,
        else of its last starts (None: none measured since gpud started)."""
        return self.bringup_s(name, StepKind.WAKE if spec.sleep_level else StepKind.START)

    def bringup_s(self, name: str, kind: StepKind) -> float | None:
        """The median of NAME's last measured bring-ups of KIND (gpud.core.queue.MEASURED)."""
        return self.counts.bringup_s(name, kind)

    def flight(self, name: str) -> Flight:
        return self.traffic.flight(name) if self.traffic is not None else Flight()

    def activity_s_ago(self, name: str) -> float | None:
        """Seconds since NAME's last request ended (0 while one is in flight): the later of
        the last request through its front (an on-demand serve's ensure) and the end of the
        last request it counted; None when neither is known since gpud started."""
        flight = self.flight(name)
        if flight.in_flight:
            return 0.0
        last = idle_from(self.svc.records.demand(name).last_request, flight)
        return None if last is None else round(max(0.0, self.clock() - last), 1)

    def in_flight(self, name: str) -> int | None:
        """The requests in flight on NAME as it last counted them (None: unknown)."""
        return self.flight(name).in_flight
