"""Figure 2: durable admissions per second and admit latency through the socket, at 1, 16 and 64
concurrent clients, with zero over-commit observed.

Each client holds one keep-alive connection (asyncio, raw HTTP/1.1 over AF_UNIX: no process per
request) and loops: admit an external reservation for its own serve name
(`POST /v1/serves/NAME/admit {"mib": M, "role": R}`), and when admitted release it again. Every
concurrency level has a role of its own whose capacity holds only 3/4 of its clients' demand
(all of it at 1 client), so at 16 and 64 clients admissions race for the last free MiB and some
are denied: that is where an over-commit would show.

Over-commit is looked for three ways: every 200 answer's figures (free >= 0); a sampler reading
GET /v1/ledger every 50 ms during the run (committed <= capacity - reserve, committed = the sum
of the reservations, no role over_committed); and the ledger after each run (nothing left
reserved). Durability: after gpud stops, the admit events in its SQLite store are counted against
the 200 answers the clients got.

The levels are interleaved: every round runs each level once in a shuffled order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import shutil
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import FigureResult, Row, median, pct, spread, start_gpud, temp_dir

LEVELS = (1, 16, 64)
MIB = 1000


def role_of(level: int) -> str:
    return f"bench-c{level}"


def capacity_of(level: int) -> int:
    return max(MIB, level * MIB * 3 // 4)


def config() -> str:
    roles = "".join(f'[roles.{role_of(n)}]\ndevice = "{i}"\ncapacity_mib = {capacity_of(n)}\n'
                    f"reserve_mib = 0\n\n" for i, n in enumerate(LEVELS))
    # Every admit event is counted in the store afterwards: none may be pruned meanwhile.
    return f'[daemon]\nadmission = "ledger"\nevents_keep = 100000000\n\n{roles}'


class Connection:
    """One keep-alive HTTP/1.1 connection over the Unix socket; requests are sent one at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, path: Path) -> Connection:
        reader, writer = await asyncio.open_unix_connection(str(path))
        return cls(reader, writer)

    async def request(self, method: str, target: str, body: Any = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else b""
        head = (f"{method} {target} HTTP/1.1\r\nHost: localhost\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n")
        self.writer.write(head.encode() + data)
        status_line = await self.reader.readline()
        if not status_line:
            raise ConnectionError("gpud closed the connection")
        status = int(status_line.split()[1])
        length = 0
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "content-length":
                length = int(value.strip())
        payload = await self.reader.readexactly(length) if length else b""
        return status, json.loads(payload) if payload else None

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


@dataclass
class LevelRun:
    level: int
    seconds: float = 0.0
    admitted: int = 0
    denied: int = 0
    released: int = 0
    transactions: int = 0  # the store's, during the run: one fsync each
    reads_per_s: float = 0.0  # GET /v1/status by as many clients, right after, same daemon
    errors: list[str] = field(default_factory=list)
    admit_ms: list[float] = field(default_factory=list)
    release_ms: list[float] = field(default_factory=list)
    ledger_samples: int = 0
    violations: list[str] = field(default_factory=list)


async def _client(sock: Path, level: int, index: int, stop_at: float, run: LevelRun) -> None:
    conn = await Connection.open(sock)
    serve, role = f"b{level}-{index}", role_of(level)
    cap = capacity_of(level)
    try:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            status, body = await conn.request("POST", f"/v1/serves/{serve}/admit",
                                              {"mib": MIB, "role": role})
            run.admit_ms.append((time.perf_counter() - t0) * 1000)
            if status == 200:
                run.admitted += 1
                figures = body.get("figures", {})
                if figures.get("free_mib", 0) < 0 or figures.get("committed_mib", 0) > cap:
                    run.violations.append(f"admit answer for {serve}: {figures}")
                t1 = time.perf_counter()
                status, body = await conn.request("POST", f"/v1/serves/{serve}/release",
                                                  {"stop": False})
                run.release_ms.append((time.perf_counter() - t1) * 1000)
                run.released += 1
                if status != 200:
                    run.errors.append(f"release {serve}: {status} {body}")
                    return
            elif status == 409 and body["error"]["code"] == "denied":
                run.denied += 1
            else:
                run.errors.append(f"admit {serve}: {status} {body}")
                return
    finally:
        await conn.close()


def _check_ledger(body: Any, where: str, run: LevelRun, *, expect_empty: bool = False) -> None:
    for role in body["roles"]:
        limit = role["capacity_mib"] - role["reserve_mib"]
        summed = sum(r["mib"] for r in role["reservations"])
        if role["committed_mib"] > limit or role["over_committed"] or role["free_mib"] < 0:
            run.violations.append(f"{where}: role {role['name']} committed {role['committed_mib']}"
                                  f" > {limit} (over_committed={role['over_committed']})")
        if summed != role["committed_mib"]:
            run.violations.append(f"{where}: role {role['name']} reservations sum to {summed}, "
                                  f"committed says {role['committed_mib']}")
        if expect_empty and role["reservations"]:
            run.violations.append(f"{where}: role {role['name']} still holds "
                                  f"{[r['serve'] for r in role['reservations']]}")


async def _sampler(sock: Path, stop: asyncio.Event, run: LevelRun) -> None:
    conn = await Connection.open(sock)
    try:
        while not stop.is_set():
            status, body = await conn.request("GET", "/v1/ledger")
            if status != 200:
                run.errors.append(f"GET /v1/ledger: {status} {body}")
            else:
                run.ledger_samples += 1
                _check_ledger(body, "ledger sample", run)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.05)
    finally:
        await conn.close()


async def _transactions(sock: Path) -> int:
    conn = await Connection.open(sock)
    try:
        _, body = await conn.request("GET", "/v1/status")
        return int(body["store_transactions"])
    finally:
        await conn.close()


async def _reader(sock: Path, stop_at: float, counter: list[int]) -> None:
    conn = await Connection.open(sock)
    try:
        while time.perf_counter() < stop_at:
            status, _ = await conn.request("GET", "/v1/status")
            if status == 200:
                counter[0] += 1
    finally:
        await conn.close()


async def _run_level(sock: Path, level: int, seconds: float) -> LevelRun:
    run = LevelRun(level)
    before = await _transactions(sock)
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sampler(sock, stop, run))
    start = time.perf_counter()
    stop_at = start + seconds
    await asyncio.gather(*(_client(sock, level, i, stop_at, run) for i in range(level)))
    run.seconds = time.perf_counter() - start
    stop.set()
    await sampler
    run.transactions = await _transactions(sock) - before
    # The same daemon's read rate with as many clients, measured right after: the ratio is
    # what durability costs against a request that touches no disk.
    reads = [0]
    start = time.perf_counter()
    await asyncio.gather(*(_reader(sock, start + seconds, reads) for _ in range(level)))
    run.reads_per_s = reads[0] / (time.perf_counter() - start)
    conn = await Connection.open(sock)
    try:
        _, body = await conn.request("GET", "/v1/ledger")
        _check_ledger(body, f"ledger after the {level}-client run", run, expect_empty=True)
    finally:
        await conn.close()
    return run


def _stored_admits(state_dir: Path) -> int | None:
    db = state_dir / "gpud.sqlite3"
    if not db.exists():
        return None
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        row = conn.execute("SELECT count(*) FROM events WHERE kind = 'admit' AND role LIKE 'bench-c%'"
                           ).fetchone()
    return int(row[0])


def _changes(run: LevelRun) -> int:
    """Durable changes answered: every admit, release and denial is one (each is stored)."""
    return run.admitted + run.released + run.denied


def run(quick: bool) -> FigureResult:
    fig = FigureResult("admissions", "durable admissions through the socket")
    rounds, seconds = (1, 1.5) if quick else (3, 4.0)
    tmp = temp_dir("admissions")
    daemon = start_gpud(tmp, config())
    runs: dict[int, list[LevelRun]] = {n: [] for n in LEVELS}
    rng = random.Random(2)
    try:
        for _ in range(rounds):
            order = list(LEVELS)
            rng.shuffle(order)
            for level in order:
                result = asyncio.run(_run_level(daemon.socket, level, seconds))
                runs[level].append(result)
                print(f"  {level:2d} client(s): {result.admitted / result.seconds:7.0f} admits/s, "
                      f"{result.denied / result.seconds:6.0f} denials/s, "
                      f"{_changes(result) / result.seconds / result.reads_per_s:.2f}x reads, "
                      f"{result.transactions / max(1, _changes(result)):.2f} fsyncs/change, "
                      f"{result.ledger_samples} ledger samples", flush=True)
    finally:
        daemon.stop()
    stored = _stored_admits(tmp / "state")
    shutil.rmtree(tmp, ignore_errors=True)

    fig.note(f"{rounds} round(s) x {seconds:g} s per level, levels shuffled per round; {MIB} MiB "
             "external reservations, capacity 3/4 of the demand (all of it at 1 client); "
             "admission = ledger; store on ext4 (/var/tmp), SQLite WAL synchronous=FULL")
    total_admitted = 0
    total_violations: list[str] = []
    for level in LEVELS:
        level_runs = runs[level]
        rates = [r.admitted / r.seconds for r in level_runs]
        denial_rates = [r.denied / r.seconds for r in level_runs]
        admit_ms = [ms for r in level_runs for ms in r.admit_ms]
        release_ms = [ms for r in level_runs for ms in r.release_ms]
        samples = sum(r.ledger_samples for r in level_runs)
        ratios = [_changes(r) / r.seconds / r.reads_per_s for r in level_runs]
        fsyncs = sum(r.transactions for r in level_runs) / max(1, sum(map(_changes, level_runs)))
        violations = [v for r in level_runs for v in r.violations]
        errors = [e for r in level_runs for e in r.errors]
        total_admitted += sum(r.admitted for r in level_runs)
        total_violations += violations
        fig.raw[str(level)] = {"admits_per_s": rates, "denials_per_s": denial_rates,
                               "admit_p50_ms": pct(admit_ms, 50), "admit_p99_ms": pct(admit_ms, 99),
                               "release_p50_ms": pct(release_ms, 50),
                               "release_p99_ms": pct(release_ms, 99),
                               "changes_vs_reads": ratios, "fsyncs_per_change": fsyncs,
                               "ledger_samples": samples, "violations": violations[:20],
                               "errors": errors[:20]}
        fig.note(f"{level:2d} client(s): admits/s {spread(rates, '{:.0f}')}; denials/s "
                 f"{spread(denial_rates, '{:.0f}')}; durable changes (admit, release, deny) "
                 f"per s as a ratio of GET /v1/status per s at the same concurrency "
                 f"{spread(ratios, '{:.2f}')}x; {fsyncs:.3f} store transactions (fsyncs) per "
                 "change")
        fig.note(f"{level:2d} client(s): admit latency p50 {pct(admit_ms, 50):.1f} ms, p99 "
                 f"{pct(admit_ms, 99):.1f} ms (n={len(admit_ms)}); release p50 "
                 f"{pct(release_ms, 50):.1f} ms, p99 {pct(release_ms, 99):.1f} ms; "
                 f"{samples} ledger samples, {len(violations)} over-commit observations")
        for err in errors[:5]:
            fig.problem(f"{level} clients: {err}")
        for v in violations[:5]:
            fig.problem(f"{level} clients: OVER-COMMIT {v}")
        fig.rows.append(Row(
            figure=f"2. admissions, {level} client{'s' if level > 1 else ''}",
            measured=f"{median(rates):.0f}/s, {median(ratios):.2f}x reads, "
                     f"{fsyncs:.2f} fsync/change, p50 {pct(admit_ms, 50):.1f} ms, "
                     f"p99 {pct(admit_ms, 99):.1f} ms",
            target="0 over-commit" + (", >= 0.5x reads" if level == 16 else ""),
            verdict=f"{len(violations)} over-commit ({samples} samples)"
                    + (", ok" if not violations and not errors else ", MISS"),
        ))
    if stored is None:
        fig.problem("the store gpud.sqlite3 was not found after the run: durability not checked")
    else:
        fig.note(f"durability: {stored} admit events in the store after gpud stopped; the clients "
                 f"got {total_admitted} admitted answers")
        if stored != total_admitted:
            fig.problem(f"store holds {stored} admit events but {total_admitted} admissions were "
                        "acknowledged")
    return fig
