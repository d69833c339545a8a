"""The durable store: SQLite in the state directory.

WAL with synchronous=FULL, one transaction per mutation: a change is acknowledged only after its
transaction commits, so a crash at any moment leaves either all of a mutation or none of it.
Every sqlite3 error is mapped to StoreError here; nothing above sees sqlite3.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from gpud.core import answers
from gpud.core.ledger import Reservation
from gpud.core.usage import Counts, UsageKey
from gpud.core.vocab import EventKind, ServeState
from gpud.errors import StoreError

log = logging.getLogger("gpud.store")

SCHEMA_VERSION = 7


# Each entry upgrades the schema from version i to i+1. Never edit an entry once released.
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE reservations (
        serve    TEXT PRIMARY KEY,
        role     TEXT NOT NULL,
        mib      INTEGER NOT NULL CHECK (mib > 0),
        since    REAL NOT NULL,
        by_uid   INTEGER,
        external INTEGER NOT NULL DEFAULT 0
    );
    CREATE TABLE serve_states (
        serve   TEXT PRIMARY KEY,
        state   TEXT NOT NULL,
        reason  TEXT,
        updated REAL NOT NULL
    );
    CREATE TABLE events (
        id      INTEGER PRIMARY KEY AUTOINCREMENT,
        ts      REAL NOT NULL,
        kind    TEXT NOT NULL,
        serve   TEXT,
        role    TEXT,
        mib     INTEGER,
        uid     INTEGER,
        message TEXT NOT NULL,
        details TEXT NOT NULL DEFAULT '{}'
    );
    CREATE INDEX events_serve ON events (serve, id);
    CREATE INDEX events_ts ON events (ts);
    """,
    """
    CREATE TABLE calibrations (
        serve        TEXT NOT NULL,
        fingerprint  TEXT NOT NULL,
        ts           REAL NOT NULL,
        window_s     REAL NOT NULL,
        samples      INTEGER NOT NULL,
        steady_mib   INTEGER NOT NULL,
        peak_mib     INTEGER NOT NULL,
        recommended_mib INTEGER NOT NULL,
        PRIMARY KEY (serve, fingerprint)
    );
    """,
    """
    CREATE TABLE meta (
        key   TEXT PRIMARY KEY,
        value TEXT NOT NULL
    );
    """,
    """
    ALTER TABLE calibrations ADD COLUMN vllm TEXT;
    """,
    # A reservation per (serve, role): a serve on several devices holds one row on each of its
    # roles, all written and deleted in the same transaction. `position` keeps the roles' order
    # (the first role first); existing rows become position 0.
    """
    CREATE TABLE reservations_by_role (
        serve    TEXT NOT NULL,
        role     TEXT NOT NULL,
        position INTEGER NOT NULL DEFAULT 0 CHECK (position >= 0),
        mib      INTEGER NOT NULL CHECK (mib > 0),
        since    REAL NOT NULL,
        by_uid   INTEGER,
        external INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (serve, role),
        UNIQUE (serve, position)
    );
    INSERT INTO reservations_by_role (serve, role, position, mib, since, by_uid, external)
        SELECT serve, role, 0, mib, since, by_uid, external FROM reservations;
    DROP TABLE reservations;
    ALTER TABLE reservations_by_role RENAME TO reservations;
    """,
    # Usage per key through the router (gpud.core.usage): hourly rows by key, model and status.
    """
    CREATE TABLE usage (
        hour              INTEGER NOT NULL,
        key               TEXT NOT NULL,
        model             TEXT NOT NULL,
        status            INTEGER NOT NULL,
        requests          INTEGER NOT NULL DEFAULT 0,
        prompt_tokens     INTEGER NOT NULL DEFAULT 0,
        completion_tokens INTEGER NOT NULL DEFAULT 0,
        unmetered         INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (hour, key, model, status)
    );
    CREATE INDEX usage_hour ON usage (hour);
    """,
    # Requests whose client hung up before the whole answer was sent (gpud.core.usage).
    """
    ALTER TABLE usage ADD COLUMN hung_up INTEGER NOT NULL DEFAULT 0;
    """,
)


@dataclass(frozen=True, slots=True)
class Event:
    kind: EventKind
    message: str
    ts: float
    serve: str | None = None
    role: str | None = None
    mib: int | None = None
    uid: int | None = None
    details: dict[str, Any] = field(default_factory=dict)
    id: int | None = None

    def to_json(self) -> answers.Event:
        return {
            "id": self.id,
            "ts": self.ts,
            "kind": self.kind,
            "serve": self.serve,
            "role": self.role,
            "mib": self.mib,
            "uid": self.uid,
            "message": self.message,
            "details": self.details,
        }


@dataclass(frozen=True, slots=True)
class ServeStateRow:
    serve: str
    state: ServeState
    reason: str | None
    updated: float


@dataclass(frozen=True, slots=True)
class Calibration:
    serve: str
    fingerprint: str
    ts: float
    window_s: float
    samples: int
    steady_mib: int
    peak_mib: int
    recommended_mib: int
    # A vllm serve's own account of its memory (weights, KV cache, CUDA graphs, context), as
    # read from its start-up lines: gpud.vllm.vllm_log; None for other serves.
    vllm: dict[str, Any] | None = None


@dataclass(slots=True)
class Changes:
    """Everything one mutation writes, committed in a single transaction."""

    put: list[Reservation] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    states: list[ServeStateRow] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    calibrations: list[Calibration] = field(default_factory=list)
    # Named values kept beside the ledger (the running config, an apply in progress); None
    # deletes the key.
    meta: dict[str, str | None] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EventQuery:
    serves: Sequence[str] = ()
    roles: Sequence[str] = ()
    kinds: Sequence[str] = ()
    since: float | None = None
    after_id: int | None = None
    limit: int = 100


class Store:
    """One connection, used from one thread at a time (gpud runs it in a single worker)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
            _check_file(path)
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        except (sqlite3.Error, OSError) as exc:
            raise StoreError(f"cannot open the store {path}: {exc}") from exc
        try:
            self._check_schema()
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA busy_timeout=5000")
            self._migrate()
        except (sqlite3.Error, OSError) as exc:
            self._db.close()
            raise StoreError(f"cannot open the store {path}: {exc}") from exc
        except StoreError:
            self._db.close()
            raise

    def _check_schema(self) -> None:
        """Refuse an SQLite database that is not gpud's: no schema version of gpud's, and
        tables of something else (a database with nothing in it is a fresh store)."""
        version = int(self._db.execute("PRAGMA user_version").fetchone()[0])
        if version:
            return
        tables = [str(r[0]) for r in self._db.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name").fetchall()
            if not str(r[0]).startswith("sqlite_")]
        if tables:
            listed = ", ".join(tables[:8]) + (f" and {len(tables) - 8} more"
                                              if len(tables) > 8 else "")
            raise StoreError(
                f"the store {self.path} is not gpud's: an SQLite database without gpud's schema "
                f"version, holding tables {listed}; refusing to start on it (move it aside, or "
                "point daemon.state_dir elsewhere; where no store file is, gpud makes a fresh "
                "one)")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _migrate(self) -> None:
        version = int(self._db.execute("PRAGMA user_version").fetchone()[0])
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"the store {self.path} has schema version {version}, newer than this gpud "
                f"({SCHEMA_VERSION}): refusing to touch it"
            )
        for target in range(version + 1, SCHEMA_VERSION + 1):
            with self._transaction() as db:
                for statement in MIGRATIONS[target - 1].split(";"):
                    if statement.strip():
                        db.execute(statement)
                db.execute(f"PRAGMA user_version={target}")

    def commit(self, changes: Changes) -> list[Event]:
        """Write all of `changes` or none of them. Returns the events with their ids."""
        return self.commit_many([changes])[0]

    def commit_many(self, batch: Sequence[Changes]) -> list[list[Event]]:
        """Write every one of `batch`, in order, in one transaction (one fsync), or none of
        them. Returns each one's events with their ids."""
        try:
            with self._transaction() as db:
                return [self._write(db, changes) for changes in batch]
        except sqlite3.Error as exc:
            raise StoreError(f"the store could not commit the change: {exc}") from exc

    @staticmethod
    def _write(db: sqlite3.Connection, changes: Changes) -> list[Event]:
        for res in changes.put:
            # The serve's rows are replaced whole: a reservation that moves from two roles to
            # one leaves nothing behind on the other.
            db.execute("DELETE FROM reservations WHERE serve = ?", (res.serve,))
            db.executemany(
                "INSERT INTO reservations (serve, role, position, mib, since, by_uid, external) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(res.serve, role, position, res.mib, res.since, res.by_uid, int(res.external))
                 for position, role in enumerate(res.all_roles)],
            )
        for serve in changes.delete:
            db.execute("DELETE FROM reservations WHERE serve = ?", (serve,))
        for st in changes.states:
            db.execute(
                "INSERT INTO serve_states (serve, state, reason, updated) VALUES (?,?,?,?) "
                "ON CONFLICT (serve) DO UPDATE SET state=excluded.state, "
                "reason=excluded.reason, updated=excluded.updated",
                (st.serve, st.state, st.reason, st.updated),
            )
        for cal in changes.calibrations:
            db.execute(
                "INSERT OR REPLACE INTO calibrations VALUES (?,?,?,?,?,?,?,?,?)",
                (cal.serve, cal.fingerprint, cal.ts, cal.window_s, cal.samples,
                 cal.steady_mib, cal.peak_mib, cal.recommended_mib,
                 None if cal.vllm is None else json.dumps(cal.vllm, sort_keys=True)),
            )
        for key, value in changes.meta.items():
            if value is None:
                db.execute("DELETE FROM meta WHERE key = ?", (key,))
            else:
                db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                           (key, value))
        stored: list[Event] = []
        for ev in changes.events:
            cur = db.execute(
                "INSERT INTO events (ts, kind, serve, role, mib, uid, message, details) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (ev.ts, ev.kind, ev.serve, ev.role, ev.mib, ev.uid, ev.message,
                 json.dumps(ev.details, sort_keys=True)),
            )
            stored.append(_with_id(ev, cur.lastrowid))
        return stored

    def reservations(self) -> list[Reservation]:
        """One Reservation per serve, its rows (one per role) joined in their order. Rows of one
        serve that disagree (which no write makes) are refused, not guessed at."""
        rows = self._read(
            "SELECT serve, role, mib, since, by_uid, external FROM reservations "
            "ORDER BY since, serve, position"
        )
        by_serve: dict[str, list[tuple[Any, ...]]] = {}
        for r in rows:
            by_serve.setdefault(r[0], []).append(r)
        out: list[Reservation] = []
        for serve, mine in by_serve.items():
            first = mine[0]
            if any(r[2:] != first[2:] for r in mine):
                raise StoreError(f"the store {self.path} holds reservation rows of serve "
                                 f"{serve!r} that disagree (MiB, since, uid or kind)")
            out.append(Reservation(serve, first[1], first[2], first[3], first[4], bool(first[5]),
                                   tuple(r[1] for r in mine[1:])))
        return out

    def serve_states(self) -> list[ServeStateRow]:
        rows = self._read("SELECT serve, state, reason, updated FROM serve_states")
        return [ServeStateRow(r[0], ServeState(r[1]), r[2], r[3]) for r in rows
                if _known(r[1], ServeState, "serve state", f"serve {r[0]!r}")]

    def calibrations(self) -> list[Calibration]:
        rows = self._read("SELECT serve, fingerprint, ts, window_s, samples, steady_mib, "
                          "peak_mib, recommended_mib, vllm FROM calibrations ORDER BY ts")
        return [Calibration(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7],
                            None if r[8] is None else json.loads(r[8])) for r in rows]

    def events(self, query: EventQuery) -> list[Event]:
        where: list[str] = []
        args: list[Any] = []
        for column, values in (("serve", query.serves), ("kind", query.kinds)):
            if values:
                where.append(f"{column} IN ({','.join('?' * len(values))})")
                args.extend(values)
        if query.roles:
            # An event of a serve on several roles names the first in `role` and all of them
            # in details.roles: it is found by any of them.
            marks = ",".join("?" * len(query.roles))
            where.append(f"(role IN ({marks}) OR EXISTS (SELECT 1 FROM json_each(details, "
                         f"'$.roles') WHERE value IN ({marks})))")
            args.extend(query.roles)
            args.extend(query.roles)
        if query.since is not None:
            where.append("ts >= ?")
            args.append(query.since)
        if query.after_id is not None:
            where.append("id > ?")
            args.append(query.after_id)
        sql = "SELECT id, ts, kind, serve, role, mib, uid, message, details FROM events"
        if where:
            sql += " WHERE " + " AND ".join(where)
        # The newest `limit` matches, returned oldest first.
        sql = f"SELECT * FROM ({sql} ORDER BY id DESC LIMIT ?) ORDER BY id"
        args.append(query.limit)
        return [
            Event(kind=EventKind(r[2]), message=r[7], ts=r[1], serve=r[3], role=r[4], mib=r[5],
                  uid=r[6], details=json.loads(r[8]), id=r[0])
            for r in self._read(sql, args) if _known(r[2], EventKind, "event kind", f"event {r[0]}")
        ]

    def meta(self, key: str) -> str | None:
        rows = self._read("SELECT value FROM meta WHERE key = ?", (key,))
        return str(rows[0][0]) if rows else None

    def add_usage(self, rows: Mapping[UsageKey, Counts],
                  log_position: tuple[str, str] | None = None) -> None:
        """Add ROWS to the hourly usage rows and, when given, set the meta entry
        LOG_POSITION (key, value: how far the log they were read from is counted), in one
        transaction: a crash leaves both or neither, so no line is counted twice or lost."""
        try:
            with self._transaction() as db:
                db.executemany(
                    "INSERT INTO usage (hour, key, model, status, requests, prompt_tokens, "
                    "completion_tokens, unmetered, hung_up) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT (hour, key, model, status) DO UPDATE SET "
                    "requests = requests + excluded.requests, "
                    "prompt_tokens = prompt_tokens + excluded.prompt_tokens, "
                    "completion_tokens = completion_tokens + excluded.completion_tokens, "
                    "unmetered = unmetered + excluded.unmetered, "
                    "hung_up = hung_up + excluded.hung_up",
                    [(k.hour, k.key, k.model, k.status, c.requests, c.prompt_tokens,
                      c.completion_tokens, c.unmetered, c.hung_up) for k, c in rows.items()])
                if log_position is not None:
                    db.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) "
                               "DO UPDATE SET value = excluded.value", log_position)
        except sqlite3.Error as exc:
            raise StoreError(f"the store could not add usage: {exc}") from exc

    def usage(self, since_hour: int = 0, key: str | None = None
              ) -> list[tuple[UsageKey, Counts]]:
        """The hourly usage rows from SINCE_HOUR on (of KEY alone when given), oldest first."""
        sql = ("SELECT hour, key, model, status, requests, prompt_tokens, completion_tokens, "
               "unmetered, hung_up FROM usage WHERE hour >= ?")
        args: list[Any] = [since_hour]
        if key is not None:
            sql += " AND key = ?"
            args.append(key)
        return [(UsageKey(int(r[0]), str(r[1]), str(r[2]), int(r[3])),
                 Counts(int(r[4]), int(r[5]), int(r[6]), int(r[7]), int(r[8])))
                for r in self._read(sql + " ORDER BY hour, key, model, status", args)]

    def prune_usage(self, keep: int) -> int:
        """Keep the newest `keep` rows (by hour), as events are pruned: a bound on rows;
        returns how many went."""
        try:
            with self._transaction() as db:
                cur = db.execute(
                    "DELETE FROM usage WHERE rowid NOT IN (SELECT rowid FROM usage "
                    "ORDER BY hour DESC LIMIT ?)", (keep,))
                return int(cur.rowcount)
        except sqlite3.Error as exc:
            raise StoreError(f"the store could not prune usage: {exc}") from exc

    def prune_events(self, keep: int) -> int:
        """Delete all but the newest `keep` events; returns how many went."""
        try:
            with self._transaction() as db:
                cur = db.execute("DELETE FROM events WHERE id <= (SELECT MAX(id) FROM events) - ?",
                                 (keep,))
                return int(cur.rowcount)
        except sqlite3.Error as exc:
            raise StoreError(f"the store could not prune events: {exc}") from exc

    def integrity_check(self) -> str:
        return str(self._read("PRAGMA integrity_check")[0][0])

    def _read(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        try:
            with self._lock:
                return list(self._db.execute(sql, args).fetchall())
        except sqlite3.Error as exc:
            raise StoreError(f"the store could not be read: {exc}") from exc


# The first 16 bytes of every SQLite 3 database file (https://sqlite.org/fileformat.html, 1.3).
SQLITE_HEADER = b"SQLite format 3\x00"


def _check_file(path: Path) -> None:
    """Refuse a store file that is there but empty or not an SQLite database: SQLite would
    take an empty file as a fresh database (and another file's bytes as a corrupt one), and
    gpud would start on a fresh store, the ledger and its history silently gone. A missing file
    is a fresh store."""
    try:
        with path.open("rb") as f:
            head = f.read(len(SQLITE_HEADER))
    except FileNotFoundError:
        return
    if not head:
        raise StoreError(
            f"the store {path} is empty (0 bytes): gpud never leaves its store empty, so it was "
            "truncated or made by something else; refusing to start on it as a fresh store (the "
            "ledger and its history would be lost). Restore it from a backup, or move it aside "
            "to start with a fresh store")
    if head != SQLITE_HEADER:
        raise StoreError(
            f"the store {path} is not gpud's: not an SQLite database (it begins {head[:8]!r}); "
            "refusing to start on it (move it aside, or restore gpud's store there)")


def _with_id(ev: Event, event_id: int | None) -> Event:
    return Event(ev.kind, ev.message, ev.ts, ev.serve, ev.role, ev.mib, ev.uid, ev.details, event_id)


def _known(value: object, vocabulary: type[StrEnum], what: str, row: str) -> bool:
    """Whether a value read back is a member of its vocabulary. A row that is not (written by
    another version of gpud) is left out of what is read, with a warning, rather than failing
    the read: the store holds it on, untouched."""
    if isinstance(value, str) and value in vocabulary.__members__.values():
        return True
    log.warning("the store holds %s with the %s %r, which this gpud does not know: left out",
                row, what, value)
    return False
