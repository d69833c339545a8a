"""A stand-in for a vLLM OpenAI server, for tests and demos on machines without a GPU.

Run as ``python -m gpud.testing.standin`` with a ``vllm serve``-shaped argv::

    python -m gpud.testing.standin serve MODEL --port 30001 --gpu-memory-utilization 0.4396 \\
        --max-model-len 32768 --quantization fp8 --startup-delay 2

It answers what gpud looks at: ``GET /health`` (503 while "loading", 200 with an empty body
after, like vLLM), ``GET /v1/models`` (vLLM's ``ModelList`` shape) and a tiny echo on
``POST /v1/completions`` and ``/v1/chat/completions``. It never pretends to be real: its
startup line says "stand-in", ``/v1/models`` says ``"owned_by": "gpud-standin"`` and every
response carries ``X-Gpud-Standin: 1``.

Simulated memory draw: ``--draw-mib N``, else ``floor(util x GPUD_SIM_TOTAL_MIB)``, times
``1 + overdraw_pct/100``. When ``GPUD_SIM_PROCS_DIR`` and ``GPUD_SIM_DEVICE`` are set, the process
holding the draw (this one, or with ``--draw-in-child`` a child it spawns, as vLLM's engine
core holds the memory) registers ``PROCS_DIR/PID.json`` = ``{"pid", "device", "mib", ...}``
through ``gpud.simulation.register_process`` (atomic) and removes it when it exits (SIGTERM,
SIGINT, SIGHUP, crash, normal exit; after a SIGKILL the simulation drops the file of a dead PID).
The simulated observation backend reads these files as NVML's per-process list.

Fault injection: ``--crash-after S [--exit-code C]``, ``--never-healthy``, ``--unhealthy-after S``,
``--ignore-sigterm``. Unknown (vLLM) flags are accepted and logged.

Standard library only, and not even ``http.server``: it pulls in ``http.client`` and ``ssl``
(measured here: some 25 ms of imports and 6 MiB of RSS per process, more than the rest of this
program together), and a test host runs many of these at once. The HTTP/1.1 subset here is
what health pollers, curl and OpenAI clients use: Content-Length bodies and keep-alive.
"""

from __future__ import annotations

import argparse
import collections
import io
import itertools
import json
import math
import os
import select
import signal
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from types import FrameType
from typing import Any, Final, NamedTuple

PROGRAM: Final = "gpud-standin"
VERSION: Final = "0.1.0"
OWNED_BY: Final = PROGRAM
STANDIN_HEADER: Final = "X-Gpud-Standin"

# The simulation's environment contract: copies of gpud.simulation's names (a test pins them
# equal), because importing that module at startup would double this program's import time.
GPUD_SIM_PROCS_DIR: Final = "GPUD_SIM_PROCS_DIR"
GPUD_SIM_DEVICE: Final = "GPUD_SIM_DEVICE"
GPUD_SIM_TOTAL_MIB: Final = "GPUD_SIM_TOTAL_MIB"

ECHO_ENV: Final = ("HOME", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
# First argv word of the internal draw-holding child; never part of a vllm-shaped argv.
DRAW_CHILD_TOKEN: Final = "__gpud_standin_draw_child__"

DEFAULT_UTILIZATION: Final = Fraction(9, 10)  # vLLM's default
DEFAULT_MAX_MODEL_LEN: Final = 4096
MAX_BODY: Final = 1 << 20
MAX_HEADERS: Final = 100
MAX_LINE: Final = 65536
KEEPALIVE_TIMEOUT_S: Final = 75.0
CHILD_STOP_TIMEOUT_S: Final = 2.0

_REASONS: Final = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    411: "Length Required",
    413: "Payload Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
}


# ---------------------------------------------------------------------------------------------
# Logging: line-buffered stdout/stderr, which journald files under the unit's identifier.


def _log(message: str) -> None:
    print(f"{PROGRAM}[{os.getpid()}]: {message}", file=sys.stdout, flush=True)


def _warn(message: str) -> None:
    print(f"{PROGRAM}[{os.getpid()}]: WARNING: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Options and the pure parts: draw arithmetic and the health schedule.


class Options(NamedTuple):
    host: str
    port: int
    model: str
    served_model_names: tuple[str, ...]
    max_model_len: int
    gpu_memory_utilization: Fraction
    draw_mib: int | None
    overdraw_pct: Fraction
    draw_after_s: float
    draw_in_child: bool
    startup_delay_s: float
    crash_after_s: float | None
    exit_code: int
    never_healthy: bool
    unhealthy_after_s: float | None
    ignore_sigterm: bool
    echo_argv: bool
    unknown_args: tuple[str, ...]


def compute_draw_mib(
    *,
    draw_mib: int | None,
    utilization: Fraction,
    total_mib: int,
    overdraw_pct: Fraction,
) -> int:
    """MiB the stand-in registers.

    Exact rational arithmetic: gpud passes ``util = floor(vram / total, 4 decimals)`` so that
    ``util x total <= vram``; binary floats would land one MiB off on some of those products.
    """
    base = Fraction(draw_mib) if draw_mib is not None else utilization * total_mib
    return math.floor(base * (1 + overdraw_pct / 100))


class Health(NamedTuple):
    status: int  # 200 or 503
    state: str  # loading | ready | never-healthy | unhealthy


def health_at(opts: Options, elapsed_s: float) -> Health:
    if opts.never_healthy:
        return Health(503, "never-healthy")
    if elapsed_s < opts.startup_delay_s:
        return Health(503, "loading")
    if opts.unhealthy_after_s is not None and elapsed_s >= opts.unhealthy_after_s:
        return Health(503, "unhealthy")
    return Health(200, "ready")


def _fraction(text: str) -> Fraction:
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    return value


def _utilization(text: str) -> Fraction:
    value = _fraction(text)
    # 0 is accepted: gpud's floor(vram / total, 4 decimals) is 0.0000 for a tiny reservation.
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def _non_negative_fraction(text: str) -> Fraction:
    value = _fraction(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _port(text: str) -> int:
    value = _non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"not a port: {text}")
    return value


def _exit_code(text: str) -> int:
    value = _non_negative_int(text)
    if value > 255:
        raise argparse.ArgumentTypeError(f"exit codes are 0..255, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: an unknown vLLM flag must never be taken for a prefix of ours
    # (``--gpu`` is not ``--gpu-memory-utilization``).
    p = argparse.ArgumentParser(
        prog="python -m gpud.testing.standin",
        allow_abbrev=False,
        description="A stand-in for a vLLM OpenAI server (no model, no GPU) for gpud's tests. "
        "Usage: [serve [MODEL]] [options]; unknown vLLM-style options are accepted and ignored.",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8000, help="0 picks a free port (logged)")
    p.add_argument("--model", default=None, help="as the positional MODEL of `serve MODEL`")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME")
    p.add_argument("--max-model-len", type=_non_negative_int, default=DEFAULT_MAX_MODEL_LEN)
    p.add_argument(
        "--gpu-memory-utilization",
        type=_utilization,
        default=DEFAULT_UTILIZATION,
        metavar="U",
        help="fraction of the device TOTAL (env GPUD_SIM_TOTAL_MIB) to draw, like vLLM",
    )
    sim = p.add_argument_group("simulation")
    sim.add_argument("--draw-mib", type=_non_negative_int, default=None, metavar="N")
    sim.add_argument("--overdraw-pct", type=_non_negative_fraction, default=Fraction(0), metavar="P")
    sim.add_argument("--draw-after-s", type=_seconds, default=0.0, metavar="S")
    sim.add_argument(
        "--draw-in-child",
        action="store_true",
        help="a child process holds (registers) the draw, as vLLM's engine core does",
    )
    sim.add_argument("--startup-delay", type=_seconds, default=0.0, metavar="S")
    faults = p.add_argument_group("fault injection")
    faults.add_argument("--crash-after", type=_seconds, default=None, metavar="S")
    faults.add_argument(
        "--exit-code", type=_exit_code, default=1, metavar="C", help="with --crash-after (default 1)"
    )
    faults.add_argument("--never-healthy", action="store_true")
    faults.add_argument("--unhealthy-after", type=_seconds, default=None, metavar="S")
    faults.add_argument("--ignore-sigterm", action="store_true")
    p.add_argument(
        "--echo-argv",
        action="store_true",
        help="print argv and selected env as JSON at start and serve them at /standin/argv",
    )
    return p


def parse_args(argv: Sequence[str]) -> Options:
    """Parse a ``vllm serve``-shaped argv; exits 2 with usage on a bad known option."""
    args = list(argv)
    positional_model: str | None = None
    if args and args[0] == "serve":
        args.pop(0)
        if args and not args[0].startswith("-"):
            positional_model = args.pop(0)
    ns, unknown = _parser().parse_known_args(args)
    model: str = positional_model or ns.model or "standin"
    served = tuple(ns.served_model_name) if ns.served_model_name else (model,)
    return Options(
        host=ns.host,
        port=ns.port,
        model=model,
        served_model_names=served,
        max_model_len=ns.max_model_len,
        gpu_memory_utilization=ns.gpu_memory_utilization,
        draw_mib=ns.draw_mib,
        overdraw_pct=ns.overdraw_pct,
        draw_after_s=ns.draw_after_s,
        draw_in_child=ns.draw_in_child,
        startup_delay_s=ns.startup_delay,
        crash_after_s=ns.crash_after,
        exit_code=ns.exit_code,
        never_healthy=ns.never_healthy,
        unhealthy_after_s=ns.unhealthy_after,
        ignore_sigterm=ns.ignore_sigterm,
        echo_argv=ns.echo_argv,
        unknown_args=tuple(unknown),
    )


# ---------------------------------------------------------------------------------------------
# Registration files: the simulated NVML per-process list.


class SimTarget(NamedTuple):
    procs_dir: str
    device: str


def sim_target_from_env(env: Mapping[str, str]) -> SimTarget | None:
    procs_dir = env.get(GPUD_SIM_PROCS_DIR, "")
    device = env.get(GPUD_SIM_DEVICE, "")
    if procs_dir and device:
        return SimTarget(procs_dir, device)
    return None


def sim_total_from_env(env: Mapping[str, str]) -> int:
    text = env.get(GPUD_SIM_TOTAL_MIB, "").strip()
    if not text:
        return 0
    value = int(text)  # ValueError: reported by main as a usage error
    if value < 0:
        raise ValueError(f"{GPUD_SIM_TOTAL_MIB} must be >= 0, got {text}")
    return value


def register(target: SimTarget, pid: int, mib: int) -> str:
    # Imported here, not at the top: gpud.simulation brings pathlib, tempfile, logging and
    # dataclasses (some 40 modules, doubling this program's import time), and only a process
    # that registers needs it, after its port already listens.
    from pathlib import Path

    from gpud.simulation import register_process

    return str(register_process(Path(target.procs_dir), pid, target.device, mib))


def unregister(target: SimTarget, pid: int) -> None:
    from pathlib import Path

    from gpud.simulation import unregister_process

    unregister_process(Path(target.procs_dir), pid)


# ---------------------------------------------------------------------------------------------
# HTTP: a small HTTP/1.1 server (Content-Length bodies, keep-alive), one thread per connection.


class Request(NamedTuple):
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class Response(NamedTuple):
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _read_request(rfile: io.BufferedIOBase) -> tuple[Request, bool] | None:
    """One request and whether the connection stays open; None at a clean end of stream."""
    line = rfile.readline(MAX_LINE + 1)
    if line in (b"\r\n", b"\n"):  # RFC 9112 2.2: ignore one empty line before a request
        line = rfile.readline(MAX_LINE + 1)
    if not line:
        return None
    if len(line) > MAX_LINE:
        raise _BadRequest(400, "request line too long")
    parts = line.decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise _BadRequest(400, "malformed request line")
    method, target, version = parts
    headers: dict[str, str] = {}
    while True:
        hline = rfile.readline(MAX_LINE + 1)
        if not hline:
            raise _BadRequest(400, "end of stream inside the headers")
        if hline in (b"\r\n", b"\n"):
            break
        if len(headers) >= MAX_HEADERS or len(hline) > MAX_LINE:
            raise _BadRequest(431, "too many or too long header fields")
        name, sep, value = hline.decode("latin-1").partition(":")
        if not sep or not name or name != name.strip():
            raise _BadRequest(400, "malformed header field")
        headers[name.lower()] = value.strip()
    if "transfer-encoding" in headers:
        raise _BadRequest(501, "Transfer-Encoding is not supported by the stand-in")
    length_text = headers.get("content-length", "0")
    if not (length_text.isascii() and length_text.isdigit()):
        raise _BadRequest(400, "bad Content-Length")
    length = int(length_text)
    if length > MAX_BODY:
        raise _BadRequest(413, "body over 1 MiB")
    body = rfile.read(length) if length else b""
    if len(body) != length:
        return None
    connection = headers.get("connection", "").lower()
    keep_alive = version == "HTTP/1.1" and "close" not in connection
    path = target.split("?", 1)[0]
    return Request(method, path, headers, body), keep_alive


def _encode_response(resp: Response, *, keep_alive: bool, head: bool) -> bytes:
    lines = [
        f"HTTP/1.1 {resp.status} {_REASONS.get(resp.status, 'Unknown')}",
        f"Date: {time.strftime('%a, %d %b %Y %H:%M:%S GMT', time.gmtime())}",
        f"Server: {PROGRAM}/{VERSION}",
        f"{STANDIN_HEADER}: 1",
        f"Content-Length: {len(resp.body)}",
        f"Connection: {'keep-alive' if keep_alive else 'close'}",
    ]
    if resp.body:
        lines.append(f"Content-Type: {resp.content_type}")
    lines.extend(f"{name}: {value}" for name, value in resp.headers)
    head_bytes = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head_bytes if head else head_bytes + resp.body


def _json(status: int, payload: object, headers: tuple[tuple[str, str], ...] = ()) -> Response:
    return Response(status, json.dumps(payload).encode("utf-8"), headers=headers)


class _Handler(socketserver.StreamRequestHandler):
    timeout = KEEPALIVE_TIMEOUT_S
    server: _Server

    def handle(self) -> None:
        app = self.server.app
        while True:
            try:
                parsed = _read_request(self.rfile)
            except _BadRequest as exc:
                self._send(_json(exc.status, {"detail": str(exc)}), keep_alive=False, head=False)
                return
            except (OSError, ValueError):  # timeout, reset, undecodable junk
                return
            if parsed is None:
                return
            request, keep_alive = parsed
            response = app.respond(request)
            if not self._send(response, keep_alive=keep_alive, head=request.method == "HEAD"):
                return
            if request.path != "/health":
                _log(f'"{request.method} {request.path}" {response.status}')
            if not keep_alive:
                return

    def _send(self, resp: Response, *, keep_alive: bool, head: bool) -> bool:
        try:
            self.wfile.write(_encode_response(resp, keep_alive=keep_alive, head=head))
        except OSError:
            return False
        return True


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, address: tuple[str, int], app: App) -> None:
        self.app = app
        super().__init__(address, _Handler)


class _Server6(_Server):
    address_family = socket.AF_INET6


# ---------------------------------------------------------------------------------------------
# The application: what each endpoint answers, from the options and the clock.


class App:
    def __init__(self, opts: Options, *, draw_mib: int, echo: dict[str, Any] | None) -> None:
        self.opts = opts
        self.draw_mib = draw_mib
        self.echo = echo
        self.started_monotonic = time.monotonic()
        self.created = int(time.time())
        # Written by the main thread, read by request threads (single attribute stores).
        self.draw_pid: int | None = None
        self.registration: str | None = None
        self._ids = itertools.count(1)
        Route = tuple[tuple[str, ...], Callable[[Request], Response]]
        self._routes: dict[str, Route] = {
            "/health": (("GET", "HEAD"), self._health),
            "/ping": (("GET", "HEAD", "POST"), self._health),
            "/version": (("GET", "HEAD"), self._version),
            "/v1/models": (("GET", "HEAD"), self._models),
            "/v1/completions": (("POST",), self._completions),
            "/v1/chat/completions": (("POST",), self._chat),
            "/standin/state": (("GET", "HEAD"), self._state),
        }
        if echo is not None:
            self._routes["/standin/argv"] = (("GET", "HEAD"), lambda _req: _json(200, echo))

    def elapsed(self) -> float:
        return time.monotonic() - self.started_monotonic

    def respond(self, req: Request) -> Response:
        route = self._routes.get(req.path)
        if route is None:
            return _json(404, {"detail": "Not Found"})
        methods, handler = route
        if req.method not in methods:
            return _json(405, {"detail": "Method Not Allowed"}, (("Allow", ", ".join(methods)),))
        return handler(req)

    def _health(self, _req: Request) -> Response:
        # vLLM answers an empty body either way; the state name travels in a header.
        h = health_at(self.opts, self.elapsed())
        return Response(h.status, headers=(("X-Gpud-Standin-State", h.state),))

    def _version(self, _req: Request) -> Response:
        return _json(200, {"version": f"{PROGRAM}-{VERSION}"})

    def _models(self, _req: Request) -> Response:
        cards: list[dict[str, Any]] = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": OWNED_BY,
                "root": self.opts.model,
                "parent": None,
                "max_model_len": self.opts.max_model_len,
                "permission": [],
            }
            for name in self.opts.served_model_names
        ]
        return _json(200, {"object": "list", "data": cards})

    def _state(self, _req: Request) -> Response:
        h = health_at(self.opts, self.elapsed())
        return _json(
            200,
            {
                "standin": True,
                "pid": os.getpid(),
                "state": h.state,
                "health_status": h.status,
                "elapsed_s": round(self.elapsed(), 3),
                "draw_mib": self.draw_mib,
                "draw_pid": self.draw_pid,
                "registration": self.registration,
                "model": self.opts.model,
                "served_model_names": list(self.opts.served_model_names),
            },
        )

    def _completions(self, req: Request) -> Response:
        return self._generate(req, chat=False)

    def _chat(self, req: Request) -> Response:
        return self._generate(req, chat=True)

    def _generate(self, req: Request, *, chat: bool) -> Response:
        if health_at(self.opts, self.elapsed()).status != 200:
            return _openai_error(503, "ServiceUnavailableError", "the stand-in is not ready")
        try:
            payload = json.loads(req.body or b"{}")
        except ValueError:
            return _openai_error(400, "BadRequestError", "the body is not JSON")
        if not isinstance(payload, dict):
            return _openai_error(400, "BadRequestError", "the body must be a JSON object")
        model = payload.get("model", self.opts.served_model_names[0])
        if model not in self.opts.served_model_names:
            return _openai_error(404, "NotFoundError", f"The model `{model}` does not exist.")
        if payload.get("stream"):
            return _openai_error(400, "BadRequestError", "the stand-in does not stream")
        text = f"[{PROGRAM} echo] {_prompt_text(payload, chat=chat)}"
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
            }
            kind, prefix = "chat.completion", "chatcmpl"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}
            kind, prefix = "text_completion", "cmpl"
        return _json(
            200,
            {
                "id": f"{prefix}-standin-{os.getpid()}-{next(self._ids)}",
                "object": kind,
                "created": int(time.time()),
                "model": model,
                "choices": [choice],
                "usage": usage,
            },
        )


def _prompt_text(payload: dict[str, Any], *, chat: bool) -> str:
    if chat:
        messages = payload.get("messages")
        if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
            content = messages[-1].get("content")
            return content if isinstance(content, str) else json.dumps(content)
        return ""
    prompt = payload.get("prompt", "")
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt else ""
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def _openai_error(status: int, kind: str, message: str) -> Response:
    # vLLM's ErrorResponse shape.
    return _json(
        status,
        {"object": "error", "message": message, "type": kind, "param": None, "code": status},
    )


# ---------------------------------------------------------------------------------------------
# The draw-holding child (--draw-in-child).


class _DrawChild:
    """vLLM's memory sits in its engine-core child: gpud must attribute by cgroup, not PID.

    The child watches the read end of a pipe whose only write end the parent holds: when the
    parent dies, by any signal including SIGKILL, the kernel closes it and the child sees EOF,
    unregisters and exits. (No PR_SET_PDEATHSIG: it fires on the death of the forking *thread*
    and would need ctypes.)
    """

    def __init__(self, mib: int) -> None:
        import subprocess

        read_fd, self._write_fd = os.pipe()  # both close-on-exec; read_fd is passed explicitly
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gpud.testing.standin", DRAW_CHILD_TOKEN, str(mib), str(read_fd)],
                pass_fds=(read_fd,),
                stdin=subprocess.DEVNULL,
            )
        finally:
            os.close(read_fd)
        self.pid = self.proc.pid
        self.pidfd: int | None = os.pidfd_open(self.pid)
        self.reaped = False

    def reap(self) -> int:
        """Collect the exited child (its pidfd was readable); returns its status."""
        code = self.proc.wait()
        self.reaped = True
        self._close_pidfd()
        return code

    def stop(self) -> None:
        if self._write_fd >= 0:
            os.close(self._write_fd)  # EOF: the child unregisters and exits
            self._write_fd = -1
        if not self.reaped:
            import subprocess

            try:
                self.proc.wait(CHILD_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.reaped = True
        self._close_pidfd()

    def _close_pidfd(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def _draw_child_main(args: Sequence[str]) -> int:
    mib, watch_fd = int(args[0]), int(args[1])
    # Ctrl-C and hangups reach the whole process group: the parent decides, the child follows
    # through EOF on its pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_zero)
    target = sim_target_from_env(os.environ)
    pid = os.getpid()
    try:
        if target is not None:
            path = register(target, pid, mib)
            _log(f"draw child of pid {os.getppid()}: registered {mib} MiB at {path}")
        else:
            _log(f"draw child of pid {os.getppid()}: holding {mib} MiB (simulation env unset)")
        while os.read(watch_fd, 64):  # returns b"" once the parent is gone
            pass
        _log("draw child: parent gone, exiting")
    finally:
        if target is not None:
            unregister(target, pid)
    return 0


def _exit_zero(_signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(0)


# ---------------------------------------------------------------------------------------------
# The main process.


def _echo_payload(args: Sequence[str]) -> dict[str, Any]:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            raw = f.read()
        cmdline: list[str] | None = [os.fsdecode(a) for a in raw.split(b"\0")[:-1]]
    except OSError:
        cmdline = None
    return {
        "pid": os.getpid(),
        "argv": [sys.argv[0], *args],
        "cmdline": cmdline,
        "env": {name: os.environ.get(name) for name in ECHO_ENV},
    }


class _Signals:
    """Signals become a queue drained by the main loop, woken through set_wakeup_fd.

    The handler only appends: it never takes a lock (an ``Event.set`` from a handler can
    deadlock against the interrupted main thread) and never raises into cleanup code.
    """

    def __init__(self) -> None:
        self.pending: collections.deque[int] = collections.deque()
        self.read_fd, write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.pending.append(signum)

    def drain_wakeups(self) -> None:
        try:
            while os.read(self.read_fd, 512):
                pass
        except BlockingIOError:
            pass


def _bind(opts: Options, app: App) -> _Server:
    cls = _Server6 if ":" in opts.host else _Server
    return cls((opts.host, opts.port), app)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)
    if args[:1] == [DRAW_CHILD_TOKEN]:
        return _draw_child_main(args[1:])

    opts = parse_args(args)
    try:
        total_mib = sim_total_from_env(os.environ)
    except ValueError as exc:
        print(f"{PROGRAM}: bad {GPUD_SIM_TOTAL_MIB}: {exc}", file=sys.stderr)
        return 2
    draw_mib = compute_draw_mib(
        draw_mib=opts.draw_mib,
        utilization=opts.gpu_memory_utilization,
        total_mib=total_mib,
        overdraw_pct=opts.overdraw_pct,
    )
    target = sim_target_from_env(os.environ)
    _log(
        f"{PROGRAM} {VERSION}: a STAND-IN for a vLLM OpenAI server (no model, no GPU); "
        f"model={opts.model!r} served={list(opts.served_model_names)} "
        f"host={opts.host} port={opts.port} "
        f"gpu_memory_utilization={float(opts.gpu_memory_utilization)} "
        f"draw={draw_mib} MiB (total {total_mib} MiB, overdraw {float(opts.overdraw_pct)}%) "
        f"holder={'child' if opts.draw_in_child else 'self'} "
        f"registration={'off' if target is None else target.procs_dir}"
    )
    if opts.unknown_args:
        _log(f"ignoring unknown vLLM-style arguments: {json.dumps(list(opts.unknown_args))}")
    if target is None and (os.environ.get(GPUD_SIM_PROCS_DIR) or os.environ.get(GPUD_SIM_DEVICE)):
        _warn(f"set both {GPUD_SIM_PROCS_DIR} and {GPUD_SIM_DEVICE} to register the draw")
    echo = _echo_payload(args) if opts.echo_argv else None
    if echo is not None:
        _log(f"argv-echo {json.dumps(echo)}")
    if opts.crash_after_s == 0:
        print(f"{PROGRAM}: simulated crash at start, exit code {opts.exit_code}", file=sys.stderr)
        return opts.exit_code

    process = _MainProcess(opts, App(opts, draw_mib=draw_mib, echo=echo), target)
    try:
        server = _bind(opts, process.app)
    except OSError as exc:
        print(f"{PROGRAM}: cannot listen on {opts.host}:{opts.port}: {exc}", file=sys.stderr)
        return 1
    host, port = server.socket.getsockname()[:2]
    # serve_forever wakes every poll_interval only to look for a shutdown request; none comes
    # (the process exits under the daemon thread), so a long interval keeps idle CPU at zero.
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 3600.0}, daemon=True).start()
    url_host = f"[{host}]" if ":" in host else host
    _log(f"listening on http://{url_host}:{port} (stand-in)")
    try:
        return process.run()
    finally:
        process.cleanup()


class _MainProcess:
    """The main thread's schedule (draw, logged health transitions, crash) and its signals."""

    def __init__(self, opts: Options, app: App, target: SimTarget | None) -> None:
        self.opts = opts
        self.app = app
        self.target = target
        self.signals = _Signals()
        self.child: _DrawChild | None = None

    def run(self) -> int:
        opts = self.opts
        schedule: list[tuple[float, str]] = [(opts.draw_after_s, "draw")]
        if not opts.never_healthy:
            schedule.append((opts.startup_delay_s, "healthy"))
            if opts.unhealthy_after_s is not None:
                schedule.append((opts.unhealthy_after_s, "unhealthy"))
        if opts.crash_after_s is not None:
            schedule.append((opts.crash_after_s, "crash"))
        schedule.sort(key=lambda item: item[0])
        while True:
            while self.signals.pending:
                signum = self.signals.pending.popleft()
                if signum == signal.SIGTERM and opts.ignore_sigterm:
                    _warn("SIGTERM received and ignored (--ignore-sigterm)")
                    continue
                _log(f"{signal.Signals(signum).name} received: unregistering and exiting")
                return 0
            now = self.app.elapsed()
            while schedule and schedule[0][0] <= now:
                _, what = schedule.pop(0)
                if what == "draw":
                    self._start_draw()
                elif what == "healthy" and health_at(opts, now).status == 200:
                    _log("loading done: /health answers 200")
                elif what == "unhealthy":
                    _warn("turning unhealthy: /health answers 503 (--unhealthy-after)")
                elif what == "crash":
                    print(
                        f"{PROGRAM}: simulated crash after {opts.crash_after_s}s, exit code {opts.exit_code}",
                        file=sys.stderr,
                        flush=True,
                    )
                    return opts.exit_code
            fds = [self.signals.read_fd]
            child = self.child
            if child is not None and child.pidfd is not None:
                fds.append(child.pidfd)
            timeout = max(0.0, schedule[0][0] - self.app.elapsed()) if schedule else None
            ready, _, _ = select.select(fds, [], [], timeout)
            if self.signals.read_fd in ready:
                self.signals.drain_wakeups()
            if child is not None and child.pidfd is not None and child.pidfd in ready:
                status = child.reap()
                self._unregister_if_present(child.pid)
                self.app.draw_pid = None
                self.app.registration = None
                _warn(f"draw child {child.pid} exited (status {status}); its draw is gone")

    def _start_draw(self) -> None:
        app, target = self.app, self.target
        if self.opts.draw_in_child:
            self.child = _DrawChild(app.draw_mib)
            app.draw_pid = self.child.pid
            if target is not None:
                app.registration = os.path.join(target.procs_dir, f"{self.child.pid}.json")
            _log(f"draw of {app.draw_mib} MiB held by child pid {self.child.pid}")
            return
        app.draw_pid = os.getpid()
        if target is not None:
            app.registration = register(target, os.getpid(), app.draw_mib)
            _log(f"registered draw of {app.draw_mib} MiB on {target.device} at {app.registration}")
        else:
            _log(f"drawing {app.draw_mib} MiB (simulation env unset: not registered)")

    def cleanup(self) -> None:
        self._unregister_if_present(os.getpid())
        if self.child is not None:
            self.child.stop()
            # The child removes its own file; this covers a child that was killed.
            self._unregister_if_present(self.child.pid)
        self.app.registration = None

    def _unregister_if_present(self, pid: int) -> None:
        # Checked first so that a process that never registered exits without importing
        # gpud.simulation.
        target = self.target
        if target is not None and os.path.exists(os.path.join(target.procs_dir, f"{pid}.json")):
            unregister(target, pid)


if __name__ == "__main__":
    sys.exit(main())
