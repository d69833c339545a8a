"""A cap on the connections each non-root peer may hold open on the API socket.

Anyone in group `gpud` may open the socket. Without a cap, one member holding idle or
slowly-dribbled connections could use up gpud's descriptors and lock everyone out, root
included. Each connection's peer uid is read (SO_PEERCRED) when it is accepted; past the cap the
new connection is closed at once. Root is never capped.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger("gpud.api")

DEFAULT_PER_UID = 64


class Limiter:
    def __init__(self, per_uid: int = DEFAULT_PER_UID) -> None:
        self.per_uid = per_uid
        self.open: dict[int, int] = {}
        self.refused = 0

    def admit(self, uid: int | None) -> bool:
        if uid is None or uid == 0:
            return True
        if self.open.get(uid, 0) >= self.per_uid:
            self.refused += 1
            if self.refused in (1, 10, 100) or self.refused % 1000 == 0:
                log.warning("uid %d holds %d connections: refusing more (%d refused so far)",
                            uid, self.per_uid, self.refused)
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


class _Guarded(asyncio.Protocol):
    """Wraps aiohttp's protocol: counts the connection against its peer, or closes it."""

    def __init__(self, inner: Any, limiter: Limiter) -> None:
        self._inner = inner
        self._limiter = limiter
        self._uid: int | None = None
        self._counted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._uid = peer_uid(transport)
        if not self._limiter.admit(self._uid):
            transport.close()
            return
        self._counted = True
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._counted:
            self._counted = False
            self._limiter.release(self._uid)
            self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._counted:
            self._inner.data_received(data)

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


class GuardedSockSite(web.SockSite):
    def __init__(self, runner: web.BaseRunner, sock: socket.socket, limiter: Limiter) -> None:
        # On stop, open requests get 3 s to finish (followers end at once: see daemon.py).
        super().__init__(runner, sock, shutdown_timeout=3.0)
        self.limiter = limiter

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        kwargs = server._kwargs  # what web.Server.__call__ would pass

        def factory() -> asyncio.Protocol:
            return _Guarded(JsonErrorHandler(server, loop=loop, **kwargs), self.limiter)

        self._server = await loop.create_server(factory, sock=self._sock, backlog=self._backlog)
