"""How many connections one local user can hold to one fronted port before another user's
request is refused: under real systemd in the sandbox (root; booted as gpud-holdbench, powered
off at the end), a user who is nobody to gpud holds N idle or N slow-header connections
(tests/integration/holder.py, renewing what the front closes) to a fronted serve's port, for
N in steps; after each step's hold is in place (or 20 s), another user sends 3 rounds of one
GET /v1/models to each of two fronted ports, each given 5 s. The largest N at which every
request was answered, and the first N at which one was not, per kind.

    .venv/bin/python bench/front_holds.py [--steps 1000,2000,...] [--kinds idle,slow]
    # the front of another checkout (its gpud runs in the sandbox), e.g. before a change:
    git worktree add /tmp/front-before REV
    .venv/bin/python bench/front_holds.py --gpud-repo /tmp/front-before
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.integration.gpudctl import PY, REPO, SandboxGpud, install_front, sim_config, standin_uds
from tests.waiting import wait_until
from tools.sandbox import Sandbox

PORT = 30291
HOLDER, OTHER = "gpud-bench-holder", "gpud-bench-other"

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
ap.add_argument("--steps", default="1000,2000,4000,8000,12000,16000,18000")
ap.add_argument("--kinds", default="idle,slow")
ap.add_argument("--gpud-repo", type=Path, default=REPO)
args = ap.parse_args()

serves = "".join(f'[serves.{name}]\nrole = "r"\nvram_mib = 4000\nport = {PORT + i}\nfront = true\n'
                 f"command = {standin_uds()}\n" for i, name in enumerate(("a", "b")))
config = sim_config('[roles.r]\ndevice = "GPU-sim-0"\nreserve_mib = 1000\n', serves)


def probe(sb: Sandbox) -> list[str]:
    script = "; ".join(f"curl -s -o /dev/null -m 5 -w '%{{http_code}}\\n' "
                       f"http://127.0.0.1:{port}/v1/models" for port in (PORT, PORT + 1))
    return list(sb.run(script, user=OTHER, timeout=60, check=False).stdout.split())


sb = Sandbox(name="gpud-holdbench")
sb.boot()
try:
    g = SandboxGpud(sb)
    g.reset()
    sb.install_gpud(args.gpud_repo, config)
    install_front(sb)
    sb.run(["mkdir", "-p", "/run/gpud"])
    g.set_external([])
    for user in (HOLDER, OTHER):
        sb.run(["useradd", "--no-create-home", user], check=False)
    g.start()
    wait_until(lambda: g.unit_prop("gpud-front.service", "ActiveState") == "active", timeout=30)
    for name in ("a", "b"):
        assert g.call("POST", f"/v1/serves/{name}/start", {}).status == 200
        g.wait_state(name, "running")
    print("front: LimitNOFILE", g.unit_prop("gpud-front.service", "LimitNOFILE"),
          "soft", g.unit_prop("gpud-front.service", "LimitNOFILESoft"), flush=True)
    for kind in args.kinds.split(","):
        served_up_to, refused_at = 0, None
        for n in (int(x) for x in args.steps.split(",")):
            holder = sb.popen([PY, str(REPO / "tests" / "integration" / "holder.py"),
                               "--port", str(PORT), f"--{kind}", str(n), "--duration", "60"],
                              user=HOLDER, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL)
            assert holder.stdout is not None and holder.stdin is not None
            started, status = time.monotonic(), {}
            while time.monotonic() - started < 20:
                line = holder.stdout.readline()
                if not line:
                    break
                status = json.loads(line)
                if status["ready"]:
                    break
            codes = [c for _ in range(3) for c in probe(sb)]
            holder.stdin.close()
            sb.kill(holder)
            holder.wait(timeout=10)
            holder.stdout.close()
            ok = all(c == "200" for c in codes)
            print(f"{kind} {n}: holder had {status.get(kind)} open; others got {codes}", flush=True)
            if ok:
                served_up_to = n
            else:
                refused_at = n
                break
            time.sleep(12)  # what the front closed of this hold is gone before the next
        print(f"{kind}: others served with {served_up_to} held; first refused at "
              f"{refused_at if refused_at is not None else 'none of the steps'}", flush=True)
finally:
    sb.run("systemctl stop gpud gpud-front 'gpud-serve-*'", check=False)
    sb.poweroff()
