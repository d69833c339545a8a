"""Observation under real systemd with the simulated GPU: the seed's honesty note computed by
gpud itself, strict admission's physical bound, and overdraw events."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.integration.gpudctl import REPO, STANDIN, SandboxGpud, sim_config, standin

T011_ROLE = """
[roles.dark-fast]
device = "GPU-sim-0"
reserve_mib = 4608
note = "display + voice STT/TTS sidecars draw ~5.7 GiB"
"""
DISPLAY = [{"device": "GPU-sim-0", "label": "display+sidecars", "mib": 5837}]


def t011_serves() -> str:
    out = []
    for prio, (name, mib, port, extra) in enumerate((
            ("fast", 14336, 30001, ()), ("embeddings", 3200, 30003, ()),
            ("reranker", 3456, 30004, ()), ("ocr", 5120, 30007, ("--draw-in-child",)))):
        out.append(f'[serves.{name}]\nrole = "dark-fast"\nvram_mib = {mib}\nresident = true\n'
                   f"priority = {(prio + 1) * 10}\nport = {port}\ncommand = {standin(*extra)}\n")
    return "\n".join(out)


def test_t011_honesty_note_and_one_reserve_exceeded(gpud: SandboxGpud) -> None:
    gpud.configure(sim_config(T011_ROLE, t011_serves()), external=DISPLAY)
    for name in ("fast", "embeddings", "reranker", "ocr"):
        gpud.wait_state(name, "running")
    role = gpud.get("/v1/ledger")["roles"][0]
    assert (role["committed_mib"], role["free_mib"]) == (26112, 1887)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        obs = gpud.get("/v1/ledger")["roles"][0]["observed"]
        if obs and obs["managed_draw_mib"] > 26000:
            break
        time.sleep(0.2)
    assert obs["simulated"] is True
    assert obs["non_ledger_draw_mib"] == 5837
    assert obs["reserve_excess_mib"] == 1229
    # Each stand-in draws floor(util x total): at most its reservation, close to it.
    assert 26100 <= obs["managed_draw_mib"] <= 26112
    # ocr's memory sits in a child process: attributed through the unit's cgroup.
    assert gpud.serve("ocr")["observed_mib"] >= 5100
    gpud.wait_polls(3)  # the crossing is reported once, not once per poll
    exceeded = gpud.events(kind="reserve-exceeded")
    assert len(exceeded) == 1
    assert exceeded[0]["mib"] == 1229 and "optimistic by 1229 MiB" in exceeded[0]["message"]
    # Back under the reserve: one reserve-ok.
    gpud.set_external([{"device": "GPU-sim-0", "label": "display", "mib": 3000}])
    gpud.wait_event("reserve-ok")
    assert len(gpud.events(kind="reserve-exceeded")) == 1
    journal = gpud.wait_journal("GPUD_EVENT=reserve-exceeded", unit="gpud.service")
    assert journal[0]["GPUD_NON_LEDGER_DRAW_MIB"] == "5837"


def test_no_per_process_memory_the_split_is_estimated_and_no_false_excess(
        gpud: SandboxGpud) -> None:
    # The seed's host under WDDM: NVML lists the serves' processes but no memory for any. The
    # display draws 3000 MiB, within the 4608 reserve: were the serves' 26 GiB called
    # non-ledger, reserve-exceeded would fire for draw that is the ledger's own.
    config = sim_config(T011_ROLE, t011_serves()).replace(
        "total_mib = 32607\n", 'total_mib = 32607\nprocess_memory = "not-available"\n')
    gpud.configure(config, external=[{"device": "GPU-sim-0", "label": "display", "mib": 3000}])
    for name in ("fast", "embeddings", "reranker", "ocr"):
        gpud.wait_state(name, "running")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        obs = gpud.get("/v1/ledger")["roles"][0]["observed"]
        if obs and obs["used_mib"] > 29000:
            break
        time.sleep(0.2)
    assert obs["estimated"] is True
    assert obs["managed_draw_mib"] == 26112  # the running serves at their reservations
    assert obs["non_ledger_draw_mib"] == obs["used_mib"] - 26112 <= 3000
    assert obs["reserve_excess_mib"] < 0
    # strict admission keeps the device's real free memory
    assert obs["physical_free_mib"] == 32607 - obs["used_mib"]
    gpud.wait_polls()
    assert gpud.events(kind="reserve-exceeded") == []
    assert gpud.events(kind="overdraw") == []
    out = subprocess.run([sys.executable, "-m", "gpud.ctl", "--socket", str(gpud.socket),
                          "ledger"], capture_output=True, text=True, cwd=REPO, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert "the split is estimated: the driver reports no per-process memory" in out.stdout
    assert gpud.metrics("gpud_draw_estimated") == [
        ({"gpu": "0", "UUID": "GPU-sim-0", "pci_bus_id": "00000000:01:00.0"}, 1.0)]


def test_physical_bound_denies_what_the_ledger_would_admit(gpud: SandboxGpud) -> None:
    serves = f'[serves.big]\nrole = "dark-fast"\nvram_mib = 8000\nport = 30030\ncommand = {standin()}\n'
    external = [{"device": "GPU-sim-0", "label": "someone else", "mib": 27000}]
    gpud.configure(sim_config(T011_ROLE, serves), external=external)
    reply = gpud.call("POST", "/v1/serves/big/start", {})
    assert reply.status == 409, reply.raw
    details = reply.body["error"]["details"]
    assert details["bound"] == "physical" and details["check"] == "strict"
    assert details["need_mib"] == 8000 and details["free_mib"] == 32607 - 27000
    assert details["shortfall_mib"] == 8000 - 5607
    assert "gpud-serve-big.service" not in gpud.serve_units()
    # The ledger alone would have admitted it.
    assert gpud.get("/v1/ledger")["roles"][0]["free_mib"] == 27999


def test_overdraw_reported_once(gpud: SandboxGpud) -> None:
    serves = (f'[serves.greedy]\nrole = "dark-fast"\nvram_mib = 4000\nport = 30031\n'
              f'command = {standin("--overdraw-pct", "20")}\n')
    gpud.configure(sim_config(T011_ROLE, serves, daemon="overdraw_tolerance_mib = 256"))
    assert gpud.call("POST", "/v1/serves/greedy/start", {}).status == 200
    gpud.wait_state("greedy", "running")
    ev = gpud.wait_event("overdraw", serve="greedy")
    assert ev["details"]["reservation_mib"] == 4000 and ev["mib"] >= 4700
    gpud.wait_polls(3)
    assert len(gpud.events(kind="overdraw")) == 1


def test_calibration_bound_to_fingerprint(gpud: SandboxGpud) -> None:
    serves = (f'[serves.emb]\nrole = "dark-fast"\nvram_mib = 3200\nport = 30032\n'
              f'command = {standin()}\n')
    config = sim_config(T011_ROLE, serves)
    gpud.configure(config)
    assert gpud.serve("emb")["calibration"] == "uncalibrated"
    reply = gpud.call("POST", "/v1/serves/emb/calibrate", {"window_s": 1})
    assert reply.status == 409  # not running: nothing to measure
    assert gpud.call("POST", "/v1/serves/emb/start", {}).status == 200
    gpud.wait_state("emb", "running")
    reply = gpud.call("POST", "/v1/serves/emb/calibrate", {"window_s": 2})
    assert reply.status == 200, reply.raw
    assert gpud.call("POST", "/v1/serves/emb/calibrate", {"window_s": 2}).status == 409
    ev = gpud.wait_event("calibrate", serve="emb")
    view = gpud.get("/v1/serves/emb/calibration")
    record = view["record"]
    assert view["status"] == "calibrated" and record["current"] is True
    draw = 3200 * 32607 // 32607  # the stand-in draws floor(util x total) <= its reservation
    assert draw - 10 <= record["peak_mib"] <= draw
    assert record["recommended_mib"] == 3584  # peak + 256, rounded up to 256
    assert ev["mib"] == 3584
    assert gpud.serve("emb")["calibration"] == "calibrated"
    # A changed serve (its command) no longer matches: stale. SIGHUP reloads the config.
    gpud.sb.write_file("/etc/gpud/serves.toml",
                       config.replace(standin(), standin("--max-model-len", "8192")), mode=0o600)
    gpud.sb.run(["systemctl", "reload", "gpud.service"])
    gpud.wait_event("reload")
    assert gpud.serve("emb")["calibration"] == "stale"


def test_bad_config_on_reload_keeps_the_running_one(gpud: SandboxGpud) -> None:
    serves = f'[serves.one]\nrole = "dark-fast"\nvram_mib = 1000\ncommand = {standin()}\n'
    gpud.configure(sim_config(T011_ROLE, serves))
    gpud.sb.write_file("/etc/gpud/serves.toml", "[roles.broken\n", mode=0o600)
    gpud.sb.run(["systemctl", "reload", "gpud.service"])
    deadline = time.monotonic() + 10
    while "reload refused" not in gpud.journal_tail() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "reload refused, keeping the running config" in gpud.journal_tail()
    assert "TOML syntax" in gpud.journal_tail()
    assert gpud.get("/v1/status")["ready"] is True
    assert gpud.serve("one")["vram_mib"] == 1000


def test_vllm_serve_calibration_reads_vllms_own_lines(gpud: SandboxGpud) -> None:
    """A vllm serve (the stand-in as `vllm`, with a context beyond util x total): gpud launches
    the argv the flag table passes, and calibration puts vLLM's journal lines beside NVML's."""
    wrapper = "/usr/local/bin/vllm-standin"
    serves = ('[serves.gen]\nrole = "dark-fast"\nvram_mib = 8192\nport = 30033\n'
              '[serves.gen.vllm]\nmodel = "org/gen"\nmax_model_len = 4096\n')
    config = sim_config(T011_ROLE, serves, daemon=f'vllm_executable = "{wrapper}"')
    gpud.configure(config, start=False)
    # The stand-in's own --context-mib: vLLM's CUDA context lies outside its budget.
    gpud.sb.write_file(wrapper, f'#!/bin/sh\nexec {" ".join(STANDIN)} "$@" --context-mib 300\n',
                       mode=0o755)
    gpud.start()
    assert gpud.call("POST", "/v1/serves/gen/start", {}).status == 200
    gpud.wait_state("gen", "running")
    assert gpud.call("POST", "/v1/serves/gen/calibrate", {"window_s": 2}).status == 200
    gpud.wait_event("calibrate", serve="gen")
    view = gpud.get("/v1/serves/gen/calibration")
    budget = 8192 * 10_000 // 32607 * 32607 // 10_000  # floor(util x total), util = 0.2512
    vllm = view["vllm"]
    assert vllm["budget_mib"] == budget
    assert vllm["context_mib"] == 300  # the steady draw beyond vLLM's budget
    assert vllm["weights_mib"] == pytest.approx(budget * 3 // 5, abs=6)  # GiB with 2 decimals
    assert vllm["recommended_kv_cache_bytes"] > 0
    assert view["record"]["steady_mib"] == budget + 300
