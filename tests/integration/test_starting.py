"""A request for a serve that is starting waits for it (docs/router.md, "Bringing a serve up"):
an operator starts x and y, which share a device; y waits for x's load behind the device's start
lock (admitted, its launch under way) when a request for y comes through the router. It is
answered once y is up, not refused at once; and a serve whose start fails answers the request
that waited for it with the reason, at once. Real systemd, gpud, the front's nginx with the
router, simulated GPU, stand-in serves."""

from __future__ import annotations

import json
import subprocess
import time

from tests.integration.gpudctl import SandboxGpud, fronted_gpud, sim_config, standin_uds
from tests.waiting import wait_until

ROUTER = 30700
PORT = 30701
USER = "gpud-starting-client"
LOAD_S = 3


def config() -> str:
    serves = "".join(
        f'[serves.{name}]\nrole = "r"\nvram_mib = 8000\nport = {PORT + i}\n'
        # w: always on, behind its front (a serve's socket, as the on-demand ones)
        f'{"front = true" if name == "w" else "on_demand = true"}\n'
        f'start_timeout_s = 30\nmodels = ["{name}"]\n'
        f"command = {standin_uds('--startup-delay', str(LOAD_S), '--served-model-name', name, *extra)}\n"
        for i, (name, extra) in enumerate((("x", ()), ("y", ()),
                                           ("z", ("--crash-after", "0.5")),
                                           ("w", ()))))
    role = '[roles.r]\ndevice = "GPU-sim-0"\nreserve_mib = 1000\n'
    router = f'[router]\nlisten = "127.0.0.1:{ROUTER}"\nqueue_timeout_s = 30\n'
    return sim_config(role, serves) + router


def ask(gpud: SandboxGpud, model: str) -> subprocess.Popen[str]:
    body = json.dumps({"model": model, "prompt": "a b", "max_tokens": 2})
    return gpud.sb.popen(
        f"curl -s --max-time 60 -w '\\n%{{http_code}}' -d '{body}' "
        f"http://127.0.0.1:{ROUTER}/v1/completions", user=USER, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True)


def test_a_request_for_a_serve_an_operator_is_starting_waits_for_it(gpud: SandboxGpud) -> None:
    with fronted_gpud(gpud, config(), [USER]):
        began = time.monotonic()
        for name in ("x", "y"):
            assert gpud.call("POST", f"/v1/serves/{name}/start", {}).status in (200, 202)
        wait_until(lambda: gpud.serve("y")["state"] in ("admitted", "starting"), timeout=10,
                   what="y's start under way")
        waiting = ask(gpud, "y")
        out, _ = waiting.communicate(timeout=90)
        took = time.monotonic() - began
        body, _, status = out.rpartition("\n")
        print(f"y: {status} after {took:.1f} s: {body[:200]}")
        assert status == "200", (out, gpud.journal_tail(60))
        # it waited for x's load and its own (two stand-in loads of LOAD_S)
        assert took >= LOAD_S, took
        assert len(gpud.events(kind="start", serve="y")) == 1


def test_a_start_that_fails_answers_the_waiting_request_with_its_reason(
        gpud: SandboxGpud) -> None:
    with fronted_gpud(gpud, config(), [USER]):
        for name in ("x", "z"):
            assert gpud.call("POST", f"/v1/serves/{name}/start", {}).status in (200, 202)
        wait_until(lambda: gpud.serve("z")["state"] in ("admitted", "starting"), timeout=10,
                   what="z's start under way")
        out, _ = ask(gpud, "z").communicate(timeout=90)
        body, _, status = out.rpartition("\n")
        print(f"z: {status}: {body[:300]}")
        assert status == "503", out
        assert gpud.serve("z")["state"] == "failed", gpud.serve("z")


def test_a_request_for_an_always_on_serve_that_is_starting_waits_for_it(
        gpud: SandboxGpud) -> None:
    """w is not on demand and cannot sleep: the router asks gpud nothing while it answers,
    and when it does not (its start under way), the request waits for gpud's word instead of
    a 503 at once; stopped, it is refused at once with why."""
    with fronted_gpud(gpud, config(), [USER]):
        began = time.monotonic()
        assert gpud.call("POST", "/v1/serves/w/start", {}).status in (200, 202)
        wait_until(lambda: gpud.serve("w")["state"] in ("admitted", "starting"), timeout=10,
                   what="w's start under way")
        out, _ = ask(gpud, "w").communicate(timeout=90)
        took = time.monotonic() - began
        body, _, status = out.rpartition("\n")
        print(f"w: {status} after {took:.1f} s: {body[:200]}")
        assert status == "200", (out, gpud.journal_tail(60))
        assert took >= LOAD_S, took
        assert len(gpud.events(kind="start", serve="w")) == 1
        assert gpud.call("POST", "/v1/serves/w/stop", {}).status in (200, 202)
        wait_until(lambda: gpud.serve("w")["state"] == "declared", timeout=30, what="w stopped")
        began = time.monotonic()
        out, _ = ask(gpud, "w").communicate(timeout=90)
        body, _, status = out.rpartition("\n")
        print(f"w stopped: {status} after {time.monotonic() - began:.2f} s: {body[:300]}")
        assert status == "503", out
        assert time.monotonic() - began < 5
        assert "is stopped and not on_demand" in body, body
        assert len(gpud.events(kind="start", serve="w")) == 1  # not started by the request
