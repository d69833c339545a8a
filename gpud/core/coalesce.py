"""Repeated refusals, coalesced: one stored event per window, carrying how many it stands for.

Anyone who can reach a fronted on-demand serve can make gpud refuse it, as often as they like
(every request through the front asks gpud to bring the serve up). Stored one by one, those
refusals rotate the whole history out of the store (`daemon.events_keep`): 30 s of alternating
refused requests once wrote 2827 `deny` events. So a refusal of one serve, for one reason (its
key: kind, serve and the reason's class, never its figures, which move with every sample), is
stored when it is the first of its window; the ones after it in the window are only counted;
when the window ends with some counted, one event stands for them (`repeated`: how many), and
the next window opens at once, so a flood that goes on is one event per window. A window that
ends with none counted closes: the next refusal is stored as it comes.

Pure: the caller passes the time in (gpud.service keeps one Coalescer and flushes it on a timer).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final, Generic, TypeVar

# How long one window lasts: a flood stores at most about one event per key per window.
WINDOW_S: Final = 60.0

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class Verdict(StrEnum):
    STORE = "store"  # the first of its window: stored (and logged) as it comes
    COUNT = "count"  # one more like it in the window: counted, stored later as one


@dataclass(frozen=True, slots=True)
class Summary(Generic[K, T]):
    """A window's refusals that were counted and not stored: `count` of them, between `first_ts`
    and `last_ts`, the last one `last` (what the stored summary says)."""

    key: K
    count: int
    first_ts: float
    last_ts: float
    last: T
    window_s: float


@dataclass(slots=True)
class _Window(Generic[T]):
    start: float
    count: int = 0
    first_ts: float = 0.0
    last_ts: float = 0.0
    last: T | None = None


@dataclass(slots=True)
class Coalescer(Generic[K, T]):
    """The open windows, by key. `offer` one refusal; `due` closes the windows that ended."""

    window_s: float = WINDOW_S
    _open: dict[K, _Window[T]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.window_s <= 0:
            raise ValueError("window_s must be positive")

    def offer(self, key: K, item: T, now: float) -> Verdict:
        """STORE the first refusal of `key` in its window (opening one), else COUNT it. Call
        `due(now)` first: a window past its end is still taken as open here."""
        win = self._open.get(key)
        if win is None:
            self._open[key] = _Window(start=now)
            return Verdict.STORE
        if win.count == 0:
            win.first_ts = now
        win.count += 1
        win.last_ts = now
        win.last = item
        return Verdict.COUNT

    def due(self, now: float) -> list[Summary[K, T]]:
        """Close every window that ended by `now`. One that counted refusals gives its Summary
        and opens the next window at once (a flood that goes on stays one event per window);
        one that counted none is forgotten."""
        out: list[Summary[K, T]] = []
        for key, win in list(self._open.items()):
            if now < win.start + self.window_s:
                continue
            if win.count and win.last is not None:
                out.append(Summary(key, win.count, win.first_ts, win.last_ts, win.last,
                                   self.window_s))
                self._open[key] = _Window(start=now)
            else:
                del self._open[key]
        return out

    def next_due(self) -> float | None:
        """When the earliest window with refusals counted ends (None: no summary to come)."""
        ends = [w.start + self.window_s for w in self._open.values() if w.count]
        return min(ends) if ends else None

    def pending(self) -> int:
        """Refusals counted and not yet stored as a summary."""
        return sum(w.count for w in self._open.values())
