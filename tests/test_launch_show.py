"""What `gpud --check-config --show-commands` prints (show_commands), in-process: a serve on
two devices, container serves and the CDI names of their devices, and a fronted serve."""

from __future__ import annotations

import textwrap

from gpud.config import parse_config
from gpud.core.launch import show_commands
from gpud.core.observation import DeviceSample

CONFIG = """
[daemon]
serve_socket_dir = "/run/gpud/serves"
[roles.a]
device = "GPU-a"
capacity_mib = 20000
[roles.b]
device = "GPU-b"
capacity_mib = 20000
[roles.seven]
device = "7"
capacity_mib = 20000
[serves.tp]
roles = ["a", "b"]
vram_mib = 4000
port = 9001
priority = 1
[serves.tp.vllm]
model = "org/m"
[serves.boxed]
role = "a"
vram_mib = 1000
priority = 2
[serves.boxed.container]
image = "img:1"
[serves.unseen]
role = "seven"
vram_mib = 1000
priority = 3
[serves.unseen.container]
image = "img:1"
[serves.fronted]
role = "b"
vram_mib = 2000
port = 9004
priority = 4
sleep_level = 1
[serves.fronted.vllm]
model = "org/f"
[serves.pair]
roles = ["a", "b"]
vram_mib = 1000
priority = 5
[serves.pair.container]
image = "img:1"
"""
DEVICES = (DeviceSample("GPU-a", 3, "", "", 30000, None, None),
           DeviceSample("GPU-b", 5, "", "", 20000, None, None))
CACHE = ("HF_HOME=/var/cache/gpud-serve/huggingface HOME=/var/cache/gpud-serve "
         "VLLM_CACHE_ROOT=/var/cache/gpud-serve/vllm")
VLLM_ENV = "VLLM_ENGINE_READY_TIMEOUT_S=900 VLLM_NO_USAGE_STATS=1"
PODMAN = "  argv: podman run --rm --replace --name gpud-serve-{} --cgroups=split --sdnotify=conmon -d"
NO_SPEC = ("  refused: no CDI spec offers nvidia.com/gpu={} (or index {}): run `nvidia-ctk cdi "
           "generate --output=/etc/cdi/nvidia.yaml`")


def show(cdi_names: set[str] | None) -> list[str]:
    return show_commands(parse_config(textwrap.dedent(CONFIG), "t.toml"), DEVICES, "NVML",
                         cdi_names=cdi_names)


def test_show_commands_of_two_devices_containers_and_a_front() -> None:
    assert show({"GPU-a", "7"}) == [
        "device totals from NVML:",
        "  3: GPU-a 30000 MiB",
        "  5: GPU-b 20000 MiB",
        # on two devices: both named, the utilization against the smaller total (4000 / 20000)
        "serve tp: roles a, b, devices device 3 (GPU-a, 30000 MiB); device 5 (GPU-b, 20000 MiB), "
        "4000 MiB on each",
        f"  environment: CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=3,5 {CACHE} {VLLM_ENV} "
        "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS=5 XDG_CACHE_HOME=/var/cache/gpud-serve",
        "  argv: vllm serve org/m --host 127.0.0.1 --port 9001 --gpu-memory-utilization 0.2000 "
        "--tensor-parallel-size 2 --shutdown-timeout 20",
        "  runs as: gpud-serve, hardened unit",
        # a container: its device by the UUID the specs offer; root's, unhardened
        "serve boxed: role a, device 3 (GPU-a, 30000 MiB), 1000 MiB",
        "  environment: CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=3",
        PODMAN.format("boxed") + " --pull=never --device=nvidia.com/gpu=GPU-a --stop-timeout=30 "
        "img:1",
        "  runs as: root, unhardened unit",
        # a device NVML does not list: by its index
        "serve unseen: role seven, device '7' (total unknown), 1000 MiB",
        "  environment: CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=7",
        PODMAN.format("unseen") + " --pull=never --device=nvidia.com/gpu=7 --stop-timeout=30 "
        "img:1",
        "  runs as: root, unhardened unit",
        # fronted: on its socket in daemon.serve_socket_dir
        "serve fronted: role b, device 5 (GPU-b, 20000 MiB), 2000 MiB",
        f"  environment: CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=5 {CACHE} {VLLM_ENV} "
        "VLLM_SERVER_DEV_MODE=1 VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS=5 "
        "XDG_CACHE_HOME=/var/cache/gpud-serve",
        "  argv: vllm serve org/f --uds /run/gpud/serves/fronted.sock --gpu-memory-utilization "
        "0.1000 --shutdown-timeout 20 --enable-sleep-mode",
        "  runs as: gpud-serve, hardened unit",
        # one of its two devices offered by no spec: refused, naming that one
        "serve pair: roles a, b, devices device 3 (GPU-a, 30000 MiB); device 5 (GPU-b, 20000 "
        "MiB), 1000 MiB on each",
        NO_SPEC.format("GPU-b", 5),
    ]


def argv_of(lines: list[str], serve: str) -> str:
    at = next(i for i, line in enumerate(lines) if line.startswith(f"serve {serve}:"))
    return lines[at + 1] if lines[at + 1].startswith("  refused") else lines[at + 2]


def test_show_commands_names_container_devices_by_uuid_else_index() -> None:
    unread = show(None)  # the specs not read: the UUID, else the index
    assert argv_of(unread, "pair") == PODMAN.format("pair") + (
        " --pull=never --device=nvidia.com/gpu=GPU-a --device=nvidia.com/gpu=GPU-b "
        "--stop-timeout=30 img:1")
    assert argv_of(unread, "unseen") == PODMAN.format("unseen") + (
        " --pull=never --device=nvidia.com/gpu=7 --stop-timeout=30 img:1")
    by_index = show({"3"})
    assert argv_of(by_index, "boxed") == PODMAN.format("boxed") + (
        " --pull=never --device=nvidia.com/gpu=3 --stop-timeout=30 img:1")
    assert argv_of(by_index, "unseen") == NO_SPEC.format(7, 7)
    assert argv_of(by_index, "pair") == NO_SPEC.format("GPU-b", 5)


def test_show_commands_of_a_command_on_two_devices() -> None:
    cfg = parse_config(textwrap.dedent("""
        [roles.a]
        device = "GPU-a"
        capacity_mib = 20000
        [roles.b]
        device = "GPU-b"
        capacity_mib = 20000
        [roles.x]
        device = "GPU-x"
        capacity_mib = 20000
        [roles.y]
        device = "GPU-y"
        capacity_mib = 20000
        [serves.both]
        roles = ["a", "b"]
        vram_mib = 1000
        command = ["/bin/c", "{device_index}", "{device_indexes}"]
        [serves.lost]
        roles = ["x", "y"]
        vram_mib = 1000
        command = ["/bin/c"]
        """), "t.toml")
    lines = show_commands(cfg, DEVICES, "NVML")
    # {device_index} is the first of its devices, in the order of its roles
    assert argv_of(lines, "both") == "  argv: /bin/c 3 3,5"
    # two devices that resolve to no index: the first is named
    assert argv_of(lines, "lost") == "  refused: device 'GPU-x' cannot be resolved to an index"
