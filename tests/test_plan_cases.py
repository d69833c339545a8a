"""Plans from values, case by case: every kind of change a serve can go through, and the plan's
own figures (found wanting by the mutation run)."""

from __future__ import annotations

from typing import Any

from gpud.config import Config
from gpud.core.ledger import Ledger, Reservation, RoleBudget
from gpud.core.plan import RebalancePlan, make_plan


def config(roles: dict[str, tuple[int, int]], serves: dict[str, dict[str, Any]]) -> Config:
    return Config.model_validate({
        "roles": {n: {"device": str(i), "capacity_mib": c, "reserve_mib": r}
                  for i, (n, (c, r)) in enumerate(sorted(roles.items()))},
        "serves": {n: {"command": ["/bin/true"], **s} for n, s in serves.items()},
    })


def budgets(cfg: Config) -> list[RoleBudget]:
    return [RoleBudget(n, r.device, r.capacity_mib or 0, r.reserve_mib)
            for n, r in sorted(cfg.roles.items())]


ROLES = {"a": (10000, 0), "b": (4000, 0)}
OLD = config(ROLES, {
    "run": {"role": "a", "vram_mib": 3000, "resident": True, "priority": 2},
    "idle": {"role": "a", "vram_mib": 1000, "priority": 3},
    "gone": {"role": "a", "vram_mib": 500, "resident": True, "priority": 4},
    "mover": {"role": "a", "vram_mib": 700, "resident": True, "priority": 5},
})
HELD = [Reservation("run", "a", 3000, 1.0), Reservation("idle", "a", 1000, 2.0),
        Reservation("gone", "a", 500, 3.0), Reservation("mover", "a", 700, 4.0),
        Reservation("ext", "b", 100, 5.0, external=True)]
STATES = {"run": "running", "idle": "admitted", "gone": "admitted", "mover": "running",
          "ext": "external"}


def plan(new: Config, states: dict[str, str] | None = None,
         totals: dict[str, int | None] | None = None) -> RebalancePlan:
    ledger = Ledger.build(budgets(OLD), HELD)
    return make_plan(old=OLD, new=new, ledger=ledger, new_budgets=budgets(new),
                     states=STATES if states is None else states,
                     totals={"0": 20000, "1": 8000} if totals is None else totals, source="t")


NEW = config(ROLES, {
    "run": {"role": "a", "vram_mib": 2000, "resident": True, "priority": 2},  # resized
    "idle": {"role": "a", "vram_mib": 1000, "priority": 1},  # priority only
    "mover": {"role": "b", "vram_mib": 700, "resident": True, "priority": 5},  # another role
    "fresh": {"role": "b", "vram_mib": 600, "resident": True, "priority": 9},  # added, fits
    "big": {"role": "b", "vram_mib": 3900, "resident": True, "priority": 10},  # added, too big
    "lazy": {"role": "a", "vram_mib": 100, "priority": 11},  # added, not resident
})


def by_name(p: RebalancePlan) -> dict[str, Any]:
    return {s.name: s for s in p.serves}


def test_every_kind_of_change() -> None:
    p = plan(NEW)
    s = by_name(p)
    assert "ext" not in s  # external reservations are not serves of the plan
    # A new vram_mib is a new --gpu-memory-utilization: the serve runs differently, too.
    assert (s["run"].change, s["run"].restart, s["run"].mib_after) == (
        "changed, resized", True, 2000)
    assert (s["idle"].change, s["idle"].restart) == ("unchanged", False)  # priority: no restart
    assert (s["gone"].change, s["gone"].state_after, s["gone"].mib_after) == (
        "removed", "removed", None)
    assert (s["mover"].role_before, s["mover"].role_after, s["mover"].change) == ("a", "b",
                                                                                    "changed")
    assert s["mover"].restart and p.stop_first == ("mover",)
    assert (s["fresh"].change, s["fresh"].state_after, s["fresh"].mib_after) == (
        "added", "admitted", 600)
    assert (s["big"].state_after, s["big"].reason) == (
        "denied", "ledger bound: need 3900 MiB, free 2600 MiB, short 1300 MiB")
    assert (s["lazy"].state_after, s["lazy"].mib_after, s["lazy"].util_after) == (
        "declared", None, "0.0050")  # util of its vram_mib on a 20000 MiB device
    assert not p.resident_fits and not p.ok and p.blocked == ()
    assert p.restart == ["run", "mover"]
    # The boot starts the resident serves that hold a reservation after the change: not idle
    # (held, not resident), not big (resident, denied), not lazy (neither).
    assert sorted(n for step in p.boot for n in step.serves) == ["fresh", "mover", "run"]


def test_order_is_role_then_priority_then_name() -> None:
    # by the new config's role and priority, a removed serve by its old ones
    assert [c.name for c in plan(NEW).serves] == ["idle", "run", "gone", "lazy", "mover", "fresh",
                                                  "big"]


def test_role_figures_before_and_after() -> None:
    p = plan(NEW)
    figures = {n: (b.committed_mib if b else None, a.committed_mib if a else None)
               for n, b, a in p.roles}
    # a: run 3000 + idle 1000 + gone 500 + mover 700 -> run 2000 + idle 1000
    # b: ext 100 -> ext 100 + mover 700 + fresh 600
    assert figures == {"a": (5200, 3000), "b": (100, 1400)}
    doc = p.to_json()
    assert doc["roles"][0] == {"name": "a", "before": {"capacity_mib": 10000, "reserve_mib": 0,
                                                       "committed_mib": 5200, "free_mib": 4800},
                               "after": {"capacity_mib": 10000, "reserve_mib": 0,
                                         "committed_mib": 3000, "free_mib": 7000}}
    assert doc["restart"] == ["run", "mover"] and doc["stop_first"] == ["mover"]
    assert doc["denied"][0]["serve"] == "big" and doc["denied"][0]["reason"].startswith("ledger")
    assert {s["name"] for s in doc["serves"]} == set(by_name(p))


def test_utilization_uses_the_device_total_or_the_capacity() -> None:
    s = by_name(plan(NEW))
    assert (s["run"].util_before, s["run"].util_after) == ("0.1500", "0.1000")  # of 20000
    unknown = by_name(plan(NEW, totals={}))
    assert unknown["run"].util_after == "0.2000"  # no total known: of the capacity, 10000


def test_nothing_running_means_nothing_restarts() -> None:
    idle = {name: "admitted" for name in STATES} | {"ext": "external"}
    p = plan(NEW, states=idle)
    assert p.restart == [] and p.stop_first == ()
    assert by_name(p)["run"].state_after == "admitted"  # resident and resized: admitted again


def test_a_denied_serve_that_now_fits_is_admitted_and_one_still_too_big_stays_denied() -> None:
    states = dict(STATES, run="denied")
    held = [r for r in HELD if r.serve != "run"]
    ledger = Ledger.build(budgets(OLD), held)
    p = make_plan(old=OLD, new=NEW, ledger=ledger, new_budgets=budgets(NEW), states=states,
                  totals={"0": 20000, "1": 8000}, source="t")
    run = by_name(p)["run"]
    assert (run.state_before, run.state_after, run.mib_before, run.mib_after) == (
        "denied", "admitted", None, 2000)
    assert not run.restart


def test_changed_and_resized_together() -> None:
    new = config(ROLES, {"run": {"role": "a", "vram_mib": 2500, "resident": True, "priority": 2,
                                 "command": ["/bin/false"]}})
    run = by_name(plan(new))["run"]
    assert run.change == "changed, resized" and run.restart
    assert run.fingerprint_before != run.fingerprint_after


def test_a_reservation_made_by_hand_at_another_size_is_resized() -> None:
    held = [Reservation("run", "a", 2500, 1.0)]  # gpuctl admit run 2500; the config says 3000
    ledger = Ledger.build(budgets(OLD), held)
    p = make_plan(old=OLD, new=OLD, ledger=ledger, new_budgets=budgets(OLD),
                  states={"run": "running"}, totals={"0": 20000}, source="t")
    run = by_name(p)["run"]
    assert (run.change, run.mib_before, run.mib_after, run.restart) == ("resized", 2500, 3000,
                                                                        True)
    # An awake serve's utilization before is of what it holds (2500), not its old vram_mib.
    assert (run.util_before, run.util_after) == ("0.1250", "0.1500")
    assert by_name(p)["idle"].change == "unchanged" and not by_name(p)["idle"].restart


# ---- the state each staying serve is shown in after the change -------------------------------


STAYING = config(ROLES, {
    "res-big": {"role": "a", "vram_mib": 500, "resident": True, "priority": 0},
    "res-run": {"role": "a", "vram_mib": 1000, "resident": True, "priority": 1},
    "nr-run": {"role": "a", "vram_mib": 1000, "priority": 2},
    "res-new": {"role": "a", "vram_mib": 1000, "resident": True, "priority": 3},
    "nr-decl": {"role": "a", "vram_mib": 500, "priority": 4},
    "nr-denied": {"role": "a", "vram_mib": 500, "priority": 5},
    "nr-held-denied": {"role": "a", "vram_mib": 500, "priority": 6},
})
STAYING_HELD = [Reservation("res-run", "a", 1000, 1.0), Reservation("nr-run", "a", 1000, 2.0),
                Reservation("nr-held-denied", "a", 500, 3.0)]
STAYING_STATES = {"res-big": "declared", "res-run": "running", "nr-run": "running",
                  "res-new": "declared", "nr-decl": "declared", "nr-denied": "denied",
                  "nr-held-denied": "denied"}


def staying_plan(new: Config) -> RebalancePlan:
    return make_plan(old=STAYING, new=new, ledger=Ledger.build(budgets(STAYING), STAYING_HELD),
                     new_budgets=budgets(new), states=STAYING_STATES, totals={"0": 20000},
                     source="t")


def test_the_state_after_of_each_staying_serve() -> None:
    specs = {n: {"role": s.role, "vram_mib": s.vram_mib, "resident": s.resident,
                 "priority": s.priority} for n, s in STAYING.serves.items()}
    specs["res-big"]["vram_mib"] = 8000  # 2500 held + 8000 > 10000: denied
    p = staying_plan(config(ROLES, specs))
    after = {c.name: c.state_after for c in p.serves}
    assert after == {
        "res-big": "denied",         # resident, does not fit
        "res-run": "running",        # resident and running: it keeps running
        "nr-run": "running",
        "res-new": "admitted",       # resident, holds nothing, fits: admitted by the plan
        "nr-decl": "declared",       # not resident, holds nothing: nothing changes
        "nr-denied": "denied",       # not resident, denied before, holds nothing
        "nr-held-denied": "admitted",  # denied once, but it holds its reservation
    }
    assert p.serves[0].name == "res-big"  # first in order: its assignment is its own
    assert by_name(p)["res-big"].reason is not None
    assert p.ok is False and p.resident_fits is False


def test_an_applicable_plan_is_ok() -> None:
    p = staying_plan(STAYING)
    assert p.ok is True and p.resident_fits is True and p.blocked == ()


def test_a_change_the_ledger_cannot_follow_blocks_the_plan_with_the_overcommit_too() -> None:
    new = config(ROLES, {
        "run": {"role": "a", "vram_mib": 9000, "resident": True, "priority": 2},
        "idle": {"role": "a", "vram_mib": 2000, "priority": 3},
        "ext": {"role": "b", "vram_mib": 100},  # the external reservation's name
    })
    p = plan(new)
    messages = [b.message for b in p.blocked]
    assert messages[0].startswith("ext (100 MiB on b): holds an external reservation")
    assert messages[-1].startswith("roles.a: the resized reservations commit 11000 MiB")
    assert len(messages) == 2
    assert p.ok is False and p.stop_first == ()


def test_a_role_only_before_or_only_after_has_no_figures_there() -> None:
    cfg = Config.model_validate({
        "roles": {"a": {"device": "0", "capacity_mib": 10000}, "b": {"device": "1",
                                                                    "capacity_mib": 4000},
                  "c": {"device": "2", "capacity_mib": 500}},
        "serves": {"run": {"command": ["/bin/true"], "role": "a", "vram_mib": 3000,
                           "resident": True, "priority": 2}}})
    doc = plan(cfg).to_json()
    roles = {r["name"]: r for r in doc["roles"]}
    assert roles["c"]["before"] is None
    assert roles["c"]["after"] == {"capacity_mib": 500, "reserve_mib": 0, "committed_mib": 0,
                                   "free_mib": 500}


def test_a_serve_on_a_role_its_ledger_does_not_know_has_no_utilization() -> None:
    old = config(dict(ROLES, z=(100, 0)), {"lost": {"role": "z", "vram_mib": 50}})
    p = make_plan(old=old, new=old, ledger=Ledger.build(budgets(OLD), []),
                  new_budgets=budgets(old), states={}, totals={}, source="t")
    lost = by_name(p)["lost"]
    assert (lost.role_before, lost.util_before, lost.util_after) == ("z", None, "0.5000")
