"""The stand-in serve: pure parts in-process, behaviour through real processes on real ports."""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from gpud.host import simulation
from gpud.testing import standin
from gpud.vllm.vllm_log import parse_memory_lines
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parent.parent
DEVICE = "GPU-sim-0"


# ---- helpers ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def gone(pid: int) -> bool:
    """Exited (a zombie counts: it holds no memory and its parent is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


class Standin:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.proc = proc
        self.port = port
        self.log = log

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def request(
        self, method: str, path: str, body: Any = None, conn: http.client.HTTPConnection | None = None
    ) -> tuple[int, http.client.HTTPResponse, bytes]:
        own = conn is None
        c = conn or http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            data = None if body is None else json.dumps(body).encode()
            headers = {} if data is None else {"Content-Type": "application/json"}
            c.request(method, path, body=data, headers=headers)
            resp = c.getresponse()
            payload = resp.read()
        finally:
            if own:
                c.close()
        return resp.status, resp, payload

    def get_json(self, path: str) -> Any:
        status, _, payload = self.request("GET", path)
        assert status == 200, (status, payload)
        return json.loads(payload)

    def health(self) -> tuple[int, str]:
        status, resp, payload = self.request("GET", "/health")
        assert payload == b""
        return status, resp.getheader("X-Gpud-Standin-State") or ""

    def listening(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"stand-in exited {self.proc.returncode}:\n{self.output()}")
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        except OSError:
            return False

    def wait_exit(self, timeout: float = 5.0) -> int:
        return self.proc.wait(timeout)


Start = Callable[..., Standin]


@pytest.fixture
def procs_dir(tmp_path: Path) -> Path:
    return tmp_path / "sim-procs"


@pytest.fixture
def start(tmp_path: Path, procs_dir: Path) -> Iterator[Start]:
    started: list[Standin] = []

    def _start(
        *args: str,
        port: int | None = None,
        sim: bool = False,
        total_mib: int | None = None,
        env: dict[str, str] | None = None,
        wait: bool = True,
    ) -> Standin:
        port = free_port() if port is None else port
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("GPUD_SIM_")}
        if sim:
            full_env |= simulation.standin_environment(procs_dir, DEVICE, total_mib or 0)
        elif total_mib is not None:
            full_env[standin.GPUD_SIM_TOTAL_MIB] = str(total_mib)
        full_env |= env or {}
        log = tmp_path / f"standin-{len(started)}.log"
        argv = [sys.executable, "-m", "gpud.testing.standin", *args]
        if "--port" not in args:
            argv += ["--port", str(port)]
        with log.open("wb") as out:
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=REPO, stdin=subprocess.DEVNULL
            )
        s = Standin(proc, port, log)
        started.append(s)
        if wait:
            wait_until(s.listening, what=f"stand-in on port {port}")
        return s

    yield _start
    for s in started:
        if s.proc.poll() is None:
            s.proc.kill()
        s.proc.wait(5)
    # Draw children exit on EOF of their parent's pipe: wait for them before tmp_path goes.
    leftover = list(registrations(procs_dir))
    wait_until(lambda: all(gone(pid) for pid in leftover), what=f"draw children {leftover}")


def registrations(procs_dir: Path) -> dict[int, dict[str, Any]]:
    if not procs_dir.exists():
        return {}
    out: dict[int, dict[str, Any]] = {}
    for path in procs_dir.glob("*.json"):
        with contextlib.suppress(FileNotFoundError):  # unregistered while listing
            out[int(path.stem)] = json.loads(path.read_text())
    return out


# ---- pure parts ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("draw_mib", "util", "total", "overdraw", "expected"),
    [
        (None, "0.4396", 32607, "0", 14334),  # gpud's util for 14336 of 32607: never above
        (None, "0.29", 100, "0", 29),  # 0.29 * 100 is 28.999999999999996 in binary floats
        (None, "0.5", 1000, "10", 550),
        (None, "0.9", 0, "0", 0),  # no total known: nothing drawn
        (100, "0.9", 32607, "50", 150),  # --draw-mib wins over util x total
        (1000, "0.9", 0, "12.5", 1125),
    ],
)
def test_compute_draw_mib(draw_mib: int | None, util: str, total: int, overdraw: str, expected: int) -> None:
    got = standin.compute_draw_mib(
        draw_mib=draw_mib, utilization=Fraction(util), total_mib=total, overdraw_pct=Fraction(overdraw)
    )
    assert got == expected


def test_health_once_listening() -> None:
    opts = standin.parse_args(["--startup-delay", "2", "--unhealthy-after", "5"])
    assert [standin.health_at(opts, t) for t in (2, 4.99, 5, 100)] == [
        standin.Health(200, "ready"),
        standin.Health(200, "ready"),
        standin.Health(503, "unhealthy"),
        standin.Health(503, "unhealthy"),
    ]
    assert standin.health_at(opts, 3, engine_dead=True) == standin.Health(503, "engine-dead")


def test_memory_plan_and_vllms_lines() -> None:
    opts = standin.parse_args(["--gpu-memory-utilization", "0.4396", "--context-mib", "400"])
    plan = standin.memory_plan(opts, 32607)
    assert plan.requested == 14334  # floor(0.4396 x 32607): never above the reservation
    assert (plan.weights, plan.activation, plan.cudagraph) == (8600, 286, 512)
    assert plan.kv_cache == 14334 - 8600 - 286 - 512
    assert plan.draw == 14334 + 400  # the context lies outside vLLM's budget
    assert plan.recommended_kv_bytes == (plan.kv_cache - 150) << 20
    lines = standin.memory_log_lines(plan, opts, 32607, 1.5)
    assert lines[:3] == [
        "Model loading took 8.4 GiB memory and 1.500000 seconds",
        "Estimated CUDA graph memory: 0.50 GiB total",
        "Available KV cache memory: 4.82 GiB",
    ]
    assert f"Replace gpu_memory_utilization config with `--kv-cache-memory={(4936 - 150) << 20}`" \
        in lines[3]
    exact = standin.parse_args(["--kv-cache-memory-bytes", str(2048 << 20), "--weights-mib", "1000"])
    plan = standin.memory_plan(exact, 32607)
    assert plan.kv_cache == 2048 and plan.recommended_kv_bytes is None
    assert plan.draw == 1000 + plan.activation + plan.cudagraph + 2048
    assert len(standin.memory_log_lines(plan, exact, 32607, 0)) == 3  # no recommendation


def test_parse_vllm_shaped_argv() -> None:
    opts = standin.parse_args(
        ["serve", "org/model", "--revision", "a" * 40, "--port", "30001", "--gpu-memory-utilization",
         "0.4396", "--max-model-len", "32768", "--quantization", "fp8", "--runner", "pooling",
         "--enforce-eager", "--tensor-parallel-size=1", "--kv-cache-memory-bytes", "1024"]
    )  # fmt: skip
    assert opts.model == "org/model"
    assert opts.served_model_names == ("org/model",)
    assert (opts.port, opts.max_model_len, opts.kv_cache_memory_bytes) == (30001, 32768, 1024)
    assert opts.gpu_memory_utilization == Fraction("0.4396")
    # --runner is honoured now (a pooling serve answers embeddings, score and rerank), so it is
    # no longer among the options accepted and ignored
    assert opts.runner == "pooling"
    assert opts.vllm_args == (
        "--revision", "a" * 40, "--quantization", "fp8",
        "--enforce-eager", "--tensor-parallel-size=1",
    )  # fmt: skip
    assert standin.parse_args([]).model == "standin"
    assert standin.parse_args([]).gpu_memory_utilization == Fraction("0.92")  # vLLM's default
    assert standin.parse_args(["--model", "m", "--served-model-name", "a", "b"]).served_model_names == (
        "a",
        "b",
    )


@pytest.mark.parametrize(("argv", "said"), [
    (["serve", "m", "--task", "embed"], "--task was removed (not an option of vLLM 0.33.0); use --runner pooling"),
    (["--swap-space", "4"], "--swap-space was removed"),
    # No abbreviations (vLLM's argparse would take this one; gpud's configs never do).
    (["--gpu", "0.5"], "--gpu is an abbreviation of --gpu-memory-utilization"),
    (["--whatever", "x"], "--whatever is not an option of vllm serve"),
    (["serve", "m", "stray"], "unexpected argument 'stray'"),
])
def test_options_vllm_does_not_know_exit_2(argv: list[str], said: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        standin.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error: unrecognized arguments:" in err and said in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--gpu-memory-utilization", "-0.1"],
        ["--gpu-memory-utilization", "1.5"],
        ["--gpu-memory-utilization", "nan"],
        ["--startup-delay", "-1"],
        ["--startup-delay", "inf"],
        ["--exit-code", "256"],
        ["--port", "70000"],
        ["--overdraw-pct", "-5"],
    ],
)
def test_bad_known_options_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        standin.parse_args(argv)
    assert exc.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_env_names_match_the_simulation() -> None:
    assert standin.GPUD_SIM_PROCS_DIR == simulation.GPUD_SIM_PROCS_DIR
    assert standin.GPUD_SIM_DEVICE == simulation.GPUD_SIM_DEVICE
    assert standin.GPUD_SIM_TOTAL_MIB == simulation.GPUD_SIM_TOTAL_MIB


def _parse(raw: bytes) -> tuple[standin.Request, bool] | None:
    return standin._read_request(io.BufferedReader(io.BytesIO(raw)))


def test_http_request_parsing() -> None:
    parsed = _parse(b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}")
    assert parsed is not None
    req, keep_alive = parsed
    assert (req.method, req.path, req.body, keep_alive) == ("POST", "/v1/completions", b"{}", True)
    assert req.headers["host"] == "a"
    closing = _parse(b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert closing is not None and closing[1] is False
    http10 = _parse(b"GET /health HTTP/1.0\r\n\r\n")
    assert http10 is not None and http10[1] is False
    assert _parse(b"") is None
    for raw, status in [
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET / SPDY/3\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nno colon\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", 501),
    ]:
        with pytest.raises(standin._BadRequest) as exc:
            _parse(raw)
        assert exc.value.status == status, raw
    # No limit on a body's size, as vLLM has none (its h11 bounds the header block only): an
    # OCR page in base64, 3 MiB here, is read whole.
    page = b"x" * (3 << 20)
    large = _parse(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s"
                   % (len(page), page))
    assert large is not None and large[0].body == page


# ---- real processes --------------------------------------------------------------------------


def engine_pid(s: Standin) -> int:
    wait_until(lambda: s.get_json("/standin/state")["draw_pid"] is not None, what="engine child")
    pid: int = s.get_json("/standin/state")["draw_pid"]
    return pid


def test_refused_while_loading_then_ready_then_unhealthy(start: Start, procs_dir: Path) -> None:
    s = start("--startup-delay", "0.8", "--unhealthy-after", "1.6", "--draw-mib", "500", sim=True,
              wait=False)
    # Loading: the port is bound but nobody listens (vLLM never answers 503 while loading),
    # and the engine already holds its memory.
    wait_until(lambda: len(registrations(procs_dir)) == 1, what="the engine's draw")
    assert not s.listening()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", s.port), timeout=1).close()
    wait_until(s.listening, what="listening after the load")
    seen: list[tuple[int, str]] = []
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline:
        h = s.health()
        if not seen or seen[-1] != h:
            seen.append(h)
        if h[1] == "unhealthy":
            break
        time.sleep(0.02)
    assert seen == [(200, "ready"), (503, "unhealthy")]
    assert s.proc.poll() is None  # unhealthy, yet alive
    out = s.output()
    assert "STAND-IN" in out.splitlines()[0]
    # vLLM's memory lines come before the server starts.
    assert out.index("Available KV cache memory:") < out.index("Starting vLLM server on")


def test_the_engine_child_holds_the_draw_and_is_titled_like_vllms(start: Start, procs_dir: Path) -> None:
    s = start("--draw-mib", "1000", sim=True)
    child = engine_pid(s)
    assert child != s.pid
    reg = registrations(procs_dir)[child]
    assert (reg["pid"], reg["device"], reg["mib"]) == (child, DEVICE, 1000)
    with open(f"/proc/{child}/status") as f:
        assert f"PPid:\t{s.pid}\n" in f.read()
    with open(f"/proc/{child}/cmdline", "rb") as f:
        assert f.read().split(b"\0")[0] == b"VLLM::EngineCore"
    with open(f"/proc/{child}/comm") as f:
        assert f.read().strip() == "VLLM::EngineCor"  # the kernel keeps 15 bytes
    assert s.pid not in registrations(procs_dir)


def test_engine_death_is_503_then_exit(start: Start, procs_dir: Path) -> None:
    s = start("--exit-after-engine-death", "0.6", "--draw-mib", "10", sim=True)
    child = engine_pid(s)
    os.kill(child, signal.SIGKILL)
    wait_until(lambda: s.health() == (503, "engine-dead"), what="503 after the engine died")
    died = time.monotonic()
    assert s.wait_exit(5) == 0  # vLLM's server exits cleanly after its engine died
    assert 0.3 < time.monotonic() - died < 3
    assert registrations(procs_dir) == {}
    assert "died" in s.output() and "the API server exits" in s.output()


def test_engine_dies_after(start: Start) -> None:
    s = start("--engine-dies-after", "0.5", "--exit-after-engine-death", "0.3")
    assert s.health() == (200, "ready")
    assert s.wait_exit(5) == 0
    assert "simulated engine death" in s.output()


def test_engine_death_during_load_never_listens(start: Start) -> None:
    s = start("--startup-delay", "5", "--engine-dies-after", "0.3", wait=False)
    assert s.wait_exit(5) == 1
    assert "engine core initialization failed" in s.output()
    assert "Starting vLLM server" not in s.output()


def test_models_shape_headers_and_echo(start: Start) -> None:
    s = start("serve", "org/model", "--served-model-name", "a", "b", "--max-model-len", "1234")
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=5)
    try:  # one keep-alive connection throughout
        status, resp, payload = s.request("GET", "/v1/models", conn=conn)
        assert status == 200
        assert resp.getheader("X-Gpud-Standin") == "1"
        assert (resp.getheader("Server") or "").startswith("gpud-standin/")
        models = json.loads(payload)
        assert models["object"] == "list"
        assert [m["id"] for m in models["data"]] == ["a", "b"]
        for card in models["data"]:
            assert card["object"] == "model"
            assert card["owned_by"] == "gpud-standin"
            assert card["root"] == "org/model"
            assert card["max_model_len"] == 1234
            assert isinstance(card["created"], int)
        status, _, payload = s.request("POST", "/v1/completions", {"model": "b", "prompt": "hi"}, conn=conn)
        assert status == 200
        body = json.loads(payload)
        assert body["object"] == "text_completion" and body["model"] == "b"
        assert body["choices"][0]["text"].endswith("hi")
        chat = {"model": "a", "messages": [{"role": "user", "content": "hello"}]}
        status, _, payload = s.request("POST", "/v1/chat/completions", chat, conn=conn)
        assert status == 200
        assert json.loads(payload)["choices"][0]["message"]["content"].endswith("hello")
        status, _, payload = s.request("POST", "/v1/completions", {"model": "zz", "prompt": ""}, conn=conn)
        # vLLM's ErrorResponse: {"error": {...}} (serve/engine/protocol.py:79-87 of vllm 0.32)
        assert status == 404 and json.loads(payload)["error"]["type"] == "NotFoundError"
        assert s.request("GET", "/nope", conn=conn)[0] == 404
        assert s.request("POST", "/health", conn=conn)[0] == 405
        assert s.request("GET", "/standin/argv", conn=conn)[0] == 404  # only with --echo-argv
        assert s.request("POST", "/sleep", conn=conn)[0] == 404  # only with VLLM_SERVER_DEV_MODE
    finally:
        conn.close()


def test_sleep_endpoints_in_dev_mode(start: Start, procs_dir: Path) -> None:
    s = start("--enable-sleep-mode", "--draw-mib", "900", "--context-mib", "300", sim=True,
              env={"VLLM_SERVER_DEV_MODE": "1"})
    child = engine_pid(s)
    wait_until(lambda: registrations(procs_dir).get(child, {}).get("mib") == 900, what="draw")
    assert s.get_json("/is_sleeping") == {"is_sleeping": False}
    status, _, payload = s.request("POST", "/sleep?level=1")
    assert (status, json.loads(payload)) == (200, {"status": "sleeping", "level": 1})
    wait_until(lambda: registrations(procs_dir)[child]["mib"] == 300, what="asleep: the context only")
    assert s.get_json("/is_sleeping") == {"is_sleeping": True}
    assert s.health() == (200, "ready")
    status, _, payload = s.request("POST", "/wake_up")
    assert (status, json.loads(payload)) == (200, {"status": "awake", "tags": None})
    wait_until(lambda: registrations(procs_dir)[child]["mib"] == 900, what="awake: the draw back")
    assert s.request("POST", "/sleep?level=3")[0] == 422
    off = start("--draw-mib", "10", env={"VLLM_SERVER_DEV_MODE": "1"})
    assert off.request("POST", "/sleep?level=1")[0] == 500  # no --enable-sleep-mode


def test_level_two_loses_the_weights_until_reloaded(start: Start) -> None:
    s = start("--enable-sleep-mode", env={"VLLM_SERVER_DEV_MODE": "1"})

    def weights() -> str:
        return str(s.get_json("/standin/state")["weights"])

    def completion() -> str:
        status, _, payload = s.request("POST", "/v1/completions", {"prompt": "hi"})
        assert status == 200
        return str(json.loads(payload)["choices"][0]["text"])

    # a bare wake after level 2: awake, "healthy", answering from uninitialised weights
    assert s.request("POST", "/sleep?level=2&mode=abort")[0] == 200
    assert weights() == "discarded"
    assert s.request("POST", "/wake_up")[0] == 200
    assert s.get_json("/is_sleeping") == {"is_sleeping": False}
    assert weights() == "uninitialised" and "garbage" in completion()
    # vLLM's restore: weights' memory, reload in place, then the KV cache
    assert s.request("POST", "/sleep?level=2")[0] == 200
    status, _, payload = s.request("POST", "/wake_up?tags=weights")
    assert (status, json.loads(payload)) == (200, {"status": "sleeping", "tags": ["weights"]})
    assert s.get_json("/is_sleeping") == {"is_sleeping": True}
    status, _, payload = s.request("POST", "/collective_rpc", {"method": "reload_weights"})
    assert (status, json.loads(payload)) == (200, {"results": [None]})
    status, _, payload = s.request("POST", "/wake_up?tags=kv_cache")
    assert (status, json.loads(payload)) == (200, {"status": "awake", "tags": ["kv_cache"]})
    assert weights() == "loaded" and "garbage" not in completion()
    # level 1 keeps them (parked in host RAM); a reload while they sleep is refused
    assert s.request("POST", "/sleep?level=1")[0] == 200
    assert s.request("POST", "/collective_rpc", {"method": "reload_weights"})[0] == 500
    assert s.request("POST", "/wake_up")[0] == 200 and weights() == "loaded"
    assert s.request("POST", "/sleep?level=1&mode=later")[0] == 422
    assert s.request("POST", "/collective_rpc", {"nomethod": 1})[0] == 400


def test_asleep_mib_is_the_draw_asleep(start: Start, procs_dir: Path) -> None:
    s = start("--enable-sleep-mode", "--draw-mib", "900", "--context-mib", "300",
              "--asleep-mib", "450", sim=True, env={"VLLM_SERVER_DEV_MODE": "1"})
    child = engine_pid(s)
    wait_until(lambda: registrations(procs_dir).get(child, {}).get("mib") == 900, what="draw")
    assert s.request("POST", "/sleep?level=2")[0] == 200
    wait_until(lambda: registrations(procs_dir)[child]["mib"] == 450, what="asleep: --asleep-mib")
    assert s.request("POST", "/wake_up")[0] == 200
    wait_until(lambda: registrations(procs_dir)[child]["mib"] == 900, what="awake again")


def test_crash_after_exits_with_the_code(start: Start, procs_dir: Path) -> None:
    # long enough that the health answer comes before the crash on a loaded host (0.4 s lost
    # the race once with other test suites beside it)
    s = start("--crash-after", "2", "--exit-code", "7", "--draw-mib", "100", sim=True)
    assert s.health()[0] == 200
    wait_until(lambda: len(registrations(procs_dir)) == 1, what="registration")
    assert s.wait_exit() == 7
    wait_until(lambda: registrations(procs_dir) == {}, what="the engine's unregistration")
    assert "simulated crash" in s.output()


def test_crash_at_once(start: Start) -> None:
    s = start("--crash-after", "0", "--exit-code", "3", wait=False)
    assert s.wait_exit() == 3
    assert "Starting vLLM server" not in s.output()


def test_zero_utilization_is_refused_like_vllm(start: Start) -> None:
    s = start("--gpu-memory-utilization", "0.0000", wait=False)
    assert s.wait_exit() == 1
    assert "Input should be greater than 0" in s.output()


def test_never_healthy_never_listens(start: Start, procs_dir: Path) -> None:
    # The draw comes 0.2 s in, after the load would have ended (--startup-delay 0): by then a
    # stand-in that became healthy listens.
    s = start("--never-healthy", "--draw-mib", "10", "--draw-after-s", "0.2", sim=True,
              wait=False)
    wait_until(lambda: len(registrations(procs_dir)) == 1, what="the draw during the load")
    assert not s.listening()
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait_exit() == 0
    assert "Starting vLLM server" not in s.output()


def test_registration_appears_and_goes_on_sigterm(start: Start, procs_dir: Path) -> None:
    s = start("--gpu-memory-utilization", "0.4396", sim=True, total_mib=32607)
    child = engine_pid(s)
    reg = registrations(procs_dir)[child]
    assert (reg["pid"], reg["device"], reg["mib"]) == (child, DEVICE, 14334)
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait_exit() == 0
    assert gone(child)
    assert list(procs_dir.iterdir()) == [], list(procs_dir.rglob("*"))  # no file, no temporary left behind


def test_context_and_overdraw(start: Start, procs_dir: Path) -> None:
    s = start("--gpu-memory-utilization", "0.5", "--context-mib", "100", "--overdraw-pct", "10",
              sim=True, total_mib=1000)
    child = engine_pid(s)
    assert registrations(procs_dir)[child]["mib"] == 660  # (500 + 100) x 1.1


def test_draw_after(start: Start, procs_dir: Path) -> None:
    began = time.time()
    s = start("--draw-mib", "64", "--draw-after-s", "0.6", "--startup-delay", "0.8", sim=True,
              wait=False)
    wait_until(lambda: len(registrations(procs_dir)) == 1, what="late registration")
    (registration,) = procs_dir.glob("*.json")
    # Written 0.6 s after the engine began (the clock's resolution aside), whenever it is seen.
    assert registration.stat().st_mtime - began >= 0.6 - 0.01
    wait_until(s.listening, what="listening")


def test_the_engine_dies_with_the_parent(start: Start, procs_dir: Path) -> None:
    s = start("--draw-mib", "1000", sim=True)
    child = engine_pid(s)
    s.proc.send_signal(signal.SIGKILL)
    s.wait_exit()
    wait_until(lambda: gone(child), what="the child's death")
    wait_until(lambda: registrations(procs_dir) == {}, what="the child's unregistration")


def test_known_vllm_options_are_accepted(start: Start) -> None:
    s = start(
        "serve", "org/model", "--revision", "r1", "--gpu-memory-utilization", "0.5",
        "--max-model-len", "2048", "--quantization", "fp8", "--runner", "pooling", "--enforce-eager",
    )  # fmt: skip
    card = s.get_json("/v1/models")["data"][0]
    assert (card["id"], card["max_model_len"]) == ("org/model", 2048)
    assert 'vLLM options accepted and ignored: ["--revision", "r1", "--quantization"' in s.output()


def test_unknown_vllm_option_exits_2(start: Start) -> None:
    s = start("serve", "BAAI/bge-m3", "--task", "embed", wait=False)
    assert s.wait_exit() == 2
    assert "--task was removed" in s.output()


def test_echo_argv_round_trips_hostile_strings(start: Start) -> None:
    hostile = [
        "$HOME", "${HOME}", "a;b", "%n", "%%", "with space", "\"double\" 'single'", "back\\slash",
        "`id`", "$(id)", "ünï\u00e7ødé", "tab\there", "new\nline", "--x=$HOME;%n",
    ]  # fmt: skip
    port = free_port()
    args = ["--echo-argv", "--port", str(port), "--note", *hostile]
    env = {"HOME": "/home/it's here", "CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    s = start(*args, port=port, env=env)
    served = s.get_json("/standin/argv")
    assert served["pid"] == s.pid
    assert served["argv"][1:] == args
    assert served["cmdline"][-len(hostile):] == hostile
    assert served["env"] == env
    (line,) = [ln for ln in s.output().splitlines() if " argv-echo " in ln]
    assert json.loads(line.split(" argv-echo ", 1)[1]) == served


def test_ignore_sigterm_then_sigint(start: Start) -> None:
    s = start("--ignore-sigterm")
    s.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: "SIGTERM received and ignored" in s.output(), what="the SIGTERM ignored")
    assert s.proc.poll() is None
    assert s.health()[0] == 200
    s.proc.send_signal(signal.SIGINT)
    assert s.wait_exit() == 0


def test_port_in_use_exits_1(start: Start) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        s = start(port=taken.getsockname()[1], wait=False)
        assert s.wait_exit() == 1
    assert "cannot listen" in s.output()


def test_profile_overlaps() -> None:
    mine = {"devices": ["d0"], "start": 10.0, "end": 20.0}
    assert standin.profile_overlaps(mine, {"devices": ["d0"], "start": 15.0, "end": 30.0},
                                    alive=False)
    assert standin.profile_overlaps(mine, {"devices": ["d1", "d0"], "start": 1.0, "end": None},
                                    alive=True)  # still loading
    assert not standin.profile_overlaps(mine, {"devices": ["d0"], "start": 1.0, "end": None},
                                        alive=False)  # killed while loading: gone
    assert not standin.profile_overlaps(mine, {"devices": ["d0"], "start": 1.0, "end": 9.0},
                                        alive=True)  # done before
    assert not standin.profile_overlaps(mine, {"devices": ["d1"], "start": 15.0, "end": 16.0},
                                        alive=True)  # another device


def test_util_sized_engines_loading_together_mis_size_byte_sized_ones_do_not(
        start: Start, procs_dir: Path) -> None:
    """vLLM #55827: two engines profiling at once on one GPU count each other's loading as
    their own; sized by --kv-cache-memory-bytes they skip the profiling."""
    util = ("--gpu-memory-utilization", "0.3", "--startup-delay", "1.0")
    a = start(*util, sim=True, total_mib=10000, wait=False)
    b = start(*util, sim=True, total_mib=10000, wait=False)
    assert a.wait_exit(10) == 1 and b.wait_exit(10) == 1
    for s in (a, b):
        assert "ValueError: No available memory for the cache blocks." in s.output()
        assert "Available KV cache memory: -" in s.output()
        assert "Starting vLLM server" not in s.output()
    exact = (*util, "--kv-cache-memory-bytes", str(512 * 1024 * 1024))
    c = start(*exact, sim=True, total_mib=10000, wait=False)
    d = start(*exact, sim=True, total_mib=10000, wait=False)
    wait_until(c.listening, 10, what="c")
    wait_until(d.listening, 10, what="d")
    # One alone, after them, loads fine.
    e = start(*util, sim=True, total_mib=10000, wait=False)
    wait_until(e.listening, 10, what="e")
    assert "No available memory" not in e.output()


# ---- vLLM 0.34.0 --------------------------------------------------------------------------


def test_0_34_s_start_lines_with_and_without_the_extensible_kv_cache() -> None:
    ext = standin.parse_args(["--vllm-version", "0.34.0", "--gpu-memory-utilization", "0.4396"])
    assert ext.vllm_version == "0.34.0" and ext.extensible_kv_cache
    plan = standin.memory_plan(ext, 32607)
    lines = standin.memory_log_lines(plan, ext, 32607, 1.5)
    assert not any("Estimated CUDA graph memory" in line for line in lines)  # V1 runner gone
    assert lines[:3] == ["Model loading took 8.4 GiB memory and 1.500000 seconds",
                         "Available KV cache memory: 4.82 GiB",
                         "Graph capturing finished in 2 secs, took 0.50 GiB"]
    assert lines[3].startswith("Memory after warmup: ")
    assert lines[4] == f"Extended KV cache to {plan.kv_cache * 4} blocks (4.82 GiB)."
    parsed = parse_memory_lines(lines)
    assert parsed.kv_extended and parsed.kv_cache_mib == 4936 and parsed.cudagraph_mib == 512
    # gpud's 0.34 argv turns it off: the profiled figure and the recommendation, as on 0.33
    off = standin.parse_args(["--vllm-version", "0.34.0", "--gpu-memory-utilization", "0.4396",
                              "--no-enable-extensible-kv-cache"])
    assert not off.extensible_kv_cache
    lines = standin.memory_log_lines(standin.memory_plan(off, 32607), off, 32607, 1.5)
    assert len(lines) == 4 and "--kv-cache-memory=" in lines[3]
    assert not parse_memory_lines(lines).kv_extended
    # 0.33 knows no such flag, and stays the default
    assert standin.parse_args([]).vllm_version == "0.33.0"
    with pytest.raises(SystemExit):
        standin.parse_args(["--no-enable-extensible-kv-cache"])
    assert standin.parse_args([]).extensible_kv_cache is False


def test_0_34_checkpoint_routes_and_a_prepared_engine(start: Start, procs_dir: Path) -> None:
    s = start("--vllm-version", "0.34.0", "--enable-sleep-mode", "--gpu-memory-utilization",
              "0.5", "--context-mib", "300", sim=True, total_mib=10000,
              env={"VLLM_SERVER_DEV_MODE": "1"})
    child = engine_pid(s)
    plan = standin.memory_plan(standin.parse_args(
        ["--vllm-version", "0.34.0", "--gpu-memory-utilization", "0.5", "--context-mib", "300"]),
        10000)
    wait_until(lambda: registrations(procs_dir).get(child, {}).get("mib") == plan.draw,
               what="draw")
    status, _, payload = s.request("GET", "/checkpoint/status")
    assert (status, json.loads(payload)) == (503, {"state": "running"})
    status, _, payload = s.request("POST", "/checkpoint/prepare")
    assert (status, json.loads(payload)) == (200, {"state": "prepared"})
    # prepared: "sleeping" to /is_sleeping, but not asleep: the KV cache alone is released
    assert s.get_json("/is_sleeping") == {"is_sleeping": True}
    wait_until(lambda: registrations(procs_dir)[child]["mib"] == plan.draw - plan.kv_cache,
               what="the KV cache released")
    assert s.request("GET", "/checkpoint/status")[0] == 200
    for path in ("/sleep?level=1", "/wake_up"):
        status, _, payload = s.request("POST", path)
        assert status == 500 and b"checkpoint state is prepared" in payload
    status, _, payload = s.request("POST", "/checkpoint/restore")
    assert (status, json.loads(payload)) == (200, {"state": "running"})
    assert s.get_json("/is_sleeping") == {"is_sleeping": False}
    wait_until(lambda: registrations(procs_dir)[child]["mib"] == plan.draw, what="restored")
    # a sleeping engine cannot be prepared; level 2 parks the graph pool, as 0.34 logs
    assert s.request("POST", "/sleep?level=2")[0] == 200
    assert s.request("POST", "/checkpoint/prepare")[0] == 400
    wait_until(lambda: "is backed up in CPU" in s.output(), what="the sleep's account")
    parked = parse_memory_lines(s.output().splitlines()).sleep_parked_host_mib
    assert parked is not None and abs(parked - plan.cudagraph) <= 10  # 2 decimals of GiB
    # 0.33 has no such routes; 0.34 has them only with sleep mode, dev mode or not
    assert start("--enable-sleep-mode").request("GET", "/checkpoint/status")[0] == 404
    assert start("--vllm-version", "0.34.0").request("GET", "/checkpoint/status")[0] == 404
    assert start("--vllm-version", "0.34.0", "--enable-sleep-mode").request(
        "GET", "/checkpoint/status")[0] == 503


# ---- requests in flight across a sleep (vLLM's pause_scheduler; see the stand-in's docstring)


def _stream_in_thread(s: Standin, tokens: int) -> tuple[threading.Thread, list[bytes]]:
    """A streamed completion read whole in a thread: the chunks' `data:` lines land in the list."""
    got: list[bytes] = []

    def read() -> None:
        c = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
        try:
            c.request("POST", "/v1/completions", body=json.dumps(
                {"prompt": "a b", "max_tokens": tokens, "stream": True}),
                headers={"Content-Type": "application/json"})
            resp = c.getresponse()
            got.extend(line for line in resp.read().splitlines() if line.startswith(b"data: "))
        finally:
            c.close()

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return t, got


def _in_flight(s: Standin) -> tuple[int, int]:
    _, _, text = s.request("GET", "/metrics")
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1])
              for line in text.decode().splitlines() if line and not line.startswith("#")}
    return int(values["vllm:num_requests_running"]), int(values["vllm:num_requests_waiting"])


def test_metrics_count_the_requests_in_flight(start: Start) -> None:
    s = start("--token-interval-s", "0.05")
    assert _in_flight(s) == (0, 0)
    t, got = _stream_in_thread(s, 40)  # 2 s
    wait_until(lambda: _in_flight(s) == (1, 0), timeout=5, what="one running")
    t.join(10)
    assert got[-1] == b"data: [DONE]" and len(got) == 41
    # counted out once its last byte is sent, which the client may read first
    wait_until(lambda: _in_flight(s) == (0, 0), timeout=5, what="none running")
    _, resp, _ = s.request("GET", "/metrics")
    assert resp.getheader("Content-Type", "").startswith("text/plain; version=0.0.4")


def test_sleep_mode_abort_ends_the_streams_in_flight(start: Start) -> None:
    s = start("--enable-sleep-mode", "--token-interval-s", "0.1",
              env={"VLLM_SERVER_DEV_MODE": "1"})
    t, got = _stream_in_thread(s, 100)  # 10 s
    wait_until(lambda: len(got) or _in_flight(s)[0] == 1, timeout=5, what="stream running")
    began = time.monotonic()
    assert s.request("POST", "/sleep?level=1&mode=abort")[0] == 200
    assert time.monotonic() - began < 3  # answered once the abort is sent, not at the end
    t.join(5)
    assert not t.is_alive()
    assert got[-1] == b"data: [DONE]", got
    last = json.loads(got[-2][len(b"data: "):])
    assert last["choices"][0]["finish_reason"] == "abort"
    assert len(got) < 50  # cut short
    assert _in_flight(s) == (0, 0)


def test_sleep_mode_wait_drains_the_streams_first(start: Start) -> None:
    s = start("--enable-sleep-mode", "--token-interval-s", "0.05",
              env={"VLLM_SERVER_DEV_MODE": "1"})
    t, got = _stream_in_thread(s, 30)  # 1.5 s
    wait_until(lambda: _in_flight(s)[0] == 1, timeout=5, what="stream running")
    status, _, _ = s.request("POST", "/sleep?level=1&mode=wait")
    assert status == 200
    # answered once the stream was done (nothing runs), all of it sent, none aborted: the
    # client may still be reading its last lines when the answer comes
    assert _in_flight(s) == (0, 0)
    t.join(5)
    assert not t.is_alive() and len(got) == 31 and got[-1] == b"data: [DONE]", got
    last = json.loads(got[-2][len(b"data: "):])
    assert last["choices"][0]["finish_reason"] != "abort", last
    assert s.get_json("/is_sleeping") == {"is_sleeping": True}


def test_a_request_to_a_sleeping_engine_is_held_until_the_wake(start: Start) -> None:
    s = start("--enable-sleep-mode", env={"VLLM_SERVER_DEV_MODE": "1"})
    assert s.request("POST", "/sleep?level=1")[0] == 200
    t, got = _stream_in_thread(s, 3)
    wait_until(lambda: _in_flight(s) == (0, 1), timeout=5, what="held as waiting")
    time.sleep(0.3)
    assert t.is_alive() and not got  # held, not answered
    assert s.request("POST", "/wake_up")[0] == 200
    t.join(5)
    assert got[-1] == b"data: [DONE]" and len(got) == 4, got
    assert _in_flight(s) == (0, 0)


@pytest.mark.parametrize(("policy", "first"), [("fcfs", 5), ("priority", -5)])
def test_the_engine_runs_max_num_seqs_and_lets_the_rest_in_by_its_policy(
        policy: str, first: int) -> None:
    # vLLM's scheduler: at most max_num_seqs running; the waiting queue FCFS (the priority
    # field ignored) or by priority, lower first (vllm/v1/core/sched/request_queue.py)
    engine = standin._Engine(max_num_seqs=1, policy=policy)
    engine.admit()
    order: list[int] = []

    def ask(priority: int) -> None:
        engine.admit(priority)
        order.append(priority)
        engine.end()

    threads = [threading.Thread(target=ask, args=(priority,)) for priority in (5, -5)]
    for waiting, thread in enumerate(threads, 1):  # 5 arrives first
        thread.start()
        wait_until(lambda: engine.counts() == (1, waiting), what="waiting")  # noqa: B023
    engine.end()
    for thread in threads:
        thread.join(10)
    assert order == [first, -first]
    assert engine.counts() == (0, 0)


def test_force_include_usage_puts_usage_in_every_chunk_of_every_stream(start: Start) -> None:
    # vLLM's --enable-force-include-usage (serve/utils/api_utils.py:289 should_include_usage:
    # usage and continuous usage, whatever the request's stream_options)
    s = start("--enable-force-include-usage")
    status, _, payload = s.request("POST", "/v1/completions",
                                   {"prompt": "a b", "max_tokens": 3, "stream": True})
    assert status == 200
    chunks = [json.loads(line[6:]) for line in payload.decode().splitlines()
              if line.startswith("data: {")]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3, 3]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": 3, "total_tokens": 6, "completion_tokens": 3,
        "prompt_tokens_details": None}
