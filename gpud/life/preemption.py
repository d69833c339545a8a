"""Preemption by priority: an admission that does not fit puts serves of lower priority on its
roles to sleep (or stops them) to make room.

gpud/core/preempt.py plans it; this carries the plan out under the coordination lock (one for
all of gpud, taken before any serve's lock: gpud.life.locks): the plan's steps in order (as
gpud.core.actions steps, through gpud.life.steps, the executor apply uses too), each an event,
then the admission; when that is still refused, every step done is undone in reverse order and
the denial says why. A serve stopped for a preemption has what is in flight on it drained
first. The sleeps (gpud.life.sleeping.Sleeps) put serves to sleep and wake them; a wake with
preempt, a start with --preempt and an admission with --preempt come here.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any, Protocol

from gpud.config import ServeConfig
from gpud.core.actions import Action, preemption, undo_in_reverse
from gpud.core.lifecycle import ServeLife
from gpud.core.preempt import Candidate, NoPlan, PreemptPlan, plan_on_roles
from gpud.core.serverecord import Happened
from gpud.core.vocab import RUNNING, DenialBound, EventKind, SleepAction, StepKind
from gpud.errors import Denied, GpudError
from gpud.life.locks import Taken
from gpud.life.service import LedgerService
from gpud.life.steps import carry_out, undo_all
from gpud.life.traffic import Drains, Stops, drain_and_stop

log = logging.getLogger("gpud.sleeping")


class _NotPreempted(Exception):
    """A serve of a preemption's steps could not be put to sleep or stopped."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ServesRuntime(Protocol):
    """What a preemption asks of the serves' runtime (gpud.life.supervisor.base.Runtime)."""

    def life(self, serve: str) -> ServeLife: ...
    def spec(self, serve: str) -> ServeConfig: ...


class Starting(Protocol):
    """A start (gpud.life.supervisor.launch.LaunchJob)."""

    async def start(self, serve: str, uid: int | None, *, wait: bool = False,
                    preempt: bool = False) -> dict[str, Any] | None: ...


class Returning(Protocol):
    """Memory coming back after stops (gpud.life.supervisor.stop.MemoryReturn)."""

    async def back_all(self, serve: str) -> None: ...


class SupervisorParts(Protocol):
    """The supervisor's parts a preemption asks (part of gpud.life.sleeping.SleepSupervisor)."""

    @property
    def runtime(self) -> ServesRuntime: ...
    @property
    def launch_job(self) -> Starting: ...
    @property
    def stop_job(self) -> Stops: ...
    @property
    def memory(self) -> Returning: ...


class Sleeper(Protocol):
    """What a preemption asks of the sleeps (gpud.life.sleeping.Sleeps): the service, the
    supervisor, what is in flight, what a serve keeps asleep, the coordination lock, and a
    sleep and a wake."""

    @property
    def svc(self) -> LedgerService: ...
    @property
    def serves(self) -> SupervisorParts: ...
    @property
    def traffic(self) -> Drains | None: ...
    def sleep_mib(self, serve: str, spec: ServeConfig) -> int | None: ...
    async def post(self, serve: str, spec: ServeConfig, path: str) -> None: ...
    def role_lock(self, _role: str) -> Taken: ...
    async def sleep(self, serve: str, uid: int | None, level: int | None = None, *,
                    preempted_by: str | None = None, idle_s: float | None = None,
                    uncut: bool = False, evicted_for: str | None = None) -> dict[str, Any]: ...
    async def wake(self, serve: str, uid: int | None, *, locked: bool = False,
                   by: str = "gpuctl wake", preempt: bool = False) -> dict[str, Any]: ...


class Preemption:
    """The preemptions of one gpud, carried out with the sleeps (`Sleeper`)."""

    def __init__(self, sleeps: Sleeper) -> None:
        self.sleeps = sleeps
        self.svc = sleeps.svc
        self.serves = sleeps.serves

    def candidates(self, serve: str, roles: tuple[str, ...]) -> list[Candidate]:
        """The running serves on any of `roles` that a preemption could put to sleep or stop,
        each with every role it holds its reservation on (it frees memory on each)."""
        out: list[Candidate] = []
        seen: set[str] = set()
        for role in roles:
            for res in self.svc.ledger.on_role(role):
                name = res.serve
                spec = self.svc.serve_spec(name)
                if name == serve or name in seen or spec is None or res.external \
                        or spec.all_roles != res.all_roles:
                    continue
                seen.add(name)
                if self.svc.state_of(name) != RUNNING or self.serves.runtime.life(name).busy:
                    continue
                if spec.preemptible == SleepAction.STOP:
                    out.append(Candidate(name, spec.priority, res.mib, SleepAction.STOP, 0,
                                         res.all_roles))
                elif spec.sleep_level:
                    keeps = self.sleeps.sleep_mib(name, spec)
                    if keeps is not None:
                        out.append(Candidate(name, spec.priority, res.mib, SleepAction.SLEEP, keeps,
                                             res.all_roles))
        return out

    def plan(self, serve: str, mib: int) -> PreemptPlan | NoPlan:
        """The plan on every role of the serve (victims on any of them; one on several frees
        on each)."""
        spec = self.serves.runtime.spec(serve)
        free = {r: self.svc.free_for(serve, r) for r in spec.all_roles}
        return plan_on_roles(serve, spec.priority, mib, free,
                             self.candidates(serve, spec.all_roles))

    def what_preemption_would_do(self, serve: str, mib: int) -> tuple[str, dict[str, Any]]:
        """For a denial without --preempt: what a preemption would do, when it could."""
        if self.svc.serve_spec(serve) is None:
            return "", {}
        plan = self.plan(serve, mib)
        if isinstance(plan, NoPlan) or not plan.steps:
            return "", {}  # nothing a preemption could do: the denial as it always was
        steps = "; ".join(s.line() for s in plan.steps)
        return (f"; with --preempt gpud would: {steps}", {"preemption": plan.to_json()})

    @contextlib.contextmanager
    def preemption_hint(self, serve: str, mib: int) -> Iterator[None]:
        """A denial of `serve`'s admission (`mib`) inside says what `--preempt` would do, when a
        preemption could make room; a denial because a device is gone says nothing more. The
        one place the hint is added: a plain admission and a start without --preempt."""
        try:
            yield
        except Denied as exc:
            if exc.details.get("bound") == DenialBound.DEVICE:
                raise
            would, details = self.what_preemption_would_do(serve, mib)
            raise Denied(exc.message + would, {**exc.details, **details}) from exc

    async def admit_preempting(self, serve: str, mib: int, uid: int | None, *,
                               dry_run: bool = False, locked: bool = False,
                               happened: Happened = Happened.ADMITTED,
                               event: tuple[EventKind, str, dict[str, Any]] | None = None,
                               ) -> dict[str, Any]:
        """Admit `serve`, putting lower-priority serves to sleep (or stopping them) when it does
        not fit. Returns the plan carried out (or, with `dry_run`, the plan alone). `locked`:
        the caller holds `coordination` already. `happened` and `event` are the admission's
        (LedgerService.admit): a wake's re-admission keeps the serve sleeping until it is
        awake, its event saying so, with the plan carried out in its details."""
        spec = self.serves.runtime.spec(serve)

        async def admit(plan: dict[str, Any] | None = None) -> None:
            said = event if event is None or plan is None else (
                event[0], event[1], {**event[2], "preemption": plan})
            await self.svc.admit(serve, mib, uid=uid, happened=happened, event=said)

        async with contextlib.AsyncExitStack() as stack:
            if not locked and not dry_run:  # a plan alone changes nothing: it waits on no one
                await stack.enter_async_context(self.sleeps.role_lock(spec.role))
            plan = self.plan(serve, mib)
            if isinstance(plan, NoPlan):
                if dry_run:
                    return {"dry_run": True, "preemption": plan.to_json(), "fits": False}
                try:
                    await admit()
                except Denied as exc:
                    raise Denied(f"{exc.message}; no preemption can make room: {plan.reason}",
                                 {**exc.details, "preemption": plan.to_json()}) from exc
                return {"preemption": None}
            if dry_run:
                return {"dry_run": True, "preemption": plan.to_json(), "fits": True}
            if not plan.steps:
                try:
                    await admit()
                    return {"preemption": None}
                except Denied:
                    plan = self.plan(serve, mib)  # decided again below, as any plan
                    if isinstance(plan, NoPlan) or not plan.steps:
                        raise
            for line in plan.lines():
                log.info("%s", line)
            steps = {s.serve: s for s in plan.steps}

            async def do(action: Action) -> None:
                assert action.serve is not None
                step = steps[action.serve]
                await self.svc.store_event(self.svc.event(
                    EventKind.PREEMPT, f"{step.serve} preempted by {serve}: {step.line()}",
                    serve=step.serve, role=(step.roles or spec.all_roles)[0],
                    mib=step.frees_mib, uid=uid,
                    preempted_by=serve, action=step.action, priority=step.priority,
                    by_priority=spec.priority))
                try:
                    if action.kind == StepKind.SLEEP:
                        await self.sleeps.sleep(step.serve, uid, preempted_by=serve)
                    else:
                        # drained first; what is left at the bound is ended, told where the
                        # serve can be (drain_to_stop), then stopped
                        vspec = self.serves.runtime.spec(step.serve)
                        await drain_and_stop(
                            self.sleeps.traffic, self.serves.stop_job, step.serve, vspec, uid,
                            self.svc.config.daemon.drain_timeout_s, cut=True,
                            tell=functools.partial(self.sleeps.post, step.serve, vspec))
                except GpudError as exc:
                    raise _NotPreempted(f"{step.serve} could not be preempted: "
                                        f"{exc.message}") from exc

            done: list[Action] = []
            failure: str | None = None
            try:
                await carry_out(preemption(plan), do, done, count_begun=False)
            except _NotPreempted as exc:
                failure = exc.message
            if failure is None:
                if any(action.kind == StepKind.STOP for action in done):
                    # a stopped serve's memory shows as free once its process is gone
                    await self.serves.memory.back_all(serve)
                try:
                    await admit(plan.to_json())
                    return {"preemption": plan.to_json()}
                except Denied as exc:
                    failure = f"still does not fit after the preemption: {exc.message}"
            undone = await self._undo(done, uid, serve)
            raise Denied(f"{serve} not admitted: {failure}; undone: {undone or 'nothing'}",
                         {"serve": serve, "role": spec.role, "need_mib": mib,
                          "preemption": plan.to_json(), "undone": undone})

    async def _undo(self, done: list[Action], uid: int | None, serve: str) -> str:
        async def do(undo: Action) -> None:
            assert undo.serve is not None
            try:
                if undo.kind == StepKind.WAKE:
                    await self.sleeps.wake(undo.serve, uid, locked=True,
                                    by=f"undo of the preemption by {serve}")
                else:
                    await self.serves.launch_job.start(undo.serve, uid)
            except GpudError as exc:
                log.error("undoing the preemption of %s by %s failed: %s", undo.serve, serve,
                          exc.message)
                raise

        tried = await undo_all(undo_in_reverse(done), do)
        return ", ".join(f"{u.kind} {u.serve}" + (f" FAILED ({exc.message})" if exc else "")
                         for u, exc in tried)
