"""Soak under systemd: random traffic for 20 minutes beside a resident serve that crashes once a
minute, gpud's RSS and open descriptors sampled every 30 s (issue 18, item 9).

Slow only: ``python3 -m pytest -m slow tests/campaigns -k soak -s`` (GPUD_CAMPAIGN_SOAK_S, default
1200; GPUD_CAMPAIGN_SOAK_SAMPLE_S, default 30). The bound, after the first sample (start-up,
imports and the first SQLite pages are in by then): RSS grows by at most SOAK_RSS_BOUND_KIB over
the run, open descriptors by at most SOAK_FD_BOUND. What grows legitimately and is bounded by
itself: SQLite's page cache (about 2 MiB per connection by default) filling as the event table
grows, and the allocator's arenas reaching their working size.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.campaigns.conftest import Client, knob, rng, seed_note
from tests.integration.gpudctl import SandboxGpud, sim_config, standin

pytestmark = pytest.mark.sandbox

SOAK_RSS_BOUND_KIB = 6 * 1024
SOAK_FD_BOUND = 8
DARK_FAST = '[roles.dark-fast]\ndevice = "GPU-sim-0"\nreserve_mib = 7168\n'


@pytest.fixture
def gpud(campaign_sandbox: Any) -> Iterator[SandboxGpud]:
    ctl = SandboxGpud(campaign_sandbox)
    yield ctl
    ctl.reset()


def gpud_figures(gpud: SandboxGpud) -> tuple[int, int, int]:
    """(MainPID, RSS KiB, open descriptors) of gpud, read inside the sandbox."""
    pid = int(gpud.unit_prop("gpud.service", "MainPID"))
    out = gpud.sb.run(f"grep VmRSS /proc/{pid}/status; ls /proc/{pid}/fd | wc -l").stdout.split()
    return pid, int(out[1]), int(out[-1])


def store_kib(gpud: SandboxGpud) -> int:
    out = gpud.sb.run("du -sk /var/lib/gpud", check=False).stdout.split()
    return int(out[0]) if out else 0


def traffic(gpud: SandboxGpud, salt: str, halt: threading.Event, bad: list[str],
            counts: dict[str, int], *, reader: bool) -> None:
    """Readers ask for the ledger, serves, events and status; the others admit and release
    external reservations and start and stop serves (a stop waits for its unit to end)."""
    r = rng(salt)
    client = Client(gpud.socket)
    allowed = {"start": {200, 409}, "stop": {200, 409}, "admit": {200, 409},
               "release": {200, 404, 409}, "read": {200}}
    try:
        while not halt.is_set():
            pick = r.random()
            if reader:
                kind, (method, path, body) = "read", r.choice([
                    ("GET", "/v1/ledger", None), ("GET", "/v1/serves", None),
                    ("GET", "/v1/events?limit=50", None), ("GET", "/v1/status", None),
                    ("GET", "/v1/serves/crashy", None)])
            elif pick < 0.6:
                name = f"x{r.randrange(5)}"
                kind = r.choice(["admit", "release"])
                body = {"mib": r.randrange(100, 400), "role": "dark-fast"} if kind == "admit" \
                    else {}
                method, path = "POST", f"/v1/serves/{name}/{kind}"
            else:
                kind = r.choice(["start", "stop"])
                method, path, body = "POST", f"/v1/serves/a{r.randrange(3)}/{kind}", {}
            try:
                status, reply = client.request(method, path, body)
            except OSError as exc:
                bad.append(f"{method} {path}: {exc}")
                continue
            counts[kind] = counts.get(kind, 0) + 1
            if status not in allowed[kind]:
                bad.append(f"{method} {path}: {status} {reply}")
            halt.wait(r.uniform(0.02, 0.2))
    finally:
        client.close()


@pytest.mark.slow
def test_soak(gpud: SandboxGpud) -> None:
    duration = knob("SOAK_S", 1200)
    every = knob("SOAK_SAMPLE_S", 30)
    serves = (f'[serves.crashy]\nrole = "dark-fast"\nvram_mib = 1000\nresident = true\n'
              f'port = 30301\nrestart_sec = 0.5\ncommand = {standin("--crash-after", "60")}\n'
              f'[serves.steady]\nrole = "dark-fast"\nvram_mib = 1000\nresident = true\n'
              f'port = 30302\ncommand = {standin()}\n')
    for i in range(3):
        serves += (f'[serves.a{i}]\nrole = "dark-fast"\nvram_mib = 800\nport = {30310 + i}\n'
                   f'restart_sec = 0.2\ncommand = {standin()}\n')
    gpud.configure(sim_config(DARK_FAST, serves))
    gpud.wait_state("crashy", "running")
    gpud.wait_state("steady", "running")
    halt = threading.Event()
    bad: list[str] = []
    counts: dict[str, int] = {}
    threads = [threading.Thread(target=traffic, args=(gpud, f"soak{i}", halt, bad, counts),
                                kwargs={"reader": i < 2}) for i in range(4)]
    for t in threads:
        t.start()
    samples: list[tuple[float, int, int, int]] = []
    t0 = time.monotonic()
    try:
        while True:
            pid, rss, fds = gpud_figures(gpud)
            samples.append((time.monotonic() - t0, pid, rss, fds))
            print(f"soak t={samples[-1][0]:6.0f} s  rss {rss / 1024:6.1f} MiB  fds {fds}  "
                  f"store {store_kib(gpud) / 1024:6.1f} MiB", flush=True)
            if time.monotonic() - t0 >= duration:
                break
            halt.wait(every)
    finally:
        halt.set()
        for t in threads:
            t.join(60)
    restarts = gpud.events(kind="restart", serve="crashy")
    loops = gpud.events(kind="crash-loop", serve="crashy")
    print(f"soak: {duration} s, requests {counts}, crashy restarted {len(restarts)} times, "
          f"crash-loop events {len(loops)} {seed_note()}")
    assert not bad, bad[:10]
    assert len({pid for _, pid, _, _ in samples}) == 1, "gpud restarted during the soak"
    # Once a minute is slower than the crash-loop window catches (5 restarts in 60 s):
    # restarted every time, never stopped (docs/supervision.md says why).
    assert len(restarts) >= max(1, duration // 60 - 2) and not loops, (len(restarts), loops)
    first, last = samples[1] if len(samples) > 2 else samples[0], samples[-1]
    growth = last[2] - first[2]
    assert growth <= SOAK_RSS_BOUND_KIB, f"RSS grew by {growth} KiB: {samples}"
    assert last[3] - first[3] <= SOAK_FD_BOUND, f"descriptors grew: {samples}"
