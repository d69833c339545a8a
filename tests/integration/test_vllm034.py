"""A vllm serve on a vLLM 0.34 daemon (`daemon.vllm_version = "0.34.0"`), the stand-in standing
in for 0.34 as `vllm`: gpud launches it with the extensible KV cache off, calibration reads its
0.34 lines, and a level-2 sleep is checked against host RAM for what 0.34 parks there. Real
systemd in the sandbox, simulated GPU."""

from __future__ import annotations

import json
import time

import pytest

from tests.integration.gpudctl import STANDIN, SandboxGpud, sim_config

pytestmark = pytest.mark.sandbox

ROLE = """
[roles.dark-fast]
device = "0"
reserve_mib = 4608
"""


def test_a_0_34_serve_s_level_2_sleep_needs_host_ram_for_its_graphs(gpud: SandboxGpud) -> None:
    wrapper = "/usr/local/bin/vllm-standin"
    serves = ('[serves.gen]\nrole = "dark-fast"\nvram_mib = 8192\nport = 30033\n'
              "sleep_level = 2\nsleep_mib = 800\n"
              '[serves.gen.vllm]\nmodel = "org/gen"\nmax_model_len = 4096\n')
    config = sim_config(ROLE, serves, daemon=f'vllm_executable = "{wrapper}"\n'
                        'vllm_version = "0.34.0"')
    gpud.configure(config, start=False)
    gpud.sb.write_file(wrapper, f'#!/bin/sh\nexec {" ".join(STANDIN)} "$@" --vllm-version 0.34.0 '
                       "--context-mib 300 --asleep-mib 800\n", mode=0o755)
    gpud.start()
    assert gpud.call("POST", "/v1/serves/gen/start", {}).status == 200
    gpud.wait_state("gen", "running")
    argv = gpud.sb.run(["systemctl", "show", "-p", "ExecStart", "gpud-serve-gen.service"]).stdout
    assert "--no-enable-extensible-kv-cache" in argv, argv
    assert gpud.call("POST", "/v1/serves/gen/calibrate", {"window_s": 2}).status == 200
    gpud.wait_event("calibrate", serve="gen")
    vllm = gpud.get("/v1/serves/gen/calibration")["vllm"]
    # gpud's 0.34 serve: profiled, not extended; the graphs from "Graph capturing finished"
    assert vllm["kv_extended"] is False and vllm["recommended_kv_cache_bytes"] > 0
    graphs = vllm["cudagraph_mib"]
    assert graphs > 0
    margin = 1024  # daemon.sleep_host_margin_mib
    gpud.sb.write_file("/run/gpud/sim.json", json.dumps(
        {"external": [], "mem_available_mib": graphs + margin - 1}))
    reply = gpud.call("POST", "/v1/serves/gen/sleep", {"level": 2})
    assert reply.status == 409, reply.raw
    message = reply.body["error"]["message"]
    assert message.startswith("serve 'gen' not put to sleep at level 2: host RAM: its CUDA "
                              f"graphs and runtime allocations (all but the parameters) "
                              f"({graphs} MiB) plus the margin"), message
    assert gpud.serve("gen")["state"] == "running"
    gpud.sb.write_file("/run/gpud/sim.json", json.dumps(
        {"external": [], "mem_available_mib": graphs + margin}))
    reply = gpud.call("POST", "/v1/serves/gen/sleep", {"level": 2})
    assert reply.status == 200, reply.raw
    assert reply.body["parked_host_mib"] == graphs
    # the serve's own account of it, as vLLM 0.34 logs it (cumem.py:302-308)
    deadline = time.monotonic() + 10
    while "is backed up in CPU" not in (log := gpud.sb.run(
            ["journalctl", "-o", "cat", "--no-pager", "-u", "gpud-serve-gen.service"]).stdout):
        assert time.monotonic() < deadline, log[-2000:]
        time.sleep(0.2)
