"""One contract, two implementations: what gpud relies on in a vLLM serve, checked against real
vLLM (the CPU build, tiny model) and against the stand-in (gpud/testing/standin.py) with the same
tests. A difference is a bug in the stand-in.

Each implementation runs two servers, started together: one answers the checks and is then
stopped with SIGTERM, the other has its engine killed.

What real vLLM on CPU cannot show stays with the stand-in alone (tests/test_standin.py and the
sandbox tests), each following vLLM's source (vllm 0.32.0 as installed by scripts/setup-vllm,
paths under vllm/):

- what a sleep does to requests in flight (`mode=abort` ends them, `mode=wait` drains them, a
  request to a sleeping engine is held: v1/engine/core.py:2061-2103 pause_scheduler, :997-1019
  wake_up resumes; the stand-in's docstring cites each) and the counts meanwhile;
- sleep mode: `POST /sleep?level=0|1|2&mode=abort` (entrypoints/serve/dev/sleep/api_router.py:25,
  `level: Query(ge=0, le=2) = 1`, `mode = "abort"`), `POST /wake_up[?tags=...]` answering
  `{"status": "awake" | "sleeping", "tags": ...}` (same file, :44), `GET /is_sleeping`, and
  `POST /collective_rpc` `{"method": ...}` (entrypoints/serve/dev/rpc/api_router.py:23), all only
  with VLLM_SERVER_DEV_MODE=1; the CPU platform has no sleep mode
  (platforms/interface.py:231 is_sleep_mode_available, checked at config/model.py:656);
- level 2 drops the weights: waking takes `wake_up?tags=weights`, `collective_rpc
  reload_weights`, `wake_up?tags=kv_cache` (docs/features/sleep_mode.md, "Online Serving");
- GPU memory and its start-up lines: `Model loading took X GiB memory`
  (v1/worker/gpu_model_runner.py:5150), `Available KV cache memory: Y GiB`
  (v1/worker/gpu_worker.py:760), `Estimated CUDA graph memory` (gpu_model_runner.py:6475, the V1
  runner only), `Graph capturing finished in S secs, took X GiB` (gpu_model_runner.py:6582 and
  v1/worker/gpu/model_runner.py:1128, both runners); the draw held by the worker process;
- the start check `free >= util x total` on the device.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpud.core.traffic import in_flight_from_metrics
from tests.vllm.servers import (
    MODEL,
    REAL,
    STANDIN,
    Implementation,
    Server,
    alive,
    get,
    outcome,
    title,
    wait_ready,
)

pytestmark = pytest.mark.usefixtures("real_vllm")


class Pair:
    def __init__(self, main: Server, doomed: Server) -> None:
        self.main, self.doomed = main, doomed


@pytest.fixture(scope="module", params=[REAL, STANDIN], ids=lambda impl: impl.name)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
         real_vllm: None) -> Iterator[Pair]:
    impl: Implementation = request.param
    folder: Path = tmp_path_factory.mktemp(impl.name)
    servers = [Server.launch(impl, folder / f"{n}.log") for n in ("main", "doomed")]
    try:
        wait_ready(*servers)
        yield Pair(*servers)
    finally:
        for server in servers:
            server.end()


def test_not_listening_until_loaded(pair: Pair) -> None:
    # While loading, a connection is refused: no HTTP answer at all, never a 503.
    for server in (pair.main, pair.doomed):
        assert server.seen[-1] == "200"
        assert set(server.seen[:-1]) == {"refused"}, server.seen


def test_health_is_200_with_an_empty_body(pair: Pair) -> None:
    assert get(pair.main.port, "/health") == (200, b"")


def test_models_lists_the_model(pair: Pair) -> None:
    status, body = get(pair.main.port, "/v1/models")
    assert status == 200
    models = json.loads(body)
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [str(MODEL)]
    assert models["data"][0]["max_model_len"] == 512


def test_completions_answer(pair: Pair) -> None:
    status, body = get(pair.main.port, "/v1/completions", method="POST", body=json.dumps(
        {"model": str(MODEL), "prompt": "hello", "max_tokens": 3}).encode())
    assert status == 200, body
    answer = json.loads(body)
    assert answer["object"] == "text_completion"
    assert isinstance(answer["choices"][0]["text"], str)


def test_metrics_count_requests_in_flight_back_to_zero(pair: Pair) -> None:
    # gpud's count of a serve's requests in flight (gpud/core/traffic.py): vLLM's
    # vllm:num_requests_running + vllm:num_requests_waiting (v1/metrics/loggers.py:527-545),
    # zero at rest and zero again once a request is done (a count stuck above zero would keep
    # an on-demand serve from ever idling). The counts during a sleep (requests held, a drain)
    # need sleep mode: the stand-in's alone (tests/test_standin.py).
    status, text = get(pair.main.port, "/metrics")
    assert status == 200
    assert "vllm:num_requests_running" in text.decode()
    assert in_flight_from_metrics(text.decode()) == 0
    status, body = get(pair.main.port, "/v1/completions", method="POST", body=json.dumps(
        {"model": str(MODEL), "prompt": "hello", "max_tokens": 8, "stream": True}).encode())
    assert status == 200, body
    deadline = time.monotonic() + 10
    while (count := in_flight_from_metrics(get(pair.main.port, "/metrics")[1].decode())) != 0 \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert count == 0


def test_the_engine_is_a_child_titled_engine_core(pair: Pair) -> None:
    # setproctitle sets argv and the kernel's comm (15 bytes of it)
    assert title(pair.main.engine()) == ("VLLM::EngineCore", "VLLM::EngineCor")


def test_engine_death_is_503_then_exit_0(pair: Pair) -> None:
    server = pair.doomed
    os.kill(server.engine(), signal.SIGKILL)
    killed = time.monotonic()
    seen: list[str] = []
    while server.proc.poll() is None and time.monotonic() - killed < 30:
        now = outcome(server.port)
        if not seen or seen[-1] != now:
            seen.append(now)
        time.sleep(0.1)
    took = time.monotonic() - killed
    # vLLM's watchdog looks every 5 s (entrypoints/launchers/launcher.py watchdog_loop), then
    # its server shuts down cleanly: status 0, which Restart=on-failure does not restart.
    assert server.proc.wait(1) == 0, server.output()[-3000:]
    assert took < 15
    assert "503" in seen, seen
    assert "200" not in seen[seen.index("503"):], seen


def test_sigterm_is_a_graceful_exit(pair: Pair) -> None:
    server = pair.main
    engine = server.engine()
    os.kill(server.proc.pid, signal.SIGTERM)
    began = time.monotonic()
    assert server.proc.wait(20) == 0, server.output()[-3000:]
    assert time.monotonic() - began < 15
    deadline = time.monotonic() + 10
    while alive(engine) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(engine), "the engine outlived its server"
