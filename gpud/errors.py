"""The one error tree of gpud.

Every error a client can see is a ``GpudError``: it carries a stable ``code`` (the JSON
``error.code``), the HTTP status the API answers with and the exit code gpuctl uses. Foreign
exceptions (sqlite3, D-Bus, NVML, pydantic, OS errors) are mapped at the edge that meets them
with ``raise ... from exc``; nothing above the adapters catches a foreign exception.

    GpudError                    500  exit 1
    +-- BadRequest               400  exit 2   malformed or invalid input
    |   +-- ConfigError          400  exit 2   a config file that cannot be used
    +-- Forbidden                403  exit 1   the peer may not change the ledger
    +-- NotFound                 404  exit 2   unknown serve or role
    +-- PayloadTooLarge          413  exit 2   request body over the limit
    +-- RequestTimeout           408  exit 1   the request's body did not arrive by its deadline
    +-- TooManyRequests          429  exit 1   the peer has as many expensive requests under way
                                               as it may (plan, apply, reload): retry later
    +-- Refused                  409  exit 1   an expected refusal: the answer, not a fault
    |   +-- Denied               409  exit 1   admission denied (bound, need, free, shortfall)
    |   +-- Conflict             409  exit 1   the request contradicts the current state
    +-- Unavailable              503  exit 1   a backend (system bus, observation, store) is down
    +-- JobFailed                500  exit 1   a systemd job for a serve's unit did not finish "done"
    +-- StoreError               500  exit 1   the durable store failed; nothing was changed
"""

from __future__ import annotations

from typing import Any, ClassVar

from typing_extensions import TypedDict

# The bottom floor: standard library and typing_extensions only, no other module of gpud (the
# pure core raises from here, so an import of the core here would be an arrow pointing up).


class ErrorBody(TypedDict):
    code: str
    message: str
    details: dict[str, Any]


class Error(TypedDict):
    """Every error: one shape (gpud.core.answers names it among the API's answers)."""

    error: ErrorBody


class GpudError(Exception):
    code: ClassVar[str] = "internal"
    http_status: ClassVar[int] = 500
    # The exit code gpuctl uses for this code: the same as gpuctl's own table
    # (gpud.core.vocab.EXIT_CODES, which gpuctl reads without importing this tree;
    # tests/test_errors.py holds the two equal). A code of the daemon's own that never crosses
    # the API keeps its parent's.
    exit_code: ClassVar[int] = 1

    def __init__(self, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, Any] = details or {}

    def to_json(self) -> Error:
        return {"error": {"code": self.code, "message": self.message, "details": self.details}}

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled whole, subclass attributes included (a plan is made in a worker process and
        # its refusal comes back this way): the default would call cls(message) alone.
        return (_rebuilt, (type(self), self.message, dict(self.__dict__)))


def _rebuilt(cls: type[GpudError], message: str, state: dict[str, Any]) -> GpudError:
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)
    exc.__dict__.update(state)
    return exc


class BadRequest(GpudError):
    code = "bad-request"
    exit_code = 2
    http_status = 400


class ConfigError(BadRequest):
    """A config that cannot be used. ``problems`` holds one "key.path: reason" line each."""

    code = "config-invalid"
    exit_code = 2

    def __init__(self, source: str, problems: list[str]) -> None:
        lines = "\n".join(f"  {p}" for p in problems)
        super().__init__(f"{source}: invalid config\n{lines}", {"source": source, "problems": problems})
        self.source = source
        self.problems = problems


class Forbidden(GpudError):
    code = "forbidden"
    http_status = 403


class NotFound(GpudError):
    code = "not-found"
    exit_code = 2
    http_status = 404


class PayloadTooLarge(GpudError):
    code = "payload-too-large"
    exit_code = 2
    http_status = 413


class RequestTimeout(GpudError):
    code = "request-timeout"
    http_status = 408


class TooManyRequests(GpudError):
    code = "too-many-requests"
    http_status = 429


class Refused(GpudError):
    """An expected refusal. Logged as a warning, never as an error."""

    code = "refused"
    http_status = 409


class Denied(Refused):
    code = "denied"


class Conflict(Refused):
    code = "conflict"


class Unavailable(GpudError):
    code = "unavailable"
    http_status = 503


class JobFailed(GpudError):
    """A systemd job for a serve's unit finished with a result other than ``done``
    (``details["result"]``: failed, dependency, timeout, canceled, ... or ``wait-timeout``)."""

    code = "unit-job-failed"
    http_status = 500


class StoreError(GpudError):
    code = "store-failed"
    http_status = 500


ALL_ERRORS: tuple[type[GpudError], ...] = (
    GpudError,
    BadRequest,
    ConfigError,
    Forbidden,
    NotFound,
    PayloadTooLarge,
    RequestTimeout,
    TooManyRequests,
    Refused,
    Denied,
    Conflict,
    Unavailable,
    JobFailed,
    StoreError,
)
