"""gpuctl's readers of argument values, pure: a time (``--since``: an ISO 8601 time, epoch
seconds or an age), a duration (``--window``), a reservation size (MIB), positive numbers, and a
serve's API path. A value that is wrong is a usage error (exit 2) that names it."""

from __future__ import annotations

from gpud.ctl.client import quote_segment
from gpud.ctl.errors import usage_error

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


def epoch_text(ts: float) -> str:
    return f"{ts:.3f}".rstrip("0").rstrip(".")


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        import argparse

        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def positive_int(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) <= 0:
        import argparse

        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def duration(text: str) -> float:
    import math

    units = {"s": 1, "m": 60, "h": 3600}
    try:
        seconds = (float(text[:-1]) * units[text[-1]] if text and text[-1] in units
                   else float(text))
    except ValueError:
        raise usage_error(f"--window: not a duration: {text!r} (say 90s, 10m or 1h)") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise usage_error(f"--window: must be a positive, finite duration: {text!r}")
    return seconds
