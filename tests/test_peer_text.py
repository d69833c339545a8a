"""Text that came from a peer (an apply's source label, serve names in errors, event messages)
is shown escaped: by gpuctl (every command's output, --json included) and in the journal's
MESSAGE (gpud.core.text.printable)."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gpud.core.text import printable
from gpud.durable.journal import FieldsFormatter, JournalHandler
from tests.conftest import REPO, T015, GpudProcess, start_gpud

HOSTILE = "\x1b[2J\x1b]0;owned\x07\x1b[31mred\x9b1m\u202etxt.exe\rX\x08"
SHOWN = "\\x1b[2J\\x1b]0;owned\\x07\\x1b[31mred\\x9b1m\\u202etxt.exe\\rX\\b"
# What a terminal obeys: C0 but newline and tab, DEL, C1, the bidirectional controls
OBEYED = {chr(c) for c in [*range(0x20), *range(0x7F, 0xA0)]} - {"\n", "\t"} | {"\u202e"}


def test_printable_escapes_what_a_terminal_obeys() -> None:
    assert printable(HOSTILE) == SHOWN
    assert printable("line\n\tindented é ∑") == "line\n\tindented é ∑"
    assert json.loads('"' + printable("\x9b\u202e", json=True) + '"') == "\x9b\u202e"
    every = "".join(chr(c) for c in range(0x3000))
    assert not set(printable(every)) & OBEYED
    assert not set(printable(every, json=True)) & OBEYED


def _gpuctl(gp: GpudProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpud.ctl", "--socket", str(gp.socket), *args],
                          capture_output=True, text=True, cwd=REPO, check=False, timeout=60)


@pytest.fixture
def applied(tmp_path: Path) -> GpudProcess:
    """A gpud whose events hold an apply's hostile source label (the apply itself fails: no
    system bus to start serves with, and it is rolled back)."""
    gp = start_gpud(tmp_path, T015)
    fits = T015.replace("reserve_mib = 7168", "reserve_mib = 1000")
    gp.call("POST", "/v1/apply", {"config": fits, "source": HOSTILE})
    messages = [e["message"] for e in gp.call("GET", "/v1/events").body["events"]]
    assert any(HOSTILE in m for m in messages), messages  # raw in the store, as sent
    return gp


def test_gpuctl_events_shows_a_source_label_escaped(applied: GpudProcess) -> None:
    try:
        out = _gpuctl(applied, "events")
        assert out.returncode == 0, out.stderr
        # (format_event folds whitespace, \r among it, to one space)
        assert SHOWN.partition("\\r")[0] in out.stdout
        assert not set(out.stdout) & OBEYED
        as_json = _gpuctl(applied, "--json", "events")
        assert not set(as_json.stdout) & OBEYED
        decoded = json.loads(as_json.stdout)["events"]
        assert any(HOSTILE in e["message"] for e in decoded)  # the same text, once decoded
    finally:
        applied.stop()


def test_journal_message_is_escaped(tmp_path: Path) -> None:
    path = tmp_path / "journal.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(str(path))
    handler = JournalHandler(str(path))
    handler.setFormatter(logging.Formatter("%(message)s"))
    try:
        record = logging.LogRecord("gpud", logging.INFO, __file__, 1, "apply validate: %s is valid",
                                   (HOSTILE,), None)
        record.journal = {"GPUD_EVENT": "apply"}
        handler.emit(record)
        entry = server.recv(65536).decode()
    finally:
        handler.close()
        server.close()
    assert f"MESSAGE=apply validate: {SHOWN} is valid\n" in entry
    assert "\x1b" not in entry and "\x9b" not in entry
    assert "GPUD_EVENT=apply\n" in entry
    text = FieldsFormatter("%(message)s").format(record)
    assert text == f"apply validate: {SHOWN} is valid [GPUD_EVENT=apply]"
