"""A supervisor and ledger service without a daemon or systemd, for direct tests of their
decisions: a real ledger service on a real SQLite store, a real observer over the simulated
backend, and a fake of the unit manager's interface (what gpud.host.units.SystemdUnits offers),
since these tests are of the orchestration, not of systemd (tests/integration has that). Unit
signals are handed in the way the unit manager hands them; every wait is on an event the
service records."""

from __future__ import annotations

import asyncio
import textwrap
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from gpud.config import parse_config
from gpud.core.health import Answer, Probe
from gpud.core.unitstate import UnitState
from gpud.core.vocab import DECLARED
from gpud.durable.store import Event, EventQuery, Store
from gpud.host.observer import Observer
from gpud.host.simulation import SimulatedBackend, SimulatedDevice
from gpud.host.unit_properties import UnitSpec
from gpud.life.service import LedgerService
from gpud.life.supervisor import Supervisor

WAIT_S = 10.0


def unit(serve: str, active: str = "active", sub: str = "running", *, result: str = "success",
         restarts: int = 0, pid: int = 4242, invocation: str = "inv-1", status: int = 0,
         stopped_by_job: bool = False) -> UnitState:
    exits = (100, 200) if stopped_by_job else (0, 0)
    return UnitState(serve, f"gpud-serve-{serve}.service", active, sub, result, restarts, pid,
                     status, invocation, f"/gpud.slice/gpud-serve-{serve}.service", 1,
                     active_exit_us=exits[0], exec_main_exit_us=exits[1])


class FakeUnits:
    """The unit manager's interface, with systemd's answers chosen by the test."""

    def __init__(self) -> None:
        self.available = True
        self.reason: str | None = None
        self.systemd_version: int | None = 252
        self.live: dict[str, UnitState] = {}
        self.started: list[UnitSpec] = []
        self.stopped: list[str] = []
        self.reset: list[str] = []
        self.restarted: list[str] = []
        self.fail_start: Exception | None = None
        self.fail_stop: Exception | None = None
        self.fail_restart: Exception | None = None
        self.restart_comes_back = True
        self.start_gate: asyncio.Event | None = None
        self.shutdown = False
        self.connected = self.closed = False
        self._on_state: Callable[[Any], None] | None = None
        self._on_resync: Callable[[Any], None] | None = None
        self._pid = 1000

    def watch(self, callback: Callable[[Any], None],
              on_resync: Callable[[Any], None] | None = None) -> None:
        self._on_state, self._on_resync = callback, on_resync

    async def connect(self) -> None:
        self.connected = True

    async def close(self) -> None:
        self.closed = True

    async def start(self, spec: UnitSpec, timeout: float) -> UnitState:
        self.started.append(spec)
        if self.start_gate is not None:
            await self.start_gate.wait()
        if self.fail_start is not None:
            raise self.fail_start
        self._pid += 1
        st = unit(spec.serve, pid=self._pid, invocation=f"inv-{self._pid}")
        self.live[spec.serve] = st
        return st

    async def stop(self, serve: str, timeout: float) -> None:
        self.stopped.append(serve)
        if self.fail_stop is not None:
            raise self.fail_stop
        self.live.pop(serve, None)

    async def reset_failed(self, serve: str) -> None:
        self.reset.append(serve)

    async def restart(self, serve: str, timeout: float) -> UnitState | None:
        self.restarted.append(serve)
        if self.fail_restart is not None:
            raise self.fail_restart
        if not self.restart_comes_back:
            self.live.pop(serve, None)
            return None
        self._pid += 1
        st = unit(serve, pid=self._pid, invocation=f"inv-{self._pid}", restarts=0)
        self.live[serve] = st
        return st

    async def shutting_down(self) -> bool:
        return self.shutdown

    async def list_serves(self) -> list[UnitState]:
        return list(self.live.values())

    async def state(self, serve: str) -> UnitState | None:
        return self.live.get(serve)

    def emit(self, st: UnitState) -> None:
        assert self._on_state is not None
        self._on_state(st)

    def resync(self, states: list[UnitState]) -> None:
        assert self._on_resync is not None
        self._on_resync(states)


class ScriptedProbe:
    """Health answers from the test (a serve without an answer is healthy): the health
    endpoint's HTTP (gpud.life.supervisor.health.HttpProbe) is tested on its own, against a real
    socket."""

    def __init__(self) -> None:
        self.answers: dict[str, Callable[[], Answer]] = {}
        self.asked: dict[str, int] = {}

    async def probe(self, serve: str, spec: Any) -> Answer:
        self.asked[serve] = self.asked.get(serve, 0) + 1
        answer = self.answers.get(serve)
        return answer() if answer else Answer(Probe.OK, "200")


class ScriptedSupervisor(Supervisor):
    """A supervisor whose health answers are the test's (`answers`, `asked`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        scripted = ScriptedProbe()
        super().__init__(*args, prober=scripted, **kwargs)
        self.answers = scripted.answers
        self.asked = scripted.asked


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Rig:
    tmp: Path
    svc: LedgerService
    units: FakeUnits
    sup: ScriptedSupervisor
    observer: Observer
    notes: list[str] = field(default_factory=list)
    figures: Figures = field(default_factory=lambda: Figures())

    def events(self, **query: Any) -> list[Event]:
        return self.svc.store.events(EventQuery(limit=1000, **query))

    def kinds(self, serve: str) -> list[str]:
        return [e.kind for e in self.events(serves=[serve])]

    def held(self) -> dict[str, int]:
        return {r.serve: r.mib for r in self.svc.store.reservations()}

    def state(self, serve: str) -> str:
        rows = {r.serve: r for r in self.svc.store.serve_states()}
        return rows[serve].state if serve in rows else DECLARED

    def reason(self, serve: str) -> str | None:
        rows = {r.serve: r for r in self.svc.store.serve_states()}
        return rows[serve].reason if serve in rows else None

    async def wait_for(self, kind: str, serve: str, *, after: int = 0,
                       match: str = "") -> Event:
        """The next `kind` event of `serve` (with `match` in its message) after event id
        `after`, once it is durable (its commit is what wakes us: the service's event
        stream)."""
        sub = self.svc.subscribe(EventQuery(serves=[serve], kinds=[kind]))

        def wanted(ev: Event) -> bool:
            return ev.id is not None and ev.id > after and match in ev.message

        try:
            for ev in self.events(serves=[serve], kinds=[kind]):
                if wanted(ev):
                    return ev
            while True:
                item = await asyncio.wait_for(sub.queue.get(), WAIT_S)
                assert item is not None, "the event stream ended"
                if wanted(item):
                    return item
        finally:
            self.svc.unsubscribe(sub)

    def last_id(self) -> int:
        evs = self.events()
        return evs[-1].id or 0 if evs else 0


class Figures:
    """Calibration's figures as the test sets them (gpud.life.supervisor.Calibrated)."""

    def __init__(self) -> None:
        self.sizing: dict[str, str] = {}
        self.kv: dict[str, int] = {}
        self.weights: dict[str, int] = {}
        self.graphs: dict[str, int] = {}

    def sizing_problem(self, serve: str) -> str | None:
        return self.sizing.get(serve)

    def kv_cache_figure(self, serve: str) -> int | None:
        return self.kv.get(serve)

    def weights_mib(self, serve: str) -> int | None:
        return self.weights.get(serve)

    def cudagraph_mib(self, serve: str) -> int | None:
        return self.graphs.get(serve)


async def make_rig(tmp: Path, config: str, *, health: float = 3600, extra: str = "",
                   clock: Callable[[], float] | None = None, observed: bool = True,
                   before: Callable[[Store], None] | None = None) -> Rig:
    """`config` is a template: {tmp} the state dir, {health} the health interval."""
    text = config.format(tmp=tmp, health=health) + textwrap.dedent(extra)
    state_file = tmp / "sim.json"
    if observed:
        state_file.write_text("{}")
    (tmp / "sim-procs").mkdir(exist_ok=True)
    observer = Observer(SimulatedBackend([SimulatedDevice("GPU-sim-0", 2000)], state_file))
    await observer.sample()
    store = Store(tmp / "gpud.sqlite3")
    if before is not None:
        before(store)
    svc = LedgerService(parse_config(text, "test"), store, observer=observer, config_text=text)
    svc.load()
    units = FakeUnits()
    notes: list[str] = []
    async def no_journal(_unit: str, _invocation: str | None) -> list[str]:
        return []

    figures = Figures()
    # The host's user database need not have the serves' default user (the package makes it).
    kwargs: dict[str, Any] = {"notify": notes.append, "journal": no_journal,
                              "calibrated": figures,
                              "home_of": {"gpud-serve": "/var/cache/gpud-serve"}.get}
    if clock is not None:
        kwargs["clock"] = clock
    sup = ScriptedSupervisor(svc, cast(Any, units), observer, **kwargs)
    return Rig(tmp, svc, units, sup, observer, notes, figures)


async def entered(r: Rig) -> AsyncIterator[Rig]:
    async with r.sup:
        yield r
    r.svc.close()
    r.svc.store.close()
