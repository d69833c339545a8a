"""A hostile local user's connection holder: keeps N idle and M slow-header TCP connections open
to one port, replacing each one the server closes, until stdin closes or --duration passes.

Idle: connected, nothing sent. Slow header: a request line and then one header field a second,
never the blank line that ends the header (slowloris). Source addresses cycle over 127.1.0.0/16
(any local user may bind any 127.x address, so the server cannot tell them apart by address).

Prints one JSON line a second: {"idle": open, "slow": open, "closed_by_peer": n,
"connect_failed": n, "ready": bool}; "ready" once both counts were reached. Standard library
only: it runs as an unprivileged user inside the sandbox.
"""

from __future__ import annotations

import argparse
import errno
import json
import resource
import selectors
import socket
import sys
import time

CONNECT_TIMEOUT_S = 3.0
IN_FLIGHT = 256  # connects under way at once: the listen queue is not flooded


class Holder:
    def __init__(self, host: str, port: int, idle: int, slow: int, sources: int) -> None:
        self.host, self.port = host, port
        self.want = {"idle": idle, "slow": slow}
        self.sources = sources
        self.sel = selectors.DefaultSelector()
        # socket -> (kind, phase, since): phase "connecting" or "open"
        self.socks: dict[socket.socket, tuple[str, str, float]] = {}
        self.closed_by_peer = 0
        self.connect_failed = 0
        self.ready = False
        self._n = 0

    def count(self, kind: str, phase: str = "open") -> int:
        return sum(1 for k, p, _ in self.socks.values() if k == kind and p == phase)

    def _source(self) -> str:
        self._n += 1
        i = self._n % self.sources
        return f"127.1.{i // 250}.{i % 250 + 1}"

    def _connect(self, kind: str) -> bool:
        """Start one connect; False when it failed at once (try again at the next step)."""
        try:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        except OSError:  # out of descriptors
            self.connect_failed += 1
            return False
        s.setblocking(False)
        try:
            if self.sources:
                s.bind((self._source(), 0))
            rc = s.connect_ex((self.host, self.port))
        except OSError:
            rc = -1
        if rc not in (0, errno.EINPROGRESS):
            s.close()
            self.connect_failed += 1
            return False
        self.socks[s] = (kind, "connecting", time.monotonic())
        self.sel.register(s, selectors.EVENT_WRITE)
        return True

    def _drop(self, s: socket.socket) -> None:
        self.sel.unregister(s)
        del self.socks[s]
        s.close()

    def _opened(self, s: socket.socket) -> None:
        kind, _, _ = self.socks[s]
        if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            self.connect_failed += 1
            self._drop(s)
            return
        if kind == "slow":
            try:
                s.send(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
            except OSError:
                self.closed_by_peer += 1
                self._drop(s)
                return
        self.socks[s] = (kind, "open", time.monotonic())
        self.sel.modify(s, selectors.EVENT_READ)

    def _readable(self, s: socket.socket) -> None:
        try:
            data = s.recv(4096)
        except OSError:
            data = b""
        if not data:  # closed (or reset) by the server: a 408 comes before its close
            self.closed_by_peer += 1
            self._drop(s)

    def _dribble(self) -> None:
        now = time.monotonic()
        for s, (kind, phase, since) in list(self.socks.items()):
            if kind == "slow" and phase == "open" and now - since >= 1.0:
                try:
                    s.send(b"X-Hold: 1\r\n")
                except OSError:
                    self.closed_by_peer += 1
                    self._drop(s)
                    continue
                self.socks[s] = (kind, phase, now)
            elif phase == "connecting" and now - since > CONNECT_TIMEOUT_S:
                self.connect_failed += 1
                self._drop(s)

    def step(self) -> None:
        connecting = sum(1 for _, p, _ in self.socks.values() if p == "connecting")
        for kind, want in self.want.items():
            missing = want - self.count(kind) - self.count(kind, "connecting")
            for _ in range(min(missing, IN_FLIGHT - connecting)):
                if not self._connect(kind):
                    break
                connecting += 1
        for key, _ in self.sel.select(timeout=0.05) if self.socks else time.sleep(0.05) or ():
            s = key.fileobj
            assert isinstance(s, socket.socket)
            if s not in self.socks:
                continue
            if self.socks[s][1] == "connecting":
                self._opened(s)
            else:
                self._readable(s)
        self._dribble()
        if all(self.count(k) >= w for k, w in self.want.items()):
            self.ready = True

    def status(self) -> str:
        return json.dumps({"idle": self.count("idle"), "slow": self.count("slow"),
                           "closed_by_peer": self.closed_by_peer,
                           "connect_failed": self.connect_failed, "ready": self.ready})

    def close(self) -> None:
        for s in list(self.socks):
            self._drop(s)
        self.sel.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--idle", type=int, default=0)
    ap.add_argument("--slow", type=int, default=0)
    ap.add_argument("--sources", type=int, default=1000,
                    help="source addresses in 127.1.0.0/16 to cycle over (0: the kernel's)")
    ap.add_argument("--duration", type=float, default=120.0)
    args = ap.parse_args()
    # What an unprivileged user may do: raise its own soft limit to the hard one.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = args.idle + args.slow + 64
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    holder = Holder(args.host, args.port, args.idle, args.slow, args.sources)
    stdin = selectors.DefaultSelector()
    stdin.register(sys.stdin, selectors.EVENT_READ)
    deadline = time.monotonic() + args.duration
    last = 0.0
    try:
        while time.monotonic() < deadline:
            holder.step()
            if time.monotonic() - last >= 1.0:
                last = time.monotonic()
                print(holder.status(), flush=True)
            if stdin.select(timeout=0) and not sys.stdin.readline():
                break  # stdin closed: the test is done
    finally:
        holder.close()
    print(holder.status(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
