"""The front under real systemd: a serve with `front = true` listens on a Unix socket only root
and the front reach; its port is nginx's (gpud-front.service), which forwards the client API
and answers 404 to vLLM's dev routes. Simulated GPU, stand-in serves."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.integration.gpudctl import PY, REPO, SandboxGpud, fronted_gpud, sim_config, standin_uds
from tests.waiting import wait_until

PORT = 30181
SOCKET = "/run/gpud/serves/chat.sock"
USER = "gpud-front-client"  # a local user who is not in group gpud nor the front's group
READER = "gpud-front-reader"  # in group gpud: may read gpud's API


def front_config() -> str:
    command = standin_uds("--enable-sleep-mode", "--context-mib", "200", "--asleep-mib", "800",
                          "--token-interval-s", "0.2")
    serve = (f'[serves.chat]\nrole = "r"\nvram_mib = 12000\nport = {PORT}\nfront = true\n'
             f"sleep_level = 1\nsleep_mib = 800\ncommand = {command}\n"
             'environment = { VLLM_SERVER_DEV_MODE = "1" }\n')
    # on demand: one that fits (loading takes a second, so the first requests all wait for
    # it), one that does not while chat runs (capacity 32607 - reserve 1000 - chat's 12000)
    serve += (f'[serves.od]\nrole = "r"\nvram_mib = 8000\nport = {PORT + 1}\nfront = true\n'
              f"on_demand = true\nstart_timeout_s = 60\nsleep_level = 1\nsleep_mib = 800\n"
              'environment = { VLLM_SERVER_DEV_MODE = "1" }\n'
              f"command = {standin_uds('--startup-delay', '1', '--enable-sleep-mode')}\n")
    serve += (f'[serves.huge]\nrole = "r"\nvram_mib = 30000\nport = {PORT + 2}\n'
              f"front = true\non_demand = true\ncommand = {standin_uds()}\n")
    # idle: asleep after 2 s without a request, stopped after 4 s
    serve += (f'[serves.idler]\nrole = "r"\nvram_mib = 4000\nport = {PORT + 3}\nfront = true\n'
              "on_demand = true\nsleep_level = 1\nsleep_mib = 800\nidle_sleep_s = 2\n"
              'idle_stop_s = 4\nenvironment = { VLLM_SERVER_DEV_MODE = "1" }\n'
              f"command = {standin_uds('--enable-sleep-mode')}\n")
    role = '[roles.r]\ndevice = "GPU-sim-0"\nreserve_mib = 1000\n'
    return sim_config(role, serve)


@pytest.fixture
def fronted(gpud: SandboxGpud) -> Iterator[SandboxGpud]:
    with fronted_gpud(gpud, front_config(), [USER], wait_front=False):  # USER: nobody to gpud
        yield gpud


def curl(gpud: SandboxGpud, *args: str) -> str:
    """curl as a local user who is nobody to gpud: the status code, then the body."""
    out = gpud.sb.run(["curl", "-s", "-w", "\n%{http_code}", *args], user=USER, check=False)
    body, _, status = out.stdout.rpartition("\n")
    return f"{status} {body}"


def front_active(gpud: SandboxGpud) -> bool:
    return gpud.unit_prop("gpud-front.service", "ActiveState") == "active"


def test_only_the_client_api_reaches_a_fronted_serve(fronted: SandboxGpud) -> None:
    gpud = fronted
    gpud.wait_front()
    assert gpud.unit_prop("gpud-front.service", "User") == "gpud-front"
    # sandboxed: `systemd-analyze security` rates it 2.2 (9.2 without the hardening)
    report = gpud.sb.run(["systemd-analyze", "security", "--no-pager", "gpud-front.service"],
                         check=False).stdout.splitlines()[-1]
    assert float(report.split("gpud-front.service:")[1].split()[0]) < 3.0, report
    # Not started yet: the front answers, with 503.
    assert curl(gpud, f"http://127.0.0.1:{PORT}/v1/models").startswith("503")
    reply = gpud.call("POST", "/v1/serves/chat/start", {})
    assert reply.status == 200, reply.raw
    # running: gpud's health checks reached /health over the socket
    gpud.wait_state("chat", "running")
    assert gpud.unit_prop("gpud-serve-chat.service", "UMask") == "0007"

    base = f"http://127.0.0.1:{PORT}"
    for path in ("/wake_up", "/sleep?level=1", "/collective_rpc", "/is_sleeping"):
        assert curl(gpud, "-X", "POST", "-d", "{}", base + path).startswith("404"), path
    models = curl(gpud, base + "/v1/models")
    assert models.startswith("200") and '"id": "m"' in models, models

    # The serve's own socket: EACCES for the same user, at the directory.
    probe = gpud.sb.run([PY, "-c", "import socket; s = socket.socket(socket.AF_UNIX); "
                         f"s.connect({SOCKET!r})"], user=USER, check=False)
    assert probe.returncode != 0 and "PermissionError" in probe.stderr, probe.stderr
    mode = gpud.sb.run(["stat", "-c", "%a %U %G", "/run/gpud/serves", SOCKET]).stdout.split("\n")
    assert mode[:2] == ["770 root gpud-front", "770 root gpud-front"], mode
    # the serve that bound it runs unprivileged, in the front's group
    pid = gpud.unit_prop("gpud-serve-chat.service", "MainPID")
    ids = gpud.sb.run(["ps", "-o", "user:20=,supgrp:40=", "-p", str(pid)]).stdout.split()
    assert ids[0] == "gpud-serve" and "gpud-front" in ids[1].split(","), ids

    # A stream comes through, token by token.
    started = time.monotonic()
    stream = gpud.sb.run(["curl", "-sN", "-d", json.dumps({"prompt": "a b c", "max_tokens": 3,
                                                           "stream": True}),
                          base + "/v1/completions"], user=USER)
    assert time.monotonic() - started >= 0.4
    events = [line for line in stream.stdout.splitlines() if line.startswith("data: ")]
    assert len(events) == 4 and events[-1] == "data: [DONE]", stream.stdout

    # gpud's own sleep and wake go over the socket.
    assert gpud.call("POST", "/v1/serves/chat/sleep", {}).status == 200
    assert gpud.serve("chat")["state"] == "sleeping"
    assert gpud.call("POST", "/v1/serves/chat/wake", {}).status == 200
    gpud.wait_state("chat", "running")

    # Restarting gpud leaves the front (and its connections) alone.
    pid = gpud.unit_prop("gpud-front.service", "MainPID")
    gpud.sb.run(["systemctl", "restart", "gpud.service"], timeout=60)
    gpud.wait_state("chat", "running")
    assert gpud.unit_prop("gpud-front.service", "MainPID") == pid
    assert curl(gpud, base + "/v1/models").startswith("200")


def test_an_on_demand_serve_starts_on_its_first_requests(fronted: SandboxGpud) -> None:
    gpud = fronted
    wait_until(lambda: front_active(gpud), timeout=30, what="gpud-front.service active")
    assert gpud.serve("od")["state"] == "declared"  # not started at boot
    url = f"http://127.0.0.1:{PORT + 1}/v1/models"
    # ten at once, as the client user
    out = gpud.sb.run(
        "for i in $(seq 10); do curl -s -o /dev/null -w '%{http_code}\\n' " + url + " & done; wait",
        user=USER, timeout=90).stdout.split()
    assert out == ["200"] * 10, out
    assert gpud.serve("od")["state"] == "running"
    starts = gpud.events(kind="start", serve="od")
    assert len(starts) == 1, starts
    # once running, requests go straight through
    assert curl(gpud, url).startswith("200")
    # asleep, the next request wakes it
    assert gpud.call("POST", "/v1/serves/od/sleep", {}).status == 200
    assert gpud.serve("od")["state"] == "sleeping"
    assert curl(gpud, url).startswith("200")
    assert gpud.serve("od")["state"] == "running"
    assert len(gpud.events(kind="wake", serve="od")) == 1
    # gpud down: the awake serve answers as before, one not up answers 503
    gpud.sb.run(["systemctl", "stop", "gpud.service"], timeout=60)
    assert curl(gpud, url).startswith("200")
    assert curl(gpud, f"http://127.0.0.1:{PORT + 2}/v1/models").startswith("503")


def test_a_refused_on_demand_serve_answers_503_with_the_reason(fronted: SandboxGpud) -> None:
    gpud = fronted
    wait_until(lambda: front_active(gpud), timeout=30, what="gpud-front.service active")
    assert gpud.call("POST", "/v1/serves/chat/start", {}).status == 200
    out = gpud.sb.run(["curl", "-s", "-i", f"http://127.0.0.1:{PORT + 2}/v1/models"],
                      user=USER, timeout=30).stdout
    head, _, body = out.replace("\r\n", "\n").partition("\n\n")
    assert head.startswith("HTTP/1.1 503"), out
    assert "Retry-After: 5" in head, head  # when gpud tries it again (gpud.core.bringup)
    error = json.loads(body)["error"]
    # the reason's class, to a user who is nobody to gpud: no figures, no other serve's name
    assert error["code"] == "denied" and error["details"]["class"] == "no-memory", error
    assert "30000" not in body and "chat" not in body and "MiB" not in body, body
    assert gpud.serve("huge")["state"] == "denied"
    assert "30000" in gpud.serve("huge")["reason"]  # the whole reason: in the API
    # Nobody else may ask gpud to start it, not even a reader of gpud's socket.
    gpud.sb.run(["useradd", "--no-create-home", "--groups", "gpud", READER], check=False)
    try:
        reply = gpud.sb.run(["curl", "-s", "--unix-socket", "/run/gpud/gpud.sock", "-X", "POST",
                             "http://localhost/v1/serves/od/ensure"], user=READER, check=False)
    finally:
        gpud.sb.run(["userdel", READER], check=False)
    assert json.loads(reply.stdout)["error"]["code"] == "forbidden", reply.stdout
    assert gpud.serve("od")["state"] == "declared"


def test_idle_sleep_and_stop_fire_at_their_times(fronted: SandboxGpud) -> None:
    gpud = fronted
    wait_until(lambda: front_active(gpud), timeout=30, what="gpud-front.service active")
    url = f"http://127.0.0.1:{PORT + 3}/v1/models"
    assert curl(gpud, url).startswith("200")
    answered = time.time()
    asleep = gpud.wait_event("sleep", timeout=20, serve="idler")
    # said as an idle sleep: in the event, the journal, the metrics, and the serve's view
    assert 2.0 <= asleep["details"]["idle_s"] < 3.5, asleep
    assert "without a request" in asleep["message"], asleep
    entry, = gpud.wait_journal("GPUD_EVENT=sleep", "GPUD_SERVE=idler")
    assert float(entry["GPUD_IDLE_S"]) == asleep["details"]["idle_s"], entry
    assert gpud.metrics("gpud_idle_sleeps_total") == [({"serve": "idler"}, 1)]
    view = gpud.serve("idler")
    assert view["front"] is True and view["last_activity_s_ago"] >= 2.0, view
    assert gpud.serve("chat")["last_activity_s_ago"] is None  # not on demand: not seen
    table = subprocess.run([sys.executable, "-m", "gpud.ctl", "--socket", str(gpud.socket),
                            "serves"], capture_output=True, text=True, cwd=REPO, timeout=60,
                           check=True).stdout
    rows = table.split("\n\n")[0].splitlines()  # the table, then the reasons
    idler, = (line for line in rows if line.startswith("idler "))
    assert rows[0].endswith("LAST REQUEST") and idler.endswith(" ago"), table
    stopped = gpud.wait_event("stop", timeout=20, serve="idler")
    # within the 0.5 s of gpud's check (and a second of slack on a loaded host)
    assert 2.0 <= asleep["ts"] - answered < 3.5, (asleep, answered)
    assert 4.0 <= stopped["ts"] - answered < 5.5, (stopped, answered)
    assert stopped["details"]["idle_s"] >= 4.0, stopped
    gpud.wait_state("idler", "declared", "admitted")
    assert gpud.metrics("gpud_idle_stops_total") == [({"serve": "idler"}, 1)]
    assert gpud.serve("idler")["last_activity_s_ago"] >= 4.0  # still said once it stopped
    # and the next request brings it back
    assert curl(gpud, url).startswith("200")


def test_a_gpud_restart_cuts_no_stream(fronted: SandboxGpud) -> None:
    gpud = fronted
    wait_until(lambda: front_active(gpud), timeout=30, what="gpud-front.service active")
    assert gpud.call("POST", "/v1/serves/chat/start", {}).status == 200
    gpud.wait_state("chat", "running")
    body = json.dumps({"prompt": "a b", "max_tokens": 150, "stream": True})  # 150 x 0.2 s
    script = (
        "rm -rf /tmp/streams; mkdir /tmp/streams; "
        f"for i in $(seq 64); do curl -sN -d '{body}' http://127.0.0.1:{PORT}/v1/completions"
        " > /tmp/streams/$i & done; "
        # every stream has its first token, then gpud restarts under them
        "until [ $(find /tmp/streams -type f -size +0 | wc -l) -eq 64 ]; do sleep 0.05; done; "
        "systemctl restart gpud.service; "
        "echo done-before-restart-ended $(grep -l '\\[DONE\\]' /tmp/streams/* | wc -l); "
        "wait; echo complete $(grep -l 'data: \\[DONE\\]' /tmp/streams/* | wc -l)")
    out = gpud.sb.run(["bash", "-c", script], timeout=120).stdout.split()
    assert out == ["done-before-restart-ended", "0", "complete", "64"], out
    gpud.wait_state("chat", "running")


def test_a_front_started_with_other_unit_properties_is_started_again(
        fronted: SandboxGpud) -> None:
    # A transient unit's properties are fixed when it starts, and nginx's reload cannot change
    # them: a front found running with others (an earlier gpud's, whose unit lacked a path this
    # gpud's nginx.conf writes to) is started again with this gpud's.
    gpud = fronted
    wait_until(lambda: front_active(gpud), timeout=30, what="gpud-front.service active")
    ours = gpud.unit_prop("gpud-front.service", "Description")
    exec_start = gpud.sb.run(["systemctl", "show", "-p", "ExecStart", "--value",
                              "gpud-front.service"]).stdout
    argv = re.search(r"argv\[\]=([^;]+);", exec_start)
    assert argv is not None, exec_start
    gpud.sb.run("systemctl stop gpud.service gpud-front.service")
    gpud.sb.run(["systemd-run", "--unit=gpud-front.service", "--slice=gpud.slice",
                 "--description=gpud front: the client API of fronted serves",
                 "-p", "User=gpud-front", "-p", "ProtectSystem=strict",
                 "-p", "ReadWritePaths=/run/gpud/front/run", *argv.group(1).split()])
    wait_until(lambda: front_active(gpud), timeout=30, what="the earlier front active")
    earlier = gpud.unit_prop("gpud-front.service", "MainPID")
    gpud.start()
    wait_until(lambda: gpud.unit_prop("gpud-front.service", "Description") == ours
               and front_active(gpud), timeout=30, what="the front started again")
    assert gpud.unit_prop("gpud-front.service", "MainPID") != earlier
    assert "runs with other unit properties" in gpud.journal_tail(200)
    # and a gpud restart after that finds its own front: reloaded, not started again
    pid = gpud.unit_prop("gpud-front.service", "MainPID")
    gpud.sb.run(["systemctl", "restart", "gpud.service"], timeout=60)  # its front synced first
    assert gpud.unit_prop("gpud-front.service", "MainPID") == pid
