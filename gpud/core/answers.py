"""The answers of gpud's API, described once.

Each JSON object a route answers with is a TypedDict here. The code that builds an answer is
typed with it (mypy checks every key and value), gpud.server.openapi generates the served document's
schemas from these types, and tests hold live answers and gpuctl's canned ones to that document.
gpuctl reads the same names for its type checks only: nothing here is imported when it runs.

``typing_extensions.TypedDict``, not ``typing.TypedDict``: pydantic builds a schema from a
TypedDict only of that kind on Python below 3.12 (pydantic's own requirement; it depends on
typing_extensions itself). Which strings a state or an event kind may be comes from
gpud.core.vocab; gpud.server.openapi puts those lists into the document.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired

from typing_extensions import TypedDict

from gpud.core.vocab import ApplyOutcome, SleepAction, StepKind
from gpud.errors import Error, ErrorBody  # the error shape, defined with the error tree

Admission = Literal["strict", "ledger"]
CalibrationStatus = Literal["calibrated", "stale", "uncalibrated"]


class Figures(TypedDict):
    """A role's ledger figures: free = capacity - reserve - committed."""

    capacity_mib: int
    reserve_mib: int
    committed_mib: int
    free_mib: int


class Observed(TypedDict):
    """What the device of a role really draws (NVML or the simulated backend)."""

    simulated: bool
    total_mib: int
    used_mib: int
    physical_free_mib: int
    managed_draw_mib: int
    non_ledger_draw_mib: int
    reserve_mib: int
    reserve_excess_mib: int
    pending_mib: int
    effective_free_mib: int
    # The driver reports no per-process memory (WDDM, WSL2): managed and non-ledger draw are
    # estimated, the running serves drawing their reservations.
    estimated: bool


class Reservation(TypedDict):
    """One reservation as listed under one role. A serve on several roles is listed under each,
    with all of them in ``roles`` and which one this is in ``part`` ("1/2"); a single-role
    serve's listing has neither."""

    serve: str
    role: str
    roles: NotRequired[list[str]]
    part: NotRequired[str]
    mib: int
    since: float
    by_uid: int | None
    state: str  # one of gpud.core.vocab.STATES
    resident: bool
    external: bool


class Role(TypedDict):
    """One role of the ledger. ``missing``: the config no longer has this role, and
    reservations still name it (kept, shown over-committed, with an empty ``device``)."""

    name: str
    device: str
    note: str | None
    missing: bool
    capacity_mib: int
    reserve_mib: int
    committed_mib: int
    free_mib: int
    over_committed: bool
    reservations: list[Reservation]
    observed: Observed | None


class Ledger(TypedDict):
    """GET /v1/ledger."""

    admission: Admission
    simulated: bool
    roles: list[Role]


class Calibrated(TypedDict):
    """A serve's current calibration in brief; ``vllm``: vLLM's own start-up account."""

    steady_mib: int
    peak_mib: int
    recommended_mib: int
    vllm: dict[str, Any] | None


class Serve(TypedDict):
    """GET /v1/serves/{name}, and what start, stop and restart answer with."""

    name: str
    role: str | None
    roles: NotRequired[list[str]]  # a serve on several roles (devices): all of them, in order
    configured: bool
    external: bool
    state: str  # one of gpud.core.vocab.STATES
    # What gpud is doing with it now (gpud.core.vocab.Phase): a start's launch, a stop, a sleep,
    # a wake... `idle` once the last of them is over. A start answers while its launch runs
    # ("launching", the state still what it was before): gpuctl waits for `idle`.
    phase: str
    reason: str | None
    vram_mib: int | None
    reserved_mib: int | None
    resident: bool
    priority: int | None
    port: int | None
    unit: str | None
    main_pid: int | None
    device_lost: str | None
    n_restarts: int
    observed_mib: int | None
    # A serve on several roles (devices): what it draws on each role's device, beside its
    # reservation there (reserved_mib, held on each); observed_mib is their sum.
    observed_by_role: NotRequired[dict[str, int] | None]
    calibration: CalibrationStatus
    fingerprint: str | None
    calibrated: Calibrated | None
    sleep_level: int  # 0: never sleeps
    parked_host_mib: int | None  # asleep at level 1: host RAM its weights are parked in
    front: bool  # its port is answered by the front (docs/front.md), the serve on a socket
    # Seconds since its last request ended (0 while one is in flight): the later of the last
    # request through an on-demand serve's front and the end of the last request the serve
    # counted (gpud.life.traffic); None when neither is known since gpud started.
    last_activity_s_ago: float | None
    # Requests in flight on it, as the serve counts them (vLLM's running + waiting), read every
    # 0.5 s; None when unknown (not running, not reachable, or it gives no count).
    in_flight: int | None
    # The median of its last five wakes and starts by a request, in seconds, measured since
    # gpud started (gpud.life.ondemand; None: none): what evicting it costs (docs/router.md).
    wake_s: float | None
    start_s: float | None
    # requests waiting in the router's queue for it to be brought up (docs/router.md)
    queued: int
    # While requests wait for it: who waits, in the order they go (docs/router.md, "Who is
    # asking"), and the wait to expect from the measured bring-ups ahead (None: unmeasured)
    queue: NotRequired[list[QueuePlace]]
    expected_wait_s: NotRequired[float | None]
    # While requests wait for memory (its state then says why the last try was refused): what
    # it waits for and until when (gpud.core.queue.waiting_for)
    waiting: NotRequired[ServeWaiting]
    # With a [router]: the names it routes to this serve (docs/router.md)
    models: NotRequired[list[str]]


class PreemptionStep(TypedDict):
    serve: str
    action: Literal[SleepAction.SLEEP, SleepAction.STOP]
    frees_mib: int
    priority: int
    undo: Literal[StepKind.WAKE, StepKind.START]
    roles: NotRequired[list[str]]  # a plan on several roles: those it frees frees_mib on, each


class PreemptionRoom(TypedDict):
    role: str
    free_mib: int
    free_after_mib: int


class PreemptionPlan(TypedDict):
    """The fewest serves of lower priority to put to sleep (or stop), in order; ``lines`` as
    gpuctl prints them."""

    serve: str
    priority: int
    need_mib: int
    free_mib: int
    free_after_mib: int
    steps: list[PreemptionStep]
    lines: list[str]
    # A serve on several roles: each of them (free_mib, free_after_mib: the least of them).
    roles: NotRequired[list[PreemptionRoom]]


class PreemptionRefused(TypedDict):
    """Why no preemption can make room; ``could_free_mib``: what the eligible serves free
    together."""

    serve: str
    need_mib: int
    free_mib: int
    could_free_mib: int
    reason: str
    role: NotRequired[str]  # a serve on several roles: the role no preemption makes room on


class Started(Serve):
    """POST /v1/serves/{name}/start: the Serve; with preempt, the plan carried out (null: it
    fitted without one); with preempt and dry_run, the plan only and whether it fits."""

    preemption: NotRequired[PreemptionPlan | PreemptionRefused | None]
    dry_run: NotRequired[bool]
    fits: NotRequired[bool]


class PreemptionDryRun(TypedDict):
    """POST /v1/serves/{name}/admit with preempt and dry_run."""

    serve: str
    dry_run: bool
    fits: bool
    preemption: PreemptionPlan | PreemptionRefused


class SleepDone(TypedDict):
    level: int
    from_mib: int
    sleep_mib: int
    parked_host_mib: int
    serve_ms: float  # the serve's own answer to /sleep and its confirmation
    draw_ms: float  # observation showing the memory back


class Slept(Serve):
    """POST /v1/serves/{name}/sleep."""

    sleep: SleepDone


class WakeDone(TypedDict):
    mib: int
    serve_ms: float  # the serve's own answer to /wake_up and its confirmation


class Woken(Serve):
    """POST /v1/serves/{name}/wake."""

    wake: WakeDone


class ServeWaiting(TypedDict):
    """What a serve with requests waiting for memory waits for (gpud.core.queue.Waiting):
    `16 requests; a may be evicted in 287 s (min_awake_s)`."""

    requests: int
    reason: str  # "a may be evicted in 287 s (min_awake_s)", "behind b in the queue", ...
    in_s: float | None  # seconds until then; None: until some change


class QueuePlace(TypedDict):
    """A requester's requests waiting for a serve (gpud.core.queue.Place)."""

    requester: str  # the key's name, else addr:CLIENT
    waiting: int
    position: int  # of its first request in the queue's fair order (1: next), all serves


class Serves(TypedDict):
    """GET /v1/serves."""

    simulated: bool
    serves: list[Serve]


class Event(TypedDict):
    id: int | None
    ts: float
    kind: str  # one of gpud.core.vocab.EVENT_KINDS
    serve: str | None
    role: str | None
    mib: int | None
    uid: int | None
    message: str
    details: dict[str, Any]


class Events(TypedDict):
    """GET /v1/events (with follow=1: one Event per NDJSON line instead)."""

    events: list[Event]


class UsageRow(TypedDict):
    """A key's use of a model over the span asked (gpud.core.usage.Summary)."""

    key: str  # "" for requests without a key (keys off)
    model: str  # "" for requests the router answered before it knew a model of its table
    requests: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    unmetered: int  # answers without the serve's usage: counted, their tokens unknown
    hung_up: int  # requests whose client hung up before the whole answer was sent
    statuses: dict[str, int]  # requests by HTTP status


class UsageBudget(TypedDict):
    """A key's token budgets (docs/router.md, "Budgets": prompt + completion tokens, the day and
    the month in UTC) and what is used and left of each now (gpud.core.quota.BudgetState;
    None: no such budget)."""

    key: str
    tokens_per_day: int | None
    used_day: int
    left_day: int | None
    day_ends: int  # Unix time
    tokens_per_month: int | None
    used_month: int
    left_month: int | None
    month_ends: int  # Unix time


class Usage(TypedDict):
    """GET /v1/usage: usage per key and model through the router, from `since` (the start of
    its hour, Unix time); and each budgeted key's budgets, whatever `since`."""

    since: int
    rows: list[UsageRow]
    budgets: list[UsageBudget]


class Launching(TypedDict):
    available: bool
    reason: str | None


class Observation(TypedDict):
    """The observation backend's state; ``devices`` as it last saw them."""

    backend: str
    simulated: bool
    available: bool
    reason: str | None
    taken_at: NotRequired[float | None]
    sample_ms: NotRequired[float]
    devices: NotRequired[list[dict[str, Any]]]


class ConfigFile(TypedDict):
    """Whether the config file on disk is the config in force, and why not."""

    differs: bool
    reason: str | None


class StoreStatus(TypedDict):
    """Whether the durable store commits; while it fails, since when and why."""

    ok: bool
    error: str | None
    failing_since: float | None
    failed_commits: int


class FrontStatus(TypedDict):
    """The front's part of GET /v1/status: what its last sync left dark and why (the router's
    keys refused, its module missing, a port another process holds; gpud.nginx.front.check_front),
    empty when nothing."""

    degraded: list[str]


class RouterStatus(TypedDict):
    """The router's part of GET /v1/status (a config with a [router]): its address, whether
    something accepts a connection there now, and what of the front's last sync is about the
    router (why it is dark or runs on its last good keys), empty when nothing."""

    listen: str
    listening: bool
    degraded: list[str]


class Status(TypedDict):
    """GET /v1/status."""

    version: str
    host: str  # the host's name (socket.gethostname): which host of several this is
    config: str | None
    admission: Admission
    started_at: float
    ready: bool
    launching: Launching
    observation: Observation
    serve_states: dict[str, int]
    over_committed: list[str]
    config_file: ConfigFile
    store_transactions: int
    store: StoreStatus
    summary: str
    # a gpud that runs a front
    front: NotRequired[FrontStatus]
    # a config with a [router]
    router: NotRequired[RouterStatus]


class Admitted(TypedDict):
    """POST /v1/serves/{name}/admit."""

    serve: str
    role: str
    # A serve on several roles: all of them, and the figures of each (``figures``: the first's).
    roles: NotRequired[list[str]]
    figures_by_role: NotRequired[dict[str, Figures]]
    mib: int
    replaced_mib: int | None
    check: Literal["ledger", "strict"]
    note: str | None
    figures: Figures
    preemption: NotRequired[PreemptionPlan | None]  # with preempt: the plan carried out


class Released(TypedDict):
    """POST /v1/serves/{name}/release."""

    serve: str
    role: str
    roles: NotRequired[list[str]]
    figures_by_role: NotRequired[dict[str, Figures]]
    released_mib: int
    figures: Figures


class Reloaded(TypedDict):
    """POST /v1/reload."""

    reloaded: bool
    over_committed: list[str]
    summary: str


class PlanRole(TypedDict):
    name: str
    before: Figures | None
    after: Figures | None


class PlanServe(TypedDict):
    name: str
    role_before: str | None
    role_after: str | None
    mib_before: int | None
    mib_after: int | None
    util_before: str | None
    util_after: str | None
    fingerprint_before: str | None
    fingerprint_after: str | None
    state_before: str
    state_after: str
    change: str  # unchanged, resized, changed, "changed, resized", added, removed
    restart: bool
    reason: str | None


class Shortage(TypedDict):
    """One role a serve on several roles lacks room on."""

    role: str
    bound: str
    need_mib: int
    free_mib: int
    shortfall_mib: int


class PlanBoot(TypedDict):
    """One step of a device's boot in a plan: serves started together, or one alone, and why."""

    device: str
    serves: list[str]
    together: bool
    why: str


class SizeDeduction(TypedDict):
    """One figure a reservation gives before its KV cache, and where it comes from: the
    checkpoint, gpud's estimate, a calibration's measurement, or the config."""

    name: str
    mib: int
    source: str


class PredictedKv(TypedDict):
    """What a serve's reservation leaves for the KV cache (gpud.core.sizing.at_reservation):
    in MiB, in tokens and in sequences of max_model_len at once as vLLM counts them, each
    deduction named; beside the tokens vLLM logged at its last start, once calibrated."""

    vram_mib: int
    vllm_version: str
    # the known release whose sizing rules it borrows (gpud has none of its own for it)
    rules_from: str | None
    kv_at_mib: int
    kv_from: str
    kv_tokens: int
    max_concurrency: float
    sequences: int
    deductions: list[SizeDeduction]
    overheads_how: str
    logged_kv_tokens: int | None


class PlanSize(TypedDict):
    """A vllm serve's needs from its checkpoint on disk (gpud.vllm.model_size): its minimum
    reservation and what its vram_mib leaves above it, or why they are unknown."""

    serve: str
    vram_mib: int
    minimum_mib: int | None
    headroom_mib: int | None
    how: str
    kv: NotRequired[PredictedKv]


class PlanDenied(TypedDict):
    """A denial: the first role lacking room; a serve on several roles with more than one
    lacking lists each in ``lacking``."""

    serve: str
    role: str
    bound: str
    need_mib: int
    free_mib: int
    shortfall_mib: int
    reason: str
    lacking: NotRequired[list[Shortage]]


class Blocker(TypedDict):
    """What stands in the way of a config change."""

    what: str
    role: str | None
    mib: int | None
    reason: str
    message: str


class PlanUndo(TypedDict):
    """What brings one step of an apply back. ``under``: the config it runs under (``old``
    after a rollback's restore); ``state_after``: the state the serve goes back to."""

    kind: str  # stop, start, restart, restore
    under: Literal["old", "new"]
    serve: str | None
    mib_before: int | None
    mib_after: int | None
    state_after: str | None
    message: str


class PlanStep(TypedDict):
    """One step of an apply, in order (see gpud.core.actions). ``mib_before``/``mib_after``:
    the serve's reservation before and after it; ``undo``: null when nothing to bring back."""

    kind: str  # backup, stop, write, reload, restart, start, verify
    under: Literal["old", "new"]
    serve: str | None
    mib_before: int | None
    mib_after: int | None
    message: str
    undo: PlanUndo | None


class Plan(TypedDict):
    """POST /v1/plan. ``steps``: what an apply of it does, in order (empty when the plan is
    refused: blocked, or the resident set does not fit)."""

    source: str
    roles: list[PlanRole]
    serves: list[PlanServe]
    restart: list[str]
    resident_fits: bool
    denied: list[PlanDenied]
    blocked: list[Blocker]
    stop_first: list[str]
    steps: list[PlanStep]
    boot: NotRequired[list[PlanBoot]]
    sizes: NotRequired[list[PlanSize]]


class CalibrationRun(TypedDict):
    """A calibration in progress (and POST /v1/serves/{name}/calibrate's answer)."""

    serve: str
    fingerprint: str
    running: bool
    window_s: float
    elapsed_s: float
    samples: int
    peak_mib: int | None


class CalibrationRecord(TypedDict):
    fingerprint: str
    ts: float
    window_s: float
    samples: int
    steady_mib: int
    peak_mib: int
    recommended_mib: int
    current: bool


class Predicted(TypedDict):
    """A vllm serve's needs predicted from its checkpoint on disk (gpud.vllm.model_size), shown
    beside what a calibration measured; the figures null, `how` saying why, when unknown;
    `kv` what its reservation leaves for the KV cache, where the checkpoint could be sized."""

    weights_mib: int | None
    kv_mib: int | None
    context_mib: int | None
    minimum_mib: int | None
    max_model_len: int | None
    how: str
    kv: NotRequired[PredictedKv]


class Calibration(TypedDict):
    """GET /v1/serves/{name}/calibration."""

    serve: str
    status: CalibrationStatus
    fingerprint: str | None
    running: CalibrationRun | None
    record: CalibrationRecord | None
    vllm: NotRequired[dict[str, Any] | None]
    predicted: NotRequired[Predicted]


class ApplyStep(TypedDict):
    """POST /v1/apply: one NDJSON line per step as it happens."""

    step: str
    ok: bool
    message: str
    path: NotRequired[str]  # backup: where the old config was saved
    serve: NotRequired[str]  # the serve a stop, restart, start or rollback step is about


class ApplyResult(TypedDict):
    """POST /v1/apply: the last NDJSON line. ``error`` is the message of what failed for a
    rolled-back apply, gpud's error object for a refused or failed one."""

    result: Literal[ApplyOutcome.APPLIED, ApplyOutcome.ROLLED_BACK, ApplyOutcome.REFUSED,
                    ApplyOutcome.FAILED]
    summary: NotRequired[str]
    backup: NotRequired[str | None]
    error: NotRequired[str | ErrorBody]


class PeerListed(TypedDict):
    """One model a peer lists for itself, as this host last read it (docs/peers.md)."""

    id: str
    state: str
    expected_wait_s: float | None
    queued: int


class Peer(TypedDict):
    """One [peers.NAME]: whether it answered its /v1/models when last asked (null: not asked
    yet) and since when, its circuit (closed: requests go to it) and since when and why, the
    models offered here, the round trip of its last answer, and what last went wrong."""

    name: str
    url: str
    reachable: bool | None
    reachable_since: float | None
    circuit: str  # one of gpud.core.peers.CircuitState
    circuit_since: float
    circuit_reason: str | None
    models: list[PeerListed]
    rtt_s: float | None
    last_error: str | None
    checked_at: float | None


class Peers(TypedDict):
    peers: list[Peer]


class RouteChoice(TypedDict):
    """GET /v1/route?model=NAME: which host takes a request for the model now
    (gpud.core.peers.choose_host; docs/peers.md, "Which host"): `found` false when none can,
    else `peer` names the peer, null this host; `hosts` are those compared ("" this host)."""

    model: str
    found: bool
    peer: str | None
    hosts: list[str]


# The component schemas of the served document, by name.
COMPONENTS: tuple[type, ...] = (
    Figures, Observed, Reservation, Role, Ledger, Calibrated, QueuePlace, Serve, Serves, Event,
    Events,
    UsageRow, Usage,
    PreemptionStep, PreemptionPlan, PreemptionRefused, Started, PreemptionDryRun, SleepDone,
    Slept, WakeDone, Woken,
    Launching, Observation, ConfigFile, Status, Admitted, Released, Reloaded, PlanRole,
    PlanServe, Shortage, PlanDenied, Blocker, PlanUndo, PlanStep, Plan, CalibrationRun,
    CalibrationRecord, Calibration, ApplyStep, ApplyResult, ErrorBody, Error,
    PeerListed, Peer, Peers, RouteChoice,
)
