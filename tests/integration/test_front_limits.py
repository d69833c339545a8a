"""The front under a hostile local user, and without gpud: one user holding thousands of idle and
slow-header connections to one fronted port leaves every other user served on every fronted
port; with gpud stopped, an on-demand serve that is asleep answers 503 from the front and is not
reached, one that is awake answers. Real systemd, the front's nginx, stand-in serves."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.integration.gpudctl import PY, REPO, SandboxGpud, fronted_gpud, sim_config, standin_uds
from tests.waiting import wait_until

PORT = 30191  # a, b: fronted; od: on demand; od2: on demand that sleeps
HOLDER = "gpud-front-holder"  # the hostile user: nobody to gpud
OTHER = "gpud-front-other"  # another local user, also nobody to gpud
# What one user holds to one port, at least (the figure), and how long.
IDLE, SLOW = 4000, 1000
HOLD_S = 25  # over two of the front's 10 s header timeouts: the holder renews what is reaped
ANSWER_S = 5  # each of the other user's requests is answered within this


def limits_config() -> str:
    serves = ""
    for i, name in enumerate(("a", "b")):
        serves += (f'[serves.{name}]\nrole = "r"\nvram_mib = 4000\nport = {PORT + i}\n'
                   f"front = true\ncommand = {standin_uds()}\n")
    for i, name in enumerate(("od", "od2"), start=2):
        serves += (f'[serves.{name}]\nrole = "r"\nvram_mib = 4000\nport = {PORT + i}\n'
                   "front = true\non_demand = true\nsleep_level = 1\nsleep_mib = 800\n"
                   'environment = { VLLM_SERVER_DEV_MODE = "1" }\n'
                   f"command = {standin_uds('--enable-sleep-mode')}\n")
    return sim_config('[roles.r]\ndevice = "GPU-sim-0"\nreserve_mib = 1000\n', serves)


@pytest.fixture
def limits(gpud: SandboxGpud) -> Iterator[SandboxGpud]:
    with fronted_gpud(gpud, limits_config(), [HOLDER, OTHER]):
        yield gpud


def answers(gpud: SandboxGpud, ports: list[int], within_s: float = ANSWER_S) -> list[str]:
    """One GET /v1/models per port as the other user: 'STATUS SECONDS' each (000: none)."""
    script = "; ".join(f"curl -s -o /dev/null -m {within_s} -w '%{{http_code}} %{{time_total}}\\n'"
                       f" http://127.0.0.1:{port}/v1/models" for port in ports)
    return list(gpud.sb.run(script, user=OTHER, timeout=60, check=False).stdout.splitlines())


def test_one_user_holding_connections_leaves_every_fronted_serve_to_the_others(
        limits: SandboxGpud) -> None:
    gpud = limits
    for name in ("a", "b"):
        assert gpud.call("POST", f"/v1/serves/{name}/start", {}).status == 200
    for name in ("a", "b"):
        gpud.wait_state(name, "running")
    ports = [PORT, PORT + 1, PORT + 2]
    # od started by its first request
    assert [line.split()[0] for line in answers(gpud, ports, 30)] == ["200"] * 3

    holder = gpud.sb.popen([PY, str(REPO / "tests" / "integration" / "holder.py"),
                            "--port", str(PORT), "--idle", str(IDLE), "--slow", str(SLOW),
                            "--duration", str(HOLD_S + 60)],
                           user=HOLDER, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    statuses: list[dict[str, object]] = []
    try:
        assert holder.stdout is not None and holder.stdin is not None
        started = time.monotonic()
        # until it holds them all, or 30 s (then with what it could get: the others' answers
        # below say whether that took the front)
        while time.monotonic() - started < 30:
            line = holder.stdout.readline()
            assert line, holder.stderr.read() if holder.stderr else "holder ended"
            statuses.append(json.loads(line))
            if statuses[-1]["ready"]:
                break
        held_at = time.monotonic()
        rounds: list[list[str]] = []
        while time.monotonic() - held_at < HOLD_S:
            rounds.append(answers(gpud, ports))
        holder.stdin.close()
        statuses += [json.loads(line) for line in holder.stdout.read().splitlines()]
    finally:
        gpud.sb.kill(holder)
        holder.wait(timeout=10)
        for pipe in (holder.stdin, holder.stdout, holder.stderr):
            if pipe is not None:
                pipe.close()
    failed = [(i, r) for i, r in enumerate(rounds)
              if [line.split()[0] for line in r] != ["200"] * 3
              or max(float(line.split()[1]) for line in r) >= ANSWER_S]
    assert not failed and len(rounds) >= 3, (failed, len(rounds), statuses[-3:])
    print("answered in at most", max(float(line.split()[1]) for r in rounds for line in r),
          "s over", len(rounds), "rounds")
    # It held what it said it would (but in the second after each reaping, while it renews),
    # and the front reaped them at its header timeout.
    held = [int(s["idle"]) + int(s["slow"]) for s in statuses if s["ready"]][:-1]
    assert held and sum(n >= IDLE + SLOW for n in held) >= 0.8 * len(held), statuses
    assert int(statuses[-1]["closed_by_peer"]) >= IDLE + SLOW, statuses[-1]
    # The front's limits as the unit has them, and nginx took them (no setrlimit refused).
    assert gpud.unit_prop("gpud-front.service", "LimitNOFILE") == "16384"
    assert gpud.unit_prop("gpud-front.service", "LimitNOFILESoft") == "16384"
    log = gpud.sb.run("journalctl -u gpud-front --no-pager", check=False).stdout
    assert "Too many open files" not in log and "setrlimit" not in log, log[-2000:]


def test_with_gpud_stopped_a_sleeping_serve_gets_503_from_the_front(limits: SandboxGpud) -> None:
    gpud = limits
    od, od2 = f"http://127.0.0.1:{PORT + 2}/v1/models", f"http://127.0.0.1:{PORT + 3}/v1/models"
    # A cache directory left 0755 by an earlier gpud: systemd sets the mode at each start.
    gpud.sb.run("install -d -m 0755 -o gpud-serve -g gpud-serve /var/cache/gpud-serve && "
                "chmod 0755 /var/cache/gpud-serve")
    assert [line.split()[0] for line in answers(gpud, [PORT + 2, PORT + 3], 30)] == ["200"] * 2
    assert gpud.call("POST", "/v1/serves/od/sleep", {}).status == 200
    assert gpud.serve("od")["state"] == "sleeping"
    assert gpud.serve("od2")["state"] == "running"

    gpud.sb.run(["systemctl", "stop", "gpud.service"], timeout=60)
    out = gpud.sb.run(["curl", "-s", "-w", "\n%{http_code}", od], user=OTHER).stdout
    # The front's own answer (the serve, asleep, would have answered 200 from its socket).
    assert out.splitlines() == [
        '{"error":{"message":"serve od is not running (gpud unreachable)",'
        '"type":"server_error","param":null,"code":"model_not_running"}}', "503"], out
    assert gpud.sb.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", od2],
                       user=OTHER).stdout == "200"
    awake = gpud.sb.run(["ls", "-A", "/run/gpud/front/awake"]).stdout.split()
    assert awake == ["od2"], awake
    mode = gpud.sb.run(["stat", "-c", "%a %U %G", "/run/gpud/front/nginx.conf",
                        "/run/gpud/front/awake", "/var/cache/gpud-serve"]).stdout.splitlines()
    assert mode == ["640 root gpud-front", "750 root gpud-front",
                    "750 gpud-serve gpud-serve"], mode
    # Back: every file rewritten from the ledger at boot, and each change followed.
    gpud.start()
    assert gpud.sb.run(["ls", "-A", "/run/gpud/front/awake"]).stdout.split() == ["od2"]
    assert gpud.sb.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", od],
                       user=OTHER, timeout=60).stdout == "200"  # woken by gpud
    gpud.wait_state("od", "running")
    wait_until(lambda: gpud.sb.run(["ls", "-A", "/run/gpud/front/awake"]).stdout.split()
               == ["od", "od2"], what="od's awake file")
