"""The router's queue under real systemd (docs/router.md, "Queue instead of thrash"): an
alternating storm over two on-demand serves that do not fit together swaps them at most once
per router.min_awake_s, every request is answered (200, or 503 with Retry-After), and gpud
answers no 5xx of its own. Simulated GPU, stand-in serves, the front's nginx with njs."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from tests.integration.gpudctl import ROLE_R, SandboxGpud, fronted_gpud, on_demand, sim_config, standin_uds

ROUTER = 30300
PORT = 30301
USER = "gpud-queue-client"  # a local user who is nobody to gpud
MIN_AWAKE_S = 4.0
STORM_S = 16.0


def config() -> str:
    # 20000 MiB each on 32607 (1000 reserved): one at a time; equal priority, no preempt
    serves = "".join(on_demand(name, PORT + i, "--token-interval-s", "0.05")
                     for i, name in enumerate(("a", "b")))
    router = (f'[router]\nlisten = "127.0.0.1:{ROUTER}"\nqueue_timeout_s = 30\nmax_queued = 64\n'
              f"min_awake_s = {MIN_AWAKE_S}\n")
    return sim_config(ROLE_R, serves) + router


@pytest.fixture
def queued(gpud: SandboxGpud) -> Iterator[SandboxGpud]:
    with fronted_gpud(gpud, config(), [USER]):
        yield gpud


def storm(gpud: SandboxGpud, clients: int, seconds: float) -> list[str]:
    """`clients` loops of requests for model a and as many for b, through the router as the
    client user, for `seconds`: each answer's status and Retry-After ("-" when none)."""
    def loop(model: str) -> str:
        body = json.dumps({"model": model, "prompt": "a b", "max_tokens": 4})
        return (f"end=$(( $(date +%s%N) + {int(seconds * 1e9)} )); "
                f"while [ $(date +%s%N) -lt $end ]; do curl -s -o /dev/null --max-time 120 "
                f"-w '%{{http_code}}/%header{{retry-after}}\\n' -d '{body}' "
                f"http://127.0.0.1:{ROUTER}/v1/completions; done")
    script = " ".join(f"( {loop(m)} ) &" for _ in range(clients) for m in ("a", "b")) + " wait"
    out = gpud.sb.run(["bash", "-c", script], user=USER, timeout=seconds + 180).stdout
    return out.split()


def test_an_alternating_storm_swaps_at_most_once_per_min_awake(queued: SandboxGpud) -> None:
    gpud = queued
    began = time.monotonic()
    answers = storm(gpud, clients=3, seconds=STORM_S)
    took = time.monotonic() - began
    statuses = Counter(a.split("/")[0] for a in answers)
    assert gpud.unit_prop("gpud.service", "ActiveState") == "active", gpud.journal_tail(400)
    # every request answered: 200, or 503 with Retry-After (never a 5xx of gpud's: its 500
    # would be the router's 500 here, its timeout a 504)
    assert set(statuses) <= {"200", "503"}, (statuses, gpud.journal_tail())
    assert all(a.split("/")[1].isdigit() for a in answers if a.startswith("503/")), answers
    # both models were served, by swapping
    starts = {n: len(gpud.events(kind="start", serve=n)) for n in ("a", "b")}
    assert starts["a"] >= 1 and starts["b"] >= 1, (starts, statuses, gpud.journal_tail())
    assert statuses["200"] >= 20, statuses
    # at most one swap per min_awake_s (the first start is no swap), not one per request
    swaps = starts["a"] + starts["b"] - 1
    assert swaps <= 1 + took / MIN_AWAKE_S, (swaps, took, statuses)
    assert swaps < statuses["200"] / 4, (swaps, statuses)
    print(f"storm: {took:.1f} s, {dict(statuses)}, starts {starts}, swaps {swaps}")
    # the measured bring-ups: GET /v1/serves shows each serve's median start
    listed = {s["name"]: s for s in gpud.get("/v1/serves")["serves"]}
    assert all(listed[n]["start_s"] is not None and listed[n]["start_s"] > 0
               for n in ("a", "b")), listed


def uncut_config() -> str:
    """a and b as above, a brought up by a request evictable after 1 s, a drain bound of 1 s."""
    serves = "".join(on_demand(name, PORT + i, "--token-interval-s", "0.02")
                     for i, name in enumerate(("a", "b")))
    router = (f'[router]\nlisten = "127.0.0.1:{ROUTER}"\nqueue_timeout_s = 30\nmax_queued = 8\n'
              "min_awake_s = 1\n")
    return sim_config(ROLE_R, serves, daemon="drain_timeout_s = 1") + router


def test_an_eviction_for_a_queued_request_never_cuts_a_stream_in_flight(
        gpud: SandboxGpud) -> None:
    """M7 (issue 41): a long stream on a, then a request for b that needs a's memory. The
    eviction of a is refused while the stream is still in flight at the drain's bound (it
    was stopped, the stream cut without [DONE], before); b waits in its queue, and gets a's
    memory once the stream has ended. The journal says why a was not evicted."""
    with fronted_gpud(gpud, uncut_config(), [USER]):
        stream = json.dumps({"model": "a", "prompt": "a b", "max_tokens": 250, "stream": True})
        other = json.dumps({"model": "b", "prompt": "a b", "max_tokens": 2})
        script = (
            "rm -f /tmp/m7-stream; "
            f"curl -sN --max-time 40 -d '{stream}' http://127.0.0.1:{ROUTER}/v1/completions "
            "> /tmp/m7-stream & "
            # a is up and streaming, and up for longer than min_awake_s: b may evict it
            "for i in $(seq 600); do grep -q '^data: {' /tmp/m7-stream 2>/dev/null && break; "
            "sleep 0.05; done; "
            "sleep 1.5; began=$(date +%s%N); "
            f"curl -s -o /dev/null --max-time 40 -w 'b=%{{http_code}}\\n' -d '{other}' "
            f"http://127.0.0.1:{ROUTER}/v1/completions; "
            "echo waited_ms=$(( ($(date +%s%N) - began) / 1000000 )); wait; "
            "echo chunks=$(grep -c '^data: {' /tmp/m7-stream) "
            "done=$(grep -c '^data: \\[DONE\\]' /tmp/m7-stream); tail -c 300 /tmp/m7-stream >&2")
        ran = gpud.sb.run(["bash", "-c", script], user=USER, timeout=120)
        journal = gpud.journal_tail(400)
        got = dict(w.split("=") for w in ran.stdout.split())
        print(ran.stderr)
        # the stream ran to its end: every token and its [DONE]
        assert got["done"] == "1" and int(got["chunks"]) >= 250, (got, journal)
        # b was served once a was evicted, after the stream ended
        assert got["b"] == "200", (got, journal)
        assert "on-demand a: eviction for b refused" in journal and "not cut" in journal, \
            journal
        assert len(gpud.events(kind="start", serve="b")) == 1, journal
        stops = gpud.events(kind="stop", serve="a")
        assert stops and all(e.get("details", {}).get("in_flight", {}).get("outcome")
                             != "aborted" for e in stops), stops


def busy_config(evict_busy: bool, sleeps: bool = True) -> str:
    """a (can sleep, or only be stopped) and b as above, a brought up by a request evictable
    after 1 s, a drain bound of 1 s; router.evict_busy as its default (true), or false. a runs
    in vLLM's dev mode either way (what gpud gives a fronted vllm serve: its /pause)."""
    dev = 'environment = { VLLM_SERVER_DEV_MODE = "1" }\n'
    sleeper = ("--enable-sleep-mode", "--context-mib", "200", "--asleep-mib", "800")
    sleep = 'sleep_level = 1\nsleep_mib = 800\n' if sleeps else ""
    args = (*(sleeper if sleeps else ()), '--token-interval-s', '0.02', '--served-model-name', 'a')
    serves = (f'[serves.a]\nrole = "r"\nvram_mib = 20000\nport = {PORT}\non_demand = true\n'
              f'start_timeout_s = 30\nmodels = ["a"]\n{sleep}{dev}'
              f"command = {standin_uds(*args)}\n"
              + on_demand("b", PORT + 1))
    router = (f'[router]\nlisten = "127.0.0.1:{ROUTER}"\nqueue_timeout_s = 40\nmax_queued = 8\n'
              "min_awake_s = 1\n" + ("" if evict_busy else "evict_busy = false\n"))
    return sim_config(ROLE_R, serves, daemon="drain_timeout_s = 1") + router


@pytest.mark.parametrize(("evict_busy", "sleeps"), [(True, True), (False, True), (True, False)],
                         ids=["sleeps", "sleeps-not-cut", "stops"])
def test_a_long_stream_holds_its_device_only_to_the_drain_bound_unless_told(
        gpud: SandboxGpud, evict_busy: bool, sleeps: bool) -> None:
    """Issue 50 item 6: a 20 s stream on a, then a request for b that needs a's memory. With
    router.evict_busy (the default), b waits for the drain's bound (1 s), not for the stream:
    the stream ends with vLLM's abort chunk (a's sleep with mode=abort; or, when a can only be
    stopped, /pause?mode=abort before its stop), then an error event in OpenAI's shape naming
    why, then [DONE] (never a stream that merely stops), and the journal names a, b and the
    requests ended. With evict_busy = false the eviction is refused as before: the stream runs
    to its end and b comes up after it."""
    with fronted_gpud(gpud, busy_config(evict_busy, sleeps), [USER]):
        stream = json.dumps({"model": "a", "prompt": "a b", "max_tokens": 1000,
                             "stream": True})
        other = json.dumps({"model": "b", "prompt": "a b", "max_tokens": 2})
        script = (
            "rm -f /tmp/m8-stream; "
            f"curl -sN --max-time 60 -d '{stream}' http://127.0.0.1:{ROUTER}/v1/completions "
            "> /tmp/m8-stream & "
            "for i in $(seq 600); do grep -q '^data: {' /tmp/m8-stream 2>/dev/null && break; "
            "sleep 0.05; done; "
            "sleep 1.5; began=$(date +%s%N); "
            f"curl -s -o /dev/null --max-time 60 -w 'b=%{{http_code}}\\n' -d '{other}' "
            f"http://127.0.0.1:{ROUTER}/v1/completions; "
            "echo waited_ms=$(( ($(date +%s%N) - began) / 1000000 )); wait; "
            "echo chunks=$(grep -c '^data: {\"id\"' /tmp/m8-stream) "
            "done=$(grep -c '^data: \\[DONE\\]' /tmp/m8-stream) "
            "aborted=$(grep -c '\"finish_reason\": *\"abort\"' /tmp/m8-stream) "
            "errors=$(grep -c '^data: {\"error\"' /tmp/m8-stream); "
            "tail -c 900 /tmp/m8-stream >&2")
        ran = gpud.sb.run(["bash", "-c", script], user=USER, timeout=150)
        # this gpud's own lines (the sandbox's journal has those of the other case before)
        journal = gpud.journal_tail(400)
        journal = journal[journal.rfind("front started"):]
        got = dict(w.split("=") for w in ran.stdout.split())
        tail = ran.stderr
        print(f"evict_busy {evict_busy}: {got}")
        assert got["b"] == "200", (got, tail, journal)
        assert got["done"] == "1", (got, tail)  # a clean end either way
        slept = [e for e in gpud.events(kind="sleep", serve="a") if "in_flight" in e["details"]]
        if evict_busy:
            # b came up after about the drain's bound, not after the stream's 20 s
            assert int(got["waited_ms"]) < 12000, (got, journal)
            assert int(got["chunks"]) < 1000, got
            # told, in order: the abort chunk, the error event, [DONE]
            assert got["aborted"] == "1" and got["errors"] == "1", (got, tail)
            last = [line for line in tail.splitlines() if line.startswith("data: ")][-3:]
            assert '"abort"' in last[0] and last[2] == "data: [DONE]", tail
            error = json.loads(last[1].removeprefix("data: "))["error"]
            assert error["code"] == "request_aborted" and error["type"] == "server_error", error
            assert "serve a" in error["message"] and "drain" in error["message"], error
            assert "on-demand a: 1 request(s) in flight ended for serve b" in journal, journal
            if sleeps:
                assert slept and slept[-1]["details"]["in_flight"]["outcome"] == "aborted", slept
            else:
                stops = [e for e in gpud.events(kind="stop", serve="a")
                         if "in_flight" in e["details"]]
                assert stops and stops[-1]["details"]["in_flight"]["outcome"] == "aborted", stops
        else:
            assert int(got["chunks"]) >= 1000 and got["aborted"] == "0", (got, tail)
            assert got["errors"] == "0", tail
            assert int(got["waited_ms"]) > 15000, got  # the stream's rest
            assert "on-demand a: eviction for b refused" in journal, journal
            assert "request(s) in flight ended for" not in journal, journal


@pytest.mark.parametrize("sleeps", [True, False], ids=["sleeps", "stops"])
def test_a_responses_stream_cut_past_the_drain_bound_is_told(gpud: SandboxGpud,
                                                             sleeps: bool) -> None:
    """Issue 50 item 6 on /v1/responses: vLLM ends an aborted responses stream as a whole one
    (response.completed, status "completed"; the stand-in too: tests/vllm/test_contract.py),
    so gpud notes the cut for the router just before its abort (a sleep's mode=abort, or the
    pause before a stop), and the router sends an error event after response.completed."""
    with fronted_gpud(gpud, busy_config(True, sleeps), [USER]):
        stream = json.dumps({"model": "a", "input": "a b", "max_output_tokens": 1000,
                             "stream": True})
        other = json.dumps({"model": "b", "prompt": "a b", "max_tokens": 2})
        script = (
            "rm -f /tmp/m9-stream; "
            f"curl -sN --max-time 60 -d '{stream}' http://127.0.0.1:{ROUTER}/v1/responses "
            "> /tmp/m9-stream & "
            "for i in $(seq 600); do grep -q '^event: response.output_text.delta' "
            "/tmp/m9-stream 2>/dev/null && break; sleep 0.05; done; "
            "sleep 1.5; "
            f"curl -s -o /dev/null --max-time 60 -w 'b=%{{http_code}}\\n' -d '{other}' "
            f"http://127.0.0.1:{ROUTER}/v1/completions; wait; "
            "echo deltas=$(grep -c '^event: response.output_text.delta' /tmp/m9-stream); "
            "grep '^event: ' /tmp/m9-stream | tail -n 3 >&2; "
            "grep '^data: ' /tmp/m9-stream | tail -n 1 >&2")
        ran = gpud.sb.run(["bash", "-c", script], user=USER, timeout=150)
        got = dict(w.split("=") for w in ran.stdout.split())
        *names, error_line = ran.stderr.splitlines()
        assert got["b"] == "200", (got, ran.stderr)
        assert int(got["deltas"]) < 1000, got  # cut, not run to its end
        assert names == ["event: response.output_item.done", "event: response.completed",
                         "event: error"], ran.stderr
        error = json.loads(error_line.removeprefix("data: "))
        assert (error["type"], error["code"]) == ("error", "request_aborted"), error
        assert "serve a" in error["message"] and "drain" in error["message"], error
