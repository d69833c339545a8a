"""A hostile local user against the front, under real systemd (the sandbox): a real unprivileged
user outside group gpud holds idle connections and sends headers a line a second to a fronted
port, storms on-demand serves that do not fit together with alternating requests, and hammers
a crash-looping on-demand serve; meanwhile another user (outside group gpud too) uses the
fronted serves, streams a completion longer than an on-demand serve's idle_stop_s, and root
reads gpud's API.

Asserts: the other user is answered (every request within 5 s, the stream whole); the ledger
invariant holds (no `invariant` event, gpud_invariant_violations_total 0); the event store is
bounded (a few events per serve and window, not per request; the crash-looping serve started
no more often than its backoff allows); no 5xx from gpud's API.

The choices (the storms' order, the phases' sizes within their bounds) come from the campaign's
seed (GPUD_CAMPAIGN_SEED), printed at the end of every run. Short form in the default run;
the long form (`-m slow`): 4000 idle and 1000 slow-header connections, 150 s (two windows of
the refusals' coalescing).
"""

from __future__ import annotations

import json
import math
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpud.core import bringup, coalesce
from tests.campaigns.conftest import invariant_events, knob, rng, seed_note
from tests.integration.gpudctl import PY, SandboxGpud, fronted_gpud, sim_config, standin_uds

pytestmark = pytest.mark.sandbox

CLIENT = str(Path(__file__).resolve().parent / "hostile_client.py")
HOSTILE = "gpud-hostile"  # outside groups gpud and gpud-front
OTHER = "gpud-bystander"  # another local user, outside them too
BASE = 30381
SERVES = ("victim", "steady", "left", "right", "crashy", "streamer", "od1", "od2")
VICTIM, STEADY, LEFT, RIGHT, CRASHY, STREAMER, OD1, OD2 = range(BASE, BASE + len(SERVES))
TOKEN_S = 0.25
SLEEPY = 'environment = { VLLM_SERVER_DEV_MODE = "1" }\nsleep_level = 2\nsleep_mib = 800\n'


def config() -> str:
    sleeper = standin_uds("--enable-sleep-mode", "--asleep-mib", "800")
    serves = (
        # what the other user uses: a serve an operator started, an on-demand one that is up
        f'[serves.victim]\nrole = "r"\nvram_mib = 2000\nport = {VICTIM}\nfront = true\n'
        f"command = {standin_uds()}\n"
        f'[serves.steady]\nrole = "r"\nvram_mib = 2000\nport = {STEADY}\nfront = true\n'
        f"on_demand = true\ncommand = {standin_uds()}\n"
        # one stream through it is longer than its idle_stop_s
        f'[serves.streamer]\nrole = "r"\nvram_mib = 2000\nport = {STREAMER}\nfront = true\n'
        f"on_demand = true\nidle_stop_s = 4\n"
        f"command = {standin_uds('--token-interval-s', str(TOKEN_S))}\n"
        # two that do not fit together (31607 - 8000 leaves room for one)
        f'[serves.left]\nrole = "r"\nvram_mib = 16000\nport = {LEFT}\nfront = true\n'
        f"on_demand = true\ncommand = {standin_uds()}\n"
        f'[serves.right]\nrole = "r"\nvram_mib = 16000\nport = {RIGHT}\nfront = true\n'
        f"on_demand = true\ncommand = {standin_uds()}\n"
        # healthy at once, dead 0.5 s later: a crash-loop
        f'[serves.crashy]\nrole = "r"\nvram_mib = 2000\nport = {CRASHY}\nfront = true\n'
        f"on_demand = true\nrestart_sec = 0.2\n"
        f"command = {standin_uds('--crash-after', '0.5')}\n"
        # on the second device: od1 preempts od2 (a wake as a start), od2 never fits beside it
        f'[serves.od1]\nrole = "r2"\nvram_mib = 16000\nport = {OD1}\nfront = true\n'
        f"on_demand = true\npreempt = true\npriority = 30\n{SLEEPY}command = {sleeper}\n"
        f'[serves.od2]\nrole = "r2"\nvram_mib = 30000\nport = {OD2}\nfront = true\n'
        f"on_demand = true\npriority = 40\n{SLEEPY}command = {sleeper}\n")
    roles = ('[roles.r]\ndevice = "GPU-sim-0"\nreserve_mib = 1000\n'
             '[roles.r2]\ndevice = "GPU-sim-1"\nreserve_mib = 1000\n')
    return sim_config(roles, serves, devices=2,
                      daemon="crash_loop_restarts = 3\ncrash_loop_window_s = 30")


@pytest.fixture
def front(campaign_sandbox: Any) -> Iterator[SandboxGpud]:
    with fronted_gpud(SandboxGpud(campaign_sandbox), config(), [HOSTILE, OTHER]) as gpud:
        yield gpud


class Sandboxed:
    """One client of hostile_client.py running as a user inside the sandbox."""

    def __init__(self, gpud: SandboxGpud, user: str, *args: object) -> None:
        self.sb = gpud.sb
        self.proc = gpud.sb.popen([PY, CLIENT, *map(str, args)], user=user,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def result(self, timeout: float) -> dict[str, Any]:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.sb.kill(self.proc)
            out, err = self.proc.communicate()
            raise AssertionError(f"a hostile-campaign client ran past {timeout:g} s: "
                                 f"{err[-2000:]}") from None
        lines = out.strip().splitlines()
        if self.proc.returncode != 0 or not lines:
            raise AssertionError(f"client failed ({self.proc.returncode}): {err[-2000:]}")
        return dict(json.loads(lines[-1]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.sb.kill(self.proc)
        self.proc.communicate()  # reaped, its pipes closed


def sample_api(gpud: SandboxGpud, stop: threading.Event, seen: Counter[str],
               fivexx: list[str]) -> None:
    """Root reading gpud's API while the campaign runs: every answer's status."""
    while not stop.is_set():
        for path in ("/v1/ledger", "/v1/serves", "/v1/status", "/metrics",
                     "/v1/events?limit=50"):
            try:
                reply = gpud.call("GET", path)
            except OSError as exc:
                seen[type(exc).__name__] += 1
                continue
            seen[str(reply.status)] += 1
            if reply.status >= 500:
                fivexx.append(f"GET {path}: {reply.status} {str(reply.raw)[:300]}")
        stop.wait(0.5)


def backoff_attempts(seconds: float) -> int:
    """The most bring-ups of a serve that fails at once that the backoff allows in `seconds`
    (gpud.core.bringup's defaults): the first, then one after each backoff."""
    policy = bringup.Policy()
    attempts, t = 1, 0.0
    while True:
        t += policy.backoff_s(attempts)
        if t > seconds:
            return attempts
        attempts += 1


def run_campaign(gpud: SandboxGpud, *, idle: int, slow: int, seconds: float) -> dict[str, Any]:
    r = rng("hostile-front")
    # what the other user uses is up before the hostile user starts
    assert gpud.call("POST", "/v1/serves/victim/start", {}).status == 200
    gpud.wait_state("victim", "running")
    first = Sandboxed(gpud, OTHER, "serve", 0.1, STEADY).result(timeout=90)
    assert first["answers"][0][1] == "200", first
    before = len(gpud.events())
    began = time.monotonic()

    storm_ports = [[LEFT, RIGHT], [OD1, OD2]]
    r.shuffle(storm_ports)
    threads = r.randint(3, 6)
    crash_threads = r.randint(2, 4)
    hold_port = r.choice([VICTIM, STEADY])
    print(f"hostile front: {idle} idle + {slow} slow-header connections to {hold_port}, "
          f"storms of {threads} threads over {storm_ports}, {crash_threads} on crashy, "
          f"{seconds:g} s {seed_note()}")
    hostile = [
        Sandboxed(gpud, HOSTILE, "hold", hold_port, idle, seconds),
        Sandboxed(gpud, HOSTILE, "slow", hold_port, slow, seconds),
        *(Sandboxed(gpud, HOSTILE, "storm", r.randrange(2**31), threads, seconds, *ports)
          for ports in storm_ports),
        Sandboxed(gpud, HOSTILE, "storm", r.randrange(2**31), crash_threads, seconds, CRASHY),
    ]
    stop = threading.Event()
    api: Counter[str] = Counter()
    fivexx: list[str] = []
    sampler = threading.Thread(target=sample_api, args=(gpud, stop, api, fivexx), daemon=True)
    sampler.start()
    clients = list(hostile)
    try:
        # the holds are in place before the other user starts (a connection a few ms)
        time.sleep(min(5.0, 1.0 + idle / 1000))
        other = Sandboxed(gpud, OTHER, "serve", max(1.0, seconds - 8), VICTIM, STEADY)
        tokens = int(2 * 4 / TOKEN_S)  # twice the streamer's idle_stop_s
        streamed = Sandboxed(gpud, OTHER, "stream", STREAMER, tokens)
        clients += [other, streamed]
        results = []
        for h in hostile:
            results.append(h.result(timeout=seconds + 120))
            print(f"  {results[-1]['mode']} done at {time.monotonic() - began:.1f} s")
        served = other.result(timeout=seconds + 60)
        stream = streamed.result(timeout=seconds + 60)
        print(f"  the other user done at {time.monotonic() - began:.1f} s")
    finally:
        for c in clients:
            c.stop()
        stop.set()
        sampler.join(timeout=30)
    took = time.monotonic() - began
    events = gpud.events()[before:]
    metrics = gpud.sb.run(["curl", "-s", "--unix-socket", "/run/gpud/gpud.sock",
                           "http://localhost/metrics"]).stdout
    violations = [line for line in metrics.splitlines()
                  if line.startswith("gpud_invariant_violations_total ")]
    return {"results": results, "served": served, "stream": stream, "events": events,
            "api": api, "fivexx": fivexx, "violations": violations, "seconds": took,
            "all_events": gpud.events()}


def check(out: dict[str, Any], *, idle: int, slow: int) -> None:
    note = seed_note()
    hold, slowed, *storms = out["results"]
    requests = sum(sum(s["statuses"].values()) for s in storms)
    events: list[dict[str, Any]] = out["events"]
    kinds = Counter((e["kind"], e["serve"]) for e in events)
    print(f"hostile front: {out['seconds']:.0f} s, hold {hold}, slow {slowed}, "
          f"{requests} storm requests {[s['statuses'] for s in storms]}, "
          f"{len(events)} events stored {dict(kinds)}, API {dict(out['api'])}, "
          f"stream {out['stream']}")
    t0 = events[0]["ts"] if events else 0.0
    print("  deny events: " + "; ".join(
        f"+{e['ts'] - t0:.0f} s {e['serve']} repeated={e['details'].get('repeated', 0)}"
        for e in events if e["kind"] == "deny"))
    problems: list[str] = []

    # the hostile user did what it meant to (else the rest proves nothing)
    if hold["opened"] < idle * 0.9:
        problems.append(f"the hostile user opened only {hold['opened']} of {idle} idle "
                        f"connections: {hold}")
    if requests < 100:
        problems.append(f"the storms' requests were answered only {requests} times in "
                        f"{out['seconds']:.0f} s (the front did not take them)")

    # other users served
    answers = out["served"]["answers"]
    bad = [a for a in answers if a[1] != "200" or a[2] > 5]
    if not answers or bad:
        problems.append(f"the other user was not served: {len(bad)} of {len(answers)} requests "
                        f"failed or took over 5 s, e.g. {bad[:5]}")
    stream = out["stream"]
    if not (stream["status"] == "200" and stream["done"] and stream["tokens"] == stream["asked"]):
        problems.append(f"a stream longer than the serve's idle_stop_s was cut: {stream}")

    # the ledger invariant
    said = invariant_events(out["all_events"])
    if said:
        problems.append(f"invariant events: {said}")
    if out["violations"] != ["gpud_invariant_violations_total 0.0"]:
        problems.append(f"gpud_invariant_violations_total: {out['violations']}")

    # no 5xx from gpud's API
    if out["fivexx"]:
        problems.append(f"gpud's API answered 5xx: {out['fivexx'][:5]}")

    # the event store bounded: a few events per serve and window, not per request
    windows = math.ceil(out["seconds"] / coalesce.WINDOW_S) + 1
    for (kind, serve), n in sorted(kinds.items(), key=lambda kv: str(kv[0])):
        if kind == "deny" and n > 2 * windows + 1:
            problems.append(f"{n} deny events of {serve} in {windows} window(s)")
    starts = kinds[("start", "crashy")]
    allowed = backoff_attempts(out["seconds"])
    if starts > allowed:
        problems.append(f"crashy started {starts} times in {out['seconds']:.0f} s (the backoff "
                        f"allows {allowed})")
    # each serve's own bring-up, sleep and stop events, a few refusals of it per window, and
    # a crash-loop's dozen events (admit, start, exits and restarts, crash-loop, release) for
    # each try its backoff allows
    budget = len(SERVES) * (10 + 2 * windows) + 16 * allowed
    if len(events) > budget:
        problems.append(f"{len(events)} events stored for {requests} requests (at most "
                        f"{budget}): {dict(kinds)}")
    if requests >= 500 and len(events) > requests / 10:
        problems.append(f"{len(events)} events for {requests} requests: per request")

    # what the hostile user was told: the reason's class, no figures, no other serve
    for s in storms:
        for body in s["bodies_503"].values():
            try:
                error = json.loads(body)["error"]
            except (ValueError, KeyError, TypeError):
                error = None
            if not isinstance(error, dict) or error.get("code") == "model_not_running":
                continue  # the front's own 503 (a serve not running), not gpud's reason
            if "class" not in error.get("details", {}) or "MiB" in body:
                problems.append(f"a 503 told the hostile user more than the class: {body}")
    assert not problems, "\n".join(problems) + f"\n{note}"


def test_hostile_front_short(front: SandboxGpud) -> None:
    idle, slow = 1100, 100
    out = run_campaign(front, idle=idle, slow=slow, seconds=25)
    check(out, idle=idle, slow=slow)


@pytest.mark.slow
def test_hostile_front_long(front: SandboxGpud) -> None:
    idle, slow = knob("IDLE_HOLD", 4000), knob("SLOW_HOLD", 1000)
    out = run_campaign(front, idle=idle, slow=slow, seconds=knob("HOSTILE_S", 150))
    check(out, idle=idle, slow=slow)
