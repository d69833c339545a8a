"""Campaigns under real systemd (the disposable sandbox of tools/sandbox.py): concurrency with
real serve units, security with real users, and faults (a full state directory, the system bus
restarted under gpud, a serve that ignores SIGTERM).

Short forms in the default run (they skip where the sandbox cannot boot: not root, no systemd);
long form: ``python3 -m pytest -m slow tests/campaigns -k sandbox`` (GPUD_CAMPAIGN_SANDBOX_OPS,
GPUD_CAMPAIGN_CLIENTS).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gpud.core.ledger import RoleBudget
from tests.campaigns.conftest import (
    Client,
    MibSource,
    Op,
    Sampler,
    check_ledger_figures,
    check_real_time_order,
    invariant_events,
    invariant_violations,
    knob,
    ledger_reservations,
    match_acks,
    replay,
    replay_reservations,
    rng,
    seed_note,
)
from tests.integration.gpudctl import SandboxGpud, sim_config, standin

pytestmark = pytest.mark.sandbox

DARK_FAST = '[roles.dark-fast]\ndevice = "GPU-sim-0"\nreserve_mib = 7168\n'
DB = "/var/lib/gpud/gpud.sqlite3"


@pytest.fixture
def gpud(campaign_sandbox: Any) -> Iterator[SandboxGpud]:
    ctl = SandboxGpud(campaign_sandbox)
    yield ctl
    ctl.reset()


STORE_DUMP = r"""
import json, sqlite3, sys
db = sqlite3.connect(sys.argv[1], timeout=30)
print(json.dumps({
    "integrity": db.execute("PRAGMA integrity_check").fetchone()[0],
    # one row per (serve, role): a serve on several roles joined with '+' (MiB -1 if they differ)
    "reservations": {r[0]: [r[1], r[2] if r[2] == r[3] else -1] for r in db.execute(
        "SELECT serve, group_concat(role, '+'), min(mib), max(mib) FROM (SELECT * FROM "
        "reservations ORDER BY serve, position) GROUP BY serve")},
    "states": dict(db.execute("SELECT serve, state FROM serve_states").fetchall()),
    "events": [{"id": r[0], "ts": r[1], "kind": r[2], "serve": r[3], "role": r[4], "mib": r[5],
                "uid": r[6], "details": json.loads(r[7]), "message": r[8]}
               for r in db.execute("SELECT id, ts, kind, serve, role, mib, uid, details, message "
                                   "FROM events ORDER BY id")],
}))
"""


def sandbox_store(gpud: SandboxGpud) -> dict[str, Any]:
    """integrity_check, reservations, states and events of the store inside the sandbox, read
    there by a connection of our own."""
    out = json.loads(gpud.sb.run([sys.executable, "-c", STORE_DUMP, DB], timeout=60).stdout)
    out["reservations"] = {k: (v[0], v[1]) for k, v in out["reservations"].items()}
    return dict(out)


# ---- 1. concurrency with real units ------------------------------------------------------------

SANDBOX_ROLES = {"dark-fast": ("GPU-sim-0", 32607, 7168), "other": ("GPU-sim-1", 24000, 0)}
UNIT_SERVES: dict[str, tuple[str | tuple[str, ...], int, int]] = {
    f"u{i}": ("dark-fast" if i % 2 else "other", 1000 + 500 * i, 30100 + i) for i in range(6)}
# A serve on both devices: its unit sees both, its start holds both, it is reserved on both.
UNIT_SERVES["tp0"] = (("dark-fast", "other"), 2000, 30110)
# States in which a serve's unit runs (and it holds a reservation).
UNIT_STATES = ("starting", "running", "sleeping")
SANDBOX_EXTERNAL = ["ext0", "ext1", "ext2", "ext3"]


def sandbox_concurrency_config() -> str:
    roles = "".join(f'[roles.{n}]\ndevice = "{d}"\ncapacity_mib = {c}\nreserve_mib = {r}\n'
                    for n, (d, c, r) in SANDBOX_ROLES.items())
    serves = "".join(
        f'[serves.{n}]\n'
        + (f'role = "{role}"' if isinstance(role, str) else f"roles = {json.dumps(role)}")
        + f"\nvram_mib = {mib}\nport = {port}\nrestart_sec = 0.2\n"
        f"stop_timeout_s = 5\ncommand = {standin('--enable-sleep-mode')}\n"
        # every serve sleeps (level 2: no host RAM needed), the larger ones first in
        # priority: their starts with preempt put smaller ones to sleep
        f"sleep_level = 2\nsleep_mib = 300\npriority = {10 * (len(UNIT_SERVES) - i)}\n"
        # on their ports, dev routes open to everyone: the campaign's outside wakes and sleeps
        "front = false\n"
        'environment = { VLLM_SERVER_DEV_MODE = "1" }\n'
        for i, (n, (role, mib, port)) in enumerate(UNIT_SERVES.items()))
    # ledger admission: the stand-ins really draw (simulated) memory, and the replay on the
    # pure ledger checks the ledger bound
    return sim_config(roles, serves, devices=2, daemon='admission = "ledger"\n'
                                                      "memory_return_timeout_s = 5\n")


def sandbox_next_op(r: Any, mibs: MibSource) -> Op:
    roll = r.random()
    if roll < 0.1:
        return Op(r.choice(["sleep", "wake"]), r.choice(list(UNIT_SERVES)))
    if roll < 0.2:
        # the largest serves come first in priority: they have serves to preempt
        return Op("start-preempt", r.choice(list(UNIT_SERVES)[-2:]))
    if roll < 0.3:
        return Op("start", r.choice(list(UNIT_SERVES)))
    if roll < 0.35:
        return Op("stop", r.choice(list(UNIT_SERVES)))
    if roll < 0.7:
        serve = r.choice(SANDBOX_EXTERNAL)
        return Op("admit", serve, mibs.next(), "dark-fast" if serve in ("ext0", "ext1") else "other")
    return Op("release", r.choice(SANDBOX_EXTERNAL + list(UNIT_SERVES)))


def sandbox_perform(client: Client, op: Op) -> None:
    body: dict[str, Any] = {}
    if op.kind == "admit":
        body = {"mib": op.mib, "role": op.role}
    action = op.kind
    if op.kind == "start-preempt":
        action, body = "start", {"preempt": True}
    op.t_send = time.monotonic()
    try:
        op.status, op.body = client.request("POST", f"/v1/serves/{op.serve}/{action}", body)
    except OSError as exc:
        op.body = repr(exc)
        return
    op.t_reply = time.monotonic()


SANDBOX_EXPECTED = {"start": {200, 409}, "stop": {200, 409}, "admit": {200, 409},
                    "release": {200, 404, 409}, "sleep": {200, 409}, "wake": {200, 409},
                    "start-preempt": {200, 409}}


def sleep_problems(events: list[dict[str, Any]]) -> list[str]:
    """No serve put to sleep twice: between two sleeps of a serve it woke, or its reservation
    went (stopped, failed)."""
    problems = []
    asleep: dict[str, int] = {}
    for ev in events:
        serve = ev["serve"]
        if ev["kind"] == "sleep" and not ev["details"].get("wake_failed"):
            if serve in asleep:
                problems.append(f"event {ev['id']}: {serve} put to sleep again, asleep since "
                                f"event {asleep[serve]}")
            asleep[serve] = ev["id"]
        elif ev["kind"] in ("wake", "release") or (ev["kind"] == "admit"
                                                   and ev["details"].get("adopted")):
            asleep.pop(serve, None)
    return problems


def events_named(events: list[dict[str, Any]], problems: str) -> str:
    """The stored events of every serve PROBLEMS names, a line each: what a failed campaign
    prints, so that the sequence that broke a rule can be read without the store."""
    named = {ev["serve"] for ev in events if ev["serve"] and f"{ev['serve']} " in problems}
    return "\n".join(f"event {ev['id']} {ev['kind']} {ev['serve']}: {ev['message'][:200]} "
                     f"{json.dumps(ev['details'], sort_keys=True)[:300]}"
                     for ev in events if ev["serve"] in named)


def settle(client: Client, serve: str, timeout: float = 30) -> None:
    """Wait (bounded) until SERVE is neither being launched nor stopped."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, body = client.request("GET", f"/v1/serves/{serve}")
        if status == 200 and body["state"] not in ("admitted", "starting", "stopping"):
            return
        time.sleep(0.05)


def preempt_next_op(r: Any, _mibs: MibSource) -> Op:
    """Preemption's own mix: the serves only, on roles the fixed external reservations leave
    tight, so that starts with preempt put others to sleep while they are started, stopped,
    put to sleep and woken by other clients."""
    roll = r.random()
    kind = ("start-preempt" if roll < 0.35 else "stop" if roll < 0.55 else "sleep"
            if roll < 0.75 else "wake" if roll < 0.85 else "outside-wake" if roll < 0.9
            else "outside-sleep" if roll < 0.93 else "start")
    return Op(kind, r.choice(list(UNIT_SERVES)))


def outside_perform(gpud: SandboxGpud, op: Op) -> None:
    """The world acting behind gpud's back: a local user with no gpud group wakes or puts to
    sleep a serve straight on its port (vLLM's dev endpoints have no authentication)."""
    port = UNIT_SERVES[op.serve][2]
    path = "/wake_up" if op.kind == "outside-wake" else "/sleep?level=2"
    op.t_send = time.monotonic()
    out = gpud.sb.run(["curl", "-s", "-m", "10", "-o", "/dev/null", "-w", "%{http_code}", "-X",
                       "POST", f"http://127.0.0.1:{port}{path}"], user="nobody", check=False)
    op.status = int(out.stdout.strip() or 0)  # 0: nothing listens (not running)
    op.t_reply = time.monotonic()


def reconciled(gpud: SandboxGpud, timeout: float = 30) -> list[str]:
    """Wait (bounded) until every serve gpud shows running or sleeping is so by its own
    word; what still disagrees at the end."""
    deadline = time.monotonic() + timeout
    disagree: list[str] = []
    while time.monotonic() < deadline:
        disagree = []
        for s in gpud.get("/v1/serves")["serves"]:
            if s["name"] not in UNIT_SERVES or s["state"] not in ("running", "sleeping"):
                continue
            port = UNIT_SERVES[s["name"]][2]
            out = gpud.sb.run(["curl", "-s", "-m", "5", f"http://127.0.0.1:{port}/is_sleeping"],
                              check=False).stdout
            said = '"is_sleeping": true' in out or '"is_sleeping":true' in out
            if said != (s["state"] == "sleeping"):
                disagree.append(f"{s['name']}: gpud says {s['state']}, it says {out!r}")
        if not disagree:
            return []
        time.sleep(0.2)
    return disagree


# What preemption's mix leaves of each role: dark-fast 3439 MiB free for u1, u3, u5 (7500
# MiB), other 5000 MiB for u0, u2, u4 (6000 MiB).
PREEMPT_EXTERNAL = (("ext0", "dark-fast", 22_000), ("ext2", "other", 19_000))


def run_sandbox_concurrency(gpud: SandboxGpud, clients: int, ops_per_client: int, *,
                            racy: bool, preempt: bool = False) -> dict[str, Any]:
    """RACY: start and stop of one serve race freely. Otherwise the clients take a per-serve
    lock around a start and the wait for it to settle, so a stop never overtakes a launch in
    flight (test_stop_or_release_during_launch pins that race, a known bug). PREEMPT: the
    preemption mix (preempt_next_op)."""
    gpud.configure(sandbox_concurrency_config())
    # external reservations: unique figures (each matched to its one event), of a size that
    # fits now and then
    mibs = MibSource(rng("sandbox-mib"), 1, 30_000)
    per_client: list[list[Op]] = [[] for _ in range(clients)]
    next_op = preempt_next_op if preempt else sandbox_next_op
    if preempt:
        prelude = Client(gpud.socket, timeout=30)
        for serve, role, mib in PREEMPT_EXTERNAL:
            op = Op("admit", serve, mib, role)
            sandbox_perform(prelude, op)
            assert op.status == 200, op.body
            per_client[0].append(op)
        # One preemption for certain before the random mix (whose own may happen or not):
        # u1 (priority 60) runs on dark-fast, and u3 (priority 40) fits only with u1 asleep.
        for op in (Op("start", "u1"), Op("start-preempt", "u3")):
            sandbox_perform(prelude, op)
            assert op.status == 200, op.body
            settle(prelude, op.serve)
            per_client[0].append(op)
        prelude.close()
    sampler = Sampler(gpud.socket, interval=0.02)
    barrier = threading.Barrier(clients)
    serve_locks = {name: threading.Lock() for name in UNIT_SERVES}

    def worker(n: int) -> None:
        r = rng(f"sandbox-{n}")
        client = Client(gpud.socket, timeout=120)
        barrier.wait()
        for _ in range(ops_per_client):
            op = next_op(r, mibs)
            if op.kind.startswith("outside-"):
                outside_perform(gpud, op)
            elif op.serve in serve_locks and not racy:
                with serve_locks[op.serve]:
                    sandbox_perform(client, op)
                    if op.kind in ("start", "start-preempt") and op.status == 200:
                        settle(client, op.serve)
            else:
                sandbox_perform(client, op)
            per_client[n].append(op)
        client.close()

    threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(clients)]
    t0 = time.monotonic()
    sampler.start()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(3000)
        elapsed = time.monotonic() - t0
        # let the launches in flight settle: nothing left `starting`
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            states = {s["name"]: s["state"] for s in gpud.get("/v1/serves")["serves"]}
            if not any(st in ("starting", "stopping") for st in states.values()):
                break
            time.sleep(0.2)
    finally:
        sampler.stop()
    ops = [op for per in per_client for op in per]
    problems: list[str] = reconciled(gpud)[:5] if preempt else []
    problems += [f"no reply to {op.kind} {op.serve}: {op.body}" for op in ops if not op.acked][:5]
    problems += [f"{op.kind} {op.serve}: {op.status} {op.body}" for op in ops
                 if op.acked and not op.kind.startswith("outside-")
                 and op.status not in SANDBOX_EXPECTED[op.kind]][:5]
    # gpud's own evaluation of the invariant after every commit found nothing either
    counted = invariant_violations(gpud.call("GET", "/metrics").raw)
    if counted:
        problems.append(f"gpud_invariant_violations_total is {counted}")
    ledger = gpud.get("/v1/ledger")
    serves = {s["name"]: s for s in gpud.get("/v1/serves")["serves"]}
    units = gpud.serve_units()
    store = sandbox_store(gpud)
    budgets = [RoleBudget(n, d, c, r) for n, (d, c, r) in SANDBOX_ROLES.items()]
    rep = replay(store["events"], budgets)
    problems += rep.problems[:10]
    problems += sleep_problems(store["events"])[:10]
    problems += invariant_events(store["events"])[:5]
    # the external reservations' operations carry unique figures: each is matched to its event,
    # and nothing else touched them
    ext_ops = [op for op in ops if op.serve in SANDBOX_EXTERNAL]
    matched, ack_problems = match_acks(
        ext_ops, [e for e in store["events"] if e["serve"] in SANDBOX_EXTERNAL])
    problems += ack_problems[:10]
    ext_events = [e for e in store["events"] if e["serve"] in SANDBOX_EXTERNAL
                  and e["kind"] in ("admit", "deny", "release")]
    if len(ext_events) != len(matched):
        problems.append(f"{len(ext_events)} events of external reservations, {len(matched)} "
                        "acknowledged operations")
    problems += check_real_time_order(ext_ops, matched)
    problems += sampler.problems[:10]
    problems += sampler.check_against(rep)
    problems += check_ledger_figures(ledger)
    if ledger_reservations(ledger) != replay_reservations(rep):
        problems.append("final /v1/ledger differs from the replay of the stored events")
    if store["reservations"] != replay_reservations(rep):
        problems.append("the store's reservations differ from the replay")
    if store["integrity"] != "ok":
        problems.append(f"integrity_check: {store['integrity']}")
    # units and states agree: a unit runs iff its serve is running, and holds a reservation
    live = {u.removeprefix("gpud-serve-").removesuffix(".service") for u in units}
    for name in UNIT_SERVES:
        state = serves[name]["state"]
        history = ", ".join([f"{e['kind']}({e['mib']})" for e in store["events"]
                             if e["serve"] == name][-8:])
        if (name in live) != (state in ("running", "sleeping")):
            problems.append(f"{name}: state {state}, unit {'active' if name in live else 'gone'}; "
                            f"its last events: {history}")
        if name in live and serves[name]["reserved_mib"] is None:
            problems.append(f"{name}: a unit runs ({state}) without a reservation; its last "
                            f"events: {history}")
    for name in live - set(UNIT_SERVES):
        problems.append(f"unit of unknown serve {name}")
    for unit in units:
        pids = gpud.sb.run(["systemctl", "show", "-p", "MainPID", "--value", unit]).stdout.strip()
        procs = gpud.sb.run(f"systemd-cgls --no-pager -u {unit} | grep -c standin || true").stdout
        if pids in ("", "0") or int(procs.strip() or 0) < 1:
            problems.append(f"{unit}: MainPID {pids}, {procs.strip()} stand-in processes")
    assert not problems, "\n".join(problems) + "\n" + seed_note() + "\n" + gpud.journal_tail(30)
    summary = {"clients": clients, "ops": len(ops), "seconds": round(elapsed, 1),
               "starts_ok": sum(op.kind in ("start", "start-preempt") and op.status == 200
                                for op in ops),
               "stops_ok": sum(op.kind == "stop" and op.status == 200 for op in ops),
               "two_device_starts_ok": sum(op.kind == "start" and op.status == 200
                                           and op.serve == "tp0" for op in ops),
               "admits_ok": sum(op.kind == "admit" and op.status == 200 for op in ops),
               "slept": sum(op.kind == "sleep" and op.status == 200 for op in ops),
               "woken": sum(op.kind == "wake" and op.status == 200 for op in ops),
               "preempted": sum(e["kind"] == "preempt" for e in store["events"]),
               "denied": sum(op.kind in ("admit", "start") and op.status == 409
                             and op.body["error"]["code"] == "denied" for op in ops),
               "outside": sum(op.kind.startswith("outside-") and op.status == 200
                              for op in ops),
               "snapshots": len(sampler.snapshots), "units_at_end": len(units), "violations": 0,
               "invariant_violations_total": counted}
    print(f"sandbox concurrency campaign: {summary} {seed_note()}")
    assert summary["starts_ok"] and summary["stops_ok"], summary
    if preempt:
        assert summary["preempted"], summary  # the prelude's one at least
    return summary


def test_sandbox_concurrency_short(gpud: SandboxGpud) -> None:
    run_sandbox_concurrency(gpud, clients=8, ops_per_client=20, racy=False)


def test_sandbox_preemption_concurrency_short(gpud: SandboxGpud) -> None:
    run_sandbox_concurrency(gpud, clients=8, ops_per_client=25, racy=False, preempt=True)


@pytest.mark.slow
def test_sandbox_preemption_concurrency_long(gpud: SandboxGpud) -> None:
    clients = max(16, knob("CLIENTS", 32))
    total = knob("SANDBOX_OPS", 5_000)
    run_sandbox_concurrency(gpud, clients=clients, ops_per_client=max(1, -(-total // clients)),
                            racy=False, preempt=True)


@pytest.mark.slow
def test_sandbox_concurrency_long(gpud: SandboxGpud) -> None:
    clients = max(64, knob("CLIENTS", 64))
    total = knob("SANDBOX_OPS", 10_000)
    # GPUD_CAMPAIGN_RACE=1 lets a stop overtake a launch in flight: fails until that bug is
    # fixed (test_stop_or_release_during_launch)
    run_sandbox_concurrency(gpud, clients=clients, ops_per_client=max(1, -(-total // clients)),
                            racy=bool(knob("RACE", 0)))


@pytest.mark.parametrize("action", ["stop", "release"])
def test_stop_or_release_during_launch(gpud: SandboxGpud, action: str) -> None:
    serves = (f'[serves.slow]\nrole = "dark-fast"\nvram_mib = 1000\nport = 30121\n'
              f'command = {standin("--startup-delay", "2")}\n'
              f'[serves.queued]\nrole = "dark-fast"\nvram_mib = 1000\nport = 30122\n'
              f"command = {standin()}\n"
              f'[serves.after]\nrole = "dark-fast"\nvram_mib = 1000\nport = 30123\n'
              f"command = {standin()}\n")
    gpud.configure(sim_config(DARK_FAST, serves))
    assert gpud.call("POST", "/v1/serves/slow/start", {}).status == 200
    # queued waits behind slow's health check (starts are serialized per device) ...
    assert gpud.call("POST", "/v1/serves/queued/start", {}).status == 200
    # ... and is stopped (or released: refused, or it must not run) while it waits
    reply = gpud.call("POST", f"/v1/serves/queued/{action}", {})
    assert reply.status in (200, 409), reply.body
    gpud.wait_state("slow", "running")
    # Starts on a device take their turns in order: once a serve started after slow is running,
    # queued's launch, had it gone on, has had its turn (its unit started, and healthy).
    assert gpud.call("POST", "/v1/serves/after/start", {}).status == 200
    gpud.wait_state("after", "running")
    queued = gpud.serve("queued")
    active = "gpud-serve-queued.service" in gpud.serve_units()
    held = queued["reserved_mib"] is not None
    assert (active, held) in ((False, False), (True, True)), (
        f"after its {action} ({reply.status}): unit {'active' if active else 'gone'}, state "
        f"{queued['state']}, reserved {queued['reserved_mib']}")
    if action == "stop":
        assert not active


# ---- 2. security with real users --------------------------------------------------------------

USERS = {"camp-outsider": "", "camp-reader": "gpud", "camp-admin": "gpud,gpud-admin"}
# POST routes that compute and change nothing (gpud/server/api.py registers them as reads)
READ_ONLY_POSTS = {"/v1/plan"}
# the query of a read that needs one
READ_QUERIES = {"/v1/route": "?model=ocr"}


def as_user(gpud: SandboxGpud, user: str, method: str, path: str,
            body: dict[str, Any] | None = None) -> tuple[int, Any]:
    """curl as USER inside the sandbox: (HTTP status, parsed body); status 0 when the socket
    could not even be opened."""
    argv = ["curl", "-s", "-w", "\n%{http_code}", "--unix-socket", "/run/gpud/gpud.sock",
            "-X", method, f"http://localhost{path}"]
    if body is not None:
        argv += ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
    out = gpud.sb.run(argv, user=user, check=False, timeout=30).stdout
    text, _, code = out.rpartition("\n")
    try:
        parsed = json.loads(text) if text else None
    except ValueError:
        parsed = text
    return int(code or 0), parsed


def make_users(gpud: SandboxGpud) -> None:
    for user, groups in USERS.items():
        gpud.sb.run(f"id -u {user} >/dev/null 2>&1 || useradd -M -s /usr/sbin/nologin "
                    + (f"-G {groups} " if groups else "") + user)


def test_security_readers_and_admins(gpud: SandboxGpud) -> None:
    serves = f'[serves.ocr]\nrole = "dark-fast"\nvram_mib = 1000\nport = 30131\ncommand = {standin()}\n'
    gpud.configure(sim_config(DARK_FAST, serves))
    make_users(gpud)
    sock = gpud.sb.host_path("/run/gpud/gpud.sock").stat()
    assert stat.S_ISSOCK(sock.st_mode) and stat.S_IMODE(sock.st_mode) == 0o660
    gid = int(gpud.sb.run(["getent", "group", "gpud"]).stdout.split(":")[2])
    assert (sock.st_uid, sock.st_gid) == (0, gid)

    # outside group gpud: the socket does not even open
    status, _ = as_user(gpud, "camp-outsider", "GET", "/v1/ledger")
    assert status == 0

    doc = gpud.get("/v1/openapi.json")
    reads = [p for p, item in doc["paths"].items() if "get" in item]
    posts = [p.replace("{name}", "ocr") for p, item in doc["paths"].items() if "post" in item]
    assert {"/v1/serves/ocr/admit", "/v1/serves/ocr/release", "/v1/serves/ocr/start",
            "/v1/reload"} <= set(posts)
    before = gpud.get("/v1/ledger")
    events_before = len(gpud.events())
    for path in reads:
        # a read that needs a query gets one (which host takes a model: the model's name)
        query = READ_QUERIES.get(path, "")
        status, body = as_user(gpud, "camp-reader", "GET", path.replace("{name}", "ocr") + query)
        assert status == 200, (path, body)
    for path in posts:
        for body in ({}, {"mib": 100, "role": "dark-fast"}, {"stop": True}):
            status, reply = as_user(gpud, "camp-reader", "POST", path, body)
            if path in READ_ONLY_POSTS:
                assert status < 500 and status != 403, (path, status, reply)
                continue
            assert status == 403, (path, status, reply)
            assert reply["error"]["code"] == "forbidden" and set(reply["error"]) == {
                "code", "message", "details"}
    assert gpud.get("/v1/ledger") == before
    assert len(gpud.events()) == events_before  # a refused mutation leaves nothing behind
    assert "gpud-serve-ocr.service" not in gpud.serve_units()

    # a member of gpud-admin may change the ledger
    status, reply = as_user(gpud, "camp-admin", "POST", "/v1/serves/sidecar/admit",
                            {"mib": 300, "role": "dark-fast"})
    assert status == 200, reply
    admits = gpud.events(kind="admit", serve="sidecar")
    uid = int(gpud.sb.run(["id", "-u", "camp-admin"]).stdout)
    assert admits[-1]["uid"] == uid  # by whom: the peer's uid
    status, reply = as_user(gpud, "camp-admin", "POST", "/v1/serves/sidecar/release", {})
    assert status == 200, reply
    status, reply = as_user(gpud, "camp-admin", "POST", "/v1/serves/ocr/start", {})
    assert status == 200, reply
    gpud.wait_state("ocr", "running")
    status, reply = as_user(gpud, "camp-admin", "POST", "/v1/serves/ocr/stop", {})
    assert status == 200, reply


def test_state_dir_not_readable_outside_group_gpud(gpud: SandboxGpud) -> None:
    """Found by this campaign (fixed with StateDirectoryMode=0750 and UMask=0027): the state
    directory was 0755 and the SQLite files 0644, so a user outside group gpud, who cannot open
    the 0660 socket, read the whole ledger and event log from /var/lib/gpud."""
    gpud.configure(sim_config(DARK_FAST, ""))
    make_users(gpud)
    assert gpud.call("POST", "/v1/serves/secret/admit", {"mib": 100, "role": "dark-fast"}).status == 200
    modes = gpud.sb.run("stat -c '%a %U:%G %n' /var/lib/gpud /var/lib/gpud/*").stdout
    read = gpud.sb.run(["head", "-c", "16", DB], user="camp-outsider", check=False)
    mode = os.stat(gpud.sb.host_path("/var/lib/gpud")).st_mode
    assert not mode & (stat.S_IROTH | stat.S_IWOTH | stat.S_IXOTH), modes
    assert gpud.sb.run(["head", "-c", "16", DB], check=False).returncode == 0  # root reads
    assert read.returncode != 0, f"a user outside group gpud read {DB}:\n{modes}"


# ---- 3. faults ---------------------------------------------------------------------------------


def fill(gpud: SandboxGpud) -> None:
    gpud.sb.run("dd if=/dev/zero of=/var/lib/gpud/filler bs=4k 2>/dev/null; sync", check=False)


@pytest.fixture
def small_state_dir(gpud: SandboxGpud) -> Iterator[SandboxGpud]:
    """A 1 MiB tmpfs mounted over /var/lib/gpud inside the sandbox, for the run of one test."""
    yield gpud
    gpud.sb.run("systemctl stop gpud.service; umount /var/lib/gpud", check=False)


def mount_small_state_dir(gpud: SandboxGpud, config: str) -> None:
    gpud.configure(config, start=False)
    gpud.sb.run("mkdir -p /var/lib/gpud && mount -t tmpfs -o size=1m,mode=0700 gpud-full "
                "/var/lib/gpud")
    gpud.start()


def test_state_dir_full(small_state_dir: SandboxGpud) -> None:
    gpud = small_state_dir
    serves = f'[serves.b]\nrole = "dark-fast"\nvram_mib = 1000\nport = 30141\ncommand = {standin()}\n'
    mount_small_state_dir(gpud, sim_config(DARK_FAST, serves))
    for i in range(3):
        assert gpud.call("POST", f"/v1/serves/x{i}/admit", {"mib": 100 + i, "role": "dark-fast"}).status == 200
    before = gpud.get("/v1/ledger")
    fill(gpud)
    refusals = [gpud.call("POST", f"/v1/serves/x{i}/admit", {"mib": 200 + i, "role": "dark-fast"})
                for i in range(2, 8)]
    refusals.append(gpud.call("POST", "/v1/serves/x0/release", {}))
    refusals.append(gpud.call("POST", "/v1/serves/b/start", {}))
    for reply in refusals:
        assert reply.status == 500, reply.body
        assert reply.body["error"]["code"] == "store-failed"
        assert "full" in reply.body["error"]["message"], reply.body
    # alive, answering, nothing changed, nothing launched
    assert gpud.get("/v1/status")["ready"] is True
    assert gpud.get("/v1/ledger") == before
    assert gpud.serve_units() == []
    # space back: mutations work again
    gpud.sb.run("rm -f /var/lib/gpud/filler")
    ok = gpud.call("POST", "/v1/serves/x5/admit", {"mib": 500, "role": "dark-fast"})
    assert ok.status == 200, ok.body
    assert gpud.call("POST", "/v1/serves/x0/release", {}).status == 200
    expected = ledger_reservations(gpud.get("/v1/ledger"))
    gpud.sb.run(["systemctl", "restart", "gpud.service"], timeout=60)
    assert ledger_reservations(gpud.get("/v1/ledger")) == expected
    assert sandbox_store(gpud)["integrity"] == "ok"
    assert expected == {"x1": ("dark-fast", 101), "x2": ("dark-fast", 102),
                        "x5": ("dark-fast", 500)}


def test_health_checks_survive_a_store_failure(small_state_dir: SandboxGpud) -> None:
    gpud = small_state_dir
    serves = (f'[serves.h1]\nrole = "dark-fast"\nvram_mib = 1000\nport = 30151\nresident = false\n'
              f'restart = "no"\ncommand = {standin("--unhealthy-after", "2")}\n'
              f'[serves.h2]\nrole = "dark-fast"\nvram_mib = 1000\nport = 30152\n'
              f'restart = "no"\ncommand = {standin("--unhealthy-after", "2")}\n')
    mount_small_state_dir(gpud, sim_config(DARK_FAST, serves, daemon="health_failures = 2\n"))
    assert gpud.call("POST", "/v1/serves/h1/start", {}).status == 200
    gpud.wait_state("h1", "running")
    fill(gpud)
    # h1 turns unhealthy while nothing can be stored: marking it failed cannot be committed
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "store" not in gpud.journal_tail(5):
        time.sleep(0.2)
    gpud.sb.run("rm -f /var/lib/gpud/filler")
    assert gpud.call("POST", "/v1/serves/h2/start", {}).status == 200
    gpud.wait_state("h2", "running")
    # h2 turns unhealthy 2 s after it started; two failed checks 0.5 s apart later it is failed
    gpud.wait_state("h2", "failed", timeout=6)


def test_system_bus_restarted_under_gpud(gpud: SandboxGpud) -> None:
    serves = (f'[serves.a]\nrole = "dark-fast"\nvram_mib = 1000\nport = 30161\nrestart_sec = 0.2\n'
              f"command = {standin()}\n"
              f'[serves.b]\nrole = "dark-fast"\nvram_mib = 1000\nport = 30162\ncommand = {standin()}\n')
    gpud.configure(sim_config(DARK_FAST, serves))
    assert gpud.call("POST", "/v1/serves/a/start", {}).status == 200
    gpud.wait_state("a", "running")
    gpud.sb.run(["systemctl", "restart", "dbus.service"], timeout=60)
    # launching comes back (a 503 `unavailable` while gpud reconnects is allowed)
    deadline = time.monotonic() + 30
    while True:
        reply = gpud.call("POST", "/v1/serves/b/start", {})
        if reply.status == 200:
            break
        assert reply.status == 503 and reply.body["error"]["code"] == "unavailable", reply.body
        assert time.monotonic() < deadline, "launching did not come back after the bus restart"
        time.sleep(0.5)
    gpud.wait_state("b", "running")
    assert gpud.get("/v1/status")["launching"]["available"] is True
    # the unit watch came back too: a serve killed after the bus restart is noticed
    pid = gpud.unit_prop("gpud-serve-a.service", "MainPID")
    gpud.sb.run(["kill", "-9", pid])
    gpud.wait_event("restart", serve="a")
    gpud.wait_state("a", "running")
    for name in ("a", "b"):
        assert gpud.call("POST", f"/v1/serves/{name}/stop", {}).status == 200
    assert gpud.serve_units() == []


def test_serve_ignoring_sigterm_is_stopped(gpud: SandboxGpud) -> None:
    serves = (f'[serves.stubborn]\nrole = "dark-fast"\nvram_mib = 1000\nport = 30171\n'
              f'stop_timeout_s = 1.5\ncommand = {standin("--ignore-sigterm", "--draw-in-child")}\n')
    gpud.configure(sim_config(DARK_FAST, serves))
    assert gpud.call("POST", "/v1/serves/stubborn/start", {}).status == 200
    gpud.wait_state("stubborn", "running")
    pid = gpud.unit_prop("gpud-serve-stubborn.service", "MainPID")
    t0 = time.monotonic()
    reply = gpud.call("POST", "/v1/serves/stubborn/stop", {})
    took = time.monotonic() - t0
    assert reply.status == 200, reply.body
    assert 1.4 <= took < 1.5 + 15 + 5, took  # SIGTERM ignored: SIGKILL after TimeoutStopSec
    assert reply.body["state"] == "declared" and reply.body["reserved_mib"] is None
    assert gpud.serve_units() == []
    gone = gpud.sb.run(["kill", "-0", pid], check=False)
    assert gone.returncode != 0, "the serve's main process outlived its stop"
    left = gpud.sb.run("pgrep -f '[g]pud.standin.*30171' || true").stdout.split()
    assert left == [], f"processes of the serve left behind (KillMode=mixed): {left}"
    assert gpud.get("/v1/ledger")["roles"][0]["committed_mib"] == 0



# ---- 4. crash consistency under systemd: no orphaned or duplicated units -----------------------


def wait_gpud_ready(gpud: SandboxGpud, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if gpud.call("GET", "/v1/status").body.get("ready"):
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError("gpud not ready after its restart:\n" + gpud.journal_tail())


def settled_serves(gpud: SandboxGpud, timeout: float = 40) -> dict[str, dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        serves = {s["name"]: s for s in gpud.get("/v1/serves")["serves"]}
        if not any(s["state"] in ("starting", "stopping") and s["name"] in UNIT_SERVES
                   for s in serves.values()):
            return serves
        if time.monotonic() > deadline:
            return serves
        time.sleep(0.2)


def units_problems(gpud: SandboxGpud, cycle: int) -> list[str]:
    """After a restart: every unit belongs to a serve that holds a reservation and says it runs;
    every serve that says it runs has its unit; one stand-in process per unit, none outside."""
    problems = []
    serves = settled_serves(gpud)
    units = gpud.serve_units()
    live = {u.removeprefix("gpud-serve-").removesuffix(".service") for u in units}
    for name in UNIT_SERVES:
        s = serves[name]
        if name in live and (s["state"] not in UNIT_STATES or s["reserved_mib"] is None):
            problems.append(f"kill {cycle}: orphaned unit of {name}: state {s['state']}, "
                            f"reserved {s['reserved_mib']}")
        if name not in live and s["state"] in UNIT_STATES:
            problems.append(f"kill {cycle}: {name} says {s['state']} but has no unit")
    standins = gpud.sb.run("pgrep -f '[g]pud.standin' || true").stdout.split()
    if len(standins) != len(units):
        problems.append(f"kill {cycle}: {len(standins)} stand-in processes for {len(units)} units")
    return problems


def run_sandbox_crash(gpud: SandboxGpud, kills: int, clients: int) -> dict[str, Any]:
    gpud.configure(sandbox_concurrency_config())
    r = rng("sandbox-crash")
    mibs = MibSource(rng("sandbox-crash-mib"), 1, 60_000)
    serve_locks = {name: threading.Lock() for name in UNIT_SERVES}
    ops: list[Op] = []
    lock = threading.Lock()
    problems: list[str] = []
    budgets = [RoleBudget(n, d, c, res) for n, (d, c, res) in SANDBOX_ROLES.items()]

    def worker(n: int, halt: threading.Event) -> None:
        wr = rng(f"sandbox-crash-{n}-{len(ops)}")
        client = Client(gpud.socket, timeout=30)
        while not halt.is_set():
            op = sandbox_next_op(wr, mibs)
            if op.serve in serve_locks:
                with serve_locks[op.serve]:
                    sandbox_perform(client, op)
                    if op.kind in ("start", "start-preempt") and op.status == 200:
                        with contextlib.suppress(OSError):
                            settle(client, op.serve, timeout=5)
            else:
                sandbox_perform(client, op)
            with lock:
                ops.append(op)
            if not op.acked:
                time.sleep(0.05)
        client.close()

    t0 = time.monotonic()
    for cycle in range(1, kills + 1):
        halt = threading.Event()
        threads = [threading.Thread(target=worker, args=(n, halt), daemon=True)
                   for n in range(clients)]
        for t in threads:
            t.start()
        time.sleep(r.uniform(0.2, 1.5))
        gpud.sb.run(["systemctl", "kill", "--signal=SIGKILL", "--kill-whom=main", "gpud.service"])
        halt.set()
        for t in threads:
            t.join(60)
        # reset-failed: these restarts come faster than systemd's start limit allows
        gpud.sb.run("systemctl reset-failed gpud.service; systemctl restart gpud.service", timeout=60)
        wait_gpud_ready(gpud)
        store = sandbox_store(gpud)
        if store["integrity"] != "ok":
            problems.append(f"kill {cycle}: integrity_check: {store['integrity']}")
        rep = replay(store["events"], budgets)
        problems += [f"kill {cycle}: {p}" for p in rep.problems[:5]]
        problems += [f"kill {cycle}: {p}" for p in sleep_problems(store["events"])[:5]]
        problems += [f"kill {cycle}: {p}" for p in invariant_events(store["events"])[:5]]
        if store["reservations"] != replay_reservations(rep):
            problems.append(f"kill {cycle}: reservations are not the replay of the stored events")
        if ledger_reservations(gpud.get("/v1/ledger")) != store["reservations"]:
            problems.append(f"kill {cycle}: the restarted gpud's ledger is not its store's")
        ext_ops = [op for op in ops if op.serve in SANDBOX_EXTERNAL]
        _, acks = match_acks(ext_ops, [e for e in store["events"] if e["serve"] in SANDBOX_EXTERNAL])
        problems += [f"kill {cycle}: {p}" for p in acks[:5]]
        problems += units_problems(gpud, cycle)
        if problems:
            break
    summary = {"kills": kills, "ops": len(ops), "acknowledged": sum(op.acked for op in ops),
               "starts_ok": sum(op.kind == "start" and op.status == 200 for op in ops),
               "slept": sum(op.kind == "sleep" and op.status == 200 for op in ops),
               "adopted": sum(e["kind"] == "adopt" for e in sandbox_store(gpud)["events"]),
               "seconds": round(time.monotonic() - t0, 1), "violations": len(problems)}
    assert not problems, ("\n".join(problems) + "\n" + seed_note() + "\n"
                          + events_named(sandbox_store(gpud)["events"], "\n".join(problems))
                          + "\n" + gpud.journal_tail(40))
    print(f"sandbox crash campaign: {summary} {seed_note()}")
    return summary


def test_sandbox_crash_short(gpud: SandboxGpud) -> None:
    run_sandbox_crash(gpud, kills=3, clients=6)


@pytest.mark.slow
def test_sandbox_crash_long(gpud: SandboxGpud) -> None:
    run_sandbox_crash(gpud, kills=max(1, knob("KILLS", 50)), clients=16)


def test_a_sleep_that_cannot_be_recorded_is_undone(small_state_dir: SandboxGpud) -> None:
    # The state directory fills while a serve is put to sleep: vLLM sleeps, the shrink of its
    # reservation cannot be committed, so gpud wakes it back. The ledger never says less than
    # what runs: recorded running at its full size, and it is awake at its full size.
    from tests.integration.test_sleep import ROLE
    from tests.integration.test_sleep import serve as sleeper

    gpud = small_state_dir
    mount_small_state_dir(gpud, sim_config(ROLE, sleeper("lo", 12000, 50, 30181, level=1,
                                                         front=False)))
    assert gpud.call("POST", "/v1/serves/lo/start", {}).status == 200
    gpud.wait_state("lo", "running")
    before = ledger_reservations(gpud.get("/v1/ledger"))
    assert before == {"lo": ("r", 12000)}
    said_before = gpud.journal_tail(100000).count("the store fails")
    fill(gpud)
    reply = gpud.call("POST", "/v1/serves/lo/sleep", {})
    assert reply.status == 500, reply.body
    assert reply.body["error"]["code"] == "store-failed"
    assert "woken back" in reply.body["error"]["message"], reply.body
    assert gpud.serve("lo")["state"] == "running"
    assert ledger_reservations(gpud.get("/v1/ledger")) == before
    state = gpud.standin_state("lo")
    assert state["sleep_level"] is None, state  # awake again, as the ledger says
    # the store's failure is a state gpud reports, and the journal says it once, no traceback
    store = gpud.get("/v1/status")["store"]
    assert store["ok"] is False and "full" in store["error"], store
    time.sleep(1.5)  # three health rounds: none of them adds a line about the store
    journal = gpud.journal_tail(100000)
    assert journal.count("the store fails") == said_before + 1, journal[-5000:]
    assert "Traceback" not in gpud.journal_tail(200), journal[-5000:]
    # space back: the sleep works, and nothing is taken for a sleep "outside gpud"
    gpud.sb.run("rm -f /var/lib/gpud/filler")
    reply = gpud.call("POST", "/v1/serves/lo/sleep", {})
    assert reply.status == 200, reply.body
    assert gpud.get("/v1/status")["store"]["ok"] is True
    assert gpud.serve("lo")["state"] == "sleeping"
    assert not [e for e in gpud.events(serve="lo") if e["details"].get("outside")]


def test_a_wake_that_cannot_be_recorded_is_not_carried_out(
        small_state_dir: SandboxGpud) -> None:
    # A wake is admitted (its growth committed) before the serve is asked to wake: with the
    # state directory full, the admission fails and the serve is never woken.
    from tests.integration.test_sleep import ROLE
    from tests.integration.test_sleep import serve as sleeper

    gpud = small_state_dir
    mount_small_state_dir(gpud, sim_config(ROLE, sleeper("lo", 12000, 50, 30182, level=1,
                                                         front=False)))
    assert gpud.call("POST", "/v1/serves/lo/start", {}).status == 200
    gpud.wait_state("lo", "running")
    assert gpud.call("POST", "/v1/serves/lo/sleep", {}).status == 200
    asleep = ledger_reservations(gpud.get("/v1/ledger"))
    assert asleep == {"lo": ("r", 800)}
    fill(gpud)
    reply = gpud.call("POST", "/v1/serves/lo/wake", {})
    assert reply.status == 500, reply.body
    assert reply.body["error"]["code"] == "store-failed"
    assert gpud.serve("lo")["state"] == "sleeping"
    assert ledger_reservations(gpud.get("/v1/ledger")) == asleep
    assert gpud.standin_state("lo")["sleep_level"] == 1  # never asked to wake
    gpud.sb.run("rm -f /var/lib/gpud/filler")
    assert gpud.call("POST", "/v1/serves/lo/wake", {}).status == 200
    assert ledger_reservations(gpud.get("/v1/ledger")) == {"lo": ("r", 12000)}


def test_a_stop_that_cannot_be_recorded_is_not_carried_out(
        small_state_dir: SandboxGpud) -> None:
    # A stop records its intent (stopping) before it touches the unit: with the state directory
    # full, that record fails and the serve keeps running, recorded running at its full size.
    gpud = small_state_dir
    serves = (f'[serves.s]\nrole = "dark-fast"\nvram_mib = 1000\nport = 30143\n'
              f'command = {standin()}\n')
    mount_small_state_dir(gpud, sim_config(DARK_FAST, serves))
    assert gpud.call("POST", "/v1/serves/s/start", {}).status == 200
    gpud.wait_state("s", "running")
    before = ledger_reservations(gpud.get("/v1/ledger"))
    assert before == {"s": ("dark-fast", 1000)}
    fill(gpud)
    reply = gpud.call("POST", "/v1/serves/s/stop", {})
    assert reply.status == 500, reply.body
    assert reply.body["error"]["code"] == "store-failed"
    assert gpud.serve("s")["state"] == "running"
    assert ledger_reservations(gpud.get("/v1/ledger")) == before
    assert gpud.serve_units() == ["gpud-serve-s.service"]  # never stopped
    assert gpud.get("/v1/status")["store"]["ok"] is False
    # space back: the stop goes through, and releases what it held
    gpud.sb.run("rm -f /var/lib/gpud/filler")
    reply = gpud.call("POST", "/v1/serves/s/stop", {})
    assert reply.status == 200, reply.body
    assert gpud.serve_units() == []
    assert ledger_reservations(gpud.get("/v1/ledger")) == {}
    assert gpud.get("/v1/status")["store"]["ok"] is True
