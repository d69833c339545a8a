"""The one error tree: every class documented, every foreign error mapped at its edge."""

from __future__ import annotations

import inspect
import sqlite3
from pathlib import Path

import pytest

from gpud import errors
from gpud.durable.store import Changes, Event, Store
from gpud.errors import ALL_ERRORS, GpudError, StoreError
from gpud.host.unitbus import map_error


def test_every_error_class_is_listed_and_documented() -> None:
    defined = {obj for _, obj in inspect.getmembers(errors, inspect.isclass)
               if issubclass(obj, GpudError)}
    assert defined == set(ALL_ERRORS)
    doc = errors.__doc__ or ""
    for cls in ALL_ERRORS:
        assert cls.__name__ in doc, cls
        assert 400 <= cls.http_status < 600 and cls.exit_code in (1, 2)


def test_codes_are_unique() -> None:
    codes = [cls.code for cls in ALL_ERRORS]
    assert len(codes) == len(set(codes))


def test_json_shape() -> None:
    assert StoreError("x", {"a": 1}).to_json() == {
        "error": {"code": "store-failed", "message": "x", "details": {"a": 1}}}


def test_sqlite_errors_become_store_errors(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    store._db.execute("DROP TABLE events")  # a broken store
    with pytest.raises(StoreError) as info:
        store.commit(Changes(events=[Event("admit", "m", 0.0)]))
    assert isinstance(info.value.__cause__, sqlite3.Error)


@pytest.mark.parametrize(("name", "cls"), [
    ("org.freedesktop.systemd1.UnitExists", errors.Conflict),
    ("org.freedesktop.systemd1.NoSuchUnit", errors.NotFound),
    ("org.freedesktop.DBus.Error.AccessDenied", errors.Unavailable),
    ("org.freedesktop.DBus.Error.InvalidArgs", errors.BadRequest),
])
def test_dbus_errors_mapped(name: str, cls: type[GpudError]) -> None:
    from dbus_fast.errors import DBusError

    mapped = map_error(DBusError(name, "text"), "start x")
    assert isinstance(mapped, cls)


def test_expected_503_logs_a_warning_not_an_error(tmp_path: Path) -> None:
    """`start` without a system bus answers 503 as designed: a warning in the log, no ERROR."""
    from tests.conftest import T015, start_gpud

    gp = start_gpud(tmp_path, T015)
    try:
        reply = gp.call("POST", "/v1/serves/fast/start")
        assert reply.status == 503, reply.body
        assert reply.body["error"]["code"] == "unavailable"
    finally:
        gp.stop()
    lines = [line for line in gp.output().splitlines() if "/v1/serves/fast/start" in line]
    assert lines and all(" WARNING " in line for line in lines), lines
    assert " ERROR " not in gp.output(), gp.output()


def test_every_error_code_has_one_exit_code_shared_with_gpuctl() -> None:
    """gpuctl exits by the daemon's error.code, from the same table the error tree reads."""
    from gpud.core.vocab import EXIT_CODES
    from gpud.ctl.errors import api_error

    classes = [GpudError, *_all_subclasses(GpudError)]
    for cls in classes:
        if cls.code in EXIT_CODES:
            assert cls.exit_code == EXIT_CODES[cls.code], cls
    api_codes = {c.code for c in classes if c.__module__ == "gpud.errors"}
    assert api_codes <= set(EXIT_CODES)
    body = b'{"error": {"code": "not-found", "message": "x", "details": {}}}'
    assert api_error(409, "", body).exit_code == 2  # the code decides, not the status


def _all_subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_all_subclasses(sub)]
    return out
