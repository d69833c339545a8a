"""The router's access log (docs/router.md): its format and fields, a line parsed into what the
router answered (parse_log_line, Answered), and the counts gpud keeps of them (RouterStats):
requests by model and the router's own latency.

Pure: lines in, values out. gpud.nginx.router.RouterLog reads the file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from gpud.core.queue import Histogram
from gpud.core.router import MAX_REQUESTER
from gpud.core.usage import tokens

# The router's access log: one JSON object a line, read by gpud for its metrics by model
# (gpud.nginx.router.RouterLog): the name of its format, and its fields (nginx variables).
LOG_FORMAT: Final = "gpud_router"
LOG_FIELDS: Final = (
    ("model", "$router_model"),
    ("serve", "$router_serve"),
    ("status", "$status"),
    ("request_s", "$request_time"),
    ("upstream_s", "$upstream_response_time"),
    ("ensure_s", "$router_ensure_s"),
    ("sse", "$router_sse"),
)
# The access log's fields of usage per key (gpud.core.usage): the key's name, when the request
# ended (Unix time, ms), the tokens of the serve's own `usage` (router.js `meterScan`; "" none),
# and whether the whole answer was sent ("OK"; "": the client hung up first: nginx sets
# r->request_complete only on ngx_http_finalize_request's path of a request done, never on
# ngx_http_terminate_request's, src/http/ngx_http_request.c).
USAGE_FIELDS: Final = (
    ("key", "$router_key"),
    ("ts", "$msec"),
    ("prompt_tokens", "$router_prompt_tokens"),
    ("completion_tokens", "$router_completion_tokens"),
    ("complete", "$request_completion"),
)
# The access log's field of forwarding (docs/peers.md): the peer a request went to, "" none.
PEER_FIELDS: Final = (("peer", "$router_peer"),)

# --- the access log: requests by model and the router's own latency --------------------------

# The buckets of the router's own latency (seconds): nginx times at millisecond resolution.
OVERHEAD_BUCKETS_S: Final = (0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
STATUS_CLASSES: Final = ("2xx", "3xx", "4xx", "5xx")


def _seconds(text: str) -> float | None:
    """nginx's `$upstream_response_time`: one time per upstream tried ("0.012, 0.003", "0.010
    : 0.002" across an internal redirect), "-" for none; their sum, None when none is a
    number."""
    total, found = 0.0, False
    for part in re.split(r"[,:]", text):
        try:
            total += float(part)
            found = True
        except ValueError:
            continue
    return total if found else None


@dataclass(frozen=True)
class Answered:
    """One request the router answered, from its access log line: the model it named (""
    for one the router answered itself before it knew a model of its table), that model's
    serve, the class of the answer's status, and the router's own share of its time (None
    when no serve answered it, or when it is not measured)."""

    model: str
    serve: str
    status_class: str
    overhead_s: float | None
    # usage per key (USAGE_FIELDS; gpud.core.usage): "" without a key; None: not in the line
    key: str = ""
    status: int = 0
    ts: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    hung_up: bool = False
    # the peer the request was forwarded to ("" none: answered here)
    peer: str = ""


def parse_log_line(line: str, table: Mapping[str, str]) -> Answered | None:
    """A line of the router's access log (LOG_FIELDS, a JSON object), None when it is not one.
    TABLE: model -> serve; a name not in it counts as "" (names come from the table alone).

    The router's own latency is the request's time in nginx ($request_time) less the serve's
    ($upstream_response_time) and gpud's ensure (the bring-up or the queue): what the router
    adds to a request to a serve that is up. A stream answered through the loading feedback
    (sse "stream" or "refused") has no such figure: its serve answered a subrequest. Its
    status is the 200 the feedback began with, or 503 when the bring-up was refused."""
    try:
        doc = json.loads(line)
    except ValueError:
        return None
    if not isinstance(doc, dict) or not all(isinstance(doc.get(k), str) for k, _ in LOG_FIELDS):
        return None
    peer = doc.get("peer")
    peer = peer[:MAX_REQUESTER] if isinstance(peer, str) else ""
    # a model forwarded to a peer is one of the peers' (the script sets it only for those)
    model = doc["model"] if doc["model"] in table or peer else ""
    sse = doc["sse"]
    status = 503 if sse == "refused" else int(doc["status"]) if doc["status"].isdigit() else 0
    if not 100 <= status <= 599:
        return None
    overhead = None
    upstream, request = _seconds(doc["upstream_s"]), _seconds(doc["request_s"])
    if upstream is not None and request is not None and not sse:
        # nginx times at millisecond resolution: so is the difference
        overhead = max(0.0, round(request - upstream - (_seconds(doc["ensure_s"]) or 0.0), 3))
    return Answered(model, "" if peer else table.get(model, ""), f"{status // 100}xx",
                    overhead, **_usage_fields(doc, status), peer=peer)


def _usage_fields(doc: Mapping[str, object], status: int) -> dict[str, Any]:
    """The USAGE_FIELDS of a log line (absent in a line of an older config: none)."""
    got = {k: v if isinstance(v, str) else "" for k, v in
           ((k, doc.get(k)) for k, _ in USAGE_FIELDS)}
    try:
        ts: float | None = float(got["ts"])
    except ValueError:
        ts = None
    return {"key": got["key"][:MAX_REQUESTER], "status": status, "ts": ts,
            "prompt_tokens": tokens(got["prompt_tokens"]),
            "completion_tokens": tokens(got["completion_tokens"]),
            # a line of an older config has no "complete": not known to have hung up
            "hung_up": "complete" in doc and got["complete"] != "OK"}


@dataclass
class RouterStats:
    """What the router answered since gpud started: requests by (model, serve, status class)
    and the router's own latency by model."""

    requests: dict[tuple[str, str, str], int]
    overhead: dict[str, Histogram]

    @classmethod
    def empty(cls) -> RouterStats:
        return cls({}, {})

    def add(self, answered: Answered) -> None:
        key = (answered.model, answered.serve, answered.status_class)
        self.requests[key] = self.requests.get(key, 0) + 1
        if answered.overhead_s is not None:
            self.overhead.setdefault(answered.model, Histogram.empty(OVERHEAD_BUCKETS_S)
                                     ).observe(answered.overhead_s)
