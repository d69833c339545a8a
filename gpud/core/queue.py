"""The router's queue: which waiting serve comes up next, which requests go first, whether a
request joins the queue at all, and which running serve makes room. Pure: values in, values out
(gpud.life.ondemand holds the requests and carries the decisions out).

A request for an on-demand serve that does not fit (a refusal of class no-memory) waits in its
serve's queue (at most `max_queued` requests per serve, each at most `queue_timeout_s`) instead
of failing (`arrive`, `after_refusal`: a returned decision, never an exception). Of the serves
that wait, one at a time may make room (`next_up`): a serve that is running already is served
first (collation: its requests go through at once), then the most important serve (the smallest
priority number), then the first request in the fair order of requesters (`order`).

Fair between requesters (docs/router.md, "Who is asking"): a request's requester is its key's
name, else the client's address. Each requester with requests waiting has a virtual time, the
requests of its let through divided by its weight (`keys.NAME.weight`), as start-time fair
queueing and Linux's CFS keep one; a requester that begins to wait starts at the smallest
virtual time of those waiting (no credit banked while it sent nothing, no debt kept from before),
and the requester with the smallest goes first (a key's `priority`, smaller first, before that;
then the oldest request; then names). So a requester's one waiting request goes within one turn
of each other requester, however many requests they queue, and requesters that keep waiting are
let through in proportion to their weights. Never "most requests wins".

A running serve may be evicted for it (`victims`) when the queue may ever evict it
(`may_evict`: an on-demand serve of equal or lower priority, or any serve of lower priority that
can sleep or be stopped) and it is either idle (nothing in flight and no request for IDLE_AFTER_S)
or up for at least `min_awake_s` since it was brought up on demand: an alternating storm A B A B
swaps at most once per `min_awake_s`. The victims are taken least important first, then the
cheapest to bring back (the median of its measured wakes or starts), then by name. A request
whose serve would not fit even were every serve it may evict evicted (`could_fit`) does not wait.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

# A serve is idle (evictable before min_awake_s) with nothing in flight and no request for this long.
IDLE_AFTER_S: Final = 1.0
# How many measured bring-ups of each kind the median is taken over.
MEASURED: Final = 5
# A requester's share when its key names none (and a requester without a key).
WEIGHT: Final = 1.0
KEY_PRIORITY: Final = 0


@dataclass(frozen=True, slots=True)
class Ticket:
    """One request in the queue: the serve it waits for, who asked, and when it arrived (the
    clock's time); the serve's priority and whether it runs already; its key's priority
    (smaller first) and weight."""

    serve: str
    requester: str
    arrived: float
    priority: int
    running: bool = False
    key_priority: int = KEY_PRIORITY
    weight: float = WEIGHT


@dataclass(frozen=True, slots=True)
class Shares:
    """Each waiting requester's virtual time: what of its requests was let through, divided by
    its weight, since it began to wait."""

    used: Mapping[str, float] = field(default_factory=dict)

    def of(self, requester: str) -> float:
        """A requester's virtual time; one not yet waiting: the smallest of those waiting."""
        if requester in self.used:
            return self.used[requester]
        return min(self.used.values(), default=0.0)


def joined(shares: Shares, requester: str) -> Shares:
    """REQUESTER began to wait (again): it starts at the smallest virtual time of those waiting."""
    if requester in shares.used:
        return shares
    return Shares({**shares.used, requester: shares.of(requester)})


def let_through(shares: Shares, ticket: Ticket) -> Shares:
    """TICKET's request went through: its requester is charged one request, by its weight."""
    used = shares.of(ticket.requester) + 1.0 / ticket.weight
    return Shares({**shares.used, ticket.requester: used})


def forget(shares: Shares, waiting: Iterable[str]) -> Shares:
    """Only the requesters still WAITING keep a virtual time (one that waits again later starts
    at the smallest of those waiting then)."""
    still = set(waiting)
    return Shares({r: v for r, v in shares.used.items() if r in still})


def order(tickets: Iterable[Ticket], shares: Shares) -> list[Ticket]:
    """The fair order of the waiting requests: running serves first (collation), then the most
    important serve, then the key's priority, then by virtual time: a requester's Kth waiting
    request (from 0, oldest first) at its virtual time plus K over its weight; then the oldest,
    then by requester and serve."""
    by_requester: dict[str, list[Ticket]] = {}
    for t in sorted(tickets, key=lambda t: (t.arrived, t.serve)):
        by_requester.setdefault(t.requester, []).append(t)
    ranked = []
    for requester, mine in by_requester.items():
        start = shares.of(requester)
        for k, t in enumerate(mine):
            ranked.append(((not t.running, t.priority, t.key_priority, start + k / t.weight,
                            t.arrived, requester, t.serve), t))
    return [t for _, t in sorted(ranked, key=lambda x: x[0])]


def next_up(tickets: Iterable[Ticket], shares: Shares) -> str | None:
    """The serve whose queued requests go first: that of the first request in `order`."""
    first = order(tickets, shares)
    return first[0].serve if first else None


def position(tickets: Iterable[Ticket], shares: Shares, ticket: Ticket) -> int:
    """TICKET's place in `order` (1: next), 0 when it is not there."""
    for i, t in enumerate(order(tickets, shares), 1):
        if t == ticket:
            return i
    return 0


@dataclass(frozen=True, slots=True)
class Place:
    """A requester's requests waiting for one serve, as `gpuctl models` and /v1/models show
    them: how many, and the place of the first of them in `order` (1: next)."""

    requester: str
    waiting: int
    position: int


def places(tickets: Iterable[Ticket], shares: Shares) -> dict[str, list[Place]]:
    """Each serve's queue by requester, in the order they go."""
    out: dict[str, dict[str, Place]] = {}
    for i, t in enumerate(order(tickets, shares), 1):
        mine = out.setdefault(t.serve, {})
        seen = mine.get(t.requester)
        mine[t.requester] = Place(t.requester, 1, i) if seen is None else \
            Place(t.requester, seen.waiting + 1, seen.position)
    return {serve: list(by.values()) for serve, by in out.items()}


def expected_wait_s(tickets: Iterable[Ticket], shares: Shares,
                    cost_s: Mapping[str, float | None]) -> dict[str, float | None]:
    """How long each waiting serve's requests may expect to wait: the measured bring-ups
    (COST_S: each serve's median, None unmeasured) of the serves that come up before it, in
    `order`, and its own; None when one of them is unmeasured. An estimate: evictions and
    min_awake_s come on top."""
    out: dict[str, float | None] = {}
    total: float | None = 0.0
    for t in order(tickets, shares):
        if t.serve in out:
            continue
        cost = None if t.running else cost_s.get(t.serve)
        total = None if total is None or (cost is None and not t.running) else \
            total + (cost or 0.0)
        out[t.serve] = None if total is None else round(total, 1)
    return out


@dataclass(frozen=True, slots=True)
class Freeing:
    """What evicting one running serve would give a waiting serve on one ROLE: MIB, once it may
    be evicted, IN_S from now (0: now; its min_awake_s or idle time to come, `evictable`)."""

    role: str
    mib: int
    in_s: float
    # which serve, and what keeps it until then ("min_awake_s", "idle time"): what is shown
    serve: str = ""
    why: str = ""


@dataclass(frozen=True, slots=True)
class Ask:
    """A waiting serve as the backfill sees it: what bringing it up adds to what is committed
    on each of its roles (its need less what it holds already: a sleeping serve's kept MiB),
    and what each eviction it may make would free, and when."""

    serve: str
    takes_mib: Mapping[str, int]
    frees: tuple[Freeing, ...] = ()


def earliest_start(ask: Ask, free_mib: Mapping[str, int]) -> float:
    """How long until ASK fits, were it to evict every serve it may as soon as it may (0: it
    fits now without evicting; math.inf: never, by evictions alone). FREE_MIB: each role's
    free MiB now."""
    at = 0.0
    for role, need in ask.takes_mib.items():
        room = free_mib.get(role, 0)
        if room >= need:
            continue
        for f in sorted((f for f in ask.frees if f.role == role), key=lambda f: f.in_s):
            room += f.mib
            if room >= need:
                at = max(at, f.in_s)
                break
        else:
            return math.inf
    return at


def spare_at(ask: Ask, free_mib: Mapping[str, int], at_s: float) -> dict[str, int]:
    """What is left on each of ASK's roles once it is up AT_S from now, having evicted every
    serve it may evict by then (the memory a backfill may take without delaying it)."""
    return {role: free_mib.get(role, 0) - need
            + sum(f.mib for f in ask.frees if f.role == role and f.in_s <= at_s)
            for role, need in ask.takes_mib.items()}


def backfill(asks: Sequence[Ask], free_mib: Mapping[str, int]) -> list[str]:
    """Which waiting serves may come up now (EASY backfilling, as Slurm's backfill scheduler
    does for jobs). ASKS in the queue's fair order (`order`, one per serve); FREE_MIB each
    role's free MiB now. Each in turn that fits now without evicting anything goes, until the
    first that does not: the head, whose earliest start (`earliest_start`: when its victims
    become evictable) is kept. After it, one that fits now goes only when it takes none of the
    memory the head needs at that start (`spare_at`). So a serve that fits and delays nobody
    never waits, the head is never delayed by one that went, and the order among those that
    must wait is the queue's."""
    free = dict(free_mib)
    go: list[str] = []
    spare: dict[str, int] | None = None
    for ask in asks:
        fits = all(free.get(r, 0) >= need for r, need in ask.takes_mib.items())
        if fits and (spare is None or all(spare.get(r, need) >= need
                                          for r, need in ask.takes_mib.items())):
            go.append(ask.serve)
            for r, need in ask.takes_mib.items():
                free[r] = free.get(r, 0) - need
                if spare is not None and r in spare:
                    spare[r] -= need
        elif spare is None:
            at = earliest_start(ask, free)
            # a head that can never start keeps nothing from the others
            spare = {} if math.isinf(at) else spare_at(ask, free, at)
    return go


@dataclass(frozen=True, slots=True)
class Waiting:
    """What a serve with requests waiting for memory waits for, as gpuctl and GET /v1/serves
    say it: `16 requests; a may be evicted in 287 s (min_awake_s)`. IN_S: how long until
    then (None: until some change, not a time)."""

    requests: int
    reason: str
    in_s: float | None

    def text(self) -> str:
        return f"{self.requests} request{'s' if self.requests != 1 else ''}; {self.reason}"


def waiting_for(ask: Ask, free_mib: Mapping[str, int], *, requests: int,
                head: str | None) -> Waiting:
    """What ASK's serve, with REQUESTS waiting, waits for: its turn behind HEAD (the serve
    that goes first, when it is another), else the eviction that lets it fit at its earliest
    start (`earliest_start`), else nothing it may evict frees enough."""
    if head is not None and head != ask.serve:
        return Waiting(requests, f"behind {head} in the queue", None)
    at = earliest_start(ask, free_mib)
    if math.isinf(at):
        return Waiting(requests, "no serve it may evict frees enough now; waiting for memory "
                       "to be freed", None)
    if at == 0.0:
        return Waiting(requests, "fits now: coming up", 0.0)
    serves = sorted({f.serve for f in ask.frees if f.in_s == at})
    whys = sorted({f.why for f in ask.frees if f.in_s == at and f.why})
    because = f" ({', '.join(whys)})" if whys else ""
    return Waiting(requests, f"{', '.join(serves)} may be evicted in {math.ceil(at)} s{because}",
                   at)


class Arrival(StrEnum):
    """What a request for a serve that is not running does first."""

    TRY = "try"      # try to bring its serve up (or share the bring-up under way)
    JOIN = "join"    # wait in the queue, behind the requests waiting already


def arrive(*, queue_on: bool, others_waiting: bool, bringing_up: bool,
           backfills: bool = False) -> Arrival:
    """A request that finds its serve down: with the queue on and requests for other serves
    waiting for memory already, it waits its turn behind them (JOIN) rather than take the
    memory they wait for, unless `backfill` lets it go now (BACKFILLS: it fits now and takes
    nothing the head needs at its earliest start); else (or when its serve is being brought
    up: it shares that) TRY."""
    return Arrival.JOIN if queue_on and others_waiting and not bringing_up and not backfills \
        else Arrival.TRY


@dataclass(frozen=True, slots=True)
class QueueRefusal:
    """The request does not wait: answered at once, of this class (gpud.core.bringup.Why's
    values), with this text; the queue's bound it met (router.max_queued)."""

    why: str
    message: str
    max_queued: int


def after_refusal(*, queue_on: bool, no_memory: bool, could_fit: bool, queued: int,
                  max_queued: int) -> Arrival | QueueRefusal | None:
    """A try refused (or an arrival told to JOIN, a refusal of class no-memory): JOIN the queue,
    or QueueRefusal (queue full), or None: the refusal stands as it is (no queue, not for memory, or
    no eviction the queue may make could ever make room)."""
    if not queue_on or not no_memory or not could_fit:
        return None
    if queued >= max_queued:
        return QueueRefusal("queue-full", f"{queued} request(s) wait for it already "
                            f"(router.max_queued = {max_queued})", max_queued)
    return Arrival.JOIN


class Next(StrEnum):
    """What becomes of a request for a serve once it has tried (or been told to JOIN)."""

    UP = "up"            # its serve runs: it goes now
    WAIT = "wait"        # it waits in its serve's queue
    REFUSED = "refused"  # it is answered at once: its try's refusal, or the queue's


@dataclass(frozen=True, slots=True)
class QueueDecision:
    """NEXT, and when REFUSED by the queue's bound, that refusal (None: the try's own stands)."""

    next: Next
    refusal: QueueRefusal | None = None


def admit(*, joined: bool, refused: str | None, never_fits: bool, queue_on: bool,
          could_fit: bool, queued: int, max_queued: int) -> QueueDecision:
    """The decision on a request after its try: JOINED (its arrival was told to JOIN: others
    wait for memory already), or REFUSED (the class of its try's refusal, gpud.core.bringup.Why's
    values; None with JOINED false: the serve came up). A refusal for memory waits in the queue
    when the queue is on, an eviction it may make could make room (COULD_FIT) and the serve's
    queue has room (`after_refusal`); one that can never fit (NEVER_FITS: nothing would ever make
    room) and any other refusal stand. An arrival told to JOIN waits unless the queue is
    full."""
    if not joined and refused is None:
        return QueueDecision(Next.UP)
    if not joined and (refused != "no-memory" or never_fits):
        return QueueDecision(Next.REFUSED)
    # told to JOIN, it waits whether or not an eviction could make room for it (its own try
    # comes at its turn); the queue's bound holds for it as for any
    entry = after_refusal(queue_on=queue_on or joined, no_memory=True,
                          could_fit=could_fit or joined, queued=queued, max_queued=max_queued)
    if isinstance(entry, QueueRefusal):
        return QueueDecision(Next.REFUSED, entry)
    if entry is None:  # (not JOINED: no queue, or no eviction could ever make room)
        return QueueDecision(Next.REFUSED)
    return QueueDecision(Next.WAIT)


# The figure of the router's config each queue refusal is about, as a refusal's details carry
# it (gpud.life.ondemand): what a client is told beside the class (docs/router.md, "Queue
# instead of thrash").
REFUSAL_FIGURES: Final[Mapping[str, str]] = {"queue-full": "max_queued",
                                            "queue-timeout": "queue_timeout_s"}


def refusal_figures(why: str, details: Mapping[str, object]) -> dict[str, int]:
    """The figures a refusal of class WHY may tell any client (its limit in router's config:
    max_queued, queue_timeout_s), from the error's DETAILS; none for other classes, or when
    the details lack it."""
    name = REFUSAL_FIGURES.get(why)
    value = details.get(name) if name is not None else None
    return {name: value} if name is not None and isinstance(value, int) \
        and not isinstance(value, bool) else {}


def figures_text(figures: Mapping[str, int]) -> str:
    """FIGURES as a public reason says them: " (router.max_queued = 8)"; "" none."""
    return f" ({', '.join(f'router.{k} = {v}' for k, v in figures.items())})" if figures else ""


@dataclass(frozen=True, slots=True)
class EvictionCandidate:
    """A serve on a waiting serve's roles, as the eviction rule sees it."""

    serve: str
    priority: int
    on_demand: bool
    # it can sleep (sleep_level) or be stopped when preempted (preemptible = "stop")
    yields: bool


def may_evict(priority: int, o: EvictionCandidate) -> bool:
    """Whether a queued request for a serve of PRIORITY may ever evict O: an on-demand serve
    of equal or lower priority, or any of lower priority that can sleep or be stopped (an
    operator's serve of equal priority is not evicted by requests)."""
    if o.priority < priority:
        return False
    if o.on_demand:
        return True
    return o.priority > priority and o.yields


def may_cut(*, evict_busy: bool, priority: int, victim_priority: int, aborts: bool) -> bool:
    """Whether an eviction for a queued request for a serve of PRIORITY may end the requests
    still in flight on its victim (of VICTIM_PRIORITY) at the drain's bound
    (daemon.drain_timeout_s), rather than be refused: when the operator allows it
    (router.evict_busy), the waiting serve is of equal or higher priority (a smaller or equal
    number), and the victim ends them with a told end (ABORTS: it is put to sleep, and vLLM's
    abort gives each stream its last chunk; a stop would cut them short without one)."""
    return evict_busy and aborts and priority <= victim_priority


def could_fit(need_mib: int, free_mib: int, freed: Iterable[int]) -> bool:
    """Whether NEED_MIB would fit in FREE_MIB plus what evicting each of the serves the queue
    may evict frees (FREED, each's MiB): else waiting is pointless."""
    return free_mib + sum(freed) >= need_mib


@dataclass(frozen=True, slots=True)
class Held:
    """A running serve a queued request might evict."""

    serve: str
    priority: int
    # requests in flight as it last counted them; None: unknown (counted busy)
    in_flight: int | None
    # seconds since its last request (0 while one is in flight); None: none seen
    quiet_s: float | None
    # seconds since it was brought up on demand; None: not brought up by a request
    up_for_s: float | None
    # the median of its measured bring-backs (wake when it sleeps, else start); None: unmeasured
    cost_s: float | None = None


@dataclass(frozen=True, slots=True)
class Protected:
    """No victim now: wait this long (at most) before asking again."""

    wait_s: float
    reason: str


def idle(h: Held) -> bool:
    return h.in_flight == 0 and (h.quiet_s is None or h.quiet_s >= IDLE_AFTER_S)


def idle_in(h: Held) -> float:
    """How long until H is idle, were nothing to come in (math.inf: something in flight, or
    its count unknown: a change of its count is an event of its own)."""
    if h.in_flight != 0:
        return math.inf
    return 0.0 if h.quiet_s is None else max(0.0, IDLE_AFTER_S - h.quiet_s)


def evictable(h: Held, priority: int, min_awake_s: float) -> float:
    """0 when a request for a serve of `priority` may evict H now, else how long until it may
    (math.inf: never, a more important serve)."""
    if h.priority < priority:
        return math.inf
    if idle(h) or h.up_for_s is None or h.up_for_s >= min_awake_s:
        return 0.0
    return min_awake_s - h.up_for_s


def victims(held: Iterable[Held], serve: str, priority: int,
            min_awake_s: float) -> list[str] | Protected:
    """The serves a request for SERVE (of `priority`) may evict now, in the order to evict
    them, or how long to wait when there is none."""
    now: list[Held] = []
    later: list[float] = []
    for h in held:
        if h.serve == serve:
            continue
        wait = evictable(h, priority, min_awake_s)
        if wait == 0.0:
            now.append(h)
        elif math.isfinite(wait):
            later.append(min(wait, idle_in(h)))
    if now:
        return [h.serve for h in sorted(now, key=_eviction_order)]
    if later:
        return Protected(min(later), "the running serves of equal or lower priority are busy "
                         f"and up for less than min_awake_s ({min_awake_s:g} s)")
    return Protected(math.inf, "no running serve of equal or lower priority to evict")


def _eviction_order(h: Held) -> tuple[int, float, str]:
    return (-h.priority, math.inf if h.cost_s is None else h.cost_s, h.serve)


def median_s(took: Sequence[float]) -> float | None:
    """The median of the last MEASURED durations, rounded to the millisecond; None: none."""
    last = list(took)[-MEASURED:]
    return round(statistics.median(last), 3) if last else None


# The buckets of the queue's waits and the bring-ups' durations (seconds; the metrics').
BUCKETS_S: Final = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(slots=True)
class Histogram:
    """Counts of durations by bucket (cumulative when read, as Prometheus' histogram is)."""

    counts: list[int]
    total_s: float = 0.0
    n: int = 0
    bounds: tuple[float, ...] = BUCKETS_S

    @classmethod
    def empty(cls, bounds: tuple[float, ...] = BUCKETS_S) -> Histogram:
        return cls([0] * len(bounds), bounds=bounds)

    def observe(self, seconds: float) -> None:
        for i, bound in enumerate(self.bounds):
            if seconds <= bound:
                self.counts[i] += 1
                break
        self.total_s += seconds
        self.n += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, count of durations at most le) for each bucket, then "+Inf"."""
        out, running = [], 0
        for bound, count in zip(self.bounds, self.counts, strict=True):
            running += count
            out.append((repr(bound), running))
        out.append(("+Inf", self.n))
        return out
