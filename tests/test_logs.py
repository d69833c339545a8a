"""`gpuctl logs NAME`: the serve's own journal through journalctl, run with the reader's own
rights; a reader who may not read the system journal is told so."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpud.ctl.errors import EXIT_REFUSED, EXIT_USAGE, CtlError
from gpud.ctl.logs import journal_argv, may_read_system_journal
from gpud.ctl.main import main


def test_the_journal_asked_for_is_the_serves_unit() -> None:
    assert journal_argv("ocr") == ["journalctl", "--unit", "gpud-serve-ocr.service"]
    assert journal_argv("ocr", follow=True, since=1783911600.7, lines=50, as_json=True) == [
        "journalctl", "--unit", "gpud-serve-ocr.service", "--since", "@1783911600",
        "--lines", "50", "--follow", "--output", "json"]
    for bad in ("../x", "Ocr", "a b", "-u"):
        with pytest.raises(CtlError) as err:
            journal_argv(bad)
        assert err.value.exit_code == EXIT_USAGE and "not a serve name" in err.value.message


def test_a_bad_name_or_since_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["logs", "a/b"]) == EXIT_USAGE
    assert "not a serve name" in capsys.readouterr().err
    assert main(["logs", "ocr", "--since", "yesterday-ish"]) == EXIT_USAGE


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory any user may traverse (pytest's own are root's, 0700)."""
    path = Path(tempfile.mkdtemp(prefix="gpud-logs-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path)


def journal_dir(top: Path, mode: int) -> str:
    machine = top / "journal" / "0123456789abcdef"
    machine.mkdir(parents=True, mode=0o755)
    (machine / "system.journal").write_bytes(b"LPKSHHRH")
    (machine / "system.journal").chmod(mode)
    for d in (top, top / "journal", machine):
        d.chmod(0o755)
    return str(top / "journal")


def as_nobody(fn: object) -> int:
    """FN's result (an int) in a child running as uid/gid 65534."""
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            code = fn()  # type: ignore[operator]
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another uid")
def test_who_may_read_the_system_journal(open_dir: Path) -> None:
    closed = journal_dir(open_dir / "a", 0o640)
    opened = journal_dir(open_dir / "b", 0o644)
    assert may_read_system_journal([closed]) is True  # root
    assert as_nobody(lambda: int(may_read_system_journal([closed]) is False)) == 1
    assert as_nobody(lambda: int(may_read_system_journal([closed, opened]) is True)) == 1
    # a journal directory this reader may not even list (journald's is 2755 root:systemd-journal)
    hidden = journal_dir(open_dir / "c", 0o644)
    Path(hidden).chmod(0o700)
    assert as_nobody(lambda: int(may_read_system_journal([hidden]) is False)) == 1
    # no journal files at all: journalctl says what it finds
    assert as_nobody(lambda: int(may_read_system_journal([str(open_dir / "none")]) is None)) == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another uid")
def test_a_reader_who_may_not_read_the_journal_is_told_so(
        open_dir: Path, capfd: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    closed = journal_dir(open_dir, 0o640)
    monkeypatch.setattr("gpud.ctl.logs.JOURNAL_DIRS", (closed,))
    assert as_nobody(lambda: main(["logs", "ocr"])) == EXIT_REFUSED
    err = capfd.readouterr().err
    assert "uid 65534 may not read the system journal, where gpud-serve-ocr.service logs" in err
