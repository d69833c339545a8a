"""The clients of the hostile-front campaign (test_hostile_front.py), run inside the sandbox as
real unprivileged users: standard library only, one JSON line on stdout when done.

    hold PORT N SECONDS             N idle TCP connections to the front, held
    slow PORT N SECONDS             N requests whose headers come a line a second (slowloris)
    storm SEED THREADS SECONDS PORT...   requests going round the ports, in a seeded order
    serve SECONDS PORT...           another user's requests, each port every 0.3 s (timeout 5 s)
    stream PORT TOKENS              one streamed completion: how many tokens came, and [DONE]
"""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import resource
import select
import socket
import sys
import threading
import time
from collections import Counter
from typing import Any

HOST = "127.0.0.1"


def more_descriptors() -> int:
    """A user may raise its own soft limit up to the hard one: a hostile one does."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def connect_many(port: int, n: int, within: float) -> tuple[list[socket.socket], int]:
    """N connections begun at once (non-blocking), those established within `within` seconds,
    and how many were not (a front whose accept queue is full drops the handshakes)."""
    pending: dict[int, socket.socket] = {}
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        s.connect_ex((HOST, port))
        pending[s.fileno()] = s
    poller = select.poll()  # not select(): descriptors past 1024
    for fd in pending:
        poller.register(fd, select.POLLOUT)
    done: list[socket.socket] = []
    deadline = time.monotonic() + within
    while pending and time.monotonic() < deadline:
        for fd, _ev in poller.poll(100):
            s = pending.pop(fd, None)
            if s is None:
                continue
            poller.unregister(fd)
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                s.setblocking(True)
                done.append(s)
            else:
                s.close()
    for s in pending.values():
        s.close()
    return done, n - len(done)


def still_open(s: socket.socket) -> bool:
    """Whether the peer has not closed the connection (no EOF, no reset)."""
    try:
        return bool(s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        return True  # nothing to read: still open
    except OSError:
        return False


def hold(port: int, n: int, seconds: float) -> dict[str, Any]:
    limit = more_descriptors()
    began = time.monotonic()
    conns, failed = connect_many(port, n, within=min(10.0, seconds / 2))
    opened = len(conns)
    time.sleep(max(0.0, seconds - (time.monotonic() - began)))
    alive = sum(still_open(s) for s in conns)
    for s in conns:
        s.close()
    return {"mode": "hold", "asked": n, "opened": opened, "failed": failed,
            "alive_at_end": alive, "nofile": limit}


def slow(port: int, n: int, seconds: float) -> dict[str, Any]:
    more_descriptors()
    began = time.monotonic()
    conns, failed = connect_many(port, n, within=min(10.0, seconds / 2))
    for s in conns:
        with contextlib.suppress(OSError):
            s.send(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n", socket.MSG_DONTWAIT)
    sent = 0
    while time.monotonic() - began < seconds and conns:
        for s in conns:
            with contextlib.suppress(OSError):  # never blocks: a line a second, or none
                s.send(f"X-Slow-{sent}: a\r\n".encode(), socket.MSG_DONTWAIT)
        sent += 1
        time.sleep(1.0)
    alive = sum(still_open(s) for s in conns)
    for s in conns:
        s.close()
    return {"mode": "slow", "asked": n, "opened": len(conns), "failed": failed,
            "lines_sent": sent, "alive_at_end": alive}


def get(port: int, timeout: float) -> tuple[str, float, dict[str, str], str]:
    """GET /v1/models: (status or error name, seconds, headers, body)."""
    began = time.monotonic()
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("GET", "/v1/models")
        resp = conn.getresponse()
        body = resp.read().decode(errors="replace")
        return str(resp.status), time.monotonic() - began, dict(resp.getheaders()), body
    except (OSError, http.client.HTTPException) as exc:
        return type(exc).__name__, time.monotonic() - began, {}, ""
    finally:
        conn.close()


def storm(seed: int, threads: int, seconds: float, ports: list[int]) -> dict[str, Any]:
    statuses: Counter[str] = Counter()
    by_port: dict[str, Counter[str]] = {str(p): Counter() for p in ports}
    bodies: dict[str, str] = {}
    retry_after: Counter[str] = Counter()
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def client(i: int) -> None:
        r = random.Random(f"{seed}:{i}")
        k = r.randrange(len(ports))
        while time.monotonic() < end:
            # mostly alternating, at times the same one again
            k = (k + 1) % len(ports) if r.random() < 0.8 else k
            status, _took, headers, body = get(ports[k], timeout=10)
            with lock:
                statuses[status] += 1
                by_port[str(ports[k])][status] += 1
                if status == "503":
                    bodies.setdefault(str(ports[k]), body)
                    retry_after[headers.get("Retry-After", "-")] += 1

    workers = [threading.Thread(target=client, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return {"mode": "storm", "statuses": statuses, "by_port": by_port, "bodies_503": bodies,
            "retry_after": retry_after}


def serve(seconds: float, ports: list[int]) -> dict[str, Any]:
    """Another user's requests: every port every 0.3 s, each allowed 5 s."""
    answers: list[tuple[int, str, float]] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for port in ports:
            status, took, _h, _b = get(port, timeout=5)
            answers.append((port, status, round(took, 3)))
        time.sleep(0.3)
    return {"mode": "serve", "answers": answers}


def stream(port: int, tokens: int) -> dict[str, Any]:
    body = json.dumps({"prompt": "a b", "max_tokens": tokens, "stream": True})
    conn = http.client.HTTPConnection(HOST, port, timeout=60)
    got = 0
    done = False
    status = ""
    began = time.monotonic()
    try:
        conn.request("POST", "/v1/completions", body=body,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        status = str(resp.status)
        for raw in resp:
            line = raw.decode(errors="replace").strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                got += 1
    except (OSError, http.client.HTTPException) as exc:
        status = status or type(exc).__name__
    finally:
        conn.close()
    return {"mode": "stream", "status": status, "tokens": got, "asked": tokens, "done": done,
            "seconds": round(time.monotonic() - began, 2)}


def main(argv: list[str]) -> int:
    mode, *args = argv
    if mode == "hold":
        out = hold(int(args[0]), int(args[1]), float(args[2]))
    elif mode == "slow":
        out = slow(int(args[0]), int(args[1]), float(args[2]))
    elif mode == "storm":
        out = storm(int(args[0]), int(args[1]), float(args[2]), [int(p) for p in args[3:]])
    elif mode == "serve":
        out = serve(float(args[0]), [int(p) for p in args[1:]])
    elif mode == "stream":
        out = stream(int(args[0]), int(args[1]))
    else:
        print(f"unknown mode {mode!r}", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
