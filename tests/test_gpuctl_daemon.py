"""gpuctl against a real gpud: follow and watch end cleanly when the daemon goes away."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.conftest import REPO, GpudProcess


def gpuctl(gp: GpudProcess, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "gpud.gpuctl", "--socket", str(gp.socket),
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO)


def test_follow_sees_new_events_and_ends_when_gpud_stops(gpud_t015: GpudProcess) -> None:
    follow = gpuctl(gpud_t015, "events", "--follow", "--kind", "admit,deny")
    watch = gpuctl(gpud_t015, "ledger", "--watch", "--interval", "0.2")
    time.sleep(1.0)
    assert gpud_t015.call("POST", "/v1/serves/fast/admit", {"mib": 18432}).status == 200
    assert gpud_t015.call("POST", "/v1/serves/ocr/admit", {"mib": 99999}).status == 409
    time.sleep(1.0)
    started = time.monotonic()
    assert gpud_t015.stop() == 0
    out, err = follow.communicate(timeout=15)
    assert time.monotonic() - started < 10
    assert follow.returncode == 3, err
    lines = [line for line in out.splitlines() if line.strip()]
    assert "admit" in lines[0] and "fast" in lines[0]
    assert "deny" in lines[1] and "ocr" in lines[1]
    assert "ended the event stream" in err
    wout, werr = watch.communicate(timeout=15)
    assert watch.returncode == 3, werr
    assert "committed 18432 MiB" in wout
