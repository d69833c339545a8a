"""The in-flight reader: a serve's count of requests in flight, read from its ``GET /metrics``
over HTTP (over its Unix socket when it is fronted, as gpud's health checks are). What the
count means and what follows from it (idle, drained, a stream that must not be cut) is
gpud.core.traffic's; when and which serves are read, gpud.life.traffic's.

Off the data path: these are gpud's own requests to a serve, bounded by READ_TIMEOUT_S; a slow or
silent serve delays nothing but the next read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import aiohttp

from gpud.config import ServeConfig
from gpud.core.traffic import in_flight_from_metrics
from gpud.errors import GpudError

READ_TIMEOUT_S: Final = 2.0
# A /metrics text larger than this is not read (vLLM's is some tens of KiB).
MAX_METRICS_BYTES: Final = 8 << 20


def reachable(spec: ServeConfig) -> bool:
    """gpud can read the serve's count: it is fronted (its socket) or has a port."""
    return spec.front or spec.port is not None


def metrics_url(spec: ServeConfig) -> str:
    if spec.front:
        return "http://localhost/metrics"  # over the serve's socket (Runtime.serve_http)
    return f"http://127.0.0.1:{spec.port}/metrics"


class InFlightReader:
    """Reads a serve's count through HTTP (`http`: the serve's client, as
    gpud.life.supervisor.base.Runtime.serve_http gives it)."""

    def __init__(self, http: Callable[[str, ServeConfig], aiohttp.ClientSession]) -> None:
        self.http = http

    async def read(self, serve: str, spec: ServeConfig) -> tuple[bool, int | None]:
        """(answered, count): the serve's count now; answered False when it did not answer,
        count None when it answered without vLLM's gauges."""
        try:
            async with self.http(serve, spec).get(
                    metrics_url(spec),
                    timeout=aiohttp.ClientTimeout(total=READ_TIMEOUT_S)) as resp:
                if resp.status != 200:
                    return True, None
                body = await resp.content.read(MAX_METRICS_BYTES)
        except (aiohttp.ClientError, TimeoutError, OSError, GpudError):
            return False, None
        return True, in_flight_from_metrics(body.decode("utf-8", "replace"))
