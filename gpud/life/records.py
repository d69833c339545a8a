"""Each serve's one record in memory, and the one place each part of it changes.

`ServeRecord` is what gpud knows of one serve at a time: its state as last committed (what
`gpuctl serves` shows), what systemd last said of its unit, its on-demand facts and its runtime
life. `ServeRecords` holds them, one per serve, and is the one writer of each part:

| part | written by | by whom |
|---|---|---|
| state, reason, updated | `remember` | the ledger service, after a commit (or a read-back at start) |
| main_pid, n_restarts | `set_main_pid`, `set_restart_count` | the supervisor, from systemd |
| demand (gpud.core.demand) | `note_demand` | gpud.server.ondemand, by the core's rules |
| life (gpud.core.lifecycle) | `set_life` | the supervisor's one step (Runtime.step) |

Everyone else reads them, as a read-only mapping (no item can be set or deleted; each record is
frozen, each change a new one). The handles of the work under way for a serve (asyncio tasks
and events, which a frozen record cannot hold) are the supervisor's
(gpud.life.supervisor.base.Handles). All but the state are memory only, read again from
systemd (PID, restarts) or begun anew (demand, life) when gpud starts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Final

from gpud.core.demand import NO_DEMAND, Demand
from gpud.core.lifecycle import IDLE_LIFE, ServeLife
from gpud.core.vocab import DECLARED, ServeState


@dataclass(frozen=True)
class ServeRecord:
    """One serve's record (see the module)."""

    state: ServeState = DECLARED
    reason: str | None = None
    updated: float = 0.0
    main_pid: int | None = None
    n_restarts: int = 0
    demand: Demand = NO_DEMAND
    # Its runtime under the supervisor (gpud.core.lifecycle: gpud's work under way on it, its
    # pending job, its unit as last seen).
    life: ServeLife = IDLE_LIFE


# The record of a serve of which nothing is known.
NO_RECORD: Final = ServeRecord()


class ServeRecords(Mapping[str, ServeRecord]):
    """Every serve's record, by name: read as a mapping, changed only through the methods
    below (see the module)."""

    def __init__(self) -> None:
        self._records: dict[str, ServeRecord] = {}

    def __getitem__(self, serve: str) -> ServeRecord:
        return self._records[serve]

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def state_of(self, serve: str) -> ServeState:
        return self._records.get(serve, NO_RECORD).state

    def remember(self, serve: str, state: ServeState, reason: str | None,
                 updated: float) -> None:
        """A stored state into the serve's record: one committed, or read back from the store
        at start; the rest of the record stays as it was."""
        rec = self._records.get(serve, NO_RECORD)
        self._records[serve] = replace(rec, state=state, reason=reason, updated=updated)

    def set_main_pid(self, serve: str, pid: int | None) -> None:
        """The main PID of the serve's unit as systemd last said it (None: none, or not one
        to show). A serve without a record is left alone."""
        rec = self._records.get(serve)
        if rec is not None and rec.main_pid != pid:
            self._records[serve] = replace(rec, main_pid=pid)

    def set_restart_count(self, serve: str, n_restarts: int) -> None:
        """How often systemd restarted the serve's unit (its NRestarts), 0 after a launch. A
        serve without a record is left alone."""
        rec = self._records.get(serve)
        if rec is not None and rec.n_restarts != n_restarts:
            self._records[serve] = replace(rec, n_restarts=n_restarts)

    def demand(self, serve: str) -> Demand:
        """The serve's on-demand facts (NO_DEMAND: none known)."""
        return self._records.get(serve, NO_RECORD).demand

    def note_demand(self, serve: str, change: Callable[[Demand], Demand]) -> Demand:
        """Change the serve's on-demand facts (gpud.server.ondemand, by the rules of
        gpud.core.demand)."""
        now = change(self.demand(serve))
        self._amend(serve, replace(self._records.get(serve, NO_RECORD), demand=now))
        return now

    def life(self, serve: str) -> ServeLife:
        """The serve's runtime life (IDLE_LIFE: nothing of gpud's under way on it)."""
        return self._records.get(serve, NO_RECORD).life

    def set_life(self, serve: str, life: ServeLife) -> None:
        """The serve's life after a step of it (the supervisor's Runtime.step, with
        gpud.core.serverecord.step)."""
        self._amend(serve, replace(self._records.get(serve, NO_RECORD), life=life))

    def _amend(self, serve: str, rec: ServeRecord) -> None:
        # A serve with no record gets one only for a change that leaves it other than
        # NO_RECORD (nothing known is no record).
        if serve in self._records or rec != NO_RECORD:
            self._records[serve] = rec
