"""Every client route through the router's one address, driven by the libraries its users use:
the official `openai` library (chat, a stream with its usage, completions, embeddings from a
pooling serve brought up on demand, responses streamed and not, a chat with a ~1 MiB base64 page image) and the
`anthropic` library (messages streamed and not, count_tokens), each answer checked as the
library's own type, each error as the library's own typed error. Under real systemd in the
sandbox; the serves are stand-ins speaking vLLM's shapes (their contract with real vLLM:
tests/vllm/test_contract.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.gpudctl import (
    PY,
    STANDIN,
    SandboxGpud,
    fronted_gpud,
    sim_config,
    standin_uds,
)

ROUTER = 30390
PORT = 30391
USER = "gpud-clients"  # a local user who is nobody to gpud
SCRIPT = "/tmp/gpud-clients.py"


def config() -> str:
    def command(*args: str) -> str:
        return json.dumps([*STANDIN, "serve", "m", "--port", "{port}",
                           "--gpu-memory-utilization", "{gpu_memory_utilization}", *args])
    serves = (
        # a generator answering to two names, as the seed's host routes chat and ocr
        f'[serves.gen]\nrole = "r"\nvram_mib = 8000\nport = {PORT}\nmodels = ["chat", "ocr"]\n'
        f"command = {command('--served-model-name', 'chat', 'ocr')}\n"
        # a pooling serve (vLLM's --runner pooling) of bge-m3's width, started by a request
        # (on demand: fronted, its stand-in on the front's socket)
        f'[serves.emb]\nrole = "r"\nvram_mib = 3200\nport = {PORT + 1}\non_demand = true\n'
        'start_timeout_s = 60\nmodels = ["embeddings"]\n'
        f"command = {standin_uds('--runner', 'pooling', '--embedding-width', '1024', '--served-model-name', 'embeddings')}\n"
    )
    role = '[roles.r]\ndevice = "GPU-sim-0"\nreserve_mib = 1000\n'
    return sim_config(role, serves) + f'[router]\nlisten = "127.0.0.1:{ROUTER}"\n'


# Run inside the sandbox as USER: each route once, what came back described by the library's
# own types (module and class) and the figures the test checks.
CLIENTS = f'''
import base64, json, os
import anthropic, openai

BASE = "http://127.0.0.1:{ROUTER}"
out = {{}}


def kind(thing):
    return type(thing).__module__ + "." + type(thing).__qualname__


o = openai.OpenAI(base_url=BASE + "/v1", api_key="unused", max_retries=0, timeout=120)
hello = [{{"role": "user", "content": "hello there"}}]
r = o.chat.completions.create(model="chat", messages=hello, max_tokens=3)
out["chat"] = [kind(r), r.model, r.choices[0].message.content, r.choices[0].finish_reason,
               r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens]
chunks = list(o.chat.completions.create(model="chat", messages=hello, max_tokens=3, stream=True,
                                        stream_options={{"include_usage": True}}))
out["chat_stream"] = [kind(chunks[0]), len([c for c in chunks if c.choices]),
                      chunks[-1].choices, chunks[-1].usage.completion_tokens]
c = o.completions.create(model="chat", prompt="hello", max_tokens=2)
out["completion"] = [kind(c), c.choices[0].text, c.usage.prompt_tokens, c.usage.completion_tokens]
e = o.embeddings.create(model="embeddings", input=["a page", "another page"])
out["embeddings"] = [kind(e), kind(e.data[0]), [len(d.embedding) for d in e.data],
                     sum(x * x for x in e.data[0].embedding), e.usage.prompt_tokens,
                     e.usage.total_tokens]
rr = o.responses.create(model="chat", input="hello there", max_output_tokens=3)
out["responses"] = [kind(rr), rr.status, rr.output_text, rr.usage.input_tokens,
                    rr.usage.output_tokens, rr.usage.total_tokens]
events = list(o.responses.create(model="chat", input="hello there", max_output_tokens=3,
                                 stream=True))
out["responses_stream"] = [kind(events[-1]), sorted({{kind(e) for e in events
                                                     if e.type.endswith(".delta")}}),
                           "".join(e.delta for e in events if e.type.endswith(".delta")),
                           events[-1].response.output_text, events[-1].response.usage.output_tokens]
page = base64.b64encode(b"\\x89PNG\\r\\n\\x1a\\n" + os.urandom(786432)).decode()
m = o.chat.completions.create(model="ocr", max_tokens=4, messages=[{{"role": "user", "content": [
    {{"type": "text", "text": "read this page"}},
    {{"type": "image_url", "image_url": {{"url": "data:image/png;base64," + page}}}}]}}])
out["multimodal"] = [kind(m), len(page), m.model, m.usage.prompt_tokens,
                     m.choices[0].message.content]
for name, call in (
        ("unknown_model", lambda: o.chat.completions.create(model="chta", messages=hello)),
        ("serve_refused", lambda: o.embeddings.create(model="embeddings", input="x",
                                                      dimensions=8))):
    try:
        call()
        out[name] = None
    except openai.APIStatusError as exc:
        out[name] = [kind(exc), exc.status_code, str(exc.message)]

a = anthropic.Anthropic(base_url=BASE, api_key="unused", max_retries=0, timeout=120)
msg = a.messages.create(model="chat", max_tokens=3, messages=hello)
out["messages"] = [kind(msg), msg.role, [b.type for b in msg.content], msg.content[0].text,
                   msg.stop_reason, msg.usage.input_tokens, msg.usage.output_tokens]
with a.messages.stream(model="chat", max_tokens=3, messages=hello) as stream:
    text = "".join(stream.text_stream)
    final = stream.get_final_message()
out["messages_stream"] = [kind(final), isinstance(final, anthropic.types.Message), text,
                          final.content[0].text, final.stop_reason, final.usage.output_tokens]
counted = a.messages.count_tokens(model="chat", messages=hello)
out["count_tokens"] = [kind(counted), counted.input_tokens]
for name, model in (("anthropic_unknown_model", "chta"), ("anthropic_not_a_generator",
                                                          "embeddings")):
    try:
        a.messages.create(model=model, max_tokens=3, messages=hello)
        out[name] = None
    except anthropic.APIStatusError as exc:
        out[name] = [kind(exc), exc.status_code]
print(json.dumps(out))
'''


@pytest.fixture
def routed(gpud: SandboxGpud) -> Iterator[SandboxGpud]:
    with fronted_gpud(gpud, config(), [USER]):
        gpud.sb.write_file(SCRIPT, CLIENTS, mode=0o644)
        yield gpud


def test_each_route_through_the_router_with_the_openai_and_anthropic_libraries(
        routed: SandboxGpud) -> None:
    gpud = routed
    assert gpud.call("POST", "/v1/serves/gen/start", {}).status == 200
    gpud.wait_state("gen", "running")
    assert gpud.serve("emb")["state"] == "declared"  # on demand: the first request starts it
    run = gpud.sb.run([PY, SCRIPT], user=USER, timeout=240, check=False,
                      env={"NO_PROXY": "*", "HOME": "/tmp"})
    assert run.returncode == 0, run.stdout + run.stderr
    out: dict[str, Any] = json.loads(run.stdout.splitlines()[-1])

    kind, model, text, finish, prompt, completion, total = out["chat"]
    assert kind == "openai.types.chat.chat_completion.ChatCompletion"
    assert (model, text, finish) == ("chat", "[gpud-standin echo] hello", "length")
    assert completion == 3 and total == prompt + completion and prompt > 0
    kind, chunks, last_choices, streamed = out["chat_stream"]
    assert kind == "openai.types.chat.chat_completion_chunk.ChatCompletionChunk"
    assert (chunks, last_choices, streamed) == (3, [], 3)  # the usage chunk last
    kind, text, prompt, completion = out["completion"]
    assert kind == "openai.types.completion.Completion"
    assert (text, prompt, completion) == ("[gpud-standin echo]", len("hello"), 2)

    # embeddings from the pooling serve gpud brought up for them; the library asked for
    # base64 (its default) and decoded it: 1024 floats of unit norm each
    kind, item, widths, norm, prompt, total = out["embeddings"]
    assert kind == "openai.types.create_embedding_response.CreateEmbeddingResponse"
    assert item == "openai.types.embedding.Embedding"
    assert widths == [1024, 1024] and abs(norm - 1) < 1e-4
    assert prompt == total == len("a page") + len("another page")
    assert gpud.serve("emb")["state"] == "running"

    kind, status, text, prompt, completion, total = out["responses"]
    assert kind == "openai.types.responses.response.Response"
    assert (status, text, completion) == ("incomplete", "[gpud-standin echo] hello", 3)
    assert total == prompt + completion

    kind, deltas, text, final_text, completion = out["responses_stream"]
    assert kind == "openai.types.responses.response_completed_event.ResponseCompletedEvent"
    assert deltas == ["openai.types.responses.response_text_delta_event.ResponseTextDeltaEvent"]
    assert text == final_text and text.split() == ["[gpud-standin", "echo]", "hello"]
    assert completion == 3

    # the OCR page: a 1 MiB base64 image in the body, through the router to its serve
    kind, size, model, prompt, text = out["multimodal"]
    assert kind == "openai.types.chat.chat_completion.ChatCompletion"
    assert size >= 1 << 20 and model == "ocr"
    assert prompt > 256 and text.startswith("[gpud-standin echo]")

    # errors as the library's typed errors: the router's own 404 for a name it does not
    # know, and the serve's 400 for what the model cannot do (vLLM's error shape)
    kind, status, message = out["unknown_model"]
    assert (kind, status) == ("openai.NotFoundError", 404) and '"chat"' in message, message
    kind, status, message = out["serve_refused"]
    assert (kind, status) == ("openai.BadRequestError", 400) and "Matryoshka" in message

    kind, role, blocks, text, stop, prompt, completion = out["messages"]
    assert kind == "anthropic.types.message.Message"
    assert (role, blocks, text, stop) == ("assistant", ["text"], "[gpud-standin echo] hello",
                                          "max_tokens")
    assert prompt > 0 and completion == 3
    # the stream, as the library's stream helper assembles it: a Message (its parsed kind)
    kind, message, text, final_text, stop, completion = out["messages_stream"]
    assert (kind, message) == ("anthropic.types.parsed_message.ParsedMessage", True)
    assert text == final_text and text.split() == ["[gpud-standin", "echo]", "hello"]
    assert (stop, completion) == ("max_tokens", 3)
    assert out["count_tokens"] == ["anthropic.types.message_tokens_count.MessageTokensCount",
                                   out["messages"][5]]
    assert out["anthropic_unknown_model"] == ["anthropic.NotFoundError", 404]
    assert out["anthropic_not_a_generator"] == ["anthropic.NotFoundError", 404]
