"""Shared test helpers: a real gpud process on a real Unix socket, and a raw HTTP client."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from hypothesis.database import DirectoryBasedExampleDatabase

from gpud.config import parse_config
from gpud.durable.store import Store
from gpud.life.service import LedgerService

# Skips CI accepts, each with why; any other skip in CI (CI=true) fails the run, so nothing
# passes there by not running.
ALLOWED_CI_SKIPS = {
    "tests/test_nvml_gpu.py": "needs a real NVIDIA GPU (NVML and torch): CI machines have none",
}
_skipped: list[tuple[str, str]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skipped.append((report.nodeid, reason))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("CI") != "true":
        return
    unexpected = [(node, why) for node, why in _skipped
                  if node.split("::")[0] not in ALLOWED_CI_SKIPS]
    if unexpected:
        for node, why in unexpected:
            print(f"\nskipped in CI, which is a failure here: {node}: {why}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED

REPO = Path(__file__).resolve().parent.parent


def example_toml() -> str:
    """etc/serves.toml without its [router] table. The router's own checks (Debian's njs module
    on this host, its address free) are tests/test_doc_snippets.py's, which checks the whole
    file; the tests of everything else read the example through this."""
    text = (REPO / "etc" / "serves.toml").read_text()
    head, found, tail = text.partition("\n[router]\n")
    assert found, "etc/serves.toml has no [router] table"
    return head + "\n" + tail.split("\n\n", 1)[1]

# The examples hypothesis found, the failing ones above all, replayed first by the next run. In
# CI (CI=true) they go where CI keeps them, beside the checkout's other artifacts
# (.ci/artifacts/, ignored by git); elsewhere hypothesis keeps them in .hypothesis/.
HYPOTHESIS_DB = Path(os.environ.get("GPUD_HYPOTHESIS_DB") or REPO / ".ci" / "artifacts" / "hypothesis")
settings.register_profile("ci", database=DirectoryBasedExampleDatabase(HYPOTHESIS_DB),
                          print_blob=True)
if os.environ.get("CI") == "true":
    HYPOTHESIS_DB.mkdir(parents=True, exist_ok=True)
    settings.load_profile("ci")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    database = settings().database
    where = getattr(database, "path", None)
    shown = str(Path(where).resolve()) if where is not None else repr(database)
    terminalreporter.write_line(f"hypothesis example database: {shown}")

# The seed's T015 ledger: reserve 7168, fast 18432 + embeddings 3200 + reranker 3456 = 25088
# committed, free 351; ocr 5120 does not fit.
T015 = """
[daemon]
admission = "ledger"

[roles.dark-fast]
device = "0"
capacity_mib = 32607
reserve_mib = 7168

[serves.fast]
role = "dark-fast"
vram_mib = 18432
resident = true
priority = 10
port = 30001
[serves.fast.vllm]
model = "google/gemma-4-E4B-it"

[serves.embeddings]
role = "dark-fast"
vram_mib = 3200
resident = true
priority = 20
port = 30003
command = ["/bin/true"]

[serves.reranker]
role = "dark-fast"
vram_mib = 3456
resident = true
priority = 30
port = 30004
command = ["/bin/true"]

[serves.ocr]
role = "dark-fast"
vram_mib = 5120
resident = true
priority = 40
port = 30007
command = ["/bin/true", "--port", "{port}"]
"""


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float = 10) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


@dataclass
class Reply:
    status: int
    body: Any
    raw: bytes
    headers: dict[str, str] = field(default_factory=dict)


# How long a test's call waits for gpud's answer: past every budget a test asserts (a real vLLM's
# stop, a start waited for), so that on a loaded machine a slow answer fails the test's own
# assertion, with its figure, and not the socket.
CALL_TIMEOUT_S = 120.0


def call(sock: str | Path, method: str, path: str, body: Any = None, *,
         raw: bytes | None = None, headers: dict[str, str] | None = None,
         timeout: float = CALL_TIMEOUT_S) -> Reply:
    conn = UnixHTTPConnection(str(sock), timeout=timeout)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers=headers or {})
        resp = conn.getresponse()
        payload = resp.read()
    finally:
        conn.close()
    try:
        parsed = json.loads(payload) if payload else None
    except ValueError:
        parsed = None
    return Reply(resp.status, parsed, payload, dict(resp.getheaders()))


@dataclass
class GpudProcess:
    proc: subprocess.Popen[bytes]
    socket: Path
    state_dir: Path
    config: Path
    log: Path

    def call(self, method: str, path: str, body: Any = None, **kw: Any) -> Reply:
        return call(self.socket, method, path, body, **kw)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def output(self) -> str:
        return self.log.read_text()


def write_config(directory: Path, text: str, name: str = "serves.toml") -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(text))
    path.chmod(0o600)
    return path


def start_gpud(tmp: Path, config_text: str, *, wait: bool = True, extra: list[str] | None = None,
               state_dir: Path | None = None, sock: Path | None = None) -> GpudProcess:
    cfg = write_config(tmp, config_text)
    sock = sock or tmp / "gpud.sock"
    state = state_dir or tmp / "state"
    log = tmp / f"gpud-{time.monotonic_ns()}.log"
    # No system bus for these: gpud's launching is unavailable (the sandbox tests have one).
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               DBUS_SYSTEM_BUS_ADDRESS=f"unix:path={tmp}/no-system-bus")
    for var in ("NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_PID", "JOURNAL_STREAM"):
        env.pop(var, None)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpud.daemon", "--config", str(cfg), "--socket", str(sock),
             "--state-dir", str(state), "--log-target", "stderr", *(extra or [])],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO,
        )
    gp = GpudProcess(proc, sock, state, cfg, log)
    if wait:
        try:
            wait_ready(gp)
        except BaseException:
            gp.stop(signal.SIGKILL)  # a gpud that never got ready must not outlive the test
            raise
    return gp


def wait_ready(gp: GpudProcess, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if gp.proc.poll() is not None:
            raise AssertionError(f"gpud exited {gp.proc.returncode}:\n{gp.output()}")
        try:
            if gp.call("GET", "/v1/status").body.get("ready"):
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"gpud not ready in {timeout}s:\n{gp.output()}")


@pytest.fixture
def gpud_t015(tmp_path: Path) -> Iterator[GpudProcess]:
    gp = start_gpud(tmp_path, T015)
    yield gp
    gp.stop()


@contextlib.contextmanager
def loaded_service(tmp_path: Path, config_text: str,
                   store_class: type[Store] = Store) -> Iterator[LedgerService]:
    """A LedgerService over a real SQLite store (STORE_CLASS) in TMP_PATH, loaded, for
    CONFIG_TEXT; the service and its store closed afterwards."""
    store = store_class(tmp_path / "gpud.sqlite3")
    svc = LedgerService(parse_config(config_text, "test"), store)
    svc.load()
    try:
        yield svc
    finally:
        svc.close()
        store.close()
