"""The boot under real systemd, stand-ins for vLLM with real start times on one simulated GPU:
exactly sized serves (vllm.kv_cache_mib) start together, util-sized ones alone; the stand-ins
mis-size as vLLM does (#55827) when two profile at once, so starting two util-sized serves
together fails the resident set."""

from __future__ import annotations

import itertools

import pytest

from tests.integration.gpudctl import STANDIN, SandboxGpud, sim_config

pytestmark = pytest.mark.sandbox

ROLE = '[roles.r]\ndevice = "GPU-sim-0"\n'
OBSERVE_S = 0.5  # sim_config's observe_interval_s


def wrapper(name: str) -> str:
    return f"/usr/local/bin/vllm-standin-{name}"


def vllm_serves(spec: list[tuple[str, float, int | None]]) -> str:
    """Serves NAME with the stand-in as their `vllm`; KV sized in MiB or by profiling (None)."""
    out = ""
    for i, (name, _delay, kv) in enumerate(spec):
        out += (f'[serves.{name}]\nrole = "r"\nvram_mib = 4096\nresident = true\n'
                f"priority = {10 * (i + 1)}\nport = {30100 + i}\n"
                f'[serves.{name}.vllm]\nmodel = "org/{name}"\nexecutable = "{wrapper(name)}"\n'
                + (f"kv_cache_mib = {kv}\n" if kv is not None else ""))
    return out


def boot(gpud: SandboxGpud, spec: list[tuple[str, float, int | None]]) -> dict[tuple[str, str],
                                                                              float]:
    """Boot the resident set, each stand-in loading for its DELAY s; the start and healthy
    events' times."""
    gpud.configure(sim_config(ROLE, vllm_serves(spec)), start=False)
    for name, delay, _ in spec:
        gpud.sb.write_file(wrapper(name), f'#!/bin/sh\nexec {" ".join(STANDIN)} "$@" '
                           f"--startup-delay {delay}\n", mode=0o755)
    gpud.start()
    for name, _, _ in spec:
        assert gpud.wait_state(name, "running", "failed", timeout=60)["state"] == "running", \
            gpud.journal_tail()
    # No stand-in mis-sized and was restarted into running alone.
    assert [e for e in gpud.events() if e["kind"] in ("exit", "restart", "crash-loop")] == []
    return {(e["kind"], e["serve"]): e["ts"] for e in gpud.events()
            if e["kind"] in ("start", "healthy")}


def test_four_exactly_sized_serves_boot_as_fast_as_the_slowest(gpud: SandboxGpud) -> None:
    spec: list[tuple[str, float, int | None]] = [
        ("e1", 2.0, 1024), ("e2", 2.5, 1024), ("e3", 3.0, 1024), ("e4", 4.0, 1024)]
    ts = boot(gpud, spec)
    starts = [ts[("start", n)] for n, _, _ in spec]
    assert max(starts) - min(starts) <= OBSERVE_S  # together, within one observation interval
    slowest = ts[("healthy", "e4")] - ts[("start", "e4")]
    wall = max(ts[("healthy", n)] for n, _, _ in spec) - min(starts)
    assert wall <= 1.3 * slowest, (wall, slowest)
    ev = [e for e in gpud.events(kind="start")]
    assert {e["details"]["device_lock"] for e in ev} == {"shared"}


def test_util_sized_serves_never_profile_together(gpud: SandboxGpud) -> None:
    """Each stand-in sized by profiling fails (vLLM's ValueError) if another one loads on the
    device meanwhile: the resident set runs only because gpud starts them one at a time, and
    the exactly sized one among them together with neither."""
    spec: list[tuple[str, float, int | None]] = [
        ("u1", 1.0, None), ("x1", 1.0, 1024), ("u2", 1.0, None), ("u3", 1.0, None)]
    ts = boot(gpud, spec)
    order = ["u1", "x1", "u2", "u3"]
    for before, after in itertools.pairwise(order):
        assert ts[("healthy", before)] <= ts[("start", after)], (before, after)
