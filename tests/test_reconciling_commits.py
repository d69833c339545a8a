"""A serve woken outside gpud and re-admitted awake (gpud.life.reconciling Reconciler
._admit_awake) is recorded running only in the commit of its wake's event: a gpud killed
between the re-admission and that event finds it recorded asleep (at its awake size, never
less) and looks again, never running with no wake recorded (the sandbox crash campaign found
one: `u2 put to sleep again, asleep since event 57`). Real SQLite, the real ledger service."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from gpud.config import parse_config
from gpud.core.serverecord import Happened
from gpud.core.vocab import SLEEPING, EventKind
from gpud.durable.store import Store
from gpud.life.reconciling import Reconciler
from gpud.life.service import LedgerService

CONFIG = """
[daemon]
admission = "ledger"

[roles.r]
device = "0"
capacity_mib = 10000

[serves.u]
role = "r"
vram_mib = 4000
port = 30999
sleep_level = 1
sleep_mib = 500
command = ["/bin/true", "{socket}"]
"""


class Killed(Exception):
    """gpud killed at this point: nothing after it is committed."""


def _service(db: Path) -> tuple[LedgerService, Store]:
    store = Store(db)
    svc = LedgerService(parse_config(CONFIG, "test"), store)
    svc.load()
    return svc, store


async def test_a_kill_between_the_readmission_and_the_wake_leaves_it_asleep(
        tmp_path: Path) -> None:
    db = tmp_path / "gpud.sqlite3"
    svc, store = _service(db)
    await svc.admit("u", 4000, role="r", happened=Happened.ADMITTED)
    await svc.admit("u", 500, happened=Happened.ASLEEP, shrink=True,
                    event=(EventKind.SLEEP, "u asleep", {"level": 1}))
    assert svc.state_of("u") == SLEEPING
    stored = svc.store_event

    async def store_event(event: Any, **kw: Any) -> Any:
        if event.kind == EventKind.WAKE:
            raise Killed
        return await stored(event, **kw)

    svc.store_event = store_event  # type: ignore[method-assign]
    observer = SimpleNamespace(available=False)
    reconciler = Reconciler(cast(Any, None), svc, cast(Any, None), cast(Any, observer))
    with pytest.raises(Killed):
        await reconciler._admit_awake("u", svc.config.serves["u"], False, 4000)
    svc.close()
    store.close()
    # the restarted gpud reads the store
    again, store = _service(db)
    try:
        assert again.state_of("u") == SLEEPING, again.state_of("u")
        assert again.ledger.reservations["u"].mib == 4000  # its awake size: never less
    finally:
        again.close()
        store.close()
