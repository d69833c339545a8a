"""Logging to journald with structured fields, over the native protocol (no library needed).

An event is logged with ``logger.info(msg, extra={"journal": {"GPUD_EVENT": "deny", ...}})``; the
fields become journal fields, so ``journalctl -u gpud GPUD_SERVE=ocr`` finds it. When gpud's
stderr is not connected to the journal (foreground runs, tests), records go to stderr instead.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import sys
from collections.abc import Mapping
from typing import Any

from gpud.core.text import printable

JOURNAL_SOCKET = "/run/systemd/journal/socket"

_PRIORITY = {
    logging.CRITICAL: 2,
    logging.ERROR: 3,
    logging.WARNING: 4,
    logging.INFO: 6,
    logging.DEBUG: 7,
}


def encode_entry(fields: Mapping[str, object]) -> bytes:
    """The journal's native datagram: KEY=value lines; values with a newline use the binary form."""
    out = bytearray()
    for key, value in fields.items():
        data = str(value).encode("utf-8", "replace")
        name = key.encode("ascii")
        if b"\n" in data:
            out += name + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += name + b"=" + data + b"\n"
    return bytes(out)


def field_name(key: str) -> str:
    """journald field names: uppercase letters, digits and underscores, not starting with '_'."""
    name = "".join(c if c.isalnum() else "_" for c in key.upper()).lstrip("_")
    return name or "FIELD"


class JournalHandler(logging.Handler):
    def __init__(self, path: str = JOURNAL_SOCKET, identifier: str = "gpud") -> None:
        super().__init__()
        self.path = path
        self.identifier = identifier
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fields: dict[str, object] = {
                # what a peer wrote (a source label, a serve name) shown, never obeyed
                "MESSAGE": printable(self.format(record)),
                "PRIORITY": _PRIORITY.get(record.levelno, 6),
                "SYSLOG_IDENTIFIER": self.identifier,
                "CODE_FILE": record.pathname,
                "CODE_LINE": record.lineno,
                "CODE_FUNC": record.funcName,
                "LOGGER": record.name,
            }
            extra: Any = getattr(record, "journal", None)
            if isinstance(extra, Mapping):
                for key, value in extra.items():
                    if value is not None:
                        fields[field_name(str(key))] = value
            self._sock.sendto(encode_entry(fields), self.path)
        except OSError:
            self.handleError(record)

    def close(self) -> None:
        self._sock.close()
        super().close()


class FieldsFormatter(logging.Formatter):
    """For stderr: the message followed by its journal fields, so foreground runs show them."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        extra: Any = getattr(record, "journal", None)
        if isinstance(extra, Mapping) and extra:
            pairs = " ".join(f"{k}={v}" for k, v in extra.items() if v is not None)
            text = f"{text} [{pairs}]"
        return printable(text)


def stderr_is_journal() -> bool:
    """systemd sets JOURNAL_STREAM=dev:inode when stderr is connected to the journal."""
    stream = os.environ.get("JOURNAL_STREAM", "")
    try:
        dev, ino = (int(x) for x in stream.split(":"))
        st = os.fstat(sys.stderr.fileno())
    except (ValueError, OSError):
        return False
    return st.st_dev == dev and st.st_ino == ino


def setup_logging(level: int = logging.INFO, *, target: str = "auto") -> None:
    """target: "journal", "stderr" or "auto" (the journal when stderr is connected to it)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    use_journal = target == "journal" or (
        target == "auto" and stderr_is_journal() and os.path.exists(JOURNAL_SOCKET)
    )
    chosen: logging.Handler
    if use_journal:
        chosen = JournalHandler()
        chosen.setFormatter(logging.Formatter("%(message)s"))
    else:
        chosen = logging.StreamHandler(sys.stderr)
        chosen.setFormatter(FieldsFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(chosen)
    root.setLevel(level)
