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

import base64
import http.client
import json
import math
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpud.core.traffic import in_flight_from_metrics
from tests.vllm.servers import (
    EMBEDDING_WIDTH,
    MODEL,
    REAL,
    REAL_POOLING,
    STANDIN,
    STANDIN_POOLING,
    Implementation,
    Server,
    alive,
    get,
    outcome,
    title,
    wait_ready,
)

# The main server of each pair runs vLLM's scheduler with one place and the priority policy
# (the tests under load), and a context long enough that a request can hold the place for as long
# as a test needs it; the stand-in's tokens come 5 ms apart, so that a long generation
# lasts long enough to queue others behind it, as the tiny model's on the CPU does.
# the tiny model's max_position_embeddings: at 2048, a loaded machine let the holder's 2000
# tokens (under 8 s on the CPU here) end before the next request reached the engine
MAIN_MAX_MODEL_LEN = 16384
# --enable-log-requests: each request's "Added request ID." once it is in the engine's queue
# (queued reads them)
SCHEDULER = ("--max-num-seqs", "1", "--scheduling-policy", "priority",
             "--max-model-len", str(MAIN_MAX_MODEL_LEN), "--enable-log-requests")
STANDIN_PACE = ("--token-interval-s", "0.005")


def needs(impl: Implementation, request: pytest.FixtureRequest) -> None:
    """Real vLLM's side skips where it is missing (a failure in CI: tests/conftest.py); the
    stand-in's side runs everywhere."""
    if impl.name == REAL.name:
        request.getfixturevalue("real_vllm")


class Pair:
    def __init__(self, main: Server, doomed: Server) -> None:
        self.main, self.doomed = main, doomed


@pytest.fixture(scope="module", params=[REAL, STANDIN], ids=lambda impl: impl.name)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    impl: Implementation = request.param
    needs(impl, request)
    folder: Path = tmp_path_factory.mktemp(impl.name)
    main = SCHEDULER + (STANDIN_PACE if impl is STANDIN else ())
    # main in vLLM's dev mode, as gpud runs a fronted serve (its /pause: test_pause_abort_...)
    servers = [Server.launch(impl, folder / "main.log", main, env={"VLLM_SERVER_DEV_MODE": "1"}),
               Server.launch(impl, folder / "doomed.log")]
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
    assert models["data"][0]["max_model_len"] == MAIN_MAX_MODEL_LEN


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


# --- the client routes, route by route (vllm 0.32.0: paths under vllm/entrypoints/) ----------
# Each runs on both engines; test ids name the engine ([vllm] the CPU build, [standin]). The
# tiny model's tokenizer and the stand-in's differ, so the contract is in relations that hold
# for any tokenizer: usage counts what /tokenize counts, totals add up, a generation of
# max_tokens with ignore_eos is max_tokens long.


def post(port: int, path: str, doc: dict[str, Any], *, timeout: float = 60) -> tuple[int, Any]:
    status, body = get(port, path, method="POST", body=json.dumps(doc).encode(), timeout=timeout)
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body.decode(errors="replace")


def count(port: int, doc: dict[str, Any]) -> int:
    """What /tokenize counts for a prompt or chat messages (serve/tokenize/protocol.py)."""
    status, answer = post(port, "/tokenize", {"model": str(MODEL), **doc})
    assert status == 200, answer
    assert answer["count"] == len(answer["tokens"]), answer
    return int(answer["count"])


def sse(port: int, path: str, doc: dict[str, Any]) -> list[tuple[str | None, Any]]:
    """A streamed answer's events (`events`)."""
    status, body = get(port, path, method="POST", body=json.dumps(doc).encode(), timeout=60)
    assert status == 200, body
    return events_of(body)


def events_of(body: bytes) -> list[tuple[str | None, Any]]:
    """A stream's events: (event name or None, data parsed; "[DONE]" kept as text)."""
    events = []
    for block in body.decode().split("\n\n"):
        name, data = None, None
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
        if data is not None:
            events.append((name, data if data == "[DONE]" else json.loads(data)))
    return events


def test_tokenize_and_detokenize_round_trip(pair: Pair) -> None:
    port = pair.main.port
    status, answer = post(port, "/tokenize", {"model": str(MODEL), "prompt": "Hello world",
                                              "add_special_tokens": False})
    assert status == 200, answer
    assert answer["count"] == len(answer["tokens"]) > 0 and answer["max_model_len"] == MAIN_MAX_MODEL_LEN
    status, back = post(port, "/detokenize", {"model": str(MODEL), "tokens": answer["tokens"]})
    assert (status, back) == (200, {"prompt": "Hello world"})


def test_completions_usage_counts_the_prompt_and_the_tokens_made(pair: Pair) -> None:
    port = pair.main.port
    status, answer = post(port, "/v1/completions", {"model": str(MODEL), "prompt": "Hello world",
                                                    "max_tokens": 5, "ignore_eos": True})
    assert status == 200, answer
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["prompt_tokens"] == count(port, {"prompt": "Hello world"})
    assert answer["usage"]["completion_tokens"] == 5
    assert answer["usage"]["total_tokens"] == answer["usage"]["prompt_tokens"] + 5


def test_chat_usage_and_a_stream_that_carries_it(pair: Pair) -> None:
    port = pair.main.port
    messages = [{"role": "user", "content": "Hello world"}]
    doc = {"model": str(MODEL), "messages": messages, "max_tokens": 4, "ignore_eos": True}
    status, answer = post(port, "/v1/chat/completions", doc)
    assert status == 200, answer
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"]["role"] == "assistant"
    usage = answer["usage"]
    assert usage["prompt_tokens"] == count(port, {"messages": messages})
    assert (usage["completion_tokens"], usage["total_tokens"]) == (4, usage["prompt_tokens"] + 4)
    # stream_options.include_usage: a last chunk with no choices and the usage, then [DONE]
    events = sse(port, "/v1/chat/completions",
                 {**doc, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == (None, "[DONE]")
    last = events[-2][1]
    assert last["choices"] == [] and {k: last["usage"][k] for k in (
        "prompt_tokens", "completion_tokens", "total_tokens")} == {
        k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    assert all(e[1]["object"] == "chat.completion.chunk" for e in events[:-1])
    # continuous_usage_stats: the usage so far in every chunk (serve/utils/api_utils.py:289)
    events = sse(port, "/v1/chat/completions", {**doc, "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}})
    made = [e[1]["usage"]["completion_tokens"] for e in events[:-1]]
    assert made == sorted(made) and made[-1] == 4, made
    assert {e[1]["usage"]["prompt_tokens"] for e in events[:-1]} == {usage["prompt_tokens"]}


def test_responses_answer_with_their_usage(pair: Pair) -> None:
    port = pair.main.port
    status, answer = post(port, "/v1/responses", {"model": str(MODEL), "input": "Hello world",
                                                  "max_output_tokens": 4})
    assert status == 200, answer
    assert answer["object"] == "response" and answer["model"] == str(MODEL)
    message = answer["output"][-1]
    assert (message["type"], message["role"]) == ("message", "assistant")
    assert all(part["type"] == "output_text" for part in message["content"])
    usage = answer["usage"]
    assert usage["input_tokens"] == count(
        port, {"messages": [{"role": "user", "content": "Hello world"}]})
    assert 1 <= usage["output_tokens"] <= 4
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    # incomplete when max_output_tokens ended it (responses/protocol.py:897-899)
    assert answer["status"] in ("completed", "incomplete")
    assert answer["status"] == "completed" or usage["output_tokens"] == 4, answer
    assert (answer["incomplete_details"] is not None) == (answer["status"] == "incomplete")
    # streamed: `event: TYPE` events numbered in order, the text in deltas, the whole response
    # last (openai/responses/serving.py:1360-1425, streaming_events.py)
    events = sse(port, "/v1/responses", {"model": str(MODEL), "input": "Hello world",
                                         "max_output_tokens": 4, "stream": True})
    names = [name for name, _ in events]
    assert names[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"], names
    assert names[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"], names
    assert set(names[4:-4]) == {"response.output_text.delta"}, names
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert all(data["type"] == name for name, data in events)
    text = "".join(data["delta"] for name, data in events if name == "response.output_text.delta")
    assert events[-4][1]["text"] == text
    done = events[-1][1]["response"]
    assert done["output"][-1]["content"][0]["text"] == text
    assert done["usage"]["total_tokens"] == (done["usage"]["input_tokens"]
                                             + done["usage"]["output_tokens"])
    assert done["usage"]["input_tokens"] == usage["input_tokens"]


def test_anthropic_messages_streamed_and_not_and_their_token_count(pair: Pair) -> None:
    port = pair.main.port
    messages = [{"role": "user", "content": "Hello world"}]
    doc = {"model": str(MODEL), "messages": messages, "max_tokens": 3, "temperature": 0}
    status, answer = post(port, "/v1/messages", doc)
    assert status == 200, answer
    assert (answer["type"], answer["role"]) == ("message", "assistant")
    assert answer["content"][0]["type"] == "text"
    assert answer["stop_reason"] in ("end_turn", "max_tokens")
    usage = answer["usage"]
    assert usage["input_tokens"] == count(port, {"messages": messages})
    assert 1 <= usage["output_tokens"] <= 3
    status, counted = post(port, "/v1/messages/count_tokens",
                           {"model": str(MODEL), "messages": messages})
    assert (status, counted) == (200, {"input_tokens": usage["input_tokens"], "context_management":
                                       {"original_input_tokens": usage["input_tokens"]}})
    events = sse(port, "/v1/messages", {**doc, "stream": True})
    names = [name for name, _ in events]
    # anthropic/serving.py: message_start, a text block, message_delta, message_stop
    assert names[:2] == ["message_start", "content_block_start"], names
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"], names
    assert set(names[2:-3]) == {"content_block_delta"}, names
    assert all(data["type"] == name for name, data in events)
    text = "".join(data["delta"]["text"] for name, data in events
                   if name == "content_block_delta")
    assert text.strip() == answer["content"][0]["text"].strip()  # greedy: the same tokens
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == answer["stop_reason"]
    assert delta["usage"]["output_tokens"] == usage["output_tokens"]


def test_an_unknown_model_is_404_in_each_routes_error_shape(pair: Pair) -> None:
    port = pair.main.port
    status, answer = post(port, "/v1/chat/completions", {
        "model": "no-such-model", "messages": [{"role": "user", "content": "x"}]})
    # vLLM's ErrorResponse (serve/engine/protocol.py:79-87), which the openai library reads
    assert status == 404, answer
    assert answer["error"]["type"] == "NotFoundError" and answer["error"]["code"] == 404
    assert "no-such-model" in answer["error"]["message"]
    status, answer = post(port, "/v1/messages", {
        "model": "no-such-model", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
    # Anthropic's error shape (anthropic/api_router.py:39 translate_error_response)
    assert status == 404, answer
    assert answer["type"] == "error" and answer["error"]["type"] == "NotFoundError", answer


def test_a_body_of_several_mib_is_read(pair: Pair) -> None:
    # vLLM sets no limit on a body (its h11 bounds the header block: 4 MiB,
    # launchers/utils/constants.py:6); an OCR page in base64 is a few MiB. A field vLLM does
    # not know is ignored (OpenAIBaseModel, extra="allow"), so 3 MiB of it cost nothing else.
    status, answer = post(pair.main.port, "/v1/completions", {
        "model": str(MODEL), "prompt": "Hello", "max_tokens": 1, "padding": "x" * (3 << 20)})
    assert status == 200, answer
    assert answer["usage"]["prompt_tokens"] == count(pair.main.port, {"prompt": "Hello"})


def test_a_generator_has_no_pooling_routes(pair: Pair) -> None:
    for path in ("/v1/embeddings", "/v1/rerank", "/v1/score"):
        status, _ = post(pair.main.port, path, {"model": str(MODEL), "input": "x"})
        assert status == 404, path


# --- under load: vLLM's scheduler (main runs with --max-num-seqs 1 --scheduling-policy
# priority: vllm/config/scheduler.py max_num_seqs, policy) ------------------------------------

HOLD = 16000  # tokens the holder may run to (MAIN_MAX_MODEL_LEN less the prompt): far longer
              # than any setup takes, for the test lets it go itself, by hanging up


# A streamed completion, read by a client process of its own: it prints when its first token
# came and when its end came, by CLOCK_MONOTONIC (one clock for every process of the host).
# Read from the test's own process, an end is when pytest's thread got to read it: in a full
# run a pause of that process (a garbage collection over a large heap, which holds every
# thread) let two ends a whole generation apart be read 0.5 ms apart, in either order.
CLIENT = """
import http.client, sys, time
conn = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=120)
conn.request("POST", "/v1/completions", body=sys.argv[2],
             headers={"Content-Type": "application/json"})
resp = conn.getresponse()
first = None
while line := resp.readline():
    if line.startswith(b"data: ") and first is None:
        first = time.monotonic()
        print("first", first, flush=True)
print("done", time.monotonic(), resp.status, flush=True)
"""


class Streamed(threading.Thread):
    """A streamed completion read by a client process (CLIENT), followed in the background: when
    its first token and its end came, by the client's clock. `hang_up()` ends the client, which
    closes the connection as a client that leaves does: the engine aborts the request and its
    place goes to the next in line."""

    def __init__(self, port: int, max_tokens: int, priority: int = 0) -> None:
        super().__init__(daemon=True)
        body = json.dumps({"model": str(MODEL), "prompt": "Hello", "max_tokens": max_tokens,
                           "ignore_eos": True, "stream": True, "priority": priority})
        self.client = subprocess.Popen([sys.executable, "-c", CLIENT, str(port), body],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.first: float | None = None
        self.done: float | None = None
        self.left = False
        self.start()

    def run(self) -> None:
        assert self.client.stdout is not None
        for line in self.client.stdout:
            what, at, *status = line.decode().split()
            if what == "first":
                self.first = float(at)
            elif status == ["200"]:
                self.done = float(at)
        assert self.client.stderr is not None
        with self.client.stdout, self.client.stderr:
            said = self.client.stderr.read()
        code = self.client.wait()
        if code != 0 and not self.left:
            raise AssertionError(f"the client exited {code}: {said!r}")

    def hang_up(self) -> None:
        self.left = True
        self.client.kill()
        self.join(30)


def requests(port: int, state: str) -> int:
    """The engine's count of requests in STATE (`waiting`, `running`), from its /metrics."""
    text = get(port, "/metrics")[1].decode()
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith(f"vllm:num_requests_{state}{{"))


def waiting(port: int) -> int:
    return requests(port, "waiting")


def until(what: str, check: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def added(server: Server) -> int:
    """How many requests SERVER's API server sent to its engine: its "Added request ID."
    lines (--enable-log-requests; vllm/v1/engine/async_llm.py AsyncLLM.add_request, once
    the request is sent to the engine core)."""
    return server.output().count("Added request ")


def queued(server: Server, *makes: Callable[[], Streamed]) -> list[Streamed]:
    """Each of MAKES' requests made in turn, each in the engine's queue before the next is
    made, while the engine is held paused (`POST /pause?mode=keep`, dev mode: new requests
    are not scheduled until `/resume`, vllm/v1/engine/async_llm.py pause_generation), then
    let go: the scheduler gives its one place by its policy, the others counted waiting. Made
    so and not behind a running holder: a full run saw a request take 60 s to be counted
    waiting behind a holder streaming thousands of tokens (its API server took 4 to 33 s to
    receive a request, measured on an idle 2-core machine), where an idle engine takes it at
    once. Known added by the log, not by the waiting count: a paused engine makes no step, so
    its counts (sent with a step's outputs) stay as they were."""
    port, made = server.port, []
    before = added(server)
    status, answer = get(port, "/pause?mode=keep", method="POST", timeout=60)
    assert status == 200, answer
    try:
        for make in makes:
            made.append(make())
            until(f"request {len(made)} in the engine's queue",
                  lambda: added(server) == before + len(made))
    except BaseException:
        for request in made:
            request.hang_up()
        raise
    finally:
        status, answer = get(port, "/resume", method="POST", timeout=60)
        assert status == 200, answer
    return made


def test_past_max_num_seqs_a_request_waits_for_a_place(pair: Pair) -> None:
    port = pair.main.port
    # the engine has one place: the first in line runs (HOLD tokens, ended by the test), the
    # second waits (counted waiting, not one token) while it runs
    holder, second = queued(pair.main, lambda: Streamed(port, HOLD),
                            lambda: Streamed(port, 2))
    until("the holder's first token", lambda: holder.first is not None)
    until("the second counted waiting", lambda: waiting(port) == 1)
    assert second.first is None and holder.done is None
    hung = time.monotonic()
    holder.hang_up()  # the engine aborts it: its place goes to the second
    second.join(120)
    assert second.done is not None
    assert holder.done is None, "the holder ran to its end: it did not hold the place"
    # had the holder kept its place, the second would have waited for the rest of its HOLD
    # tokens (10 s at the stand-in's pace, more on the tiny model on the CPU)
    assert second.done - hung < 5, "the second waited for the holder's end: no abort"
    assert waiting(port) == 0


def test_the_priority_policy_lets_the_lower_value_in_first(pair: Pair) -> None:
    port = pair.main.port
    # two in line for the one place, the later with the lower value; each asks for HOLD
    # tokens, so the one let in runs for as long as the test needs and the other gets no
    # token meanwhile
    low, high = queued(pair.main, lambda: Streamed(port, HOLD, priority=5),
                       lambda: Streamed(port, HOLD, priority=-5))
    until("one of the two let in", lambda: low.first is not None or high.first is not None)
    # v1/request.py Request.__lt__ (the lower value first) over v1/core/sched/request_queue.py
    # PriorityRequestQueue: the lower value is let in and the other has not one token while it
    # runs. Read from which client has a token, not from when each ended: the API server takes
    # the engine's outputs in chunks (v1/engine/async_llm.py output_handler) and merges a
    # request's deltas (v1/engine/output_processor.py RequestOutputCollector), so on a loaded
    # machine it fell hundreds of engine steps behind and sent two ends 400 steps apart within
    # 4 ms, in either order.
    assert high.first is not None and low.first is None, "priority 5 was let in before -5"
    until("the other counted waiting", lambda: waiting(port) == 1)
    assert low.first is None and high.done is None
    for request in (low, high):  # the waiting one, then the runner: the engine left empty
        request.hang_up()
    until("the engine empty again", lambda: waiting(port) == 0
          and requests(port, "running") == 0)


def paused_midway(port: int, path: str, doc: dict[str, Any]) -> list[tuple[str | None, Any]]:
    """A stream on PATH ended by `POST /pause?mode=abort` after its first event (in dev mode:
    vllm/entrypoints/rl/online/api_router.py pause_generation), then `/resume`: the stream's
    events as `sse` gives them. The pause answers {"status": "paused"}, /is_paused says so, and
    /resume lets requests run again."""
    raw: list[bytes] = []
    body = json.dumps({"model": str(MODEL), **doc, "stream": True}).encode()

    def read() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        while line := resp.readline():
            raw.append(line)
        conn.close()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    until("the stream's first tokens", lambda: sum(line.startswith(b"data: {") for line in raw) > 6)
    status, answer = get(port, "/pause?mode=abort", method="POST", timeout=60)
    assert (status, json.loads(answer)) == (200, {"status": "paused"}), answer
    reader.join(60)
    assert not reader.is_alive(), "the stream did not end at the pause"
    assert json.loads(get(port, "/is_paused")[1]) == {"is_paused": True}
    status, answer = get(port, "/resume", method="POST")
    assert (status, json.loads(answer)) == (200, {"status": "resumed"}), answer
    assert json.loads(get(port, "/is_paused")[1]) == {"is_paused": False}
    status, done = post(port, "/v1/completions", {"model": str(MODEL), "prompt": "Hello",
                                                  "max_tokens": 2})
    assert status == 200 and done["choices"][0]["finish_reason"] == "length", done
    return events_of(b"".join(raw))


def test_pause_abort_ends_a_stream_in_flight_with_an_abort_chunk(pair: Pair) -> None:
    """gpud's told end of what is still in flight before it stops a serve past its drain bound
    (gpud.life.traffic.drain_to_stop): the stream's last chunk says finish_reason "abort", then
    `data: [DONE]` (what the router follows with its error event)."""
    events = paused_midway(pair.main.port, "/v1/completions", {
        "prompt": "Hello", "max_tokens": HOLD, "ignore_eos": True})
    assert events[-1] == (None, "[DONE]"), events[-3:]
    assert events[-2][1]["choices"][0]["finish_reason"] == "abort", events[-2]
    assert len(events) < HOLD, "the stream ran to its end"


def test_an_aborted_responses_stream_ends_as_a_whole_one(pair: Pair) -> None:
    """vLLM 0.32 ends an aborted /v1/responses stream (a model without Harmony) as a whole one:
    the done events, then `response.completed` whose response's status is "completed"
    (openai/responses/serving.py: "cancelled" only for Harmony), its usage the tokens made; no
    error event. What the router cannot tell from the stream alone (docs/router.md)."""
    events = paused_midway(pair.main.port, "/v1/responses", {
        "input": "Hello", "max_output_tokens": HOLD, "ignore_eos": True})
    names = [name for name, _ in events]
    assert names[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"], names[-6:]
    assert "error" not in names
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    done = events[-1][1]["response"]
    made = sum(name == "response.output_text.delta" for name in names)
    assert done["status"] == "completed" and done["incomplete_details"] is None, done
    assert 0 < done["usage"]["output_tokens"] < HOLD and made < HOLD, done["usage"]


def test_an_aborted_messages_stream_ends_with_no_stop_reason(pair: Pair) -> None:
    """vLLM 0.32 ends an aborted /v1/messages stream with its usual last events, the
    message_delta's stop_reason null (anthropic/serving.py _to_anthropic_stop_reason maps
    "abort" to None), then message_stop; no error event. The router's mark of a cut
    /v1/messages stream (router.js MESSAGES_ABORTS)."""
    events = paused_midway(pair.main.port, "/v1/messages", {
        "messages": [{"role": "user", "content": "Hello"}], "max_tokens": HOLD,
        "temperature": 0})
    names = [name for name, _ in events]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"], names[-5:]
    assert "error" not in names
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] is None, delta
    assert 0 < delta["usage"]["output_tokens"] < HOLD, delta


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


# --- a pooling serve: embeddings, score, rerank (vllm 0.32.0: pooling/, registered by
# pooling/factories.py register_pooling_api_routers for an "embed" model) ---------------------

@pytest.fixture(scope="module", params=[REAL_POOLING, STANDIN_POOLING],
                ids=lambda impl: impl.name)
def pooler(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Server]:
    impl: Implementation = request.param
    needs(impl, request)
    server = Server.launch(impl, tmp_path_factory.mktemp(f"pooling-{impl.name}") / "serve.log")
    try:
        wait_ready(server)
        yield server
    finally:
        server.end()


def test_embeddings_as_floats_and_as_base64_with_their_usage(pooler: Server) -> None:
    port = pooler.port
    texts = ["Hello world", "The quick brown fox"]
    status, answer = post(port, "/v1/embeddings", {"model": str(MODEL), "input": texts})
    assert status == 200, answer
    assert answer["object"] == "list" and answer["model"] == str(MODEL)
    assert [d["index"] for d in answer["data"]] == [0, 1]
    for item in answer["data"]:
        assert item["object"] == "embedding" and len(item["embedding"]) == EMBEDDING_WIDTH
        # the embed pooler normalizes (vllm/pooling_params.py: use_activation for embed)
        assert math.isclose(math.hypot(*item["embedding"]), 1.0, abs_tol=1e-3)
    # usage: the prompt tokens alone (pooling/utils.py:154)
    tokens = sum(count(port, {"prompt": t}) for t in texts)
    assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] == tokens
    assert answer["usage"]["completion_tokens"] == 0
    # base64: float32 in native byte order, as the openai library reads it (its default)
    status, packed = post(port, "/v1/embeddings", {"model": str(MODEL), "input": texts[0],
                                                   "encoding_format": "base64"})
    assert status == 200, packed
    raw = base64.b64decode(packed["data"][0]["embedding"])
    floats = struct.unpack(f"={EMBEDDING_WIDTH}f", raw)
    assert all(math.isclose(a, b, abs_tol=1e-5)
               for a, b in zip(floats, answer["data"][0]["embedding"], strict=True))


def test_embeddings_refuse_dimensions_a_model_cannot_give(pooler: Server) -> None:
    # vllm/pooling_params.py:175: not a Matryoshka model
    status, answer = post(pooler.port, "/v1/embeddings",
                          {"model": str(MODEL), "input": "x", "dimensions": 8})
    assert status == 400 and answer["error"]["type"] == "BadRequestError", answer
    assert "Matryoshka" in answer["error"]["message"]


def test_score_a_query_against_documents(pooler: Server) -> None:
    status, answer = post(pooler.port, "/v1/score", {
        "model": str(MODEL), "text_1": "Hello world",
        "text_2": ["Hello world", "The quick brown fox"]})
    assert status == 200, answer
    assert [(d["index"], d["object"]) for d in answer["data"]] == [(0, "score"), (1, "score")]
    same, other = (d["score"] for d in answer["data"])
    # a bi-encoder's score: the cosine of the embeddings, 1 for the same text
    assert math.isclose(same, 1.0, abs_tol=1e-3) and other < same
    assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] > 0


def test_rerank_sorts_the_documents_and_keeps_the_top_n(pooler: Server) -> None:
    documents = ["The quick brown fox", "Hello world", "A serve is admitted"]
    status, answer = post(pooler.port, "/v1/rerank", {
        "model": str(MODEL), "query": "Hello world", "documents": documents, "top_n": 2})
    assert status == 200, answer
    results = answer["results"]
    assert len(results) == 2 and results[0]["index"] == 1
    assert results[0]["document"]["text"] == "Hello world"
    assert math.isclose(results[0]["relevance_score"], 1.0, abs_tol=1e-3)
    assert results[0]["relevance_score"] >= results[1]["relevance_score"]
    assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] > 0


def test_a_pooling_serve_has_no_generation_routes(pooler: Server) -> None:
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"):
        status, _ = post(pooler.port, path, {"model": str(MODEL), "prompt": "x"})
        assert status == 404, path
    assert count(pooler.port, {"prompt": "Hello"}) > 0  # the tokenizer's routes: every serve


# --- audio transcription (multipart: speech_to_text/transcription/api_router.py:31) ---------

def wav(seconds: float, rate: int = 16000) -> bytes:
    """A silent 16-bit mono PCM WAV file."""
    data = b"\0\0" * int(seconds * rate)
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    return (b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVE" + b"fmt "
            + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", len(data)) + data)


def form(fields: dict[str, bytes]) -> tuple[str, bytes]:
    boundary = "gpud-contract-boundary"
    parts = []
    for name, value in fields.items():
        filename = '; filename="a.wav"' if name == "file" else ""
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"'
                     f"{filename}\r\n\r\n".encode() + value + b"\r\n")
    end = f"--{boundary}--\r\n".encode()
    return f"multipart/form-data; boundary={boundary}", b"".join(parts) + end


# The stand-in's side alone, by construction rather than by a skip: real vLLM's CPU build here
# cannot serve these routes. They exist only for a speech-to-text model
# (launchers/api_server/routers.py: "transcription" in supported_tasks) and none is made offline
# (a Whisper needs its feature extractor and tokenizer); and vLLM decodes an upload with
# soundfile, then PyAV (multimodal/media/audio.py load_audio_soundfile and the chain after it),
# resampling with soxr or torchaudio, none of which .venv-vllm has (scripts/setup-vllm leaves
# torchaudio and torchcodec out: their wheels do not match torch+cpu).
@pytest.fixture(scope="module")
def speech(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server.launch(STANDIN, tmp_path_factory.mktemp("speech") / "serve.log",
                           ("--audio",))
    try:
        wait_ready(server)
        yield server
    finally:
        server.end()


def test_a_transcription_of_a_multipart_upload_with_its_duration(speech: Server) -> None:
    kind, body = form({"model": str(MODEL).encode(), "file": wav(1.5)})
    status, raw = get(speech.port, "/v1/audio/transcriptions", method="POST", body=body,
                      content_type=kind)
    assert status == 200, raw
    answer = json.loads(raw)
    # TranscriptionResponse: text and usage {"type": "duration", "seconds": rounded up}
    assert isinstance(answer["text"], str)
    assert answer["usage"] == {"type": "duration", "seconds": 2}
    kind, body = form({"model": str(MODEL).encode(), "file": wav(1.0)})
    status, raw = get(speech.port, "/v1/audio/translations", method="POST", body=body,
                      content_type=kind)
    assert status == 200 and "usage" not in json.loads(raw), raw  # a translation has none
    kind, body = form({"model": b"no-such-model", "file": wav(1.0)})
    status, raw = get(speech.port, "/v1/audio/transcriptions", method="POST", body=body,
                      content_type=kind)
    assert status == 404 and json.loads(raw)["error"]["type"] == "NotFoundError", raw
