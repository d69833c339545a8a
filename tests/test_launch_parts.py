"""The pieces of a launch, one function at a time, as tables: the vllm argv with the key each
argument comes from, the calibrated KV cache, which serves boot together, and the container's
device names and published host."""

from __future__ import annotations

from typing import Any

import pytest

from gpud.config import ServeConfig
from gpud.core.launch import (
    DEFAULT_HOST,
    MIB,
    BootStep,
    _publish_host,
    boot_steps,
    cdi_device_name,
    kv_cache_fit_mib,
    start_sharing,
    vllm_arg_parts,
    with_kv_cache,
)
from gpud.core.vllm_versions import EXTENSIBLE_KV_OFF, NEWEST_KNOWN, V034


def vllm_serve(*, port: int | None = 8000, roles: list[str] | None = None,
               priority: int = 100, sleep_level: int = 0, **vllm: Any) -> ServeConfig:
    data: dict[str, Any] = {"vram_mib": 4000, "priority": priority, "port": port,
                            "sleep_level": sleep_level, "front": False,
                            "vllm": {"model": "org/model", **vllm}}
    data.update({"roles": roles} if roles else {"role": "r"})
    return ServeConfig.model_validate(data)


def command_serve(priority: int = 100) -> ServeConfig:
    return ServeConfig.model_validate({"role": "r", "vram_mib": 1000, "priority": priority,
                                       "command": ["/bin/true"]})


def parts(serve: ServeConfig, **kw: Any) -> list[tuple[str, str]]:
    return vllm_arg_parts(serve, executable="vllm", util="0.5000", **kw)


BASE_HEAD = [("vllm", "vllm.executable"), ("serve", "vllm"), ("org/model", "vllm.model")]
HOST = [("--host", "vllm.host"), ("127.0.0.1", "vllm.host")]
PORT = [("--port", "port"), ("8000", "port")]
UTIL = [("--gpu-memory-utilization", "vram_mib"), ("0.5000", "vram_mib")]
SHUTDOWN = [("--shutdown-timeout", "stop_timeout_s"), ("20", "stop_timeout_s")]


@pytest.mark.parametrize(("serve", "kw", "expected"), [
    (vllm_serve(), {}, BASE_HEAD + HOST + PORT + UTIL + SHUTDOWN),
    # no port: no --port (serve_argv refuses such a vllm serve before; the parts say nothing)
    (vllm_serve(port=None), {}, BASE_HEAD + HOST + UTIL + SHUTDOWN),
    (vllm_serve(revision="abc"), {},
     [*BASE_HEAD, ("--revision", "vllm.revision"), ("abc", "vllm.revision"),
      *HOST, *PORT, *UTIL, *SHUTDOWN]),
    # the host: the caller's, else the serve's, else 127.0.0.1
    (vllm_serve(host="10.0.0.1"), {},
     [*BASE_HEAD, ("--host", "vllm.host"), ("10.0.0.1", "vllm.host"), *PORT, *UTIL, *SHUTDOWN]),
    (vllm_serve(host="10.0.0.1"), {"host": "0.0.0.0"},
     [*BASE_HEAD, ("--host", "vllm.host"), ("0.0.0.0", "vllm.host"), *PORT, *UTIL, *SHUTDOWN]),
    # fronted: --uds instead of --host and --port (the port is the front's)
    (vllm_serve(), {"socket": "/run/gpud/serves/s.sock"},
     [*BASE_HEAD, ("--uds", "front"), ("/run/gpud/serves/s.sock", "front"), *UTIL, *SHUTDOWN]),
    (vllm_serve(host="10.0.0.1"), {"socket": "/s.sock", "host": "0.0.0.0"},
     [*BASE_HEAD, ("--uds", "front"), ("/s.sock", "front"), *UTIL, *SHUTDOWN]),
    # one GPU per role: --tensor-parallel-size for two roles or more, never for one
    (vllm_serve(roles=["a", "b"]), {},
     BASE_HEAD + HOST + PORT + UTIL
     + [("--tensor-parallel-size", "roles"), ("2", "roles")] + SHUTDOWN),
    (vllm_serve(roles=["a", "b", "c"]), {},
     BASE_HEAD + HOST + PORT + UTIL
     + [("--tensor-parallel-size", "roles"), ("3", "roles")] + SHUTDOWN),
    (vllm_serve(roles=["a"]), {}, BASE_HEAD + HOST + PORT + UTIL + SHUTDOWN),
    (vllm_serve(max_model_len=4096, quantization="fp8"), {},
     BASE_HEAD + HOST + PORT + UTIL
     + [("--max-model-len", "vllm.max_model_len"), ("4096", "vllm.max_model_len"),
        ("--quantization", "vllm.quantization"), ("fp8", "vllm.quantization")] + SHUTDOWN),
    (vllm_serve(kv_cache_mib=1000), {},
     BASE_HEAD + HOST + PORT + UTIL
     + [("--kv-cache-memory-bytes", "vllm.kv_cache_mib"),
        (str(1000 * MIB), "vllm.kv_cache_mib")] + SHUTDOWN),
    # "calibrated" without a figure resolved: no flag, sized by profiling
    (vllm_serve(kv_cache_mib="calibrated"), {}, BASE_HEAD + HOST + PORT + UTIL + SHUTDOWN),
    (vllm_serve(sleep_level=1), {},
     BASE_HEAD + HOST + PORT + UTIL + SHUTDOWN + [("--enable-sleep-mode", "sleep_level")]),
    # vLLM 0.34: the extensible KV cache turned off
    (vllm_serve(), {"vllm_version": V034},
     BASE_HEAD + HOST + PORT + UTIL + SHUTDOWN + [(EXTENSIBLE_KV_OFF, "vllm")]),
    # the names the router routes here, answered by vLLM itself; then the operator's own
    (vllm_serve(sleep_level=1, extra_args=["--seed", "1"]).model_copy(
        update={"models": ["a", "b"]}), {"vllm_version": V034},
     BASE_HEAD + HOST + PORT + UTIL + SHUTDOWN
     + [("--enable-sleep-mode", "sleep_level"), (EXTENSIBLE_KV_OFF, "vllm"),
        ("--served-model-name", "models"), ("a", "models"), ("b", "models"),
        ("--seed", "vllm.extra_args[0]"), ("1", "vllm.extra_args[1]")]),
    (vllm_serve(extra_args=["--seed", "1"], executable="/opt/v/bin/vllm"), {},
     [("/opt/v/bin/vllm", "vllm.executable"), *BASE_HEAD[1:],
      *HOST, *PORT, *UTIL, *SHUTDOWN,
      ("--seed", "vllm.extra_args[0]"), ("1", "vllm.extra_args[1]")]),
])
def test_vllm_arg_parts(serve: ServeConfig, kw: dict[str, Any],
                        expected: list[tuple[str, str]]) -> None:
    assert parts(serve, **kw) == expected


def test_a_release_gpud_has_no_rules_for_is_launched_by_the_newest_rules_and_a_non_version_never() -> None:
    """A release with no rules of its own borrows the newest known release's (issue 54: never
    refused for that alone, and said where gpud speaks: tests/test_vllm_tables.py); a string that
    is not a vLLM version raises instead of launching as some release."""
    assert parts(vllm_serve(), vllm_version="0.99.0") == parts(vllm_serve(),
                                                               vllm_version=NEWEST_KNOWN)
    with pytest.raises(KeyError, match=r"'latest' is not a vLLM version"):
        parts(vllm_serve(), vllm_version="latest")


def test_vllm_arg_parts_of_a_command_serve_is_an_error() -> None:
    with pytest.raises(ValueError, match="not a vllm serve"):
        parts(command_serve())


FIGURES = {"budget_mib": 8000, "context_mib": 500, "kv_cache_mib": 5000}


@pytest.mark.parametrize(("vram", "figures", "fit"), [
    # 10000 - context 500 - (budget 8000 - KV 5000 = 3000) - margin 2% 200
    (10000, FIGURES, 6300),
    # vLLM's own recommendation, when given, is what the budget keeps for the KV cache
    (10000, {**FIGURES, "recommended_kv_cache_mib": 6000}, 7300),
    (10000, {**FIGURES, "recommended_kv_cache_mib": 0}, 6300),  # 0: no recommendation
    # the margin: 2% of the reservation, at least 64 MiB
    (3250, {"budget_mib": 2000, "context_mib": 100, "kv_cache_mib": 1500}, 3250 - 100 - 500 - 65),
    (3200, {"budget_mib": 2000, "context_mib": 100, "kv_cache_mib": 1500}, 3200 - 100 - 500 - 64),
    (3199, {"budget_mib": 2000, "context_mib": 100, "kv_cache_mib": 1500}, 3199 - 100 - 500 - 64),
    (1000, {"budget_mib": 2000, "context_mib": 100, "kv_cache_mib": 1500}, 1000 - 100 - 500 - 64),
    # exactly one MiB left is a KV cache; none left is not
    (665, {"budget_mib": 2000, "context_mib": 100, "kv_cache_mib": 1500}, 1),
    (664, {"budget_mib": 2000, "context_mib": 100, "kv_cache_mib": 1500}, None),
    (600, {"budget_mib": 2000, "context_mib": 100, "kv_cache_mib": 1500}, None),
])
def test_kv_cache_fit(vram: int, figures: dict[str, int], fit: int | None) -> None:
    got, how = kv_cache_fit_mib(vram, figures)
    assert got == fit
    if fit is None:
        assert how.startswith("no room for a KV cache: vram_mib")
        assert how.endswith(f"= {vram - figures['context_mib'] - 500 - 64} MiB")
    else:
        assert how.startswith(f"vram_mib {vram} - context {figures['context_mib']} - ")


def test_kv_cache_fit_says_how() -> None:
    assert kv_cache_fit_mib(10000, FIGURES) == (
        6300, "vram_mib 10000 - context 500 - weights, activation peak and CUDA graphs 3000 "
              "- margin 200")


@pytest.mark.parametrize("figures", [
    {}, {"context_mib": 500, "kv_cache_mib": 5000}, {"budget_mib": 8000, "kv_cache_mib": 5000},
    {"budget_mib": 8000, "context_mib": 500},
    {**FIGURES, "budget_mib": True},  # a bool is not a figure
    {**FIGURES, "context_mib": "500"},
])
def test_kv_cache_fit_needs_every_figure(figures: dict[str, object]) -> None:
    got, why = kv_cache_fit_mib(10000, figures)
    assert got is None and why.startswith("no figure: the calibration needs")


def test_with_kv_cache_resolves_only_a_calibrated_vllm_serve() -> None:
    calibrated = vllm_serve(kv_cache_mib="calibrated", max_model_len=4096)
    sized = with_kv_cache(calibrated, 1234)
    assert sized.vllm is not None and sized.vllm.kv_cache_mib == 1234
    assert sized.vllm.max_model_len == 4096 and sized.vram_mib == calibrated.vram_mib
    assert calibrated.vllm is not None and calibrated.vllm.kv_cache_mib == "calibrated"
    assert with_kv_cache(calibrated, None) is calibrated  # no figure yet: profiling
    fixed = vllm_serve(kv_cache_mib=500)
    assert with_kv_cache(fixed, 1234) is fixed
    assert with_kv_cache(vllm_serve(), 1234).vllm.kv_cache_mib is None  # type: ignore[union-attr]
    command = command_serve()
    assert with_kv_cache(command, 1234) is command


@pytest.mark.parametrize(("serve", "shared", "why"), [
    (command_serve(), False, "starts alone: not a vllm serve"),
    (vllm_serve(), False, "starts alone: its KV cache is sized by profiling"),
    (vllm_serve(kv_cache_mib="calibrated"), False,
     'starts alone: kv_cache_mib = "calibrated" but no calibration gives a figure yet'),
    (vllm_serve(kv_cache_mib=700), True,
     "starts with its device's other exactly sized serves: KV cache 700 MiB"),
])
def test_start_sharing(serve: ServeConfig, shared: bool, why: str) -> None:
    got, text = start_sharing(serve)
    assert got is shared and text.startswith(why)


EXACT = "exactly sized (--kv-cache-memory-bytes): no profiling"
ALONE = "starts alone: its KV cache is sized by profiling"


def steps(serves: dict[str, tuple[ServeConfig, str]]) -> list[tuple[str, tuple[str, ...], bool]]:
    got = boot_steps({n: s for n, (s, _d) in serves.items()}, lambda n: serves[n][1])
    for step in got:
        assert isinstance(step, BootStep)
        assert step.why == EXACT if step.together else step.why.startswith("starts alone")
    return [(s.device, s.serves, s.together) for s in got]


def exact(priority: int = 100) -> ServeConfig:
    return vllm_serve(kv_cache_mib=700, priority=priority)


def util_sized(priority: int = 100) -> ServeConfig:
    return vllm_serve(priority=priority)


@pytest.mark.parametrize(("serves", "expected"), [
    ({}, []),
    ({"a": (exact(), "0")}, [("0", ("a",), True)]),
    ({"a": (util_sized(), "0")}, [("0", ("a",), False)]),
    # exactly sized serves on one device start together, in name order at equal priority
    ({"b": (exact(), "0"), "a": (exact(), "0")}, [("0", ("a", "b"), True)]),
    # a util-sized serve between them ends the run: the next ones start after it
    ({"a": (exact(1), "0"), "b": (util_sized(2), "0"), "c": (exact(3), "0"),
      "d": (exact(4), "0")},
     [("0", ("a",), True), ("0", ("b",), False), ("0", ("c", "d"), True)]),
    ({"a": (util_sized(1), "0"), "b": (util_sized(2), "0")},
     [("0", ("a",), False), ("0", ("b",), False)]),
    # in priority order, not name order
    ({"a": (util_sized(5), "0"), "b": (util_sized(1), "0")},
     [("0", ("b",), False), ("0", ("a",), False)]),
    # per device: another device's serves neither join nor end a run
    ({"a": (exact(1), "0"), "b": (exact(2), "1"), "c": (exact(3), "0")},
     [("0", ("a", "c"), True), ("1", ("b",), True)]),
    ({"a": (exact(1), "0"), "b": (util_sized(2), "1"), "c": (exact(3), "0")},
     [("0", ("a", "c"), True), ("1", ("b",), False)]),
    ({"a": (util_sized(1), "0"), "b": (exact(2), "0"), "c": (exact(3), "0")},
     [("0", ("a",), False), ("0", ("b", "c"), True)]),
    ({"a": (exact(1), "0"), "b": (util_sized(2), "0"), "c": (util_sized(3), "0"),
      "d": (exact(4), "0")},
     [("0", ("a",), True), ("0", ("b",), False), ("0", ("c",), False), ("0", ("d",), True)]),
])
def test_boot_steps(serves: dict[str, tuple[ServeConfig, str]],
                    expected: list[tuple[str, tuple[str, ...], bool]]) -> None:
    assert steps(serves) == expected


def test_boot_step_reasons() -> None:
    [alone, together] = boot_steps({"a": util_sized(1), "b": exact(2)}, lambda _n: "0")
    assert alone.why.startswith(ALONE) and not alone.together
    assert together.why == EXACT and together.together
    [joined] = boot_steps({"a": exact(1), "b": exact(2)}, lambda _n: "0")
    assert joined == BootStep("0", ("a", "b"), True, EXACT)


@pytest.mark.parametrize(("uuid", "index", "known", "name"), [
    # the specs not read: the UUID, else the index
    ("GPU-1", 3, None, "GPU-1"),
    ("", 3, None, "3"),
    ("", 0, None, "0"),
    # read: the UUID when offered, else the index, else none
    ("GPU-1", 3, ["GPU-1", "3"], "GPU-1"),
    ("GPU-1", 3, ["3"], "3"),
    ("GPU-1", 0, ["0", "all"], "0"),
    ("GPU-1", 3, ["GPU-2", "2", "all"], None),
    ("", 3, ["3"], "3"),
    ("", 3, ["", "4"], None),  # an empty UUID never names a device
    ("GPU-1", 3, [], None),
])
def test_cdi_device_name(uuid: str, index: int, known: list[str] | None,
                         name: str | None) -> None:
    assert cdi_device_name(uuid, index, None if known is None else iter(known)) == name


@pytest.mark.parametrize(("host", "published"), [
    (None, DEFAULT_HOST),
    ("10.0.0.1", "10.0.0.1"),
    ("::1", "[::1]"),  # an IPv6 address is bracketed in podman's --publish
    ("fe80::1", "[fe80::1]"),
])
def test_publish_host(host: str | None, published: str) -> None:
    assert _publish_host(vllm_serve(**({"host": host} if host else {}))) == published


def test_publish_host_of_a_command_container_is_the_default() -> None:
    serve = ServeConfig.model_validate({"role": "r", "vram_mib": 1000, "port": 9000,
                                        "container": {"image": "img", "args": ["x"]}})
    assert _publish_host(serve) == DEFAULT_HOST
