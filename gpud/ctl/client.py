"""gpuctl's client: requests to gpud through a ``Transport``, answers decoded or raised.

``Client`` speaks gpud's API: a JSON object in, the decoded JSON object out on 2xx, a
``CtlError`` built from the daemon's error object otherwise; ``stream`` reads NDJSON. How the
bytes travel is the transport's business: ``UnixTransport`` is HTTP/1.1 over gpud's Unix socket
(the default); ``MemoryTransport`` answers from a table in this process (for tests: no socket,
no thread).

``UnixTransport`` speaks HTTP with a small client of its own instead of ``http.client``: measured
on a clean Python 3.11, ``import http.client`` alone costs about 1.6 times a whole ``python3 -c
pass`` (it pulls in the ``email`` package and ``ssl``), which would break gpuctl's startup budget
on its own. For the same reason ``urllib.parse`` is not imported: ``quote_segment`` is its
``quote(s, safe="")``.
"""

from __future__ import annotations

import os

from gpud.ctl.errors import (
    EXIT_REFUSED,
    EXIT_UNREACHABLE,
    CtlError,
    api_error,
    timeout_error,
    unreachable_error,
    usage_error,
)

# Not ``typing.TYPE_CHECKING``: importing typing costs startup time. mypy treats any name
# TYPE_CHECKING as true. The protocols below exist for the type checker only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from _socket import socket as Socket
    from collections.abc import Callable, Iterator, Sequence
    from typing import Any, Protocol

    Doc = dict[str, Any]

    class DaemonAnswer(Protocol):
        """One answer of the daemon, its status known; the body read on demand."""

        status: int
        reason: str

        def read(self) -> bytes: ...

        def lines(self) -> Iterator[bytes]: ...

        def settimeout(self, timeout: float | None) -> None: ...

        def close(self) -> None: ...

    class Transport(Protocol):
        """How a request reaches gpud. ``address`` names where, for messages."""

        @property
        def address(self) -> str: ...

        def open(self, method: str, target: str, body: bytes | None,
                 timeout: float | None) -> DaemonAnswer:
            """Send one request and return its answer with the head read; raises CtlError when
            the daemon cannot be reached or does not answer in time."""
            ...

# Seconds to wait for an answer unless --timeout says otherwise. start and restart answer once the
# unit is launched; allow for a slow system bus and the wait for freed memory before it.
READ_TIMEOUT = 30.0
MUTATION_TIMEOUT = 120.0
LIFECYCLE_TIMEOUT = 600.0

_MAX_HEADER_LINE = 65536
_MAX_HEADERS = 100
_MAX_UNIX_PATH = 107  # sun_path is 108 bytes on Linux, with the terminating NUL


_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-~")


def quote_segment(text: str) -> str:
    """Percent-encode ``text`` for one path segment or query value.

    The same as ``urllib.parse.quote(text, safe="")``, except that arguments the terminal handed
    over as undecodable bytes go to the daemon as those bytes, so that it is the daemon that
    refuses a hostile serve name.
    """
    data = text.encode("utf-8", "surrogateescape")
    return "".join(chr(b) if b in _UNRESERVED else f"%{b:02X}" for b in data)


def query_string(params: Sequence[tuple[str, str]]) -> str:
    return "&".join(f"{quote_segment(k)}={quote_segment(v)}" for k, v in params)


class HttpAnswer:
    """One HTTP/1.1 answer, its headers read; the body is read on demand."""

    def __init__(self, sock: Socket, path: str) -> None:
        self._sock = sock
        self._buf = b""
        self._eof = False
        self.socket_path = path
        self.status = 0
        self.reason = ""
        self.headers: dict[str, str] = {}
        self._chunked = False
        self._remaining: int | None = None
        self._chunk_left = 0
        self._done = False

    def _fill(self) -> bool:
        """Read more from the socket into the buffer; False at the end of the stream."""
        if self._eof:
            return False
        data = self._sock.recv(65536)
        if not data:
            self._eof = True
            return False
        self._buf += data
        return True

    def _line(self) -> bytes:
        """One line with its ending; what is left at the end of the stream; b"" after it."""
        while (end := self._buf.find(b"\n")) < 0:
            if len(self._buf) > _MAX_HEADER_LINE:
                raise self._bad("header line too long")
            if not self._fill():
                end = len(self._buf) - 1
                break
        line, self._buf = self._buf[:end + 1], self._buf[end + 1:]
        return line

    def _read_upto(self, n: int) -> bytes:
        """Up to ``n`` bytes, at least one unless the stream ended."""
        if not self._buf:
            self._fill()
        data, self._buf = self._buf[:n], self._buf[n:]
        return data

    def _bad(self, why: str) -> CtlError:
        return CtlError("bad-response",
                        f"gpud at {self.socket_path} answered with something that is not HTTP: "
                        f"{why}", EXIT_REFUSED, {"socket": self.socket_path})

    def read_head(self) -> None:
        while True:
            line = self._line()
            if not line:
                raise CtlError("unreachable",
                               f"gpud at {self.socket_path} closed the connection without "
                               "answering (did it stop?)", EXIT_UNREACHABLE,
                               {"socket": self.socket_path})
            parts = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
            if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
                raise self._bad(f"status line {line[:80]!r}")
            self.status = int(parts[1])
            self.reason = parts[2] if len(parts) > 2 else ""
            self.headers = {}
            for _ in range(_MAX_HEADERS + 1):
                line = self._line()
                if line in (b"\r\n", b"\n", b""):
                    break
                name, sep, value = line.decode("latin-1").partition(":")
                if not sep:
                    raise self._bad(f"header line {line[:80]!r}")
                self.headers[name.strip().lower()] = value.strip()
            else:
                raise self._bad("too many header lines")
            if self.status >= 200 or self.status == 101:
                break  # 1xx answers are interim: the real one follows
        self._chunked = "chunked" in self.headers.get("transfer-encoding", "").lower()
        length = self.headers.get("content-length")
        if not self._chunked and length is not None:
            if not length.isdigit():
                raise self._bad(f"Content-Length {length!r}")
            self._remaining = int(length)

    def read1(self) -> bytes:
        """The next piece of the body; b"" at its end."""
        if self._done:
            return b""
        if self._chunked:
            if self._chunk_left == 0:
                size_line = self._line()
                size_text = size_line.split(b";", 1)[0].strip()
                try:
                    self._chunk_left = int(size_text, 16)
                except ValueError:
                    if not size_line:  # closed in the middle of the body
                        self._done = True
                        return b""
                    raise self._bad(f"chunk size {size_line[:40]!r}") from None
                if self._chunk_left == 0:
                    while self._line() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    self._done = True
                    return b""
            data = self._read_upto(self._chunk_left)
            if not data:
                self._done = True
                return b""
            self._chunk_left -= len(data)
            if self._chunk_left == 0:
                self._line()  # the CRLF after the chunk
            return data
        if self._remaining is not None:
            if self._remaining == 0:
                self._done = True
                return b""
            data = self._read_upto(self._remaining)
            self._remaining -= len(data)
        else:
            data = self._read_upto(65536)
        if not data:
            self._done = True
        return data

    def read(self) -> bytes:
        parts = []
        while piece := self.read1():
            parts.append(piece)
        return b"".join(parts)

    def lines(self) -> Iterator[bytes]:
        """The body as lines (NDJSON), each yielded as soon as it is complete."""
        pending = b""
        while piece := self.read1():
            pending += piece
            *complete, pending = pending.split(b"\n")
            yield from complete
        if pending:
            yield pending

    def settimeout(self, timeout: float | None) -> None:
        self._sock.settimeout(timeout)

    def close(self) -> None:
        self._sock.close()




class UnixTransport:
    """HTTP/1.1 over gpud's Unix socket, a fresh connection per request."""

    def __init__(self, path: str) -> None:
        self.address = path

    def open(self, method: str, target: str, body: bytes | None,
             timeout: float | None) -> HttpAnswer:
        # _socket, not socket: the socket module builds enums of every constant at import, which
        # costs a tenth of gpuctl's start; what gpuctl needs is all in the C module.
        import _socket

        from gpud import __version__

        socket_path = self.address
        head = [f"{method} {target} HTTP/1.1", "Host: localhost",
                f"User-Agent: gpuctl/{__version__}", "Accept: application/json",
                "Connection: close"]
        if body is not None:
            head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        payload = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (body or b"")
        if len(os.fsencode(socket_path)) > _MAX_UNIX_PATH:
            raise usage_error(f"socket path too long for a Unix socket (over {_MAX_UNIX_PATH} "
                              f"bytes): {socket_path}", socket=socket_path)
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            try:
                sock.connect(socket_path)
            except OSError as exc:
                raise unreachable_error(socket_path, exc) from exc
            try:
                sock.sendall(payload)
                resp = HttpAnswer(sock, socket_path)
                try:
                    resp.read_head()
                except BaseException:
                    resp.close()
                    raise
            except TimeoutError as exc:
                raise timeout_error(socket_path, timeout) from exc
            except OSError as exc:  # reset, broken pipe: the daemon went away under us
                raise CtlError("unreachable", f"gpud at {socket_path} dropped the connection: "
                               f"{exc.strerror or exc}", EXIT_UNREACHABLE,
                               {"socket": socket_path}) from exc
        except BaseException:
            sock.close()
            raise
        return resp


class MemoryRequest:
    """One request a ``MemoryTransport`` was sent."""

    def __init__(self, method: str, target: str, body: bytes | None) -> None:
        self.method = method
        self.target = target  # the path with its query string
        self.path, _, self.query = target.partition("?")
        self.body = body

    def json(self) -> Any:
        import json

        return None if self.body is None else json.loads(self.body)


class MemoryAnswer:
    """An answer held in memory: the whole body at once."""

    def __init__(self, status: int, body: bytes, reason: str = "") -> None:
        self.status = status
        self.reason = reason
        self._body: bytes | None = body

    def read(self) -> bytes:
        body, self._body = self._body or b"", None
        return body

    def lines(self) -> Iterator[bytes]:
        yield from (line for line in self.read().split(b"\n") if line)

    def settimeout(self, timeout: float | None) -> None:
        pass

    def close(self) -> None:
        self._body = None


# What a MemoryTransport route returns: (HTTP status, body) where the body is a JSON document,
# bytes sent as they are, or a list of documents sent as NDJSON lines (a stream that then ends).
if TYPE_CHECKING:
    MemoryReply = tuple[int, Any]
    MemoryRoute = Callable[[MemoryRequest], MemoryReply]
    AnswerCheck = Callable[[MemoryRequest, int, Any], None]


class MemoryTransport:
    """A gpud answering from a table in this process, for tests of commands and formatters.

    ``routes`` maps (method, path without the query) to a function of the request; a path not
    routed answers 404 with gpud's error shape. Every request is kept in ``requests``. ``check``,
    when given, sees every answer before gpuctl does (to hold canned answers to the served
    schema). A route may raise, as a transport does (a CtlError for an unreachable daemon).
    """

    def __init__(self, address: str = "memory", check: AnswerCheck | None = None) -> None:
        self.address = address
        self.routes: dict[tuple[str, str], MemoryRoute] = {}
        self.requests: list[MemoryRequest] = []
        self.check = check

    def answer(self, method: str, path: str, status: int, doc: Any) -> None:
        """Answer every ``method path`` with ``status`` and ``doc``."""
        self.routes[(method, path)] = lambda req: (status, doc)

    @property
    def last(self) -> MemoryRequest:
        return self.requests[-1]

    def open(self, method: str, target: str, body: bytes | None,
             timeout: float | None) -> MemoryAnswer:
        import json

        req = MemoryRequest(method, target, body)
        self.requests.append(req)
        route = self.routes.get((method, req.path))
        if route is None:
            status, doc = 404, {"error": {"code": "not-found", "message": f"no route {req.path}",
                                          "details": {}}}
        else:
            status, doc = route(req)
        if self.check is not None:
            self.check(req, status, doc)
        if isinstance(doc, bytes):
            data = doc
        elif isinstance(doc, list):
            data = b"".join(json.dumps(d).encode() + b"\n" for d in doc)
        else:
            data = json.dumps(doc).encode()
        return MemoryAnswer(status, data)


def _decode(status: int, body: bytes) -> Any:
    import json

    try:
        return json.loads(body)
    except ValueError as exc:
        raise CtlError("bad-response", f"gpud answered HTTP {status} with a body that is "
                       f"not JSON: {body[:80]!r}", EXIT_REFUSED, {"status": status}) from exc


class Client:
    """Requests to one gpud through ``transport``. Every call opens its own connection."""

    def __init__(self, transport: Transport, timeout: float | None = None) -> None:
        self.transport = transport
        self.timeout = timeout

    @property
    def address(self) -> str:
        """Where gpud is (its socket path), for messages."""
        return self.transport.address

    def call(self, method: str, target: str, body: Doc | None = None,
             timeout: float = READ_TIMEOUT) -> Any:
        """One request; the decoded JSON object on 2xx, else raises CtlError.

        Typed Any: the answer is the route's (gpud.core.answers), which the formatter that
        reads it is typed with."""
        import json

        data = None if body is None else json.dumps(body).encode()
        wait = self.timeout if self.timeout is not None else timeout
        resp = self.transport.open(method, target, data, wait)
        try:
            raw = resp.read()
        except TimeoutError as exc:
            raise timeout_error(self.address, wait) from exc
        except OSError as exc:
            raise CtlError("unreachable", f"gpud at {self.address} dropped the connection: "
                           f"{exc.strerror or exc}", EXIT_UNREACHABLE,
                           {"socket": self.address}) from exc
        finally:
            resp.close()
        if not 200 <= resp.status < 300:
            raise api_error(resp.status, resp.reason, raw)
        doc = _decode(resp.status, raw)
        if not isinstance(doc, dict):
            raise CtlError("bad-response", "gpud answered with JSON that is not an object",
                           EXIT_REFUSED, {"status": resp.status})
        return doc

    def stream(self, target: str, method: str = "GET", body: Doc | None = None) -> Iterator[Any]:
        """An NDJSON stream: one decoded object per line, blank keepalive lines skipped.

        Returns when the daemon ends the stream; a stream gpuctl did not end itself means the
        daemon went away, which the caller reports.
        """
        import json

        wait = self.timeout if self.timeout is not None else READ_TIMEOUT
        data = None if body is None else json.dumps(body).encode()
        resp = self.transport.open(method, target, data, wait)
        try:
            if not 200 <= resp.status < 300:
                raise api_error(resp.status, resp.reason, resp.read())
            resp.settimeout(None)  # an idle stream is not a fault: events are rare
            try:
                for line in resp.lines():
                    if line.strip():
                        doc = _decode(resp.status, line)
                        if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
                            raise api_error(500, "", line)
                        if isinstance(doc, dict):
                            yield doc
            except OSError:
                return  # reset by a daemon that went away: the caller says so
        finally:
            resp.close()
