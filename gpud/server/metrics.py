"""Prometheus text exposition (format 0.0.4) of the ledger, observation and serve states.

Names are `gpud_*`, in MiB (`_mib`) as DCGM's framebuffer fields are. Labels follow DCGM's
exporter so a dashboard can join gpud's figures with DCGM's on the device:

- `gpud_device_*`: one series per physical device (labels `gpu`, `UUID`, `pci_bus_id`), so a
  sum by `gpu` counts a device once however many roles share it;
- `gpud_role_*`: the ledger of one role (labels `role`, `gpu`, `UUID`);
- `gpud_serve_*`: one serve (labels `serve`, `role`, `gpu`, `UUID`).

The text is written by prometheus_client, Prometheus' reference client: `GpudCollector` yields
its metric families and `generate_latest` formats them, exactly (`repr` of the float: a counter
of 12,345,678 reads `1.2345678e+07`, never the six digits `{:g}` kept) and escaped as the format
says.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric

from gpud.core.ledger import Ledger
from gpud.core.queue import Histogram
from gpud.core.routerlog import OVERHEAD_BUCKETS_S, STATUS_CLASSES
from gpud.core.vocab import EVENT_KINDS, STATES, EventKind, ServeState
from gpud.host.observer import Observer
from gpud.life.calibration import Calibrator
from gpud.life.service import LedgerService

if TYPE_CHECKING:
    from gpud.host.peers import PeerPoller
    from gpud.life.ondemand import Orchestrator
    from gpud.nginx.router import RouterLog

# Prometheus' text exposition format, version 0.0.4: what its scraper and promtool expect, and
# what generate_latest writes (prometheus_client's CONTENT_TYPE_PLAIN_0_0_4).
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Every kind of event gpud records has its series, from its first scrape (a counter that appears
# only once its first event happens loses that first increase to rate()).
COUNTED: tuple[str, ...] = tuple(str(kind) for kind in EVENT_KINDS)


class _Family:
    """One metric family; NAME is the samples' name (a counter's ends in `_total`)."""

    def __init__(self, name: str, kind: str, help_text: str) -> None:
        # prometheus_client names a counter's family without `_total` and writes it back in the
        # 0.0.4 text (`# TYPE gpud_events_total counter`, as promtool wants it)
        self.metric = Metric(name.removesuffix("_total") if kind == "counter" else name,
                             help_text, kind)  # fmt: skip
        self.name = name

    def add(self, value: float, **labels: str) -> None:
        self.metric.add_sample(self.name, labels, float(value))


class GpudCollector:
    """prometheus_client's Collector of gpud's figures, read afresh at each `collect`."""

    def __init__(self, svc: LedgerService, observer: Observer | None,
                 calibrator: Calibrator | None = None, on_demand: Orchestrator | None = None,
                 router_log: RouterLog | None = None,
                 front_degraded: Callable[[], tuple[str, ...]] | None = None,
                 peers: PeerPoller | None = None) -> None:
        self.svc, self.observer, self.calibrator = svc, observer, calibrator
        self.on_demand, self.router_log = on_demand, router_log
        self.front_degraded = front_degraded
        self.peers = peers

    def collect(self) -> Iterator[Metric]:
        families = _families(self.svc, self.observer, self.calibrator)
        if self.on_demand is not None:
            _idle_families(families, self.svc, self.on_demand)
            _queue_families(families, self.svc, self.on_demand)
        if self.router_log is not None:
            _router_families(families, self.router_log)
        if self.front_degraded is not None:
            _front_families(families, self.front_degraded())
        if self.peers is not None:
            _peer_families(families, self.peers)
        for family in families.values():
            yield family.metric


def render(svc: LedgerService, observer: Observer | None, calibrator: Calibrator | None = None,
           on_demand: Orchestrator | None = None, router_log: RouterLog | None = None,
           front_degraded: Callable[[], tuple[str, ...]] | None = None,
           peers: PeerPoller | None = None) -> str:
    """The 0.0.4 text exposition of what `GpudCollector` collects now."""
    return generate_latest(GpudCollector(svc, observer, calibrator, on_demand, router_log,
                                         front_degraded, peers)).decode()


def _peer_families(fams: dict[str, _Family], peers: PeerPoller) -> None:
    """Each [peers.NAME] (docs/peers.md): whether its router answered its /v1/models when last
    asked and its circuit is closed, the round trip of that answer, and the requests this
    host's router forwarded to it, by the class of the answer's status (from the router's
    access log: gpud.nginx.router.RouterLog)."""
    up = fams.setdefault("gpud_peer_up", _Family(
        "gpud_peer_up", "gauge", "1 when the peer answered its model list when last asked "
        "and its circuit is closed; 0 otherwise, a refused key included (why in GET "
        "/v1/peers, gpuctl peers)"))
    rtt = fams.setdefault("gpud_peer_rtt_seconds", _Family(
        "gpud_peer_rtt_seconds", "gauge", "The round trip of the peer's last /v1/models "
        "answer, read whole"))
    requests = fams.setdefault("gpud_peer_requests_total", _Family(
        "gpud_peer_requests_total", "counter", "Requests this host's router forwarded to the "
        "peer since gpud started, by the class of the answer's status"))
    for peer in peers.answer()["peers"]:
        name = peer["name"]
        up.add(1 if peer["reachable"] and peer["circuit"] == "closed"
               and peer["last_error"] is None else 0, peer=name)
        if peer["rtt_s"] is not None:
            rtt.add(peer["rtt_s"], peer=name)
        counts = peers.view(name).requests
        for code in sorted(set(STATUS_CLASSES) - {"3xx"} | set(counts)):
            requests.add(counts.get(code, 0), peer=name, code=code)


def _front_families(fams: dict[str, _Family], degraded: tuple[str, ...]) -> None:
    """Whether the front's last sync left something dark (gpud.nginx.front.Front.degraded: why, in
    GET /v1/status and gpuctl status): the count of what it left out."""
    fams.setdefault("gpud_front_degraded", _Family(
        "gpud_front_degraded", "gauge", "What the front's last sync left dark (the router's "
        "keys refused, its module missing, a port another process holds): 0 when nothing; "
        "why in GET /v1/status, front.degraded")).add(len(degraded))


def _router_families(fams: dict[str, _Family], router_log: RouterLog) -> None:
    """What the router answered, by model (its access log, read by gpud: docs/router.md): a
    series for each routed name and status class from the first scrape, model "" for the
    requests the router answered before it knew a name of its table (bad input, an unknown
    name: a client's names never become labels)."""
    table, stats = router_log.table(), router_log.stats
    requests = fams.setdefault("gpud_router_requests_total", _Family(
        "gpud_router_requests_total", "counter", "Requests the router answered since gpud "
        "started, by the model they named (its serve) and the class of the answer's status"))
    keys = {(m, s, c) for m, s in table.items() for c in STATUS_CLASSES if c != "3xx"}
    for model, serve, status in sorted(keys | set(stats.requests)):
        requests.add(stats.requests.get((model, serve, status), 0), model=model, serve=serve,
                     code=status)
    overhead = fams.setdefault("gpud_router_overhead_seconds", _Family(
        "gpud_router_overhead_seconds", "histogram", "The router's own share of each "
        "request a serve answered: nginx's time for it less the serve's and gpud's ensure "
        "(millisecond resolution), since gpud started"))
    for model in sorted(set(table) | set(stats.overhead)):
        _histogram(overhead, stats.overhead.get(model) or Histogram.empty(OVERHEAD_BUCKETS_S),
                   model=model)
    _key_families(fams, router_log)


def _key_families(fams: dict[str, _Family], router_log: RouterLog) -> None:
    """Usage per key since gpud started (gpud.core.usage; docs/router.md, "Who is asking"):
    requests by key, model and status class, and the serve's own tokens by key, model and
    kind. The key names come from the keys file (its bound on the labels; "" without a key),
    the models from the table."""
    requests = fams.setdefault("gpud_router_key_requests_total", _Family(
        "gpud_router_key_requests_total", "counter", "Requests the router answered since gpud "
        "started, by key (\"\": none), the model they named and the class of the status"))
    tokens = fams.setdefault("gpud_router_key_tokens_total", _Family(
        "gpud_router_key_tokens_total", "counter", "Tokens of the serves' own usage objects "
        "since gpud started, by key, model and kind (prompt, completion); answers without "
        "usage add none (gpud_router_key_unmetered_total counts them)"))
    unmetered = fams.setdefault("gpud_router_key_unmetered_total", _Family(
        "gpud_router_key_unmetered_total", "counter", "Answers that carried no usage of the "
        "serve's own (a stream without include_usage, an error) since gpud started, by key "
        "and model"))
    by_model: dict[tuple[str, str], list[int]] = {}
    for (key, model, status), c in sorted(router_log.by_key.items()):
        requests.add(c.requests, key=key, model=model, code=status)
        sums = by_model.setdefault((key, model), [0, 0, 0])
        sums[0] += c.prompt_tokens
        sums[1] += c.completion_tokens
        sums[2] += c.unmetered
    for (key, model), (prompt, completion, none) in sorted(by_model.items()):
        tokens.add(prompt, key=key, model=model, kind="prompt")
        tokens.add(completion, key=key, model=model, kind="completion")
        unmetered.add(none, key=key, model=model)


def _idle_families(fams: dict[str, _Family], svc: LedgerService,
                   on_demand: Orchestrator) -> None:
    """The idle sleeps and stops of on-demand serves, a series for each serve with an idle time
    from the first scrape (and for any serve that has a count, configured or not any more): the
    orchestrator's counts (gpud.life.counts), read now."""
    counted = on_demand.counts
    for name, help_text, counts, due in (
        ("gpud_idle_sleeps_total", "On-demand serves put to sleep for want of requests "
         "(idle_sleep_s) since gpud started", counted.idle_sleeps, "idle_sleep_s"),
        ("gpud_idle_stops_total", "On-demand serves stopped for want of requests "
         "(idle_stop_s) since gpud started", counted.idle_stops, "idle_stop_s"),
    ):
        family = fams.setdefault(name, _Family(name, "counter", help_text))
        serves = {n for n, spec in svc.config.serves.items()
                  if spec.on_demand and getattr(spec, due) is not None} | set(counts)
        for serve in sorted(serves):
            family.add(counts.get(serve, 0), serve=serve)
    flights = fams.setdefault("gpud_requests_in_flight", _Family(
        "gpud_requests_in_flight", "gauge", "Requests in flight on each serve as it counts them "
        "(vLLM's num_requests_running + num_requests_waiting), read by gpud every 0.5 s; no "
        "series while a serve's count is unknown"))
    for serve in sorted(svc.config.serves):
        count = on_demand.in_flight(serve)
        if count is not None:
            flights.add(count, serve=serve)


def _queue_families(fams: dict[str, _Family], svc: LedgerService,
                    on_demand: Orchestrator) -> None:
    """The router's queue and the bring-ups by request, by serve (a serve's model names share
    its queue: docs/router.md): a series for each on-demand serve from the first scrape; the
    counts are the orchestrator's (gpud.life.counts), read now."""
    counted = on_demand.counts
    od = sorted(n for n, spec in svc.config.serves.items() if spec.on_demand)
    queued = fams.setdefault("gpud_requests_queued", _Family(
        "gpud_requests_queued", "gauge", "Requests waiting in each serve's queue for it to be "
        "brought up (the router's queue: router.max_queued)"))
    for serve in sorted(set(od) | set(on_demand.queued)):
        queued.add(len(on_demand.queued.get(serve, ())), serve=serve)
    evicted = fams.setdefault("gpud_evictions_total", _Family(
        "gpud_evictions_total", "counter", "Serves put to sleep or stopped to make room for a "
        "queued request for another serve, since gpud started"))
    for serve in sorted(set(od) | set(counted.evictions)):
        evicted.add(counted.evictions.get(serve, 0), serve=serve)
    waits = fams.setdefault("gpud_queue_wait_seconds", _Family(
        "gpud_queue_wait_seconds", "histogram", "How long requests waited in each serve's "
        "queue (brought up, refused or gone), since gpud started"))
    for serve in sorted(set(od) | set(counted.queue_waits)):
        _histogram(waits, counted.queue_waits.get(serve) or Histogram.empty(), serve=serve)
    took = fams.setdefault("gpud_bringup_seconds", _Family(
        "gpud_bringup_seconds", "histogram", "How long each bring-up by a request took (kind "
        "wake or start: from the ensure that began it to the serve running), since gpud "
        "started; its _count is the bring-ups"))
    for (serve, kind), hist in sorted(counted.bringups.items()):
        _histogram(took, hist, serve=serve, kind=str(kind))


def _histogram(family: _Family, hist: Histogram, **labels: str) -> None:
    name = family.metric.name
    for le, count in hist.cumulative():
        family.metric.add_sample(f"{name}_bucket", {**labels, "le": le}, float(count))
    family.metric.add_sample(f"{name}_sum", labels, hist.total_s)
    family.metric.add_sample(f"{name}_count", labels, float(hist.n))


_Fam = Callable[[str, str, str], _Family]


def _families(svc: LedgerService, observer: Observer | None,
              calibrator: Calibrator | None) -> dict[str, _Family]:
    fams: dict[str, _Family] = {}

    def fam(name: str, kind: str, help_text: str) -> _Family:
        return fams.setdefault(name, _Family(name, kind, help_text))

    ledger, states = svc.ledger, svc.states()
    _device_families(fam, observer, ledger, states)
    role_labels = _role_families(fam, observer, ledger, states)
    _serve_families(fam, svc, observer, calibrator, role_labels)
    _gpud_families(fam, svc, observer)
    return fams


def _device_families(fam: _Fam, observer: Observer | None, ledger: Ledger,
                     states: Mapping[str, ServeState]) -> None:
    """Each observed device: its identity, total and the split of its draw."""
    latest = observer.latest if observer is not None else None
    if observer is not None and latest is not None and latest.available:
        for sample in latest.devices:
            # DCGM's join labels, spelled as DCGM spells them. Its `modelName` is not repeated on
            # every series: promtool's lint rejects camelCase label names, so the model rides on
            # gpud_device_info as `model_name` (or comes from DCGM by group_left on UUID).
            labels = {"gpu": str(sample.index), "UUID": sample.uuid, "pci_bus_id": sample.pci_bus_id}
            fam("gpud_device_info", "gauge", "1 for each observed device; model_name as NVML names it"
                ).add(1, **labels, model_name=sample.name)
            if sample.total_mib is not None:
                fam("gpud_device_total_mib", "gauge", "Device memory total (NVML)"
                    ).add(sample.total_mib, **labels)
            draw = observer.draw_for(sample.uuid, ledger, states)
            if draw is None:
                continue
            for metric, help_text, value in (
                ("used_mib", "Device memory used (NVML)", draw.used_mib),
                ("physical_free_mib", "Device memory free (NVML)", draw.physical_free_mib),
                ("managed_draw_mib", "Draw of processes in gpud's serve units", draw.managed_draw_mib),
                ("non_ledger_draw_mib", "used - managed draw", draw.non_ledger_draw_mib),
                ("reserve_excess_mib", "non-ledger draw - the reserves of the device's roles",
                 draw.reserve_excess_mib),
                ("pending_mib", "Reserved memory not yet drawn", draw.pending_mib),
            ):
                fam(f"gpud_device_{metric}", "gauge", help_text).add(value, **labels)
            fam("gpud_draw_estimated", "gauge", "1 when the driver reports no per-process memory "
                "(WDDM): managed and non-ledger draw are estimated from the reservations"
                ).add(int(draw.estimated), **labels)


def _role_families(fam: _Fam, observer: Observer | None, ledger: Ledger,
                   states: Mapping[str, ServeState]) -> dict[str, dict[str, str]]:
    """Each role's figures; returns the device labels of each role (its serves carry them)."""
    role_labels: dict[str, dict[str, str]] = {}
    for name in sorted(ledger.roles):
        budget = ledger.roles[name]
        figures = ledger.figures(name)
        dev = observer.device(budget.device) if observer else None
        if dev is not None:
            where = {"gpu": str(dev.index), "UUID": dev.uuid}
        else:
            # not observed: what the config says, in the label it fits
            ref = budget.device
            where = {"gpu": ref if ref.isdigit() else "", "UUID": ref if ref.startswith("GPU-") else ""}
        role_labels[name] = where
        base = {"role": name, **where}
        for metric, help_text, value in (
            ("capacity_mib", "Role capacity in MiB", figures.capacity_mib),
            ("reserve_mib", "Headroom for draw the ledger does not manage", figures.reserve_mib),
            ("committed_mib", "Sum of reservations on the role", figures.committed_mib),
            ("ledger_free_mib", "capacity - reserve - committed", figures.free_mib),
        ):
            fam(f"gpud_role_{metric}", "gauge", help_text).add(value, **base)
        draw = observer.draw_for(budget.device, ledger, states) if observer and not budget.missing \
            else None
        if draw is None:
            continue
        fam("gpud_role_effective_free_mib", "gauge", "min(ledger free, physical free - pending)"
            ).add(draw.effective_free(figures.free_mib), **base)
    return role_labels


def _serve_families(fam: _Fam, svc: LedgerService, observer: Observer | None,
                    calibrator: Calibrator | None,
                    role_labels: Mapping[str, dict[str, str]]) -> None:
    """Each serve gpud knows: its reservation, observed draw, device, state, calibration."""
    ledger = svc.ledger
    for serve in svc.known_serves():
        res = ledger.reservations.get(serve)
        spec = svc.serve_spec(serve)
        role = res.role if res else (spec.role if spec else "")
        labels = {"serve": serve, "role": role, **role_labels.get(role, {"gpu": "", "UUID": ""})}
        roles = res.all_roles if res else (spec.all_roles if spec else ())
        if len(roles) > 1:
            # A serve on several devices: one series per device (its reservation is on each,
            # its draw there is that of its processes on that device).
            by_device = observer.observed_by_device(serve) if observer else None
            for name in roles:
                where = role_labels.get(name, {"gpu": "", "UUID": ""})
                one = {"serve": serve, "role": name, **where}
                fam("gpud_serve_reservation_mib", "gauge", "The serve's reservation (0: none)"
                    ).add(res.mib if res else 0, **one)
                if by_device is not None and observer is not None:
                    held = ledger.roles.get(name)
                    dev = observer.device(held.device) if held else None
                    fam("gpud_serve_observed_mib", "gauge", "Memory observed in the serve's unit"
                        ).add(by_device.get(dev.uuid, 0) if dev else 0, **one)
                fam("gpud_serve_device_lost", "gauge",
                    "1 when the device of the serve's role is lost"
                    ).add(1 if svc.lost_device(name) else 0, **one)
        else:
            fam("gpud_serve_reservation_mib", "gauge", "The serve's reservation (0: none)"
                ).add(res.mib if res else 0, **labels)
            observed = observer.observed_mib(serve) if observer else None
            if observed is not None:
                fam("gpud_serve_observed_mib", "gauge", "Memory observed in the serve's unit"
                    ).add(observed, **labels)
            fam("gpud_serve_device_lost", "gauge", "1 when the device of the serve's role is lost"
                ).add(1 if role and svc.lost_device(role) else 0, **labels)
        current = svc.state_of(serve)
        state_fam = fam("gpud_serve_state", "gauge", "1 for the serve's current state")
        for state in STATES:
            state_fam.add(1 if state == current else 0, **labels, state=state)
        if calibrator is not None and spec is not None:
            fam("gpud_serve_calibrated", "gauge", "1 when a calibration matches the fingerprint"
                ).add(1 if calibrator.calibration_of(serve)[0] == "calibrated" else 0, **labels)


def _gpud_families(fam: _Fam, svc: LedgerService, observer: Observer | None) -> None:
    """gpud's own counters and whether observation and launching work."""
    for kind in COUNTED:
        fam("gpud_events_total", "counter", "Events recorded since gpud started, by kind"
            ).add(svc.counters.get(kind, 0), kind=kind)
    fam("gpud_invariant_violations_total", "counter", "Violations of the ledger's invariant "
        "found after a commit since gpud started (0 unless something is wrong)"
        ).add(svc.invariant_violations)
    fam("gpud_preemptions_total", "counter", "Serves put to sleep or stopped by a preemption "
        "since gpud started").add(svc.counters.get(EventKind.PREEMPT, 0))
    obs_ok = bool(observer and observer.available)
    fam("gpud_observation_available", "gauge", "1 when observation works").add(1 if obs_ok else 0,
        backend=observer.backend.name if observer else "none")
    if observer is not None:
        fam("gpud_observation_sample_seconds", "gauge", "Duration of the last observation sample"
            ).add(observer.sample_seconds)
    available, _ = svc.launching()
    fam("gpud_launching_available", "gauge", "1 when the system bus is reachable"
        ).add(1 if available else 0)
    fam("gpud_store_ok", "gauge", "1 when the durable store commits; 0 while its commits fail "
        "(a full or read-only state directory)").add(1 if svc.store_error is None else 0)
