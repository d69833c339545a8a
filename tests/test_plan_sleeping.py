"""Plans (and the transition under them) while a serve sleeps: it holds its sleep reservation,
not its vram_mib, and an apply does not wake it behind the ledger's back."""

from __future__ import annotations

from gpud.config import Config, parse_config
from gpud.core.ledger import Ledger, Reservation, RoleBudget
from gpud.core.plan import RebalancePlan, make_plan
from gpud.core.transition import Refusal, Transition, transition, violations
from gpud.ctl.format import format_plan
from gpud.life.service import resolve_budgets

BASE = """
[daemon]
[roles.a]
device = "0"
capacity_mib = 10000
[roles.b]
device = "1"
capacity_mib = 10000
[serves.big]
role = "a"
command = ["x"]
port = 8001
vram_mib = 6000
priority = 1
[serves.small]
role = "a"
command = ["y"]
port = 8002
front = false
vram_mib = 8000
priority = 5
sleep_level = 1
sleep_mib = 1000
"""


def world() -> tuple[Config, Ledger, dict[str, str]]:
    cfg = parse_config(BASE, "old")
    ledger = Ledger.build(resolve_budgets(cfg, lambda _d: None), [
        Reservation("small", "a", 1000, 1.0), Reservation("big", "a", 6000, 2.0)])
    return cfg, ledger, {"small": "sleeping", "big": "running"}


def plan_to(text: str) -> RebalancePlan:
    old, ledger, states = world()
    new = parse_config(text, "new")
    return make_plan(old=old, new=new, ledger=ledger,
                     new_budgets=resolve_budgets(new, lambda _d: None), states=states,
                     totals={"0": 10000, "1": 10000}, source="new")


def test_unchanged_config_with_a_sleeping_serve_plans_nothing() -> None:
    plan = plan_to(BASE)
    assert plan.ok and plan.blocked == ()
    small = {s.name: s for s in plan.serves}["small"]
    assert (small.mib_before, small.mib_after) == (1000, 1000)
    assert small.change == "unchanged" and not small.restart
    assert (small.state_before, small.state_after) == ("sleeping", "sleeping")
    assert small.util_before == small.util_after == "0.8000"  # what it was launched with
    assert plan.after.figures("a").committed_mib == 7000
    assert plan.restart == []


def test_a_change_while_asleep_keeps_the_sleep_reservation_and_says_why() -> None:
    for old, new in (("vram_mib = 8000", "vram_mib = 7000"),
                     ('command = ["y"]', 'command = ["z"]'),
                     ("sleep_mib = 1000", "sleep_mib = 2000")):
        plan = plan_to(BASE.replace(old, new))
        assert plan.ok, (new, plan.blocked)
        small = {s.name: s for s in plan.serves}["small"]
        assert small.mib_after == 1000 and not small.restart, new
        assert small.change != "unchanged", new
        assert small.reason is not None and "sleeping" in small.reason, new
        from gpud.core.actions import actions
        assert [a.kind for a in actions(plan) if a.serve == "small"] == [], new
        assert plan.after.figures("a").committed_mib == 7000


def test_a_sleeping_serve_moved_or_removed_is_stopped_first() -> None:
    moved = plan_to(BASE.replace('role = "a"\ncommand = ["y"]', 'role = "b"\ncommand = ["y"]'))
    assert moved.stop_first == ("small",)
    assert moved.after.reservations["small"].all_roles == ("b",)
    assert moved.after.reservations["small"].mib == 8000  # started again there, awake
    removed = plan_to(BASE.split("[serves.small]")[0])
    assert removed.stop_first == ("small",) and "small" not in removed.after.reservations


def test_transition_keeps_the_sleep_reservation_and_the_invariant() -> None:
    old, ledger, states = world()
    new = parse_config(BASE.replace("vram_mib = 8000", "vram_mib = 9000"), "new")
    t = transition(old=old, new=new, ledger=ledger, budgets=resolve_budgets(new, lambda _d: None),
                   states=states, may_stop=False)
    assert isinstance(t, Transition)
    assert t.ledger.reservations["small"].mib == 1000
    assert violations(new, t.ledger, states) == []


def test_a_change_that_leaves_a_sleeping_serve_unable_to_wake_is_refused() -> None:
    old, ledger, states = world()
    for change, said in ((("sleep_level = 1", "sleep_level = 0"), ("sleep_mib = 1000", "")),
                         "sleep_level is removed"), \
                        ((("port = 8002", "port = 8003"),), "port changes (8002 -> 8003"):
        text = BASE
        for a, b in change:
            text = text.replace(a, b)
        new = parse_config(text, "new")
        for may_stop in (False, True):
            t = transition(old=old, new=new, ledger=ledger,
                           budgets=resolve_budgets(new, lambda _d: None), states=states,
                           may_stop=may_stop)
            assert not isinstance(t, Transition), (said, may_stop)
            (blocker,) = t.blockers
            assert blocker.what == "small" and said in blocker.reason
            assert "gpuctl wake" in blocker.reason
    # Awake, the same changes are a plain reload (they take effect at its next start).
    awake = {"small": "running", "big": "running"}
    new = parse_config(BASE.replace("port = 8002", "port = 8003"), "new")
    assert isinstance(transition(old=old, new=new, ledger=ledger,
                                 budgets=resolve_budgets(new, lambda _d: None), states=awake,
                                 may_stop=False), Transition)


def test_gpuctl_plan_says_why_a_sleeping_serve_is_not_restarted() -> None:
    text = format_plan(plan_to(BASE.replace("vram_mib = 8000", "vram_mib = 7000")).to_json())
    assert "must restart: none" in text
    assert "small: sleeping: not restarted" in text
    assert "BLOCKED" not in text


def test_a_role_cut_below_what_a_sleeping_serve_wakes_to_is_refused() -> None:
    old, ledger, states = world()
    # 7000 MiB committed (6000 + its 1000 asleep) fits in 7500; its 8000 awake never would
    new = parse_config(BASE.replace("capacity_mib = 10000", "capacity_mib = 10000\nreserve_mib = 2500",
                                    1), "new")
    t = transition(old=old, new=new, ledger=ledger, budgets=resolve_budgets(new, lambda _d: None),
                   states=states, may_stop=True)
    assert not isinstance(t, Transition)
    (blocker,) = t.blockers
    assert blocker.what == "small"
    assert "role 'a' would hold 7500 MiB at most" in blocker.reason
    assert "8000 MiB it wakes to" in blocker.reason
    # cut to what it still wakes in: a change like any other
    new = parse_config(BASE.replace("capacity_mib = 10000", "capacity_mib = 10000\nreserve_mib = 2000",
                                    1), "new")
    assert isinstance(transition(old=old, new=new, ledger=ledger,
                                 budgets=resolve_budgets(new, lambda _d: None), states=states,
                                 may_stop=True), Transition)


def test_the_undo_of_stopping_a_sleeping_serve_starts_it_awake_at_its_vram_mib() -> None:
    from gpud.core.actions import Action, actions

    steps = actions(plan_to(BASE.split("[serves.small]")[0]))
    (stop,) = [a for a in steps if a.kind == "stop"]
    assert (stop.serve, stop.mib_before, stop.mib_after) == ("small", 1000, None)
    # not its 1000 MiB asleep, nor "back to sleeping": the start admits its vram_mib again
    assert stop.undo == Action("start", "old", "small", None, None, "running", rollback=True)


def _shrink(capacity: int, *, was: tuple[int, int] = (10000, 0), reserve: int = 0,
            vram: str = "vram_mib = 3000", missing: bool = False) -> Transition | Refusal:
    """The transition of world() to a config whose role a has `capacity` (and the sleeping
    serve small `vram`: less than the 8000 MiB it was launched with), from a ledger whose role a had `was` (capacity, reserve)."""
    old, ledger, _ = world()
    states = {"small": "sleeping"}  # alone on role a
    held = Ledger(
        {**ledger.roles, "a": RoleBudget("a", "0", was[0], was[1], missing=missing)},
        {"small": ledger.reservations["small"]})
    new = parse_config(BASE.replace("capacity_mib = 10000\n[roles.b]",
                                    f"capacity_mib = {capacity}\nreserve_mib = {reserve}\n"
                                    "[roles.b]").replace("vram_mib = 8000", vram), "new")
    return transition(old=old, new=new, ledger=held, budgets=resolve_budgets(new, lambda _d: None),
                      states=states, may_stop=True)


def test_a_role_shrunk_below_what_a_sleeping_serve_wakes_to_is_refused() -> None:
    # small wakes to 8000 MiB (what it was launched with), whatever the new config says of it
    for capacity, reserve, vram in ((7999, 0, "vram_mib = 3000"), (9000, 1001, "vram_mib = 3000"),
                                    (7000, 0, "vram_mib = 6000")):
        t = _shrink(capacity, reserve=reserve, vram=vram)
        assert isinstance(t, Refusal), (capacity, reserve, vram)
        (blocker,) = [b for b in t.blockers if b.what == "small"]
        assert f"would hold {capacity - reserve} MiB at most" in blocker.reason
        assert "less than the 8000 MiB it wakes to" in blocker.reason
    assert isinstance(_shrink(8000), Transition)  # exactly enough room
    assert isinstance(_shrink(9000, reserve=1000), Transition)


def test_only_a_change_that_makes_a_sleeping_serve_unwakeable_is_refused() -> None:
    # The role already had less room than small wakes to (capacity 12000, reserve 5000: 7000):
    # a further shrink is not what keeps it asleep.
    assert isinstance(_shrink(6500, was=(12000, 5000)), Transition)
    # It had exactly the room (8000), and the change takes it away.
    assert isinstance(_shrink(7999, was=(8000, 0)), Refusal)
    # A role whose device was missing (its room unknown) counts as made so by this change.
    t = _shrink(7000, was=(0, 0), missing=True)
    assert isinstance(t, Refusal) and any(b.what == "small" for b in t.blockers)


def test_a_reservation_naming_a_role_twice_is_a_violation() -> None:
    old, ledger, states = world()
    twice = Ledger(ledger.roles, {**ledger.reservations, "big": Reservation(
        "big", "a", 6000, 2.0, extra_roles=("a",))})
    assert "big: reservation names a role twice: a, a" in violations(old, twice, states)
