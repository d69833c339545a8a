"""gpuctl against a real gpud: follow and watch end cleanly when the daemon goes away."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time

from tests.conftest import REPO, GpudProcess


def gpuctl(gp: GpudProcess, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "gpud.ctl", "--socket", str(gp.socket),
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO)


class Lines:
    """A process's output, line by line, waited for with a deadline (no sleep as
    synchronization). Reads the pipe's descriptor itself: select() on a buffered reader misses
    lines already in its buffer."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        self.fd = proc.stdout.fileno()
        self.pending = b""

    def next(self, timeout: float = 20) -> str:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.fd], [], [], max(0.0, left))
            assert ready, f"no output within {timeout} s"
            chunk = os.read(self.fd, 65536)
            assert chunk, "the process ended its output"
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return line.decode()


def test_follow_sees_new_events_and_ends_when_gpud_stops(gpud_t015: GpudProcess) -> None:
    follow = gpuctl(gpud_t015, "events", "--follow", "--kind", "admit,deny")
    watch = gpuctl(gpud_t015, "ledger", "--watch", "--interval", "0.2")
    try:
        _follow_and_watch(gpud_t015, follow, watch)
    finally:
        for proc in (follow, watch):
            if proc.poll() is None:
                proc.kill()
            if proc.stdout is not None and not proc.stdout.closed:
                proc.communicate(timeout=15)  # closes the pipes of a test that failed midway


def _follow_and_watch(gpud_t015: GpudProcess, follow: subprocess.Popen[str],
                      watch: subprocess.Popen[str]) -> None:
    followed, watched = Lines(follow), Lines(watch)
    # Admit until the follower shows it: from then on it is subscribed.
    assert gpud_t015.call("POST", "/v1/serves/reranker/admit", {"mib": 3456}).status == 200
    assert "reranker" in followed.next()
    assert gpud_t015.call("POST", "/v1/serves/fast/admit", {"mib": 18432}).status == 200
    assert gpud_t015.call("POST", "/v1/serves/ocr/admit", {"mib": 99999}).status == 409
    seen = [followed.next(), followed.next()]
    assert "admit" in seen[0] and "fast" in seen[0]
    assert "deny" in seen[1] and "ocr" in seen[1]
    while "committed 21888 MiB" not in watched.next():
        pass  # the watch has shown the ledger with both admissions
    started = time.monotonic()
    assert gpud_t015.stop() == 0
    _, err = follow.communicate(timeout=15)
    assert time.monotonic() - started < 10
    assert follow.returncode == 3, err
    assert "ended the event stream" in err
    _, werr = watch.communicate(timeout=15)
    assert watch.returncode == 3, werr
