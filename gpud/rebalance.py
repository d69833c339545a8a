"""`gpuctl plan` and `gpuctl apply`: the seed's hand-made rebalance as two commands.

apply: validate and plan (refused, nothing touched, when the resident set would not fit or the
ledger invariant cannot hold, see gpud.core.transition), record the apply's intent in the store,
back up the config (timestamped, the last N kept), stop live serves that leave the config or
their role (while their spec is still in force), write the new file atomically, reload, restart
changed serves shrinking ones before growing ones (so a device is never over-committed on the
way), start resident serves that now fit, and verify their health. If a step fails, what was done
is undone in reverse and every serve is brought back to the state it had; a config file changed
on disk meanwhile is never written over. Each step is reported as it happens and logged as an
event; a gpud that died during an apply finds its record at the next start (`recover`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from gpud.config import Config, parse_config
from gpud.core import answers
from gpud.core.plan import Plan, ServeChange, make_plan
from gpud.core.vocab import LIVE_STATES, RUNNING
from gpud.errors import Conflict, Denied, GpudError, StoreError
from gpud.files import write_atomically
from gpud.observer import Observer
from gpud.service import LedgerService, resolve_budgets
from gpud.store import Changes
from gpud.supervisor import Supervisor

log = logging.getLogger("gpud.rebalance")

Emit = Callable[[answers.ApplyStep | answers.ApplyResult], Awaitable[None]]
# reload(uid, text): decide `text` (just written to the config file) against the ledger.
Reload = Callable[[int | None, str], Awaitable[answers.Reloaded]]
# The store's key for an apply under way: its intent and the steps done so far.
JOURNAL = "apply"


def _mib(value: int | None) -> str:
    return "none" if value is None else f"{value} MiB"


def backup(path: Path, keep: int, now: float) -> Path:
    folder = path.parent / "backups"
    folder.mkdir(mode=0o700, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.localtime(now)) + f".{int(now * 1e6) % 10**6:06d}"
    target = folder / f"{path.name}.{stamp}"
    try:
        shutil.copy2(path, target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            target.unlink()
        raise GpudError(f"cannot back up {path} to {target}: {exc.strerror or exc}") from exc
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

    @property
    def busy(self) -> bool:
        return self._busy

    def parse(self, text: str, source: str) -> Config:
        return self.svc.overrides(parse_config(text, source))

    def plan(self, text: str, source: str) -> Plan:
        return self._plan(self.parse(text, source), source)

    def _plan(self, cfg: Config, source: str) -> Plan:
        budgets = resolve_budgets(cfg, self.observer.device_total, self.observer.present_devices())
        totals = {b.device: self.observer.device_total(b.device) for b in budgets}
        totals.update({b.device: self.observer.device_total(b.device)
                       for b in self.svc.ledger.roles.values()})
        return make_plan(old=self.svc.config, new=cfg, ledger=self.svc.ledger,
                         new_budgets=budgets, states=self.svc.states(), totals=totals,
                         source=source)

    def check_can_begin(self) -> None:
        """An apply begins only when nothing else is changing the serves: not during another
        apply, and not while the resident set is still booting."""
        if self.config_path is None:
            raise Conflict("gpud runs without a config file: nothing to apply to")
        if self._busy:
            raise Conflict("another apply is in progress")
        if not self.supervisor.booted.is_set():
            starting = sorted(n for n in self.svc.known_serves()
                              if self.svc.state_of(n) in ("admitted", "starting"))
            raise Conflict("the resident set is still starting: apply when it is done "
                           f"(starting: {', '.join(starting) or 'none yet'})",
                           {"starting": starting})

    async def apply(self, text: str, source: str, uid: int | None,
                    emit: Emit) -> answers.ApplyResult:
        self.check_can_begin()
        self._busy = True
        try:
            return await self._apply(text, source, uid, emit)
        finally:
            self._busy = False

    async def _step(self, emit: Emit, step: str, message: str, ok: bool = True,
                    uid: int | None = None, *, path: str | None = None,
                    serve: str | None = None) -> None:
        line: answers.ApplyStep = {"step": step, "ok": ok, "message": message}
        if path is not None:
            line["path"] = path
        if serve is not None:
            line["serve"] = serve
        await emit(line)
        await self.svc.record(self.svc.event("apply", f"apply {step}: {message}", uid=uid,
                                             step=step, ok=ok))

    async def _journal(self, record: dict[str, Any] | None) -> None:
        await self.svc.put_meta(JOURNAL, None if record is None else json.dumps(record))

    async def _apply(self, text: str, source: str, uid: int | None,
                     emit: Emit) -> answers.ApplyResult:
        assert self.config_path is not None
        plan = self._plan(self.parse(text, source), source)
        if plan.blocked:
            message = "; ".join(b.message for b in plan.blocked)
            await self._step(emit, "validate", f"refused: {message}", ok=False, uid=uid)
            raise Conflict(f"apply refused, nothing changed: {message}",
                           {"blockers": [b.to_json() for b in plan.blocked],
                            "plan": plan.to_json()})
        if not plan.resident_fits:
            d = plan.denied[0]
            await self._step(emit, "validate", f"refused: {d.message}", ok=False, uid=uid)
            raise Denied(f"apply refused, nothing changed: the resident set does not fit: "
                         f"{d.message}", {"plan": plan.to_json()})
        old_text = self.svc.config_text or self.config_path.read_text()
        before = {n: self.svc.state_of(n) for n in self.svc.known_serves()}
        journal: dict[str, Any] = {"old": old_text, "new": text, "source": source,
                                   "uid": uid, "done": []}
        await self._journal(journal)  # before anything is touched: a crash is found at start
        done: list[tuple[str, ServeChange]] = []
        saved: Path | None = None
        try:
            await self._step(emit, "validate", f"{source} is valid; the resident set fits; "
                             f"restart: {', '.join(plan.restart) or 'none'}"
                             + (f"; stop first: {', '.join(plan.stop_first)}"
                                if plan.stop_first else ""), uid=uid)
            saved = backup(self.config_path, self.svc.config.daemon.config_backups, time.time())
            await self._step(emit, "backup", f"saved {saved}", uid=uid, path=str(saved))
            changes = {c.name: c for c in plan.serves}
            for name in plan.stop_first:
                await self._do_step(emit, journal, done, "stop", changes[name], uid)
            write_atomically(self.config_path, text)
            journal["written"] = True
            await self._journal(journal)
            await self._step(emit, "write", f"wrote {self.config_path}", uid=uid)
            await self.reload(uid, text)
            await self._step(emit, "reload", "config reloaded", uid=uid)
            for action, change in self._actions(plan):
                await self._do_step(emit, journal, done, action, change, uid)
            summary = self.svc.summary()
            await self._step(emit, "verify", f"all changed serves healthy; {summary}", uid=uid)
            await self._journal(None)
            return {"result": "applied", "backup": str(saved), "summary": summary}
        except GpudError as exc:
            with contextlib.suppress(GpudError):
                await self._step(emit, "failed", exc.message, ok=False, uid=uid)
            await self._rollback(old_text, text, done, before, uid, emit)
            with contextlib.suppress(GpudError):
                await self._journal(None)
            return {"result": "rolled-back", "error": exc.message,
                    "backup": str(saved) if saved else None, "summary": self.svc.summary()}

    async def _do_step(self, emit: Emit, journal: dict[str, Any],
                       done: list[tuple[str, ServeChange]], action: str, change: ServeChange,
                       uid: int | None) -> None:
        done.append((action, change))  # before: a half-done step is undone too
        journal["done"].append([action, change.name])
        await self._journal(journal)
        await self._do(action, change, uid)
        await self._step(emit, action, f"{change.name}: {action} done "
                         f"({_mib(change.mib_before)} -> {_mib(change.mib_after)})",
                         uid=uid, serve=change.name)

    def _actions(self, plan: Plan) -> list[tuple[str, ServeChange]]:
        """After the reload: restarts shrinking before growing, then starts by priority
        (serves that moved to another role start there again)."""
        moved = set(plan.stop_first)
        restarts = sorted((c for c in plan.serves if c.restart and c.name not in moved),
                          key=lambda c: ((c.mib_after or 0) - (c.mib_before or 0), c.name))
        new_cfg_priority = {c.name: i for i, c in enumerate(plan.serves)}
        starts = [("start", c) for c in plan.serves
                  if (c.state_after == "admitted" and c.state_before not in ("starting", "running"))
                  or (c.name in moved and c.role_after is not None)]
        starts.sort(key=lambda a: new_cfg_priority[a[1].name])
        return [("restart", c) for c in restarts] + starts

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

    async def _rollback(self, old_text: str, new_text: str, done: list[tuple[str, ServeChange]],
                        before: dict[str, str], uid: int | None, emit: Emit) -> None:
        """Undo in reverse, each serve back to the state it had before the apply: serves the
        apply started go first (they may not exist in the old config), then the old config is
        written back (unless the file changed on disk meanwhile) and reloaded, then restarted
        and stopped serves come back with their old figures."""
        assert self.config_path is not None
        started = [c for a, c in done if a == "start"]
        others = [(a, c) for a, c in reversed(done) if a != "start"]
        for change in reversed(started):
            await self._undo(emit, change.name, uid, self._undo_start(change, before, uid))
        try:
            on_disk = self.config_path.read_text()
        except OSError as exc:
            on_disk = f"(unreadable: {exc})"
        if on_disk == new_text:
            try:
                write_atomically(self.config_path, old_text)
            except GpudError as exc:
                await self._say(emit, "rollback", f"old config NOT written back: {exc.message}",
                                uid, ok=False)
                return
        elif on_disk != old_text:
            await self._say(emit, "rollback", f"{self.config_path} changed on disk since the "
                            "apply began: not written over; the serves stay as they are now",
                            uid, ok=False)
            return
        try:
            if self.svc.config_text != old_text:
                await self.reload(uid, old_text)
        except GpudError as exc:
            await self._say(emit, "rollback", f"old config written back but not reloaded: "
                            f"{exc.message}", uid, ok=False)
            return
        await self._say(emit, "rollback", "old config written back and reloaded", uid)
        for _action, change in others:
            await self._undo(emit, change.name, uid, self._undo_change(change, before, uid))

    async def _say(self, emit: Emit, step: str, message: str, uid: int | None, *,
                   ok: bool = True, serve: str | None = None) -> None:
        with contextlib.suppress(GpudError):
            await self._step(emit, step, message, ok=ok, uid=uid, serve=serve)

    async def _undo(self, emit: Emit, name: str, uid: int | None, work: Awaitable[None]) -> None:
        try:
            await work
            await self._say(emit, "rollback", f"{name}: back to {self.svc.state_of(name)}", uid,
                            serve=name)
        except GpudError as exc:
            await self._say(emit, "rollback", f"{name}: could not be restored: {exc.message}",
                            uid, ok=False, serve=name)

    async def _undo_start(self, change: ServeChange, before: dict[str, str],
                          uid: int | None) -> None:
        name = change.name
        if self.svc.serve_spec(name) is not None:
            with contextlib.suppress(GpudError):
                await self.supervisor.stop(name, uid, keep_reservation=True)
        held = self.svc.ledger.reservations.get(name)
        if held is not None and change.mib_before is None:
            await self.svc.release(name, uid=uid, reason="rollback", allow_live=True,
                                   next_state=before.get(name, "declared"))

    async def _undo_change(self, change: ServeChange, before: dict[str, str],
                           uid: int | None) -> None:
        name = change.name
        if self.svc.serve_spec(name) is None:
            return
        with contextlib.suppress(GpudError):
            await self.supervisor.stop(name, uid, keep_reservation=True)
        if change.mib_before is not None:
            await self.svc.admit(name, change.mib_before, uid=uid)
        if before.get(name) in LIVE_STATES:
            await self.supervisor.start(name, uid, wait=True)


class Recovery:
    """An apply that gpud did not live to finish left its record in the store. Before the
    ledger loads, the old config file goes back (unless the file changed since); once the units
    are reconciled, serves the apply started are stopped, the old config is reloaded, and serves
    it restarted are restarted on their old settings. The outcome is one `apply` event."""

    def __init__(self, svc: LedgerService, config_path: Path | None) -> None:
        self.svc = svc
        self.config_path = config_path
        self.record: dict[str, Any] | None = None
        self.outcome = ""

    def prepare(self) -> bool:
        """Put the old file back; True when there was an apply to recover."""
        raw = self.svc.store.meta(JOURNAL)
        if raw is None or self.config_path is None:
            return False
        try:
            record = json.loads(raw)
            old, new = str(record["old"]), str(record["new"])
            record["done"] = [(str(a), str(n)) for a, n in record.get("done", [])]
        except (ValueError, KeyError, TypeError):
            self.svc.store.commit(Changes(meta={JOURNAL: None}))
            return False
        self.record = record
        try:
            on_disk: str | None = self.config_path.read_text()
        except OSError:
            on_disk = None
        if on_disk == new:
            try:
                write_atomically(self.config_path, old)
                self.outcome = "the old config was written back"
            except GpudError as exc:
                self.outcome = f"the old config could NOT be written back ({exc.message})"
        elif on_disk == old:
            self.outcome = "the config file still held the old config"
        else:
            self.outcome = (f"{self.config_path} changed since the apply began: left as it is, "
                            "not written over")
        return True

    async def finish(self, supervisor: Supervisor, reload: Reload) -> str | None:
        if self.record is None or self.config_path is None:
            return None
        done: list[tuple[str, str]] = self.record["done"]
        notes: list[str] = []
        for action, name in reversed(done):
            if action == "start" and self.svc.state_of(name) in LIVE_STATES:
                try:
                    await supervisor.stop(name, None)
                    notes.append(f"stopped {name}")
                except GpudError as exc:
                    notes.append(f"could not stop {name}: {exc.message}")
        try:
            text = self.config_path.read_text()
            if text != self.svc.config_text:
                await reload(None, text)
            notes.append("old config reloaded")
        except (OSError, GpudError) as exc:
            notes.append(f"old config not reloaded: {getattr(exc, 'message', exc)}")
        for action, name in done:
            if action == "restart" and self.svc.serve_spec(name) is not None:
                try:
                    await supervisor.stop(name, None, keep_reservation=True)
                    await supervisor.start(name, None)
                    notes.append(f"restarted {name} on its old settings")
                except GpudError as exc:
                    notes.append(f"could not restart {name}: {exc.message}")
        steps = ", ".join(f"{a} {n}" for a, n in done) or "none"
        message = (f"apply interrupted (gpud stopped during it): {self.outcome}; steps it had "
                   f"done: {steps}; recovery: {'; '.join(notes)}")
        log.warning("%s", message)
        await self.svc.put_meta(JOURNAL, None)
        with contextlib.suppress(StoreError):
            await self.svc.record(self.svc.event("apply", message, step="recover", ok=False))
        return message
