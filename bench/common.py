"""What every figure of the benchmark suite shares: a real gpud on a temp socket, a raw HTTP client
over AF_UNIX, statistics, and the shape of a result.

Benchmarks are not tests: nothing here is collected by pytest, and nothing here asserts on time.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# The interpreter running the suite; `python3` on PATH may be a shim (pyenv) that costs more than
# the program it starts, so every figure names the real binary. In a virtualenv (the project's
# .venv) that is the venv's own python, a symlink: resolving it would leave the venv's packages.
PY = sys.executable if sys.prefix != sys.base_prefix else os.path.realpath(sys.executable)
# Temp dirs go to /var/tmp: the same disk as a real /var/lib/gpud (the ledger fsyncs), never a tmpfs.
TMP_BASE = Path("/var/tmp")


# ---- results ------------------------------------------------------------------------------------


@dataclass
class Row:
    """One line of the final table."""

    figure: str
    measured: str
    target: str
    verdict: str


@dataclass
class FigureResult:
    name: str
    title: str
    rows: list[Row] = field(default_factory=list)
    # the details: how it was measured, spreads, sanity checks (printed and written to RESULTS.md)
    notes: list[str] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # suspicious things seen while measuring

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"  {text}", flush=True)

    def problem(self, text: str) -> None:
        self.problems.append(text)
        print(f"  PROBLEM: {text}", flush=True)


def verdict(measured: float, target: float, *, lower_is_better: bool = True) -> str:
    """`0.42x target, ok` / `1.30x target, MISS`."""
    if target == 0:
        return "n/a"
    ratio = measured / target
    good = ratio <= 1.0 if lower_is_better else ratio >= 1.0
    return f"{ratio:.2f}x target, {'ok' if good else 'MISS'}"


# ---- statistics ---------------------------------------------------------------------------------


def pct(values: Sequence[float], q: float) -> float:
    """The q-th percentile by nearest rank (p99 of 100 values is the 99th smallest)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def spread(values: Sequence[float], fmt: str = "{:.1f}") -> str:
    """`median M (p25-p75 A-B, min-max C-D, n=N)`."""
    if not values:
        return "no samples"
    return (f"median {fmt.format(median(values))} (p25-p75 {fmt.format(pct(values, 25))}-"
            f"{fmt.format(pct(values, 75))}, min-max {fmt.format(min(values))}-"
            f"{fmt.format(max(values))}, n={len(values)})")


# ---- HTTP over the Unix socket ------------------------------------------------------------------


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str | Path, timeout: float = 10) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = str(path)

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.unix_path)
        self.sock = sock


def call(sock: str | Path, method: str, path: str, body: Any = None,
         timeout: float = 10) -> tuple[int, Any]:
    """One request on a fresh connection: (status, parsed JSON body or None)."""
    conn = UnixHTTPConnection(sock, timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        payload = resp.read()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(payload) if payload else None
    except ValueError:
        return resp.status, None


def get(sock: str | Path, path: str) -> Any:
    status, body = call(sock, "GET", path)
    if status != 200:
        raise RuntimeError(f"GET {path}: {status} {body}")
    return body


# ---- a real gpud on a temp socket ---------------------------------------------------------------


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    dir: Path
    socket: Path
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self, tail: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-tail:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def temp_dir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"gpud-bench-{prefix}.", dir=TMP_BASE))


def start_gpud(directory: Path, config_text: str, timeout: float = 30,
               env: dict[str, str] | None = None) -> Daemon:
    """gpud in the foreground on DIRECTORY/gpud.sock, its state in DIRECTORY/state; ready on
    return. `env`: more environment for it."""
    cfg = directory / "serves.toml"
    cfg.write_text(config_text)
    cfg.chmod(0o600)
    sock = directory / "gpud.sock"
    log = directory / "gpud.log"
    more = env or {}
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for var in ("NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_PID", "JOURNAL_STREAM", "WATCHDOG_USEC"):
        env.pop(var, None)
    env.update(more)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [PY, "-m", "gpud.daemon", "--config", str(cfg), "--socket", str(sock),
             "--state-dir", str(directory / "state"), "--log-target", "stderr"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=REPO,
        )
    daemon = Daemon(proc, directory, sock, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gpud exited {proc.returncode}:\n{daemon.output()}")
        try:
            status, body = call(sock, "GET", "/v1/status", timeout=2)
            if status == 200 and body.get("ready"):
                return daemon
        except OSError:
            pass
        time.sleep(0.05)
    daemon.stop()
    raise RuntimeError(f"gpud not ready in {timeout:.0f} s:\n{daemon.output()}")


# ---- /proc --------------------------------------------------------------------------------------

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of PID, in seconds (fields 14 and 15 of /proc/PID/stat)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def status_kib(pid: int, key: str) -> int:
    """A `kB` line of /proc/PID/status (VmRSS, VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


# ---- the machine --------------------------------------------------------------------------------


def machine() -> dict[str, str]:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem_kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                       if line.startswith("MemTotal:"))
        memory = f"{mem_kib / 1024 / 1024:.1f} GiB"
    except (OSError, StopIteration):
        memory = "unknown"
    commit = "unknown"
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"],
                               capture_output=True, text=True, timeout=10)
        if out.returncode == 0:
            commit = out.stdout.strip() + (" (working tree modified)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    uname = os.uname()
    return {
        "nproc": str(len(os.sched_getaffinity(0))),
        "cpu": model,
        "memory": memory,
        "kernel": f"{uname.sysname} {uname.release} {uname.machine}",
        "python": f"{sys.version.split()[0]} ({PY})",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "commit": commit,
        "load_before": loadavg(),
    }


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"
