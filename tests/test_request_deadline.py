"""A request's headers and body must arrive within daemon.request_read_timeout_s of its first
byte, for every peer (these tests run as root): a body sent a byte at a time is answered 408,
headers sent a byte at a time get the connection closed."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.fig_flood import flood_config
from tests.conftest import T015, GpudProcess, UnixHTTPConnection, start_gpud

DEADLINE_S = 1.0
CONFIG = T015.replace('admission = "ledger"',
                      f'admission = "ledger"\nrequest_read_timeout_s = {DEADLINE_S}')


@pytest.fixture(scope="module")
def gpud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GpudProcess]:
    gp = start_gpud(tmp_path_factory.mktemp("deadline"), CONFIG)
    yield gp
    gp.stop()


def _connect(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10 * DEADLINE_S)  # far past the deadline: a connection kept open fails here
    s.connect(str(path))
    return s


def _dribble(s: socket.socket, data: bytes, until: float) -> None:
    """A byte every tenth of the deadline, until the server closes or `until` passes."""
    for byte in data:
        if time.monotonic() > until:
            return
        try:
            s.send(bytes([byte]))
        except OSError:
            return  # closed by gpud
        time.sleep(DEADLINE_S / 10)


def _answer(s: socket.socket) -> bytes:
    """What gpud answered, up to its close. A close while the client's last bytes are still
    unread is reported by the kernel as a reset once the answer before it has been read
    (AF_UNIX: ECONNRESET after the queued data): the answer is what came before it, and a
    reset before any answer is a close with none (a dribbled byte can land after gpud's last
    read and before its close). A connection left open fails here by the socket's timeout."""
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def test_a_body_a_byte_at_a_time_is_answered_408(gpud: GpudProcess) -> None:
    s = _connect(gpud.socket)
    try:
        body = json.dumps({"mib": 1000, "role": "dark-fast"}).encode() + b" " * 200
        s.sendall(b"POST /v1/serves/ocr/admit HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
        started = time.monotonic()
        _dribble(s, body, started + 3 * DEADLINE_S)
        answer = _answer(s)  # the connection is closed after the answer
        took = time.monotonic() - started
    finally:
        s.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer[:300]
    assert json.loads(payload)["error"]["code"] == "request-timeout"
    assert DEADLINE_S * 0.9 <= took < 3 * DEADLINE_S, took
    assert gpud.call("GET", "/v1/serves/ocr").body["state"] == "declared"  # nothing admitted


def test_headers_a_byte_at_a_time_get_the_connection_closed(gpud: GpudProcess) -> None:
    s = _connect(gpud.socket)
    try:
        started = time.monotonic()
        _dribble(s, b"GET /v1/status HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200,
                 started + 3 * DEADLINE_S)
        answer = _answer(s)
        took = time.monotonic() - started
    finally:
        s.close()
    assert answer == b""
    assert DEADLINE_S * 0.9 <= took < 3 * DEADLINE_S, took
    assert gpud.call("GET", "/v1/status").status == 200


def test_the_deadline_does_not_run_between_requests(gpud: GpudProcess) -> None:
    """A keep-alive connection idle longer than the deadline is still served: the deadline
    runs from a request's first byte (idle connections are aiohttp's keep-alive timeout's)."""
    s = _connect(gpud.socket)
    request = b"GET /v1/status HTTP/1.1\r\nHost: x\r\n\r\n"
    try:
        for _ in range(2):
            s.sendall(request)
            data = b""
            while b"\r\n\r\n" not in data:
                data += s.recv(65536)
            head, _, rest = data.partition(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            while len(rest) < length:
                rest += s.recv(65536)
            assert head.startswith(b"HTTP/1.1 200"), head
            time.sleep(DEADLINE_S * 1.5)  # idle past the deadline
    finally:
        s.close()


def test_time_the_daemon_takes_to_get_to_a_request_is_not_the_peers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests sent whole, on time, while the loop is busy for longer than the deadline (here:
    8 plans made on the loop one after the other, as GPUD_EXPENSIVE_INLINE=1 makes them) are
    answered, not cut with a 408: the time the loop spent on the others is not the peer's."""
    monkeypatch.setenv("GPUD_EXPENSIVE_INLINE", "1")
    gp = start_gpud(tmp_path, CONFIG)
    try:
        big = json.dumps({"config": flood_config(11_000), "source": "big"}).encode()
        answers: list[int] = []

        def plan() -> None:
            conn = UnixHTTPConnection(str(gp.socket), timeout=300)  # they queue: minutes
            try:
                conn.request("POST", "/v1/plan", body=big)
                resp = conn.getresponse()
                resp.read()
                answers.append(resp.status)
            finally:
                conn.close()

        threads = [threading.Thread(target=plan) for _ in range(8)]
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        took = time.monotonic() - started
    finally:
        gp.stop()
    assert answers == [200] * 8
    assert took > 2 * DEADLINE_S, took  # the last of them waited longer than the deadline


def test_the_metrics_listener_has_the_deadline_too(tmp_path: Path) -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    gp = start_gpud(tmp_path, CONFIG.replace(
        "[daemon]", f'[daemon]\nmetrics_listen = "127.0.0.1:{port}"'))
    s = socket.create_connection(("127.0.0.1", port), timeout=10 * DEADLINE_S)
    try:
        started = time.monotonic()
        _dribble(s, b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200,
                 started + 3 * DEADLINE_S)
        answer = _answer(s)
        took = time.monotonic() - started
    finally:
        s.close()
        gp.stop()
    assert answer == b""
    assert DEADLINE_S * 0.9 <= took < 3 * DEADLINE_S, took
