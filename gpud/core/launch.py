"""How a serve is run: its argv, environment and fingerprint. Pure: values in, values out.

Commands come only from the root-owned config, never from a client request: nothing here takes
client input.
"""

from __future__ import annotations

import hashlib
import json
import math
import posixpath
import shlex
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from gpud.core.argv64 import encode
from gpud.core.config import Config, DaemonConfig, ServeConfig
from gpud.core.front import socket_path
from gpud.core.ledger import gpu_memory_utilization
from gpud.core.observation import DeviceSample, find_device
from gpud.core.vllm_versions import DEFAULT_VERSION, EXTENSIBLE_KV_OFF, behaviour
from gpud.core.vocab import SERVE_UNIT_SUFFIX, serve_unit
from gpud.errors import GpudError, Refused, Unavailable

# vLLM binds every interface unless told (vllm/entrypoints/launchers/launcher.py: setup_server
# binds `args.host or ""`); gpud's health checks go to loopback, so that is the default.
DEFAULT_HOST = "127.0.0.1"
MIB = 1 << 20

# Options gpud sets from the serve's keys: an extra_args copy would silently win (argparse keeps
# the last), so it is refused, naming the key to set instead.
GPUD_SET_OPTIONS: Mapping[str, str] = {
    "--revision": "vllm.revision",
    "--host": "vllm.host",
    "--port": "port",
    "--gpu-memory-utilization": "vram_mib",
    "--device-memory-utilization": "vram_mib",
    "--max-model-len": "vllm.max_model_len",
    "--quantization": "vllm.quantization",
    "-q": "vllm.quantization",
    "--kv-cache-memory-bytes": "vllm.kv_cache_mib",
    "--shutdown-timeout": "stop_timeout_s",
    "--enable-sleep-mode": "sleep_level",
}

# Options that would turn off what a serve's sleep_level turns on: refused when it has one
# (vLLM's --enable-sleep-mode is a BooleanOptionalAction: vllm/engine/arg_utils.py:379).
SLEEP_OFF_OPTIONS = ("--disable-sleep-mode", "--no-enable-sleep-mode")

# Options that take away the HTTP server gpud watches on the serve's port (vLLM 0.32.0:
# vllm/entrypoints/launchers/cli_args.py:435 --headless, :456 --grpc; launcher.py:394 --uds):
# the serve would never answer gpud's health checks, or (with --uds) answer none on its port.
NO_HTTP_OPTIONS: Mapping[str, str] = {
    "--uds": "serves vLLM's API on a Unix socket, not on the serve's port, where gpud polls "
             "/health",
    "--headless": "starts no API server (the engine alone): there is no /health to poll",
    "--grpc": "serves gRPC on the port instead of the HTTP OpenAI server: there is no /health "
              "to poll",
}


def stop_budget(stop_timeout_s: float) -> tuple[int, int]:
    """(drain, worker) seconds for a graceful vLLM stop inside systemd's TimeoutStopSec.

    On SIGTERM vLLM's API server lets in-flight requests finish for `--shutdown-timeout` seconds
    (0, its default, aborts them: vllm/entrypoints/launchers/launcher.py: handle_shutdown), then
    its process manager gives the engine `VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS` (default 5) to
    release the GPU before killing it (vllm/v1/engine/utils.py:
    get_engine_process_shutdown_timeout). Both fit in stop_timeout_s with one worker window
    spare, so systemd's SIGKILL never lands on an engine still freeing memory.
    """
    seconds = math.floor(stop_timeout_s)
    worker = 5 if seconds >= 15 else max(1, seconds // 3)
    return max(0, seconds - 2 * worker), worker


def vllm_environment(serve: ServeConfig) -> dict[str, str]:
    """What gpud sets in a vllm serve's environment (the serve's own `environment` wins)."""
    _drain, worker = stop_budget(serve.stop_timeout_s)
    return {
        # vLLM waits this long for its engine to come up (vllm/envs.py, default 600 s): never
        # less than gpud waits for the serve, or vLLM gives up on a slow load gpud allows.
        "VLLM_ENGINE_READY_TIMEOUT_S": str(math.ceil(serve.start_timeout_s)),
        "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": str(worker),
        "VLLM_NO_USAGE_STATS": "1",
        # vLLM registers /sleep, /wake_up and /is_sleeping, and /pause, only in dev mode
        # (vllm/entrypoints/launchers/api_server/routers.py: register_vllm_dev_api_routers and
        # register_rl_api_routers under envs.VLLM_SERVER_DEV_MODE, vllm 0.32). A serve that
        # sleeps needs them; a fronted one gets them for /pause, its told end (`tells_abort`).
        # Neither faces the network: a sleeper binds 127.0.0.1 (config check), a fronted serve
        # listens on its socket, and the front forwards no dev route.
        **({DEV_MODE: "1"} if serve.sleep_level or serve.front else {}),
    }


# vllm/envs.py: VLLM_SERVER_DEV_MODE is read as bool(int(value)), default "0"
DEV_MODE: Final = "VLLM_SERVER_DEV_MODE"


def tells_abort(serve: ServeConfig) -> bool:
    """Requests in flight on SERVE can be ended with a told end (`POST /pause?mode=abort`:
    vLLM's engine aborts each, a stream's last chunk says finish_reason "abort", and the
    router follows it with an error event), not merely cut by a stop: its environment, as gpud
    launches it, has vLLM's dev mode (gpud's for a vllm serve that sleeps or is fronted, or
    the serve's own `environment`), and gpud reaches it over HTTP (fronted, or a port).
    vllm/entrypoints/rl/online/api_router.py pause_generation (mode "abort" by default;
    vllm/v1/engine/async_llm.py pause_generation returns once the aborted requests' last
    outputs are out), vllm 0.32."""
    try:
        dev = bool(int(serve_environment(serve).get(DEV_MODE, "0") or "0"))
    except ValueError:
        dev = False
    return dev and (bool(serve.front) or serve.port is not None)


def unit_restart(serve: ServeConfig) -> Literal["no", "on-failure", "always"]:
    """The unit's Restart= for the serve's restart policy. A vllm serve's "on-failure" is
    "always": after its engine dies vLLM's API server exits with status 0 (seen on real vLLM:
    EngineDeadError logged, then a clean exit), which Restart=on-failure takes as a clean exit
    and does not restart, leaving the serve exited and its reservation held. systemd never
    restarts a unit its own stop job ended (systemd.service(5), Restart=), so gpud's stops stay
    stops."""
    if serve.vllm is not None and serve.restart == "on-failure":
        return "always"
    return serve.restart


SCHEDULING_POLICY: Final = "--scheduling-policy"


def scheduling_policy(args: Sequence[str]) -> str | None:
    """The vLLM scheduling policy ARGS choose (`--scheduling-policy P` or
    `--scheduling-policy=P`), None when they choose none."""
    for i, arg in enumerate(args):
        if arg.startswith(SCHEDULING_POLICY + "="):
            return arg.partition("=")[2]
        if arg == SCHEDULING_POLICY:
            return args[i + 1] if i + 1 < len(args) else ""
    return None


def vllm_arg_parts(serve: ServeConfig, *, executable: str, util: str,
                   host: str | None = None, socket: str | None = None,
                   vllm_version: str = DEFAULT_VERSION,
                   behind_router: bool = False) -> list[tuple[str, str]]:
    """The argv of a vllm serve, each argument with the key (under `serves.NAME.`) it comes
    from: `vllm serve MODEL [--revision R] --host H [--port P] --gpu-memory-utilization U
    [--max-model-len N] [--quantization Q] [--kv-cache-memory-bytes B] --shutdown-timeout D
    [--enable-sleep-mode] [--no-enable-extensible-kv-cache] [--served-model-name NAMES]
    [--scheduling-policy priority] [extra_args...]` (pinned by a golden test and checked
    against the flag table of `vllm_version`). BEHIND_ROUTER: the router reaches the serve; it
    runs with the priority policy (a key's priority and each requester's first request first
    are the body's `priority`, which vLLM orders by only under that policy: docs/router.md),
    unless its extra_args choose a policy. On vLLM 0.34 the
    extensible KV cache is turned off (gpud.core.vllm_versions; docs/vllm.md says why): the
    KV cache is then profiled and the start refused on a short device, as 0.33 does
    (vllm/v1/worker/utils.py:783-797 of 0.34.0)."""
    v = serve.vllm
    if v is None:
        raise ValueError("not a vllm serve")
    parts = [(v.executable or executable, "vllm.executable"), ("serve", "vllm"),
             (v.model, "vllm.model")]
    if v.revision:
        parts += [("--revision", "vllm.revision"), (v.revision, "vllm.revision")]
    if socket is not None:
        # A fronted serve: its port is the front's (vllm/entrypoints/openai/api_server.py:
        # setup_server binds args.uds instead of (host, port) when it is given).
        parts += [("--uds", "front"), (socket, "front")]
    else:
        parts += [("--host", "vllm.host"), (host or v.host or DEFAULT_HOST, "vllm.host")]
    if serve.port is not None and socket is None:
        parts += [("--port", "port"), (str(serve.port), "port")]
    parts += [("--gpu-memory-utilization", "vram_mib"), (util, "vram_mib")]
    if serve.roles is not None and len(serve.roles) > 1:
        # One GPU per role (vllm/engine/arg_utils.py: EngineArgs.add_cli_args, parallel group:
        # "--tensor-parallel-size", "-tp"); vLLM's utilization is per GPU.
        parts += [("--tensor-parallel-size", "roles"), (str(len(serve.all_roles)), "roles")]
    if v.max_model_len is not None:
        parts += [("--max-model-len", "vllm.max_model_len"),
                  (str(v.max_model_len), "vllm.max_model_len")]
    if v.quantization:
        parts += [("--quantization", "vllm.quantization"), (v.quantization, "vllm.quantization")]
    if isinstance(v.kv_cache_mib, int):  # "calibrated": resolved by with_kv_cache, or none
        parts += [("--kv-cache-memory-bytes", "vllm.kv_cache_mib"),
                  (str(v.kv_cache_mib * MIB), "vllm.kv_cache_mib")]
    drain, _worker = stop_budget(serve.stop_timeout_s)
    parts += [("--shutdown-timeout", "stop_timeout_s"), (str(drain), "stop_timeout_s")]
    if serve.sleep_level:
        parts += [("--enable-sleep-mode", "sleep_level")]
    if behaviour(vllm_version).extensible_kv_off_arg:
        parts += [(EXTENSIBLE_KV_OFF, "vllm")]
    if serve.models:
        # Every name the router routes here, answered by vLLM itself (no rewrite of the
        # body): vllm/engine/arg_utils.py:1006 --served-model-name (nargs "+"; the first
        # name is the one its answers carry).
        parts += [("--served-model-name", "models"), *((m, "models") for m in serve.models)]
    if behind_router and scheduling_policy(v.extra_args) is None:
        parts += [(SCHEDULING_POLICY, "router"), ("priority", "router")]
    parts += [(arg, f"vllm.extra_args[{i}]") for i, arg in enumerate(v.extra_args)]
    return parts


def vllm_argv(serve: ServeConfig, *, executable: str, util: str,
              host: str | None = None, socket: str | None = None,
              vllm_version: str = DEFAULT_VERSION, behind_router: bool = False) -> list[str]:
    return [arg for arg, _key in vllm_arg_parts(serve, executable=executable, util=util,
                                                host=host, socket=socket,
                                                vllm_version=vllm_version,
                                                behind_router=behind_router)]


def _fill(args: Sequence[str], serve: ServeConfig, *, util: str, device_index: int,
          device_indexes: Sequence[int] | None = None, socket: str = "") -> list[str]:
    indexes = list(device_indexes) if device_indexes is not None else [device_index]
    values: Mapping[str, object] = {
        "port": serve.port if serve.port is not None else "",
        "gpu_memory_utilization": util,
        "device_index": device_index,
        "device_indexes": visible_devices(indexes),
        "vram_mib": serve.vram_mib,
        "socket": socket,
    }
    return [arg.format_map(values) for arg in args]


def command_argv(serve: ServeConfig, *, util: str, device_index: int,
                 device_indexes: Sequence[int] | None = None, socket: str = "") -> list[str]:
    """An explicit command with its placeholders filled. Each argument is formatted on its own,
    so a value can never split into two arguments or reach a shell. `{device_index}` is the
    first device, `{device_indexes}` all of them, comma-separated (CUDA_VISIBLE_DEVICES form)."""
    if serve.command is None:
        raise ValueError("not a command serve")
    return _fill(serve.command, serve, util=util, device_index=device_index,
                 device_indexes=device_indexes, socket=socket)


KV_MARGIN_PCT = 2  # of the reservation, at least KV_MARGIN_MIN_MIB
KV_MARGIN_MIN_MIB = 64


def kv_cache_fit_mib(vram_mib: int, vllm: Mapping[str, object]) -> tuple[int | None, str]:
    """The KV cache (MiB) that fits the reservation with the serve sized exactly, from a
    calibration's vLLM figures (a util-sized start's: gpud.vllm.vllm_log), and how it was found, or
    None and why not. vram_mib less the context beyond vLLM's budget, less what the budget held
    besides the KV cache (weights, activation peak, CUDA graphs: the budget less vLLM's own
    --kv-cache-memory recommendation, which keeps its buffer, or less the KV cache it sized),
    less a margin (KV_MARGIN_PCT of the reservation, at least KV_MARGIN_MIN_MIB)."""
    def num(key: str) -> int | None:
        value = vllm.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    budget, context = num("budget_mib"), num("context_mib")
    kv = num("recommended_kv_cache_mib") or num("kv_cache_mib")
    if budget is None or context is None or kv is None:
        return None, ("no figure: the calibration needs a util-sized start's vLLM lines "
                      "(its budget, KV cache and context)")
    non_kv = budget - kv
    margin = max(KV_MARGIN_MIN_MIB, vram_mib * KV_MARGIN_PCT // 100)
    fit = vram_mib - context - non_kv - margin
    how = (f"vram_mib {vram_mib} - context {context} - weights, activation peak and CUDA graphs "
           f"{non_kv} - margin {margin}")
    if fit <= 0:
        return None, f"no room for a KV cache: {how} = {fit} MiB"
    return fit, how


def with_kv_cache(serve: ServeConfig, figure_mib: int | None) -> ServeConfig:
    """A serve with kv_cache_mib = "calibrated" as it starts: sized by its calibration's figure
    (kv_cache_fit_mib) when there is one, else unchanged (sized by profiling)."""
    v = serve.vllm
    if v is None or v.kv_cache_mib != "calibrated" or figure_mib is None:
        return serve
    return serve.model_copy(update={"vllm": v.model_copy(update={"kv_cache_mib": figure_mib})})


def start_sharing(serve: ServeConfig) -> tuple[bool, str]:
    """Whether the serve's start may share its devices with other such starts, and why (said in
    the boot's events and `gpuctl plan`). A vllm serve sized in bytes (vllm.kv_cache_mib →
    --kv-cache-memory-bytes) skips vLLM's memory profiling (vllm/v1/worker/gpu_worker.py,
    Worker.determine_available_memory), so a neighbour loading at the same time cannot shrink
    its KV cache; anything else profiles or is not known not to, and starts alone (vLLM
    #55827)."""
    if serve.vllm is None:
        return False, "starts alone: not a vllm serve, its sizing unknown to gpud"
    if serve.vllm.kv_cache_mib == "calibrated":
        return False, ('starts alone: kv_cache_mib = "calibrated" but no calibration gives a '
                       "figure yet (gpuctl calibrate NAME): sized by profiling until then")
    if serve.vllm.kv_cache_mib is None:
        return False, ("starts alone: its KV cache is sized by profiling (no vllm.kv_cache_mib), "
                       "which a neighbour loading at the same time would corrupt")
    return True, (f"starts with its device's other exactly sized serves: KV cache "
                  f"{serve.vllm.kv_cache_mib} MiB (--kv-cache-memory-bytes), no profiling")


@dataclass(frozen=True)
class BootStep:
    """One step of a device's boot: serves that start together (exactly sized), or one alone."""

    device: str
    serves: tuple[str, ...]
    together: bool
    why: str


def boot_steps(serves: Mapping[str, ServeConfig], device_of: Callable[[str], str]) -> list[BootStep]:
    """The boot of `serves` (those that start), per device in priority order: each util-sized
    serve alone, each run of exactly sized ones between them together (start_sharing; the
    device locks of gpud.life.locks do this at boot)."""
    steps: list[BootStep] = []
    open_run: dict[str, int] = {}  # device -> index in steps of its current run of together
    for _prio, name in sorted((s.priority, n) for n, s in serves.items()):
        device = device_of(name)
        shared, why = start_sharing(serves[name])
        at = open_run.get(device)
        if shared and at is not None:
            step = steps[at]
            steps[at] = BootStep(device, (*step.serves, name), True,
                                 "exactly sized (--kv-cache-memory-bytes): no profiling")
            continue
        steps.append(BootStep(device, (name,), shared,
                              "exactly sized (--kv-cache-memory-bytes): no profiling" if shared
                              else why))
        if shared:
            open_run[device] = len(steps) - 1
        else:
            open_run.pop(device, None)
    return steps


def uses_utilization(serve: ServeConfig) -> bool:
    args = [*(serve.command or ()), *((serve.container.args or ()) if serve.container else ())]
    return serve.vllm is not None or any("{gpu_memory_utilization}" in arg for arg in args)


# --- containers: podman run the way quadlet writes it ------------------------------------------

# What quadlet puts in every ExecStart (podman's pkg/systemd/quadlet/quadlet.go): the container
# named after the unit and replaced if a stale one holds the name, removed when it exits; its
# payload in a sub-cgroup of the unit's own cgroup (--cgroups=split: ".../gpud-serve-NAME.service/
# libpod-payload-ID"), so NVML's host PIDs still name the serve; conmon as the unit's main PID,
# READY=1 once the container runs (--sdnotify=conmon, with Type=notify and NotifyAccess=all);
# detached, since conmon, not podman, stays with the container.
PODMAN_RUN: tuple[str, ...] = ("run", "--rm", "--replace")
PODMAN_UNIT_FLAGS: tuple[str, ...] = ("--cgroups=split", "--sdnotify=conmon", "-d")
# vLLM's image (vllm/vllm-openai) has ENTRYPOINT ["vllm", "serve"]: what follows the image is
# the model and the options. Inside the container's own network namespace vLLM listens on every
# interface; the host side of the published port is the serve's host (127.0.0.1 by default).
CONTAINER_LISTEN = "0.0.0.0"
CDI_GPU_KIND = "nvidia.com/gpu"
# Set by gpud for the host's view of the devices: inside, CDI has left only the serve's own.
HOST_ONLY_ENV = frozenset({"CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"})


def container_name(name: str) -> str:
    """The container of serve NAME is named like its unit, so both find each other."""
    return serve_unit(name).removesuffix(SERVE_UNIT_SUFFIX)


def cdi_device_name(uuid: str, index: int, known: Iterable[str] | None) -> str | None:
    """The name under which a CDI spec offers a device: its UUID, else its index (nvidia-ctk
    cdi generate names devices by index, by UUID or both: --device-name-strategy). `known`: the
    names the host's specs define (None: not read; the UUID, else the index). None when the
    specs do not offer it."""
    if known is None:
        return uuid or str(index)
    names = set(known)
    for candidate in (uuid, str(index)):
        if candidate and candidate in names:
            return candidate
    return None


def _publish_host(serve: ServeConfig) -> str:
    host = (serve.vllm.host if serve.vllm is not None else None) or DEFAULT_HOST
    return f"[{host}]" if ":" in host else host


def container_argv(name: str, serve: ServeConfig, inner: Sequence[str], *,
                   devices: Sequence[str], forward_env: Iterable[str],
                   executable: str = "podman", socket: str | None = None) -> list[str]:
    """`podman run ...` for a container serve: `inner` is what follows the image, `devices` the
    CDI names of the serve's devices (one `--device nvidia.com/gpu=NAME` each), `forward_env` the
    variables the unit holds that the container gets (by name only: podman takes the value from
    its own environment, so a secret never appears in the argv or in `systemctl show`).
    `socket`: a fronted serve's, which it binds inside at the same path: the directory of the
    serves' sockets is bind-mounted (the host's permissions hold: only gpud and the front may
    enter it), and no port is published (the port is the front's)."""
    c = serve.container
    if c is None:
        raise ValueError("not a container serve")
    argv = [executable, *PODMAN_RUN, "--name", container_name(name), *PODMAN_UNIT_FLAGS,
            f"--pull={c.pull}"]
    argv += [f"--device={CDI_GPU_KIND}={d}" for d in devices]
    if socket is not None:
        sockets = posixpath.dirname(socket)
        argv.append(f"--volume={sockets}:{sockets}:rw")
    elif serve.port is not None:
        argv.append(f"--publish={_publish_host(serve)}:{serve.port}:{serve.port}")
    if c.ipc is not None:
        argv.append(f"--ipc={c.ipc}")
    if c.shm_size is not None:
        argv.append(f"--shm-size={c.shm_size}")
    for volume in c.volumes:
        # read-only unless the volume says rw
        opts = volume.split(":")[2].split(",") if volume.count(":") == 2 else []
        argv.append(f"--volume={volume}" if "ro" in opts or "rw" in opts
                    else f"--volume={volume}{',' if opts else ':'}ro")
    argv += [f"--env={k}" for k in sorted(set(forward_env) - HOST_ONLY_ENV)]
    argv.append(f"--stop-timeout={math.ceil(serve.stop_timeout_s)}")
    return [*argv, c.image, *inner]


def utilization(name: str, mib: int, total_mib: int | None, *, needed: bool = True) -> str:
    """util = floor(vram / device total, 4 decimals), so util x total never exceeds the
    reservation. Never a guess: an unknown total or a util that floors to 0 (vLLM requires
    > 0: vllm/config/cache.py CacheConfig.gpu_memory_utilization) refuses the launch."""
    if not total_mib:
        if not needed:
            return ""
        raise Unavailable(
            f"serve {name}: the device total is unknown (no NVML and no simulated device for "
            "its role), so gpud cannot compute --gpu-memory-utilization; it will not guess",
            {"serve": name})
    util = gpu_memory_utilization(mib, total_mib)
    if needed and util == "0.0000":
        raise Refused(
            f"serve {name}: {mib} MiB of a {total_mib} MiB device is "
            "--gpu-memory-utilization 0.0000, which vLLM refuses (it must be > 0); reserve at "
            f"least {math.ceil(total_mib / 10_000)} MiB",
            {"serve": name, "mib": mib, "total_mib": total_mib})
    return util


def vllm_budget_mib(serve: ServeConfig, reservation_mib: int) -> int:
    """What gpud hands vLLM as its budget (util x total) out of a reservation: all of it but the
    context vLLM draws beyond its budget (vllm.context_mib), so that a healthy vLLM stays
    inside its reservation and never reads as an overdraw."""
    context = serve.vllm.context_mib if serve.vllm is not None else 0
    return reservation_mib - context


def visible_devices(indexes: Sequence[int]) -> str:
    """CUDA_VISIBLE_DEVICES for the devices of a serve, in the order of its roles. With
    CUDA_DEVICE_ORDER=PCI_BUS_ID, CUDA numbers devices as NVML does (the CUDA Programming Guide,
    "CUDA Environment Variables": a comma-separated sequence, enumerated in that order)."""
    return ",".join(str(i) for i in indexes)


def smallest_total(totals: Sequence[int | None]) -> int | None:
    """The device total a serve on several devices computes its utilization against: the
    smallest, so util x total stays within the reservation on every device; None when one of
    them is unknown."""
    if not totals or any(not t for t in totals):
        return None
    return min(t for t in totals if t)


def serve_argv(serve: ServeConfig, *, total_mib: int | None, device_index: int,
               vllm_executable: str, vram_mib: int | None = None, name: str = "?",
               device_indexes: Sequence[int] | None = None,
               cdi_devices: Sequence[str] = (), forward_env: Iterable[str] = (),
               socket: str | None = None, vllm_version: str = DEFAULT_VERSION,
               behind_router: bool = False) -> list[str]:
    """The argv of a serve. `vram_mib` is its current reservation (default: the config's).
    BEHIND_ROUTER: the router reaches it (a vllm serve then runs the priority policy).
    A serve on several devices gives `total_mib` as the smallest of their totals and
    `device_indexes` in the order of its roles. For a container serve, `cdi_devices` and
    `forward_env` as container_argv takes them. `socket`: where a fronted serve listens."""
    if serve.vllm is not None and serve.port is None and socket is None:
        # vLLM's --port defaults to 8000 (vllm/entrypoints/launchers/cli_args.py:285 of 0.32.0):
        # gpud would poll whatever answers there, and call the serve healthy at once
        raise Refused(f"serve {name}: a vllm serve needs a port (serves.{name}.port): without "
                      "--port vLLM binds 8000, where gpud's health checks would find whatever "
                      "answers there", {"serve": name})
    mib = vllm_budget_mib(serve, vram_mib if vram_mib is not None else serve.vram_mib)
    if mib <= 0:
        raise Refused(f"serve {name}: its reservation does not cover its vllm.context_mib",
                      {"serve": name})
    util = utilization(name, mib, total_mib, needed=uses_utilization(serve))
    if serve.container is not None:
        if serve.vllm is not None:
            # [2:]: the image's entrypoint is vllm serve
            inner = vllm_argv(serve, executable=vllm_executable, util=util,
                              host=None if socket else CONTAINER_LISTEN, socket=socket,
                              vllm_version=vllm_version, behind_router=behind_router)[2:]
        else:
            # Inside, the serve's devices are numbered from 0 (CDI injected only them).
            inside = range(len(device_indexes)) if device_indexes else None
            inner = _fill(serve.container.args or (), serve, util=util, device_index=0,
                          device_indexes=inside, socket=socket or "")
        return container_argv(name, serve, inner, devices=cdi_devices, forward_env=forward_env,
                              socket=socket)
    if serve.vllm is not None:
        return vllm_argv(serve, executable=vllm_executable, util=util, socket=socket,
                         vllm_version=vllm_version, behind_router=behind_router)
    return command_argv(serve, util=util, device_index=device_index,
                        device_indexes=device_indexes, socket=socket or "")


def serve_environment(serve: ServeConfig) -> dict[str, str]:
    """The serve's environment as gpud launches it, less what gpud adds per device (its
    CUDA_VISIBLE_DEVICES, the simulation's variables)."""
    base = vllm_environment(serve) if serve.vllm is not None else {}
    return {**base, **serve.environment}


def show_commands(cfg: Config, devices: tuple[DeviceSample, ...], source: str,
                  extra_env: Callable[..., Mapping[str, str]] | None = None,
                  cdi_names: Iterable[str] | None = None) -> list[str]:
    """What `gpud --check-config FILE --show-commands` prints: per serve, the environment and
    argv gpud would launch, from the device totals known (`source`: NVML or the simulation),
    or why it would refuse. `cdi_names`: the GPU names the host's CDI specs offer (None: none
    read)."""
    lines = [f"device totals from {source}:"]
    lines += [f"  {d.index}: {d.uuid} {d.total_mib} MiB" for d in devices] or ["  none known"]
    for name, serve in sorted(cfg.serves.items(), key=lambda kv: (kv[1].priority, kv[0])):
        found: list[tuple[str, DeviceSample | None, int | None, str]] = []
        for role_name in serve.all_roles:
            role = cfg.roles[role_name]
            dev = find_device(devices, role.device)
            index = dev.index if dev else (int(role.device) if role.device.isdigit() else None)
            where = (f"device {dev.index} ({dev.uuid}, {dev.total_mib} MiB)" if dev
                     else f"device {role.device!r} (total unknown)")
            found.append((role.device, dev, index, where))
        if len(found) == 1:
            lines.append(f"serve {name}: role {serve.role}, {found[0][3]}, {serve.vram_mib} MiB")
        else:
            lines.append(f"serve {name}: roles {', '.join(serve.all_roles)}, devices "
                         f"{'; '.join(w for _, _, _, w in found)}, {serve.vram_mib} MiB on each")
        unresolved = [ref for ref, _, index, _ in found if index is None]
        if unresolved:
            lines.append(f"  refused: device {unresolved[0]!r} cannot be resolved to an index")
            continue
        indexes = [index for _, _, index, _ in found if index is not None]
        total = smallest_total([dev.total_mib if dev else None for _, dev, _, _ in found])
        # As whom it would run (the host's user database is --check-config's to consult).
        ident = serve_identity(name, serve, cfg.daemon, home_of=lambda _user: "")
        env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": visible_devices(indexes),
               **ident.environment, **serve_environment(serve)}
        seen = [dev for _, dev, _, _ in found if dev is not None]
        if len(seen) == len(found) and extra_env is not None:
            env.update(extra_env(*(dev.uuid for dev in seen)))
        cdi: list[str] = []
        if serve.container is not None:
            for _, dev, index, _ in found:
                assert index is not None
                cdi_name = cdi_device_name(dev.uuid if dev else "", index, cdi_names)
                if cdi_name is None:
                    lines.append(f"  refused: no CDI spec offers "
                                 f"{CDI_GPU_KIND}={dev.uuid if dev else index} (or index "
                                 f"{index}): run `nvidia-ctk cdi generate --output="
                                 "/etc/cdi/nvidia.yaml`")
                    break
                cdi.append(cdi_name)
            if len(cdi) != len(found):
                continue
        try:
            argv = serve_argv(serve, total_mib=total, device_index=indexes[0],
                              vllm_executable=cfg.daemon.vllm_executable, name=name,
                              device_indexes=indexes, cdi_devices=cdi, forward_env=env,
                              vllm_version=cfg.daemon.vllm_version,
                              socket=(socket_path(cfg.daemon.serve_socket_dir, name)
                                      if serve.front else None))
        except GpudError as exc:
            lines.append(f"  refused: {exc.message}")
            continue
        lines.append("  environment: " + " ".join(
            shlex.quote(f"{k}={v}") for k, v in sorted(env.items())))
        lines.append(f"  argv: {shlex.join(argv)}")
        lines.append(f"  runs as: {ident.user or 'root'}, "
                     + ("hardened unit" if ident.hardening else "unhardened unit"))
    return lines



# --- as whom a serve runs, and what its unit may touch ------------------------------------------

# The default identity's cache (CacheDirectory=, so /var/cache/gpud-serve, made and owned by
# systemd for the unit's user): the model downloads of every serve running as it, shared (one
# download per model) and pre-seedable by an operator (`runuser -u gpud-serve -- hf download`).
SERVE_CACHE = "gpud-serve"
SERVE_CACHE_PATH = f"/var/cache/{SERVE_CACHE}"
# Where vLLM, Hugging Face and the libraries under them (torch, triton, outlines) keep their
# caches: all of it inside the cache directory, the one place the default identity may write.
SERVE_CACHE_ENVIRONMENT: Mapping[str, str] = {
    "HOME": SERVE_CACHE_PATH,
    "XDG_CACHE_HOME": SERVE_CACHE_PATH,
    "HF_HOME": f"{SERVE_CACHE_PATH}/huggingface",
    "VLLM_CACHE_ROOT": f"{SERVE_CACHE_PATH}/vllm",
}
ROOT_NAMES = frozenset({"root", "0"})


@dataclass(frozen=True)
class Hardening:
    """The sandbox of an unprivileged serve's unit (unit_properties sends it): what it may
    write besides its cache, whether home directories are hidden, its extra groups."""

    # "yes": /home, /root and /run/user are empty to the serve; "no" for a named user, whose
    # own home may hold its models and caches (then writable, in read_write_paths).
    protect_home: Literal["yes", "no"] = "yes"
    # Paths writable under ProtectSystem=strict; a leading "-": skipped when missing.
    read_write_paths: tuple[str, ...] = ()
    cache_directory: str | None = None
    supplementary_groups: tuple[str, ...] = ()


@dataclass(frozen=True)
class Identity:
    """As whom a serve runs: `user` (None: root, no User= sent, as for a container serve),
    what gpud adds to its environment for it, and its sandbox (None: root's unit, unhardened)."""

    user: str | None
    environment: Mapping[str, str]
    hardening: Hardening | None


def serve_identity(name: str, serve: ServeConfig, daemon: DaemonConfig, *,
                   home_of: Callable[[str], str | None], front_group: str | None = None,
                   writable: Sequence[str] = ()) -> Identity:
    """The identity and sandbox of serve NAME's unit. `home_of`: a user's home directory, None
    when the host has no such user (Unavailable naming the key then, not systemd's 217/USER at
    start). `front_group`: the front's group for a fronted serve (it binds its socket in
    daemon.serve_socket_dir, which that group may write). `writable`: more paths it must write
    (the simulation's registration folder).

    The default identity is daemon.serve_user, a system user the package creates (sysusers.d),
    not DynamicUser=: the serves share one cache of model downloads (DynamicUser= gives each
    unit its own, chowned to its uid at start), and DynamicUser= forces PrivateTmp= and
    RemoveIPC=, which this shared user must not have (see below). A container serve runs as
    root unless its `user` says otherwise: rootful podman needs root's capabilities to set up
    the container (conmon, mounts, netavark); its isolation is the container's own. `user =
    "root"` is root's unhardened unit, as every serve before."""
    if serve.user is not None:
        user, key = serve.user, f"serves.{name}.user"
    elif serve.container is not None:
        return Identity(None, {}, None)
    else:
        user, key = daemon.serve_user, "daemon.serve_user"
    if user in ROOT_NAMES:
        return Identity(user, {}, None)
    home = home_of(user)
    if home is None:
        made = " (the package creates it with systemd-sysusers)" if key.startswith("daemon") else ""
        raise Unavailable(f"{key}: no user {user!r} on this host{made}",
                          {"serve": name, "user": user, "key": key})
    if serve.container is not None:
        # rootless podman: its own user namespace and storage under the user's home
        return Identity(user, {}, None)
    paths = [*writable]
    if front_group is not None:
        paths.append(daemon.serve_socket_dir)
    if serve.user is None:
        return Identity(user, dict(SERVE_CACHE_ENVIRONMENT),
                        Hardening("yes", tuple(paths), SERVE_CACHE,
                                  (front_group,) if front_group else ()))
    if home not in ("", "/"):
        paths.append(f"-{home}")
    return Identity(user, {}, Hardening("no", tuple(paths), None,
                                        (front_group,) if front_group else ()))

# systemd up to 252 writes a transient unit to /run/systemd/transient and re-reads it at every
# daemon-reload, altering these characters in ExecStart= arguments (`$` -> `\$`, `;` -> `\;`).
ALTERED_BY_RELOAD = ("$", ";")
RELOAD_ALTERS_UNTIL = 252


def reload_alters_arguments(systemd_version: int | None) -> bool:
    """Whether this systemd (its major version; None: unknown, taken as the oldest supported)
    would alter ALTERED_BY_RELOAD in a transient unit's arguments across a daemon-reload."""
    return systemd_version is None or systemd_version <= RELOAD_ALTERS_UNTIL


def through_shim(argv: list[str], python: str, systemd_version: int | None) -> list[str]:
    """The argv to hand systemd: the command itself, or (when an argument would not survive a
    daemon-reload on this systemd) the command wrapped for gpud.execv."""
    fragile = any(ch in arg for arg in argv for ch in ALTERED_BY_RELOAD)
    if not fragile or not reload_alters_arguments(systemd_version):
        return argv
    return [python, "-I", "-m", "gpud.execv", encode(argv)]


def fingerprint(serve: ServeConfig) -> str:
    """A hash of what defines a serve's memory behaviour: model, revision, quantization,
    max_model_len, the command, and a container's image and args. A changed serve no longer
    matches its calibration."""
    v = serve.vllm
    what: dict[str, object] = {
        "model": v.model if v else None,
        "revision": v.revision if v else None,
        "quantization": v.quantization if v else None,
        "max_model_len": v.max_model_len if v else None,
        "extra_args": list(v.extra_args) if v else None,
        "command": list(serve.command) if serve.command else None,
    }
    if serve.container is not None:
        # Only for container serves, so that the others keep their calibrations. A new image
        # is a new serve: its vLLM, CUDA and kernels may draw differently.
        what["image"] = serve.container.image
        what["container_args"] = serve.container.args
    if v is not None and v.kv_cache_mib is not None:
        # Only when set, so that the serves that never had it keep their calibrations.
        what["kv_cache_mib"] = v.kv_cache_mib
    if serve.roles is not None and len(serve.roles) > 1:
        # Over N devices each holds its share of the weights: a calibration made on another
        # number of devices says nothing about the draw per device. (Only when > 1: serves on
        # one device keep their calibrations.)
        what["devices"] = len(serve.all_roles)
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
