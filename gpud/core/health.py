"""What a health answer means: pure decisions, no I/O (the supervisor asks, this module judges).

vLLM 0.33 (its source: entrypoints/launchers/launcher.py, serve/instrumentator/health.py): its
HTTP server does not listen until the model has loaded, so during a start a refused connection
means "still loading", until the start timeout; `/health` answers 200 when ready and 503 once
the engine died, and the server then exits within about 5 s. So for a vLLM serve that has been
healthy, one 503 is a verdict, not a blip. A serve given by `command` may be anything: there
only `health_failures` failed checks in a row are.

An answer counts only when it comes from the serve's own process: a 200 from a socket held by
another process (gpud.host.ports) is `FOREIGN`, a failure like any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Probe(StrEnum):
    OK = "ok"                  # 200 from a socket the serve's own unit holds
    REFUSED = "refused"        # nobody listens (vLLM: loading)
    ENGINE_DEAD = "503"        # 503 Service Unavailable
    FAILED = "failed"          # timeout, reset, any other status
    FOREIGN = "foreign"        # an answer from a socket held by a process outside the unit


@dataclass(frozen=True)
class Answer:
    probe: Probe
    detail: str  # for the record: "connection refused", "503", "held by PID 42 (x.service)"


@dataclass(frozen=True)
class HealthVerdict:
    failures: int              # failed checks in a row, after this one
    unhealthy: str | None      # the reason, once the serve is unhealthy; None while it is not


def judge_running(answer: Answer, failures: int, limit: int, *, vllm: bool,
                  health_path: str) -> HealthVerdict:
    """A running serve's check: healthy, one more failure, or unhealthy (with the reason)."""
    if answer.probe is Probe.OK:
        return HealthVerdict(0, None)
    count = failures + 1
    if answer.probe is Probe.ENGINE_DEAD and vllm:
        return HealthVerdict(count, f"unhealthy: engine died ({health_path} answered 503 after the "
                              "serve was healthy)")
    if count >= limit:
        return HealthVerdict(count, f"unhealthy: {count} health checks in a row failed on "
                              f"{health_path} (last: {answer.detail})")
    return HealthVerdict(count, None)


def healthy_at_start(answer: Answer) -> bool:
    """A starting serve is healthy at its first 200 from its own socket; anything else (refused
    while vLLM loads, 503, a foreign listener) means keep waiting until the start timeout."""
    return answer.probe is Probe.OK
