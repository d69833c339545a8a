"""gpuctl's formatters: pure functions from a decoded JSON answer (docs/api.md) to text.

No I/O here and no clock: ``local_time`` takes the time zone it is given (local by default).
Each ``format_*`` says which answer it reads.
"""

from __future__ import annotations

# Not ``typing.TYPE_CHECKING``: importing typing costs startup time. mypy treats any name
# TYPE_CHECKING as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import datetime
    from collections.abc import Sequence
    from typing import Any

    from gpud.core import answers
    from gpud.ctl.errors import CtlError

    Doc = dict[str, Any]

from gpud.core.vocab import DENIED, STATES  # noqa: E402 - defined once


def _mib(value: Any) -> str:
    return "-" if value is None else f"{value} MiB"


def _dash(value: Any) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def local_time(ts: float, tz: datetime.tzinfo | None = None) -> str:
    """ISO 8601 with the UTC offset, in local time unless ``tz`` is given.

    Local time through the time module: importing datetime costs a twentieth of a
    ``gpuctl status`` (the same text as ``datetime.fromtimestamp(ts).astimezone()
    .isoformat(timespec="seconds")``, which the tests hold it to)."""
    if tz is not None:
        from datetime import datetime

        return datetime.fromtimestamp(ts, tz).isoformat(timespec="seconds")
    import math
    import time

    # The second datetime shows: it rounds to microseconds (half to even) first.
    fraction, whole = math.modf(ts)
    micro = round(fraction * 1e6)
    if micro >= 1_000_000:
        whole += 1
    elif micro < 0:
        whole -= 1
    moment = time.localtime(int(whole))
    offset = moment.tm_gmtoff
    sign, offset = ("-", -offset) if offset < 0 else ("+", offset)
    hours, rest = divmod(offset, 3600)
    minutes, seconds = divmod(rest, 60)
    zone = f"{sign}{hours:02d}:{minutes:02d}" + (f":{seconds:02d}" if seconds else "")
    return time.strftime("%Y-%m-%dT%H:%M:%S", moment) + zone


def format_reservation(res: answers.Reservation) -> str:
    """``  fast 14336 MiB (resident, running)``, as in the seed record."""
    state = res.get("state") or "?"
    if res.get("external"):
        flags = "external"
    elif res.get("resident"):
        flags = f"resident, {state}"
    else:
        flags = state
    if res.get("part"):  # a serve on several roles: which of its parts this role holds
        flags += f"; {res['part']} of {', '.join(res.get('roles') or [])}"
    return f"  {res.get('serve')} {res.get('mib')} MiB ({flags})"


def format_observed(obs: answers.Observed, reserve_mib: Any) -> list[str]:
    label = "observed (simulated)" if obs.get("simulated") else "observed"
    reserve = obs.get("reserve_mib", reserve_mib)
    pending = obs.get("pending_mib") or 0
    line = (f"  {label}: used {_mib(obs.get('used_mib'))}, "
            f"non-ledger draw {_mib(obs.get('non_ledger_draw_mib'))} (reserve {_mib(reserve)}), "
            f"physical free {_mib(obs.get('physical_free_mib'))}, ")
    if pending:
        line += f"pending {pending} MiB, "
    line += f"effective free {_mib(obs.get('effective_free_mib'))}"
    lines = [line]
    if obs.get("estimated"):
        lines.append("  the split is estimated: the driver reports no per-process memory "
                     "(WDDM); running serves are counted at their reservations")
    excess = obs.get("reserve_excess_mib") or 0
    if excess > 0:
        lines.append(f"  ledger free is optimistic by {excess} MiB: "
                     "non-ledger draw exceeds the reserve")
    return lines


def format_role(role: answers.Role) -> list[str]:
    """One role of ``GET /v1/ledger``: the seed's gpu_role line, its reservations, observation."""
    lines = [f"gpu_role '{role.get('name')}': capacity {_mib(role.get('capacity_mib'))}, "
             f"reserve {_mib(role.get('reserve_mib'))}, "
             f"committed {_mib(role.get('committed_mib'))}, free {_mib(role.get('free_mib'))}"]
    if role.get("over_committed"):
        free = role.get("free_mib")
        by = f" by {-free} MiB" if isinstance(free, int) and free < 0 else ""
        lines.append(f"  !! OVER-COMMITTED{by}: committed exceeds capacity minus reserve; "
                     "reservations are kept, release or shrink a serve")
    if role.get("missing"):
        # A role the config no longer has, kept because reservations still name it (its
        # device is empty and its capacity 0: there is no device to name).
        lines.append(f"  !! role '{role.get('name')}' is not in the config: its reservations "
                     "are kept; release them or restore the role")
    lines += [format_reservation(r) for r in role.get("reservations") or []]
    observed = role.get("observed")
    if observed:
        lines += format_observed(observed, role.get("reserve_mib"))
    return lines


def format_ledger(doc: answers.Ledger) -> str:
    """``GET /v1/ledger`` as the seed record writes a ledger."""
    roles = doc.get("roles") or []
    blocks = ["\n".join(format_role(r)) for r in roles]
    if not roles:
        blocks.append("no roles configured")
    text = "\n\n".join(blocks)
    shown = any((obs := r.get("observed")) is not None and obs.get("simulated") for r in roles)
    if doc.get("simulated") and not shown:
        text += "\nobservation: SIMULATED (no real GPU behind these figures)"
    return text


def _counts(counts: Doc) -> str:
    order = [s for s in STATES if s in counts] + sorted(s for s in counts if s not in STATES)
    parts = [f"{counts[s]} {s}" for s in order if counts[s]]
    return ", ".join(parts) if parts else "none"


def _block(rows: Sequence[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows) + 2
    return "\n".join(f"{k + ':':<{width}}{v}".rstrip() for k, v in rows)


def format_status(doc: answers.Status, tz: datetime.tzinfo | None = None) -> str:
    """``GET /v1/status`` as a short block."""
    launching = doc.get("launching") or {}
    if launching.get("available"):
        launch = "available"
    else:
        launch = "UNAVAILABLE" + (f": {launching['reason']}" if launching.get("reason") else "")
    obs = doc.get("observation") or {}
    backend = obs.get("backend") or "none"
    if obs.get("available"):
        # Available but with a caveat (a simulation state file missing or broken: the last
        # good state is in force): said, not hidden.
        observation = backend + (f"; {obs['reason']}" if obs.get("reason") else "")
    else:
        observation = f"UNAVAILABLE ({backend})" + (f": {obs['reason']}" if obs.get("reason")
                                                    else "")
        if doc.get("admission") == "strict":
            observation += "; strict admission falls back to the ledger bound"
    if obs.get("simulated"):
        observation += " (SIMULATED: no real GPU behind these figures)"
    started = doc.get("started_at")
    when = local_time(started, tz) if isinstance(started, (int, float)) else "-"
    over = doc.get("over_committed") or []
    names = [o if isinstance(o, str) else str(o.get("role") or o.get("name")) for o in over]
    file = doc.get("config_file") or {}
    config = _dash(doc.get("config"))
    if file.get("differs"):
        config += f" (!! the file on disk is not the config in force: {file.get('reason')})"
    store = doc.get("store") or {}
    rows = [
        ("version", _dash(doc.get("version"))),
        ("host", _dash(doc.get("host"))),
        ("config", config),
        ("started", when + ("" if doc.get("ready", True) else " (not ready yet)")),
        ("admission", _dash(doc.get("admission"))),
        ("launching", launch),
        ("observation", observation),
        ("serves", _counts(doc.get("serve_states") or {})),
        ("over-committed", ("!! " + ", ".join(names)) if names else "none"),
    ]
    if store and not store.get("ok", True):
        since = store.get("failing_since")
        rows.append(("store", "!! FAILING" + (f" since {local_time(since, tz)}"
                                              if isinstance(since, (int, float)) else "")
                     + f" ({store.get('failed_commits')} failed commits): {store.get('error')}; "
                     "nothing that needs a record is changed"))
    router = doc.get("router")
    if router is not None:
        rows.append(("router", _router_line(router)))
    front = doc.get("front")
    # what of the front's degradation is the router's is said on the router's line
    mine = set(router["degraded"]) if router is not None else set()
    degraded = [d for d in (front["degraded"] if front is not None else []) if d not in mine]
    if degraded:
        rows.append(("front", "!! DEGRADED: " + "; ".join(degraded)))
    rows.append(("summary", _dash(doc.get("summary"))))
    return _block(rows)


def _router_line(router: answers.RouterStatus) -> str:
    """`listening on ADDRESS`, or `!! NOT LISTENING on ADDRESS`; then why it is degraded."""
    where = router["listen"]
    line = f"listening on {where}" if router["listening"] else f"!! NOT LISTENING on {where}"
    if router["degraded"]:
        line += ("; " if router["listening"] else ": ") + "!! DEGRADED: " + "; ".join(
            router["degraded"])
    return line


_SERVE_COLUMNS: tuple[tuple[str, str, bool], ...] = (
    # (header, key, right-aligned)
    ("NAME", "name", False), ("ROLE", "role", False), ("STATE", "state", False),
    ("VRAM", "vram_mib", True), ("RESERVED", "reserved_mib", True),
    ("RESIDENT", "resident", False), ("PRIO", "priority", True), ("PORT", "port", True),
    ("PID", "main_pid", True), ("CALIBRATION", "calibration", False),
)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]],
                 right: Sequence[bool]) -> str:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        padded = zip(cells, widths, right, strict=True)
        return "  ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in padded).rstrip()

    return "\n".join([line(headers)] + [line(r) for r in rows])


def format_serves(doc: answers.Serves) -> str:
    """``GET /v1/serves``: a table, then the reason of each serve that has one."""
    serves = doc.get("serves") or []
    if not serves:
        return "no serves"
    rows = [[_dash(s.get(key)) for _, key, _ in _SERVE_COLUMNS] for s in serves]
    for row, s in zip(rows, serves, strict=True):
        if s.get("roles"):  # on several roles (devices): all of them
            row[1] = ",".join(s["roles"])
        if s.get("device_lost"):
            row[2] += " (DEVICE LOST)"
        if s.get("waiting"):
            row[2] = WAITING  # for memory, with requests: not its last refusal
    columns = list(_SERVE_COLUMNS)
    if any(s.get("wake_s") is not None or s.get("start_s") is not None for s in serves):
        # the medians of its measured wakes and starts: its cost to bring back (the router's
        # queue evicts the cheaper first, docs/router.md)
        columns.append(("WAKE/START", "wake_s", True))
        for row, s in zip(rows, serves, strict=True):
            row.append(f"{_secs(s.get('wake_s'))}/{_secs(s.get('start_s'))}")
    if any(s.get("front") for s in serves):  # a host without a front keeps its table
        columns.append(("LAST REQUEST", "last_activity_s_ago", True))
        for row, s in zip(rows, serves, strict=True):
            row.append(ago(s.get("last_activity_s_ago")) if s.get("front") else "-")
    text = format_table([h for h, _, _ in columns], rows, [r for _, _, r in columns])
    reasons = [waiting_line(s) if s.get("waiting") else
               f"{s.get('name')} ({s.get('state')}): {s['reason']}"
               + (f"; {s['parked_host_mib']} MiB parked in host RAM"
                  if s.get("parked_host_mib") else "")
               for s in serves if s.get("reason") or s.get("waiting")]
    reasons += [f"{s.get('name')}: {s['device_lost']}" for s in serves if s.get("device_lost")]
    if reasons:
        text += "\n\n" + "\n".join(reasons)
    if doc.get("simulated"):
        text += "\nobservation: SIMULATED (no real GPU behind observed figures)"
    return text


# What gpuctl shows as the state of a serve with requests waiting for memory (its stored state
# is that of its last refused try: the queue's answer is that it waits).
WAITING = "waiting"


def waiting_line(s: answers.Serve) -> str:
    """`b (waiting): 16 requests; a may be evicted in 287 s (min_awake_s)`."""
    w = s.get("waiting")
    if not w:
        return ""
    n = w.get("requests")
    return (f"{s.get('name')} ({WAITING}): {n} request{'s' if n != 1 else ''}; "
            f"{w.get('reason')}")


# The HOST of a model this host serves (gpuctl models): a peer's is its [peers.NAME] name.
LOCAL_HOST = "local"


def format_models(doc: answers.Serves, peers: answers.Peers | None = None) -> str:
    """``GET /v1/serves``, by the names the router routes (docs/router.md): one row each; then,
    with PEERS (``GET /v1/peers``, docs/peers.md), each model a peer offers here, its HOST the
    peer's name, its state and queue as the peer reported them."""
    rows = [[model, LOCAL_HOST, str(s.get("name")),
             WAITING if s.get("waiting") else str(s.get("state")), _dash(s.get("port")),
             "yes" if s.get("front") else "no", _dash(s.get("in_flight")),
             _dash(s.get("queued"))]
            for s in doc.get("serves") or [] for model in s.get("models") or []]
    down = []
    for p in (peers or {"peers": []}).get("peers") or []:
        if p.get("circuit") != "closed":
            down.append(f"host {p.get('name')} unreachable ({p.get('circuit_reason') or '?'}): "
                        "its models are answered 503 until it answers again")
            continue
        rows += [[str(m.get("id")), str(p.get("name")), "-", str(m.get("state")), "-", "-",
                  "-", _dash(m.get("queued"))] for m in p.get("models") or []]
    if not rows:
        return "\n".join(["no models: the router is off (no [router] table) or no serve has a "
                          "port", *down])
    rows.sort()
    table = format_table(["MODEL", "HOST", "SERVE", "STATE", "PORT", "FRONT", "IN FLIGHT",
                          "QUEUED"], rows, [False, False, False, False, True, False, True, True])
    waits = [waiting_line(s) for s in doc.get("serves") or [] if s.get("waiting")]
    return "\n".join([table, *waits, *_queues(doc), *down])


def _queues(doc: answers.Serves) -> list[str]:
    """Who waits for each serve, in the order they go (docs/router.md, "Who is asking")."""
    out = []
    for s in doc.get("serves") or []:
        places = s.get("queue")
        if not places:
            continue
        wait = s.get("expected_wait_s")
        expect = f", expected wait {wait:.0f} s" if isinstance(wait, int | float) else ""
        who = ", ".join(f"{p['requester']} {p['waiting']} (position {p['position']})"
                        for p in places)
        out.append(f"waiting for {s.get('name')}{expect}: {who}")
    return out


def format_usage(doc: answers.Usage) -> str:
    """``GET /v1/usage``: one row per key and model (docs/router.md, "Who is asking")."""
    rows = [[r.get("key") or "-", r.get("model") or "-", str(r.get("requests")),
             str(r.get("prompt_tokens")), str(r.get("completion_tokens")),
             str(r.get("total_tokens")), str(r.get("unmetered")), str(r.get("hung_up", 0)),
             " ".join(f"{k}:{v}" for k, v in (r.get("statuses") or {}).items())]
            for r in doc.get("rows") or []]
    out = format_table(["KEY", "MODEL", "REQUESTS", "PROMPT", "COMPLETION", "TOTAL",
                        "UNMETERED", "HUNG UP", "STATUSES"], rows,
                       [False, False, True, True, True, True, True, True, False]) if rows else (
        "no usage recorded (the router counts requests per key once it has answered some)")
    budgets = format_budgets(doc.get("budgets") or [])
    return out + ("\n\n" + budgets if budgets else "")


def format_budgets(budgets: list[answers.UsageBudget]) -> str:
    """Each key's token budgets (docs/router.md, "Budgets"): used and left this UTC day and
    month, and when the period ends; "" when no key has one."""
    rows = []
    for b in budgets:
        for name, limit, used, left, ends in (
                ("tokens_per_day", b.get("tokens_per_day"), b.get("used_day"),
                 b.get("left_day"), b.get("day_ends")),
                ("tokens_per_month", b.get("tokens_per_month"), b.get("used_month"),
                 b.get("left_month"), b.get("month_ends"))):
            if limit is None:
                continue
            # the time module, as local_time: importing datetime costs startup time
            import time

            rows.append([str(b.get("key")), name, str(limit), str(used), str(left),
                         time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(int(ends or 0)))
                         + (" (refused until then)" if left == 0 else "")])
    if not rows:
        return ""
    return format_table(["KEY", "BUDGET", "TOKENS", "USED", "LEFT", "RESETS"], rows,
                        [False, False, True, True, True, False])


def format_peers(doc: answers.Peers, tz: datetime.tzinfo | None = None) -> str:
    """``GET /v1/peers`` (docs/peers.md): one row per peer, then each peer's models and last
    error."""
    peers = doc.get("peers") or []
    if not peers:
        return "no peers: serves.toml has no [peers.NAME] table (docs/peers.md)"
    rows = []
    for p in peers:
        reachable = p.get("reachable")
        since = p.get("reachable_since")
        state = "not asked yet" if reachable is None else ("reachable" if reachable else
                                                          "unreachable")
        if reachable is not None and isinstance(since, int | float):
            state += " since " + local_time(since, tz)
        rtt = p.get("rtt_s")
        rows.append([str(p.get("name")), str(p.get("url")), state, str(p.get("circuit")),
                     str(len(p.get("models") or [])),
                     f"{rtt * 1000:.1f} ms" if isinstance(rtt, int | float) else "-"])
    lines = [format_table(["PEER", "URL", "REACHABLE", "CIRCUIT", "MODELS", "RTT"], rows,
                          [False, False, False, False, True, True])]
    for p in peers:
        models = p.get("models") or []
        if models:
            lines.append(f"{p.get('name')} models: " + ", ".join(
                f"{m.get('id')} ({m.get('state')}"
                + (f", wait {m.get('expected_wait_s'):.0f}s" if isinstance(
                    m.get("expected_wait_s"), int | float) else "")
                + (f", {m.get('queued')} queued" if m.get("queued") else "") + ")"
                for m in models))
        if p.get("last_error"):
            lines.append(f"{p.get('name')} last error: {p.get('last_error')}")
        if p.get("circuit") != "closed" and p.get("circuit_reason"):
            since = p.get("circuit_since")
            lines.append(f"{p.get('name')} circuit {p.get('circuit')}"
                         + (f" since {local_time(since, tz)}" if isinstance(since, int | float)
                            else "") + f": {p.get('circuit_reason')}")
    return "\n".join(lines)


_SERVE_FIELDS: tuple[tuple[str, str], ...] = (
    ("name", "name"), ("role", "role"), ("state", "state"), ("reason", "reason"), ("phase", "phase"),
    ("configured", "configured"), ("external", "external"), ("vram", "vram_mib"),
    ("device lost", "device_lost"),
    ("reserved", "reserved_mib"), ("observed", "observed_mib"), ("resident", "resident"),
    ("priority", "priority"), ("port", "port"), ("unit", "unit"), ("main pid", "main_pid"),
    ("restarts", "n_restarts"), ("calibration", "calibration"), ("fingerprint", "fingerprint"),
    ("sleep level", "sleep_level"), ("parked RAM", "parked_host_mib"), ("front", "front"),
    ("activity", "last_activity_s_ago"), ("in flight", "in_flight"), ("models", "models"),
    ("wake time", "wake_s"), ("start time", "start_s"),  # the medians of the measured ones
    ("queued", "queued"),
)


def _secs(value: Any) -> str:
    return f"{value:.1f}s" if isinstance(value, int | float) and not isinstance(value, bool) \
        else "-"


def ago(seconds: Any) -> str:
    """Seconds since, as `gpuctl serves` shows a last request: `12s ago`, `3m ago`, `2h ago`."""
    if not isinstance(seconds, int | float) or isinstance(seconds, bool):
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds // 60:.0f}m ago"
    return f"{seconds // 3600:.0f}h ago"


def format_serve(serve: answers.Serve) -> str:
    """``GET /v1/serves/{name}``: one ``key: value`` line per field; unknown fields at the end."""
    rows = []
    fields: dict[str, Any] = dict(serve)
    for label, key in _SERVE_FIELDS:
        value = fields.get(key)
        rows.append((label, _mib(value) if key.endswith("_mib")
                     else ago(value) if key == "last_activity_s_ago" else _dash(value)))
        if key == "role" and serve.get("roles"):
            rows.append(("roles", ", ".join(serve["roles"])))
        if key == "observed_mib" and serve.get("observed_by_role"):
            # per device, beside the reservation held on each
            rows.append(("observed each", ", ".join(
                f"{r} {mib} MiB" for r, mib in (serve.get("observed_by_role") or {}).items())))
    known = {key for _, key in _SERVE_FIELDS} | {"calibrated", "roles", "observed_by_role"}
    rows.append(("calibrated", _calibrated(serve.get("calibrated"))))
    rows += [(k, _dash(v)) for k, v in sorted(serve.items()) if k not in known and k != "simulated"]
    text = _block(rows)
    if serve.get("simulated"):
        text += "\nobservation: SIMULATED (no real GPU behind observed figures)"
    return text


def _calibrated(brief: Any) -> str:
    """The current calibration in one line, vLLM's own account beside the measured figures."""
    if not isinstance(brief, dict):
        return "-"
    line = (f"steady {_mib(brief.get('steady_mib'))}, peak {_mib(brief.get('peak_mib'))}, "
            f"recommended reservation {_mib(brief.get('recommended_mib'))}")
    vllm = brief.get("vllm")
    if isinstance(vllm, dict) and vllm.get("weights_mib") is not None:
        line += (f"; vLLM: weights {_mib(vllm.get('weights_mib'))}, KV cache "
                 f"{_mib(vllm.get('kv_cache_mib'))}, CUDA graphs {_mib(vllm.get('cudagraph_mib'))}, "
                 f"context {_mib(vllm.get('context_mib'))}")
        if vllm.get("recommended_kv_cache_mib") is not None:
            line += f", recommends kv_cache_mib = {vllm['recommended_kv_cache_mib']}"
    return line


def _free_by_role(doc: answers.Admitted | answers.Released) -> str:
    """``left free 9000 MiB, right free 6000 MiB`` for a serve on several roles."""
    by_role = doc.get("figures_by_role") or {}
    free = {r: f.get("free_mib") for r, f in by_role.items()}
    return ", ".join(f"{r} free {_mib(free.get(r))}" for r in doc.get("roles") or [])


def format_admit(doc: answers.Admitted) -> str:
    """``admitted fast: 14336 MiB on dark-fast (was 18432); dark-fast free 1887 MiB``; a serve
    on several roles: ``admitted big: 30000 MiB on each of left, right; left free ...``."""
    role = doc.get("role")
    was = doc.get("replaced_mib")
    figures = doc.get("figures") or {}
    if doc.get("roles"):
        line = (f"admitted {doc.get('serve')}: {doc.get('mib')} MiB on each of "
                f"{', '.join(doc['roles'])}" + (f" (was {was})" if was else "")
                + f"; {_free_by_role(doc)}")
    else:
        line = (f"admitted {doc.get('serve')}: {doc.get('mib')} MiB on {role}"
                + (f" (was {was})" if was else "")
                + f"; {role} free {_mib(figures.get('free_mib'))}")
    if doc.get("note"):
        line += f"\nnote: {doc['note']}"
    return line


def format_preemption(doc: answers.Started | answers.Admitted | answers.PreemptionDryRun | Doc
                      ) -> str:
    """The plan of a preemption, `gpuctl plan`-style, as the daemon wrote it; "" without one
    (start and admit with preempt, and their dry runs)."""
    plan = doc.get("preemption")
    if not isinstance(plan, dict):
        return ""
    lines = plan.get("lines")
    if isinstance(lines, list):
        text = "\n".join(str(line) for line in lines)
    else:
        # start answers with the serve's view (its "name"), admit with "serve"; the refusal
        # names it itself
        serve = plan.get("serve") or doc.get("serve") or doc.get("name")
        text = f"no preemption can make room for {serve}: {plan.get('reason')}"
    if doc.get("dry_run"):
        text += "\ndry run: nothing changed"
    return text


def format_sleep(serve: answers.Slept | answers.Woken) -> str:
    """What sleep and wake answer: the serve in one line, and what the step did."""
    line = format_lifecycle(serve)
    done = serve.get("sleep")
    if isinstance(done, dict):
        line += (f"\nasleep at level {done.get('level')}: {_mib(done.get('from_mib'))} -> "
                 f"{_mib(done.get('sleep_mib'))}"
                 + (f", {_mib(done.get('parked_host_mib'))} parked in host RAM"
                    if done.get("parked_host_mib") else ""))
    woke = serve.get("wake")
    if isinstance(woke, dict):
        line += f"\nawake: {_mib(woke.get('mib'))} (the serve took {woke.get('serve_ms')} ms)"
    return line


def format_release(doc: answers.Released, stopped: bool = False) -> str:
    """``released ocr: 5120 MiB on dark-fast; dark-fast free 7007 MiB``."""
    role = doc.get("role")
    figures = doc.get("figures") or {}
    verb = "stopped and released" if stopped else "released"
    if doc.get("roles"):
        return (f"{verb} {doc.get('serve')}: {_mib(doc.get('released_mib'))} on each of "
                f"{', '.join(doc['roles'])}; {_free_by_role(doc)}")
    return (f"{verb} {doc.get('serve')}: {_mib(doc.get('released_mib'))} on {role}; "
            f"{role} free {_mib(figures.get('free_mib'))}")


def format_lifecycle(serve: answers.Serve) -> str:
    """The Serve that start, stop and restart answer with, in one line."""
    facts = []
    if serve.get("reserved_mib") is not None:
        facts.append(f"reserved {serve['reserved_mib']} MiB")
    fields: dict[str, Any] = dict(serve)
    for label, key in (("port", "port"), ("pid", "main_pid"), ("unit", "unit")):
        if fields.get(key) is not None:
            facts.append(f"{label} {fields[key]}")
    where = ", ".join(serve["roles"]) if serve.get("roles") else _dash(serve.get("role"))
    phase = serve.get("phase") or "idle"
    # While gpud's own work on it runs (a start answered with --no-wait), its state and reason
    # are still those from before that work: said so, never shown as its outcome.
    state = f"{phase} (was {serve.get('state')})" if phase != "idle" else serve.get("state")
    line = f"{serve.get('name')}: {state} on {where}" + (f" ({', '.join(facts)})" if facts else "")
    if serve.get("reason"):
        line += f"\n{'reason' if phase == 'idle' else 'reason before'}: {serve['reason']}"
    return line


def format_reload(doc: answers.Reloaded) -> str:
    return "reloaded" + (f": {doc['summary']}" if doc.get("summary") else "")


def format_event(ev: answers.Event, tz: datetime.tzinfo | None = None) -> str:
    """One event: local ISO time, kind, serve, role, MiB, message."""
    ts = ev.get("ts")
    when = local_time(ts, tz) if isinstance(ts, (int, float)) else "-"
    mib = _mib(ev.get("mib"))
    message = " ".join(str(ev.get("message") or "").split())
    return (f"{when} {_dash(ev.get('kind')):<16} {_dash(ev.get('serve')):<12} "
            f"{_dash(ev.get('role')):<12} {mib:>10}  {message}").rstrip()


def format_events(doc: answers.Events, tz: datetime.tzinfo | None = None) -> str:
    return "\n".join(format_event(ev, tz) for ev in doc.get("events") or [])


def format_error(err: CtlError) -> str:
    """``gpuctl: <message>``, and for a denial the figures from its details."""
    lines = [f"gpuctl: {err.message}"]
    d = err.details
    lacking = d.get("lacking")
    if err.code == "denied" and isinstance(lacking, list):
        # A serve on several roles: every role that lacks room; nothing was reserved.
        for one in lacking:
            lines.append(f"gpuctl: need {_mib(one.get('need_mib'))}, free "
                         f"{_mib(one.get('free_mib'))}, shortfall {_mib(one.get('shortfall_mib'))}"
                         f" ({one.get('bound')} bound on {one.get('role')})")
    elif err.code == "denied" and "need_mib" in d:
        bound = f" ({d['bound']} bound on {d.get('role')})" if d.get("bound") else ""
        lines.append(f"gpuctl: need {_mib(d.get('need_mib'))}, free {_mib(d.get('free_mib'))}, "
                     f"shortfall {_mib(d.get('shortfall_mib'))}{bound}")
    plan = d.get("preemption")
    if isinstance(plan, dict) and isinstance(plan.get("lines"), list):
        lines += [f"gpuctl: {line}" for line in plan["lines"]]
    problems = d.get("problems")
    if isinstance(problems, list) and len(problems) > 1:
        lines += [f"gpuctl:   {p}" for p in problems]
    if err.code == "forbidden":
        lines.append("gpuctl: changes need root or the admin group named by daemon.admin_group")
    return "\n".join(lines)


def dump_json(doc: Any, compact: bool = False) -> str:
    import json

    if compact:
        return json.dumps(doc, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return json.dumps(doc, sort_keys=True, ensure_ascii=False, indent=2)



def _arrow(before: Any, after: Any) -> str:
    b = "-" if before is None else str(before)
    a = "-" if after is None else str(after)
    return b if b == a else f"{b} -> {a}"


# What each bound of a plan's denial measures (gpud.core.vocab.DenialBound; DESIGN "The arithmetic").
_BOUND_WHAT = {
    "ledger": " (capacity - reserve - committed)",
    "physical": " (strict admission: what the device has free, less what admitted serves "
                "will draw)",
}


def format_plan(doc: answers.Plan) -> str:
    lines = [f"plan: {doc.get('source')} against the running config"]
    for role in doc.get("roles", []):
        before: dict[str, Any] = dict(role.get("before") or {})
        after: dict[str, Any] = dict(role.get("after") or {})
        lines.append(f"role '{role.get('name')}':")
        for key in ("capacity_mib", "reserve_mib", "committed_mib", "free_mib"):
            label = key.replace("_mib", "")
            lines.append(f"  {label:<10} {_arrow(before.get(key), after.get(key))} MiB")
    rows = [("SERVE", "ROLE", "MIB", "UTIL", "STATE", "CHANGE", "RESTART")]
    for s in doc.get("serves", []):
        rows.append((str(s.get("name")), _arrow(s.get("role_before"), s.get("role_after")),
                     _arrow(s.get("mib_before"), s.get("mib_after")),
                     _arrow(s.get("util_before"), s.get("util_after")),
                     _arrow(s.get("state_before"), s.get("state_after")),
                     str(s.get("change")), "yes" if s.get("restart") else "no"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    for size in doc.get("sizes") or []:  # only those read from a checkpoint on disk
        if size.get("minimum_mib") is not None:
            lines.append(f"{size.get('serve')}: minimum {size.get('minimum_mib')} MiB "
                         f"({size.get('how')}), headroom {size.get('headroom_mib')} MiB")
            lines += _predicted_kv_lines(size.get("kv"))
    restart = doc.get("restart") or []
    lines.append(f"must restart: {', '.join(restart) if restart else 'none'}")
    for s in doc.get("serves", []):  # why a serve is not restarted (asleep), or denied
        if s.get("reason") and s.get("state_after") != DENIED:
            lines.append(f"{s.get('name')}: {s.get('reason')}")
    if doc.get("resident_fits"):
        lines.append("resident set: fits, every resident serve is admitted")
    else:
        for d in doc.get("denied", []):
            lines.append(f"resident set: DOES NOT FIT: {d.get('serve')} on {d.get('role')}: "
                         f"{d.get('bound')} bound{_BOUND_WHAT.get(str(d.get('bound')), '')}: "
                         f"need {d.get('need_mib')} MiB, free {d.get('free_mib')} MiB, "
                         f"short {d.get('shortfall_mib')} MiB")
    for boot in doc.get("boot") or []:  # what the boot serializes on each device, and why
        how = "together" if boot.get("together") else "alone"
        lines.append(f"boot on {boot.get('device')}: {', '.join(boot.get('serves') or [])} "
                     f"{how}: {boot.get('why')}")
    stop_first = doc.get("stop_first") or []
    if stop_first:
        lines.append(f"stop first (leave the config or their role): {', '.join(stop_first)}")
    for b in doc.get("blocked") or []:
        lines.append(f"BLOCKED: {b.get('message')}")
    steps = doc.get("steps") or []
    if steps:
        lines.append("steps (what apply does, in order; undo on failure):")
        for i, step in enumerate(steps, 1):
            undo = step.get("undo")
            lines.append(f"  {i:>2}. {step.get('message')}"
                         + (f"   [undo: {undo.get('message')}]" if undo else ""))
    return "\n".join(lines)



def format_calibration(doc: answers.Calibration) -> str:
    rec = doc.get("record")
    lines = [f"{doc.get('serve')}: {doc.get('status')} (fingerprint {doc.get('fingerprint')})"]
    run = doc.get("running")
    if run:
        lines.append(f"  measuring: {run.get('elapsed_s')} of {run.get('window_s')} s, "
                     f"{run.get('samples')} samples, peak {run.get('peak_mib')} MiB")
    if rec:
        current = "" if rec.get("current") else " (for an older fingerprint: stale)"
        lines.append(f"  steady {rec.get('steady_mib')} MiB, peak {rec.get('peak_mib')} MiB over "
                     f"{rec.get('window_s')} s ({rec.get('samples')} samples): recommended "
                     f"vram_mib = {rec.get('recommended_mib')}{current}")
    vllm = doc.get("vllm")
    if vllm:
        # vLLM's own start-up account, from the serve's journal (gpud.vllm.vllm_log)
        lines.append(f"  vLLM says: weights {vllm.get('weights_mib')} MiB, KV cache "
                     f"{vllm.get('kv_cache_mib')} MiB, CUDA graphs {vllm.get('cudagraph_mib')} MiB; "
                     f"context beyond its budget {vllm.get('context_mib')} MiB")
        if vllm.get("kv_extended"):
            # vLLM 0.34's extensible KV cache: sized after warm-up, not by the estimate
            lines.append(f"  KV cache extended after warm-up to {vllm.get('kv_cache_blocks')} "
                         f"blocks ({vllm.get('kv_cache_mib')} MiB; profiling estimated "
                         f"{vllm.get('kv_cache_estimate_mib')} MiB)")
        if vllm.get("sleep_parked_host_mib") is not None:
            lines.append(f"  its last sleep parked {vllm.get('sleep_parked_host_mib')} MiB in "
                         "host RAM (vLLM's \"backed up in CPU\")")
        if vllm.get("recommended_kv_cache_mib"):
            lines.append(f"  vLLM recommends --kv-cache-memory={vllm.get('recommended_kv_cache_bytes')}: "
                         f"kv_cache_mib = {vllm.get('recommended_kv_cache_mib')}")
        if vllm.get("kv_cache_fit_mib"):
            # sized in bytes, the serve skips vLLM's profiling and starts beside its neighbours
            lines.append(f"  KV cache to fit the reservation exactly: {vllm.get('kv_cache_fit_mib')} "
                         f"MiB ({vllm.get('kv_cache_fit')}); in [serves.{doc.get('serve')}.vllm]: "
                         f"kv_cache_mib = {vllm.get('kv_cache_fit_mib')}")
        elif vllm.get("kv_cache_fit"):
            lines.append(f"  KV cache to fit the reservation exactly: {vllm.get('kv_cache_fit')}")
    lines += predicted_lines(doc.get("predicted"), vllm)
    return "\n".join(lines)


def predicted_lines(p: Any, vllm: Any) -> list[str]:
    """The checkpoint's prediction beside vLLM's measured weights, so a wrong one shows."""
    if not p:
        return []
    if p.get("minimum_mib") is None:
        return [f"  predicted from the checkpoint: unknown ({p.get('how')})"]
    line = (f"  predicted from the checkpoint: minimum {p.get('minimum_mib')} MiB (weights "
            f"{p.get('weights_mib')} + KV for one {p.get('max_model_len')}-token sequence "
            f"{p.get('kv_mib')} + context {p.get('context_mib')})")
    measured = vllm.get("weights_mib") if vllm else None
    if isinstance(measured, int) and measured > 0 and p.get("weights_mib"):
        off = (p["weights_mib"] - measured) * 100 / measured
        line += f"; vLLM measured weights {measured} MiB: predicted {off:+.1f}%"
    return [line, *_predicted_kv_lines(p.get("kv"))]


def _predicted_kv_lines(kv: Any) -> list[str]:
    """What the reservation leaves for the KV cache, each deduction with its source (measured
    once calibrated), and the predicted tokens beside those vLLM logged."""
    if not kv:
        return []
    parts = ", ".join(f"{d.get('name')} {d.get('mib')} ({d.get('source')})"
                      for d in kv.get("deductions") or [])
    sized = ("" if kv.get("kv_from") == "what the reservation leaves"
             else f" (sized by {kv.get('kv_from')})")
    lines = [f"  vram_mib {kv.get('vram_mib')} on vLLM {kv.get('vllm_version')}: {parts} "
             f"leave a KV cache of {kv.get('kv_at_mib')} MiB{sized}: {kv.get('kv_tokens'):,} "
             "tokens, "
             f"{kv.get('max_concurrency')}x max concurrency ({kv.get('sequences')} sequences "
             "at once)"]
    if kv.get("rules_from"):
        lines.append(f"  (gpud has no sizing rules of vLLM {kv.get('vllm_version')}'s own: "
                     f"these are by vLLM {kv.get('rules_from')}'s, the newest it knows)")
    logged = kv.get("logged_kv_tokens")
    if isinstance(logged, int) and logged > 0:
        off = (kv.get("kv_tokens", 0) - logged) * 100 / logged
        lines.append(f"  KV cache tokens: predicted {kv.get('kv_tokens'):,}, vLLM logged "
                     f"{logged:,} ({off:+.1f}%)")
    return lines

