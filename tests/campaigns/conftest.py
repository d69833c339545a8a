"""Shared machinery of the "prove it holds" campaigns.

A campaign drives a REAL gpud (tests.conftest.start_gpud, or gpud under real systemd in the
sandbox) with many clients, checks invariants while it runs, and checks the end state against a
replay of what was acknowledged, done with the pure ledger core (gpud.core.ledger.Ledger).

Each campaign has a short form in the default run and a long form marked ``slow``
(``python3 -m pytest -m slow tests/campaigns``), sized by the GPUD_CAMPAIGN_* variables
(README.md beside this file).
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import random
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gpud.core.ledger import Denial, Ledger, Reservation, RoleBudget
from tests.conftest import UnixHTTPConnection

SEED = int(os.environ.get("GPUD_CAMPAIGN_SEED", "0")) or random.SystemRandom().randrange(1, 2**31)


def knob(name: str, default: int) -> int:
    """A long-form size: GPUD_CAMPAIGN_<NAME>, else the default."""
    value = os.environ.get(f"GPUD_CAMPAIGN_{name}")
    return int(value) if value else default


def rng(salt: str) -> random.Random:
    """A seeded generator; the seed is printed in every failure message (GPUD_CAMPAIGN_SEED)."""
    return random.Random(f"{SEED}:{salt}")


def seed_note() -> str:
    return f"(rerun with GPUD_CAMPAIGN_SEED={SEED})"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The seed of this run's campaigns, pass or fail: a run that only fails later (CI's next
    run, on another seed) can still be compared with this one."""
    terminalreporter.write_line(f"campaign seed: GPUD_CAMPAIGN_SEED={SEED}")


# ---- a client that keeps its connection and measures each call ---------------------------------


class Client:
    """One keep-alive connection to gpud's Unix socket (a new one after any transport error)."""

    def __init__(self, sock: str | Path, timeout: float = 30) -> None:
        self.sock = str(sock)
        self.timeout = timeout
        self.conn: UnixHTTPConnection | None = None

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """(status, parsed JSON body). Raises OSError (or http.client errors) on transport
        failure, after dropping the connection."""
        import http.client

        if self.conn is None:
            self.conn = UnixHTTPConnection(self.sock, timeout=self.timeout)
        data = json.dumps(body).encode() if body is not None else None
        try:
            self.conn.request(method, path, body=data,
                              headers={"Content-Type": "application/json"} if data else {})
            resp = self.conn.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException):
            self.close()
            raise
        if resp.getheader("Connection", "").lower() == "close":
            self.close()
        return resp.status, (json.loads(raw) if raw else None)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


# ---- operations and their acknowledgements ----------------------------------------------------


@dataclass
class Op:
    """One client operation: what was asked, when, and what came back (if anything)."""

    kind: str                 # admit | release | bad-admit | start | stop
    serve: str
    mib: int | None = None
    role: str | None = None
    t_send: float = 0.0
    t_reply: float | None = None
    status: int | None = None  # None: no reply (transport error, daemon killed)
    body: Any = None

    @property
    def acked(self) -> bool:
        return self.status is not None


class MibSource:
    """Unique MiB figures for the whole campaign, so that every admit (and the release of what it
    reserved) is matched to exactly one stored event."""

    def __init__(self, r: random.Random, low: int, high: int) -> None:
        values = list(range(low, high))
        r.shuffle(values)
        self._it: Iterator[int] = iter(values)
        self._lock = threading.Lock()

    def next(self) -> int:
        with self._lock:
            return next(self._it)


# ---- the store, read directly ------------------------------------------------------------------


@dataclass
class StoreDump:
    events: list[dict[str, Any]]
    reservations: dict[str, tuple[str, int]]
    states: dict[str, str]
    integrity: str


def read_store(state_dir: Path) -> StoreDump:
    """Everything in gpud's SQLite store, read with a connection of our own (gpud stopped or
    running: WAL lets a reader in)."""
    db = sqlite3.connect(state_dir / "gpud.sqlite3", timeout=30)
    try:
        integrity = db.execute("PRAGMA integrity_check").fetchone()[0]
        events = [
            {"id": r[0], "ts": r[1], "kind": r[2], "serve": r[3], "role": r[4], "mib": r[5],
             "uid": r[6], "details": json.loads(r[7])}
            for r in db.execute("SELECT id, ts, kind, serve, role, mib, uid, details FROM events "
                                "ORDER BY id")
        ]
        # A serve on several roles is one row per role: read back as one entry, its roles
        # joined with '+'. Rows of one serve that disagree on MiB (a half-written reservation)
        # read as MiB -1, which no replay holds.
        rows: dict[str, tuple[list[str], set[int]]] = {}
        for serve, role, mib in db.execute(
                "SELECT serve, role, mib FROM reservations ORDER BY serve, position"):
            roles, mibs = rows.setdefault(serve, ([], set()))
            roles.append(role)
            mibs.add(mib)
        reservations = {serve: ("+".join(roles), mibs.pop() if len(mibs) == 1 else -1)
                        for serve, (roles, mibs) in rows.items()}
        states = dict(db.execute("SELECT serve, state FROM serve_states").fetchall())
    finally:
        db.close()
    return StoreDump(events, reservations, states, integrity)


# ---- replay with the pure core -----------------------------------------------------------------


@dataclass
class Replay:
    ledger: Ledger
    # fingerprint of the reservations after each ledger-changing event, in event order
    states: list[frozenset[tuple[str, str, int]]] = field(default_factory=list)
    event_index: dict[int, int] = field(default_factory=dict)  # event id -> position in states
    problems: list[str] = field(default_factory=list)


def fingerprint(reservations: dict[str, tuple[str, int]]) -> frozenset[tuple[str, str, int]]:
    return frozenset((serve, role, mib) for serve, (role, mib) in reservations.items())


def role_key(res: Reservation) -> str:
    """A reservation's roles as one key: the role, or (a serve on several) them joined by '+'."""
    return "+".join(res.all_roles)


def replay(events: list[dict[str, Any]], budgets: list[RoleBudget]) -> Replay:
    """Replay the stored admit / deny / release / sleep events, in commit order, on the pure Ledger:
    every admit must be admitted there too with the same figures, every deny denied with the
    same free figure, every release must release what was held."""
    ledger = Ledger.build(budgets, [])
    out = Replay(ledger, [fingerprint({})])
    for ev in events:
        kind, serve, role, mib, det = ev["kind"], ev["serve"], ev["role"], ev["mib"], ev["details"]
        # A serve on several roles: its events name the first in `role`, all in details.roles.
        roles = tuple(det.get("roles") or (role,))
        if kind == "admit" and det.get("adopted"):
            # a running unit found at boot keeps its memory, fitting or not
            held = {**ledger.reservations,
                    serve: Reservation(serve, roles[0], mib, ev["ts"], None, False, roles[1:])}
            ledger = Ledger.build(ledger.roles.values(), held.values())
        elif kind == "deny" and det.get("bound") in ("held", "device"):
            # Not a ledger decision: admissions held on the role (a serve disagreeing with the
            # ledger, the invariant) or its device lost; the ledger is unchanged and gives no
            # free figure.
            continue
        elif kind in ("admit", "deny"):
            outcome = ledger.decide(serve, roles, mib, since=ev["ts"], by_uid=ev["uid"])
            if kind == "admit":
                if isinstance(outcome, Denial):
                    out.problems.append(f"event {ev['id']}: {serve} {mib} MiB admitted by gpud, "
                                        f"but the replay denies it: {outcome.reason}")
                    continue
                ledger, admission = outcome
                if (det.get("free_mib"), det.get("committed_mib")) != (
                        admission.figures.free_mib, admission.figures.committed_mib):
                    out.problems.append(
                        f"event {ev['id']}: admit {serve} {mib}: gpud said free "
                        f"{det.get('free_mib')} committed {det.get('committed_mib')}, replay "
                        f"{admission.figures.free_mib} {admission.figures.committed_mib}")
            else:
                if not isinstance(outcome, Denial):
                    out.problems.append(f"event {ev['id']}: {serve} {mib} MiB denied by gpud, but "
                                        f"the replay admits it")
                elif det.get("free_mib") != outcome.free_mib:
                    out.problems.append(f"event {ev['id']}: deny {serve}: gpud free "
                                        f"{det.get('free_mib')}, replay {outcome.free_mib}")
                continue
        elif kind == "sleep":
            # a serve put to sleep: its reservation shrinks, on the ledger bound alone
            held = ledger.reservations.get(serve)
            if held is None or held.role != role or mib > held.mib:
                out.problems.append(f"event {ev['id']}: {serve} asleep at {mib} MiB on {role}, "
                                    f"but the replay holds {held}")
                continue
            shrunk = {**ledger.reservations, serve: Reservation(serve, role, mib, held.since,
                                                                extra_roles=held.extra_roles)}
            ledger = Ledger.build(ledger.roles.values(), shrunk.values())
            figures = ledger.figures(role)
            if (det.get("free_mib"), det.get("committed_mib")) != (figures.free_mib,
                                                                   figures.committed_mib):
                out.problems.append(f"event {ev['id']}: sleep {serve} {mib}: gpud said free "
                                    f"{det.get('free_mib')}, replay {figures.free_mib}")
        elif kind == "release":
            held = ledger.reservations.get(serve)
            if held is None or (held.role, held.mib) != (role, mib):
                out.problems.append(f"event {ev['id']}: release of {serve} {mib} MiB on {role}, "
                                    f"but the replay holds {held}")
                continue
            ledger, _ = ledger.release(serve)
        else:
            continue
        out.event_index[ev["id"]] = len(out.states)
        out.states.append(fingerprint({s: (role_key(r), r.mib)
                                       for s, r in ledger.reservations.items()}))
    out.ledger = ledger
    return out


def ledger_reservations(ledger_json: dict[str, Any]) -> dict[str, tuple[str, int]]:
    """serve -> (roles key, MiB) from /v1/ledger; a serve on several roles is listed under each
    and must be listed under every one of its roles with the same MiB (else MiB -1)."""
    out: dict[str, tuple[str, int]] = {}
    seen: dict[str, list[tuple[str, int]]] = {}
    for role in ledger_json["roles"]:
        for r in role["reservations"]:
            key = "+".join(r.get("roles") or [r["role"]])
            seen.setdefault(r["serve"], []).append((role["name"], r["mib"]))
            out[r["serve"]] = (key, r["mib"])
    for serve, (key, mib) in out.items():
        listed = seen[serve]
        if sorted(name for name, _ in listed) != sorted(key.split("+")) or \
                any(m != mib for _, m in listed):
            out[serve] = (key, -1)
    return out


def replay_reservations(rep: Replay) -> dict[str, tuple[str, int]]:
    return {s: (role_key(r), r.mib) for s, r in rep.ledger.reservations.items()}


def check_ledger_figures(ledger_json: dict[str, Any]) -> list[str]:
    """The invariants of one /v1/ledger answer: committed never exceeds capacity - reserve,
    and every figure is the arithmetic of the reservations it lists."""
    problems = []
    for role in ledger_json["roles"]:
        committed = sum(r["mib"] for r in role["reservations"])
        cap, reserve = role["capacity_mib"], role["reserve_mib"]
        if role["committed_mib"] != committed:
            problems.append(f"{role['name']}: committed {role['committed_mib']} != sum {committed}")
        if role["free_mib"] != cap - reserve - role["committed_mib"]:
            problems.append(f"{role['name']}: free {role['free_mib']} != {cap}-{reserve}-"
                            f"{role['committed_mib']}")
        if role["committed_mib"] > cap - reserve:
            problems.append(f"{role['name']}: committed {role['committed_mib']} > capacity "
                            f"{cap} - reserve {reserve}")
        if any(r["role"] != role["name"] for r in role["reservations"]):
            problems.append(f"{role['name']}: lists a reservation of another role")
    return problems


def match_acks(ops: list[Op], events: list[dict[str, Any]]) -> tuple[dict[int, int], list[str]]:
    """Match every acknowledged admit / deny / release to its one stored event (MiB figures are
    unique in a campaign). Returns op index -> event id, and the problems: an acknowledged
    operation without its event, or an event answered differently than it was stored."""
    by_key: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for ev in events:
        if ev["kind"] in ("admit", "deny", "release") and ev["mib"] is not None:
            by_key.setdefault((ev["kind"], ev["serve"], ev["mib"]), []).append(ev)
    problems = [f"{len(v)} {k[0]} events for {k[1]} {k[2]} MiB (figures are unique)"
                for k, v in by_key.items() if len(v) > 1 and k[0] != "release"]
    matched: dict[int, int] = {}
    for i, op in enumerate(ops):
        if not op.acked:
            continue
        key: tuple[str, str, int] | None = None
        if op.kind == "admit" and op.status == 200:
            key = ("admit", op.serve, op.mib or 0)
        elif op.kind == "admit" and op.status == 409:
            key = ("deny", op.serve, op.mib or 0)
        elif op.kind == "release" and op.status == 200:
            key = ("release", op.serve, op.body["released_mib"])
        if key is None:
            continue
        found = by_key.get(key)
        if not found:
            problems.append(f"acknowledged {op.kind} {op.serve} {op.mib} ({op.status}) has no "
                            f"stored {key[0]} event")
            continue
        matched[i] = found[-1]["id"]
    return matched, problems


def check_real_time_order(ops: list[Op], matched: dict[int, int]) -> list[str]:
    """Linearizability of the commit order: an operation acknowledged before another was sent
    must have been committed before it."""
    pairs = sorted((matched[i], ops[i]) for i in matched)
    problems = []
    min_reply = float("inf")
    min_id = -1
    for ev_id, op in reversed(pairs):
        if min_reply < op.t_send:
            problems.append(f"event {ev_id} ({op.kind} {op.serve}) was sent after an operation "
                            f"acknowledged earlier (event {min_id}) yet committed before it")
            if len(problems) > 5:
                break
        assert op.t_reply is not None
        if op.t_reply < min_reply:
            min_reply, min_id = op.t_reply, ev_id
    return problems


class Sampler(threading.Thread):
    """Reads /v1/ledger over and over while a campaign runs; each snapshot must satisfy the
    figures' invariants and (checked afterwards) be one of the replay's states, in order."""

    def __init__(self, sock: str | Path, interval: float = 0.005) -> None:
        super().__init__(daemon=True, name="ledger-sampler")
        self.sock = sock
        self.interval = interval
        self.halt = threading.Event()
        self.snapshots: list[frozenset[tuple[str, str, int]]] = []
        self.problems: list[str] = []
        self.errors = 0

    def run(self) -> None:
        client = Client(self.sock, timeout=10)
        while not self.halt.is_set():
            try:
                status, body = client.request("GET", "/v1/ledger")
            except OSError:
                self.errors += 1
                time.sleep(0.05)
                continue
            if status != 200:
                self.problems.append(f"GET /v1/ledger answered {status}: {body}")
            else:
                self.problems.extend(check_ledger_figures(body))
                self.snapshots.append(fingerprint(ledger_reservations(body)))
            self.halt.wait(self.interval)
        client.close()

    def stop(self) -> None:
        self.halt.set()
        self.join(30)

    def check_against(self, rep: Replay) -> list[str]:
        """Every snapshot is a state the replay passed through, and they come in commit order."""
        where: dict[frozenset[tuple[str, str, int]], list[int]] = {}
        for i, st in enumerate(rep.states):
            where.setdefault(st, []).append(i)
        problems = []
        last = 0
        for n, snap in enumerate(self.snapshots):
            positions = where.get(snap)
            if not positions:
                problems.append(f"snapshot {n} is no state of the replay: {sorted(snap)[:5]}...")
                break
            k = bisect.bisect_left(positions, last)
            if k == len(positions):
                problems.append(f"snapshot {n} went back in time (state {positions[-1]} after "
                                f"{last})")
                break
            last = positions[k]
        return problems


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def connect_raw(sock: str | Path, timeout: float = 5) -> socket.socket:
    """A connected Unix socket; waits (bounded) while the listen backlog is full."""
    deadline = time.monotonic() + timeout
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        try:
            s.connect(str(sock))
            return s
        except BlockingIOError:
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
        except BaseException:
            s.close()
            raise


def chunks(seq: list[Any], n: int) -> list[list[Any]]:
    it = iter(seq)
    return [list(itertools.islice(it, n)) for _ in range((len(seq) + n - 1) // n)]


@pytest.fixture(scope="session")
def campaign_sandbox() -> Iterator[Any]:
    """A disposable systemd sandbox of the campaigns' own (tools/sandbox.py), powered off at the
    end of the session whatever happened."""
    from tests.integration.conftest import booted_sandbox

    yield from booted_sandbox("gpud-campaign")


def invariant_violations(metrics_text: bytes | str) -> int:
    """gpud_invariant_violations_total from a /metrics answer (gpud's own evaluation of the
    invariant after every commit)."""
    text = metrics_text.decode() if isinstance(metrics_text, bytes) else metrics_text
    for line in text.splitlines():
        if line.startswith("gpud_invariant_violations_total "):
            return int(float(line.split()[1]))
    raise AssertionError("no gpud_invariant_violations_total in /metrics")


def invariant_events(events: list[dict[str, Any]]) -> list[str]:
    """What gpud's stored `invariant` events said (none while the invariant holds)."""
    return [e["message"] for e in events if e["kind"] == "invariant"]

