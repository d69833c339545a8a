"""Usage per key (docs/router.md, "Who is asking"): what each key asked of each model, counted
from the router's access log. Pure: lines in, hourly rows out (gpud.durable.store keeps them,
gpud.nginx.router reads the log).

A request is counted under its key (keys off: under "", the router's one anonymous bucket: an
address is no label, it is not bounded), the model it named, the hour it ended and its status.
Tokens come from the serve's own `usage` object only, as the router saw it pass (router.js
`meterScan`): the answer's top-level `usage` (a non-streamed answer's; a stream's event that
carries it: a chat or completions stream's last chunk when the client asked for it with
`stream_options.include_usage`, /v1/responses' `response.completed`, /v1/messages'
message_start and message_delta), read by the route's own names: `prompt_tokens` and
`completion_tokens`, or `input_tokens` and `output_tokens` on /v1/responses and /v1/messages
(counted here as prompt and completion). A count anywhere else in the answer (a tool's schema
the answer echoes: the client's text) is never read. An answer without usage (a stream without
include_usage, an error) is counted in `requests` and in `unmetered`, its tokens in neither
sum: never invented. A request whose client hung up before the whole answer was sent (nginx's
$request_completion is not "OK") is counted in `hung_up` too, with what the serve reported
before it, if anything.

A request a peer host forwarded with its requester (docs/peers.md, "Who is asking, across
hosts") is counted under PEER/NAME: the peer key's name, "/", the requester the peer named. A
key's name has no "/", so such a row is never a local key's, and it is charged to the peer key
(`charged_to`: its budgets, gpud.core.quota).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

HOUR_S: Final = 3600
# Between a peer key's name and the requester it forwarded (PEER/NAME).
FORWARDED_SEP: Final = "/"


def charged_to(name: str) -> str:
    """The key a usage row's (or a requester's) NAME is charged to: the name itself, or for a
    peer's forwarded requester (PEER/NAME) the peer key's."""
    return name.partition(FORWARDED_SEP)[0]


def hour_of(ts: float) -> int:
    """The hour TS (a Unix time) falls in, as the Unix time of its start."""
    return int(ts // HOUR_S) * HOUR_S


@dataclass(frozen=True, slots=True)
class UsageKey:
    hour: int
    key: str
    model: str
    status: int


@dataclass(frozen=True, slots=True)
class Counts:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # answers that carried no usage: counted, their tokens unknown
    unmetered: int = 0
    # requests whose client hung up before the whole answer was sent
    hung_up: int = 0

    def __add__(self, other: Counts) -> Counts:
        return Counts(self.requests + other.requests,
                      self.prompt_tokens + other.prompt_tokens,
                      self.completion_tokens + other.completion_tokens,
                      self.unmetered + other.unmetered,
                      self.hung_up + other.hung_up)


def one(prompt_tokens: int | None, completion_tokens: int | None,
        hung_up: bool = False) -> Counts:
    """One request's counts: its tokens when its answer carried usage, else unmetered; and
    whether its client hung up."""
    gone = 1 if hung_up else 0
    if prompt_tokens is None or completion_tokens is None:
        return Counts(1, 0, 0, 1, gone)
    return Counts(1, prompt_tokens, completion_tokens, 0, gone)


def tokens(text: str) -> int | None:
    """A token count as the access log writes it (the router's js_var: digits, or "" / "-"
    when the answer carried none); None when it is not a count."""
    return int(text) if text.isdigit() and len(text) <= 12 else None


def add(rows: Mapping[UsageKey, Counts], key: UsageKey, counts: Counts) -> dict[UsageKey, Counts]:
    out = dict(rows)
    out[key] = out.get(key, Counts()) + counts
    return out


@dataclass(frozen=True, slots=True)
class UsageSummary:
    """A key's use of a model over a span: what `gpuctl usage` prints a row of."""

    key: str
    model: str
    counts: Counts
    # requests by status ("200", "429", ...)
    statuses: Mapping[str, int]

    def to_json(self) -> dict[str, object]:
        c = self.counts
        return {"key": self.key, "model": self.model, "requests": c.requests,
                "prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
                "total_tokens": c.prompt_tokens + c.completion_tokens,
                "unmetered": c.unmetered, "hung_up": c.hung_up, "statuses": dict(self.statuses)}


def summarize(rows: Iterable[tuple[UsageKey, Counts]]) -> list[UsageSummary]:
    """Rows summed by (key, model), their statuses kept apart; by key, then model."""
    sums: dict[tuple[str, str], Counts] = {}
    statuses: dict[tuple[str, str], dict[str, int]] = {}
    for k, c in rows:
        at = (k.key, k.model)
        sums[at] = sums.get(at, Counts()) + c
        by = statuses.setdefault(at, {})
        by[str(k.status)] = by.get(str(k.status), 0) + c.requests
    return [UsageSummary(key, model, sums[(key, model)], dict(sorted(statuses[(key, model)].items())))
            for key, model in sorted(sums)]
