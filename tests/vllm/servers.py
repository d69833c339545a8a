"""Real vLLM (its CPU build, made by scripts/setup-vllm in .venv-vllm/) and the stand-in, run the
same way: a `vllm serve`-shaped argv on a loopback port, as plain processes."""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# GPUD_VLLM_VENV: another checkout's real-vLLM tier, used read-only (the tests write nothing in it)
VENV = Path(os.environ.get("GPUD_VLLM_VENV") or REPO / ".venv-vllm")
VLLM = VENV / "bin" / "vllm"
MODEL = VENV / "model"
# A real start of the tiny model on 2 busy cores: ~50 s (imports ~40 s of it); allow for a
# machine shared with other work.
REAL_START_S = 300.0

# What the real engine needs here: a 1 GiB CPU KV cache, no hub, no usage report. The model is
# run eagerly: torch.compile's warm-up would add about a minute to every cold start and show
# nothing gpud relies on.
REAL_ENV: Mapping[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}
REAL_ARGS = ("--max-model-len", "512", "--enforce-eager")


def real_vllm_missing() -> str | None:
    """Why real vLLM cannot run here, or None."""
    if not VLLM.exists():
        return f"no real vLLM at {VLLM} (scripts/setup-vllm makes it)"
    if not (MODEL / "config.json").exists():
        return f"no tiny model at {MODEL} (scripts/setup-vllm makes it)"
    return None


@dataclass(frozen=True)
class Implementation:
    name: str
    argv: Callable[[int], list[str]]
    env: Mapping[str, str]
    start_timeout_s: float


REAL = Implementation(
    "vllm",
    lambda port: [str(VLLM), "serve", str(MODEL), "--host", "127.0.0.1", "--port", str(port),
                  *REAL_ARGS],
    REAL_ENV, REAL_START_S)
STANDIN = Implementation(
    "standin",
    lambda port: [sys.executable, "-m", "gpud.testing.standin", "serve", str(MODEL), "--host",
                  "127.0.0.1", "--port", str(port), *REAL_ARGS, "--startup-delay", "1.5"],
    {"PYTHONPATH": str(REPO)}, 30.0)

# A pooling serve of each: the tiny model run as an embedding model (vLLM's --convert embed:
# its last token's hidden state, normalized), whose width is the tiny model's hidden size;
# the stand-in told the same width.
EMBEDDING_WIDTH = 256
POOLING_ARGS = ("--runner", "pooling", "--convert", "embed")
REAL_POOLING = Implementation(
    "vllm", lambda port: [*REAL.argv(port), *POOLING_ARGS], REAL_ENV, REAL_START_S)
STANDIN_POOLING = Implementation(
    "standin", lambda port: [*STANDIN.argv(port), *POOLING_ARGS, "--embedding-width",
                             str(EMBEDDING_WIDTH)], STANDIN.env, STANDIN.start_timeout_s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def get(port: int, path: str, *, method: str = "GET", body: bytes | None = None,
        timeout: float = 10, content_type: str = "application/json") -> tuple[int, bytes]:
    """(status, body); raises OSError (ConnectionRefusedError first of all) when nothing answers."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        headers = {"Content-Type": content_type} if body is not None else {}
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def outcome(port: int) -> str:
    """What GET /health meets now: "refused", another OSError's name, or the HTTP status."""
    try:
        return str(get(port, "/health", timeout=5)[0])
    except ConnectionRefusedError:
        return "refused"
    except (OSError, http.client.HTTPException) as exc:
        return type(exc).__name__


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            out.append(int(entry))
    return sorted(out)


def title(pid: int) -> tuple[str, str]:
    """(argv[0], comm) of a process."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv0 = f.read().split(b"\0")[0].decode(errors="replace")
    with open(f"/proc/{pid}/comm") as f:
        return argv0, f.read().strip()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@dataclass
class Server:
    impl: Implementation
    port: int
    proc: subprocess.Popen[bytes]
    log: Path
    started: float = field(default_factory=time.monotonic)
    # What GET /health met from launch until the first 200, in order, repeats folded.
    seen: list[str] = field(default_factory=list)

    @classmethod
    def launch(cls, impl: Implementation, log: Path, extra: tuple[str, ...] = (),
               env: dict[str, str] | None = None) -> Server:
        port = free_port()
        env = {**os.environ, **impl.env, **(env or {})}
        with open(log, "wb") as out:
            # its own session: the whole tree is ended at teardown by its process group
            proc = subprocess.Popen([*impl.argv(port), *extra], stdout=out, stderr=subprocess.STDOUT,
                                    env=env, cwd="/", start_new_session=True)
        return cls(impl, port, proc, log)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def look(self) -> bool:
        """One look at GET /health while it starts; True once it answered 200."""
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.impl.name} exited {self.proc.returncode} before it "
                                 f"was ready:\n{self.output()[-4000:]}")
        if time.monotonic() > self.started + self.impl.start_timeout_s:
            raise AssertionError(f"{self.impl.name} not ready after "
                                 f"{self.impl.start_timeout_s} s; /health met {self.seen}:\n"
                                 f"{self.output()[-4000:]}")
        seen = outcome(self.port)
        if not self.seen or self.seen[-1] != seen:
            self.seen.append(seen)
        return seen == "200"

    def engine(self) -> int:
        """The engine child's PID (titled VLLM::EngineCore)."""
        for pid in children(self.proc.pid):
            with contextlib.suppress(OSError):
                if title(pid)[0] == "VLLM::EngineCore":
                    return pid
        raise AssertionError(f"{self.impl.name}: no VLLM::EngineCore child of {self.proc.pid}: "
                             f"{[(p, title(p)) for p in children(self.proc.pid)]}")

    def end(self) -> None:
        """Whatever is left of its process group, killed (only this server's tree)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def wait_ready(*servers: Server) -> None:
    """Watch every server's start at once (each one's /health from its launch on)."""
    waiting = list(servers)
    while waiting:
        waiting = [s for s in waiting if not s.look()]
        time.sleep(0.2)

