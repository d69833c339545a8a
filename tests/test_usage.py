"""Usage per key (gpud.core.usage): counted from the router's access log, hourly rows in the
store, pruned as events are, summed for `gpuctl usage`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpud.config import parse_config
from gpud.core.routerlog import LOG_FIELDS, USAGE_FIELDS, parse_log_line
from gpud.core.usage import Counts, UsageKey, add, hour_of, one, summarize, tokens
from gpud.durable.store import Store
from gpud.nginx.router import RouterLog, log_path


def test_one_request_counts_its_tokens_or_is_unmetered() -> None:
    assert one(12, 5) == Counts(1, 12, 5, 0)
    assert one(None, 5) == Counts(1, 0, 0, 1) and one(12, None) == Counts(1, 0, 0, 1)
    assert one(0, 0) == Counts(1, 0, 0, 0)
    assert Counts(1, 2, 3, 4) + Counts(10, 20, 30, 40) == Counts(11, 22, 33, 44)


@pytest.mark.parametrize(("text", "count"), [
    ("17", 17), ("0", 0), ("", None), ("-", None), ("1.5", None), ("-3", None),
    ("9" * 12, 999_999_999_999), ("9" * 13, None)])
def test_tokens(text: str, count: int | None) -> None:
    assert tokens(text) == count


def test_hours_and_summaries() -> None:
    assert hour_of(7199.9) == 3600 and hour_of(7200) == 7200
    rows = add({}, UsageKey(3600, "alice", "chat", 200), Counts(2, 10, 4, 0))
    rows = add(rows, UsageKey(3600, "alice", "chat", 200), Counts(1, 1, 1, 0))
    rows = add(rows, UsageKey(7200, "alice", "chat", 429), Counts(3, 0, 0, 3))
    rows = add(rows, UsageKey(7200, "bob", "chat", 200), Counts(1, 5, 5, 0))
    assert rows[UsageKey(3600, "alice", "chat", 200)] == Counts(3, 11, 5, 0)
    got = [s.to_json() for s in summarize(rows.items())]
    assert got == [
        {"key": "alice", "model": "chat", "requests": 6, "prompt_tokens": 11,
         "completion_tokens": 5, "total_tokens": 16, "unmetered": 3, "hung_up": 0,
         "statuses": {"200": 3, "429": 3}},
        {"key": "bob", "model": "chat", "requests": 1, "prompt_tokens": 5,
         "completion_tokens": 5, "total_tokens": 10, "unmetered": 0, "hung_up": 0,
         "statuses": {"200": 1}}]


def test_the_store_adds_to_hourly_rows_and_prunes_the_oldest(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    try:
        store.add_usage({UsageKey(3600, "alice", "chat", 200): Counts(2, 10, 4, 0)})
        store.add_usage({UsageKey(3600, "alice", "chat", 200): Counts(1, 1, 1, 1),
                         UsageKey(7200, "bob", "ocr", 503): Counts(1, 0, 0, 1)})
        assert store.usage() == [
            (UsageKey(3600, "alice", "chat", 200), Counts(3, 11, 5, 1)),
            (UsageKey(7200, "bob", "ocr", 503), Counts(1, 0, 0, 1))]
        assert store.usage(since_hour=7200) == [(UsageKey(7200, "bob", "ocr", 503),
                                                 Counts(1, 0, 0, 1))]
        assert [k.key for k, _ in store.usage(key="alice")] == ["alice"]
        assert store.prune_usage(1) == 1
        assert [k.hour for k, _ in store.usage()] == [7200]  # the newest kept
    finally:
        store.close()
    # durable: a new gpud reads them back
    again = Store(tmp_path / "s.db")
    try:
        assert [k.key for k, _ in again.usage()] == ["bob"]
    finally:
        again.close()


def _line(model: str, status: str, key: str, ts: str, prompt: str, completion: str,
          complete: str = "OK") -> str:
    doc = {name: "" for name, _ in LOG_FIELDS}
    doc.update(model=model, serve=model, status=status, request_s="0.010",
               upstream_s="0.009", ensure_s="", sse="")
    doc.update({"key": key, "ts": ts, "prompt_tokens": prompt, "completion_tokens": completion,
                "complete": complete})
    assert set(doc) == {n for n, _ in (*LOG_FIELDS, *USAGE_FIELDS)}
    return json.dumps(doc)


def test_a_line_of_an_older_config_without_usage_still_counts() -> None:
    doc = json.loads(_line("chat", "200", "alice", "7300.5", "3", "4"))
    for name, _ in USAGE_FIELDS:
        del doc[name]
    answered = parse_log_line(json.dumps(doc), {"chat": "chat"})
    assert answered is not None and answered.key == "" and answered.prompt_tokens is None
    assert not answered.hung_up  # not known
    answered = parse_log_line(_line("chat", "429", "alice", "7300.5", "", ""),
                              {"chat": "chat"})
    assert answered is not None and (answered.key, answered.status, answered.ts) == (
        "alice", 429, 7300.5)


CONFIG = """\
[daemon]
front_dir = "{front}"
events_keep = 100
[router]
listen = "127.0.0.1:8000"
[roles.r]
device = "0"
[serves.chat]
role = "r"
vram_mib = 1000
port = 30001
models = ["chat"]
command = ["/bin/chat"]
"""


def test_the_router_log_counts_per_key_and_stores_hourly(tmp_path: Path) -> None:
    cfg = parse_config(CONFIG.format(front=tmp_path / "front"), "t")
    log = Path(log_path(cfg.daemon))
    log.parent.mkdir(parents=True)
    store = Store(tmp_path / "s.db")
    try:
        router_log = RouterLog(lambda: cfg, store, clock=lambda: 7300.0)
        log.write_text("\n".join([
            _line("chat", "200", "alice", "7300.1", "12", "5"),
            _line("chat", "200", "alice", "7301.1", "", ""),      # a stream without usage
            _line("chat", "429", "alice", "7302.1", "", ""),      # past its limit
            _line("chat", "200", "bob", "3700.0", "1", "1"),      # an hour before
            _line("nope", "404", "bob", "7303.0", "", ""),        # a name not in the table
        ]) + "\n")
        router_log.read()
        assert router_log.by_key[("alice", "chat", "2xx")] == Counts(2, 12, 5, 1)
        assert router_log.by_key[("alice", "chat", "4xx")] == Counts(1, 0, 0, 1)
        assert router_log.by_key[("bob", "", "4xx")] == Counts(1, 0, 0, 1)
        router_log.flush()
        assert router_log.pending == {}
        rows = dict(store.usage())
        assert rows[UsageKey(7200, "alice", "chat", 200)] == Counts(2, 12, 5, 1)
        assert rows[UsageKey(3600, "bob", "chat", 200)] == Counts(1, 1, 1, 0)
        # read and flushed again: added to, not replaced
        with log.open("a") as f:
            f.write(_line("chat", "200", "alice", "7304.0", "8", "2") + "\n")
        router_log.read()
        router_log.flush()
        assert dict(store.usage())[UsageKey(7200, "alice", "chat", 200)] == Counts(3, 20, 7, 1)
    finally:
        store.close()


def _requests(store: Store) -> int:
    return sum(c.requests for _, c in store.usage())


def test_usage_is_counted_once_across_a_crash_and_while_gpud_is_down(tmp_path: Path) -> None:
    cfg = parse_config(CONFIG.format(front=tmp_path / "front"), "t")
    log = Path(log_path(cfg.daemon))
    log.parent.mkdir(parents=True)
    log.write_text(_line("chat", "200", "old", "7000.0", "1", "1") + "\n")  # before gpud
    store = Store(tmp_path / "s.db")

    def write(n: int, at: float, partial: str = "") -> None:
        with log.open("a") as f:
            f.writelines(_line("chat", "200", "alice", f"{at + i}", "3", "2") + "\n"
                         for i in range(n))
            f.write(partial)

    try:
        first = RouterLog(lambda: cfg, store, clock=lambda: 7300.0)
        write(5, 7300.0)
        first.read()
        first.flush()
        # read, not flushed, then killed (-9: nothing more of it runs); then lines written
        # while gpud is down, the last one cut in the middle
        write(4, 7310.0)
        first.read()
        del first
        line = _line("chat", "200", "alice", "7330.0", "3", "2")
        write(3, 7320.0, partial=line[:40])
        second = RouterLog(lambda: cfg, store, clock=lambda: 7400.0)
        second.read()
        second.flush()
        assert _requests(store) == 12  # the line before gpud skipped; none twice, none lost
        with log.open("a") as f:
            f.write(line[40:] + "\n")
        second.read()
        second.flush()
        third = RouterLog(lambda: cfg, store, clock=lambda: 7400.0)  # a restart
        third.read()
        third.flush()
        assert _requests(store) == 13
        assert dict(store.usage())[UsageKey(7200, "alice", "chat", 200)] == Counts(13, 39, 26)
        # the log replaced while gpud was down (rotated): the new one counted from its start
        log.write_text(_line("chat", "200", "bob", "7500.0", "1", "1") + "\n")
        fourth = RouterLog(lambda: cfg, store, clock=lambda: 7500.0)
        fourth.read()
        fourth.flush()
        assert _requests(store) == 14
    finally:
        store.close()


def test_usage_not_stored_is_kept_for_the_next_flush(tmp_path: Path) -> None:
    cfg = parse_config(CONFIG.format(front=tmp_path / "front"), "t")
    store = Store(tmp_path / "s.db")
    router_log = RouterLog(lambda: cfg, store, clock=lambda: 7300.0)
    router_log.pending = {UsageKey(7200, "alice", "chat", 200): Counts(1, 2, 3, 0)}
    store.close()  # the store fails now
    router_log.flush()
    assert router_log.pending == {UsageKey(7200, "alice", "chat", 200): Counts(1, 2, 3, 0)}


def test_gpuctl_usage_prints_a_row_per_key_and_model() -> None:
    from gpud.ctl.format import format_usage
    doc = {"since": 0, "rows": [
        {"key": "alice", "model": "chat", "requests": 120, "prompt_tokens": 48211,
         "completion_tokens": 20113, "total_tokens": 68324, "unmetered": 2, "hung_up": 0,
         "statuses": {"200": 118, "429": 2}},
        {"key": "", "model": "", "requests": 1, "prompt_tokens": 0, "completion_tokens": 0,
         "total_tokens": 0, "unmetered": 1, "hung_up": 0, "statuses": {"401": 1}}]}
    lines = format_usage(doc).splitlines()  # type: ignore[arg-type]
    assert lines[0].split() == ["KEY", "MODEL", "REQUESTS", "PROMPT", "COMPLETION", "TOTAL",
                                "UNMETERED", "HUNG", "UP", "STATUSES"]
    assert lines[1].split() == ["alice", "chat", "120", "48211", "20113", "68324", "2", "0",
                                "200:118", "429:2"]
    assert lines[2].split() == ["-", "-", "1", "0", "0", "0", "1", "0", "401:1"]
    assert "no usage" in format_usage({"since": 0, "rows": []})


def test_prometheus_counts_usage_by_key(tmp_path: Path) -> None:
    import subprocess

    from gpud.life.service import LedgerService
    from gpud.server.metrics import render
    from tests.test_metrics import promtool, text_samples

    text = CONFIG.format(front=tmp_path / "front").replace(
        'device = "0"\n', 'device = "0"\ncapacity_mib = 2000\nreserve_mib = 0\n')
    cfg = parse_config(text, "t")
    log = Path(log_path(cfg.daemon))
    log.parent.mkdir(parents=True)
    store = Store(tmp_path / "s.db")
    svc = LedgerService(cfg, store, config_text=text)
    try:
        svc.load()
        router_log = RouterLog(lambda: svc.config, store)
        log.write_text("\n".join([
            _line("chat", "200", "alice", "7300.1", "12", "5"),
            _line("chat", "200", "alice", "7301.1", "", ""),
            _line("chat", "429", "alice", "7302.1", "", ""),
            _line("chat", "200", "bob", "7303.0", "1", "2")]) + "\n")
        router_log.read()
        exposed = render(svc, None, router_log=router_log)
    finally:
        svc.close()
        store.close()
    got = text_samples(exposed, ("gpud_router_key_",))
    assert got[("gpud_router_key_requests_total", (("code", "2xx"), ("key", "alice"),
                                                   ("model", "chat")))] == 2
    assert got[("gpud_router_key_requests_total", (("code", "4xx"), ("key", "alice"),
                                                   ("model", "chat")))] == 1
    assert got[("gpud_router_key_tokens_total", (("key", "alice"), ("kind", "prompt"),
                                                 ("model", "chat")))] == 12
    assert got[("gpud_router_key_tokens_total", (("key", "bob"), ("kind", "completion"),
                                                 ("model", "chat")))] == 2
    assert got[("gpud_router_key_unmetered_total", (("key", "alice"), ("model", "chat")))] == 2
    result = subprocess.run([promtool(), "check", "metrics"], input=exposed.encode(),
                            capture_output=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
