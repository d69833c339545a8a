"""What the on-demand check costs an awake serve: p50 latency of GET /v1/models through the
front of a fronted serve and of an on-demand one (each request first asks gpud, auth_request),
both running, under real systemd in the sandbox (root; booted as gpud-odbench, powered off at
the end). Five rounds of 300 sequential requests on one keep-alive connection each. Then the
first request to the on-demand serve asleep, five times.

    .venv/bin/python bench/front_ondemand.py
"""
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.integration.gpudctl import SandboxGpud
from tests.integration.test_front import PORT, front_config
from tests.waiting import wait_until
from tools.sandbox import Sandbox

SNIPPET = r'''
import http.client, statistics, sys, time
port = int(sys.argv[1]); n = int(sys.argv[2])
c = http.client.HTTPConnection("127.0.0.1", port)
lat = []
for _ in range(n):
    t = time.perf_counter(); c.request("GET", "/v1/models"); r = c.getresponse(); r.read()
    assert r.status == 200, r.status
    lat.append(time.perf_counter() - t)
print(statistics.median(lat) * 1000)
'''
sb = Sandbox(name="gpud-odbench")
sb.boot()
try:
    g = SandboxGpud(sb)
    g.configure(front_config())  # with nginx and the front's user
    wait_until(lambda: g.unit_prop("gpud-front.service", "ActiveState") == "active", timeout=30)
    assert g.call("POST", "/v1/serves/chat/start", {}).status == 200
    g.wait_state("chat", "running")
    sb.run(["curl", "-s", f"http://127.0.0.1:{PORT + 1}/v1/models"], timeout=60)
    g.wait_state("od", "running")
    res: dict[str, list[float]] = {"fronted": [], "on_demand": []}
    for _ in range(5):
        for name, port in (("fronted", PORT), ("on_demand", PORT + 1)):
            out = sb.run([sys.executable, "-c", SNIPPET, str(port), "300"]).stdout
            res[name].append(float(out))
    for k, v in res.items():
        print(k, "p50 ms per round:", [round(x, 3) for x in v], "median", round(statistics.median(v), 3))
    # A sleeping on-demand serve's first request: the whole wait, of which the stand-in's own
    # wake is a few milliseconds (a pipe write to its engine child): an upper bound of gpud's
    # share (request in to wake sent, healthy to forwarded) plus that wake.
    waits: list[float] = []
    for _ in range(5):
        assert g.call("POST", "/v1/serves/od/sleep", {}).status == 200
        out = sb.run([sys.executable, "-c", SNIPPET, str(PORT + 1), "1"]).stdout
        waits.append(float(out))
    print("first request to a sleeping serve, ms:", [round(x, 1) for x in waits], "median",
          round(statistics.median(waits), 1))
finally:
    sb.run("systemctl stop gpud gpud-front 'gpud-serve-*'", check=False)
    sb.poweroff()
