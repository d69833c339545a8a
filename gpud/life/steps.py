"""Carrying out a list of steps (gpud.core.actions), and their undo: one executor for apply
(gpud.life.rebalance) and preemption (gpud.life.sleeping). What a step does is the caller's `do`; here is
only the order, which steps count as done, and how an undo list runs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

from gpud.core.actions import Action
from gpud.errors import GpudError

Do = Callable[[Action], Awaitable[None]]


class Halt(Exception):
    """Raised by an undo to end the undo list there: what follows it depends on it."""


async def carry_out(steps: Iterable[Action], do: Do, done: list[Action], *,
                    count_begun: bool) -> None:
    """Each step in order; the first error ends it (raised). `done` gets each step once it
    began (`count_begun`: a half-done step is undone too, as an apply's, whose steps may have
    changed a serve before they failed) or once it finished (a preemption's: a serve that could
    not be put to sleep is left as it is)."""
    for step in steps:
        if count_begun:
            done.append(step)
        await do(step)
        if not count_begun:
            done.append(step)


async def undo_all(undos: Iterable[Action], do: Do) -> list[tuple[Action, GpudError | None]]:
    """Each undo in order, a failed one not stopping the next; an undo that raises `Halt` ends
    the list. Returns each undo tried with its error (None: done)."""
    tried: list[tuple[Action, GpudError | None]] = []
    for undo in undos:
        try:
            await do(undo)
        except Halt:
            break
        except GpudError as exc:
            tried.append((undo, exc))
        else:
            tried.append((undo, None))
    return tried
