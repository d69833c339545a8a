"""Token budgets per key (docs/router.md, "Budgets"): the pure decision (gpud.core.quota) of
which keys are past their tokens_per_day / tokens_per_month and until when, the keys file's
check of the two fields, and what the router's config is told."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from gpud.core.keys import parse_keys
from gpud.core.limits import QUOTA_STATUS
from gpud.core.quota import (
    Budget,
    Over,
    budget_states,
    day_bounds,
    month_bounds,
    over_budget,
)
from gpud.core.router import ROUTED_PATHS, RoutedServe, RouterFront
from gpud.core.routerconf import front_policy, http_lines, render_script
from gpud.core.usage import Counts, UsageKey


def ts(text: str) -> int:
    return int(datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp())


def row(hour: str, key: str, prompt: int, completion: int, model: str = "chat",
        status: int = 200) -> tuple[UsageKey, Counts]:
    return UsageKey(ts(hour), key, model, status), Counts(1, prompt, completion)


NOW = ts("2026-02-27T15:30:00")


def test_the_day_and_the_month_are_utc() -> None:
    assert day_bounds(NOW) == (ts("2026-02-27T00:00:00"), ts("2026-02-28T00:00:00"))
    assert month_bounds(NOW) == (ts("2026-02-01T00:00:00"), ts("2026-03-01T00:00:00"))
    # December's end is January's start of the next year
    assert month_bounds(ts("2026-12-31T23:59:59")) == (ts("2026-12-01T00:00:00"),
                                                       ts("2027-01-01T00:00:00"))
    # the last second of a day is in it, the next one is not
    assert day_bounds(ts("2026-02-27T23:59:59"))[0] == ts("2026-02-27T00:00:00")
    assert day_bounds(ts("2026-02-28T00:00:00"))[0] == ts("2026-02-28T00:00:00")


def test_prompt_and_completion_tokens_of_the_period_count() -> None:
    rows = [row("2026-02-27T09:00:00", "alice", 60, 30),
            row("2026-02-27T15:00:00", "alice", 5, 5, model="ocr", status=400),
            # yesterday: the month's, not the day's
            row("2026-02-26T23:00:00", "alice", 1000, 0),
            # last month: neither
            row("2026-01-31T23:00:00", "alice", 10**6, 0),
            # another key's
            row("2026-02-27T10:00:00", "bob", 10**6, 10**6)]
    states = budget_states(rows, {"alice": Budget(100, 2000), "carol": Budget(None, 5)}, NOW)
    assert [s.to_json() for s in states] == [
        {"key": "alice", "tokens_per_day": 100, "used_day": 100, "left_day": 0,
         "day_ends": ts("2026-02-28T00:00:00"), "tokens_per_month": 2000, "used_month": 1100,
         "left_month": 900, "month_ends": ts("2026-03-01T00:00:00")},
        {"key": "carol", "tokens_per_day": None, "used_day": 0, "left_day": None,
         "day_ends": ts("2026-02-28T00:00:00"), "tokens_per_month": 5, "used_month": 0,
         "left_month": 5, "month_ends": ts("2026-03-01T00:00:00")}]


def test_a_key_is_over_once_its_tokens_are_used_until_the_periods_end() -> None:
    rows = [row("2026-02-27T09:00:00", "alice", 60, 39)]
    # one token left: not over
    assert over_budget(rows, {"alice": Budget(tokens_per_day=100)}, NOW) == ()
    rows.append(row("2026-02-27T10:00:00", "alice", 0, 1))
    assert over_budget(rows, {"alice": Budget(tokens_per_day=100)}, NOW) == (
        Over("alice", ts("2026-02-28T00:00:00"), "day", 100, 100),)
    # the next day the same rows are yesterday's
    assert over_budget(rows, {"alice": Budget(tokens_per_day=100)},
                       ts("2026-02-28T00:00:00")) == ()


def test_past_both_the_month_decides_until_when() -> None:
    rows = [row("2026-02-27T09:00:00", "alice", 500, 500)]
    assert over_budget(rows, {"alice": Budget(100, 1000)}, NOW) == (
        Over("alice", ts("2026-03-01T00:00:00"), "month", 1000, 1000),)
    # past the month's alone (spent on other days)
    rows = [row("2026-02-03T09:00:00", "alice", 1000, 0)]
    assert over_budget(rows, {"alice": Budget(100, 1000)}, NOW) == (
        Over("alice", ts("2026-03-01T00:00:00"), "month", 1000, 1000),)


def test_a_budget_of_zero_lets_nothing_in_and_no_budget_nothing_out() -> None:
    assert over_budget([], {"alice": Budget(tokens_per_day=0)}, NOW) == (
        Over("alice", ts("2026-02-28T00:00:00"), "day", 0, 0),)
    assert over_budget([row("2026-02-27T09:00:00", "alice", 10**9, 10**9)],
                       {"alice": Budget()}, NOW) == ()


KEYS = """
[keys.alice]
token = "sk-alice-0123456789abcdef"
models = ["chat"]
tokens_per_day = 1000
tokens_per_month = 20000

[keys.bob]
token = "sk-bob-0123456789abcdef00"
models = ["*"]
"""


def test_the_budgets_are_read_from_the_keys_file() -> None:
    keys, problems = parse_keys(KEYS, ["chat"])
    assert problems == []
    by = {k.name: k for k in keys}
    assert (by["alice"].tokens_per_day, by["alice"].tokens_per_month) == (1000, 20000)
    assert (by["bob"].tokens_per_day, by["bob"].tokens_per_month) == (None, None)
    keys, problems = parse_keys(KEYS.replace("tokens_per_day = 1000", "tokens_per_day = 0"),
                                ["chat"])
    assert problems == [] and keys[0].tokens_per_day == 0


@pytest.mark.parametrize("value", ["-1", "1.5", '"100"', "true", "1000000000000001"])
def test_a_budget_that_is_not_a_whole_count_is_refused_naming_the_key(value: str) -> None:
    keys, problems = parse_keys(KEYS.replace("tokens_per_month = 20000",
                                             f"tokens_per_month = {value}"), ["chat"])
    assert problems == ["keys.alice.tokens_per_month: an integer from 0 to 1000000000000000 "
                        f"(got {json.loads(value.lower()) if value != '1.5' else 1.5!r})"]
    assert [k.name for k in keys] == ["bob"]


def _router(over: tuple[Over, ...] = ()) -> RouterFront:
    keys, _ = parse_keys(KEYS, ["chat"])
    return RouterFront(listen="127.0.0.1:8000", keys=tuple(keys), over_budget=over,
                       serves=(RoutedServe("chat", ("chat",), port=9001),))


def test_the_router_and_the_fronts_check_the_budget_before_the_body() -> None:
    lines = "\n".join(http_lines(_router()))
    assert "js_set $router_quota router.quota;" in lines
    # in each routed location, after the key's check
    assert lines.count(f"return {QUOTA_STATUS};") == len(ROUTED_PATHS)
    assert f"error_page {QUOTA_STATUS} = @router_quota;" in lines
    assert "add_header Retry-After $router_quota always;" in lines
    server = "\n".join(front_policy(_router(), "chat").server)
    assert f"return {QUOTA_STATUS};" in server and "location @router_quota {" in server
    # no budgets: no check
    keys, _ = parse_keys(KEYS.replace("tokens_per_day = 1000\n", "").replace(
        "tokens_per_month = 20000\n", ""), ["chat"])
    plain = RouterFront(listen="127.0.0.1:8000", keys=tuple(keys),
                        serves=(RoutedServe("chat", ("chat",), port=9001),))
    assert str(QUOTA_STATUS) not in "\n".join(http_lines(plain))
    assert str(QUOTA_STATUS) not in "\n".join(front_policy(plain, "chat").server)


def test_the_script_is_told_who_is_over_until_when() -> None:
    until = ts("2026-02-28T00:00:00")
    text = render_script(_router((Over("alice", until, "day", 1000, 1200),)), "")
    config = json.loads(text.split("var CONFIG = ", 1)[1].rsplit(";", 1)[0])
    assert config["over_budget"] == {"alice": {"until": until, "period": "day", "limit": 1000}}
    text = render_script(_router(), "")
    assert json.loads(text.split("var CONFIG = ", 1)[1].rsplit(";", 1)[0])["over_budget"] == {}


def test_gpuctl_usage_shows_each_budget_and_what_is_left() -> None:
    from gpud.ctl.format import format_usage

    rows = [row("2026-02-27T09:00:00", "alice", 60, 40), row("2026-02-03T09:00:00", "alice", 500, 0)]
    states = budget_states(rows, {"alice": Budget(100, 2000)}, NOW)
    text = format_usage({"since": 0, "rows": [], "budgets": [
        s.to_json() for s in states]})  # type: ignore[misc]
    assert text.splitlines()[-3:] == [
        "KEY    BUDGET            TOKENS  USED  LEFT  RESETS",
        "alice  tokens_per_day       100   100     0  2026-02-28 00:00 UTC (refused until then)",
        "alice  tokens_per_month    2000   600  1400  2026-03-01 00:00 UTC"]


def test_what_the_router_is_told_does_not_change_as_an_over_key_spends_more() -> None:
    budgets = {"alice": Budget(tokens_per_day=100)}
    once = over_budget([row("2026-02-27T09:00:00", "alice", 100, 0)], budgets, NOW)
    more = over_budget([row("2026-02-27T09:00:00", "alice", 100, 50)], budgets, NOW)
    assert once == more and (once[0].used, more[0].used) == (100, 150)


def test_an_hour_counts_in_the_day_and_month_its_start_falls_in() -> None:
    budgets = {"alice": Budget(tokens_per_day=10**6, tokens_per_month=10**6)}
    rows = [row("2026-02-01T00:00:00", "alice", 1, 0),    # the month's first hour
            row("2026-02-27T00:00:00", "alice", 10, 0),   # the day's first hour
            row("2026-02-28T00:00:00", "alice", 100, 0),  # tomorrow's: the month's, not the day's
            row("2026-03-01T00:00:00", "alice", 1000, 0)]  # next month's first hour: neither
    [state] = budget_states(rows, budgets, NOW)
    assert (state.used_day, state.used_month) == (10, 111)


def test_a_key_past_its_budget_has_nothing_left_not_less() -> None:
    [state] = budget_states([row("2026-02-27T09:00:00", "alice", 150, 0)],
                            {"alice": Budget(100, 120)}, NOW)
    assert (state.left("day"), state.left("month")) == (0, 0)
