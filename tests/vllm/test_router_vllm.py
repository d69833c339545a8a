"""The router in front of real vLLM (the CPU build, tiny model) under real systemd in the
sandbox: vLLM launched with the serve's `models` as --served-model-name answers each of them,
one completion and one stream through the router's one address, and /v1/models listing the
names. About one real start (50 s on the 2-core machine)."""

from __future__ import annotations

import json
import textwrap
import time
from collections.abc import Iterator

import pytest

from tests.integration.conftest import booted_sandbox
from tests.integration.gpudctl import SandboxGpud, sim_config
from tests.vllm.servers import MODEL, REAL_ENV, REAL_START_S, VLLM

pytestmark = [pytest.mark.sandbox, pytest.mark.usefixtures("real_vllm")]

ROUTER = 30190


def config() -> str:
    env = ", ".join(f'{k} = "{v}"' for k, v in REAL_ENV.items())
    serves = textwrap.dedent(f"""
        [serves.tiny]
        role = "cpu"
        vram_mib = 4096
        port = 30191
        start_timeout_s = {REAL_START_S:g}
        models = ["tiny-chat", "tiny-fast"]
        environment = {{ {env} }}
        [serves.tiny.vllm]
        model = "{MODEL}"
        max_model_len = 512
        extra_args = ["--enforce-eager"]
        """)
    return (sim_config('[roles.cpu]\ndevice = "GPU-sim-0"\n', serves,
                       daemon=f'vllm_executable = "{VLLM}"')
            + f'[router]\nlisten = "127.0.0.1:{ROUTER}"\n')


@pytest.fixture(scope="module")
def gpud(real_vllm: None) -> Iterator[SandboxGpud]:
    for sb in booted_sandbox("gpud-vllm-router"):
        ctl = SandboxGpud(sb)
        ctl.configure(config())
        try:
            assert ctl.call("POST", "/v1/serves/tiny/start", {}).status == 200
            ctl.wait_state("tiny", "running", timeout=REAL_START_S)
            yield ctl
        finally:
            ctl.reset()
            sb.run("systemctl stop gpud-front.service; rm -rf /run/gpud/front", check=False)


def post(gpud: SandboxGpud, doc: dict[str, object], *, stream: bool = False) -> str:
    return gpud.sb.run(["curl", "-s" + ("N" if stream else ""), "-H",
                        "Content-Type: application/json", "-d", json.dumps(doc),
                        f"http://127.0.0.1:{ROUTER}/v1/completions"], timeout=120).stdout


def test_a_completion_and_a_stream_through_the_router(gpud: SandboxGpud) -> None:
    argv = gpud.unit_prop("gpud-serve-tiny.service", "ExecStart")
    assert "--served-model-name tiny-chat tiny-fast" in argv, argv
    listed = json.loads(gpud.sb.run(["curl", "-s", f"http://127.0.0.1:{ROUTER}/v1/models"]
                                    ).stdout)
    assert [(m["id"], m["gpud"]["state"]) for m in listed["data"]] == [
        ("tiny-chat", "running"), ("tiny-fast", "running")]
    for name in ("tiny-chat", "tiny-fast"):
        doc = json.loads(post(gpud, {"model": name, "prompt": "Hello", "max_tokens": 4}))
        # vLLM names the first of its served names in its answers
        assert doc["object"] == "text_completion" and doc["model"] == "tiny-chat", doc
        assert doc["usage"]["completion_tokens"] >= 1, doc
    started = time.monotonic()
    out = post(gpud, {"model": "tiny-fast", "prompt": "Hello", "max_tokens": 8,
                      "stream": True}, stream=True)
    events = [line[6:] for line in out.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) >= 3, out
    assert json.loads(events[0])["object"] == "text_completion", events[0]
    print(f"\nstream of {len(events) - 1} chunks in {time.monotonic() - started:.2f} s")
    # a name vLLM does not answer to is the router's 404, not vLLM's
    doc = json.loads(post(gpud, {"model": str(MODEL), "prompt": "x", "max_tokens": 1}))
    assert doc["error"]["code"] == "model_not_found", doc
