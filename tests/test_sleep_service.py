"""The ledger service's side of sleep, on a real SQLite store: the shrink and its state, event
and note in one transaction, a shrink never refused, the roles a change frees."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpud.config import parse_config
from gpud.core.ledger import Reservation
from gpud.core.serverecord import Happened
from gpud.core.vocab import RUNNING, SLEEPING, STOPPING
from gpud.durable.store import Changes, EventQuery
from gpud.errors import Denied
from gpud.life.service import LedgerService
from tests.conftest import loaded_service
from tests.reach import admitted_to

CONFIG = """
[daemon]
admission = "ledger"
[roles.r]
device = "0"
capacity_mib = 10000
[serves.lo]
role = "r"
vram_mib = 6000
sleep_level = 1
sleep_mib = 500
command = ["x"]
[serves.hi]
role = "r"
vram_mib = 7000
command = ["x"]
"""


@pytest.fixture
def service(tmp_path: Path) -> Iterator[LedgerService]:
    with loaded_service(tmp_path, CONFIG) as svc:
        yield svc


class Told:
    """A supervision that notes the roles it is told memory came back on."""

    def __init__(self) -> None:
        self.freed_on: list[str] = []

    def launch_under_way(self, serve: str) -> bool:
        return False

    def launching(self) -> tuple[bool, str | None]:
        return True, None

    def freed(self, role: str) -> None:
        self.freed_on.append(role)


async def test_shrink_with_its_state_event_and_note_in_one_transaction(
        service: LedgerService) -> None:
    told = Told()
    freed = told.freed_on
    service.supervise(told)
    await admitted_to(service, "lo", 6000, RUNNING)
    with pytest.raises(Denied):
        await service.admit("hi", 7000)
    before = service.commits
    await service.admit("lo", 500, happened=Happened.ASLEEP, shrink=True,
                        state_reason="asleep (level 1, put to sleep)",
                        event=("sleep", "lo asleep", {"from_mib": 6000}),
                        meta={"sleep:lo": json.dumps({"level": 1})})
    assert service.commits == before + 1
    store = service.store
    assert {r.serve: r.mib for r in store.reservations()} == {"lo": 500}
    row = next(r for r in store.serve_states() if r.serve == "lo")
    assert (row.state, row.reason) == ("sleeping", "asleep (level 1, put to sleep)")
    ev = store.events(EventQuery(kinds=["sleep"]))[-1]
    assert ev.mib == 500 and ev.details["from_mib"] == 6000
    assert ev.details["free_mib"] == 9500 and ev.message.startswith("lo asleep; gpu_role 'r'")
    assert store.meta("sleep:lo") == '{"level": 1}'
    assert freed == ["r"]  # told once the shrink is durable
    await service.admit("hi", 7000)  # now it fits
    assert freed == ["r"]  # a growth frees nothing


async def test_a_shrink_is_made_on_an_over_committed_role(service: LedgerService) -> None:
    # adopted units over-commit the role: any admission there is refused, a shrink is not
    await service.adopt("lo", "r", 6000)
    await service.adopt("hi", "r", 7000)
    await service.store_event(service.event("adopt", "lo found running", serve="lo"),
                              report=service.report("lo", Happened.FOUND_ACTIVE))
    assert service.ledger.figures("r").free_mib == -3000
    with pytest.raises(Denied):
        await service.admit("lo", 6000)
    admission = await service.admit("lo", 500, happened=Happened.ASLEEP, shrink=True)
    assert admission.reservation.mib == 500 and admission.replaced_mib == 6000
    assert service.ledger.figures("r").free_mib == 2500


async def test_free_for_counts_the_serves_own_reservation_back(service: LedgerService) -> None:
    assert service.free_for("lo", "r") == 10000
    await service.admit("lo", 6000)
    assert service.free_for("hi", "r") == 4000
    assert service.free_for("lo", "r") == 10000


def test_freed_roles_in_the_size_of_the_change() -> None:
    from gpud.core.ledger import Ledger, RoleBudget
    from gpud.life.writes import _freed_roles

    ledger = Ledger.build([RoleBudget("r", "0", 100, 0), RoleBudget("s", "0", 100, 0)],
                          [Reservation("a", "r", 50, 0.0), Reservation("b", "s", 20, 0.0)])
    assert _freed_roles(ledger, Changes(delete=["a"])) == ["r"]
    assert _freed_roles(ledger, Changes(put=[Reservation("b", "s", 10, 0.0)])) == ["s"]
    assert _freed_roles(ledger, Changes(put=[Reservation("b", "s", 30, 0.0)])) == []
    assert _freed_roles(ledger, Changes(put=[Reservation("b", "r", 20, 0.0)])) == ["s"]
    assert _freed_roles(ledger, Changes(put=[Reservation("new", "r", 5, 0.0)])) == []


def test_wake_back_follows_auto_wake() -> None:
    from types import SimpleNamespace
    from typing import Any, cast

    from gpud.life.sleeping import Sleeps

    for auto_wake, spawned in ((False, 0), (True, 1)):
        cfg = parse_config(CONFIG.replace('admission = "ledger"', 'admission = "ledger"\n'
                                          f"auto_wake = {str(auto_wake).lower()}"), "t")
        started: list[Any] = []

        def spawn(coro: Any, started: list[Any] = started) -> Any:
            started.append(coro)
            coro.close()
            return SimpleNamespace(done=lambda: False)

        sup = SimpleNamespace(runtime=SimpleNamespace(spawn=spawn))
        sleeps = Sleeps(cast(Any, sup), cast(Any, SimpleNamespace(config=cfg)), cast(Any, None),
                        host_memory=lambda: None)
        sleeps.freed("r")
        sleeps.freed("r")  # while one runs: it goes round once more, no second task
        assert len(started) == spawned
        assert ("r" in sleeps._wake_again) == auto_wake


# ---- adoption at startup: the reconciliation's rule (gpud.core.reconcile) ------------------

class Answering:
    """Sleeps whose serve answers GET /is_sleeping with `said` (the HTTP exchange is the
    integration tests'; here, what adoption does with the answer)."""

    @staticmethod
    def make(service: LedgerService, said: bool | None):  # type: ignore[no-untyped-def]
        from types import SimpleNamespace
        from typing import Any, cast

        from gpud.config import ServeConfig
        from gpud.life.sleeping import Sleeps

        class Stub(Sleeps):
            async def is_sleeping(self, serve: str, spec: ServeConfig) -> bool | None:
                return said

        return Stub(cast(Any, SimpleNamespace()), service, cast(Any, None),
                    host_memory=lambda: None)


async def _asleep(service: LedgerService, *, neighbour_mib: int | None) -> None:
    await admitted_to(service, "lo", 6000, RUNNING)
    await service.admit("lo", 500, happened=Happened.ASLEEP, shrink=True,
                        meta={"sleep:lo": json.dumps({"level": 1, "awake_mib": 6000})})
    if neighbour_mib is not None:
        await service.adopt("hi", "r", neighbour_mib)


@pytest.mark.parametrize(("said", "overdrawn", "neighbour", "state", "mib"), [
    # asleep, as recorded: it stays so, its reservation unchanged
    (True, False, None, "sleeping", 500),
    (True, True, None, "sleeping", 500),
    # awake again and it fits: re-admitted at its awake size, watched until healthy
    (False, False, None, "starting", 6000),
    (False, False, 4000, "starting", 6000),  # 10000 - 4000 = 6000: exactly fits
    # awake again and it does not fit: never admitted at full size (the role would be
    # over-committed); kept asleep in the ledger until the health check puts it right
    (False, False, 4001, "sleeping", 500),
    (False, False, 7000, "sleeping", 500),
    # no answer: asleep unless observation sees it draw its awake size
    (None, False, None, "sleeping", 500),
    (None, True, None, "starting", 6000),
    (None, True, 7000, "sleeping", 500),
])
async def test_adoption_of_a_serve_recorded_asleep(
        service: LedgerService, said: bool | None, overdrawn: bool, neighbour: int | None,
        state: str, mib: int) -> None:
    await _asleep(service, neighbour_mib=neighbour)
    sleeps = Answering.make(service, said)
    spec = service.config.serves["lo"]
    got = await sleeps.adopt("lo", spec, "sleeping", overdrawn=overdrawn)
    assert got == state
    assert service.ledger.reservations["lo"].mib == mib
    assert (service.store.meta("sleep:lo") is None) == (state == "starting")
    if neighbour is not None:
        assert service.ledger.reservations["hi"].mib == neighbour


@pytest.mark.parametrize(("said", "state", "mib"), [
    (True, "sleeping", 6000),  # slept between vLLM's sleep and the shrink: its full reservation
    (False, "running", 6000),
    (None, "running", 6000),
])
async def test_adoption_of_a_serve_recorded_running(
        service: LedgerService, said: bool | None, state: str, mib: int) -> None:
    await admitted_to(service, "lo", 6000, RUNNING)
    await service.adopt("hi", "r", 7000)  # over-committed already: nothing is re-admitted
    sleeps = Answering.make(service, said)
    assert await sleeps.adopt("lo", service.config.serves["lo"], "running") == state
    assert service.ledger.reservations["lo"].mib == mib


@pytest.mark.parametrize(("said", "state", "mib"), [
    (True, "sleeping", 500),  # still asleep: adopted asleep, its sleep reservation unchanged
    (None, "sleeping", 500),  # no answer, no draw seen: asleep, as recorded
    (False, "starting", 6000),  # awake: re-admitted at its awake size, watched until healthy
])
async def test_adoption_of_a_serve_whose_stop_began_while_it_slept(
        service: LedgerService, said: bool | None, state: str, mib: int) -> None:
    """A gpud killed while it stopped a sleeping serve finds it recorded stopping at its sleep
    reservation, its unit still running: it is asked what it is as a serve recorded asleep is
    (last_said: its sleep's note is kept until the stop ends), never taken as running at its
    sleep reservation, which a later sleep would read as a second one and a later wake as its
    awake size (the sandbox crash campaign, GPUD_CAMPAIGN_SEED=1079562660: 'u2 put to sleep
    again', then awake at 300 MiB drawing 1998)."""
    await _asleep(service, neighbour_mib=None)
    await service.store_event(service.event("stop", "lo: stopping (was sleeping)", serve="lo"),
                              report=service.report("lo", Happened.STOP_BEGUN))
    assert service.state_of("lo") == STOPPING
    sleeps = Answering.make(service, said)
    spec = service.config.serves["lo"]
    asked = sleeps.last_said("lo", spec, STOPPING)
    assert asked == SLEEPING
    found = await sleeps.found("lo", spec, asked)
    await service.store_event(service.event("adopt", "lo: adopted running unit", serve="lo"),
                              report=service.report("lo", found))
    assert service.state_of("lo") == state
    assert service.ledger.reservations["lo"].mib == mib
    assert sleeps.awake_mib("lo", spec) == 6000


async def test_last_said_asks_only_what_a_sleep_left(service: LedgerService) -> None:
    """A serve stopping or starting with no sleep's note (its stop began while it ran) is found
    active, as before: its health says when it is up."""
    await admitted_to(service, "lo", 6000, RUNNING)
    sleeps = Answering.make(service, True)
    spec = service.config.serves["lo"]
    assert sleeps.last_said("lo", spec, RUNNING) == RUNNING  # it can sleep: asked
    await service.store_event(service.event("stop", "lo: stopping (was running)", serve="lo"),
                              report=service.report("lo", Happened.STOP_BEGUN))
    assert sleeps.last_said("lo", spec, STOPPING) is None
    await service.put_meta("sleep:lo", json.dumps({"level": 1, "awake_mib": 6000}))
    assert sleeps.last_said("lo", spec, STOPPING) == SLEEPING


async def test_a_shrink_is_made_where_the_ledger_bound_refuses_any_size(
        service: LedgerService) -> None:
    """Adopted units over-commit the role past what lo gives back: without lo's own 6000 MiB
    the role still has -1000 MiB free, so the ledger bound refuses lo any size; its shrink
    (gpud.core.ledger.shrink_reservation) is made all the same."""
    await service.adopt("lo", "r", 6000)
    await service.adopt("hi", "r", 11000)
    await service.store_event(service.event("adopt", "lo found running", serve="lo"),
                              report=service.report("lo", Happened.FOUND_ACTIVE))
    with pytest.raises(Denied):
        await service.admit("lo", 500)
    admission = await service.admit("lo", 500, happened=Happened.ASLEEP, shrink=True)
    assert admission.reservation.mib == 500 and admission.replaced_mib == 6000
    assert admission.check == "ledger"
    assert service.ledger.figures("r").free_mib == -1500
    assert service.state_of("lo") == "sleeping"
