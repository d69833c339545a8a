"""Bounded waits and one lock order, under real systemd in the sandbox: a serve stopped with
SIGSTOP during its wake or its sleep (the request gets no answer: it fails in time, the serve
keeps its full reservation and is restarted), a dry run that never waits on a hung wake, and a
neighbour's sleep that waits for a slow start on the same device."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tests.conftest import Reply
from tests.integration.gpudctl import SandboxGpud, sim_config, standin
from tests.integration.test_reconcile import wait_for
from tests.integration.test_sleep import ROLE, checked, reserved, running, serve

pytestmark = pytest.mark.sandbox

BOUNDED = "sleep_timeout_s = 2\nwake_timeout_s = 2\n"


class Later(threading.Thread):
    """A request sent in the background, with how long its answer took."""

    def __init__(self, gpud: SandboxGpud, method: str, path: str, body: Any) -> None:
        super().__init__(daemon=True)
        self.gpud, self.args = gpud, (method, path, body)
        self.reply: Reply | None = None
        self.took = 0.0
        self.start()

    def run(self) -> None:
        began = time.monotonic()
        self.reply = self.gpud.call(*self.args)
        self.took = time.monotonic() - began


def stop_process(gpud: SandboxGpud, name: str) -> int:
    pid = int(gpud.serve(name)["main_pid"])
    gpud.sb.run(["kill", "-STOP", str(pid)])
    return pid


def test_a_hung_wake_fails_in_time_and_the_serve_is_restarted_at_full_size(
        gpud: SandboxGpud) -> None:
    gpud.configure(sim_config(ROLE, serve("lo", 12000, 50, 30101, level=1)
                              + serve("hi", 16000, 10, 30103)
                              + serve("big", 26000, 10, 30104), daemon=BOUNDED))
    running(gpud, "lo")
    checked(gpud, "/v1/serves/{name}/sleep", "lo")
    old = stop_process(gpud, "lo")
    wake = Later(gpud, "POST", "/v1/serves/lo/wake", {})
    wait_for("the wake under way", lambda: reserved(gpud) == {"lo": 12000})
    # a preemption's dry run answers at once, whatever the wake waits on
    began = time.monotonic()
    dry = gpud.call("POST", "/v1/serves/big/start", {"preempt": True, "dry_run": True})
    assert time.monotonic() - began < 1.0 and dry.status == 200, dry.raw
    wake.join(20)
    assert wake.reply is not None, "the wake did not answer within 20 s"
    assert wake.reply.status == 503 and "no answer within 2 s" in \
        wake.reply.body["error"]["message"], wake.reply.raw
    assert wake.took < 10, wake.took
    [ev] = [e for e in gpud.events(serve="lo", kind="unhealthy") if e["details"].get("wake_failed")]
    assert "keeps its full reservation (12000 MiB) and is restarted" in ev["message"], ev
    view = gpud.wait_state("lo", "running")
    assert view["main_pid"] != old and view["reserved_mib"] == 12000
    assert reserved(gpud) == {"lo": 12000}
    assert gpud.standin_state("lo")["sleep_level"] is None


def test_a_serve_stopped_during_its_sleep_is_not_committed_asleep(gpud: SandboxGpud) -> None:
    gpud.configure(sim_config(ROLE, serve("lo", 12000, 50, 30101, level=1), daemon=BOUNDED))
    running(gpud, "lo")
    old = stop_process(gpud, "lo")
    began = time.monotonic()
    reply = gpud.call("POST", "/v1/serves/lo/sleep", {})
    assert time.monotonic() - began < 10
    assert reply.status == 503 and "no answer within 2 s" in reply.body["error"]["message"], \
        reply.raw
    assert reserved(gpud) == {"lo": 12000}  # never shrunk
    # health restarts it (it answers nothing), under its lock: awake, at its full size
    view = wait_for("lo restarted", lambda: (v := gpud.serve("lo"))["state"] == "running"
                    and v["main_pid"] != old and v, timeout=30)
    assert view["reserved_mib"] == 12000 and reserved(gpud) == {"lo": 12000}
    assert gpud.standin_state("lo")["sleep_level"] is None
    assert not [e for e in gpud.events(serve="lo", kind="sleep")]


def test_a_neighbours_sleep_waits_for_a_slow_start_on_its_device(gpud: SandboxGpud) -> None:
    slow = ('[serves.slow]\nrole = "r"\nvram_mib = 8000\nport = 30106\n'
            f"command = {standin('--startup-delay', '3')}\n")
    gpud.configure(sim_config(ROLE, serve("lo", 12000, 50, 30101, level=1) + slow))
    running(gpud, "lo")
    assert gpud.call("POST", "/v1/serves/slow/start", {}).status == 200
    gpud.wait_event("start", serve="slow")
    asleep = checked(gpud, "/v1/serves/{name}/sleep", "lo")  # waits for slow's window to end
    assert asleep["state"] == "sleeping"
    # slow loads for 3 s after its unit started: lo's memory did not move meanwhile
    started = gpud.events(serve="slow", kind="start")[0]["ts"]
    slept = gpud.events(serve="lo", kind="sleep")[0]["ts"]
    assert slept - started >= 2.9, (started, slept)
    assert gpud.serve("slow")["state"] == "running"


def test_a_sleeping_serve_is_health_checked_too(gpud: SandboxGpud) -> None:
    gpud.configure(sim_config(ROLE, serve("lo", 12000, 50, 30101, level=1)))
    running(gpud, "lo")
    checked(gpud, "/v1/serves/{name}/sleep", "lo")
    stop_process(gpud, "lo")
    # restarted, it would load at its full size on its sleep reservation: stopped and failed
    view = gpud.wait_state("lo", "failed", timeout=30)
    assert "while asleep" in view["reason"], view
    assert reserved(gpud) == {}
    assert "gpud-serve-lo.service" not in gpud.serve_units()
