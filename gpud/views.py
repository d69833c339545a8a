"""The JSON shapes of the API (docs/api.md), built from the service's state. No I/O."""

from __future__ import annotations

from typing import Any, Protocol

from gpud.core.ledger import DeviceDraw, Ledger, Reservation
from gpud.core.vocab import LIVE_STATES, ORPHAN
from gpud.service import LedgerService


class DrawSource(Protocol):
    """The observer's latest split of each device's memory, for the views."""

    @property
    def simulated(self) -> bool: ...

    def draw_for(self, device: str, ledger: Ledger, states: dict[str, str]) -> DeviceDraw | None: ...

    def observed_mib(self, serve: str) -> int | None: ...


def reservation_view(svc: LedgerService, res: Reservation,
                     on_role: str | None = None) -> dict[str, Any]:
    """A reservation as listed under `on_role` (default: its first role). One on several roles
    says which part this is (`part` "1/2") and every role; a single-role one stays as it was."""
    spec = svc.serve_spec(res.serve)
    role = on_role or res.role
    multi: dict[str, Any] = {}
    if res.extra_roles:
        multi = {"roles": list(res.all_roles),
                 "part": f"{res.all_roles.index(role) + 1}/{len(res.all_roles)}"}
    return {
        "serve": res.serve,
        "role": role,
        **multi,
        "mib": res.mib,
        "since": res.since,
        "by_uid": res.by_uid,
        "state": svc.state_of(res.serve),
        "resident": bool(spec and spec.resident),
        "external": res.external,
    }


def ledger_view(svc: LedgerService, draws: DrawSource | None) -> dict[str, Any]:
    ledger = svc.ledger
    states = svc.states()
    roles = []
    for name in sorted(ledger.roles):
        budget = ledger.roles[name]
        figures = ledger.figures(name)
        observed = None
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
               calibration: tuple[str, str | None] = ("uncalibrated", None),
               calibrated: dict[str, Any] | None = None) -> dict[str, Any]:
    spec = svc.serve_spec(name)
    res = svc.ledger.reservations.get(name)
    rec = svc.records.get(name)
    role = spec.role if spec else (res.role if res else None)
    roles = spec.all_roles if spec else (res.all_roles if res else ())
    state = rec.state if rec else "declared"
    # A PID is shown only while a process of the unit may run: a failed or stopped serve's
    # last PID may belong to another process by now.
    has_unit = state in LIVE_STATES or state == ORPHAN
    multi: dict[str, Any] = {}
    if len(roles) > 1:
        lost = [why for r in roles if (why := svc.lost_device(r))]
        multi = {"roles": list(roles), "device_lost": "; ".join(lost) or None}
    return {
        "name": name,
        "role": role,
        **({"roles": multi["roles"]} if multi else {}),
        "configured": spec is not None,
        "external": bool(res and res.external),
        "state": state,
        "reason": rec.reason if rec else None,
        "vram_mib": spec.vram_mib if spec else None,
        "reserved_mib": res.mib if res else None,
        "resident": bool(spec and spec.resident),
        "priority": spec.priority if spec else None,
        "port": spec.port if spec else None,
        "unit": f"gpud-serve-{name}.service" if spec or state == ORPHAN else None,
        "main_pid": rec.main_pid if rec and has_unit else None,
        # The device of the serve's role is lost (NVML or the simulation says so): whatever
        # the state says, the serve's memory and health are in doubt.
        "device_lost": (multi["device_lost"] if multi
                        else svc.lost_device(role) if role else None),
        "n_restarts": rec.n_restarts if rec else 0,
        "observed_mib": draws.observed_mib(name) if draws else None,
        "calibration": calibration[0],
        "fingerprint": calibration[1],
        # The current calibration: measured steady/peak, the recommended reservation, and a
        # vllm serve's own account (weights, KV cache, CUDA graphs, context).
        "calibrated": calibrated,
    }


def serves_view(svc: LedgerService, draws: DrawSource | None,
                calibrations: dict[str, tuple[str, str | None]] | None = None,
                summaries: dict[str, dict[str, Any] | None] | None = None) -> dict[str, Any]:
    cal = calibrations or {}
    brief = summaries or {}
    views = [serve_view(svc, n, draws, cal.get(n, ("uncalibrated", None)), brief.get(n))
             for n in svc.known_serves()]
    views.sort(key=lambda v: (v["role"] or "", v["priority"] if v["priority"] is not None else 1 << 30,
                              v["name"]))
    return {"simulated": bool(draws and draws.simulated), "serves": views}
