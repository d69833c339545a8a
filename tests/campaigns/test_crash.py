"""Campaign 2: crash consistency. gpud is killed with SIGKILL at random moments of a mutation
storm and restarted, over and over, on the same state directory. After every kill:

- ``PRAGMA integrity_check`` of the store is ok (read by a connection of our own, gpud down);
- every acknowledged operation is there (its stored event, and its effect in the ledger);
- nothing is half-applied: the reservations are exactly the replay of the stored admit/release
  events (a reservation without its event, or an event without its reservation, breaks it), and
  every serve's stored state agrees with whether it holds a reservation;
- the restarted gpud serves exactly that ledger.

An operation that got no reply may or may not be there, but never partly.

Short form (5 kills) in the default run; long form: ``python3 -m pytest -m slow
tests/campaigns -k crash`` (GPUD_CAMPAIGN_KILLS, default 50).
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest

from tests.campaigns.conftest import (
    Client,
    MibSource,
    Op,
    check_ledger_figures,
    invariant_events,
    knob,
    ledger_reservations,
    match_acks,
    read_store,
    replay,
    replay_reservations,
    rng,
    seed_note,
)
from tests.campaigns.test_concurrency import (
    CONFIGURED,
    EXTERNAL,
    MIB_RANGE,
    budgets,
    campaign_config,
    next_op,
    perform,
)
from tests.conftest import start_gpud, wait_ready

RESERVED_STATES = {"admitted", "external"}


def storm(sock: Path, mibs: MibSource, clients: int, salt: str, stop: threading.Event,
          ops: list[Op]) -> list[threading.Thread]:
    lock = threading.Lock()

    def worker(n: int) -> None:
        r = rng(f"{salt}-{n}")
        client = Client(sock, timeout=10)
        while not stop.is_set():
            op = next_op(r, mibs)
            perform(client, op)
            with lock:
                ops.append(op)
            if not op.acked:
                time.sleep(0.01)
        client.close()

    threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(clients)]
    for t in threads:
        t.start()
    return threads


def check_after_kill(state_dir: Path, ops: list[Op], cycle: int) -> tuple[list[str], dict]:
    store = read_store(state_dir)
    problems = []
    if store.integrity != "ok":
        problems.append(f"kill {cycle}: integrity_check: {store.integrity}")
    rep = replay(store.events, budgets())
    problems += [f"kill {cycle}: {p}" for p in rep.problems[:10]]
    if store.reservations != replay_reservations(rep):
        diff = set(store.reservations.items()) ^ set(replay_reservations(rep).items())
        problems.append(f"kill {cycle}: reservations are not the replay of the stored events: "
                        f"{sorted(diff)[:6]}")
    _, ack_problems = match_acks(ops, store.events)
    problems += [f"kill {cycle}: {p}" for p in ack_problems[:10]]
    problems += [f"kill {cycle}: {p}" for p in invariant_events(store.events)[:5]]
    # an acknowledged admit's reservation is still held unless a later stored event replaced or
    # released it: the replay already says so; here the states must agree with the ledger
    for serve in [*CONFIGURED, *EXTERNAL]:
        held = serve in store.reservations
        state = store.states.get(serve)
        if held and state not in RESERVED_STATES:
            problems.append(f"kill {cycle}: {serve} holds a reservation in state {state!r}")
        if not held and state in RESERVED_STATES:
            problems.append(f"kill {cycle}: {serve} is {state!r} without a reservation")
    return problems, replay_reservations(rep)


def run_campaign(tmp: Path, kills: int, clients: int = 8) -> dict[str, object]:
    r = rng("crash")
    mibs = MibSource(rng("crash-mib"), *MIB_RANGE)
    config = campaign_config(tmp)
    ops: list[Op] = []
    problems: list[str] = []
    gp = start_gpud(tmp, config)
    t0 = time.monotonic()
    acked_before = 0
    try:
        for cycle in range(1, kills + 1):
            stop = threading.Event()
            threads = storm(gp.socket, mibs, clients, f"crash-{cycle}", stop, ops)
            # let the storm build up, then kill at a random moment of it
            time.sleep(r.uniform(0.05, 0.8))
            gp.proc.send_signal(signal.SIGKILL)
            gp.proc.wait(10)
            stop.set()
            for t in threads:
                t.join(30)
            assert not any(t.is_alive() for t in threads), "storm clients hang after the kill"
            found, expected = check_after_kill(gp.state_dir, ops, cycle)
            problems += found
            if problems:
                break
            gp = start_gpud(tmp, config, state_dir=gp.state_dir)
            wait_ready(gp)
            ledger = gp.call("GET", "/v1/ledger").body
            problems += [f"kill {cycle}: {p}" for p in check_ledger_figures(ledger)]
            if ledger_reservations(ledger) != expected:
                problems.append(f"kill {cycle}: the restarted gpud's ledger is not the store's")
            acked_now = sum(op.acked for op in ops)
            if acked_now == acked_before:
                problems.append(f"kill {cycle}: no operation was acknowledged in this storm")
            acked_before = acked_now
            if problems:
                break
    finally:
        gp.stop()
    elapsed = time.monotonic() - t0
    assert not problems, "\n".join(problems) + "\n" + seed_note()
    final, _ = check_after_kill(gp.state_dir, ops, kills + 1)
    assert not final, "\n".join(final)
    summary = {"kills": kills, "ops": len(ops), "acknowledged": sum(op.acked for op in ops),
               "unacknowledged": sum(not op.acked for op in ops),
               "events": len(read_store(gp.state_dir).events),
               "seconds": round(elapsed, 1), "violations": 0}
    print(f"crash campaign: {summary} {seed_note()}")
    return summary


def test_crash_short(tmp_path: Path) -> None:
    run_campaign(tmp_path, kills=5)


@pytest.mark.slow
def test_crash_long(tmp_path: Path) -> None:
    run_campaign(tmp_path, kills=max(1, knob("KILLS", 50)))
