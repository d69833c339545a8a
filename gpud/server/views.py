"""The JSON shapes of the API (docs/api.md), built from the service's state. No I/O."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from gpud.config import Config, routed
from gpud.core import answers
from gpud.core.ledger import DeviceDraw, Ledger, Reservation, RoleFigures
from gpud.core.peers import CircuitState, PeerModel, choose_host, local_offer, offers_of
from gpud.core.vocab import LIVE_STATES, ORPHAN, SLEEPING, ServeState, serve_unit
from gpud.life.service import LedgerService


class DrawSource(Protocol):
    """The observer's latest split of each device's memory, for the views."""

    @property
    def simulated(self) -> bool: ...

    def draw_for(self, device: str, ledger: Ledger,
                 states: Mapping[str, ServeState]) -> DeviceDraw | None: ...

    def observed_mib(self, serve: str) -> int | None: ...


def reservation_view(svc: LedgerService, res: Reservation,
                     on_role: str | None = None) -> answers.Reservation:
    """A reservation as listed under `on_role` (default: its first role). One on several roles
    says which part this is (`part` "1/2") and every role; a single-role one stays as it was."""
    spec = svc.serve_spec(res.serve)
    role = on_role or res.role
    out: answers.Reservation = {
        "serve": res.serve,
        "role": role,
        "mib": res.mib,
        "since": res.since,
        "by_uid": res.by_uid,
        "state": svc.state_of(res.serve),
        "resident": bool(spec and spec.resident),
        "external": res.external,
    }
    if res.extra_roles:
        out["roles"] = list(res.all_roles)
        out["part"] = f"{res.all_roles.index(role) + 1}/{len(res.all_roles)}"
    return out


def ledger_view(svc: LedgerService, draws: DrawSource | None) -> answers.Ledger:
    ledger = svc.ledger
    states = svc.states()
    roles: list[answers.Role] = []
    for name in sorted(ledger.roles):
        budget = ledger.roles[name]
        figures = ledger.figures(name)
        observed: answers.Observed | None = None
        draw = draws.draw_for(budget.device, ledger, states) if draws and not budget.missing else None
        if draw is not None and draws is not None:
            observed = {
                "simulated": draws.simulated,
                "total_mib": draw.total_mib,
                "used_mib": draw.used_mib,
                "physical_free_mib": draw.physical_free_mib,
                "managed_draw_mib": draw.managed_draw_mib,
                "non_ledger_draw_mib": draw.non_ledger_draw_mib,
                "reserve_mib": draw.reserve_mib,
                "reserve_excess_mib": draw.reserve_excess_mib,
                "pending_mib": draw.pending_mib,
                "effective_free_mib": draw.effective_free(figures.free_mib),
                "estimated": draw.estimated,
            }
        roles.append({
            "name": name,
            "device": budget.device,
            "note": budget.note,
            "missing": budget.missing,
            "capacity_mib": figures.capacity_mib,
            "reserve_mib": figures.reserve_mib,
            "committed_mib": figures.committed_mib,
            "free_mib": figures.free_mib,
            "over_committed": figures.over_committed,
            "reservations": [reservation_view(svc, r, name) for r in ledger.on_role(name)],
            "observed": observed,
        })
    return {
        "admission": svc.config.daemon.admission,
        "simulated": bool(draws and draws.simulated),
        "roles": roles,
    }


def serve_view(svc: LedgerService, name: str, draws: DrawSource | None,
               calibration: tuple[answers.CalibrationStatus, str | None] = ("uncalibrated", None),
               calibrated: answers.Calibrated | None = None,
               parked: Callable[[str], int | None] = lambda _serve: None,
               activity: Callable[[str], float | None] = lambda _serve: None,
               in_flight: Callable[[str], int | None] = lambda _serve: None,
               bringups: Callable[[str], tuple[float | None, float | None]] = lambda _serve: (
                   None, None),
               queued: Callable[[str], int] = lambda _serve: 0,
               queue: Callable[[str], tuple[list[answers.QueuePlace], float | None,
                                           answers.ServeWaiting | None] | None]
               = lambda _serve: None) -> answers.Serve:
    spec = svc.serve_spec(name)
    res = svc.ledger.reservations.get(name)
    rec = svc.records.get(name)
    role = spec.role if spec else (res.role if res else None)
    roles = spec.all_roles if spec else (res.all_roles if res else ())
    state = svc.records.state_of(name)
    # A PID is shown only while a process of the unit may run: a failed or stopped serve's
    # last PID may belong to another process by now.
    has_unit = state in LIVE_STATES or state == ORPHAN
    if len(roles) > 1:  # on several devices: lost when any of them is
        device_lost = "; ".join(why for r in roles if (why := svc.lost_device(r))) or None
    else:
        device_lost = svc.lost_device(role) if role else None
    out: answers.Serve = {
        "name": name,
        "role": role,
        "configured": spec is not None,
        "external": bool(res and res.external),
        "state": state,
        "phase": svc.records.life(name).phase,
        "reason": rec.reason if rec else None,
        "vram_mib": spec.vram_mib if spec else None,
        "reserved_mib": res.mib if res else None,
        "resident": bool(spec and spec.resident),
        "priority": spec.priority if spec else None,
        "port": spec.port if spec else None,
        "unit": serve_unit(name) if spec or state == ORPHAN else None,
        "main_pid": rec.main_pid if rec and has_unit else None,
        # The device of the serve's role is lost (NVML or the simulation says so): whatever
        # the state says, the serve's memory and health are in doubt.
        "device_lost": device_lost,
        "n_restarts": rec.n_restarts if rec else 0,
        "observed_mib": draws.observed_mib(name) if draws else None,
        "calibration": calibration[0],
        "fingerprint": calibration[1],
        # The current calibration: measured steady/peak, the recommended reservation, and a
        # vllm serve's own account (weights, KV cache, CUDA graphs, context).
        "calibrated": calibrated,
        "sleep_level": spec.sleep_level if spec else 0,
        # asleep at level 1: the host RAM its weights are parked in (gpud.life.sleeping)
        "parked_host_mib": parked(name) if state == SLEEPING else None,
        "front": bool(spec and spec.front),
        # seconds since its last request ended (gpud.life.ondemand, gpud.life.traffic)
        "last_activity_s_ago": activity(name),
        "in_flight": in_flight(name) if state in LIVE_STATES else None,
        # the medians of its measured wakes and starts (gpud.life.ondemand): its cost to bring back
        "wake_s": bringups(name)[0],
        "start_s": bringups(name)[1],
        # requests waiting in the router's queue for it to be brought up (gpud.life.ondemand)
        "queued": queued(name),
    }
    names = routed(svc.config).get(name)
    if names is not None:
        out["models"] = list(names)
    waits = queue(name)
    if waits is not None:
        out["queue"], out["expected_wait_s"], waiting = waits
        if waiting is not None:
            out["waiting"] = waiting
    if len(roles) > 1:
        out["roles"] = list(roles)
        out["observed_by_role"] = _observed_by_role(svc, name, roles, draws)
    return out


def _observed_by_role(svc: LedgerService, name: str, roles: Sequence[str],
                      draws: DrawSource | None) -> dict[str, int] | None:
    """What a serve on several devices draws on each of its roles' devices (None without
    observation)."""
    by_device = getattr(draws, "observed_by_device", None)
    find = getattr(draws, "device", None)
    seen = by_device(name) if callable(by_device) else None
    if seen is None or not callable(find):
        return None
    out: dict[str, int] = {}
    for role in roles:
        budget = svc.ledger.roles.get(role)
        dev = find(budget.device) if budget is not None else None
        out[role] = seen.get(dev.uuid, 0) if dev is not None else 0
    return out


def serves_view(svc: LedgerService, draws: DrawSource | None,
                calibrations: dict[str, tuple[answers.CalibrationStatus, str | None]] | None = None,
                summaries: dict[str, answers.Calibrated | None] | None = None,
                parked: Callable[[str], int | None] = lambda _serve: None,
                activity: Callable[[str], float | None] = lambda _serve: None,
                in_flight: Callable[[str], int | None] = lambda _serve: None,
                bringups: Callable[[str], tuple[float | None, float | None]] = lambda _serve: (
                    None, None),
                queued: Callable[[str], int] = lambda _serve: 0,
                queue: Callable[[str], tuple[list[answers.QueuePlace], float | None,
                                           answers.ServeWaiting | None] | None]
                = lambda _serve: None) -> answers.Serves:
    cal = calibrations or {}
    brief = summaries or {}
    views = [serve_view(svc, n, draws, cal.get(n, ("uncalibrated", None)), brief.get(n), parked,
                        activity, in_flight, bringups, queued, queue)
             for n in svc.known_serves()]
    views.sort(key=lambda v: (v["role"] or "", v["priority"] if v["priority"] is not None else 1 << 30,
                              v["name"]))
    return {"simulated": bool(draws and draws.simulated), "serves": views}


def figures_view(f: RoleFigures) -> answers.Figures:
    return {"capacity_mib": f.capacity_mib, "reserve_mib": f.reserve_mib,
            "committed_mib": f.committed_mib, "free_mib": f.free_mib}


def figures_of_each_role(answer: answers.Admitted | answers.Released, res: Reservation,
                          figures_of: Callable[[str], RoleFigures]) -> None:
    """A serve on several roles (devices): all of them, and the figures of each, in the order
    of its roles (``figures`` is the first's). An admission, a preempting admission and a
    release answer alike."""
    if res.extra_roles:
        answer["roles"] = list(res.all_roles)
        answer["figures_by_role"] = {r: figures_view(figures_of(r)) for r in res.all_roles}


def route_choice(cfg: Config, model: str, state_of: Callable[[str], str],
                 queue: Callable[[str], tuple[object, float | None, object] | None],
                 queued: Callable[[str], int], crowded: bool,
                 peers: answers.Peers) -> answers.RouteChoice:
    """Which host takes a request for MODEL now: gpud.core.peers.choose_host over what this
    host knows of its serve of it (its state, QUEUED, its expected wait from QUEUE, full at
    router.max_queued or when every requester's bring-ups together are CROWDED) and what
    each peer whose circuit is closed last said of the model (PEERS: GET /v1/peers)."""
    serve = next((name for name, models in routed(cfg).items() if model in models), None)
    local = None
    if serve is not None:
        waits = queue(serve)
        count = queued(serve)
        full = (cfg.router is not None and 0 < cfg.router.max_queued <= count) or crowded
        local = local_offer(str(state_of(serve)), count, full,
                            waits[1] if waits is not None else None)
    offered = {p["name"]: PeerModel(m["id"], m["state"], m["expected_wait_s"], m["queued"])
               for p in peers["peers"] if p["circuit"] == CircuitState.CLOSED
               for m in p["models"] if m["id"] == model}
    chosen = choose_host(offers_of(local, offered),
                         spillover=cfg.router is not None and cfg.router.spillover)
    return {"model": model, "found": chosen is not None,
            "peer": chosen.host if chosen is not None else None,
            "hosts": ([""] if local is not None else []) + sorted(offered)}

