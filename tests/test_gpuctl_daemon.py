"""gpuctl against a real gpud: follow and watch end cleanly when the daemon goes away."""

from __future__ import annotations

import select
import subprocess
import sys
import time

from tests.conftest import REPO, GpudProcess


def gpuctl(gp: GpudProcess, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "gpud.gpuctl", "--socket", str(gp.socket),
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO)


def next_line(proc: subprocess.Popen[str], timeout: float = 20) -> str:
    """The next line the process prints, waited for (no sleep as synchronization)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no output within {timeout} s"
    return proc.stdout.readline()


def test_follow_sees_new_events_and_ends_when_gpud_stops(gpud_t015: GpudProcess) -> None:
    follow = gpuctl(gpud_t015, "events", "--follow", "--kind", "admit,deny")
    watch = gpuctl(gpud_t015, "ledger", "--watch", "--interval", "0.2")
    # Admit until the follower shows it: from then on it is subscribed.
    assert gpud_t015.call("POST", "/v1/serves/reranker/admit", {"mib": 3456}).status == 200
    assert "reranker" in next_line(follow)
    assert gpud_t015.call("POST", "/v1/serves/fast/admit", {"mib": 18432}).status == 200
    assert gpud_t015.call("POST", "/v1/serves/ocr/admit", {"mib": 99999}).status == 409
    seen = [next_line(follow), next_line(follow)]
    assert "admit" in seen[0] and "fast" in seen[0]
    assert "deny" in seen[1] and "ocr" in seen[1]
    while "committed 21888 MiB" not in next_line(watch):
        pass  # the watch has shown the ledger with both admissions
    started = time.monotonic()
    assert gpud_t015.stop() == 0
    _, err = follow.communicate(timeout=15)
    assert time.monotonic() - started < 10
    assert follow.returncode == 3, err
    assert "ended the event stream" in err
    _, werr = watch.communicate(timeout=15)
    assert watch.returncode == 3, werr
