"""The ledger service without a daemon: a real SQLite store in a tmp dir, a real observer over
the simulated backend, and a clock the test moves. Each decision and each error path of
gpud.service is asked for directly."""

from __future__ import annotations

import asyncio
import json
import logging
import textwrap
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpud.config import Config, parse_config
from gpud.core.ledger import Reservation
from gpud.core.serverecord import Happened
from gpud.core.states import Cause
from gpud.core.transition import Refusal, Transition
from gpud.core.vocab import (
    ADMITTED,
    DECLARED,
    DENIED,
    EXTERNAL,
    FAILED,
    RUNNING,
    STARTING,
    EventKind,
)
from gpud.durable.store import Changes, Event, EventQuery, ServeStateRow, Store
from gpud.errors import BadRequest, ConfigError, Conflict, Denied, GpudError, NotFound, StoreError
from gpud.host.observer import Observer
from gpud.host.simulation import SimulatedBackend, SimulatedDevice
from gpud.life.service import LedgerService, StateRefused, resolve_budgets
from gpud.life.writes import prune_batch
from tests.reach import admitted_to

ROLES = """
[daemon]
admission = "ledger"
events_keep = 100

[roles.r]
device = "GPU-sim-0"
capacity_mib = 1000
reserve_mib = 100

[serves.a]
role = "r"
vram_mib = 300
command = ["/bin/true"]

[serves.b]
role = "r"
vram_mib = 500
command = ["/bin/true"]
"""


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FailingStore(Store):
    """A real store that can be told to fail its next transaction, or its pruning."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.fail_next = 0
        self.fail_prune = False
        self.pruned: list[int] = []
        # Cleared by a test: a transaction waits for it (entered is set once one does).
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def commit_many(self, batch: Sequence[Changes]) -> list[list[Event]]:
        self.entered.set()
        self.gate.wait(10)
        if self.fail_next:
            self.fail_next -= 1
            raise StoreError("the store could not commit the change: disk I/O error")
        return super().commit_many(batch)

    def prune_events(self, keep: int) -> int:
        self.pruned.append(keep)
        if self.fail_prune:
            raise StoreError("cannot prune: database is locked")
        return super().prune_events(keep)


@dataclass
class World:
    tmp: Path
    clock: Clock
    stores: list[Store]
    services: list[LedgerService]
    observer: Observer | None = None

    def store(self) -> FailingStore:
        store = FailingStore(self.tmp / "gpud.sqlite3")
        self.stores.append(store)
        return store

    def service(self, text: str = ROLES, *, store: Store | None = None, load: bool = True,
                observer: Any = None, config_path: Path | None = None,
                config_text: str | None = None) -> LedgerService:
        cfg = parse_config(textwrap.dedent(text), "test")
        svc = LedgerService(cfg, store or self.store(), clock=self.clock, observer=observer,
                            config_path=config_path,
                            config_text=config_text if config_text is not None else text)
        self.services.append(svc)
        if load:
            svc.load()
        return svc

    async def simulated(self, devices: Sequence[SimulatedDevice] = (
            SimulatedDevice("GPU-sim-0", 2000),), state: dict[str, Any] | None = None) -> Observer:
        state_file = self.tmp / "sim.json"
        state_file.write_text(json.dumps(state or {}))
        (self.tmp / "sim-procs").mkdir(exist_ok=True)
        obs = Observer(SimulatedBackend(devices, state_file))
        await obs.sample()
        self.observer = obs
        return obs


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path, Clock(), [], [])
    yield w
    for svc in w.services:
        svc.close()
    for store in w.stores:
        store.close()


def held(svc: LedgerService) -> dict[str, int]:
    """The reservations as they are in the store (durable), not in memory."""
    return {r.serve: r.mib for r in svc.store.reservations()}


def stored_states(svc: LedgerService) -> dict[str, str]:
    return {r.serve: r.state for r in svc.store.serve_states()}


def kinds(svc: LedgerService) -> list[str]:
    return [e.kind for e in svc.store.events(EventQuery(limit=1000))]


# ---- resolve_budgets ------------------------------------------------------------------------


def cfg(text: str) -> Config:
    return parse_config(textwrap.dedent(text), "test")


def test_capacity_defaults_to_the_device_total() -> None:
    c = cfg('[roles.r]\ndevice = "GPU-0"\nreserve_mib = 10\nnote = "n"\n')
    [budget] = resolve_budgets(c, {"GPU-0": 4096}.get, ["GPU-0"])
    assert (budget.name, budget.device, budget.capacity_mib, budget.reserve_mib, budget.note) == (
        "r", "GPU-0", 4096, 10, "n")


def test_a_capacity_below_the_device_total_is_kept() -> None:
    c = cfg('[roles.r]\ndevice = "GPU-0"\ncapacity_mib = 4096\n')
    assert resolve_budgets(c, {"GPU-0": 4096}.get)[0].capacity_mib == 4096


@pytest.mark.parametrize(("text", "totals", "devices", "problem"), [
    ('[roles.r]\ndevice = "GPU-9"\ncapacity_mib = 100\n', {}, ["GPU-0"],
     "roles.r.device: no device 'GPU-9' on this host (present: GPU-0)"),
    ('[roles.r]\ndevice = "GPU-9"\ncapacity_mib = 100\n', {}, [],
     "roles.r.device: no device 'GPU-9' on this host (present: none)"),
    ('[roles.r]\ndevice = "GPU-0"\n', {}, None,
     "roles.r.capacity_mib: required, since the total of device 'GPU-0' cannot be observed"),
    ('[roles.r]\ndevice = "GPU-0"\ncapacity_mib = 4097\n', {"GPU-0": 4096}, None,
     "roles.r.capacity_mib: 4097 exceeds device 'GPU-0' total 4096 MiB"),
    ('[roles.r]\ndevice = "GPU-0"\nreserve_mib = 100\n', {"GPU-0": 100}, None,
     "roles.r.reserve_mib: 100 must be < capacity 100"),
    ('[roles.r]\ndevice = "GPU-0"\n'
     '[serves.s]\nrole = "r"\nvram_mib = 101\ncommand = ["/bin/true"]\n', {"GPU-0": 100}, None,
     "serves.s.vram_mib: 101 exceeds role 'r' capacity 100"),
])
def test_a_role_that_cannot_be_resolved_is_named(text: str, totals: dict[str, int],
                                                 devices: list[str] | None, problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_budgets(cfg(text), totals.get, devices)
    assert err.value.problems == [problem]


def test_a_lost_device_is_there_its_total_unknown() -> None:
    """A device observation sees but cannot read (lost, reset required) is not "no device on
    this host": a role with its capacity set resolves; one without is told why it needs it."""
    lost = {"GPU-0": "GPU is lost"}.get
    c = cfg('[roles.r]\ndevice = "GPU-0"\ncapacity_mib = 4096\n')
    [budget] = resolve_budgets(c, {}.get, ["GPU-0 (index 0)"], lost)
    assert budget.capacity_mib == 4096
    with pytest.raises(ConfigError) as err:
        resolve_budgets(cfg('[roles.r]\ndevice = "GPU-0"\n'), {}.get, ["GPU-0 (index 0)"], lost)
    assert err.value.problems == ["roles.r.capacity_mib: required, since the total of device "
                                  "'GPU-0' cannot be read (GPU is lost)"]


def test_every_problem_is_named_at_once() -> None:
    c = cfg('[roles.a]\ndevice = "0"\n[roles.b]\ndevice = "1"\nreserve_mib = 5\n')
    with pytest.raises(ConfigError) as err:
        resolve_budgets(c, {"1": 5}.get)
    assert [p.split(":")[0] for p in err.value.problems] == ["roles.a.capacity_mib",
                                                             "roles.b.reserve_mib"]


def test_a_serve_fitting_its_role_exactly_passes() -> None:
    c = cfg('[roles.r]\ndevice = "0"\ncapacity_mib = 100\n'
            '[serves.s]\nrole = "r"\nvram_mib = 100\ncommand = ["/bin/true"]\n')
    assert [b.name for b in resolve_budgets(c, lambda _d: None)] == ["r"]


THREE_ON_ONE = """
[roles.a]
device = "1"
[roles.a2]
device = "GPU-one"
capacity_mib = 10000
[roles.a3]
device = "0000:01:00.0"
capacity_mib = 10000
"""
ONE = {"1": "GPU-one", "GPU-one": "GPU-one", "0000:01:00.0": "GPU-one"}


def test_roles_on_one_device_may_not_hold_more_than_it() -> None:
    """The issue's case: a (whole device), a2 and a3 (10000 MiB each) on one 32607 MiB device,
    named three ways: refused at the role whose capacity is the whole device."""
    with pytest.raises(ConfigError) as err:
        resolve_budgets(cfg(THREE_ON_ONE), lambda _ref: 32607, None, None, ONE.get)
    assert err.value.problems == [
        "roles.a.capacity_mib: roles a, a2, a3 are on one device (0000:01:00.0, 1, GPU-one, "
        "total 32607 MiB) and together hold 52607 MiB: roles on a device partition it (a "
        "capacity_mib not set is the whole device); set capacity_mib on each so that they add "
        "up to 32607 MiB at most"]
    # partitioned, they pass; on devices of their own, too
    parted = THREE_ON_ONE.replace('device = "1"\n', 'device = "1"\ncapacity_mib = 12607\n')
    assert len(resolve_budgets(cfg(parted), lambda _ref: 32607, None, None, ONE.get)) == 3
    assert len(resolve_budgets(cfg(THREE_ON_ONE), lambda _ref: 32607, None, None,
                               lambda ref: ref)) == 3
    # without identities only equal references are one device
    same = cfg('[roles.a]\ndevice = "0"\n[roles.b]\ndevice = "0"\ncapacity_mib = 10\n')
    with pytest.raises(ConfigError) as err:
        resolve_budgets(same, lambda _ref: 100)
    assert err.value.problems[0].startswith("roles.a.capacity_mib: roles a, b are on one device")


def test_a_serve_on_two_roles_of_one_device_is_refused() -> None:
    text = THREE_ON_ONE.replace('device = "1"\n', 'device = "1"\ncapacity_mib = 12607\n') + (
        '[serves.tp]\nroles = ["a2", "a3"]\nvram_mib = 5000\ncommand = ["/bin/true"]\n')
    with pytest.raises(ConfigError) as err:
        resolve_budgets(cfg(text), lambda _ref: 32607, None, None, ONE.get)
    assert err.value.problems == [
        "serves.tp.roles[1]: role 'a3' is on the same device as role 'a2' ('GPU-one' and "
        "'0000:01:00.0' are one device): each role of a serve must be on a different device"]


def test_check_config_knows_simulated_devices_by_every_name(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    from gpud.daemon import check_config
    path = tmp_path / "serves.toml"
    path.write_text(THREE_ON_ONE.replace("GPU-one", "GPU-sim-0").replace(
        "0000:01:00.0", "1") + '[simulation]\nstate_file = "/nonexistent"\n'
        '[[simulation.devices]]\nuuid = "GPU-sim-0"\ntotal_mib = 32607\nindex = 1\n')
    assert check_config(path) == 2
    assert "roles.a.capacity_mib: roles a, a2, a3 are on one device" in capsys.readouterr().err


# ---- load -----------------------------------------------------------------------------------


def test_load_on_an_empty_store_keeps_the_config_text(world: World) -> None:
    svc = world.service()
    assert svc.ledger.roles["r"].capacity_mib == 1000
    assert svc.store.meta("config") == ROLES
    assert svc.states() == {}
    assert svc.state_of("a") == DECLARED


def test_load_restores_reservations_and_states_from_the_store(world: World) -> None:
    store = world.store()
    store.commit(Changes(put=[Reservation("a", "r", 300, 1.0), Reservation("x", "r", 50, 2.0,
                                                                            external=True)],
                         states=[ServeStateRow("a", RUNNING, None, 5.0),
                                 ServeStateRow("x", DECLARED, None, 5.0),
                                 ServeStateRow("gone", FAILED, "old", 6.0)]))
    svc = world.service(store=store)
    assert {s: r.mib for s, r in svc.ledger.reservations.items()} == {"a": 300, "x": 50}
    assert svc.state_of("a") == RUNNING
    assert svc.state_of("x") == EXTERNAL  # held, so not "declared"
    assert svc.records["gone"].reason == "old"
    assert svc.known_serves() == ["a", "b", "x"]  # gone: not configured, holding nothing


def test_a_held_serve_recorded_declared_or_denied_is_admitted_again(world: World) -> None:
    store = world.store()
    store.commit(Changes(put=[Reservation("a", "r", 300, 1.0)],
                         states=[ServeStateRow("a", DENIED, "too big", 5.0)]))
    svc = world.service(store=store)
    assert svc.state_of("a") == ADMITTED


def test_load_releases_a_serve_that_left_the_config_while_gpud_was_away(world: World) -> None:
    store = world.store()
    store.commit(Changes(put=[Reservation("old", "r", 200, 1.0)],
                         states=[ServeStateRow("old", FAILED, "x", 1.0)]))
    svc = world.service(store=store)
    assert "old" not in svc.ledger.reservations
    assert held(svc) == {}
    assert svc.state_of("old") == DECLARED
    [ev] = svc.store.events(EventQuery(kinds=["release"]))
    assert ev.serve == "old" and ev.mib == 200
    assert "config loaded at start" in ev.message and "free 900 MiB" in ev.message


def test_a_release_on_a_role_the_config_dropped_has_no_figures(world: World) -> None:
    store = world.store()
    store.commit(Changes(put=[Reservation("old", "gone", 200, 1.0)]))
    svc = world.service(store=store)
    assert held(svc) == {}
    [ev] = svc.store.events(EventQuery(kinds=["release"]))
    assert ev.message.endswith("(config loaded at start: the serve left the config or its role)")


def test_a_change_made_while_away_that_the_ledger_cannot_follow_is_refused(
        world: World, caplog: pytest.LogCaptureFixture) -> None:
    old = ROLES + '\n[serves.c]\nrole = "r"\nvram_mib = 100\ncommand = ["/bin/true"]\n'
    store = world.store()
    store.commit(Changes(put=[Reservation("c", "r", 100, 1.0)],
                         states=[ServeStateRow("c", RUNNING, None, 1.0)], meta={"config": old}))
    with caplog.at_level(logging.ERROR, "gpud"):
        svc = world.service(ROLES, store=store)
    assert svc.config_refused is not None
    assert svc.config_refused.startswith("refused at start: ")
    assert "c" in svc.config.serves  # the config it last ran with is in force
    assert svc.config_text == old
    assert held(svc) == {"c": 100}
    assert "cannot follow" in caplog.text


def test_without_a_stored_config_a_ledger_that_does_not_fit_is_logged(
        world: World, caplog: pytest.LogCaptureFixture) -> None:
    store = world.store()
    store.commit(Changes(put=[Reservation("c", "r", 100, 1.0)],
                         states=[ServeStateRow("c", RUNNING, None, 1.0)]))
    with caplog.at_level(logging.ERROR, "gpud"):
        svc = world.service(store=store)
    assert "the ledger does not fit the config" in caplog.text
    assert svc.config_refused is None
    assert held(svc) == {"c": 100}  # nothing released: the serve may still hold it


def test_an_unreadable_stored_config_is_decided_against_the_file_alone(
        world: World, caplog: pytest.LogCaptureFixture) -> None:
    store = world.store()
    store.commit(Changes(meta={"config": "[roles.r\n"}))
    with caplog.at_level(logging.WARNING, "gpud"):
        svc = world.service(store=store)
    assert "the stored config cannot be read" in caplog.text
    assert svc.config_refused is None
    assert svc.store.meta("config") == ROLES


def test_a_stored_config_that_no_longer_fits_the_host_is_set_aside(world: World) -> None:
    store = world.store()
    store.commit(Changes(meta={"config": '[roles.r]\ndevice = "GPU-gone"\ncapacity_mib = 10\n'}))
    text = '[roles.r]\ndevice = "GPU-sim-0"\ncapacity_mib = 10\n'

    async def go() -> LedgerService:
        return world.service(text, store=store, observer=await world.simulated())

    svc = asyncio.run(go())
    assert svc.config_refused is None
    assert svc.ledger.roles["r"].device == "GPU-sim-0"


def test_a_config_that_does_not_fit_the_host_without_a_stored_one_fails_load(
        world: World) -> None:
    async def go() -> None:
        obs = await world.simulated()
        with pytest.raises(ConfigError, match="no device 'GPU-gone'"):
            world.service('[roles.r]\ndevice = "GPU-gone"\ncapacity_mib = 10\n', observer=obs)

    asyncio.run(go())


def test_an_over_committed_role_is_warned_at_load(world: World,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    text = ROLES.replace("capacity_mib = 1000", "capacity_mib = 400")
    text = text.replace("vram_mib = 500", "vram_mib = 350")
    store = world.store()
    store.commit(Changes(put=[Reservation("a", "r", 300, 1.0), Reservation("b", "r", 350, 2.0)],
                         states=[ServeStateRow("a", RUNNING, None, 1.0),
                                 ServeStateRow("b", RUNNING, None, 1.0)]))
    with caplog.at_level(logging.WARNING, "gpud"):
        svc = world.service(text, store=store)
    assert "role r is over-committed by 350 MiB" in caplog.text
    assert held(svc) == {"a": 300, "b": 350}  # adopted memory is kept, shown over-committed


# ---- admission ------------------------------------------------------------------------------


async def test_admit_commits_reservation_state_and_event_together(world: World) -> None:
    svc = world.service()
    world.clock.now = 2000.0
    admission = await svc.admit("a", 300, uid=7)
    assert admission.reservation == Reservation("a", "r", 300, 2000.0, 7, False)
    assert admission.replaced_mib is None
    assert held(svc) == {"a": 300}
    assert stored_states(svc) == {"a": ADMITTED}
    [ev] = await svc.events(EventQuery(kinds=["admit"]))
    assert ev.message == ("a admitted on r: 300 MiB (new); gpu_role 'r': capacity 1000 MiB, "
                          "reserve 100 MiB, committed 300 MiB, free 600 MiB")
    assert (ev.uid, ev.ts, ev.details["check"], ev.details["free_mib"]) == (7, 2000.0, "ledger", 600)
    assert svc.counters == {"admit": 1}


async def test_a_commit_of_states_is_told_with_the_serves_it_changed(world: World) -> None:
    """`watch_states`: each commit that stores a state is told with the serves it changed (the
    on-demand orchestrator wakes the requests waiting on their devices, not all)."""
    svc = world.service()
    told: list[frozenset[str]] = []
    svc.watch_states(told.append)
    await svc.admit("a", 300)
    await svc.admit("b", 200)
    assert told == [frozenset({"a"}), frozenset({"b"})]


async def test_a_readmission_replaces_and_keeps_a_live_state(world: World) -> None:
    svc = world.service()
    await svc.admit("a", 300)
    await svc.store_event(svc.event("start", "a: started", serve="a"),
                          report=svc.report("a", Happened.LAUNCHED))
    await svc.store_event(svc.event("healthy", "a: healthy", serve="a"),
                          report=svc.report("a", Happened.HEALTHY))
    admission = await svc.admit("a", 400)
    assert admission.replaced_mib == 300
    assert svc.state_of("a") == RUNNING
    [ev] = await svc.events(EventQuery(kinds=["admit"], limit=1))
    assert "(replaced 300 MiB)" in ev.message


async def test_an_explicit_state_is_taken(world: World) -> None:
    svc = world.service()
    await admitted_to(svc, "a", 300, STARTING)
    assert stored_states(svc) == {"a": STARTING}


async def test_a_state_change_the_rule_refuses_fails_the_whole_change(
        world: World, caplog: pytest.LogCaptureFixture) -> None:
    """The one writer asks gpud.core.states: a health answer does not make an admitted serve
    (never started) running. The change is refused whole (the event is not stored either),
    raised to the caller, and the journal names the serve, both states and the cause. (It was
    logged and the rest committed: issue 45's bug.)"""
    svc = world.service()
    await svc.admit("a", 300)
    with caplog.at_level(logging.WARNING, logger="gpud"), pytest.raises(StateRefused) as err:
        await svc.store_event(svc.event("healthy", "a: healthy", serve="a"),
                              report=svc.report("a", Happened.HEALTHY))
    assert err.value.details == {"serve": "a", "state": ADMITTED, "next": RUNNING,
                                 "cause": Cause.HEALTHY}
    assert await svc.events(EventQuery(kinds=["healthy"])) == []
    assert svc.state_of("a") == ADMITTED
    assert stored_states(svc) == {"a": ADMITTED}
    [line] = [r.getMessage() for r in caplog.records if "change refused" in r.getMessage()]
    assert line == ("a: change refused: admitted -> running (healthy) refused: healthy does "
                    "not apply to a serve that is admitted")
    # the same change for a cause that allows it is stored
    await svc.store_event(svc.event("start", "a: started", serve="a"),
                          report=svc.report("a", Happened.LAUNCHED))
    await svc.store_event(svc.event("healthy", "a: healthy", serve="a"),
                          report=svc.report("a", Happened.HEALTHY))
    assert stored_states(svc) == {"a": RUNNING}


async def test_a_refused_state_fails_the_reservation_change_beside_it(world: World) -> None:
    """An admission whose state the rule refuses (a serve never launched cannot be put to
    sleep) reserves nothing; a release that asks for a state its cause does not lead to
    releases nothing: reservation, event and state are one change. (Both went through, the
    state alone not stored, leaving a serve released but shown admitted: issue 45's bug.)"""
    svc = world.service()
    with pytest.raises(StateRefused):
        await svc.admit("a", 300, happened=Happened.ASLEEP)
    assert held(svc) == {}
    assert stored_states(svc) == {}
    await svc.admit("b", 200)
    with pytest.raises(StateRefused):
        await svc.release("b", happened=Happened.WOKEN)
    assert held(svc) == {"b": 200}
    assert stored_states(svc) == {"b": ADMITTED}
    assert [e.kind for e in await svc.events(EventQuery(serves=["b"]))] == ["admit"]


async def test_a_denial_is_recorded_and_marks_a_configured_serve_denied(world: World) -> None:
    svc = world.service()
    await svc.admit("b", 500)
    with pytest.raises(Denied) as err:
        await svc.admit("a", 401, uid=3)
    assert err.value.details["bound"] == "ledger"
    assert err.value.details["check"] == "ledger"
    assert err.value.details["shortfall_mib"] == 1
    assert held(svc) == {"b": 500}
    assert stored_states(svc)["a"] == DENIED
    assert svc.records["a"].reason is not None
    [ev] = await svc.events(EventQuery(kinds=["deny"]))
    assert (ev.serve, ev.uid, ev.mib, ev.details["free_mib"]) == ("a", 3, 401, 400)


async def test_a_denied_readmission_of_a_holder_keeps_its_state(world: World) -> None:
    svc = world.service()
    await svc.admit("a", 300)
    with pytest.raises(Denied):
        await svc.admit("a", 1000)
    assert svc.state_of("a") == ADMITTED
    assert held(svc) == {"a": 300}


async def test_a_denied_running_serve_keeps_running(world: World) -> None:
    svc = world.service()
    await svc.admit("b", 500)
    await svc.admit("a", 300)
    await svc.store_event(svc.event(EventKind.START, "a: started", serve="a"),
                          report=svc.report("a", Happened.LAUNCHED))
    await svc.store_event(svc.event(EventKind.CALIBRATE, "x", serve="a"),
                          report=svc.report("a", Happened.HEALTHY))
    with pytest.raises(Denied) as err:
        await svc.admit("a", 401)
    assert err.value.details["bound"] == "ledger"
    assert svc.state_of("a") == RUNNING and svc.invariant_violations == 0


async def test_a_denied_external_name_is_not_remembered(world: World) -> None:
    svc = world.service()
    with pytest.raises(Denied):
        await svc.admit("ext", 5000, role="r")
    assert "ext" not in svc.records
    assert "ext" not in svc.known_serves()
    assert kinds(svc).count("deny") == 1


async def test_an_external_reservation(world: World) -> None:
    svc = world.service()
    admission = await svc.admit("ext", 100, role="r", uid=1)
    assert admission.reservation.external
    assert svc.state_of("ext") == EXTERNAL


@pytest.mark.parametrize(("serve", "role", "error", "message"), [
    ("a", "other", BadRequest, "serve 'a' is configured on role 'r', not 'other'"),
    ("ext", None, NotFound, "unknown serve 'ext': not in the config"),
    ("ext", "Bad Role!", BadRequest, "role"),
    ("ext", "nosuch", NotFound, "unknown role 'nosuch'"),
    ("Bad Name!", None, BadRequest, "serve"),
])
async def test_an_admission_that_names_nothing_known_is_refused(
        world: World, serve: str, role: str | None, error: type[GpudError], message: str) -> None:
    svc = world.service()
    with pytest.raises(error, match=message.replace("(", r"\(")) as err:
        await svc.admit(serve, 10, role=role)
    assert type(err.value) is error
    assert held(svc) == {}
    assert kinds(svc) == []  # nothing recorded for a malformed or unknown ask


async def test_an_external_ask_on_a_missing_role_is_not_found(world: World) -> None:
    store = world.store()
    store.commit(Changes(put=[Reservation("x", "gone", 10, 1.0, external=True)]))
    svc = world.service(store=store)
    assert svc.ledger.roles["gone"].missing
    with pytest.raises(NotFound, match="unknown role 'gone'"):
        await svc.admit("y", 1, role="gone")


async def test_strict_admission_uses_observation(world: World) -> None:
    obs = await world.simulated(state={"external": [
        {"device": "GPU-sim-0", "label": "display", "mib": 1800}]})
    svc = world.service(ROLES.replace('admission = "ledger"', 'admission = "strict"'),
                        observer=obs)
    with pytest.raises(Denied) as err:
        await svc.admit("a", 300)
    assert err.value.details["check"] == "strict"
    assert err.value.details["bound"] == "physical"
    admission = await svc.admit("ext", 100, role="r")
    assert admission.reservation.mib == 100
    [ev] = await svc.events(EventQuery(kinds=["admit"]))
    assert ev.details["check"] == "strict"


VLLM_ON_SIM = """
[daemon]
admission = "strict"
vllm_start_context_mib = 300

[roles.r]
device = "GPU-sim-0"

[serves.v]
role = "r"
vram_mib = 1500
port = 30001
[serves.v.vllm]
model = "m"
"""


async def test_strict_admission_leaves_room_for_vllms_own_start_check(world: World) -> None:
    # 2000 MiB device, 400 MiB drawn by the display: 1600 free. vLLM checks free >= util x
    # total after its CUDA context exists: with no vllm.context_mib in its reservation, 1500
    # MiB would fail that check at start; admission asks for the context besides.
    obs = await world.simulated(state={"external": [
        {"device": "GPU-sim-0", "label": "display", "mib": 400}]})
    svc = world.service(VLLM_ON_SIM, observer=obs)
    with pytest.raises(Denied) as err:
        await svc.admit("v", 1500)
    assert err.value.details["bound"] == "physical"
    assert "need 1800 MiB, free 1600 MiB, short 200 MiB" in err.value.message
    assert (await svc.admit("v", 1300)).reservation.mib == 1300


async def test_a_reservation_that_covers_vllms_context_needs_no_more(world: World) -> None:
    obs = await world.simulated(state={"external": [
        {"device": "GPU-sim-0", "label": "display", "mib": 400}]})
    covered = VLLM_ON_SIM.replace('model = "m"', 'model = "m"\ncontext_mib = 300')
    svc = world.service(covered, observer=obs)
    assert (await svc.admit("v", 1500)).reservation.mib == 1500


async def test_strict_admission_without_observation_falls_back_and_says_so(world: World) -> None:
    svc = world.service(ROLES.replace('admission = "ledger"', 'admission = "strict"'))
    await svc.admit("a", 300)
    [ev] = await svc.events(EventQuery(kinds=["admit"]))
    assert ev.details["check"] == "ledger"
    with pytest.raises(Denied) as err:
        await svc.admit("b", 700)
    assert err.value.details["note"] == (
        "observation unavailable: strict admission fell back to the ledger bound")


async def test_a_lost_device_denies_with_the_reason(world: World) -> None:
    obs = await world.simulated()
    svc = world.service(observer=obs)
    (world.tmp / "sim.json").write_text(json.dumps({"lost": ["GPU-sim-0"]}))
    await obs.sample()
    assert svc.lost_device("r") == "device 'GPU-sim-0' of role 'r' is lost: simulated: device lost"
    assert svc.lost_device("nosuch") is None
    with pytest.raises(Denied) as err:
        await svc.admit("a", 300, uid=4)
    assert err.value.message == ("a denied on r: device 'GPU-sim-0' of role 'r' is lost: "
                                 "simulated: device lost")
    assert err.value.details == {"serve": "a", "role": "r", "bound": "device", "need_mib": 300,
                                 "device": "GPU-sim-0", "check": "device"}
    assert held(svc) == {}
    [ev] = await svc.events(EventQuery(kinds=["deny"]))
    assert (ev.uid, ev.details["bound"]) == (4, "device")


async def test_a_healthy_device_is_not_lost(world: World) -> None:
    svc = world.service(observer=await world.simulated())
    assert svc.lost_device("r") is None
    assert world.service(load=True).lost_device("r") is None  # no observer at all


async def test_adopt_keeps_a_running_units_memory_even_over_capacity(world: World) -> None:
    svc = world.service()
    await svc.admit("b", 500)
    res = await svc.adopt("a", "r", 600)
    assert res == Reservation("a", "r", 600, 1000.0, None, False)
    assert held(svc) == {"a": 600, "b": 500}
    assert [f.role for f in svc.ledger.over_committed()] == ["r"]
    [ev] = await svc.events(EventQuery(kinds=["admit"], limit=1))
    assert ev.details["adopted"] is True and ev.details["free_mib"] == -200


# ---- release --------------------------------------------------------------------------------


async def test_release_commits_deletion_state_and_event(world: World) -> None:
    svc = world.service()
    await svc.admit("a", 300)
    res = await svc.release("a", uid=9, reason="done")
    assert res.mib == 300
    assert held(svc) == {}
    assert stored_states(svc) == {"a": DECLARED}
    [ev] = await svc.events(EventQuery(kinds=["release"]))
    assert ev.message.startswith("a released 300 MiB on r (done); ")
    assert (ev.uid, ev.details["free_mib"]) == (9, 900)


async def test_release_to_a_given_state_with_its_reason(world: World) -> None:
    svc = world.service()
    await svc.admit("a", 300)
    await svc.release("a", happened=Happened.FAILED, state_reason="why")
    assert svc.records["a"].state == FAILED and svc.records["a"].reason == "why"


@pytest.mark.parametrize("state", [STARTING, RUNNING])
async def test_releasing_a_live_serve_is_refused_unless_allowed(world: World, state: str) -> None:
    svc = world.service()
    await admitted_to(svc, "a", 300, state)
    with pytest.raises(Conflict, match=f"serve 'a' is {state}: its process may still hold"):
        await svc.release("a")
    assert held(svc) == {"a": 300}
    await svc.release("a", allow_live=True)
    assert held(svc) == {}


class Launching:
    """A supervision with one serve's launch under way."""

    def __init__(self, serve: str) -> None:
        self.serve = serve

    def launch_under_way(self, serve: str) -> bool:
        return serve == self.serve

    def launching(self) -> tuple[bool, str | None]:
        return True, None

    def freed(self, role: str) -> None:
        pass


async def test_releasing_a_serve_whose_launch_is_under_way_is_refused(world: World) -> None:
    svc = world.service()
    await svc.admit("a", 300)
    svc.supervise(Launching("a"))
    with pytest.raises(Conflict) as err:
        await svc.release("a")
    assert err.value.details == {"serve": "a", "state": STARTING}
    await svc.release("a", allow_live=True)


async def test_releasing_what_is_not_held(world: World) -> None:
    svc = world.service()
    with pytest.raises(Conflict, match="serve 'a' holds no reservation"):
        await svc.release("a")
    with pytest.raises(NotFound, match="unknown serve 'zz'"):
        await svc.release("zz")
    with pytest.raises(BadRequest):
        await svc.release("../x")
    await svc.store_event(svc.event("exit", "gone failed", serve="gone"),
                          report=svc.report("gone", Happened.FAILED))
    with pytest.raises(Conflict):
        await svc.release("gone")


# ---- the write path -------------------------------------------------------------------------


async def test_a_failed_commit_changes_nothing_in_memory(world: World) -> None:
    svc = world.service()
    store = svc.store
    assert isinstance(store, FailingStore)
    store.fail_next = 1
    with pytest.raises(StoreError):
        await svc.admit("a", 300)
    assert svc.ledger.reservations == {}
    assert svc._decided is svc.ledger  # the next decision starts from what is durable
    assert svc.state_of("a") == DECLARED
    assert held(svc) == {}
    await svc.admit("a", 300)  # and the next one works
    assert held(svc) == {"a": 300}


async def test_every_change_queued_behind_a_failed_one_fails_too(world: World) -> None:
    svc = world.service()
    store = svc.store
    assert isinstance(store, FailingStore)
    store.fail_next = 1
    store.gate.clear()
    async with svc.lock:
        first = svc.submit(Changes(events=[svc.event(EventKind.CALIBRATE, "one")]))
    # The commit loop has taken the first into its batch, which is being written.
    await asyncio.to_thread(store.entered.wait, 5)
    async with svc.lock:
        second = svc.submit(Changes(events=[svc.event(EventKind.CALIBRATE, "two")]))
    store.gate.set()
    results = await asyncio.gather(first, second, return_exceptions=True)
    assert isinstance(results[0], StoreError)
    assert all(isinstance(r, StoreError) for r in results), results
    assert kinds(svc) == []


async def test_a_failing_announcement_does_not_fail_the_durable_change(
        world: World, caplog: pytest.LogCaptureFixture) -> None:
    svc = world.service()

    def boom(_ev: Event) -> None:
        raise RuntimeError("listener broke")

    svc._announce = boom  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, "gpud"):
        await svc.admit("a", 300)
    assert held(svc) == {"a": 300}
    assert "announcing event" in caplog.text


async def test_events_are_pruned_after_a_batch(world: World,
                                               caplog: pytest.LogCaptureFixture) -> None:
    svc = world.service()
    store = svc.store
    assert isinstance(store, FailingStore)
    store.pruned.clear()
    svc._since_prune = 0
    assert prune_batch(100) == 5
    for i in range(146):
        await svc.store_event(svc.event(EventKind.CALIBRATE, f"n{i}"))
    await svc.drain()
    await asyncio.get_running_loop().run_in_executor(svc._executor, lambda: None)
    assert store.pruned and set(store.pruned) == {100}
    store.pruned.clear()
    svc._since_prune = 0
    for i in range(4):
        await svc.store_event(svc.event(EventKind.CALIBRATE, f"m{i}"))
    assert store.pruned == []  # under a batch: not pruned yet
    svc._since_prune = 4
    with caplog.at_level(logging.INFO, "gpud"):
        await svc.store_event(svc.event(EventKind.CALIBRATE, "last"))
        await svc.drain()
        await asyncio.get_running_loop().run_in_executor(svc._executor, lambda: None)
    assert store.pruned == [100]
    assert svc._since_prune == 0
    assert len(store.events(EventQuery(limit=1000))) == 100
    assert "old events (keeping the newest 100)" in caplog.text


@pytest.mark.parametrize("keep", [100, 500, 2000])
async def test_events_kept_stay_within_a_tenth_of_events_keep(world: World, keep: int) -> None:
    """events_keep = 500 kept 1,499 events when pruning went by batches of 1000. Recorded 25 at
    a time (group commits of several events), counted once each prune has run."""
    svc = world.service(ROLES.replace("events_keep = 100", f"events_keep = {keep}"))
    counts = []
    for burst in range(2 * keep // 25 + 20):
        await asyncio.gather(*(svc.store_event(svc.event(EventKind.CALIBRATE, f"n{burst}.{i}")) for i in range(25)))
        await svc.drain()
        await asyncio.get_running_loop().run_in_executor(svc._executor, lambda: None)
        counts.append(len(svc.store.events(EventQuery(limit=100_000))))
    assert counts[-1] >= keep
    assert max(counts) <= keep * 1.1, (keep, max(counts))


async def test_a_failed_prune_is_a_warning(world: World, caplog: pytest.LogCaptureFixture) -> None:
    svc = world.service()
    store = svc.store
    assert isinstance(store, FailingStore)
    store.fail_prune = True
    svc._since_prune = 10_000
    with caplog.at_level(logging.WARNING, "gpud"):
        await svc.store_event(svc.event(EventKind.CALIBRATE, "x"))
        await asyncio.get_running_loop().run_in_executor(svc._executor, lambda: None)
    assert "pruning old events failed: cannot prune: database is locked" in caplog.text


async def test_put_meta_and_record(world: World) -> None:
    svc = world.service()
    await svc.put_meta("apply", "{}")
    assert svc.store.meta("apply") == "{}"
    await svc.put_meta("apply", None)
    assert svc.store.meta("apply") is None
    ev = await svc.store_event(svc.event(EventKind.CALIBRATE, "hello", serve="a", role="r", mib=1, uid=2, k="v"))
    assert ev.id is not None and ev.details == {"k": "v"}


async def test_drain_waits_for_everything_submitted(world: World) -> None:
    svc = world.service()
    await svc.drain()  # nothing under way
    async with svc.lock:
        futures = [svc.submit(Changes(events=[svc.event(EventKind.CALIBRATE, str(i))])) for i in range(3)]
    await svc.drain()
    assert all(f.done() for f in futures)
    assert len(kinds(svc)) == 3


async def test_warning_kinds_log_as_warnings(world: World,
                                            caplog: pytest.LogCaptureFixture) -> None:
    svc = world.service()
    with caplog.at_level(logging.INFO, "gpud"):
        await svc.store_event(svc.event("deny", "denied!", serve="a", n=3, skip=[1]))
        await svc.store_event(svc.event("admit", "fine"))
    levels = {r.getMessage(): r.levelno for r in caplog.records}
    assert levels["denied!"] == logging.WARNING
    assert levels["fine"] == logging.INFO
    fields = next(r for r in caplog.records if r.getMessage() == "denied!").journal  # type: ignore[attr-defined]
    assert fields["GPUD_N"] == 3 and "GPUD_SKIP" not in fields and fields["GPUD_SERVE"] == "a"


# ---- event streams --------------------------------------------------------------------------


async def test_subscribers_hear_only_what_they_asked_for(world: World) -> None:
    svc = world.service()
    by_serve = svc.subscribe(EventQuery(serves=["a"]))
    by_kind = svc.subscribe(EventQuery(kinds=["release"]))
    by_role = svc.subscribe(EventQuery(roles=["other"]))
    later = svc.subscribe(EventQuery(since=5000.0))
    await svc.admit("a", 300)
    await svc.admit("b", 500)
    await svc.release("b")
    world.clock.now = 6000.0
    await svc.release("a")
    assert [e.kind for e in drain_queue(by_serve.queue)] == ["admit", "release"]
    assert [e.serve for e in drain_queue(by_kind.queue)] == ["b", "a"]
    assert drain_queue(by_role.queue) == []
    assert [e.serve for e in drain_queue(later.queue)] == ["a"]
    svc.unsubscribe(by_serve)
    svc.unsubscribe(by_serve)  # twice is harmless
    await svc.admit("a", 300)
    assert drain_queue(by_serve.queue) == []
    assert [e.kind for e in drain_queue(later.queue)] == ["admit"]
    svc.end_streams()
    assert later.queue.get_nowait() is None
    assert svc._subscribers == []


def drain_queue(queue: asyncio.Queue[Event | None]) -> list[Event]:
    out = []
    while not queue.empty():
        item = queue.get_nowait()
        assert item is not None
        out.append(item)
    return out


async def test_a_follower_that_does_not_read_is_cut_off(world: World) -> None:
    svc = world.service()
    sub = svc.subscribe(EventQuery())
    sub.queue = asyncio.Queue(2)
    for i in range(3):
        await svc.store_event(svc.event(EventKind.CALIBRATE, str(i)))
    assert sub not in svc._subscribers
    assert sub.queue.get_nowait() is None  # told its stream ended
    svc.end_streams()


async def test_end_streams_with_a_full_queue(world: World) -> None:
    svc = world.service()
    sub = svc.subscribe(EventQuery())
    sub.queue = asyncio.Queue(1)
    sub.queue.put_nowait(svc.event(EventKind.CALIBRATE, "x"))
    svc.end_streams()  # the end marker does not fit: the follower is dropped all the same
    assert svc._subscribers == []


# ---- reload ---------------------------------------------------------------------------------


async def test_reload_releases_serves_that_left_and_swaps_the_config(world: World) -> None:
    svc = world.service()
    await svc.admit("a", 300)
    await svc.admit("b", 500)
    new_text = ROLES.split("[serves.b]")[0]
    over = await svc.reload(cfg(new_text), new_text, source="test.toml", uid=5)
    assert over == []
    assert set(svc.config.serves) == {"a"}
    assert svc.config_text == new_text
    assert svc.store.meta("config") == new_text
    assert held(svc) == {"a": 300}
    assert svc.state_of("b") == DECLARED
    [reload_ev] = await svc.events(EventQuery(kinds=["reload"]))
    assert reload_ev.message == "config reloaded from test.toml; released: b"
    assert reload_ev.uid == 5
    [rel] = await svc.events(EventQuery(kinds=["release"]))
    assert "reload from test.toml" in rel.message


async def test_reload_refused_changes_nothing(world: World) -> None:
    svc = world.service()
    await admitted_to(svc, "b", 500, RUNNING)
    svc.config_refused = "earlier"
    new_text = ROLES.split("[serves.b]")[0]
    with pytest.raises(Conflict) as err:
        await svc.reload(cfg(new_text), new_text, source="x")
    assert err.value.message.startswith("config change refused, nothing changed: ")
    assert err.value.details["blockers"][0]["what"] == "b"
    assert "b" in svc.config.serves
    assert svc.config_text == ROLES
    assert held(svc) == {"b": 500}
    assert svc.config_refused == "earlier"


async def test_reload_whose_commit_fails_keeps_the_old_config(world: World) -> None:
    svc = world.service()
    store = svc.store
    assert isinstance(store, FailingStore)
    new_text = ROLES.replace("capacity_mib = 1000", "capacity_mib = 900")
    store.fail_next = 1
    with pytest.raises(StoreError):
        await svc.reload(cfg(new_text), new_text, source="x")
    assert svc.config_text == ROLES
    assert svc.config.roles["r"].capacity_mib == 1000
    assert svc.ledger.roles["r"].capacity_mib == 1000


async def test_reload_names_roles_that_stay_over_committed(world: World) -> None:
    svc = world.service()
    await svc.adopt("a", "r", 950)
    new_text = ROLES + "\n"
    over = await svc.reload(cfg(new_text), new_text, source="x")
    assert over == ["r"]
    [ev] = await svc.events(EventQuery(kinds=["reload"]))
    assert ev.message.endswith("; over-committed: r")
    svc.config_refused = "x"
    await svc.reload(cfg(new_text), new_text, source="x")
    assert svc.config_refused is None


async def test_decide_asks_the_core(world: World) -> None:
    svc = world.service()
    same = svc.decide(svc.config, may_stop=False)
    assert isinstance(same, Transition) and same.released == ()
    await admitted_to(svc, "b", 500, RUNNING)
    without_b = cfg(ROLES.split("[serves.b]")[0])
    assert isinstance(svc.decide(without_b, may_stop=False), Refusal)
    stop = svc.decide(without_b, may_stop=True)
    assert isinstance(stop, Transition) and stop.stop == ("b",)


# ---- reads ----------------------------------------------------------------------------------


async def test_summary_and_status(world: World) -> None:
    svc = world.service(config_path=world.tmp / "serves.toml")
    (world.tmp / "serves.toml").write_text(ROLES)
    await svc.admit("a", 300)
    assert svc.summary() == "r 300/900 MiB committed (free 600); 2 serves: 1 admitted, 1 declared"
    svc.ready = True
    view = svc.status_view({"available": False})
    assert view["config"] == str(world.tmp / "serves.toml")
    assert view["admission"] == "ledger"
    assert view["ready"] is True
    assert view["launching"] == {"available": False,
                                 "reason": "launching is not set up in this gpud"}
    assert view["observation"] == {"available": False}
    assert view["serve_states"] == {"admitted": 1, "declared": 1}
    assert view["over_committed"] == []
    assert view["config_file"] == {"differs": False, "reason": None}
    assert view["store_transactions"] == svc.commits >= 1
    assert view["started_at"] == 1000.0
    assert svc.serve_spec("a") is not None and svc.serve_spec("zz") is None


def test_summary_with_no_serves(world: World) -> None:
    svc = world.service('[roles.r]\ndevice = "0"\ncapacity_mib = 10\n')
    assert svc.summary() == "r 0/10 MiB committed (free 10); 0 serves: none"
    assert svc.status_view({})["config"] is None


def test_config_file_status(world: World) -> None:
    path = world.tmp / "serves.toml"
    assert world.service().config_file_status() == {"differs": False, "reason": None}
    path.write_text(ROLES)
    svc = world.service(config_path=path)
    assert svc.config_file_status() == {"differs": False, "reason": None}
    path.write_text(ROLES + "\n# edited\n")
    assert svc.config_file_status() == {
        "differs": True, "reason": "the file changed since it was loaded: gpuctl plan shows "
                                   "what a reload would do"}
    svc.config_refused = "refused at start: no"
    assert svc.config_file_status() == {"differs": True, "reason": "refused at start: no"}
    svc.config_refused = None
    path.unlink()
    assert svc.config_file_status() == {"differs": True, "reason": "the file cannot be read"}
    path.write_bytes(b"\xff\xfe")
    assert svc.config_file_status()["reason"] == "the file cannot be read"


def test_without_config_text_the_file_never_differs(world: World) -> None:
    path = world.tmp / "serves.toml"
    path.write_text("something else")
    svc = world.service(config_path=path, load=False)
    svc.config_text = None
    assert svc.config_file_status() == {"differs": False, "reason": None}


async def test_known_serves_leave_out_declared_leftovers(world: World) -> None:
    svc = world.service()
    await svc.store_event(svc.event(EventKind.CALIBRATE, "old", serve="old"),
                          report=svc.report("old", Happened.CONFIG_DROPPED))
    await svc.store_event(svc.event(EventKind.CALIBRATE, "broken", serve="broken"),
                          report=svc.report("broken", Happened.FAILED))
    await svc.store_event(svc.event(EventKind.CALIBRATE, "leaving", serve="leaving"),
                          report=svc.report("leaving", Happened.STOP_BEGUN))
    # not configured, holding nothing: listed only while its unit may still run
    assert svc.known_serves() == ["a", "b", "leaving"]


async def test_admissions_on_a_held_role_are_denied_but_for_the_holder(world: World) -> None:
    svc = world.service()
    svc.hold("a", ["r"], "reconciling: a says is_sleeping false")
    with pytest.raises(Denied) as err:
        await svc.admit("b", 500, uid=4)
    assert err.value.message == "b denied on r: reconciling: a says is_sleeping false"
    assert err.value.details["bound"] == "held"
    assert svc.hold_reason("r", "b") == "reconciling: a says is_sleeping false"
    assert svc.hold_reason("r", "a") is None and svc.hold_reason("other", "b") is None
    await svc.admit("a", 300)  # the serve putting its own reservation right
    svc.lift("a")
    await svc.admit("b", 500)
    assert held(svc) == {"a": 300, "b": 500}


async def test_the_invariant_is_evaluated_after_every_commit(world: World,
                                                             caplog: pytest.LogCaptureFixture
                                                             ) -> None:
    svc = world.service()
    await svc.admit("b", 500)
    assert svc.violations == [] and svc.invariant_violations == 0
    # a bug elsewhere: a serve recorded starting without a reservation
    with caplog.at_level(logging.ERROR, logger="gpud"):
        await svc.store_event(svc.event("start", "a: started"),
                              report=svc.report("a", Happened.LAUNCHED))
        await svc.drain()
    assert svc.violations == ["a: starting without a reservation"]
    assert svc.invariant_violations == 1
    [ev] = await svc.events(EventQuery(kinds=["invariant"]))
    assert ev.details["violations"] == ["a: starting without a reservation"]
    assert ev.details["roles"] == ["r"] and ev.details["holds"] is False
    assert "refused until it holds" in ev.message
    assert any(r.levelno == logging.ERROR and "invariant does not hold" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(Denied) as err:
        await svc.admit("b", 400)
    assert "the invariant does not hold: a: starting without a reservation" in err.value.message
    await svc.release("b", allow_live=True)  # what gives memory back still goes
    # put right: admissions are granted again, and it is said
    await svc.store_event(svc.event("exit", "a: gone"), report=svc.report("a", Happened.STOPPED))
    await svc.drain()
    assert svc.violations == [] and svc.invariant_violations == 1
    evs = await svc.events(EventQuery(kinds=["invariant"]))
    assert [e.details["holds"] for e in evs] == [False, True]
    await svc.admit("b", 400)


async def test_adopted_over_commitment_is_no_violation_and_it_drains(world: World) -> None:
    svc = world.service()
    await svc.admit("b", 500)
    await svc.adopt("a", "r", 600)  # 1100 > 900: units found running
    await svc.drain()
    assert svc.violations == []
    await svc.release("a", allow_live=True)
    await svc.drain()
    assert svc.violations == [] and svc.invariant_violations == 0


async def test_a_serve_removed_from_the_config_is_no_longer_listed(world: World) -> None:
    svc = world.service()
    with pytest.raises(Denied):
        await svc.admit("b", 5000)  # denied: its state says so, with the reason
    await svc.store_event(svc.event(EventKind.CALIBRATE, "x", serve="a"),
                          report=svc.report("a", Happened.FAILED, "boom"))
    assert svc.known_serves() == ["a", "b"]
    new_text = ROLES.split("[serves.a]")[0]
    await svc.reload(cfg(new_text), new_text, source="test.toml")
    assert svc.known_serves() == []  # their history stays in the events
    assert [e.kind for e in await svc.events(EventQuery(serves=["b"]))] == ["deny"]


async def test_a_denial_no_longer_true_is_cleared(world: World) -> None:
    svc = world.service()
    await svc.admit("b", 700)
    with pytest.raises(Denied):
        await svc.admit("a", 300)  # free 200: short 100
    assert svc.state_of("a") == DENIED and "short" in (svc.records["a"].reason or "")
    await svc.admit("b", 650)  # a shrink, still no room for a's 300
    await svc.drain()
    assert svc.state_of("a") == DENIED
    await svc.release("b")
    await svc.drain()
    assert svc.state_of("a") == DECLARED and svc.records["a"].reason is None
