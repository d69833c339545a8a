"""The models of ``serves.toml``: frozen, strict pydantic models whose key names are the
interface, and the checks each model makes of its own fields. Values only: reading a file,
parsing TOML and the checks of a config as a whole (one of them reads the vLLM flag table, a
data file) are gpud.config's, above the core, which re-exports these names.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from gpud.core.front import DEFAULT_PATHS as DEFAULT_FRONT_PATHS
from gpud.core.router import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_LARGE_BODIES_PER_REQUESTER,
    DEFAULT_LOADING_FEEDBACK_S,
    DEFAULT_MAX_BODY_MIB,
    DEFAULT_NJS_MODULE,
)
from gpud.core.vllm_versions import DEFAULT_VERSION
from gpud.core.vocab import SleepAction

# The largest reservation anyone can mean (2 PiB). Bounds hostile numbers such as 2**70.
MAX_MIB = 2**31 - 1

class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class DaemonConfig(_Model):
    socket: str = "/run/gpud/gpud.sock"
    state_dir: str = "/var/lib/gpud"
    admission: Literal["strict", "ledger"] = "strict"
    admin_group: str = "gpud-admin"
    socket_group: str = "gpud"
    observe_interval_s: float = Field(default=1.0, gt=0, le=3600)
    health_interval_s: float = Field(default=1.0, gt=0, le=3600)
    # A running serve turns `failed` after this many health checks in a row fail.
    health_failures: int = Field(default=3, ge=1, le=1000)
    crash_loop_restarts: int = Field(default=5, ge=1, le=1000)
    crash_loop_window_s: float = Field(default=60.0, gt=0)
    # A resident serve whose unit an operator stopped by hand (`systemctl stop`) keeps its
    # reservation when true; by default it is released, as `gpuctl stop` releases it.
    keep_resident_on_outside_stop: bool = False
    overdraw_tolerance_mib: int = Field(default=256, ge=0, le=MAX_MIB)
    # After a stop, the next start on that device waits at most this long for NVML to show the
    # memory back (vLLM frees its memory some seconds after the process is told to stop).
    memory_return_timeout_s: float = Field(default=60.0, ge=0)
    vllm_executable: str = "vllm"
    # What a vllm serve without a vllm.context_mib needs free beyond its reservation to start:
    # vLLM checks free >= util x total after its CUDA context, NCCL and cuBLAS exist (a few
    # hundred MiB per device; ~500 MiB is the CUDA context alone on recent drivers). Strict
    # admission asks for it; `gpuctl calibrate` measures a serve's own (vllm.context_mib).
    vllm_start_context_mib: int = Field(default=512, ge=0, le=MAX_MIB)
    # The vLLM release the serves run: its flag table checks every vllm argv. gpud ships the
    # tables of the releases it knows (gpud/data); another release's is read from
    # vllm_flags_dir (an operator's, vllm-serve-flags-VERSION.json: scripts/vllm-flags), else
    # learned once from vllm_executable's own parser and kept under state_dir (gpud.config).
    vllm_version: str = DEFAULT_VERSION
    vllm_flags_dir: str = "/etc/gpud"
    # Backups of the config file an apply keeps (the newest) under backups/ beside it; older
    # ones are removed. Its former name, config_backups, is still read.
    backups_keep: int = Field(default=10, ge=1, le=1000,
                              validation_alias=AliasChoices("backups_keep", "config_backups"))
    # Events kept in the store (the newest); older ones are pruned in batches of a twentieth of
    # it, so the store holds at most about 5% more (gpud.life.writes.prune_batch).
    events_keep: int = Field(default=100_000, ge=100, le=100_000_000)
    metrics_listen: str | None = None
    # Sleeping serves put to sleep by a preemption wake by priority, while they fit, when
    # memory is released on their role.
    auto_wake: bool = True
    # A resident serve of higher priority may put lower ones to sleep at boot.
    preempt_at_boot: bool = False
    # A level-1 sleep parks the weights in host RAM: refused unless MemAvailable holds them
    # plus this much.
    sleep_host_margin_mib: int = Field(default=1024, ge=0, le=MAX_MIB)
    # A request's headers must have arrived this long after its first byte, its body this long
    # after its handling began (every peer, root included): past it the connection is closed,
    # or the body answered 408 (gpud.server.connguard).
    request_read_timeout_s: float = Field(default=10.0, gt=0, le=3600)
    # The ensures of the front and the router waiting at once (each holds a connection of
    # the front's uid on gpud's socket until its serve is up): at most this many per
    # requester (a key's name, else the client's address) and in all; past either, the
    # ensure is refused at once (the router's 429, docs/router.md "Who is asking"). The
    # front's uid may hold this many connections and 64 more, kept for reads such as the
    # states /v1/models shows.
    ensure_waiting_per_requester: int = Field(default=16, ge=1, le=10_000)
    ensure_waiting_total: int = Field(default=512, ge=1, le=16_384)
    # The front (gpud/nginx/front.py) of serves with `front = true`: the nginx it runs, the user it
    # runs as (its group may enter serve_socket_dir), the routes it forwards, where the serves'
    # sockets and its own config live.
    front_nginx: str = "/usr/sbin/nginx"
    # Whom a serve without its own `user` runs as (a container serve: root): a system user the
    # package creates (packaging/gpud.sysusers); "root" runs them all as root.
    serve_user: str = Field(default="gpud-serve", min_length=1)
    front_user: str = "gpud-front"
    front_paths: list[str] = Field(default_factory=lambda: list(DEFAULT_FRONT_PATHS))
    serve_socket_dir: str = "/run/gpud/serves"
    front_dir: str = "/run/gpud/front"
    # Every request gpud makes to a serve is bounded: POST /sleep (a level-1 sleep copies the
    # weights to host RAM, seconds for a large model) within sleep_timeout_s, a wake's requests
    # within wake_timeout_s; past it the sleep or wake fails (a wake: see docs/sleep.md).
    sleep_timeout_s: float = Field(default=300.0, gt=0, le=3600)
    wake_timeout_s: float = Field(default=300.0, gt=0, le=3600)
    # A preemption of a serve with requests in flight waits at most this long for them to end
    # (new ones wait at the front meanwhile); those still running then are aborted by the sleep
    # (vLLM's mode=abort) or the stop, and the event says so (gpud.core.traffic.Drain).
    drain_timeout_s: float = Field(default=30.0, ge=0, le=3600)


class RoleConfig(_Model):
    device: str = Field(min_length=1)
    capacity_mib: int | None = Field(default=None, gt=0, le=MAX_MIB)
    reserve_mib: int = Field(default=0, ge=0, le=MAX_MIB)
    note: str | None = None


class VllmConfig(_Model):
    model: str = Field(min_length=1)
    revision: str | None = None
    quantization: str | None = None
    max_model_len: int | None = Field(default=None, gt=0)
    extra_args: list[str] = Field(default_factory=list)
    executable: str | None = None
    # --host; gpud's health checks go to 127.0.0.1, the default.
    host: str | None = Field(default=None, min_length=1)
    # --kv-cache-memory-bytes: the KV cache sized exactly, no KV profiling (the serve starts
    # beside its device's other exactly sized serves); "calibrated": the figure of the serve's
    # current calibration (gpuctl calibrate NAME), util-sized and alone until there is one.
    kv_cache_mib: int | Literal["calibrated"] | None = None
    @field_validator("kv_cache_mib", mode="before")
    @classmethod
    def _mib_or_calibrated(cls, value: Any) -> Any:
        # one problem named at the key, not one per member of the union
        if value is None or value == "calibrated":
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError('must be a figure in MiB (an integer) or "calibrated"')
        if value <= 0:
            raise ValueError("must be > 0")
        if value > MAX_MIB:
            raise ValueError(f"must be <= {MAX_MIB}")
        return value

    # What vLLM draws beyond its budget (CUDA context, NCCL, cuBLAS: measured by `gpuctl
    # calibrate`). The reservation covers it: util = floor((vram_mib - context_mib) / total).
    context_mib: int = Field(default=0, ge=0, le=MAX_MIB)



class ContainerConfig(_Model):
    """Where a serve runs: an image, through podman (the way quadlet runs one), never pulled
    unless `pull = "missing"`. With a [vllm] table the image's entrypoint is `vllm serve` (as in
    vLLM's own vllm/vllm-openai image) and what follows the image is that table's argv."""

    image: str = Field(min_length=1)
    # docker is not offered: its containers live in dockerd's cgroup, not the unit's, so their
    # draw could not be attributed to the serve.
    engine: Literal["podman"] = "podman"
    args: list[str] | None = None
    volumes: list[str] = Field(default_factory=list)
    shm_size: str | None = None
    ipc: Literal["host"] | None = None
    pull: Literal["never", "missing"] = "never"


class ServeConfig(_Model):
    # `role`, or `roles` for a serve on several devices (tensor parallel): exactly one of the
    # two is written. With `roles`, `role` is the first of them (filled in on load) and
    # `vram_mib` is the reservation on EACH role.
    role: str
    roles: list[str] | None = None
    vram_mib: int = Field(gt=0, le=MAX_MIB)
    resident: bool = False
    priority: int = Field(default=100, ge=0, le=1_000_000)
    port: int | None = Field(default=None, ge=1, le=65535)
    health_path: str = "/health"
    vllm: VllmConfig | None = None
    command: list[str] | None = None
    container: ContainerConfig | None = None
    environment: dict[str, str] = Field(default_factory=dict)
    # Whom it runs as (unset: daemon.serve_user; a container serve: root). Never empty: an
    # empty User= is root to systemd.
    user: str | None = Field(default=None, min_length=1)
    start_timeout_s: float = Field(default=900.0, gt=0)
    stop_timeout_s: float = Field(default=30.0, gt=0)
    restart: Literal["no", "on-failure", "always"] = "on-failure"
    restart_sec: float = Field(default=2.0, ge=0)
    # vLLM's sleep mode: 1 parks the weights in host RAM, 2 drops them; 0 never sleeps.
    sleep_level: Literal[0, 1, 2] = 0
    # The reservation kept while asleep (CUDA context and what vLLM keeps). Unset: measured
    # after the first sleep (plus daemon.overdraw_tolerance_mib); a first sleep needs it.
    sleep_mib: int | None = Field(default=None, gt=0, le=MAX_MIB)
    # What a preemption by a serve of higher priority does to this one: "sleep" (the default
    # with a sleep_level) or "stop"; without either it is never preempted.
    # Not strict: the TOML gives the string, the field holds the member.
    preemptible: SleepAction | None = Field(default=None, strict=False)
    # Clients reach the serve through the front on `port`; the serve itself listens on a Unix
    # socket only root and the front may reach ({socket} in a command). Unset: on for a serve
    # with a sleep_level or on_demand (vLLM's dev routes, which sleep opens, reach no one but
    # gpud and the front), off otherwise; always a bool once validated (_front_by_default).
    front: bool | None = None
    # Not started at boot: the first request to its front admits it (strictly; through the
    # preemption planner with `preempt`) and starts or wakes it, held until it is healthy.
    on_demand: bool = False
    preempt: bool = False
    # An on-demand serve without a request through its front for this long is put to sleep
    # (its sleep_level) / stopped.
    idle_sleep_s: float | None = Field(default=None, gt=0)
    idle_stop_s: float | None = Field(default=None, gt=0)
    # The names the router (docs/router.md) routes to this serve. Unset: a vllm serve's
    # --served-model-name from its extra_args, else its model id; any other serve's name. Set
    # on a vllm serve: vLLM is launched with them as --served-model-name.
    models: list[str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _front_by_default(cls, data: Any) -> Any:
        """`front` unset: on for a serve that sleeps or starts on demand, unless it has no port
        (nothing to front); an explicit `front = false` is the operator's choice (gpud
        --check-config warns)."""
        if not isinstance(data, dict) or data.get("front") is not None:
            return data
        wants = data.get("sleep_level") not in (None, 0, False) or data.get("on_demand") is True
        return {**data, "front": wants and data.get("port") is not None}

    @model_validator(mode="before")
    @classmethod
    def _one_of_role_or_roles(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "roles" not in data:
            return data
        if "role" in data:
            raise ValueError("give exactly one of role or roles")
        roles = data["roles"]
        if isinstance(roles, list) and roles and isinstance(roles[0], str):
            return {**data, "role": roles[0]}
        if isinstance(roles, list) and not roles:
            raise ValueError("roles: must name at least one role")
        return data

    @model_serializer(mode="wrap")
    def _dump_as_written(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Dumped as written: `roles` for a serve on several roles (its `role` is derived), and
        # `role` alone otherwise (as before `roles` existed), so a dump validates again.
        data: dict[str, Any] = handler(self)
        data.pop("role" if self.roles else "roles", None)
        return data

    @property
    def all_roles(self) -> tuple[str, ...]:
        """The roles the serve reserves on, in order (one per device it runs on)."""
        return tuple(self.roles) if self.roles else (self.role,)

    @property
    def extra_roles(self) -> tuple[str, ...]:
        return self.all_roles[1:]

    @model_validator(mode="after")
    def _how_to_run(self) -> ServeConfig:
        if self.container is not None:
            if self.command is not None:
                raise ValueError("a container serve has no command: what follows the image is "
                                 "container.args (or the [vllm] table's argv)")
            if self.vllm is not None and self.vllm.executable is not None:
                raise ValueError("vllm.executable: not with a container: the image's entrypoint "
                                 "(vllm serve) runs vLLM")
            if self.vllm is not None and self.container.args is not None:
                raise ValueError("container.args: with a [vllm] table what follows the image is "
                                 "the table's argv; give one of them")
        elif (self.vllm is None) == (self.command is None):
            raise ValueError("give exactly one of a [vllm] table or a command")
        if self.sleep_mib is not None and self.sleep_mib >= self.vram_mib:
            raise ValueError(f"sleep_mib: {self.sleep_mib} must be below vram_mib {self.vram_mib}")
        if self.preemptible == SleepAction.SLEEP and not self.sleep_level:
            raise ValueError('preemptible: "sleep" needs a sleep_level of 1 or 2')
        if self.command is not None and not self.command:
            raise ValueError("command: must not be empty")
        if not self.health_path.startswith("/"):
            raise ValueError("health_path: must start with '/'")
        if self.front and self.port is None:
            raise ValueError("front: a fronted serve needs the port its front listens on")
        if self.on_demand and not self.front:
            raise ValueError("on_demand: needs front = true (its first request comes through "
                             "the front)")
        if self.on_demand and self.resident:
            raise ValueError("on_demand: a resident serve starts at boot; give one of the two")
        if (self.idle_sleep_s is not None or self.idle_stop_s is not None) and not self.on_demand:
            raise ValueError("idle_sleep_s, idle_stop_s: activity is what passes through an "
                             "on_demand serve's front; needs on_demand")
        if self.idle_sleep_s is not None and not self.sleep_level:
            raise ValueError("idle_sleep_s: needs a sleep_level of 1 or 2")
        if self.preempt and not self.on_demand:
            raise ValueError("preempt: says how an on_demand serve is started; needs on_demand")
        if self.front and self.container is not None and self.vllm is None \
                and not any("{socket}" in arg for arg in self.container.args or ()):
            raise ValueError("front: a fronted container serve must listen on {socket} "
                             "(container.args; its port is the front's); a serve with "
                             "sleep_level or on_demand is fronted unless it says front = false")
        if self.front and self.command is not None \
                and not any("{socket}" in arg for arg in self.command):
            raise ValueError("front: a fronted command serve must listen on {socket} "
                             "(its port is the front's); a serve with sleep_level or on_demand "
                             "is fronted unless it says front = false")
        return self


class SimulatedDeviceConfig(_Model):
    uuid: str = Field(min_length=1)
    total_mib: int = Field(gt=0, le=MAX_MIB)
    index: int | None = Field(default=None, ge=0)
    pci_bus_id: str | None = None
    name: str | None = None
    # What the simulated NVML says of each process's memory: "reported", "not-available"
    # (WDDM) or "none" (no process listed, as WSL2 shows it).
    process_memory: Literal["reported", "not-available", "none"] = "reported"


class SimulationConfig(_Model):
    state_file: str = "/run/gpud/sim.json"
    devices: list[SimulatedDeviceConfig] = Field(min_length=1)


DEFAULT_QUEUE_TIMEOUT_S = 60
DEFAULT_MAX_QUEUED = 32
DEFAULT_MIN_AWAKE_S = 30.0


class RouterConfig(_Model):
    """One OpenAI-compatible address for every serve, routed by the body's `model`
    (docs/router.md): a server of the front's nginx, with the njs module loaded."""

    listen: str = "127.0.0.1:8000"
    njs_module: str = DEFAULT_NJS_MODULE
    max_body_mib: int = Field(default=DEFAULT_MAX_BODY_MIB, ge=1, le=1024)
    # A request's headers, and its body, each within this long: past it nginx closes the
    # connection (it cannot answer 408 to a read timeout: docs/router.md).
    body_timeout_s: int = Field(default=DEFAULT_BODY_TIMEOUT_S, ge=1, le=3600)
    # Requests with a large body (10^6 bytes or more, or chunked) one requester (a key, else
    # an address) may have open at once: past it 429, before the body is read (docs/router.md,
    # "Who is asking"). Each holds up to max_body_mib of the front's memory. 0: no bound.
    large_bodies_per_requester: int = Field(default=DEFAULT_LARGE_BODIES_PER_REQUESTER, ge=0,
                                            le=65535)
    # Bearer tokens and the models each may use (root's, 0600; docs/router.md). Unset: open
    # to whoever reaches `listen`.
    api_keys_file: str | None = None
    # The queue (docs/router.md, "Queue instead of thrash"): a request for an on-demand serve
    # that does not fit waits up to queue_timeout_s, at most max_queued per serve (0: no queue,
    # refused at once), and a serve brought up by a request stays up min_awake_s before a
    # request for another may evict it (unless it is idle).
    queue_timeout_s: int = Field(default=DEFAULT_QUEUE_TIMEOUT_S, ge=1, le=3600)
    max_queued: int = Field(default=DEFAULT_MAX_QUEUED, ge=0, le=10_000)
    min_awake_s: float = Field(default=DEFAULT_MIN_AWAKE_S, ge=0, le=86_400)
    # A bound on holding a device (docs/router.md): an eviction for a queued request drains its
    # victim's requests in flight within daemon.drain_timeout_s; past that bound, true: a victim
    # that can sleep is put to sleep all the same, ending what is still in flight (each stream
    # told: vLLM's abort chunk, then the router's error event); false: the eviction is refused
    # then, and the victim keeps its device for as long as its requests run.
    evict_busy: bool = True
    # Loading feedback (docs/router.md): a stream (`"stream": true`) waiting on a bring-up is
    # answered 200 text/event-stream and sent an SSE comment every this many seconds, so its
    # client does not time out during a cold start (0: none; the stream waits silently and a
    # refusal is a 503).
    loading_feedback_s: int = Field(default=DEFAULT_LOADING_FEEDBACK_S, ge=0, le=300)
    # A request for a model this host and a peer both serve also goes to the peer when this
    # host's queue for it is full or its expected wait is longer (gpud.core.peers.choose_host).
    spillover: bool = False


class PeerConfig(_Model):
    """Another gpud host's router (docs/peers.md): its models are offered here, each host
    staying the only authority over its own GPUs."""

    # http or https, a host and an optional port, no path beyond "/" (gpud.core.peers.url_problem)
    url: str = Field(min_length=1)
    # Root's only (0600): the key this host presents to the peer's router.
    key_file: str = Field(min_length=1)
    # Which of the peer's models are offered here; unset: all it lists.
    models: list[str] | None = None
    # The CA bundle that verifies an https peer's certificate.
    tls_ca: str | None = Field(default=None, min_length=1)


class Config(_Model):
    daemon: DaemonConfig = DaemonConfig()
    # off when absent
    router: RouterConfig | None = None
    roles: dict[str, RoleConfig] = Field(default_factory=dict)
    serves: dict[str, ServeConfig] = Field(default_factory=dict)
    simulation: SimulationConfig | None = None
    peers: dict[str, PeerConfig] = Field(default_factory=dict)
