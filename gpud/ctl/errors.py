"""What gpuctl reports and exits with: the exit codes and ``CtlError``.

    0  ok
    1  denied, refused, forbidden, conflict, unavailable, or a daemon fault
    2  usage or bad input (argument errors; HTTP 400, 404, 413)
    3  the daemon cannot be reached

When the daemon answered, its ``error.code`` decides the exit code, from the table gpud's error
tree is built on (``gpud.core.vocab.EXIT_CODES``); the HTTP status only for a code this gpuctl
does not know.
"""

from __future__ import annotations

# Not ``typing.TYPE_CHECKING``: importing typing costs startup time. mypy treats any name
# TYPE_CHECKING as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    Doc = dict[str, Any]

from gpud.core.vocab import EXIT_CODES  # noqa: E402 - defined once

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what the shell reports for a writer whose reader left

START_HINT = "start it with `systemctl start gpud` or `gpud --config /etc/gpud/serves.toml`"


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


def timeout_error(socket_path: str, timeout: float | None) -> CtlError:
    return CtlError("timeout",
                    f"gpud at {socket_path} did not answer within {timeout:g} s (--timeout); "
                    "a change it was asked for may still complete", EXIT_REFUSED,
                    {"socket": socket_path, "timeout": timeout})

