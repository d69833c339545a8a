"""A container serve's `podman run` argv, one piece at a time: the container's own options
(container_argv) and what follows the image (serve_argv: vLLM's argv less its entrypoint, or
container.args with the devices numbered from 0 inside)."""

from __future__ import annotations

from typing import Any

import pytest

from gpud.config import ServeConfig
from gpud.core.launch import container_argv, container_name, serve_argv
from gpud.errors import Unavailable

IMAGE = "localhost/serve:1"
HEAD = ["podman", "run", "--rm", "--replace", "--name", "gpud-serve-s", "--cgroups=split",
        "--sdnotify=conmon", "-d", "--pull=never"]
PUBLISH = ["--publish=127.0.0.1:9000:9000"]
TAIL = ["--stop-timeout=30", IMAGE, "inner"]


def container(*, port: int | None = 9000, vllm: dict[str, Any] | None = None,
              **options: Any) -> ServeConfig:
    data: dict[str, Any] = {"role": "r", "vram_mib": 1000, "port": port,
                            "container": {"image": IMAGE, **options}}
    if vllm is not None:
        data["vllm"] = vllm
    return ServeConfig.model_validate(data)


def argv(serve: ServeConfig, **kw: Any) -> list[str]:
    return container_argv("s", serve, ["inner"], **{"devices": (), "forward_env": (), **kw})


def test_the_container_is_named_like_the_unit() -> None:
    assert container_name("s") == "gpud-serve-s"
    assert container_name("a-b") == "gpud-serve-a-b"


@pytest.mark.parametrize(("serve", "kw", "expected"), [
    (container(), {}, HEAD + PUBLISH + TAIL),
    (container(), {"executable": "/usr/bin/podman"}, ["/usr/bin/podman", *HEAD[1:], *PUBLISH,
                                                      *TAIL]),
    (container(pull="missing"), {}, [*HEAD[:-1], "--pull=missing", *PUBLISH, *TAIL]),
    # one --device per CDI name, in the order of the serve's roles
    (container(), {"devices": ["GPU-b", "0"]},
     [*HEAD, "--device=nvidia.com/gpu=GPU-b", "--device=nvidia.com/gpu=0", *PUBLISH, *TAIL]),
    # no port: nothing published
    (container(port=None), {}, HEAD + TAIL),
    # the serve's host, bracketed when it is an IPv6 address
    (container(vllm={"model": "m", "host": "::1"}), {},
     [*HEAD, "--publish=[::1]:9000:9000", *TAIL]),
    (container(vllm={"model": "m", "host": "10.0.0.2"}), {},
     [*HEAD, "--publish=10.0.0.2:9000:9000", *TAIL]),
    # fronted: the sockets' directory bind-mounted at the same path, no port published
    (container(), {"socket": "/run/gpud/serves/s.sock"},
     [*HEAD, "--volume=/run/gpud/serves:/run/gpud/serves:rw", *TAIL]),
    (container(ipc="host"), {}, HEAD + PUBLISH + ["--ipc=host"] + TAIL),
    (container(shm_size="8g"), {}, HEAD + PUBLISH + ["--shm-size=8g"] + TAIL),
    # volumes: read-only unless they say rw (or ro already)
    (container(volumes=["/a:/b", "/c:/d:rw", "/e:/f:ro", "/g:/h:z", "/i:/j:z,rw", "/k:/l:ro,z"]),
     {},
     HEAD + PUBLISH + ["--volume=/a:/b:ro", "--volume=/c:/d:rw", "--volume=/e:/f:ro",
                       "--volume=/g:/h:z,ro", "--volume=/i:/j:z,rw", "--volume=/k:/l:ro,z"]
     + TAIL),
    # the variables by name, sorted, less the host's view of the devices
    (container(), {"forward_env": ["B", "CUDA_VISIBLE_DEVICES", "A", "CUDA_DEVICE_ORDER", "B"]},
     HEAD + PUBLISH + ["--env=A", "--env=B"] + TAIL),
    (container().model_copy(update={"stop_timeout_s": 45.2}), {},
     [*HEAD, *PUBLISH, "--stop-timeout=46", IMAGE, "inner"]),
])
def test_container_argv(serve: ServeConfig, kw: dict[str, Any], expected: list[str]) -> None:
    assert argv(serve, **kw) == expected


def run(serve: ServeConfig, **kw: Any) -> list[str]:
    """What follows the image in serve S's podman argv on a 10000 MiB device."""
    got = serve_argv(serve, **{"total_mib": 10_000, "device_index": 4, "vllm_executable": "vllm",
                               "name": "s", **kw})
    assert got[:len(HEAD)] == HEAD
    return got[got.index(IMAGE) + 1:]


def test_a_vllm_container_runs_the_images_entrypoint_listening_inside() -> None:
    serve = container(vllm={"model": "org/m"})
    assert run(serve) == ["org/m", "--host", "0.0.0.0", "--port", "9000",
                          "--gpu-memory-utilization", "0.1000", "--shutdown-timeout", "20"]


def test_a_fronted_vllm_container_binds_its_socket_inside() -> None:
    serve = container(vllm={"model": "org/m", "host": "10.0.0.2"})
    assert run(serve, socket="/run/gpud/serves/s.sock") == [
        "org/m", "--uds", "/run/gpud/serves/s.sock", "--gpu-memory-utilization", "0.1000",
        "--shutdown-timeout", "20"]


ARGS = ["--port", "{port}", "--util", "{gpu_memory_utilization}", "--gpu", "{device_index}",
        "--gpus", "{device_indexes}", "--socket", "{socket}", "--mib", "{vram_mib}"]


@pytest.mark.parametrize(("kw", "expected"), [
    # inside, CDI left only the serve's devices: numbered from 0
    ({"device_indexes": [5, 2]}, ["0", "0,1", ""]),
    ({"device_indexes": [3]}, ["0", "0", ""]),
    ({}, ["0", "0", ""]),
    ({"socket": "/run/gpud/serves/s.sock"}, ["0", "0", "/run/gpud/serves/s.sock"]),
])
def test_a_command_containers_args_are_filled_for_inside(kw: dict[str, Any],
                                                         expected: list[str]) -> None:
    gpu, gpus, socket = expected
    assert run(container(args=ARGS), **kw) == [
        "--port", "9000", "--util", "0.1000", "--gpu", gpu, "--gpus", gpus, "--socket", socket,
        "--mib", "1000"]


def test_a_container_without_args_runs_the_image_as_it_is() -> None:
    assert run(container()) == []
    # and needs no device total: nothing asks for the utilization
    assert run(container(), total_mib=None) == []
    assert run(container(args=["--x"]), total_mib=None) == ["--x"]


def test_a_container_asking_for_the_utilization_needs_the_device_total() -> None:
    with pytest.raises(Unavailable, match="device total is unknown"):
        run(container(args=["--util={gpu_memory_utilization}"]), total_mib=None)
    with pytest.raises(Unavailable, match="device total is unknown"):
        run(container(vllm={"model": "m"}), total_mib=None)
