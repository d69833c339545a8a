"""gpud's answers as aiohttp responses: a value, or an error of the error tree with its own
HTTP status (the API's routes and the front's ensure route answer alike), an ensure refused for
the requests waiting already, and the status page's text."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

from aiohttp import web

from gpud.core.router import Crowded
from gpud.errors import GpudError, TooManyRequests


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(data, allow_nan=False), status=status,
                        content_type="application/json")


def error_response(exc: GpudError) -> web.Response:
    return json_response(exc.to_json(), status=exc.http_status)


def too_many_waiting(name: str, requester: str, problem: Crowded, retry_s: int) -> web.Response:
    """The 403 the front and the router turn into their refusal (the router's: 429), when
    REQUESTER (or everyone) has as many ensures waiting as gpud keeps: at once, holding
    nothing. X-Gpud-Reason carries the class and the bound (its key and figure), as
    gpud.server.ondemand's refusals; RETRY_S its Retry-After."""
    exc = TooManyRequests(f"serve {name}: {problem.text}; retry in {retry_s} s",
                          {"serve": name, "requester": requester})
    resp = error_response(exc)
    resp.set_status(403)
    resp.headers["X-Gpud-Reason"] = json.dumps({"error": {
        "code": TooManyRequests.code, "message": exc.message,
        "details": {"serve": name, "class": "too-many-waiting", "requester": requester,
                    "limit": problem.limit, "value": problem.value,
                    "retry_after_s": retry_s}}})
    resp.headers["Retry-After"] = str(retry_s)
    return resp


PAGE_SOURCE = Path(__file__).parents[1] / "data" / "status.html"


@cache
def status_page() -> tuple[str, str]:
    """The status page's text and the SHA-256 (base64) of its one inline script, which its
    Content-Security-Policy allows by that hash alone."""
    text = PAGE_SOURCE.read_text()
    scripts = re.findall(r"<script>(.*?)</script>", text, re.DOTALL)
    if len(scripts) != 1:
        raise GpudError(f"{PAGE_SOURCE}: {len(scripts)} inline scripts, one expected")
    digest = base64.b64encode(hashlib.sha256(scripts[0].encode()).digest()).decode()
    return text, digest
