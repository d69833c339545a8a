"""The per-peer connection cap on the API socket."""

from __future__ import annotations

import os
import select
import socket
import tempfile
import time
from pathlib import Path

import pytest

from gpud.server.connguard import Limiter
from tests.conftest import T015, start_gpud


def test_limiter_caps_non_root_only() -> None:
    lim = Limiter(per_uid=2)
    assert lim.admit(1000) and lim.admit(1000)
    assert not lim.admit(1000)
    assert lim.admit(1001)
    assert all(lim.admit(0) for _ in range(100))  # root is never capped
    lim.release(1000)
    assert lim.admit(1000)
    assert lim.refused == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_a_member_cannot_lock_out_root() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="gpud-guard-"))
    tmp.chmod(0o755)
    gp = start_gpud(tmp, T015)
    gp.socket.chmod(0o666)
    # Two pipes: the child says when its connections are open and how many gpud closed; the
    # parent says when to count and when to let go.
    up_read, up_write = os.pipe()
    down_read, down_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child, as nobody: open 80 connections and hold them
        os.close(up_read)
        os.close(down_write)
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
        held = []
        for _ in range(80):
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(gp.socket))
            held.append(s)
        os.write(up_write, b"open\n")
        os.read(down_read, 1)  # root has been answered: gpud accepted all 80 before it
        # Every connection over the cap was closed when gpud accepted it, so before root's
        # answer: wait (bounded) until those are seen, then take whatever else is closed.
        gone: set[int] = set()
        deadline = time.monotonic() + 20
        while True:
            timeout = 0.0 if len(gone) >= 80 - 64 or time.monotonic() > deadline else 0.2
            readable, _, _ = select.select([s for s in held if s.fileno() not in gone], [], [],
                                           timeout)
            gone |= {s.fileno() for s in readable if s.recv(1) == b""}
            if timeout == 0.0:
                break
        os.write(up_write, str(len(gone)).encode())
        os.read(down_read, 1)  # held until the parent is done
        os._exit(0)
    os.close(up_write)
    os.close(down_read)
    try:
        assert os.read(up_read, 100) == b"open\n"
        # Root is served while the member holds its 64 (its connections came first).
        assert gp.call("GET", "/v1/status").status == 200
        os.write(down_write, b"c")
        closed = int(os.read(up_read, 100) or b"-1")
        # The cap (64) held: the rest were closed at once.
        assert closed == 80 - 64
        assert "refusing more" in gp.output()
    finally:
        os.close(down_write)
        os.waitpid(pid, 0)
        os.close(up_read)
        gp.stop()


def test_the_fronts_uid_has_its_own_cap_others_the_default() -> None:
    front = 997
    lim = Limiter(per_uid=2, cap_of=lambda uid: 5 if uid == front else None)
    assert [lim.admit(1000) for _ in range(3)] == [True, True, False]
    assert [lim.admit(front) for _ in range(6)] == [True] * 5 + [False]
    lim.release(front)
    assert lim.admit(front)
