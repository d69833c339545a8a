"""What a request to the API carries, read within bounds: its JSON body (at most BODY_LIMIT
bytes, arriving within the time the connection guard gives it, gpud.server.connguard; parsed by
gpud.bounded, and checked against a pydantic model with one clear reason per field) and its
integer and time query parameters. A body or parameter that is wrong is a BadRequest that says
what is wrong."""

from __future__ import annotations

import asyncio
import json
import math
from datetime import datetime
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from gpud import bounded
from gpud.config import _reason
from gpud.errors import BadRequest, PayloadTooLarge, RequestTimeout
from gpud.server import connguard

BODY_LIMIT = 64 * 1024

M = TypeVar("M", bound=BaseModel)


async def read_json(request: web.Request, limit: int = BODY_LIMIT, *, empty_ok: bool = False) -> Any:
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"request body of {request.content_length} bytes is over the limit "
                              f"of {limit} bytes", {"limit": limit})
    # read(n) gives what has arrived, up to n bytes: a large body comes in several pieces.
    chunks: list[bytes] = []
    size = 0
    deadline: float | None = request.get("deadline")
    loop = asyncio.get_running_loop()
    while True:
        try:
            async with asyncio.timeout_at(deadline):
                while chunk := await request.content.read(limit + 1 - size):
                    chunks.append(chunk)
                    size += len(chunk)
                    if size > limit:
                        raise PayloadTooLarge(f"request body is over the limit of {limit} bytes",
                                              {"limit": limit})
            break
        except TimeoutError as exc:
            late = loop.time() - deadline if deadline is not None else 0.0
            if late < connguard.LATE_S:
                raise RequestTimeout(
                    f"the request body did not arrive in time ({size} bytes within "
                    "daemon.request_read_timeout_s of the start of its handling)",
                    {"received_bytes": size}) from exc
            deadline = loop.time() + late  # the loop was busy past it: that time is not the peer's
    raw = b"".join(chunks)
    if not raw.strip():
        if empty_ok:
            return {}
        raise BadRequest("request body is empty: a JSON object is required")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"invalid JSON: not UTF-8 (byte {exc.start})") from exc
    try:
        return bounded.parse_json(text)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"invalid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from exc
    except bounded.SyntaxProblem as exc:
        raise BadRequest(f"invalid JSON: {exc}") from exc
    except bounded.OutOfBounds as exc:
        raise BadRequest(f"{exc.path}: {exc.reason}", {"path": exc.path}) from exc


async def read_model(request: web.Request, model: type[M], *,
                                   empty_ok: bool = False, limit: int = BODY_LIMIT) -> M:
    data = await read_json(request, limit, empty_ok=empty_ok)
    if not isinstance(data, dict):
        raise BadRequest(f"request body must be a JSON object, not {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = [f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {_wire_reason(e)}"
                    for e in exc.errors()]
        raise BadRequest("; ".join(problems), {"problems": problems}) from exc


def _wire_reason(err: Any) -> str:
    if err["type"] == "int_type" and err["loc"] == ("mib",):
        value = err.get("input")
        shown = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else value
        return f"must be a positive integer number of MiB, got {shown}"
    return _reason(err)


def int_param(value: str | None, name: str, default: int, low: int, high: int) -> int:
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError as exc:
        raise BadRequest(f"{name}: must be an integer, got {value[:50]!r}") from exc
    if not low <= number <= high:
        raise BadRequest(f"{name}: must be between {low} and {high}")
    return number


def parse_since(value: str) -> float:
    """Epoch seconds or ISO 8601 (a naive time is local time, like journalctl's --since)."""
    try:
        number = float(value)
        if math.isfinite(number):
            return number
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError as exc:
        raise BadRequest(f"since: not epoch seconds or ISO 8601: {value[:50]!r}") from exc
