"""gpuctl plan / apply on running stand-ins under real systemd: the seed's T015 -> T011
rebalance in two commands, and a rollback when the new serve never becomes healthy."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.integration.gpudctl import REPO, SandboxGpud, sim_config, standin
from tests.waiting import wait_until


def dark_fast(reserve: int) -> str:
    return f'[roles.dark-fast]\ndevice = "GPU-sim-0"\nreserve_mib = {reserve}\n'


def serves(fast_mib: int, fast_args: tuple[str, ...] = (), extra: str = "") -> str:
    out = []
    for prio, (name, mib, port, args) in enumerate((
            ("fast", fast_mib, 30001, fast_args), ("embeddings", 3200, 30003, ()),
            ("reranker", 3456, 30004, ()), ("ocr", 5120, 30007, ()))):
        out.append(f'[serves.{name}]\nrole = "dark-fast"\nvram_mib = {mib}\nresident = true\n'
                   f"priority = {(prio + 1) * 10}\nport = {port}\ncommand = {standin(*args)}\n")
    return "\n".join(out) + extra


T015 = sim_config(dark_fast(7168), serves(18432, ("--model", "gemma-4-E4B-it-bf16")))
T011 = sim_config(dark_fast(4608), serves(14336, ("--model", "gemma-4-E4B-it-FP8-Dynamic")))


def gpuctl(gpud: SandboxGpud, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpud.ctl", "--socket", str(gpud.socket),
                           *args], capture_output=True, text=True, cwd=REPO, timeout=300,
                          check=False)


def boot_t015(gpud: SandboxGpud) -> None:
    gpud.configure(T015)
    for name in ("fast", "embeddings", "reranker"):
        gpud.wait_state(name, "running")
    gpud.wait_state("ocr", "denied")


def test_plan_and_apply_t015_to_t011(gpud: SandboxGpud, tmp_path: Path) -> None:
    boot_t015(gpud)
    new = tmp_path / "t011.toml"
    new.write_text(T011)
    plan = gpuctl(gpud, "plan", str(new), "--json")
    assert plan.returncode == 0, plan.stderr
    doc = json.loads(plan.stdout)
    role = doc["roles"][0]
    assert (role["before"]["reserve_mib"], role["after"]["reserve_mib"]) == (7168, 4608)
    assert (role["before"]["free_mib"], role["after"]["free_mib"]) == (351, 1887)
    fast = next(s for s in doc["serves"] if s["name"] == "fast")
    assert (fast["mib_before"], fast["mib_after"], fast["restart"]) == (18432, 14336, True)
    ocr = next(s for s in doc["serves"] if s["name"] == "ocr")
    assert (ocr["state_before"], ocr["state_after"]) == ("denied", "admitted")
    human = gpuctl(gpud, "plan", str(new)).stdout
    assert "free       351 -> 1887 MiB" in human and "resident set: fits" in human

    old_fast_pid = gpud.serve("fast")["main_pid"]
    applied = gpuctl(gpud, "apply", str(new))
    assert applied.returncode == 0, applied.stdout + applied.stderr
    steps = [line.split("]")[1].split(":")[0].strip() for line in applied.stdout.splitlines()
             if line.startswith("[")]
    assert steps[:4] == ["validate", "backup", "write", "reload"]
    assert steps.index("restart") < steps.index("start") < steps.index("verify")
    # the apply did the plan's steps, the ones gpuctl plan showed, in their order
    assert steps == ["validate"] + [s["kind"] for s in doc["steps"]]
    planned = [f"{s['kind']} {s['serve']}" for s in doc["steps"] if s["serve"]]
    done = [f"{m[1]} {m[2]}" for m in re.finditer(r"\] (\w+): (\S+): \1 done \(",
                                                   applied.stdout)]
    assert done == planned and planned
    assert "steps (what apply does, in order; undo on failure):" in human
    for name in ("fast", "embeddings", "reranker", "ocr"):
        assert gpud.serve(name)["state"] == "running"
    assert gpud.serve("fast")["main_pid"] != old_fast_pid
    role = gpud.get("/v1/ledger")["roles"][0]
    assert (role["reserve_mib"], role["committed_mib"], role["free_mib"]) == (4608, 26112, 1887)
    argv = gpud.sb.run(["cat", f"/proc/{gpud.serve('fast')['main_pid']}/cmdline"]).stdout
    assert "0.4396" in argv.split("\0")
    assert gpud.sb.host_path("/etc/gpud/serves.toml").read_text() == T011
    backups = list(gpud.sb.host_path("/etc/gpud/backups").iterdir())
    assert len(backups) == 1 and backups[0].read_text() == T015
    assert [e["details"]["step"] for e in gpud.events(kind="apply")][-1] == "verify"


def test_apply_rolls_back_when_a_new_serve_never_turns_healthy(gpud: SandboxGpud,
                                                              tmp_path: Path) -> None:
    gpud.configure(T011)
    for name in ("fast", "embeddings", "reranker", "ocr"):
        gpud.wait_state(name, "running")
    before = {n: gpud.serve(n)["main_pid"] for n in ("fast", "embeddings", "reranker", "ocr")}
    bad = (f'\n[serves.sick]\nrole = "dark-fast"\nvram_mib = 300\nresident = true\n'
           f'priority = 50\nport = 30050\nstart_timeout_s = 2\n'
           f'command = {standin("--never-healthy")}\n')
    new = tmp_path / "bad.toml"
    new.write_text(T011 + bad)
    applied = gpuctl(gpud, "apply", str(new))
    assert applied.returncode == 1, applied.stdout
    assert "rolled back: sick did not become healthy" in applied.stderr
    assert "[FAIL] failed" in applied.stdout and "[ok  ] rollback" in applied.stdout
    assert gpud.sb.host_path("/etc/gpud/serves.toml").read_text() == T011
    assert "gpud-serve-sick.service" not in gpud.serve_units()
    assert {n: gpud.serve(n)["main_pid"] for n in before} == before  # untouched
    role = gpud.get("/v1/ledger")["roles"][0]
    assert role["committed_mib"] == 26112
    reply = gpud.call("GET", "/v1/serves/sick")
    assert reply.status == 404 or reply.body["reserved_mib"] is None


def test_apply_refuses_a_set_that_does_not_fit(gpud: SandboxGpud, tmp_path: Path) -> None:
    boot_t015(gpud)
    new = tmp_path / "big.toml"
    new.write_text(T015.replace("reserve_mib = 7168", "reserve_mib = 9000"))
    plan = gpuctl(gpud, "plan", str(new))
    assert plan.returncode == 1 and "DOES NOT FIT" in plan.stdout
    applied = gpuctl(gpud, "apply", str(new))
    assert applied.returncode == 1
    assert gpud.sb.host_path("/etc/gpud/serves.toml").read_text() == T015
    assert not gpud.sb.host_path("/etc/gpud/backups").exists()


def test_plan_says_no_where_apply_would_the_device_has_no_room(gpud: SandboxGpud,
                                                                tmp_path: Path) -> None:
    """Ledger free 3072 MiB, but the display's draw leaves 666 MiB free on the device: a plan
    to add a 1024 MiB serve says the physical bound blocks it (exit 1), as the apply's strict
    admission would, and the apply is refused before it changes anything."""
    role = '[roles.r]\ndevice = "GPU-sim-0"\nreserve_mib = 1024\n'
    a = (f'[serves.a]\nrole = "r"\nvram_mib = 4096\nresident = true\npriority = 10\n'
         f'port = 30060\ncommand = {standin()}\n')
    b = (f'[serves.b]\nrole = "r"\nvram_mib = 1024\nresident = true\npriority = 20\n'
         f'port = 30061\ncommand = {standin()}\n')
    old = sim_config(role, a, total_mib=8192)
    gpud.configure(old)
    drawn = gpud.wait_state("a", "running")
    seen = int(wait_until(lambda: gpud.serve("a")["observed_mib"], 20,
                          "a's draw observed"))
    gpud.set_external([{"device": "GPU-sim-0", "label": "display", "mib": 8192 - seen - 666}])
    gpud.wait_polls()
    observed = gpud.get("/v1/ledger")["roles"][0]["observed"]
    assert (observed["physical_free_mib"], observed["effective_free_mib"]) == (666, 666), observed
    assert gpud.get("/v1/ledger")["roles"][0]["free_mib"] == 3072
    new = tmp_path / "add-b.toml"
    new.write_text(sim_config(role, a + b, total_mib=8192))
    plan = gpuctl(gpud, "plan", str(new))
    assert plan.returncode == 1, plan.stdout + plan.stderr
    assert ("resident set: DOES NOT FIT: b on r: physical bound (strict admission: what the "
            "device has free, less what admitted serves will draw): need 1024 MiB, free 666 "
            "MiB, short 358 MiB") in plan.stdout, plan.stdout
    doc = json.loads(gpuctl(gpud, "plan", str(new), "--json").stdout)
    assert doc["resident_fits"] is False and doc["steps"] == []
    assert [(d["serve"], d["bound"], d["need_mib"], d["free_mib"]) for d in doc["denied"]] == [
        ("b", "physical", 1024, 666)]
    applied = gpuctl(gpud, "apply", str(new))
    assert applied.returncode == 1, applied.stdout
    assert "physical bound: need 1024 MiB, free 666 MiB" in applied.stderr, applied.stderr
    assert "rolled back" not in applied.stdout + applied.stderr  # refused, never begun
    assert gpud.sb.host_path("/etc/gpud/serves.toml").read_text() == old
    assert gpud.serve("a")["main_pid"] == drawn["main_pid"]
    assert gpud.call("GET", "/v1/serves/b").status == 404
