"""gpuctl: the command-line client of gpud.

gpuctl is thin: every answer comes from the daemon over its Unix socket (HTTP/1.1 + JSON, see
docs/api.md); gpuctl only turns arguments into requests and answers into lines, and exits with

    0  ok
    1  denied, refused, forbidden, conflict, unavailable, or a daemon fault
    2  usage or bad input (argument errors; HTTP 400, 404, 413)
    3  the daemon cannot be reached

Startup time is part of the interface (scripts and shell completion call gpuctl in loops), so this
module imports nothing but ``os`` and ``sys`` at the top and only the standard library anywhere.
It speaks HTTP with a small client of its own instead of ``http.client``: measured on a clean
Python 3.11, ``import http.client`` alone costs about 1.6 times a whole ``python3 -c pass``
(it pulls in the ``email`` package and ``ssl``), which would break the startup budget of
2.5 times ``python3 -c pass`` on its own. For the same reason ``urllib.parse`` is not imported:
``quote_segment`` is its ``quote(s, safe="")``.

The formatting functions (``format_*``) and ``parse_since`` are pure: a decoded JSON answer in,
text out. Each command is one ``Command`` row in ``COMMANDS``; a new command (plan, apply,
calibrate) is a new row with its ``configure`` and ``run`` functions.
"""

from __future__ import annotations

import math
import os
import sys

# Not ``typing.TYPE_CHECKING``: importing typing costs startup time. mypy treats any name
# TYPE_CHECKING as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    import datetime
    from _socket import socket as Socket
    from collections.abc import Callable, Iterator, Mapping, Sequence
    from typing import Any, TextIO

    Doc = dict[str, Any]

DEFAULT_SOCKET = "/run/gpud/gpud.sock"
SOCKET_ENV = "GPUD_SOCKET"

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what the shell reports for a writer whose reader left

START_HINT = "start it with `systemctl start gpud` or `gpud --config /etc/gpud/serves.toml`"

# Seconds to wait for an answer unless --timeout says otherwise. start and restart answer once the
# unit is launched; allow for a slow system bus and the wait for freed memory before it.
READ_TIMEOUT = 30.0
MUTATION_TIMEOUT = 120.0
LIFECYCLE_TIMEOUT = 600.0

from gpud.core.vocab import EVENT_KINDS, EXIT_CODES, STATES  # noqa: E402 - defined once

_MAX_HEADER_LINE = 65536
_MAX_HEADERS = 100
_MAX_UNIX_PATH = 107  # sun_path is 108 bytes on Linux, with the terminating NUL


# ---- errors ---------------------------------------------------------------------------------


class CtlError(Exception):
    """An outcome gpuctl reports and exits with.

    ``code`` is the daemon's ``error.code`` when the daemon answered, else one of gpuctl's own:
    ``unreachable``, ``usage``, ``timeout``, ``bad-response``.
    """

    def __init__(self, code: str, message: str, exit_code: int,
                 details: Doc | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.exit_code = exit_code
        self.details: Doc = details if details is not None else {}
        self.status = status

    def to_json(self) -> Doc:
        return {"error": {"code": self.code, "message": self.message, "details": self.details}}


def usage_error(message: str, **details: Any) -> CtlError:
    return CtlError("usage", message, EXIT_USAGE, dict(details))


def exit_code_for_status(status: int) -> int:
    """The exit code for an HTTP status, for an answer without a known error.code."""
    if 200 <= status < 300:
        return EXIT_OK
    if status in (403, 409, 429):
        return EXIT_REFUSED
    if 400 <= status < 500:
        return EXIT_USAGE
    return EXIT_REFUSED


def api_error(status: int, reason: str, body: bytes) -> CtlError:
    """The CtlError for a non-2xx answer; tolerates a body that is not the documented shape."""
    import json

    exit_code = exit_code_for_status(status)
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    err = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        details = err.get("details")
        code = str(err.get("code") or "error")
        # The daemon's error code decides, from the table its error tree is built on; the HTTP
        # status only for a code this gpuctl does not know.
        return CtlError(code, err["message"], EXIT_CODES.get(code, exit_code),
                        details if isinstance(details, dict) else {}, status)
    text = body.decode("utf-8", "replace").strip()[:200]
    message = f"gpud answered HTTP {status} {reason}".rstrip() + (f": {text}" if text else "")
    return CtlError(f"http-{status}", message, exit_code, {"status": status}, status)


def unreachable_error(path: str, exc: OSError) -> CtlError:
    """Why the daemon's socket could not be used, and what to do about it."""
    import errno

    details = {"socket": path, "errno": errno.errorcode.get(exc.errno or 0), "reason": exc.strerror}
    if exc.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTDIR):
        return CtlError("unreachable", f"gpud is not running at {path}: {START_HINT}",
                        EXIT_UNREACHABLE, details)
    if exc.errno in (errno.EACCES, errno.EPERM):
        return CtlError("unreachable",
                        f"permission denied on {path}: join group gpud "
                        "(`sudo usermod -aG gpud $USER`, then log in again) or run as root",
                        EXIT_UNREACHABLE, details)
    if isinstance(exc, TimeoutError):
        return CtlError("unreachable", f"gpud at {path} does not accept connections (timed out)",
                        EXIT_UNREACHABLE, details)
    reason = exc.strerror or str(exc)
    return CtlError("unreachable", f"cannot reach gpud at {path}: {reason}",
                    EXIT_UNREACHABLE, details)


# ---- HTTP over the Unix socket ----------------------------------------------------------------


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


class Response:
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


def open_request(socket_path: str, method: str, target: str, body: bytes | None,
                 timeout: float | None) -> Response:
    """Send one request on a fresh connection and read the answer's head."""
    # _socket, not socket: the socket module builds enums of every constant at import, which
    # costs a tenth of gpuctl's start; what gpuctl needs is all in the C module.
    import _socket

    from gpud import __version__

    head = [f"{method} {target} HTTP/1.1", "Host: localhost", f"User-Agent: gpuctl/{__version__}",
            "Accept: application/json", "Connection: close"]
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
            resp = Response(sock, socket_path)
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


def timeout_error(socket_path: str, timeout: float | None) -> CtlError:
    return CtlError("timeout",
                    f"gpud at {socket_path} did not answer within {timeout:g} s (--timeout); "
                    "a change it was asked for may still complete", EXIT_REFUSED,
                    {"socket": socket_path, "timeout": timeout})


def _decode(resp: Response, body: bytes) -> Any:
    import json

    try:
        return json.loads(body)
    except ValueError as exc:
        raise CtlError("bad-response", f"gpud answered HTTP {resp.status} with a body that is "
                       f"not JSON: {body[:80]!r}", EXIT_REFUSED,
                       {"status": resp.status}) from exc


class Client:
    """Requests to one gpud socket. Every call opens its own connection."""

    def __init__(self, socket_path: str, timeout: float | None = None) -> None:
        self.socket_path = socket_path
        self.timeout = timeout

    def call(self, method: str, target: str, body: Doc | None = None,
             timeout: float = READ_TIMEOUT) -> Doc:
        """One request; the decoded JSON object on 2xx, else raises CtlError."""
        import json

        data = None if body is None else json.dumps(body).encode()
        wait = self.timeout if self.timeout is not None else timeout
        resp = open_request(self.socket_path, method, target, data, wait)
        try:
            raw = resp.read()
        except TimeoutError as exc:
            raise timeout_error(self.socket_path, wait) from exc
        except OSError as exc:
            raise CtlError("unreachable", f"gpud at {self.socket_path} dropped the connection: "
                           f"{exc.strerror or exc}", EXIT_UNREACHABLE,
                           {"socket": self.socket_path}) from exc
        finally:
            resp.close()
        if not 200 <= resp.status < 300:
            raise api_error(resp.status, resp.reason, raw)
        doc = _decode(resp, raw)
        if not isinstance(doc, dict):
            raise CtlError("bad-response", "gpud answered with JSON that is not an object",
                           EXIT_REFUSED, {"status": resp.status})
        return doc

    def stream(self, target: str, method: str = "GET", body: Doc | None = None) -> Iterator[Doc]:
        """An NDJSON stream: one decoded object per line, blank keepalive lines skipped.

        Returns when the daemon ends the stream; a stream gpuctl did not end itself means the
        daemon went away, which the caller reports.
        """
        import json

        wait = self.timeout if self.timeout is not None else READ_TIMEOUT
        data = None if body is None else json.dumps(body).encode()
        resp = open_request(self.socket_path, method, target, data, wait)
        try:
            if not 200 <= resp.status < 300:
                raise api_error(resp.status, resp.reason, resp.read())
            resp.settimeout(None)  # an idle stream is not a fault: events are rare
            try:
                for line in resp.lines():
                    if line.strip():
                        doc = _decode(resp, line)
                        if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
                            raise api_error(500, "", line)
                        if isinstance(doc, dict):
                            yield doc
            except OSError:
                return  # reset by a daemon that went away: the caller says so
        finally:
            resp.close()


# ---- pure formatting --------------------------------------------------------------------------


def _mib(value: Any) -> str:
    return "-" if value is None else f"{value} MiB"


def _dash(value: Any) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def local_time(ts: float, tz: datetime.tzinfo | None = None) -> str:
    """ISO 8601 with the UTC offset, in local time unless ``tz`` is given."""
    from datetime import datetime

    moment = datetime.fromtimestamp(ts, tz) if tz is not None else datetime.fromtimestamp(ts)
    return moment.astimezone(tz).isoformat(timespec="seconds")


def format_reservation(res: Doc) -> str:
    """``  fast 14336 MiB (resident, running)``, as in the seed record."""
    state = res.get("state") or "?"
    if res.get("external"):
        flags = "external"
    elif res.get("resident"):
        flags = f"resident, {state}"
    else:
        flags = state
    return f"  {res.get('serve')} {res.get('mib')} MiB ({flags})"


def format_observed(obs: Doc, reserve_mib: Any) -> list[str]:
    label = "observed (simulated)" if obs.get("simulated") else "observed"
    reserve = obs.get("reserve_mib", reserve_mib)
    pending = obs.get("pending_mib") or 0
    line = (f"  {label}: used {_mib(obs.get('used_mib'))}, "
            f"non-ledger draw {_mib(obs.get('non_ledger_draw_mib'))} (reserve {_mib(reserve)}), "
            f"physical free {_mib(obs.get('physical_free_mib'))}, ")
    if pending:
        line += f"pending {pending} MiB, "
    line += f"effective free {_mib(obs.get('effective_free_mib'))}"
    lines = [line]
    excess = obs.get("reserve_excess_mib") or 0
    if excess > 0:
        lines.append(f"  ledger free is optimistic by {excess} MiB: "
                     "non-ledger draw exceeds the reserve")
    return lines


def format_role(role: Doc) -> list[str]:
    """One role of ``GET /v1/ledger``: the seed's gpu_role line, its reservations, observation."""
    lines = [f"gpu_role '{role.get('name')}': capacity {_mib(role.get('capacity_mib'))}, "
             f"reserve {_mib(role.get('reserve_mib'))}, "
             f"committed {_mib(role.get('committed_mib'))}, free {_mib(role.get('free_mib'))}"]
    if role.get("over_committed"):
        free = role.get("free_mib")
        by = f" by {-free} MiB" if isinstance(free, int) and free < 0 else ""
        lines.append(f"  !! OVER-COMMITTED{by}: committed exceeds capacity minus reserve; "
                     "reservations are kept, release or shrink a serve")
    if role.get("missing"):
        lines.append(f"  !! device {role.get('device')} is missing")
    lines += [format_reservation(r) for r in role.get("reservations") or []]
    observed = role.get("observed")
    if observed:
        lines += format_observed(observed, role.get("reserve_mib"))
    return lines


def format_ledger(doc: Doc) -> str:
    """``GET /v1/ledger`` as the seed record writes a ledger."""
    roles = doc.get("roles") or []
    blocks = ["\n".join(format_role(r)) for r in roles]
    if not roles:
        blocks.append("no roles configured")
    text = "\n\n".join(blocks)
    shown = any((r.get("observed") or {}).get("simulated") for r in roles)
    if doc.get("simulated") and not shown:
        text += "\nobservation: SIMULATED (no real GPU behind these figures)"
    return text


def _counts(counts: Doc) -> str:
    order = [s for s in STATES if s in counts] + sorted(s for s in counts if s not in STATES)
    parts = [f"{counts[s]} {s}" for s in order if counts[s]]
    return ", ".join(parts) if parts else "none"


def _block(rows: Sequence[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows) + 2
    return "\n".join(f"{k + ':':<{width}}{v}".rstrip() for k, v in rows)


def format_status(doc: Doc, tz: datetime.tzinfo | None = None) -> str:
    """``GET /v1/status`` as a short block."""
    launching = doc.get("launching") or {}
    if launching.get("available"):
        launch = "available"
    else:
        launch = "UNAVAILABLE" + (f": {launching['reason']}" if launching.get("reason") else "")
    obs = doc.get("observation") or {}
    backend = obs.get("backend") or "none"
    if obs.get("available"):
        # Available but with a caveat (a simulation state file missing or broken: the last
        # good state is in force): said, not hidden.
        observation = backend + (f"; {obs['reason']}" if obs.get("reason") else "")
    else:
        observation = f"UNAVAILABLE ({backend})" + (f": {obs['reason']}" if obs.get("reason")
                                                    else "")
        if doc.get("admission") == "strict":
            observation += "; strict admission falls back to the ledger bound"
    if obs.get("simulated"):
        observation += " (SIMULATED: no real GPU behind these figures)"
    started = doc.get("started_at")
    when = local_time(started, tz) if isinstance(started, (int, float)) else "-"
    over = doc.get("over_committed") or []
    names = [o if isinstance(o, str) else str(o.get("role") or o.get("name")) for o in over]
    file = doc.get("config_file") or {}
    config = _dash(doc.get("config"))
    if file.get("differs"):
        config += f" (!! the file on disk is not the config in force: {file.get('reason')})"
    rows = [
        ("version", _dash(doc.get("version"))),
        ("config", config),
        ("started", when + ("" if doc.get("ready", True) else " (not ready yet)")),
        ("admission", _dash(doc.get("admission"))),
        ("launching", launch),
        ("observation", observation),
        ("serves", _counts(doc.get("serve_states") or {})),
        ("over-committed", ("!! " + ", ".join(names)) if names else "none"),
        ("summary", _dash(doc.get("summary"))),
    ]
    return _block(rows)


_SERVE_COLUMNS: tuple[tuple[str, str, bool], ...] = (
    # (header, key, right-aligned)
    ("NAME", "name", False), ("ROLE", "role", False), ("STATE", "state", False),
    ("VRAM", "vram_mib", True), ("RESERVED", "reserved_mib", True),
    ("RESIDENT", "resident", False), ("PRIO", "priority", True), ("PORT", "port", True),
    ("PID", "main_pid", True), ("CALIBRATION", "calibration", False),
)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]],
                 right: Sequence[bool]) -> str:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        padded = zip(cells, widths, right, strict=True)
        return "  ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in padded).rstrip()

    return "\n".join([line(headers)] + [line(r) for r in rows])


def format_serves(doc: Doc) -> str:
    """``GET /v1/serves``: a table, then the reason of each serve that has one."""
    serves = doc.get("serves") or []
    if not serves:
        return "no serves"
    rows = [[_dash(s.get(key)) for _, key, _ in _SERVE_COLUMNS] for s in serves]
    for row, s in zip(rows, serves, strict=True):
        if s.get("device_lost"):
            row[2] += " (DEVICE LOST)"
    text = format_table([h for h, _, _ in _SERVE_COLUMNS], rows, [r for _, _, r in _SERVE_COLUMNS])
    reasons = [f"{s.get('name')} ({s.get('state')}): {s['reason']}"
               for s in serves if s.get("reason")]
    reasons += [f"{s.get('name')}: {s['device_lost']}" for s in serves if s.get("device_lost")]
    if reasons:
        text += "\n\n" + "\n".join(reasons)
    if doc.get("simulated"):
        text += "\nobservation: SIMULATED (no real GPU behind observed figures)"
    return text


_SERVE_FIELDS: tuple[tuple[str, str], ...] = (
    ("name", "name"), ("role", "role"), ("state", "state"), ("reason", "reason"),
    ("configured", "configured"), ("external", "external"), ("vram", "vram_mib"),
    ("device lost", "device_lost"),
    ("reserved", "reserved_mib"), ("observed", "observed_mib"), ("resident", "resident"),
    ("priority", "priority"), ("port", "port"), ("unit", "unit"), ("main pid", "main_pid"),
    ("restarts", "n_restarts"), ("calibration", "calibration"), ("fingerprint", "fingerprint"),
)


def format_serve(serve: Doc) -> str:
    """``GET /v1/serves/{name}``: one ``key: value`` line per field; unknown fields at the end."""
    rows = []
    for label, key in _SERVE_FIELDS:
        value = serve.get(key)
        rows.append((label, _mib(value) if key.endswith("_mib") else _dash(value)))
    known = {key for _, key in _SERVE_FIELDS} | {"calibrated"}
    rows.append(("calibrated", _calibrated(serve.get("calibrated"))))
    rows += [(k, _dash(v)) for k, v in sorted(serve.items()) if k not in known and k != "simulated"]
    text = _block(rows)
    if serve.get("simulated"):
        text += "\nobservation: SIMULATED (no real GPU behind observed figures)"
    return text


def _calibrated(brief: Any) -> str:
    """The current calibration in one line, vLLM's own account beside the measured figures."""
    if not isinstance(brief, dict):
        return "-"
    line = (f"steady {_mib(brief.get('steady_mib'))}, peak {_mib(brief.get('peak_mib'))}, "
            f"recommended reservation {_mib(brief.get('recommended_mib'))}")
    vllm = brief.get("vllm")
    if isinstance(vllm, dict) and vllm.get("weights_mib") is not None:
        line += (f"; vLLM: weights {_mib(vllm.get('weights_mib'))}, KV cache "
                 f"{_mib(vllm.get('kv_cache_mib'))}, CUDA graphs {_mib(vllm.get('cudagraph_mib'))}, "
                 f"context {_mib(vllm.get('context_mib'))}")
        if vllm.get("recommended_kv_cache_mib") is not None:
            line += f", recommends kv_cache_mib = {vllm['recommended_kv_cache_mib']}"
    return line


def format_admit(doc: Doc) -> str:
    """``admitted fast: 14336 MiB on dark-fast (was 18432); dark-fast free 1887 MiB``."""
    role = doc.get("role")
    was = doc.get("replaced_mib")
    figures = doc.get("figures") or {}
    line = (f"admitted {doc.get('serve')}: {doc.get('mib')} MiB on {role}"
            + (f" (was {was})" if was else "")
            + f"; {role} free {_mib(figures.get('free_mib'))}")
    if doc.get("note"):
        line += f"\nnote: {doc['note']}"
    return line


def format_release(doc: Doc, stopped: bool = False) -> str:
    """``released ocr: 5120 MiB on dark-fast; dark-fast free 7007 MiB``."""
    role = doc.get("role")
    figures = doc.get("figures") or {}
    verb = "stopped and released" if stopped else "released"
    return (f"{verb} {doc.get('serve')}: {_mib(doc.get('released_mib'))} on {role}; "
            f"{role} free {_mib(figures.get('free_mib'))}")


def format_lifecycle(serve: Doc) -> str:
    """The Serve that start, stop and restart answer with, in one line."""
    facts = []
    if serve.get("reserved_mib") is not None:
        facts.append(f"reserved {serve['reserved_mib']} MiB")
    for label, key in (("port", "port"), ("pid", "main_pid"), ("unit", "unit")):
        if serve.get(key) is not None:
            facts.append(f"{label} {serve[key]}")
    line = (f"{serve.get('name')}: {serve.get('state')} on {_dash(serve.get('role'))}"
            + (f" ({', '.join(facts)})" if facts else ""))
    if serve.get("reason"):
        line += f"\nreason: {serve['reason']}"
    return line


def format_reload(doc: Doc) -> str:
    return "reloaded" + (f": {doc['summary']}" if doc.get("summary") else "")


def format_event(ev: Doc, tz: datetime.tzinfo | None = None) -> str:
    """One event: local ISO time, kind, serve, role, MiB, message."""
    ts = ev.get("ts")
    when = local_time(ts, tz) if isinstance(ts, (int, float)) else "-"
    mib = _mib(ev.get("mib"))
    message = " ".join(str(ev.get("message") or "").split())
    return (f"{when} {_dash(ev.get('kind')):<16} {_dash(ev.get('serve')):<12} "
            f"{_dash(ev.get('role')):<12} {mib:>10}  {message}").rstrip()


def format_events(doc: Doc, tz: datetime.tzinfo | None = None) -> str:
    return "\n".join(format_event(ev, tz) for ev in doc.get("events") or [])


def format_error(err: CtlError) -> str:
    """``gpuctl: <message>``, and for a denial the figures from its details."""
    lines = [f"gpuctl: {err.message}"]
    d = err.details
    if err.code == "denied" and "need_mib" in d:
        bound = f" ({d['bound']} bound on {d.get('role')})" if d.get("bound") else ""
        lines.append(f"gpuctl: need {_mib(d.get('need_mib'))}, free {_mib(d.get('free_mib'))}, "
                     f"shortfall {_mib(d.get('shortfall_mib'))}{bound}")
    problems = d.get("problems")
    if isinstance(problems, list) and len(problems) > 1:
        lines += [f"gpuctl:   {p}" for p in problems]
    if err.code == "forbidden":
        lines.append("gpuctl: changes need root or the admin group named by daemon.admin_group")
    return "\n".join(lines)


def dump_json(doc: Any, compact: bool = False) -> str:
    import json

    if compact:
        return json.dumps(doc, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return json.dumps(doc, sort_keys=True, ensure_ascii=False, indent=2)


# ---- argument values --------------------------------------------------------------------------


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_since(text: str, now: float) -> float:
    """``--since``: ISO 8601 (naive is local time), epoch seconds, or an age like 10m, 2h, 1h30m.

    Returns epoch seconds; raises CtlError (exit 2) for anything else.
    """
    import re

    value = text.strip()
    if re.fullmatch(r"(?:\d+(?:\.\d+)?[smhdw])+", value):
        age = sum(float(n) * _UNITS[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([smhdw])", value))
        return now - age
    if re.fullmatch(r"\d+(?:\.\d+)?", value):
        return float(value)
    from datetime import datetime

    try:
        return datetime.fromisoformat(value).timestamp()
    except (ValueError, OverflowError, OSError):
        raise usage_error(
            f"--since {text!r}: use ISO 8601 (2026-07-13T03:00), epoch seconds (1783911600) "
            "or an age (90s, 10m, 2h, 3d, 1h30m)", since=text) from None


def parse_mib(text: str) -> int:
    """A reservation size: a positive integer number of MiB (the daemon is the authority)."""
    value = text.strip()
    if not (value.isascii() and value.isdigit()) or int(value) <= 0:
        raise usage_error(f"MIB must be a positive integer number of MiB, got {text!r}",
                          mib=text)
    return int(value)


def serve_path(name: str, action: str = "") -> str:
    if not name:
        raise usage_error("the serve name must not be empty")
    return f"/v1/serves/{quote_segment(name)}" + (f"/{action}" if action else "")


def _epoch_text(ts: float) -> str:
    return f"{ts:.3f}".rstrip("0").rstrip(".")


# ---- commands ---------------------------------------------------------------------------------


class Ctl:
    """What a command runs with: the client, the output mode and the streams."""

    def __init__(self, client: Client, as_json: bool, out: TextIO, err: TextIO) -> None:
        self.client = client
        self.as_json = as_json
        self.out = out
        self.err = err
        # follow and watch print one compact JSON document per line (NDJSON), errors included
        self.ndjson = False

    def emit(self, doc: Doc, human: Callable[[Doc], str]) -> None:
        text = dump_json(doc) if self.as_json else human(doc)
        if text:
            print(text, file=self.out, flush=True)


class Command:
    """One subcommand: its help texts, how it reads its arguments and what it does."""

    def __init__(self, name: str, summary: str, description: str, examples: str,
                 configure: Callable[[argparse.ArgumentParser], None],
                 run: Callable[[Ctl, argparse.Namespace], int]) -> None:
        self.name = name
        self.summary = summary
        self.description = description
        self.examples = examples
        self.configure = configure
        self.run = run


def _no_args(p: argparse.ArgumentParser) -> None:
    pass


def _name_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", metavar="NAME", help="the serve, as named in serves.toml")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        import argparse

        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) <= 0:
        import argparse

        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def run_status(ctl: Ctl, args: argparse.Namespace) -> int:
    ctl.emit(ctl.client.call("GET", "/v1/status"), format_status)
    return EXIT_OK


def configure_ledger(p: argparse.ArgumentParser) -> None:
    p.add_argument("--watch", action="store_true",
                   help="redraw the ledger every --interval seconds until Ctrl-C (exit 0); "
                        "exit 3 when gpud goes away. When output is not a terminal, print only "
                        "when the ledger changed (with --json: one compact JSON line each)")
    p.add_argument("--interval", type=_positive_float, default=2.0, metavar="S",
                   help="seconds between reads with --watch (default: 2)")


def run_ledger(ctl: Ctl, args: argparse.Namespace) -> int:
    if args.watch:
        return watch_ledger(ctl, args.interval)
    ctl.emit(ctl.client.call("GET", "/v1/ledger"), format_ledger)
    return EXIT_OK


def watch_ledger(ctl: Ctl, interval: float) -> int:
    import time

    tty = ctl.out.isatty()
    ctl.ndjson = True
    last = None
    try:
        while True:
            doc = ctl.client.call("GET", "/v1/ledger")
            text = dump_json(doc, compact=True) if ctl.as_json else format_ledger(doc)
            if tty:
                stamp = local_time(time.time())
                ctl.out.write(f"\x1b[H\x1b[2J{stamp}  gpuctl ledger --watch "
                              f"(every {interval:g} s, Ctrl-C to stop)\n\n{text}\n")
                ctl.out.flush()
            elif text != last:
                if not ctl.as_json and last is not None:
                    print(f"\n-- {local_time(time.time())}", file=ctl.out)
                print(text, file=ctl.out, flush=True)
            last = text
            time.sleep(interval)
    except KeyboardInterrupt:
        return EXIT_OK


def configure_serves(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", metavar="NAME", nargs="?",
                   help="show this serve alone, one field per line")
    p.add_argument("--names", action="store_true",
                   help="print only the serve names, one per line (for scripts and completion)")


def run_serves(ctl: Ctl, args: argparse.Namespace) -> int:
    if args.name is not None:
        ctl.emit(ctl.client.call("GET", serve_path(args.name)), format_serve)
        return EXIT_OK
    doc = ctl.client.call("GET", "/v1/serves")
    if args.names and not ctl.as_json:
        ctl.emit(doc, lambda d: "\n".join(str(s.get("name")) for s in d.get("serves") or []))
    else:
        ctl.emit(doc, format_serves)
    return EXIT_OK


def configure_admit(p: argparse.ArgumentParser) -> None:
    _name_arg(p)
    p.add_argument("mib", metavar="MIB",
                   help="the reservation in MiB, a positive integer; replaces the serve's own "
                        "reservation, it is not added to it")
    p.add_argument("--role", metavar="ROLE",
                   help="the role to reserve on: required for a serve serves.toml does not "
                        "declare (an external reservation), must match the configured role "
                        "otherwise")


def run_admit(ctl: Ctl, args: argparse.Namespace) -> int:
    mib = parse_mib(args.mib)
    path = serve_path(args.name, "admit")
    body: Doc = {"mib": mib}
    if args.role is not None:
        body["role"] = args.role
    ctl.emit(ctl.client.call("POST", path, body, MUTATION_TIMEOUT), format_admit)
    return EXIT_OK


def configure_release(p: argparse.ArgumentParser) -> None:
    _name_arg(p)
    p.add_argument("--stop", action="store_true",
                   help="stop the serve's unit first; without it, releasing a serve whose unit "
                        "is live is refused (exit 1), since its memory is still held")


def run_release(ctl: Ctl, args: argparse.Namespace) -> int:
    doc = ctl.client.call("POST", serve_path(args.name, "release"), {"stop": bool(args.stop)},
                          LIFECYCLE_TIMEOUT if args.stop else MUTATION_TIMEOUT)
    ctl.emit(doc, lambda d: format_release(d, stopped=bool(args.stop)))
    return EXIT_OK


def configure_start(p: argparse.ArgumentParser) -> None:
    _name_arg(p)
    p.add_argument("--no-wait", action="store_true",
                   help="return once launched instead of waiting until the serve's health "
                        "endpoint answers 200 (or it fails)")


SETTLED = ("running", "failed", "denied", "declared")


def _lifecycle(action: str) -> Callable[[Ctl, argparse.Namespace], int]:
    def run(ctl: Ctl, args: argparse.Namespace) -> int:
        import time

        doc = ctl.client.call("POST", serve_path(args.name, action), {}, LIFECYCLE_TIMEOUT)
        if action != "stop" and not getattr(args, "no_wait", True):
            deadline = time.monotonic() + (ctl.client.timeout or LIFECYCLE_TIMEOUT)
            while doc.get("state") not in SETTLED and time.monotonic() < deadline:
                time.sleep(0.25)
                doc = ctl.client.call("GET", serve_path(args.name))
        ctl.emit(doc, format_lifecycle)
        return EXIT_REFUSED if action != "stop" and doc.get("state") == "failed" else EXIT_OK

    return run


def configure_events(p: argparse.ArgumentParser) -> None:
    p.add_argument("--serve", action="append", metavar="S",
                   help="only events of this serve (may be repeated)")
    p.add_argument("--role", action="append", metavar="R",
                   help="only events on this role (may be repeated)")
    p.add_argument("--kind", action="extend", nargs="+", metavar="K",
                   help="only events of these kinds (repeat, list, or comma-separate): "
                        + ", ".join(EVENT_KINDS))
    p.add_argument("--since", metavar="T",
                   help="only events at or after T: ISO 8601 (2026-07-13T03:00, local time "
                        "unless an offset is given), epoch seconds, or an age such as 90s, 10m, "
                        "2h, 3d or 1h30m")
    p.add_argument("--limit", type=_positive_int, metavar="N",
                   help="at most the N newest matching events (daemon default 100, max 10000)")
    p.add_argument("-f", "--follow", action="store_true",
                   help="after the matching events, print each new one as it happens, until "
                        "Ctrl-C (exit 0); exit 3 when gpud goes away. With --json: one compact "
                        "JSON object per line (NDJSON)")


def events_query(args: argparse.Namespace, now: float) -> list[tuple[str, str]]:
    params: list[tuple[str, str]] = []
    params += [("serve", s) for s in args.serve or []]
    params += [("role", r) for r in args.role or []]
    for group in args.kind or []:
        params += [("kind", k) for k in group.split(",") if k]
    if args.since is not None:
        params.append(("since", _epoch_text(parse_since(args.since, now))))
    if args.limit is not None:
        params.append(("limit", str(args.limit)))
    return params


def run_events(ctl: Ctl, args: argparse.Namespace) -> int:
    import time

    params = events_query(args, time.time())
    if args.follow:
        return follow_events(ctl, params)
    target = "/v1/events" + ("?" + query_string(params) if params else "")
    ctl.emit(ctl.client.call("GET", target), format_events)
    return EXIT_OK


def follow_events(ctl: Ctl, params: list[tuple[str, str]]) -> int:
    target = "/v1/events?" + query_string([*params, ("follow", "1")])
    ctl.ndjson = True
    try:
        for ev in ctl.client.stream(target):
            text = dump_json(ev, compact=True) if ctl.as_json else format_event(ev)
            print(text, file=ctl.out, flush=True)
    except KeyboardInterrupt:
        return EXIT_OK
    raise CtlError("unreachable", f"gpud at {ctl.client.socket_path} ended the event stream "
                   "(stopped or restarting?)", EXIT_UNREACHABLE,
                   {"socket": ctl.client.socket_path})


def run_reload(ctl: Ctl, args: argparse.Namespace) -> int:
    ctl.emit(ctl.client.call("POST", "/v1/reload", {}, MUTATION_TIMEOUT), format_reload)
    return EXIT_OK


def configure_config_file(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="NEW.toml", help="the serves.toml to plan or apply")


def _config_body(path: str) -> Doc:
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read(2 * 1024 * 1024)
    except OSError as exc:
        raise usage_error(f"cannot read {path}: {exc.strerror or exc}", file=path) from exc
    except UnicodeDecodeError as exc:
        raise usage_error(f"{path} is not UTF-8 text", file=path) from exc
    return {"config": text, "source": os.path.abspath(path)}


def _arrow(before: Any, after: Any) -> str:
    b = "-" if before is None else str(before)
    a = "-" if after is None else str(after)
    return b if b == a else f"{b} -> {a}"


def format_plan(doc: Doc) -> str:
    lines = [f"plan: {doc.get('source')} against the running config"]
    for role in doc.get("roles", []):
        before, after = role.get("before") or {}, role.get("after") or {}
        lines.append(f"role '{role.get('name')}':")
        for key in ("capacity_mib", "reserve_mib", "committed_mib", "free_mib"):
            label = key.replace("_mib", "")
            lines.append(f"  {label:<10} {_arrow(before.get(key), after.get(key))} MiB")
    rows = [("SERVE", "ROLE", "MIB", "UTIL", "STATE", "CHANGE", "RESTART")]
    for s in doc.get("serves", []):
        rows.append((str(s.get("name")), _arrow(s.get("role_before"), s.get("role_after")),
                     _arrow(s.get("mib_before"), s.get("mib_after")),
                     _arrow(s.get("util_before"), s.get("util_after")),
                     _arrow(s.get("state_before"), s.get("state_after")),
                     str(s.get("change")), "yes" if s.get("restart") else "no"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    restart = doc.get("restart") or []
    lines.append(f"must restart: {', '.join(restart) if restart else 'none'}")
    if doc.get("resident_fits"):
        lines.append("resident set: fits, every resident serve is admitted")
    else:
        for d in doc.get("denied", []):
            lines.append(f"resident set: DOES NOT FIT: {d.get('serve')} on {d.get('role')}: "
                         f"need {d.get('need_mib')} MiB, free {d.get('free_mib')} MiB, "
                         f"short {d.get('shortfall_mib')} MiB")
    stop_first = doc.get("stop_first") or []
    if stop_first:
        lines.append(f"stop first (leave the config or their role): {', '.join(stop_first)}")
    for b in doc.get("blocked") or []:
        lines.append(f"BLOCKED: {b.get('message')}")
    return "\n".join(lines)


def run_plan(ctl: Ctl, args: argparse.Namespace) -> int:
    doc = ctl.client.call("POST", "/v1/plan", _config_body(args.file), MUTATION_TIMEOUT)
    ctl.emit(doc, format_plan)
    return EXIT_OK if doc.get("resident_fits") and not doc.get("blocked") else EXIT_REFUSED


def run_apply(ctl: Ctl, args: argparse.Namespace) -> int:
    final: Doc = {}
    for line in ctl.client.stream("/v1/apply", "POST", _config_body(args.file)):
        if "result" in line:
            final = line
            break
        if ctl.as_json:
            print(dump_json(line, compact=True), file=ctl.out, flush=True)
        else:
            mark = "ok  " if line.get("ok") else "FAIL"
            print(f"[{mark}] {line.get('step')}: {line.get('message')}", file=ctl.out, flush=True)
    if not final:
        raise CtlError("unreachable", "gpud ended the apply stream without a result: check "
                       "`gpuctl events --kind apply`", EXIT_UNREACHABLE)
    if ctl.as_json:
        print(dump_json(final, compact=True), file=ctl.out, flush=True)
    elif final.get("result") == "applied":
        print(f"applied: {final.get('summary')}", file=ctl.out)
    elif final.get("result") == "rolled-back":
        print(f"rolled back: {final.get('error')}; {final.get('summary')}", file=ctl.err)
    else:
        err = final.get("error") or {}
        print(f"gpuctl: {err.get('message', final)}", file=ctl.err)
    return EXIT_OK if final.get("result") == "applied" else EXIT_REFUSED


def configure_calibrate(p: argparse.ArgumentParser) -> None:
    _name_arg(p)
    p.add_argument("--window", default="10m", metavar="T",
                   help="how long to sample the serve's draw: 90s, 10m, 1h (default 10m)")
    p.add_argument("--no-wait", action="store_true",
                   help="start the calibration and return; see `gpuctl calibrate NAME --status`")
    p.add_argument("--status", action="store_true", help="show the serve's calibration only")


def _duration(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    try:
        seconds = (float(text[:-1]) * units[text[-1]] if text and text[-1] in units
                   else float(text))
    except ValueError:
        raise usage_error(f"--window: not a duration: {text!r} (say 90s, 10m or 1h)") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise usage_error(f"--window: must be a positive, finite duration: {text!r}")
    return seconds


def format_calibration(doc: Doc) -> str:
    rec = doc.get("record")
    lines = [f"{doc.get('serve')}: {doc.get('status')} (fingerprint {doc.get('fingerprint')})"]
    run = doc.get("running")
    if run:
        lines.append(f"  measuring: {run.get('elapsed_s')} of {run.get('window_s')} s, "
                     f"{run.get('samples')} samples, peak {run.get('peak_mib')} MiB")
    if rec:
        current = "" if rec.get("current") else " (for an older fingerprint: stale)"
        lines.append(f"  steady {rec.get('steady_mib')} MiB, peak {rec.get('peak_mib')} MiB over "
                     f"{rec.get('window_s')} s ({rec.get('samples')} samples): recommended "
                     f"vram_mib = {rec.get('recommended_mib')}{current}")
    vllm = doc.get("vllm")
    if vllm:
        # vLLM's own start-up account, from the serve's journal (gpud.vllm_log)
        lines.append(f"  vLLM says: weights {vllm.get('weights_mib')} MiB, KV cache "
                     f"{vllm.get('kv_cache_mib')} MiB, CUDA graphs {vllm.get('cudagraph_mib')} MiB; "
                     f"context beyond its budget {vllm.get('context_mib')} MiB")
        if vllm.get("recommended_kv_cache_mib"):
            lines.append(f"  vLLM recommends --kv-cache-memory={vllm.get('recommended_kv_cache_bytes')}: "
                         f"kv_cache_mib = {vllm.get('recommended_kv_cache_mib')}")
    return "\n".join(lines)


def run_calibrate(ctl: Ctl, args: argparse.Namespace) -> int:
    import time

    path = serve_path(args.name, "calibration")
    if not args.status:
        ctl.client.call("POST", serve_path(args.name, "calibrate"),
                        {"window_s": _duration(args.window)}, MUTATION_TIMEOUT)
        if not args.no_wait:
            while (doc := ctl.client.call("GET", path)).get("running"):
                if not ctl.as_json:
                    print(format_calibration(doc).splitlines()[-1], file=ctl.err, flush=True)
                time.sleep(min(5.0, max(0.5, _duration(args.window) / 10)))
    ctl.emit(ctl.client.call("GET", path), format_calibration)
    return EXIT_OK


COMMANDS: tuple[Command, ...] = (
    Command(
        "status", "the daemon in a few lines",
        "Show gpud's version, config file, admission mode, whether launching (the system bus) "
        "and observation (NVML, or the simulated backend) are available and why not, how many "
        "serves are in each state, which roles are over-committed, and the ledger summary.\n\n"
        "Readable by anyone who can open the socket (group gpud).",
        "  gpuctl status\n  gpuctl status --json | jq .observation",
        _no_args, run_status),
    Command(
        "ledger", "the GPU-memory ledger of every role",
        "Show each role as the operator's record writes it: capacity, reserve, committed and "
        "free MiB (free = capacity - reserve - committed), then one line per reservation, then, "
        "when observation is available, what the device really draws: used, the draw the ledger "
        "does not manage (display, sidecars) against the reserve, physical free and the "
        "effective free that strict admission uses. A role whose non-ledger draw exceeds its "
        "reserve is flagged (its ledger free figure is optimistic); an over-committed role "
        "(free below zero after a config change) is flagged loudly. Figures from the simulated "
        "backend are marked (simulated).",
        "  gpuctl ledger\n"
        "      gpu_role 'dark-fast': capacity 32607 MiB, reserve 4608 MiB, committed 26112 MiB,"
        " free 1887 MiB\n"
        "        fast 14336 MiB (resident, running)\n"
        "        ...\n"
        "  gpuctl ledger --watch --interval 5",
        configure_ledger, run_ledger),
    Command(
        "serves", "the serves and their states",
        "Without NAME, a table of every serve gpud knows (configured or holding an external "
        "reservation), sorted by role, priority and name: state, configured vram_mib, "
        "reserved MiB, resident, priority, port, main PID and calibration; then the reason of "
        "each denied or failed serve. With NAME, every field of that serve.\n\n"
        "States: declared, admitted, starting, running, stopping, denied, failed, external, "
        "orphan.",
        "  gpuctl serves\n  gpuctl serves ocr\n  gpuctl serves --names",
        configure_serves, run_serves),
    Command(
        "admit", "reserve MiB for a serve on its role",
        "Ask the ledger for MIB MiB for serve NAME. The serve's own current reservation is "
        "replaced, not added to. It is admitted iff MIB fits the role's free figure (ledger "
        "mode) or the smaller of that and the observed free memory (strict mode, the default); "
        "a denial says which bound failed, the need, the free figure and the shortfall, and "
        "exits 1. Admitting does not start the serve (see start).\n\n"
        "Needs root or the admin group.",
        "  gpuctl admit ocr 5120\n"
        "  gpuctl admit fast 14336\n"
        "      admitted fast: 14336 MiB on dark-fast (was 18432); dark-fast free 1887 MiB\n"
        "  gpuctl admit sidecar 2048 --role dark-fast      # a process gpud does not launch",
        configure_admit, run_admit),
    Command(
        "release", "give a serve's reservation back",
        "Drop serve NAME's reservation. gpud never releases memory a live process still "
        "holds: releasing a serve whose unit is live is refused (exit 1) unless --stop stops "
        "it in the same request.\n\nNeeds root or the admin group.",
        "  gpuctl release ocr\n  gpuctl release ocr --stop",
        configure_release, run_release),
    Command(
        "start", "admit (if needed) and launch a serve",
        "Admit serve NAME at its configured vram_mib if it holds no reservation (a denial exits "
        "1 with the reason), then launch its transient unit gpud-serve-NAME.service and wait "
        "until its health endpoint answers 200 (--no-wait: return once launched). Exits 1 when "
        "the serve fails to become healthy, or when launching is unavailable (no system bus)."
        "\n\nNeeds root or the admin group.",
        "  gpuctl start ocr\n  gpuctl start ocr --no-wait",
        configure_start, _lifecycle("start")),
    Command(
        "stop", "stop a serve's unit and release its reservation",
        "Stop serve NAME's unit (SIGTERM to its main process, SIGKILL to what is left after its "
        "stop timeout) and release its reservation. The next start on that device waits until "
        "the device shows the memory back.\n\nNeeds root or the admin group.",
        "  gpuctl stop ocr",
        _name_arg, _lifecycle("stop")),
    Command(
        "restart", "restart a serve's unit",
        "Restart serve NAME's unit under its current reservation and wait until it is healthy "
        "again (--no-wait: return once launched).\n\nNeeds root or the admin group.",
        "  gpuctl restart fast",
        configure_start, _lifecycle("restart")),
    Command(
        "events", "what happened: admissions, denials, starts, exits, overdraws",
        "Show stored events, oldest first: the newest --limit that match. Each line: local "
        "time (ISO 8601), kind, serve, role, MiB, message. --json gives each event's details "
        "too.\n\nKinds: " + ", ".join(EVENT_KINDS) + ".",
        "  gpuctl events --serve ocr --kind deny --since 2h\n"
        "  gpuctl events --since 2026-07-13T03:00 --limit 20\n"
        "  gpuctl events --follow --kind overdraw,reserve-exceeded",
        configure_events, run_events),
    Command(
        "plan", "what a new serves.toml would do to the ledger",
        "Ask gpud to compute the ledger NEW.toml would give, without changing anything: per "
        "role capacity, reserve, committed and free before -> after; per serve its reservation, "
        "--gpu-memory-utilization and state before -> after, what changed and whether it must "
        "restart; and whether the full resident set is admitted. Exits 1 when it does not fit, "
        "naming the shortfall.\n\nReadable by anyone who can open the socket.",
        "  gpuctl plan /etc/gpud/serves.new.toml",
        configure_config_file, run_plan),
    Command(
        "apply", "rebalance to a new serves.toml, rolling back on failure",
        "Validate NEW.toml (refused, nothing changed, when the resident set does not fit), back "
        "up the current config (timestamped, the last daemon.config_backups kept, under "
        "backups/ beside it), write NEW.toml over it atomically, reload, then per device stop "
        "serves that left, restart changed serves shrinking ones before growing ones, start "
        "resident serves that now fit, and wait for their health. If a step fails the old "
        "config is written back and the touched serves are restored. Each step is printed as "
        "it happens and logged as an `apply` event. Exit 1 when refused or rolled back.\n\n"
        "Needs root or the admin group.",
        "  gpuctl plan new.toml && gpuctl apply new.toml",
        configure_config_file, run_apply),
    Command(
        "calibrate", "measure a serve's real draw and recommend a reservation",
        "Sample the draw of running serve NAME over --window (default 10m) and store its steady "
        "(median) and peak MiB and a recommended vram_mib (peak plus max(256 MiB, 5%), rounded "
        "up to 256 MiB), bound to the serve's fingerprint (model, revision, quantization, "
        "max_model_len, command): when any of those change the calibration shows as stale.\n\n"
        "Starting one needs root or the admin group; --status is readable by anyone.",
        "  gpuctl calibrate fast --window 10m\n  gpuctl calibrate fast --status",
        configure_calibrate, run_calibrate),
    Command(
        "reload", "re-read serves.toml",
        "Make gpud re-read its config file. Reservations are never dropped silently: a role the "
        "new config leaves over-committed is reported as such.\n\nNeeds root or the admin group.",
        "  gpuctl reload",
        _no_args, run_reload),
)


DESCRIPTION = """\
gpuctl talks to gpud, the daemon that owns the GPU-memory ledger of this host: which model serve
holds how many MiB on which GPU role, what is free, and what the devices really draw.

Answers are printed for people by default; --json prints the daemon's JSON answer instead (on
failure, its error object), for scripts. The exit code says how it went either way."""

EPILOG = """\
socket:
  --socket PATH, else $GPUD_SOCKET, else /run/gpud/gpud.sock. Reading needs access to the
  socket (group gpud); changing the ledger needs root or the admin group.

exit status:
  0  ok
  1  denied, refused, forbidden, conflict, unavailable, or a daemon fault
  2  usage or bad input (also an unknown serve or role)
  3  gpud cannot be reached (not running, or no permission on its socket)

examples:
  gpuctl ledger
  gpuctl admit ocr 5120
  gpuctl serves ocr
  gpuctl events --serve ocr --kind deny --since 1d

Run `gpuctl COMMAND --help` for each command."""

SUB_EPILOG = """\
options --socket, --json and --timeout may also be given before COMMAND.
exit status: 0 ok, 1 refused, 2 usage or bad input, 3 gpud unreachable."""


class UsageError(Exception):
    def __init__(self, usage: str, prog: str, message: str) -> None:
        super().__init__(message)
        self.usage = usage
        self.prog = prog
        self.message = message


def _add_common(p: argparse.ArgumentParser, suppress: bool) -> None:
    import argparse

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    p.add_argument("--socket", metavar="PATH", default=default(None),
                   help=f"gpud's socket (default: ${SOCKET_ENV}, else {DEFAULT_SOCKET})")
    p.add_argument("--json", action="store_true", default=default(False),
                   help="print the daemon's JSON answer (or error) instead of text")
    p.add_argument("--timeout", type=_positive_float, metavar="S", default=default(None),
                   help="seconds to wait for an answer (default: 30 for reads, 120 for "
                        "changes, 600 for start, stop and restart)")


def command_named(argv: Sequence[str]) -> str | None:
    """The command ``argv`` runs when only global options precede it, else None.

    Building the parsers of all commands costs more than the rest of a ``gpuctl status`` run
    (argparse looks up translations and the terminal size for every option), so ``main`` builds
    only the one it needs. Anything unusual before the command (--help, an abbreviated option)
    answers None, and the whole tree is built.
    """
    names = {cmd.name for cmd in COMMANDS}
    i = 0
    while i < len(argv):
        token = argv[i]
        if token in ("--socket", "--timeout"):
            i += 2
        elif token == "--json" or token.startswith(("--socket=", "--timeout=")):
            i += 1
        elif token == "--":
            return argv[i + 1] if i + 1 < len(argv) and argv[i + 1] in names else None
        else:
            return token if token in names else None
    return None


def terminal_width() -> int:
    """$COLUMNS, else the width of the terminal on stdout, else 80 (as shutil decides)."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    stream = sys.__stdout__
    try:
        return (os.get_terminal_size(stream.fileno()).columns or 80) if stream else 80
    except (AttributeError, ValueError, OSError):
        return 80


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """gpuctl's parser; with ``only``, that command's alone (the rest are left out)."""
    import argparse

    from gpud import __version__

    class Parser(argparse.ArgumentParser):
        def error(self, message: str) -> Any:
            raise UsageError(self.format_usage(), self.prog, message)

    class Formatter(argparse.RawDescriptionHelpFormatter):
        # argparse asks shutil for the terminal width, and importing shutil costs a tenth of
        # gpuctl's start: ask os, which shutil asks too.
        def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                     width: int | None = None) -> None:
            super().__init__(prog, indent_increment, max_help_position,
                             width if width is not None else terminal_width() - 2)

        # Fill plain paragraphs to the terminal; keep paragraphs with line breaks (examples,
        # tables) as written.
        def _fill_text(self, text: str, width: int, indent: str) -> str:
            import textwrap

            return "\n\n".join(
                para if "\n" in para or para.startswith(" ")
                else textwrap.fill(para, width, initial_indent=indent, subsequent_indent=indent)
                for para in text.split("\n\n"))

    fmt = Formatter
    parser = Parser(prog="gpuctl", description=DESCRIPTION, epilog=EPILOG, formatter_class=fmt)
    _add_common(parser, suppress=False)
    parser.add_argument("--version", action="version", version=f"gpuctl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                title="commands")
    for cmd in COMMANDS:
        if only is not None and cmd.name != only:
            continue
        p = sub.add_parser(cmd.name, help=cmd.summary, description=cmd.description,
                           epilog=f"examples:\n{cmd.examples}\n\n{SUB_EPILOG}",
                           formatter_class=fmt)
        cmd.configure(p)
        _add_common(p, suppress=True)  # per-command position; the global one stays otherwise
        p.set_defaults(run=cmd.run)
    return parser


def resolve_socket(option: str | None, environ: Mapping[str, str]) -> str:
    return option or environ.get(SOCKET_ENV) or DEFAULT_SOCKET


def main(argv: list[str] | None = None) -> int:
    """Run gpuctl with ``argv`` (default: the process's arguments); return the exit code."""
    args_in = sys.argv[1:] if argv is None else list(argv)
    out, err = sys.stdout, sys.stderr
    wants_json = "--json" in args_in
    try:
        try:
            args = build_parser(command_named(args_in)).parse_args(args_in)
        except UsageError as exc:
            err.write(f"{exc.usage}{exc.prog}: error: {exc.message}\n")
            if wants_json:
                print(dump_json(usage_error(exc.message).to_json()), file=out)
            return EXIT_USAGE
        except SystemExit as exc:  # --help, --version
            return exc.code if isinstance(exc.code, int) else EXIT_OK
        client = Client(resolve_socket(args.socket, os.environ), args.timeout)
        ctl = Ctl(client, bool(args.json), out, err)
        try:
            code: int = args.run(ctl, args)
            return code
        except CtlError as exc:
            if ctl.as_json:
                print(dump_json(exc.to_json(), compact=ctl.ndjson), file=out, flush=True)
            else:
                print(format_error(exc), file=err, flush=True)
            return exc.exit_code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (gpuctl events | head). Point stdout at /dev/null so that the
        # interpreter's final flush does not complain a second time.
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass  # stdout without a file descriptor: nothing will flush into the pipe
        finally:
            os.close(devnull)
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
