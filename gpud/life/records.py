"""Each serve's one record in memory, and the one place it changes.

A serve's record is gpud.core.serverecord.Record, whole: its state as last committed (what
`gpuctl serves` shows) with its reason, what it holds, what systemd last said of its unit, its
on-demand facts and its runtime life. `ServeRecords` holds them, one per serve, and changes one
only through `apply(serve, event)`: the record's one pure step (gpud.core.serverecord.step)
sees all of it, and the result is kept, or the refusal returned and nothing kept. The events
come from:

| event | from whom |
|---|---|
| `Stored`, `FoundHeld`, `Reserved`, `Dropped` | the ledger service: a commit, its start, a reload |
| `UnitPid`, `UnitRestarts` | the supervisor, from systemd |
| gpud.core.demand's events | gpud.server.ondemand |
| gpud.core.lifecycle's inputs | the supervisor's one step (Runtime.step) |

A report (gpud.core.serverecord.Report) is decided on the record as the change under way will
leave it (`decide`), and its state kept once the change is committed (`Stored`). Everyone else
reads the records, as a read-only mapping (no item can be set or deleted; each record is
frozen, each change a new one). The handles of the work under way for a serve (asyncio tasks
and events, which a frozen record cannot hold) are the supervisor's
(gpud.life.supervisor.base.Handles). All but the state are memory only, read again from
systemd (PID, restarts) or begun anew (demand, life) when gpud starts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Final

from gpud.core.demand import Demand
from gpud.core.lifecycle import ServeLife
from gpud.core.serverecord import (
    Event,
    Record,
    Reserved,
    Stepped,
    Stored,
    UnitPid,
    UnitRestarts,
    as_planned,
    step,
)
from gpud.core.states import StateRefusal
from gpud.core.vocab import DECLARED, ServeState

# The record of one serve, as gpud keeps it (the name its readers know it by).
ServeRecord = Record

# The record of a serve of which nothing is known.
NO_RECORD: Final = Record(DECLARED)


class ServeRecords(Mapping[str, Record]):
    """Every serve's record, by name: read as a mapping, changed only through `apply` (see the
    module)."""

    def __init__(self) -> None:
        self._records: dict[str, Record] = {}
        # Told, with the serve's name, after each change of a serve's life (`watch_lives`).
        self._life_listeners: list[Callable[[str], None]] = []

    def __getitem__(self, serve: str) -> Record:
        return self._records[serve]

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def of(self, serve: str) -> Record:
        """The serve's record (NO_RECORD: nothing known of it)."""
        return self._records.get(serve, NO_RECORD)

    def apply(self, serve: str, event: Event) -> Stepped | StateRefusal:
        """Step the serve's whole record by EVENT and keep the result; or return the refusal,
        keeping nothing. A serve with no record gets one for a state stored, or for a change
        that leaves it other than NO_RECORD (nothing known is no record); what systemd says of
        the unit of a serve with no record makes none."""
        known = serve in self._records
        if not known and isinstance(event, UnitPid | UnitRestarts):
            return Stepped(NO_RECORD)
        before = self.of(serve)
        stepped = step(before, event)
        if isinstance(stepped, Stepped) and (known or isinstance(event, Stored)
                                             or stepped.serve != NO_RECORD):
            self._records[serve] = stepped.serve
            if stepped.serve.life is not before.life:
                for listener in self._life_listeners:
                    listener(serve)
        return stepped

    def watch_lives(self, listener: Callable[[str], None]) -> None:
        """Call `listener` with the serve's name after each change of a serve's life (a step of
        gpud.core.lifecycle: the supervisor's, Runtime.step)."""
        self._life_listeners.append(listener)

    def decide(self, serve: str, event: Event, state: ServeState | None,
               reserved: Reserved) -> Stepped | StateRefusal:
        """Step the serve's record as the change under way leaves it (its state decided so
        far, STATE, and its reservation and config, RESERVED: gpud.core.serverecord.as_planned)
        by EVENT, keeping nothing: the ledger service commits what it decides, then keeps it
        (`Stored`)."""
        return step(as_planned(self.of(serve), state, reserved), event)

    def state_of(self, serve: str) -> ServeState:
        state = self.of(serve).state
        return DECLARED if state is None else state

    def demand(self, serve: str) -> Demand:
        """The serve's on-demand facts (NO_DEMAND: none known)."""
        return self.of(serve).demand

    def life(self, serve: str) -> ServeLife:
        """The serve's runtime life (IDLE_LIFE: nothing of gpud's under way on it)."""
        return self.of(serve).life
