"""Campaign 1: concurrency. Many clients admit and release at random over many serves and roles
while a sampler reads /v1/ledger: committed never exceeds capacity - reserve in any snapshot,
every snapshot is a state of the commit order, the commit order respects real time, and the
final ledger is the replay (gpud.core.ledger.Ledger) of exactly the acknowledged operations.

Short form in the default run; long form: ``python3 -m pytest -m slow tests/campaigns -k
concurrency`` (GPUD_CAMPAIGN_CLIENTS, GPUD_CAMPAIGN_OPS).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

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
    read_store,
    replay,
    replay_reservations,
    rng,
    seed_note,
)
from tests.conftest import GpudProcess, start_gpud

# Three roles on two simulated devices. Each device's total covers the capacities of its roles,
# so in strict admission the ledger bound is the one that binds and the replay on the pure
# ledger must decide every admission exactly as gpud did.
ROLES = {"alpha": ("GPU-sim-0", 400_000, 10_000), "beta": ("GPU-sim-0", 300_000, 0),
         "gamma": ("GPU-sim-1", 500_000, 50_000)}
CONFIGURED: dict[str, str | tuple[str, ...]] = {f"c{i:02d}": list(ROLES)[i % 3]
                                                 for i in range(18)}
# Serves on two devices (tensor parallel): admitted on both roles or on neither.
CONFIGURED |= {f"t{i:02d}": (("alpha", "gamma"), ("gamma", "beta"))[i % 2] for i in range(6)}
EXTERNAL = [f"x{i:02d}" for i in range(18)]
MIB_RANGE = (1, 200_000)


def campaign_config(tmp: Path) -> str:
    sim = tmp / "sim.json"
    sim.write_text(json.dumps({"external": []}))
    lines = ['[daemon]\nadmission = "strict"\nobserve_interval_s = 0.2\n']
    for name, (dev, cap, reserve) in ROLES.items():
        lines.append(f'[roles.{name}]\ndevice = "{dev}"\ncapacity_mib = {cap}\nreserve_mib = {reserve}\n')
    for name, role in CONFIGURED.items():
        where = f'role = "{role}"' if isinstance(role, str) else f"roles = {json.dumps(role)}"
        lines.append(f'[serves.{name}]\n{where}\nvram_mib = 1000\ncommand = ["/bin/true"]\n')
    lines.append(f'[simulation]\nstate_file = "{sim}"\n'
                 '[[simulation.devices]]\nuuid = "GPU-sim-0"\ntotal_mib = 700000\n'
                 '[[simulation.devices]]\nuuid = "GPU-sim-1"\ntotal_mib = 500000\n')
    return "\n".join(lines)


def budgets() -> list[RoleBudget]:
    return [RoleBudget(n, d, c, r) for n, (d, c, r) in ROLES.items()]


def next_op(r, mibs: MibSource) -> Op:
    """A random operation: mostly admits and releases, some refused on purpose."""
    roll = r.random()
    if roll < 0.52:
        serve = r.choice([*CONFIGURED, *EXTERNAL])
        if serve in CONFIGURED:
            return Op("admit", serve, mibs.next())
        # an external serve, usually on "its" role, sometimes moved to another one
        role = list(ROLES)[int(serve[1:]) % 3] if r.random() < 0.8 else r.choice(list(ROLES))
        return Op("admit", serve, mibs.next(), role)
    if roll < 0.97:
        return Op("release", r.choice([*CONFIGURED, *EXTERNAL]))
    # refused before any decision: a configured serve on the wrong role, an unknown role
    if r.random() < 0.5:
        serve = r.choice(list(CONFIGURED))
        return Op("bad-admit", serve, mibs.next(), next(x for x in ROLES
                                                         if x not in _roles(CONFIGURED[serve])))
    return Op("bad-admit", r.choice(EXTERNAL), mibs.next(), "no-such-role")


def _roles(role: str | tuple[str, ...]) -> tuple[str, ...]:
    return (role,) if isinstance(role, str) else role


def perform(client: Client, op: Op) -> None:
    if op.kind in ("admit", "bad-admit"):
        body: dict[str, object] = {"mib": op.mib}
        if op.role:
            body["role"] = op.role
        path = f"/v1/serves/{op.serve}/admit"
    else:
        body = {}
        path = f"/v1/serves/{op.serve}/release"
    op.t_send = time.monotonic()
    try:
        op.status, op.body = client.request("POST", path, body)
    except OSError as exc:
        op.body = repr(exc)
        return
    op.t_reply = time.monotonic()


EXPECTED = {"admit": {200, 409}, "release": {200, 404, 409}, "bad-admit": {400, 404}}


def run_campaign(tmp: Path, clients: int, ops_per_client: int) -> dict[str, object]:
    gp: GpudProcess = start_gpud(tmp, campaign_config(tmp))
    mibs = MibSource(rng("concurrency-mib"), *MIB_RANGE)
    all_ops: list[list[Op]] = [[] for _ in range(clients)]
    sampler = Sampler(gp.socket)
    barrier = threading.Barrier(clients)

    def worker(n: int) -> None:
        r = rng(f"concurrency-{n}")
        client = Client(gp.socket)
        barrier.wait()
        for _ in range(ops_per_client):
            op = next_op(r, mibs)
            perform(client, op)
            all_ops[n].append(op)
        client.close()

    threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(clients)]
    t0 = time.monotonic()
    try:
        sampler.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join(1800)
        elapsed = time.monotonic() - t0
        sampler.stop()
        assert not any(t.is_alive() for t in threads), "clients did not finish"
        final = gp.call("GET", "/v1/ledger").body
        counted = invariant_violations(gp.call("GET", "/metrics").raw)
        assert gp.alive(), gp.output()[-3000:]
    finally:
        sampler.stop()
        gp.stop()
    ops = [op for per in all_ops for op in per]
    store = read_store(gp.state_dir)

    problems: list[str] = []
    unacked = [op for op in ops if not op.acked]
    problems += [f"no reply to {op.kind} {op.serve}: {op.body}" for op in unacked[:5]]
    wrong = [op for op in ops if op.acked and op.status not in EXPECTED[op.kind]]
    problems += [f"{op.kind} {op.serve} {op.mib} {op.role}: {op.status} {op.body}" for op in wrong[:5]]
    bad_shape = [op for op in ops if op.acked and op.status != 200
                 and set((op.body or {}).get("error", {})) != {"code", "message", "details"}]
    problems += [f"error not in the JSON error shape: {op.body}" for op in bad_shape[:5]]
    not_strict = [op for op in ops if op.kind == "admit" and op.status == 200
                  and op.body["check"] != "strict"]
    problems += [f"admit answered check={op.body['check']}" for op in not_strict[:3]]

    rep = replay(store.events, budgets())
    problems += rep.problems[:10]
    matched, ack_problems = match_acks(ops, store.events)
    problems += ack_problems[:10]
    # exactly the acknowledged operations: no ledger event without an acknowledged operation
    ledger_events = [e for e in store.events if e["kind"] in ("admit", "deny", "release")]
    if len(ledger_events) != len(matched):
        problems.append(f"{len(ledger_events)} admit/deny/release events stored, "
                        f"{len(matched)} acknowledged operations")
    # what each acknowledgement said is what the replay computed at that point
    by_id = {e["id"]: e for e in store.events}
    for i, ev_id in matched.items():
        op = ops[i]
        if op.status == 200 and op.kind == "admit":
            ev = by_id[ev_id]
            if op.body["figures"]["free_mib"] != ev["details"]["free_mib"]:
                problems.append(f"admit {op.serve}: answered free {op.body['figures']['free_mib']}, "
                                f"stored {ev['details']['free_mib']}")
    problems += check_real_time_order(ops, matched)
    problems += sampler.problems[:10]
    problems += sampler.check_against(rep)
    problems += check_ledger_figures(final)
    if ledger_reservations(final) != replay_reservations(rep):
        problems.append("final /v1/ledger differs from the replay of the acknowledged operations")
    if store.reservations != replay_reservations(rep):
        problems.append("the store's reservations differ from the replay")
    if store.integrity != "ok":
        problems.append(f"integrity_check: {store.integrity}")
    if sampler.errors:
        problems.append(f"{sampler.errors} sampler reads failed")
    # gpud's own evaluation of the invariant after every commit found nothing either
    if counted:
        problems.append(f"gpud_invariant_violations_total is {counted}")
    problems += invariant_events(store.events)[:5]
    assert not problems, "\n".join(problems) + "\n" + seed_note()

    summary = {
        "clients": clients, "ops": len(ops), "seconds": round(elapsed, 1),
        "ops_per_s": round(len(ops) / elapsed), "snapshots": len(sampler.snapshots),
        "admitted": sum(1 for op in ops if op.kind == "admit" and op.status == 200),
        "denied": sum(1 for op in ops if op.kind == "admit" and op.status == 409),
        "released": sum(1 for op in ops if op.kind == "release" and op.status == 200),
        "release_refused": sum(1 for op in ops if op.kind == "release" and op.status == 409),
        "multi_role_admitted": sum(1 for op in ops if op.kind == "admit" and op.status == 200
                                   and not isinstance(CONFIGURED.get(op.serve, ""), str)),
        "multi_role_denied": sum(1 for op in ops if op.kind == "admit" and op.status == 409
                                 and not isinstance(CONFIGURED.get(op.serve, ""), str)),
        "violations": 0, "invariant_violations_total": counted,
    }
    print(f"concurrency campaign: {summary} {seed_note()}")
    # the campaign must have exercised every outcome, serves on two devices included
    assert summary["admitted"] and summary["denied"] and summary["released"], summary
    assert summary["multi_role_admitted"] and summary["multi_role_denied"], summary
    return summary


def test_concurrency_short(tmp_path: Path) -> None:
    run_campaign(tmp_path, clients=16, ops_per_client=300)


@pytest.mark.slow
def test_concurrency_long(tmp_path: Path) -> None:
    clients = max(64, knob("CLIENTS", 64))
    total = knob("OPS", 10_000)
    run_campaign(tmp_path, clients=clients, ops_per_client=max(1, -(-total // clients)))
