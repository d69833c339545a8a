"""A change that any number of waiters await together, with no polling.

`fire` says that something a waiter reads may have changed; `until(holds)` returns once `holds()`
is true, looking again only after a fire. The waiters of one change share one future: a waiter
cancelled (its request gone, its timeout over) leaves it, and the others, as they were.

`Wakeups`: one Pulse per serve, fired by the changes that name a serve sharing one of its roles
(devices), so that a change wakes the waiters of the serves it can concern, not every waiter.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Protocol


class Pulse:
    def __init__(self) -> None:
        self._next: asyncio.Future[None] | None = None
        # How many times a waiter looked (`holds` asked): what the tests count.
        self.looks = 0
        # How many times it fired: a waiter that read this before it looked (`next(since=)`)
        # hears a fire that came while it was busy elsewhere.
        self.fired = 0

    def fire(self) -> None:
        """Something may have changed: every waiter looks again."""
        self.fired += 1
        fut, self._next = self._next, None
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def until(self, holds: Callable[[], bool]) -> None:
        """Return once `holds()` is true (at once if it is now)."""
        while True:
            self.looks += 1
            if holds():
                return
            if self._next is None:
                self._next = asyncio.get_running_loop().create_future()
            # shielded: a waiter cancelled must not cancel the future the others await
            await asyncio.shield(self._next)

    async def next(self, since: int | None = None) -> None:
        """Return at the next fire (a waiter that decided what it waits for: a change); SINCE:
        `fired` as read before the waiter looked: at once when it fired since then (a change
        that came while the waiter was awaiting something else is not lost)."""
        self.looks += 1
        if since is not None and since != self.fired:
            return
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._next)


class HasRoles(Protocol):
    @property
    def all_roles(self) -> tuple[str, ...]: ...


class Wakeups:
    """Each serve's own Pulse (`of`), and `any`, fired on every change (a waiter that reads
    every serve: the idle check). SERVES: the serves as configured now, each with the roles it
    holds memory on (its devices).

    `fire(named)`: a change of the serves NAMED (its state stored, its life stepped, its drain
    ended, its count of requests in flight read): the pulses of the serves that share a role
    with one of them are fired (the memory freed or taken there, a victim settling), and no
    other; a change that names no serve, or one not configured (gone at a reload), fires every
    pulse. `wake(serve)` fires one serve's pulse alone. The cost of a change is the number of
    serves on its roles, whatever the number of waiters elsewhere."""

    def __init__(self, serves: Callable[[], Mapping[str, HasRoles]]) -> None:
        self._serves = serves
        self.any = Pulse()
        self._pulses: dict[str, Pulse] = {}
        # role -> the serves on it, for the serves as last read (built again when they change)
        self._indexed: Mapping[str, HasRoles] | None = None
        self._by_role: dict[str, tuple[str, ...]] = {}

    @property
    def looks(self) -> int:
        """How many times a waiter looked, on any of the pulses (what the tests count)."""
        return self.any.looks + sum(p.looks for p in self._pulses.values())

    def of(self, serve: str) -> Pulse:
        """SERVE's own pulse: what a waiter for SERVE awaits."""
        pulse = self._pulses.get(serve)
        if pulse is None:
            pulse = self._pulses[serve] = Pulse()
        return pulse

    async def next(self) -> None:
        """Return at the next change, whatever it names (`any`)."""
        await self.any.next()

    def roles(self, serves: Iterable[str]) -> frozenset[str] | None:
        """The roles SERVES hold memory on; None when one is not configured."""
        config = self._serves()
        out: set[str] = set()
        for serve in serves:
            spec = config.get(serve)
            if spec is None:
                return None
            out.update(spec.all_roles)
        return frozenset(out)

    def fire(self, named: Collection[str] | None = None) -> frozenset[str] | None:
        """A change of the serves NAMED (None: of anything): see the class. The roles it
        concerned (None: every pulse was fired)."""
        self.any.fire()
        roles = None if named is None else self.roles(named)
        if roles is None:
            for pulse in list(self._pulses.values()):
                pulse.fire()
            return None
        config = self._serves()
        if config is not self._indexed:
            by_role: dict[str, list[str]] = {}
            for serve, spec in config.items():
                for role in spec.all_roles:
                    by_role.setdefault(role, []).append(serve)
            self._by_role = {r: tuple(s) for r, s in by_role.items()}
            self._indexed = config
        woken: set[str] = set()
        for role in roles:
            for serve in self._by_role.get(role, ()):
                if serve not in woken:
                    woken.add(serve)
                    self.wake(serve)
        return roles

    def wake(self, serve: str) -> None:
        """Fire SERVE's pulse alone (a change of the queue that makes it act: its turn)."""
        pulse = self._pulses.get(serve)
        if pulse is not None:
            pulse.fire()
