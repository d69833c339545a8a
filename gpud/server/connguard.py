"""A cap on the connections each non-root peer may hold open on the API socket, and a deadline
for every peer's requests to arrive.

Anyone in group `gpud` may open the socket. Without a cap, one member holding idle or
slowly-dribbled connections could use up gpud's descriptors and lock everyone out, root
included. Each connection's peer uid is read (SO_PEERCRED) when it is accepted; past the cap the
new connection is closed at once. Root is never capped.

The deadline (daemon.request_read_timeout_s) runs from a request's first byte: its headers must
have arrived by then, or the connection is closed (aiohttp has no such timeout of its own: its
keep-alive timeout only runs between requests); the API reads its body within as long again
from the moment its handler begins, and answers 408 `request-timeout` past it
(gpud.server.reading.read_json). For every peer, root included, and on the metrics listener too: one byte
a second would otherwise hold a connection, and what it holds, indefinitely.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger("gpud.api")

DEFAULT_PER_UID = 64
# A deadline whose timer ran this much late (it runs a millisecond late at most when the loop is
# free) found the loop busy with other requests, not the peer slow: the peer is given that time
# again.
LATE_S = 0.05


# Connections of the front's uid kept for what is not an ensure waiting (reads: the states
# the router's /v1/models shows; ensures answered at once), above daemon.ensure_waiting_total.
FRONT_READ_RESERVE = 64


class Limiter:
    """The cap per uid: PER_UID connections, or what CAP_OF says for a uid (the front's: it
    carries every local user's requests, so it is not one user's bucket; gpud bounds its
    ensures by requester instead, gpud.core.router.EnsureBound)."""

    def __init__(self, per_uid: int = DEFAULT_PER_UID,
                 cap_of: Callable[[int], int | None] | None = None) -> None:
        self.per_uid = per_uid
        self.cap_of = cap_of
        self.open: dict[int, int] = {}
        self.refused = 0

    def cap(self, uid: int) -> int:
        own = self.cap_of(uid) if self.cap_of is not None else None
        return self.per_uid if own is None else own

    def admit(self, uid: int | None) -> bool:
        if uid is None or uid == 0:
            return True
        cap = self.cap(uid)
        if self.open.get(uid, 0) >= cap:
            self.refused += 1
            if self.refused in (1, 10, 100) or self.refused % 1000 == 0:
                log.warning("uid %d holds %d connections: refusing more (%d refused so far)",
                            uid, cap, self.refused)
            return False
        self.open[uid] = self.open.get(uid, 0) + 1
        return True

    def release(self, uid: int | None) -> None:
        if uid is None or uid == 0:
            return
        left = self.open.get(uid, 1) - 1
        if left > 0:
            self.open[uid] = left
        else:
            self.open.pop(uid, None)


def peer_uid(transport: asyncio.BaseTransport) -> int | None:
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    return int(struct.unpack("3i", raw)[1])


class Guarded(asyncio.Protocol):
    """Wraps aiohttp's protocol: counts the connection against its peer, or closes it; closes it
    too when a request's headers have not arrived `read_timeout()` seconds after its first
    byte. The API tells it when a request's handler begins (`request_began`, which answers the
    deadline its body must arrive by: from then, so that time the daemon took to get to the
    request is not counted against the peer) and ends (`request_done`)."""

    def __init__(self, inner: Any, limiter: Limiter,
                 read_timeout: Callable[[], float] | None = None) -> None:
        self._inner = inner
        self._limiter = limiter
        self._read_timeout = read_timeout
        self._uid: int | None = None
        self._counted = False
        self._transport: asyncio.BaseTransport | None = None
        self._timer: asyncio.TimerHandle | None = None
        # a request's headers are in and it is not answered yet: what arrives is its body (or
        # the next request, pipelined), the handler's to bound
        self._open = False
        # done when the connection is lost (`lost`): a waiting handler learns its asker went
        self._lost: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._uid = peer_uid(transport)
        if not self._limiter.admit(self._uid):
            transport.close()
            return
        self._counted = True
        self._transport = transport
        self._inner.connection_made(transport)

    def lost(self) -> asyncio.Future[None]:
        """Done once the peer's connection is lost (a handler that waits, the front's ensure in
        the queue, stops waiting then: gpud.life.ondemand)."""
        if self._lost is None:
            self._lost = asyncio.get_running_loop().create_future()
            if self._transport is None or self._transport.is_closing():
                self._lost.set_result(None)
        return self._lost

    def connection_lost(self, exc: Exception | None) -> None:
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(None)
        self._stop_timer()
        if self._counted:
            self._counted = False
            self._limiter.release(self._uid)
            self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._counted:
            return
        if not self._open and self._timer is None:
            self._start_timer()
        before = self._heads()
        self._inner.data_received(data)
        if self._heads() > before:  # aiohttp parsed a request's headers
            self._stop_timer()
            self._open = True

    def _heads(self) -> int:
        return int(getattr(self._inner, "heads_parsed", 0))

    def _start_timer(self, seconds: float | None = None) -> None:
        if self._read_timeout is None:
            return
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(seconds or self._read_timeout(), self._expired)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        timer, self._timer = self._timer, None
        late = asyncio.get_running_loop().time() - timer.when() if timer is not None else 0.0
        if late >= LATE_S:  # the loop was busy past the deadline: that time is not the peer's
            self._start_timer(late)
            return
        log.warning("uid %s sent no whole request headers within %g s: connection closed",
                    self._uid, self._read_timeout() if self._read_timeout else 0)
        if self._transport is not None:
            self._transport.close()

    def request_began(self) -> float | None:
        """A request's handler begins: the loop time its body must have arrived by (None: no
        deadline)."""
        self._stop_timer()
        self._open = True
        if self._read_timeout is None:
            return None
        return asyncio.get_running_loop().time() + self._read_timeout()

    def request_done(self) -> None:
        # What arrives from now on is a new request: its first byte starts its deadline.
        self._open = False

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._counted else None

    def pause_writing(self) -> None:
        if self._counted:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._counted:
            self._inner.resume_writing()


class JsonErrorHandler(RequestHandler):
    """aiohttp's protocol, but its own answers to requests it cannot parse (bad method, an
    8 KiB header, broken chunking) use gpud's one error shape instead of text/plain."""

    __slots__ = ()

    @property
    def heads_parsed(self) -> int:
        """How many requests' headers aiohttp has parsed on this connection (its own count:
        RequestHandler.data_received adds one per message its parser gives)."""
        return int(self._request_count)

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs; refuses once output began
        code = "bad-request" if status < 500 else "internal"
        text = (f"malformed HTTP request: {message or exc or 'unreadable'}" if status < 500
                else "internal error")
        resp = web.Response(status=status, content_type="application/json",
                            text=json.dumps({"error": {"code": code, "message": text,
                                                       "details": {}}}))
        resp.force_close()
        return resp


def _guarded(runner: web.BaseRunner, limiter: Limiter,
             read_timeout: Callable[[], float] | None) -> Callable[[], asyncio.Protocol]:
    server = runner.server
    assert server is not None
    loop = asyncio.get_running_loop()
    kwargs = server._kwargs  # what web.Server.__call__ would pass

    def factory() -> asyncio.Protocol:
        return Guarded(JsonErrorHandler(server, loop=loop, **kwargs), limiter, read_timeout)

    return factory


class GuardedSockSite(web.SockSite):
    def __init__(self, runner: web.BaseRunner, sock: socket.socket, limiter: Limiter,
                 read_timeout: Callable[[], float] | None = None) -> None:
        # On stop, open requests get 3 s to finish (followers end at once: see daemon.py).
        super().__init__(runner, sock, shutdown_timeout=3.0)
        self.limiter = limiter
        self.read_timeout = read_timeout

    async def start(self) -> None:
        await web.BaseSite.start(self)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            _guarded(self._runner, self.limiter, self.read_timeout), sock=self._sock,
            backlog=self._backlog)


class GuardedTCPSite(web.TCPSite):
    """The metrics listener (daemon.metrics_listen): the same request deadline (its peers have
    no uid: they are not capped)."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int,
                 read_timeout: Callable[[], float] | None = None) -> None:
        super().__init__(runner, host, port, shutdown_timeout=3.0)
        self.read_timeout = read_timeout

    async def start(self) -> None:
        await web.BaseSite.start(self)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            _guarded(self._runner, Limiter(), self.read_timeout), self._host, self._port,
            backlog=self._backlog, reuse_address=self._reuse_address,
            reuse_port=self._reuse_port)
