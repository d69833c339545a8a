"""A store that cannot commit (a full or read-only state directory) is a state gpud reports:
in /v1/status, as a metric, in `gpuctl status`, and in the journal once per interval, not once
per try. On a real SQLite store whose commits are made to fail as a full disk makes them fail
(the sandbox campaign fills a real tmpfs: tests/campaigns/test_sandbox.py)."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from gpud.ctl.format import format_status
from gpud.durable.store import Changes, Event, Store
from gpud.errors import StoreError
from gpud.life.service import LedgerService
from gpud.server.metrics import render
from tests.conftest import loaded_service

CONFIG = """
[daemon]
admission = "ledger"
[roles.r]
device = "0"
capacity_mib = 10000
"""


class FillingStore(Store):
    """A store whose commits fail while `full` (as SQLite's do on a full disk)."""

    full = False

    def commit_many(self, batch: Sequence[Changes]) -> list[list[Event]]:
        if self.full:
            raise StoreError("the store could not commit the change: database or disk is full")
        return super().commit_many(batch)


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[LedgerService]:
    with loaded_service(tmp_path, CONFIG, FillingStore) as service:
        yield service


def observation() -> dict[str, object]:
    return {"available": False, "backend": "none", "reason": "test", "simulated": False}


def status(svc: LedgerService) -> dict[str, object]:
    return dict(svc.status_view(observation()))  # type: ignore[arg-type]


async def test_a_failing_store_is_reported_and_logged_once_per_interval(
        svc: LedgerService, caplog: pytest.LogCaptureFixture) -> None:
    await svc.admit("a", 100, role="r")
    assert status(svc)["store"] == {"ok": True, "error": None, "failing_since": None,
                                    "failed_commits": 0}
    assert "gpud_store_ok 1.0" in render(svc, None)
    store = svc.store
    assert isinstance(store, FillingStore)
    store.full = True
    caplog.set_level(logging.INFO, logger="gpud")
    for i in range(3):
        with pytest.raises(StoreError):
            await svc.admit(f"b{i}", 100, role="r")
    assert set(svc.ledger.reservations) == {"a"}  # nothing changed
    reported = status(svc)["store"]
    assert isinstance(reported, dict)
    assert reported["ok"] is False and "disk is full" in reported["error"]
    assert reported["failed_commits"] == 3 and isinstance(reported["failing_since"], float)
    assert "gpud_store_ok 0.0" in render(svc, None)
    said = [r for r in caplog.records if "the store fails" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.ERROR  # once, not per commit
    assert said[0].exc_info is None  # no traceback
    text = format_status(status(svc))  # type: ignore[arg-type]
    assert "store" in text and "!! FAILING since" in text and "(3 failed commits)" in text
    assert "database or disk is full" in text
    # space back: it commits, and says so
    store.full = False
    await svc.admit("c", 100, role="r")
    assert status(svc)["store"] == {"ok": True, "error": None, "failing_since": None,
                                    "failed_commits": 0}
    assert any("the store commits again, after 3 failed commits" in r.getMessage()
               for r in caplog.records)
    assert "FAILING" not in format_status(status(svc))  # type: ignore[arg-type]


async def test_a_store_still_failing_is_said_again_after_the_interval(
        svc: LedgerService, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import gpud.life.writes

    store = svc.store
    assert isinstance(store, FillingStore)
    store.full = True
    caplog.set_level(logging.INFO, logger="gpud")
    monkeypatch.setattr(gpud.life.writes, "STORE_LOG_INTERVAL_S", 0.0)
    for i in range(2):
        with pytest.raises(StoreError):
            await svc.admit(f"b{i}", 100, role="r")
    said = [r.getMessage() for r in caplog.records if "the store fails" in r.getMessage()]
    assert len(said) == 2 and "(2 failed commits since" in said[1]
