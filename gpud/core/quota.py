"""Token budgets per key (docs/router.md, "Budgets"): keys.NAME.tokens_per_day and
tokens_per_month, prompt + completion tokens as the durable usage counts them (gpud.core.usage),
the day and the month in UTC. Pure: usage rows, budgets and a time in; which keys are past their
budget, and until when, out. gpud decides it when it stores usage rows and renders the answer
into the router's script (gpud.core.routerconf.render_script); the data path compares the time
alone, so a key is let in again at its period's end even before gpud looks again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from gpud.core.usage import Counts, UsageKey, charged_to

DAY_S = 86_400


def day_bounds(now: float) -> tuple[int, int]:
    """The UTC day NOW (a Unix time) falls in: its start and end, Unix times."""
    start = int(now // DAY_S) * DAY_S
    return start, start + DAY_S


def month_bounds(now: float) -> tuple[int, int]:
    """The UTC month NOW falls in: its start and end (the next month's start), Unix times."""
    t = datetime.fromtimestamp(int(now // 1), UTC)
    start = datetime(t.year, t.month, 1, tzinfo=UTC)
    end = (start + timedelta(days=32)).replace(day=1)
    return int(start.timestamp()), int(end.timestamp())


@dataclass(frozen=True, slots=True)
class Budget:
    """A key's budgets in tokens (None: none)."""

    tokens_per_day: int | None = None
    tokens_per_month: int | None = None


@dataclass(frozen=True, slots=True)
class BudgetState:
    """A key's use of its budgets at a time: what `gpuctl usage` shows, what the router is told."""

    key: str
    budget: Budget
    used_day: int
    used_month: int
    day_ends: int
    month_ends: int

    def left(self, period: str) -> int | None:
        limit = self.budget.tokens_per_day if period == "day" else self.budget.tokens_per_month
        used = self.used_day if period == "day" else self.used_month
        return None if limit is None else max(0, limit - used)

    def over(self) -> Over | None:
        """Past a budget (its tokens all used: a budget of 0 lets nothing in): until the end of
        the longest period past, else None."""
        month, day = self.budget.tokens_per_month, self.budget.tokens_per_day
        if month is not None and self.used_month >= month:
            return Over(self.key, self.month_ends, "month", month, self.used_month)
        if day is not None and self.used_day >= day:
            return Over(self.key, self.day_ends, "day", day, self.used_day)
        return None

    def to_json(self) -> dict[str, object]:
        return {"key": self.key,
                "tokens_per_day": self.budget.tokens_per_day, "used_day": self.used_day,
                "left_day": self.left("day"), "day_ends": self.day_ends,
                "tokens_per_month": self.budget.tokens_per_month,
                "used_month": self.used_month, "left_month": self.left("month"),
                "month_ends": self.month_ends}


@dataclass(frozen=True, slots=True, order=True)
class Over:
    """A key past its budget: refused until UNTIL (a Unix time, its period's end). Its USED
    tokens are said, not compared: what the router is told does not change as they grow."""

    key: str
    until: int
    period: str  # "day" or "month"
    limit: int
    used: int = field(compare=False)


def budget_states(rows: Iterable[tuple[UsageKey, Counts]], budgets: Mapping[str, Budget],
                  now: float) -> list[BudgetState]:
    """Each budgeted key's use of this UTC day and month (ROWS: hourly usage rows, an hour
    counted in the day and month of its start; rows of other keys or periods are left out),
    by key."""
    day_start, day_end = day_bounds(now)
    month_start, month_end = month_bounds(now)
    day: dict[str, int] = {}
    month: dict[str, int] = {}
    for k, c in rows:
        # a peer's forwarded requester's row (PEER/NAME) is the peer key's use
        key = charged_to(k.key)
        if key not in budgets or not month_start <= k.hour < month_end:
            continue
        used = c.prompt_tokens + c.completion_tokens
        month[key] = month.get(key, 0) + used
        if day_start <= k.hour < day_end:
            day[key] = day.get(key, 0) + used
    return [BudgetState(name, b, day.get(name, 0), month.get(name, 0), day_end, month_end)
            for name, b in sorted(budgets.items())
            if b.tokens_per_day is not None or b.tokens_per_month is not None]


def over_budget(rows: Iterable[tuple[UsageKey, Counts]], budgets: Mapping[str, Budget],
                now: float) -> tuple[Over, ...]:
    """The keys past a budget at NOW and until when, by key."""
    return tuple(o for s in budget_states(rows, budgets, now) for o in [s.over()]
                 if o is not None)
