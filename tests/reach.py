"""Drive a serve's recorded state the way gpud's adapters do: by reporting what happened
(gpud.core.serverecord decides the state), never by naming it."""

from __future__ import annotations

from gpud.core.serverecord import Happened
from gpud.core.vocab import RUNNING, STARTING, EventKind, ServeState
from gpud.life.service import LedgerService

# What the supervisor reports of an admitted serve on its way to each state.
_LAUNCHED = (EventKind.START, Happened.LAUNCHED)
_HEALTHY = (EventKind.HEALTHY, Happened.HEALTHY)
_WAY: dict[ServeState, tuple[tuple[EventKind, Happened], ...]] = {
    STARTING: (_LAUNCHED,),
    RUNNING: (_LAUNCHED, _HEALTHY),
}


async def report(svc: LedgerService, serve: str, kind: EventKind, happened: Happened,
                 reason: str | None = None) -> None:
    """Store an event of `kind` for `serve` with what happened to it, as the supervisor does."""
    await svc.store_event(svc.event(kind, f"{serve}: {happened}", serve=serve),
                          report=svc.report(serve, happened, reason))


async def admitted_to(svc: LedgerService, serve: str, mib: int, state: ServeState) -> None:
    """Admit `serve` and report its launch (and health, and sleep) until it is `state`."""
    await svc.admit(serve, mib)
    for kind, happened in _WAY[state]:
        await report(svc, serve, kind, happened)
