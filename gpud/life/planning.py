"""A plan of a config text made from values alone, so that it can be made in a worker process
(gpud.life.offload): nothing here reads the service, the observer or the clock.

The daemon's --socket and --state-dir overrides travel in the inputs as data and are applied to
the parsed config here, as the service applies them to any config it takes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from gpud.config import Config, apply_overrides, parse_config
from gpud.core.answers import PlanSize
from gpud.core.budgets import resolve_budgets
from gpud.core.ledger import DeviceDraw, Ledger
from gpud.core.observation import DeviceView
from gpud.core.plan import RebalancePlan, device_rooms, make_plan
from gpud.core.transition import ConfigBlocker
from gpud.core.vocab import ServeState


@dataclass(frozen=True)
class PlanInputs:
    """What a plan is made against, taken on the event loop: the config in force and the ledger
    (immutable values, replaced whole, never changed in place), a copy of the serve states and
    the devices as the latest sample saw them."""

    config: Config
    ledger: Ledger
    states: Mapping[str, ServeState]
    devices: DeviceView
    overrides: dict[str, Any] = field(default_factory=dict)
    # What the front listens on now (gpud.nginx.front.running_listens), when a plan is to be refused
    # for what it would leave dark (gpud.nginx.front.check_front); None: not checked.
    front_listens: frozenset[str] | None = None
    # Each observed device's draw split (gpud.core.ledger.DeviceDraw, by UUID), what strict
    # admission decides on; None: observation unavailable (strict falls back to the ledger).
    draws: Mapping[str, DeviceDraw] | None = None


def plan_of(cfg: Config, source: str, inputs: PlanInputs) -> RebalancePlan:
    dev = inputs.devices
    budgets = resolve_budgets(cfg, dev.device_total, dev.present_devices(), dev.device_problem,
                              dev.device_uuid, source=source)
    totals = {b.device: dev.device_total(b.device) for b in budgets}
    totals.update({b.device: dev.device_total(b.device) for b in inputs.ledger.roles.values()})
    rooms = (None if inputs.draws is None else
             device_rooms(inputs.draws, inputs.ledger, inputs.states, dev.device_uuid))
    plan = make_plan(old=inputs.config, new=cfg, ledger=inputs.ledger, new_budgets=budgets,
                     states=inputs.states, totals=totals, source=source, rooms=rooms,
                     device_key=dev.device_uuid)
    if inputs.front_listens is None:
        return plan
    from gpud.nginx.front import check_front

    dark = check_front(cfg, inputs.front_listens).dark
    return replace(plan, blocked=plan.blocked + tuple(ConfigBlocker(d.what, d.reason) for d in dark))


def plan_json(text: str, source: str, inputs: PlanInputs) -> str:
    """The plan of `text` as the JSON text POST /v1/plan answers (ConfigError when invalid),
    with each vllm serve's needs from its checkpoint on disk (gpud.vllm.model_size)."""
    cfg = apply_overrides(parse_config(text, source), inputs.overrides)
    doc = plan_of(cfg, source, inputs).to_json()
    doc["sizes"] = plan_sizes(cfg)
    return json.dumps(doc, allow_nan=False)


def plan_sizes(cfg: Config) -> list[PlanSize]:
    from gpud.vllm.model_size import kv_at_reservation, size_serve

    sizes: list[PlanSize] = []
    for name, serve in sorted(cfg.serves.items()):
        if serve.vllm is None:
            continue
        sized = size_serve(serve, cfg.daemon)
        n = sized.need
        how = (n.arithmetic() if n is not None
               else sized.unknown or sized.error or "unknown until its first start")
        size: PlanSize = {"serve": name, "vram_mib": serve.vram_mib,
                          "minimum_mib": n.minimum_mib if n else None,
                          "headroom_mib": serve.vram_mib - n.minimum_mib if n else None,
                          "how": how}
        if n is not None and sized.weights is not None and sized.kv is not None \
                and sized.config is not None and serve.vram_mib >= sized.weights.mib:
            # what the reservation leaves for the KV cache, with gpud's estimated overheads
            # (the daemon's calibration view replaces them with measured ones)
            size["kv"] = kv_at_reservation(serve, cfg.daemon, sized, n.max_model_len, None)
        sizes.append(size)
    return sizes
