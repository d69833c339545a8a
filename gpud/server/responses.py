"""gpud's JSON answers as aiohttp responses: a value, or an error of the error tree with its
own HTTP status (the API's routes and the front's ensure route answer alike)."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from gpud.errors import GpudError


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(data, allow_nan=False), status=status,
                        content_type="application/json")


def error_response(exc: GpudError) -> web.Response:
    return json_response(exc.to_json(), status=exc.http_status)
