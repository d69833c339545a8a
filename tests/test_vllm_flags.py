"""The committed flag table of `vllm serve` 0.33 and the check of an argv against it."""

from __future__ import annotations

import pytest

from gpud.vllm.vllm_flags import DEFAULT_VERSION, available_versions, check_serve_args, load_table

TABLE = load_table(DEFAULT_VERSION)


def messages(*args: str) -> list[tuple[int, str]]:
    return [(p.index, p.message) for p in check_serve_args(["org/model", *args], TABLE)]


def test_the_table_is_vllm_0_33s() -> None:
    assert "0.33.0" in available_versions()
    assert TABLE.version == "0.33.0" and TABLE.series == "0.33"
    # Facts read in vLLM 0.33's own parser (scripts/vllm-flags walked it).
    for name in ("--host", "--port", "--gpu-memory-utilization", "--max-model-len",
                 "--revision", "--kv-cache-memory-bytes", "--shutdown-timeout",
                 "--enable-sleep-mode", "--served-model-name"):
        assert name in TABLE.options, name
    for gone in ("--task", "--swap-space", "--disable-frontend-multiprocessing"):
        assert gone not in TABLE.options and gone in TABLE.removed
    assert TABLE.options["--runner"].choices == ("auto", "draft", "generate", "pooling")
    assert TABLE.options["--convert"].choices == ("auto", "classify", "embed", "none")
    assert "compressed-tensors" in (TABLE.options["--quantization"].choices or ())
    assert TABLE.options["-tp"] is TABLE.options["--tensor-parallel-size"]
    assert not TABLE.options["--enforce-eager"].takes_value
    assert TABLE.options["--compilation-config"].json


def test_unknown_version_names_the_known_ones() -> None:
    with pytest.raises(KeyError, match=r"0\.33\.0"):
        load_table("0.1.0")


def test_a_good_argv_passes() -> None:
    assert messages("--host", "127.0.0.1", "--port=30001", "--gpu_memory_utilization", "0.4396",
                    "--runner", "pooling", "-tp", "2", "--enforce-eager", "--no-enforce-eager",
                    "--served-model-name", "a", "b", "-O3", "--compilation-config.mode", "3",
                    "--override-generation-config", '{"temperature": 0.5}',
                    "--seed", "-1") == []


def test_removed_option_has_its_hint() -> None:
    [(index, message)] = messages("--port", "1", "--task", "embed")
    assert index == 3
    assert message.startswith("--task was removed (not an option of vLLM 0.33.0); use --runner "
                              "pooling")


@pytest.mark.parametrize(("args", "expected"), [
    (["--swap-space", "4"], "--swap-space was removed"),
    (["--disable-frontend-multiprocessing"], "--disable-frontend-multiprocessing was removed"),
    (["--prot", "1"], "--prot is not an option of vllm serve in vLLM 0.33.0; did you mean --port?"),
    (["--kv-cache-memory", "1"], "--kv-cache-memory is an abbreviation of --kv-cache-memory-bytes"),
    (["--runner", "embedding"], "--runner 'embedding': not one of auto, draft, generate, pooling"),
    (["--quantization", "fp9"], "--quantization 'fp9': not one of"),
    (["--max-model-len"], "--max-model-len needs a value"),
    (["--max-model-len", "--enforce-eager"], "--max-model-len needs a value"),
    (["--enforce-eager=true"], "--enforce-eager takes no value"),
    (["--port.x", "1"], "--port does not take JSON"),
    (["--port", "1", "stray"], "unexpected argument 'stray'"),
    (["--"], "'--' is not an option"),
])
def test_bad_argv(args: list[str], expected: str) -> None:
    found = messages(*args)
    assert len(found) == 1, found
    assert found[0][1].startswith(expected), found
