"""Requests in flight under real systemd, through the front's nginx, to stand-ins that treat them
as vLLM's engine does across a sleep (gpud/testing/standin.py): idle time counts from the end of
the last request, a preemption drains its victim, a request that arrives during a sleep waits
for it and is answered by the woken serve."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.gpudctl import SandboxGpud, sim_config, standin, standin_uds
from tests.waiting import wait_until

SL, ST, LO, HI, SX, LS = 30191, 30192, 30193, 30194, 30195, 30196
TOKEN_S = 0.2
DEV = 'environment = { VLLM_SERVER_DEV_MODE = "1" }\n'


def flight_config(daemon: str = "") -> str:
    sleeper = ["--enable-sleep-mode", "--context-mib", "200", "--asleep-mib", "800"]
    tokens = ["--token-interval-s", str(TOKEN_S)]
    # on demand, asleep after 2 s idle; its sleep takes 3 s once the engine is paused (a level-1
    # sleep copies the weights to host RAM: seconds for a real model)
    serves = (f'[serves.sl]\nrole = "r"\nvram_mib = 4000\nport = {SL}\nfront = true\n'
              "on_demand = true\nstart_timeout_s = 60\nsleep_level = 1\nsleep_mib = 800\n"
              f"idle_sleep_s = 2\n{DEV}"
              f"command = {standin_uds(*sleeper, *tokens, '--sleep-delay-s', '3')}\n")
    # on demand, stopped after 2 s idle
    serves += (f'[serves.st]\nrole = "r"\nvram_mib = 4000\nport = {ST}\nfront = true\n'
               "on_demand = true\nstart_timeout_s = 60\nidle_stop_s = 2\n"
               f"command = {standin_uds(*tokens)}\n")
    # on demand, stopped after 2 s idle, and its stop takes 3 s (it ignores SIGTERM: systemd
    # kills it at stop_timeout_s)
    serves += (f'[serves.sx]\nrole = "r"\nvram_mib = 4000\nport = {SX}\nfront = true\n'
               "on_demand = true\nstart_timeout_s = 60\nidle_stop_s = 2\nstop_timeout_s = 3\n"
               f"command = {standin_uds('--ignore-sigterm')}\n")
    # a preemption's victim (fronted, sleeps) and the serve that needs its room
    serves += (f'[serves.lo]\nrole = "r"\nvram_mib = 12000\npriority = 50\nport = {LO}\n'
               f"front = true\nsleep_level = 1\nsleep_mib = 800\n{DEV}"
               f"command = {standin_uds(*sleeper, *tokens)}\n")
    # a preemption's victim that is stopped, not put to sleep (in vLLM's dev mode, as gpud runs
    # a fronted vllm serve: what outlasts the drain is told its end, /pause?mode=abort); an
    # operator's stop gives what is in flight 2 s (launch.stop_budget of its stop_timeout_s)
    serves += (f'[serves.ls]\nrole = "r"\nvram_mib = 12000\npriority = 50\nport = {LS}\n'
               f'front = true\npreemptible = "stop"\nstop_timeout_s = 6\n{DEV}'
               f"command = {standin_uds(*tokens)}\n")
    serves += (f'[serves.hi]\nrole = "r"\nvram_mib = 20000\npriority = 10\nport = {HI}\n'
               f"command = {standin()}\n")
    return sim_config('[roles.r]\ndevice = "GPU-sim-0"\nreserve_mib = 1000\n', serves,
                      daemon=daemon)


@pytest.fixture
def flight(gpud: SandboxGpud, request: pytest.FixtureRequest) -> Iterator[SandboxGpud]:
    daemon = getattr(request, "param", "")
    try:
        gpud.configure(flight_config(daemon))
        gpud.wait_front()
        yield gpud
    finally:
        gpud.reset()


class Stream:
    """A streamed completion through the front, read whole by curl in a thread."""

    def __init__(self, gpud: SandboxGpud, port: int, tokens: int) -> None:
        self.gpud, self.port, self.tokens = gpud, port, tokens
        self.out = ""
        self.ended_at = 0.0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = json.dumps({"prompt": "a b", "max_tokens": self.tokens, "stream": True})
        result = self.gpud.sb.run(
            ["bash", "-c", f"curl -sN -m 60 -d '{body}' "
                           f"http://127.0.0.1:{self.port}/v1/completions; echo curl-exit=$?"],
            timeout=90, check=False)
        self.ended_at = time.time()
        self.out = result.stdout

    def whole(self) -> list[str]:
        """The stream's data lines, asserted complete: every token, no abort, a clean end."""
        self.thread.join(90)
        assert not self.thread.is_alive()
        data = [line for line in self.out.splitlines() if line.startswith("data: ")]
        assert self.out.rstrip().endswith("curl-exit=0"), self.out
        assert data[-1] == "data: [DONE]", self.out
        assert len(data) == self.tokens + 1, self.out
        assert '"abort"' not in self.out, self.out
        return data


def event_after(gpud: SandboxGpud, kind: str, serve: str, after: float,
                timeout: float = 20) -> dict[str, Any]:
    """The first KIND event of SERVE at or after AFTER (epoch seconds)."""
    found: list[dict[str, Any]] = []

    def seen() -> bool:
        found[:] = [e for e in gpud.events(kind=kind, serve=serve) if e["ts"] >= after]
        return bool(found)

    wait_until(seen, timeout=timeout, what=f"a {kind} event of {serve}")
    return found[0]


def answered(gpud: SandboxGpud, port: int) -> str:
    out = gpud.sb.run(["curl", "-s", "-m", "60", "-w", "\n%{http_code}",
                       f"http://127.0.0.1:{port}/v1/models"], timeout=90, check=False).stdout
    return out.rpartition("\n")[2]


def test_streams_longer_than_idle_stop_and_idle_sleep_arrive_whole(flight: SandboxGpud) -> None:
    gpud = flight
    assert answered(gpud, SL) == answered(gpud, ST) == "200"  # both up
    # 30 tokens 0.2 s apart: 6 s, three times their idle time
    began = time.time()
    streams = {name: Stream(gpud, port, 30) for name, port in (("sl", SL), ("st", ST))}
    wait_until(lambda: all(gpud.serve(n)["in_flight"] == 1 for n in streams), timeout=10,
               what="both streams counted in flight")
    assert gpud.serve("sl")["last_activity_s_ago"] == 0.0  # a request runs: not idle
    assert dict((s["serve"], v) for s, v in gpud.metrics("gpud_requests_in_flight")
                if s["serve"] in streams) == {"sl": 1, "st": 1}
    for stream in streams.values():
        stream.whole()
    # idle from each stream's end: asleep and stopped 2 s (and a read, 0.5 s, and the 0.5 s
    # check) after it, not during it
    asleep = event_after(gpud, "sleep", "sl", began)
    stopped = event_after(gpud, "stop", "st", began)
    assert asleep["ts"] >= streams["sl"].ended_at + 1.0, (asleep, streams["sl"].ended_at)
    assert stopped["ts"] >= streams["st"].ended_at + 1.0, (stopped, streams["st"].ended_at)
    assert asleep["details"]["in_flight"]["outcome"] == "none", asleep
    assert "no request in flight" in stopped["message"], stopped
    assert 2.0 <= asleep["details"]["idle_s"] < 4.0, asleep
    assert gpud.standin_state("sl")["sleep_mode"] == "wait"


def test_a_stream_begun_before_a_gpud_restart_is_not_slept_under(flight: SandboxGpud) -> None:
    gpud = flight
    assert answered(gpud, SL) == "200"
    began = time.time()
    stream = Stream(gpud, SL, 75)  # 15 s
    wait_until(lambda: gpud.serve("sl")["in_flight"] == 1, timeout=10, what="stream counted")
    gpud.sb.run(["systemctl", "restart", "gpud.service"], timeout=60)
    # the new gpud sees the stream at its first read of the serve's count: no sleep under it
    wait_until(lambda: gpud.serve("sl")["in_flight"] == 1, timeout=10,
               what="stream counted by the new gpud")
    stream.whole()
    asleep = event_after(gpud, "sleep", "sl", began)
    assert asleep["ts"] >= stream.ended_at + 1.0, (asleep, stream.ended_at)


def test_a_request_during_an_idle_sleep_waits_and_is_answered_awake(flight: SandboxGpud) -> None:
    gpud = flight
    assert answered(gpud, SL) == "200"
    # idle 2 s: the sleep begins (the engine paused), and takes 3 s
    wait_until(lambda: gpud.standin_state("sl")["sleep_mode"] is not None, timeout=15,
               what="the idle sleep under way")
    assert gpud.serve("sl")["state"] == "running"  # until the sleep commits
    # 4 tokens: the stand-in's echo whole ("[gpud-standin echo] hello there"); it answers no
    # more than max_tokens, as vLLM does
    body = json.dumps({"prompt": "hello there", "max_tokens": 4})
    sent = time.time()
    out = gpud.sb.run(["curl", "-s", "-m", "30", "-w", "\n%{http_code}", "-d", body,
                       f"http://127.0.0.1:{SL}/v1/completions"], timeout=60, check=False).stdout
    got = time.time()
    text, _, status = out.rpartition("\n")
    assert status == "200", out
    assert "hello there" in json.loads(text)["choices"][0]["text"], out
    asleep = gpud.wait_event("sleep", timeout=5, serve="sl")
    woken = gpud.wait_event("wake", timeout=5, serve="sl")
    # the sleep finished, then the wake, then the answer
    assert sent <= asleep["ts"] <= woken["ts"] <= got, (sent, asleep, woken, got)
    assert gpud.serve("sl")["state"] == "running"


def test_a_request_during_an_idle_stop_waits_and_is_answered_by_a_new_start(
        flight: SandboxGpud) -> None:
    gpud = flight
    assert answered(gpud, SX) == "200"
    first = gpud.serve("sx")["main_pid"]
    gpud.wait_state("sx", "stopping", timeout=15)  # idle 2 s; the stop takes 3 s
    sent = time.time()
    assert answered(gpud, SX) == "200"
    got = time.time()
    stopped = event_after(gpud, "stop", "sx", sent - 5)
    started = event_after(gpud, "start", "sx", sent)
    # the stop finished (3 s: SIGTERM ignored, SIGKILL at stop_timeout_s), then a new start,
    # then the answer: from a new process
    assert stopped["ts"] + 2.5 <= started["ts"] <= got, (stopped, started, got)
    assert gpud.serve("sx")["main_pid"] not in (None, first)


def test_a_preemption_drains_the_stream_in_flight(flight: SandboxGpud) -> None:
    gpud = flight
    assert gpud.call("POST", "/v1/serves/lo/start", {}).status == 200
    gpud.wait_state("lo", "running")
    stream = Stream(gpud, LO, 20)  # 4 s
    wait_until(lambda: gpud.serve("lo")["in_flight"] == 1, timeout=10, what="stream counted")
    began = time.time()
    reply = gpud.call("POST", "/v1/serves/hi/start", {"preempt": True})
    assert reply.status == 200, reply.raw
    data = stream.whole()
    assert len(data) == 21
    assert time.time() - began < 30  # within drain_timeout_s (30 s by default)
    asleep = gpud.wait_event("sleep", timeout=5, serve="lo")
    drained = asleep["details"]["in_flight"]
    assert (drained["outcome"], drained["before"], drained["after"]) == ("drained", 1, 0), asleep
    assert drained["bound_s"] == 30.0
    assert "1 request(s) in flight drained in" in asleep["message"], asleep
    assert asleep["ts"] >= stream.ended_at - 1.0  # the memory went once the stream was done
    assert gpud.standin_state("lo")["sleep_mode"] == "wait"
    gpud.wait_state("hi", "running")


def test_a_preemption_by_stop_drains_the_stream_in_flight_first(flight: SandboxGpud) -> None:
    gpud = flight
    assert gpud.call("POST", "/v1/serves/ls/start", {}).status == 200
    gpud.wait_state("ls", "running")
    stream = Stream(gpud, LS, 20)  # 4 s
    wait_until(lambda: gpud.serve("ls")["in_flight"] == 1, timeout=10, what="stream counted")
    reply = gpud.call("POST", "/v1/serves/hi/start", {"preempt": True})
    assert reply.status == 200, reply.raw
    stream.whole()  # SIGTERM came after it: a stand-in (and vLLM) aborts what runs then
    stopped = [e for e in gpud.events(kind="stop", serve="ls") if "in_flight" in e["details"]]
    assert len(stopped) == 1, gpud.events(kind="stop", serve="ls")
    drained = stopped[0]["details"]["in_flight"]
    assert (drained["outcome"], drained["before"], drained["after"]) == ("drained", 1, 0)
    assert "1 request(s) in flight drained in" in stopped[0]["message"], stopped
    assert stopped[0]["ts"] >= stream.ended_at - 1.0


@pytest.mark.parametrize("flight", ["drain_timeout_s = 1"], indirect=True)
def test_a_preemption_by_stop_tells_what_outlasts_the_drain_bound(flight: SandboxGpud) -> None:
    """Issue 50 item 6: a stream on a victim that can only be stopped, still in flight at the
    drain's bound, is ended with a told end (/pause?mode=abort: a last chunk with finish_reason
    "abort", then [DONE]) before the stop, not cut by it (the stand-in exits on SIGTERM with
    the stream unended; real vLLM 0.32 leaves it open until systemd's SIGKILL)."""
    gpud = flight
    assert gpud.call("POST", "/v1/serves/ls/start", {}).status == 200
    gpud.wait_state("ls", "running")
    stream = Stream(gpud, LS, 100)  # 20 s
    wait_until(lambda: gpud.serve("ls")["in_flight"] == 1, timeout=10, what="stream counted")
    assert gpud.call("POST", "/v1/serves/hi/start", {"preempt": True}).status == 200
    stream.thread.join(30)
    assert '"finish_reason": "abort"' in stream.out and "data: [DONE]" in stream.out, stream.out
    assert stream.out.count("data: {") < 100, stream.out  # not run to its end
    stopped = [e for e in gpud.events(kind="stop", serve="ls") if "in_flight" in e["details"]]
    drained = stopped[-1]["details"]["in_flight"]
    assert (drained["outcome"], drained["before"], drained["after"]) == ("aborted", 1, 1), stopped
    gpud.wait_state("hi", "running")


def test_an_operators_stop_tells_what_outlasts_the_serves_shutdown_bound(
        flight: SandboxGpud) -> None:
    """`gpuctl stop` of a serve that can be told (dev mode, behind its front): what is in flight
    has the serve's own shutdown bound to finish (launch.stop_budget: 2 s of ls's 6 s
    stop_timeout_s), then is told its end (/pause?mode=abort: a last chunk with finish_reason
    "abort", then [DONE]) before SIGTERM, not cut by the stop (the stand-in exits on SIGTERM
    with the stream unended; vLLM 0.32 leaves it open with no last chunk)."""
    gpud = flight
    assert gpud.call("POST", "/v1/serves/ls/start", {}).status == 200
    gpud.wait_state("ls", "running")
    stream = Stream(gpud, LS, 100)  # 20 s
    wait_until(lambda: gpud.serve("ls")["in_flight"] == 1, timeout=10, what="stream counted")
    began = time.monotonic()
    reply = gpud.call("POST", "/v1/serves/ls/stop", {})
    took = time.monotonic() - began
    assert reply.status == 200, reply.raw
    stream.thread.join(30)
    assert '"finish_reason": "abort"' in stream.out and "data: [DONE]" in stream.out, stream.out
    assert stream.out.rstrip().endswith("curl-exit=0"), stream.out
    assert stream.out.count("data: {") < 100, stream.out  # not run to its end
    stopped = [e for e in gpud.events(kind="stop", serve="ls") if "in_flight" in e["details"]]
    assert len(stopped) == 1, gpud.events(kind="stop", serve="ls")
    drained = stopped[0]["details"]["in_flight"]
    assert (drained["outcome"], drained["before"], drained["after"], drained["bound_s"]) == \
        ("aborted", 1, 1, 2), stopped
    assert took >= 2, took  # the stream had its bound first
    assert gpud.serve("ls")["state"] == "declared"  # stopped, its reservation released


@pytest.mark.parametrize("flight", ["drain_timeout_s = 1"], indirect=True)
def test_a_preemption_aborts_what_outlasts_the_drain_bound(flight: SandboxGpud) -> None:
    gpud = flight
    assert gpud.call("POST", "/v1/serves/lo/start", {}).status == 200
    gpud.wait_state("lo", "running")
    stream = Stream(gpud, LO, 100)  # 20 s
    wait_until(lambda: gpud.serve("lo")["in_flight"] == 1, timeout=10, what="stream counted")
    assert gpud.call("POST", "/v1/serves/hi/start", {"preempt": True}).status == 200
    stream.thread.join(30)
    # cut, and told: a last chunk with finish_reason "abort", then a clean end
    assert '"finish_reason": "abort"' in stream.out and "data: [DONE]" in stream.out, stream.out
    asleep = gpud.wait_event("sleep", timeout=5, serve="lo")
    drained = asleep["details"]["in_flight"]
    assert (drained["outcome"], drained["before"], drained["after"]) == ("aborted", 1, 1), asleep
    assert "1 of 1 request(s) in flight aborted after the 1 s drain bound" in asleep["message"]
    assert gpud.standin_state("lo")["sleep_mode"] == "abort"
