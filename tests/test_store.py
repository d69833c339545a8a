"""The SQLite store: real files, real transactions."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from gpud.core.ledger import Reservation
from gpud.core.vocab import EventKind, ServeState
from gpud.durable.store import SCHEMA_VERSION, Changes, Event, EventQuery, ServeStateRow, Store
from gpud.errors import StoreError


def schema_version(path: Path) -> int:
    """The schema version SQLite holds for the store at `path` (PRAGMA user_version)."""
    db = sqlite3.connect(path)
    try:
        return int(db.execute("PRAGMA user_version").fetchone()[0])
    finally:
        db.close()


def test_fresh_store_is_migrated_and_wal(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    db = sqlite3.connect(tmp_path / "s.db")
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    store.close()


def test_commit_is_all_or_nothing(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    store.commit(Changes(put=[Reservation("a", "r", 100, 1.0)],
                         events=[Event("admit", "a admitted", 1.0, "a", "r", 100)]))
    bad = Changes(put=[Reservation("b", "r", 200, 2.0), Reservation("c", "r", 0, 2.0)],
                  delete=["a"], events=[Event("admit", "b", 2.0, "b")])
    with pytest.raises(StoreError, match="could not commit"):
        store.commit(bad)
    assert [r.serve for r in store.reservations()] == ["a"]
    assert [e.kind for e in store.events(EventQuery())] == ["admit"]
    assert store.integrity_check() == "ok"


def test_survives_reopen(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    store.commit(Changes(put=[Reservation("a", "r", 100, 1.0, 0, True)],
                         states=[ServeStateRow("a", "external", None, 1.0)]))
    store.close()
    again = Store(tmp_path / "s.db")
    assert again.reservations() == [Reservation("a", "r", 100, 1.0, 0, True)]
    assert again.serve_states()[0].state == "external"


def test_newer_schema_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(StoreError, match="newer than this gpud"):
        Store(path)


def test_migrates_from_version_1(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    db = sqlite3.connect(path)
    from gpud.durable.store import MIGRATIONS

    db.executescript(MIGRATIONS[0] + "; PRAGMA user_version=1;")
    db.execute("INSERT INTO reservations VALUES ('a', 'r', 5, 1.0, 0, 0)")
    db.commit()
    db.close()
    store = Store(path)
    assert schema_version(path) == SCHEMA_VERSION
    assert store.reservations()[0].mib == 5
    assert store.calibrations() == []


def test_event_query_filters(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    evs = [Event("admit", "x", float(i), serve="ocr" if i % 2 else "fast", role="r") for i in range(10)]
    store.commit(Changes(events=evs))
    got = store.events(EventQuery(serves=["ocr"], since=4.0))
    assert [e.ts for e in got] == [5.0, 7.0, 9.0]
    newest = store.events(EventQuery(limit=2))
    assert [e.ts for e in newest] == [8.0, 9.0]
    assert store.events(EventQuery(kinds=["deny"])) == []


def test_unwritable_state_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StoreError, match="cannot open the store"):
        Store(blocker / "sub" / "s.db")


def test_rows_read_back_are_members_and_unknown_values_are_left_out(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A store written by another version of gpud may hold a kind or a state this one does not
    # know: reading it must not fail, and what it knows comes back typed.
    path = tmp_path / "s.db"
    store = Store(path)
    store.commit(Changes(events=[Event(EventKind.ADMIT, "a admitted", 1.0, "a")],
                         states=[ServeStateRow("a", ServeState.RUNNING, None, 1.0)]))
    store.close()
    db = sqlite3.connect(path)
    with db:
        db.execute("INSERT INTO events (ts, kind, serve, role, mib, uid, message, details) "
                   "VALUES (2.0, 'retired-kind', 'b', NULL, NULL, NULL, 'old', '{}')")
        db.execute("INSERT INTO serve_states (serve, state, reason, updated) "
                   "VALUES ('b', 'hibernating', NULL, 2.0)")
    db.close()
    store = Store(path)
    events = store.events(EventQuery())
    states = store.serve_states()
    assert [(e.kind, type(e.kind)) for e in events] == [(EventKind.ADMIT, EventKind)]
    assert [(s.serve, s.state, type(s.state)) for s in states] == [
        ("a", ServeState.RUNNING, ServeState)]
    assert "'retired-kind', which this gpud does not know" in caplog.text
    assert "'hibernating', which this gpud does not know" in caplog.text
    # left out of what is read, not removed: the row is still there
    assert store.events(EventQuery(kinds=("retired-kind",))) == []
    store.close()
    db = sqlite3.connect(path)
    assert db.execute("SELECT count(*) FROM events WHERE kind = 'retired-kind'").fetchone() == (1,)
    db.close()


def test_an_empty_store_file_is_refused_naming_it(tmp_path: Path) -> None:
    """A zero-byte store (truncated, or made by something else) started silently as a fresh
    store: the ledger and its history were gone without a word."""
    path = tmp_path / "gpud.sqlite3"
    path.write_bytes(b"")
    with pytest.raises(StoreError, match=rf"the store {path} is empty \(0 bytes\)"):
        Store(path)
    assert path.read_bytes() == b""  # left as it was found


def test_a_file_that_is_not_sqlite_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "gpud.sqlite3"
    path.write_text("[serves.x]\nrole = 'r'\n")
    with pytest.raises(StoreError, match=rf"the store {path} is not gpud's: not an SQLite"):
        Store(path)


def test_an_sqlite_database_of_something_else_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "gpud.sqlite3"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE moz_places (id INTEGER PRIMARY KEY, url TEXT)")
    db.commit()
    db.close()
    with pytest.raises(StoreError, match=rf"the store {path} is not gpud's: .*moz_places"):
        Store(path)
    db = sqlite3.connect(path)  # untouched: no table of gpud's added, no version set
    assert [r[0] for r in db.execute("SELECT name FROM sqlite_master")] == ["moz_places"]
    assert db.execute("PRAGMA user_version").fetchone()[0] == 0
    db.close()


def test_a_missing_file_is_a_fresh_store(tmp_path: Path) -> None:
    path = tmp_path / "gpud.sqlite3"
    Store(path).close()
    assert schema_version(path) == SCHEMA_VERSION
    Store(path).close()  # and gpud's own store opens again
