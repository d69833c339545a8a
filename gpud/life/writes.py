"""The write path of the ledger service: the one writer of the store and of what each serve's
record says was stored. Every change the service decides is queued here (`submit`) and written
in the next group commit, one transaction (one fsync) for every change decided while the one
before was being written; only once it is durable does the in-memory ledger move on, each
serve's record learn its stored state (gpud.core.serverecord.Stored), the event bus tell its
followers and the journal, and the caller get its answer. A failed commit leaves memory as it
was, and the decisions queued behind it fail with it. Repeated refusals of requests through
the front are coalesced here (`RepeatedRefusals`) before they are stored.

`LedgerService` (gpud.life.service) is this, with admission, holds, reload and reads on top:
it decides under `lock`, and hears of what became durable through `_freed` and
`_check_invariant`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from gpud.config import Config
from gpud.core import answers
from gpud.core.coalesce import Coalescer, Summary, Verdict
from gpud.core.ledger import Ledger
from gpud.core.serverecord import Reserved, Stored
from gpud.core.vocab import WARNING_KINDS, EventKind, ServeState
from gpud.durable.store import Changes, Event, EventQuery, Store
from gpud.errors import GpudError
from gpud.life.records import ServeRecords

log = logging.getLogger("gpud")

def prune_batch(keep: int) -> int:
    """Events are pruned down to `daemon.events_keep` after every this many new ones: a
    twentieth of it, so the store holds at most about 5% more than the setting (plus the events
    of one group commit). A fixed batch of 1000 kept 1,499 of an events_keep of 500."""
    return max(1, keep // 20)


# A store that keeps failing is said in the journal at most this often (seconds).
STORE_LOG_INTERVAL_S = 60.0

# Set (to True) in the task of a bring-up that a request through the front asked for
# (gpud.server.ondemand): its refusals are coalesced (gpud.core.coalesce), since anyone who reaches the
# front can make gpud refuse, as often as they like. An operator's refusals (the API's admit or
# start, the boot) are stored one by one, as the audit trail they are.
COALESCE_REFUSALS: ContextVar[bool] = ContextVar("gpud_coalesce_refusals", default=False)


@dataclass
class _Pending:
    changes: Changes
    ledger: Ledger | None
    future: asyncio.Future[list[Event]]


@dataclass
class Subscription:
    query: EventQuery
    queue: asyncio.Queue[Event | None] = field(default_factory=lambda: asyncio.Queue(1000))


class Writes:
    """The write path: the group commit, the store's thread, the event bus and the refusals'
    coalescer (see the module's doc). Changes are decided by the subclass (LedgerService),
    under `lock`."""

    def __init__(self, config: Config, store: Store, clock: Callable[[], float]) -> None:
        self.config = config
        self.store = store
        self.clock = clock
        self._lock = asyncio.Lock()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="gpud-store")
        self._subscribers: list[Subscription] = []
        self.counters: dict[str, int] = {}
        # the first commit prunes what an earlier run left
        self._since_prune = prune_batch(self.config.daemon.events_keep)
        self._records = ServeRecords()
        # `ledger` is what is durable (what everyone is shown); `_decided` has every decision
        # made, some of them still on their way to the store.
        self.ledger = Ledger({}, {})
        self._decided = self.ledger
        self._decided_states: dict[str, ServeState] = {}
        self._queue: list[_Pending] = []
        self._committer: asyncio.Task[None] | None = None
        self.commits = 0  # transactions written (one fsync each)
        # The store's failure, while its commits fail (a full or read-only state directory):
        # reported (status, a metric), and logged once per STORE_LOG_INTERVAL_S, not per try.
        self.store_error: str | None = None
        self.store_failing_since: float | None = None
        self.store_failures = 0
        self._store_logged_at: float | None = None
        # Called after each commit that stored a serve's state (gpud.nginx.front's awake files),
        # with the serves it changed.
        self._state_listeners: list[Callable[[frozenset[str]], None]] = []
        # Repeated refusals: one stored event per window and key (RepeatedRefusals).
        self.refusals = RepeatedRefusals(self.submit, lambda: self.clock(), self.counters)

    # ---- what the deciding side hears of durable changes -----------------------------------

    def _freed(self, roles: list[str]) -> None:
        """A durable change gave memory back on `roles` (called once per change)."""

    def _check_invariant(self) -> None:
        """Called after every group commit, on what is durable now."""

    # ---- the records and the store -----------------------------------------------------------

    def _reserved(self, serves: Iterable[str]) -> None:
        """What the ledger and the config now say of each of SERVES, into its record (one that
        has a record: a reservation alone makes none)."""
        for serve in list(serves):
            if serve in self._records:
                res = self.ledger.reservations.get(serve)
                self._records.apply(serve, Reserved(res is not None, bool(res and res.external),
                                                    serve in self.config.serves))

    @property
    def records(self) -> ServeRecords:
        """Every serve's record (gpud.life.records: read as a mapping; its state changed by this
        service alone, after a commit; the other parts through their one writer each)."""
        return self._records

    def watch_states(self, listener: Callable[[frozenset[str]], None]) -> None:
        """Call `listener` after every commit that stored a serve's state (read them from
        `states`), with the serves the commit changed: those whose state it stored, and those
        whose reservation it made or dropped (the memory it took or freed)."""
        self._state_listeners.append(listener)

    @property
    def lock(self) -> asyncio.Lock:
        """Held for every change of the ledger; commit() callers must hold it."""
        return self._lock

    def end_streams(self) -> None:
        """End every event stream (gpud is stopping)."""
        for sub in self._subscribers:
            with contextlib.suppress(asyncio.QueueFull):
                sub.queue.put_nowait(None)
        self._subscribers.clear()

    def close(self) -> None:
        self.end_streams()
        self._executor.shutdown(wait=True)
        # The refusals counted in open windows, stored before gpud goes (the store's thread
        # is done: this thread writes alone).
        summaries = self.refusals.close()
        if summaries:
            try:
                self.store.commit(Changes(events=summaries))
            except GpudError as exc:
                log.warning("storing the last refusals' summaries failed: %s", exc.message)


    # ---- the write path ------------------------------------------------------------------

    def event(self, kind: EventKind, message: str, *, serve: str | None = None,
              role: str | None = None, mib: int | None = None, uid: int | None = None,
              **details: Any) -> Event:
        """An event of `kind`, not yet stored."""
        if serve is not None and "roles" not in details:
            # Every event of a serve on several roles names them all (details.roles, journald
            # GPUD_ROLES), so that it is found by any of them; single-role events stay as they were.
            spec = self.config.serves.get(serve)
            held = self._decided.reservations.get(serve)
            roles = spec.all_roles if spec is not None else held.all_roles if held else ()
            if len(roles) > 1:
                details["roles"] = list(roles)
        return Event(kind, message, self.clock(), serve, role, mib, uid, details)

    def submit(self, changes: Changes, ledger: Ledger | None = None) -> asyncio.Future[list[Event]]:
        """Queue a decided change for the next group commit. Callers hold the lock: `ledger`
        (the ledger with this change) is what the next decision is made on at once; readers
        see it, and the caller is answered, only once the transaction holding it is durable.
        Every change decided while one transaction is being written goes into the next one."""
        future: asyncio.Future[list[Event]] = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(changes, ledger, future))
        if ledger is not None:
            self._decided = ledger
        for row in changes.states:
            self._decided_states[row.serve] = row.state
        if self._committer is None or self._committer.done():
            self._committer = asyncio.get_running_loop().create_task(self._commit_loop())
        return future

    async def commit(self, changes: Changes, ledger: Ledger | None = None) -> list[Event]:
        """Submit and wait until durable (see `submit`)."""
        return await self.submit(changes, ledger)

    async def _commit_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while self._queue:
            batch, self._queue = self._queue, []
            try:
                stored = await loop.run_in_executor(
                    self._executor, self.store.commit_many, [p.changes for p in batch])
            except BaseException as exc:
                # Nothing of this batch is durable, and what was decided after it rests on it:
                # every waiter hears the failure, and decisions start again from the store.
                failed, self._queue = batch + self._queue, []
                self._decided, self._decided_states = self.ledger, {}
                for p in failed:
                    if not p.future.done():
                        p.future.set_exception(exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                self._store_failed(exc)
                continue
            self.commits += 1
            self._store_works()
            for p, events in zip(batch, stored, strict=True):
                for row in p.changes.states:
                    self._records.apply(row.serve, Stored(row.state, row.reason, row.updated))
                if p.ledger is not None:
                    freed = _freed_roles(self.ledger, p.changes)
                    self.ledger = p.ledger
                    if freed:
                        self._freed(freed)
                self._reserved({r.serve for r in p.changes.states}
                               | {r.serve for r in p.changes.put} | set(p.changes.delete))
                for ev in events:
                    try:
                        self._announce(ev)
                    except Exception:  # the change is durable: its caller is answered anyway
                        log.exception("announcing event %s failed", ev.id)
                self._since_prune += len(events)
                if not p.future.done():
                    p.future.set_result(events)
            self._decided_states = {row.serve: row.state for p in self._queue
                                    for row in p.changes.states}
            self._check_invariant()
            if any(p.changes.states for p in batch):
                serves = frozenset(s for p in batch for s in (
                    *(r.serve for r in p.changes.states), *(r.serve for r in p.changes.put),
                    *p.changes.delete))
                for listener in self._state_listeners:
                    try:
                        listener(serves)
                    except Exception:  # the change is durable: its callers are answered anyway
                        log.exception("a listener of serve states failed")
            if self._since_prune >= prune_batch(self.config.daemon.events_keep):
                # Queued behind this commit in the store's thread; nobody waits on it.
                self._since_prune = 0
                loop.run_in_executor(self._executor, self._prune)

    def _store_failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        self.store_failures += 1
        self.store_error = exc.message if isinstance(exc, GpudError) else repr(exc)
        if self.store_failing_since is None:
            self.store_failing_since = self.clock()
        if self._store_logged_at is None or now - self._store_logged_at >= STORE_LOG_INTERVAL_S:
            self._store_logged_at = now
            log.error("the store fails (%d failed commits since %s): %s; nothing that needs a "
                      "record is changed until it works again", self.store_failures,
                      time.strftime("%H:%M:%S", time.localtime(self.store_failing_since)),
                      self.store_error)

    def _store_works(self) -> None:
        if self.store_error is not None:
            log.warning("the store commits again, after %d failed commits: %s",
                        self.store_failures, self.store_error)
        self.store_error, self.store_failing_since = None, None
        self.store_failures, self._store_logged_at = 0, None

    def store_status(self) -> answers.StoreStatus:
        """Whether the store commits, and since when it fails, with its last error."""
        return {"ok": self.store_error is None, "error": self.store_error,
                "failing_since": self.store_failing_since, "failed_commits": self.store_failures}

    async def drain(self) -> None:
        """Wait until every submitted change is committed (or has failed)."""
        while self._committer is not None and not self._committer.done():
            await asyncio.wait({self._committer})

    def _decided_state(self, serve: str) -> ServeState:
        """A serve's state with the decided but not yet committed changes."""
        state = self._decided_states.get(serve)
        if state is not None:
            return state
        return self._records.state_of(serve)

    def _prune(self) -> None:
        try:
            gone = self.store.prune_events(self.config.daemon.events_keep)
        except GpudError as exc:
            log.warning("pruning old events failed: %s", exc.message)
            return
        if gone:
            log.info("pruned %d old events (keeping the newest %d)", gone,
                     self.config.daemon.events_keep)

    def _announce(self, ev: Event) -> None:
        if not ev.details.get("repeated"):  # a summary's refusals were counted as they came
            self.counters[ev.kind] = self.counters.get(ev.kind, 0) + 1
        level = logging.WARNING if ev.kind in WARNING_KINDS else logging.INFO
        if ev.kind == EventKind.INVARIANT and not ev.details.get("holds"):
            level = logging.ERROR
        fields: dict[str, object] = {"GPUD_EVENT": ev.kind, "GPUD_SERVE": ev.serve, "GPUD_ROLE": ev.role,
                  "GPUD_MIB": ev.mib, "GPUD_UID": ev.uid, "GPUD_EVENT_ID": ev.id}
        for key, value in ev.details.items():
            if isinstance(value, int | float | str):
                fields[f"GPUD_{key.upper()}"] = value
            elif isinstance(value, list) and all(isinstance(v, str) for v in value):
                fields[f"GPUD_{key.upper()}"] = ",".join(value)  # GPUD_ROLES=left,right
        log.log(level, ev.message, extra={"journal": fields})
        for sub in list(self._subscribers):
            if _matches(sub.query, ev):
                try:
                    sub.queue.put_nowait(ev)
                except asyncio.QueueFull:
                    # A follower that does not read is cut off rather than growing memory.
                    self._subscribers.remove(sub)
                    sub.queue = asyncio.Queue(1)
                    sub.queue.put_nowait(None)

    async def put_meta(self, key: str, value: str | None) -> None:
        async with self._lock:
            done = self.submit(Changes(meta={key: value}))
        await done

    # ---- the event bus -------------------------------------------------------------------

    async def events(self, query: EventQuery) -> list[Event]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.store.events, query)

    def subscribe(self, query: EventQuery) -> Subscription:
        sub = Subscription(query)
        self._subscribers.append(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        if sub in self._subscribers:
            self._subscribers.remove(sub)


class RepeatedRefusals:
    """Repeated refusals of requests through the front (gpud.core.coalesce): one stored event
    per window and key (its serve, kind, peer and bound), with the count of those it stands
    for, and the timer that stores a window's summary when no other refusal comes. `submit`
    stores events (LedgerService.submit), `clock` is the service's, `counters` its count of
    events by kind (every refusal is counted there, stored or not)."""

    def __init__(self, submit: Callable[[Changes], object], clock: Callable[[], float],
                 counters: dict[str, int]) -> None:
        self.windows: Coalescer[tuple[str, str | None, int | None, str], Event] = Coalescer()
        self._submit = submit
        self._clock = clock
        self._counters = counters
        self._timer: asyncio.TimerHandle | None = None

    def stored(self, ev: Event) -> list[Event]:
        """The refusal `ev` as stored: itself when it is an operator's, or the first of its
        window for a request through the front; else nothing (counted, and stored with the
        others of its window as one event when the window ends)."""
        if not COALESCE_REFUSALS.get():
            return [ev]
        now = ev.ts
        self.flush(now)
        key = (str(ev.kind), ev.serve, ev.uid, str(ev.details.get("bound", "")))
        if self.windows.offer(key, ev, now) == Verdict.STORE:
            return [ev]
        self._counters[ev.kind] = self._counters.get(ev.kind, 0) + 1
        self._arm(now)
        return []

    def flush(self, now: float) -> None:
        """Store the summaries of the windows ended by `now`."""
        summaries = self.windows.due(now)
        if summaries:
            self._submit(Changes(events=[self._summary(s) for s in summaries]))

    def close(self) -> list[Event]:
        """The summaries of every open window, to store before gpud goes; the timer ends."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        return [self._summary(s) for s in self.windows.due(float("inf"))]

    def _arm(self, now: float) -> None:
        due = self.windows.next_due()
        if due is None or self._timer is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (a test's synchronous use): the next refusal flushes

        def fire() -> None:
            self._timer = None
            self.flush(self._clock())
            self._arm(self._clock())

        self._timer = loop.call_later(max(0.0, due - now) + 0.01, fire)

    def _summary(self, s: Summary[tuple[str, str | None, int | None, str], Event]) -> Event:
        last = s.last
        took = max(0.0, s.last_ts - s.first_ts)
        message = (f"{s.count} more like this within {s.window_s:g} s (the last at "
                   f"{time.strftime('%H:%M:%S', time.localtime(s.last_ts))}, over {took:.1f} s; "
                   f"stored as one): {last.message}")
        return Event(last.kind, message, self._clock(), last.serve, last.role, last.mib,
                     last.uid, {**last.details, "repeated": s.count, "first_ts": s.first_ts,
                                "last_ts": s.last_ts, "window_s": s.window_s})


def _freed_roles(before: Ledger, changes: Changes) -> list[str]:
    """The roles on which `changes` (made on `before`) release or shrink a reservation; in
    the size of the change, not of the ledger (a commit may carry thousands of admissions)."""
    roles: set[str] = set()
    for serve in changes.delete:
        res = before.reservations.get(serve)
        if res is not None:
            roles.update(res.all_roles)
    for put in changes.put:
        res = before.reservations.get(put.serve)
        if res is not None:
            kept = set(put.all_roles) if put.mib >= res.mib else set()
            roles.update(r for r in res.all_roles if r not in kept)
    return sorted(roles)


def _matches(query: EventQuery, ev: Event) -> bool:
    return ((not query.serves or ev.serve in query.serves)
            and (not query.roles or ev.role in query.roles
                 or any(r in query.roles for r in ev.details.get("roles") or ()))
            and (not query.kinds or ev.kind in query.kinds)
            and (query.since is None or ev.ts >= query.since))

