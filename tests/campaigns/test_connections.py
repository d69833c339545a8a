"""Campaign 3c: many idle connections and slow senders. While hundreds of connections sit idle,
some hold a half-sent request, and slowloris clients dribble their headers byte by byte, other
clients are still answered promptly, gpud's memory stays bounded, and once they all go away
gpud holds no more file descriptors than before.

Short form in the default run; long form: ``python3 -m pytest -m slow tests/campaigns -k
connections`` (GPUD_CAMPAIGN_IDLE, default 2000 idle connections).
"""

from __future__ import annotations

import contextlib
import resource
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.campaigns.conftest import Client, connect_raw, open_fds, rss_kib
from tests.conftest import T015, GpudProcess, start_gpud, wait_ready

SLOW_REQUEST = (b"POST /v1/serves/ocr/admit HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * 40) for i in range(150)))


class Slowloris(threading.Thread):
    """Sends a request's headers one byte at a time, never finishing them."""

    def __init__(self, sock: Path, interval: float, halt: threading.Event) -> None:
        super().__init__(daemon=True)
        self.sock, self.interval, self.halt = sock, interval, halt
        self.sent = 0
        self.cut_off = False

    def run(self) -> None:
        s = connect_raw(self.sock)
        try:
            for byte in SLOW_REQUEST:
                if self.halt.wait(self.interval):
                    return
                s.sendall(bytes([byte]))
                self.sent += 1
        except OSError:
            self.cut_off = True  # gpud may cut a slow sender off: allowed
        finally:
            s.close()


def timed_calls(gp: GpudProcess, n: int) -> list[float]:
    """Latencies of N fresh-connection reads and admits by an ordinary client."""
    out = []
    for i in range(n):
        client = Client(gp.socket, timeout=10)
        t = time.monotonic()
        if i % 4 == 3:
            status, body = client.request("POST", "/v1/serves/sidecar/admit",
                                          {"mib": 100 + i, "role": "dark-fast"})
        else:
            status, body = client.request("GET", "/v1/ledger")
        out.append(time.monotonic() - t)
        client.close()
        assert status == 200, body
    return out


def run_campaign(tmp: Path, idle: int, partial: int, slow: int, hold_s: float) -> dict[str, object]:
    gp = start_gpud(tmp, T015)
    conns: list[socket.socket] = []
    halt = threading.Event()
    slowpokes = [Slowloris(gp.socket, 0.02, halt) for _ in range(slow)]
    try:
        timed_calls(gp, 8)  # warm up
        rss0, fds0 = rss_kib(gp.proc.pid), open_fds(gp.proc.pid)
        for t in slowpokes:
            t.start()
        for i in range(idle + partial):
            s = connect_raw(gp.socket)
            if i >= idle:
                s.sendall(b"GET /v1/ledger HTTP/1.1\r\nHost: x\r\nX-Half: ")
            conns.append(s)
        # gpud holds them all (it may close idle ones after a while: measured now). It accepts
        # connections in the order they came: once it answers one made after them, it has
        # accepted every one of them.
        timed_calls(gp, 1)
        held_fds = open_fds(gp.proc.pid)
        deadline = time.monotonic() + hold_s
        latencies: list[float] = []
        while time.monotonic() < deadline:
            latencies += timed_calls(gp, 8)
        still_held = open_fds(gp.proc.pid)
        rss1 = rss_kib(gp.proc.pid)
        halt.set()
        for t in slowpokes:
            t.join(10)
        for s in conns:
            s.close()
        conns.clear()
        # gpud lets go of every connection that went away
        deadline = time.monotonic() + 10
        while open_fds(gp.proc.pid) > fds0 + 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        fds2 = open_fds(gp.proc.pid)
        assert gp.alive(), gp.output()[-3000:]
    finally:
        halt.set()
        for s in conns:
            s.close()
        gp.stop()
    latencies.sort()
    summary = {"idle": idle, "partial": partial, "slowloris": slow, "calls": len(latencies),
               "p50_ms": round(latencies[len(latencies) // 2] * 1000, 1),
               "max_ms": round(latencies[-1] * 1000, 1), "rss_growth_kib": rss1 - rss0,
               "fds_held": held_fds - fds0, "fds_held_at_end": still_held - fds0,
               "fds_after": fds2 - fds0}
    print(f"connections campaign: {summary}")
    assert held_fds - fds0 >= (idle + partial) * 0.9, "the idle connections never reached gpud"
    # Starvation would show as waits of the keep-alive timeout (15 s) or longer; on 2 loaded
    # cores a lone scheduling hiccup may reach a second, which is not what this looks for.
    p99 = latencies[int(len(latencies) * 0.99)]
    assert p99 < 1.0, f"ordinary clients waited {p99:.2f} s at p99: {summary}"
    assert latencies[-1] < 5.0, f"an ordinary client waited {latencies[-1]:.2f} s: {summary}"
    # a few KiB per connection at most
    assert rss1 - rss0 < 16 * 1024 + 16 * (idle + partial + slow), summary
    assert fds2 <= fds0 + 2, f"gpud still holds {fds2 - fds0} descriptors more than before"
    return summary


def test_connections_short(tmp_path: Path) -> None:
    run_campaign(tmp_path, idle=500, partial=50, slow=5, hold_s=3)


@pytest.mark.slow
def test_connections_long(tmp_path: Path) -> None:
    from tests.campaigns.conftest import knob

    run_campaign(tmp_path, idle=knob("IDLE", 2000), partial=200, slow=20, hold_s=30)


def test_fd_exhaustion_under_the_default_limit(tmp_path: Path) -> None:
    """Found by this campaign (fixed in a0ac50a): under systemd's default soft RLIMIT_NOFILE
    (1024) about a thousand idle connections made gpud unreachable for everyone, root included,
    for up to an hour (aiohttp's keep-alive timeout is 3630 s)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    try:
        gp = start_gpud(tmp_path, T015, wait=False)  # inherits the limit systemd would set
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    conns: list[socket.socket] = []
    try:
        wait_ready(gp)
        refused = 0
        for _ in range(1100):
            try:
                conns.append(connect_raw(gp.socket, timeout=0.5))
            except OSError:
                refused += 1
        # The client's connection comes after all of them, which gpud must get through first.
        client = Client(gp.socket, timeout=3)
        try:
            status, _ = client.request("GET", "/v1/status")
        except OSError as exc:
            raise AssertionError(f"with {len(conns)} idle connections open ({refused} more could "
                                 f"not connect) an ordinary client got no answer: {exc!r}") from exc
        finally:
            client.close()
        assert status == 200
    finally:
        for s in conns:
            with contextlib.suppress(OSError):
                s.close()
        gp.stop()
