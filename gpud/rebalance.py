"""`gpuctl plan` and `gpuctl apply`: the seed's hand-made rebalance as two commands.

apply: validate and plan (refused, nothing touched, when the resident set would not fit), back up
the config (timestamped, the last N kept), write the new one atomically, reload, then per device
stop serves that left, restart changed serves shrinking ones before growing ones (so a device is
never over-committed on the way), start resident serves that now fit, and verify their health.
If a step fails, the old config is written back, reloaded, and the touched serves are brought
back to what they were. Each step is reported as it happens and logged as an event.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from gpud.config import Config, parse_config
from gpud.errors import Conflict, Denied, GpudError
from gpud.observer import Observer
from gpud.plan import Plan, ServeChange, make_plan
from gpud.service import RUNNING, LedgerService, resolve_budgets
from gpud.supervisor import Supervisor

log = logging.getLogger("gpud.rebalance")

Emit = Callable[[dict[str, Any]], Awaitable[None]]
Reload = Callable[[int | None], Awaitable[dict[str, Any]]]


def _mib(value: int | None) -> str:
    return "none" if value is None else f"{value} MiB"


def write_atomically(path: Path, text: str, mode: int = 0o600) -> None:
    """Write, fsync, rename over, fsync the directory: a crash leaves the old or the new file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.fchmod(fd, mode)
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def backup(path: Path, keep: int, now: float) -> Path:
    folder = path.parent / "backups"
    folder.mkdir(mode=0o700, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.localtime(now)) + f".{int(now * 1e6) % 10**6:06d}"
    target = folder / f"{path.name}.{stamp}"
    shutil.copy2(path, target)
    for old in sorted(folder.glob(f"{path.name}.*"))[:-keep]:
        old.unlink()
    return target


class Rebalancer:
    def __init__(self, svc: LedgerService, supervisor: Supervisor, observer: Observer, *,
                 config_path: Path | None, reload: Reload) -> None:
        self.svc = svc
        self.supervisor = supervisor
        self.observer = observer
        self.config_path = config_path
        self.reload = reload
        self._busy = False

    def plan(self, text: str, source: str) -> Plan:
        cfg = parse_config(text, source)
        return self._plan(cfg, source)

    def _plan(self, cfg: Config, source: str) -> Plan:
        budgets = resolve_budgets(cfg, self.observer.device_total)
        totals = {b.device: self.observer.device_total(b.device) for b in budgets}
        totals.update({b.device: self.observer.device_total(b.device)
                       for b in self.svc.ledger.roles.values()})
        return make_plan(old=self.svc.config, new=cfg, ledger=self.svc.ledger,
                         new_budgets=budgets, states=self.svc.states(), totals=totals,
                         source=source)

    async def apply(self, text: str, source: str, uid: int | None, emit: Emit) -> dict[str, Any]:
        if self._busy:
            raise Conflict("another apply is in progress")
        if self.config_path is None:
            raise Conflict("gpud runs without a config file: nothing to apply to")
        self._busy = True
        try:
            return await self._apply(text, source, uid, emit)
        finally:
            self._busy = False

    async def _step(self, emit: Emit, step: str, message: str, ok: bool = True,
                    uid: int | None = None, **details: Any) -> None:
        await emit({"step": step, "ok": ok, "message": message, **details})
        await self.svc.record(self.svc.event("apply", f"apply {step}: {message}", uid=uid,
                                             step=step, ok=ok))

    async def _apply(self, text: str, source: str, uid: int | None, emit: Emit) -> dict[str, Any]:
        assert self.config_path is not None
        cfg = parse_config(text, source)
        plan = self._plan(cfg, source)
        if not plan.resident_fits:
            d = plan.denied[0]
            await self._step(emit, "validate", f"refused: {d.message}", ok=False, uid=uid)
            raise Denied(f"apply refused, nothing changed: the resident set does not fit: "
                         f"{d.message}", {"plan": plan.to_json()})
        await self._step(emit, "validate", f"{source} is valid; the resident set fits; restart: "
                         f"{', '.join(plan.restart) or 'none'}", uid=uid)
        old_text = self.config_path.read_text()
        saved = backup(self.config_path, self.svc.config.daemon.config_backups, time.time())
        await self._step(emit, "backup", f"saved {saved}", uid=uid, path=str(saved))
        write_atomically(self.config_path, text)
        await self._step(emit, "write", f"wrote {self.config_path}", uid=uid)
        done: list[tuple[str, ServeChange]] = []
        try:
            await self.reload(uid)
            await self._step(emit, "reload", "config reloaded", uid=uid)
            for action, change in self._actions(plan):
                done.append((action, change))  # before: a half-done step is undone too
                await self._do(action, change, uid)
                await self._step(emit, action, f"{change.name}: {action} done "
                                 f"({_mib(change.mib_before)} -> {_mib(change.mib_after)})",
                                 uid=uid, serve=change.name)
            summary = self.svc.summary()
            await self._step(emit, "verify", f"all changed serves healthy; {summary}", uid=uid)
            return {"result": "applied", "backup": str(saved), "summary": summary}
        except GpudError as exc:
            await self._step(emit, "failed", exc.message, ok=False, uid=uid)
            await self._rollback(old_text, done, uid, emit)
            return {"result": "rolled-back", "error": exc.message, "backup": str(saved),
                    "summary": self.svc.summary()}

    def _actions(self, plan: Plan) -> list[tuple[str, ServeChange]]:
        """Stops first, then restarts shrinking before growing, then new starts by priority."""
        removed = [("stop", c) for c in plan.serves
                   if c.change == "removed" and c.state_before in ("starting", "running")]
        restarts = sorted((c for c in plan.serves if c.restart),
                          key=lambda c: ((c.mib_after or 0) - (c.mib_before or 0), c.name))
        new_cfg_priority = {c.name: i for i, c in enumerate(plan.serves)}
        starts = [("start", c) for c in plan.serves
                  if c.state_after == "admitted" and c.state_before not in ("starting", "running")]
        starts.sort(key=lambda a: new_cfg_priority[a[1].name])
        return removed + [("restart", c) for c in restarts] + starts

    async def _do(self, action: str, change: ServeChange, uid: int | None) -> None:
        name = change.name
        if action == "stop":
            await self.supervisor.stop(name, uid)
            return
        if action == "restart":
            await self.supervisor.stop(name, uid, keep_reservation=True)
            if change.mib_after is not None:
                await self.svc.admit(name, change.mib_after, uid=uid)
        await self.supervisor.start(name, uid, wait=True)
        if self.svc.state_of(name) != RUNNING:
            rec = self.svc.records.get(name)
            raise GpudError(f"{name} did not become healthy: "
                            f"{rec.reason if rec and rec.reason else self.svc.state_of(name)}")

    async def _rollback(self, old_text: str, done: list[tuple[str, ServeChange]],
                        uid: int | None, emit: Emit) -> None:
        assert self.config_path is not None
        write_atomically(self.config_path, old_text)
        await self.reload(uid)
        await self._step(emit, "rollback", "old config written back and reloaded", uid=uid)
        # Undo in reverse: what was started goes away, what was restarted or stopped comes
        # back as it was. The serve that failed is undone too (it may be half started).
        for action, change in reversed(done):
            name = change.name
            try:
                if action == "start":
                    with contextlib.suppress(GpudError):
                        await self.supervisor.stop(name, uid)
                    if name in self.svc.ledger.reservations:
                        await self.svc.release(name, uid=uid, reason="rollback", allow_live=True)
                else:
                    with contextlib.suppress(GpudError):
                        await self.supervisor.stop(name, uid, keep_reservation=True)
                    if change.mib_before is not None:
                        await self.svc.admit(name, change.mib_before, uid=uid)
                    await self.supervisor.start(name, uid, wait=True)
                await self._step(emit, "rollback", f"{name}: back to its old config", uid=uid,
                                 serve=name)
            except GpudError as exc:
                await self._step(emit, "rollback", f"{name}: could not be restored: "
                                 f"{exc.message}", ok=False, uid=uid, serve=name)
