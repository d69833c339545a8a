"""More pieces of a launch as tables: the fingerprint's exact content, the utilization and the
device total of a serve on several devices, the placeholders of a command, and the sandbox of
a serve running as a named user."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from gpud.config import DaemonConfig, ServeConfig
from gpud.core.launch import (
    Hardening,
    command_argv,
    fingerprint,
    serve_argv,
    serve_identity,
    smallest_total,
    utilization,
)
from gpud.errors import Refused, Unavailable


def serve(**data: Any) -> ServeConfig:
    return ServeConfig.model_validate({"vram_mib": 1000, **({} if "roles" in data
                                                             else {"role": "r"}), **data})


def digest(what: dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


VLLM: dict[str, object] = {"model": "org/m", "revision": None, "quantization": None, "max_model_len": None,
        "extra_args": [], "command": None}
NOT_VLLM: dict[str, object] = {"model": None, "revision": None, "quantization": None, "max_model_len": None,
            "extra_args": None}


@pytest.mark.parametrize(("config", "what"), [
    ({"vllm": {"model": "org/m"}}, VLLM),
    ({"vllm": {"model": "org/m", "revision": "r1", "quantization": "fp8", "max_model_len": 4096,
               "extra_args": ["--seed", "1"]}},
     {**VLLM, "revision": "r1", "quantization": "fp8", "max_model_len": 4096,
      "extra_args": ["--seed", "1"]}),
    # kv_cache_mib only when set, so that the serves that never had it keep their calibrations
    ({"vllm": {"model": "org/m", "kv_cache_mib": 700}}, {**VLLM, "kv_cache_mib": 700}),
    ({"vllm": {"model": "org/m", "kv_cache_mib": "calibrated"}},
     {**VLLM, "kv_cache_mib": "calibrated"}),
    ({"command": ["/bin/x", "{port}"]}, {**NOT_VLLM, "command": ["/bin/x", "{port}"]}),
    # a container's image and args
    ({"vllm": {"model": "org/m"}, "container": {"image": "img:1"}},
     {**VLLM, "image": "img:1", "container_args": None}),
    ({"container": {"image": "img:1", "args": ["--a"]}},
     {**NOT_VLLM, "command": None, "image": "img:1", "container_args": ["--a"]}),
    # the number of devices, only past one (a serve on one keeps its calibration)
    ({"roles": ["a", "b"], "vllm": {"model": "org/m"}}, {**VLLM, "devices": 2}),
    ({"roles": ["a", "b", "c"], "vllm": {"model": "org/m"}}, {**VLLM, "devices": 3}),
    ({"roles": ["a"], "vllm": {"model": "org/m"}}, VLLM),
])
def test_fingerprint_is_a_hash_of_exactly_what_defines_the_serve(
        config: dict[str, Any], what: dict[str, object]) -> None:
    """Pinned: a fingerprint that changed across versions of gpud would lose every calibration."""
    assert fingerprint(serve(**config)) == digest(what)


def test_a_fingerprint_pinned_by_value() -> None:
    assert fingerprint(serve(vllm={"model": "org/m"})) == digest(VLLM) == "ccdcc037b26ee4ea"


@pytest.mark.parametrize(("totals", "smallest"), [
    ([], None), ([None], None), ([0], None), ([30000, None], None), ([None, 30000], None),
    ([30000], 30000), ([30000, 20000], 20000), ([20000, 30000], 20000),
])
def test_the_total_of_a_serve_on_several_devices_is_the_smallest(
        totals: list[int | None], smallest: int | None) -> None:
    assert smallest_total(totals) == smallest


def test_a_utilization_not_needed_is_never_refused() -> None:
    assert utilization("s", 1, 30000, needed=False) == "0.0000"
    assert utilization("s", 100, None, needed=False) == ""
    assert utilization("s", 100, 0, needed=False) == ""
    assert utilization("s", 3000, 30000) == "0.1000"
    with pytest.raises(Refused):
        utilization("s", 1, 30000)
    with pytest.raises(Unavailable):
        utilization("s", 100, 0)


PLACES = ["/x", "{port}", "{device_index}", "{device_indexes}", "{socket}",
          "{gpu_memory_utilization}", "{vram_mib}"]


@pytest.mark.parametrize(("port", "kw", "expected"), [
    (9000, {}, ["9000", "3", "3", ""]),
    (None, {}, ["", "3", "3", ""]),
    (9000, {"device_indexes": [3, 1]}, ["9000", "3", "3,1", ""]),
    (9000, {"socket": "/run/s.sock"}, ["9000", "3", "3", "/run/s.sock"]),
])
def test_command_placeholders_one_by_one(port: int | None, kw: dict[str, Any],
                                         expected: list[str]) -> None:
    cmd = serve(command=PLACES, port=port)
    assert command_argv(cmd, util="0.5", device_index=3, **kw) == ["/x", *expected, "0.5", "1000"]


@pytest.mark.parametrize(("socket", "filled"), [(None, ""), ("/run/s.sock", "/run/s.sock")])
def test_serve_argv_hands_a_command_its_socket(socket: str | None, filled: str) -> None:
    cmd = serve(command=["/x", "{socket}", "{device_indexes}"])
    assert serve_argv(cmd, total_mib=None, device_index=2, vllm_executable="v",
                      device_indexes=[2, 0], socket=socket) == ["/x", filled, "2,0"]


def test_a_fronted_vllm_serve_listens_on_its_socket() -> None:
    fronted = serve(vllm={"model": "m"}, port=9000)
    argv = serve_argv(fronted, total_mib=10_000, device_index=0, vllm_executable="v",
                      socket="/run/s.sock")
    assert argv[:5] == ["v", "serve", "m", "--uds", "/run/s.sock"]
    assert "--port" not in argv and "--host" not in argv
    # without a port of its own it needs none: the port is the front's
    bare = serve(vllm={"model": "m"})
    assert serve_argv(bare, total_mib=10_000, device_index=0, vllm_executable="v",
                      socket="/run/s.sock")[3:5] == ["--uds", "/run/s.sock"]
    with pytest.raises(Refused, match="needs a port"):
        serve_argv(bare, total_mib=10_000, device_index=0, vllm_executable="v")


@pytest.mark.parametrize(("home", "front_group", "hardening"), [
    ("/home/bob", None, Hardening("no", ("-/home/bob",), None, ())),
    ("/home/bob", "gpud-front", Hardening("no", ("/run/gpud/serves", "-/home/bob"), None,
                                          ("gpud-front",))),
    # no home, or /: nothing more is writable
    ("/", None, Hardening("no", (), None, ())),
    ("", None, Hardening("no", (), None, ())),
])
def test_a_named_users_sandbox(home: str, front_group: str | None,
                               hardening: Hardening) -> None:
    ident = serve_identity("s", serve(command=["/x"], user="bob"), DaemonConfig(),
                           home_of={"bob": home}.get, front_group=front_group)
    assert (ident.user, dict(ident.environment), ident.hardening) == ("bob", {}, hardening)


def test_the_default_users_sandbox_without_a_front() -> None:
    ident = serve_identity("s", serve(command=["/x"]), DaemonConfig(),
                           home_of={"gpud-serve": "/var/cache/gpud-serve"}.get)
    assert ident.hardening == Hardening("yes", (), "gpud-serve", ())
