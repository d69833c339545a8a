"""The ledger invariant and the config-change decision: table cases, and a property over random
sequences of admissions, releases, starts, stops and config changes."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from gpud.config import Config
from gpud.core.ledger import Denial, Ledger, Reservation, RoleBudget
from gpud.core.transition import Refusal, Transition, transition, violated, violations


def config(roles: dict[str, tuple[int, int]],
           serves: dict[str, tuple[str | tuple[str, ...], int]], **daemon: Any) -> Config:
    """Roles on devices of their own; a serve on one role (a name) or on several (a tuple)."""
    return Config.model_validate({
        "daemon": daemon,
        "roles": {n: {"device": str(i), "capacity_mib": c, "reserve_mib": r}
                  for i, (n, (c, r)) in enumerate(roles.items())},
        "serves": {n: {**({"role": role} if isinstance(role, str) else {"roles": list(role)}),
                       "vram_mib": mib, "command": ["/bin/true"]}
                   for n, (role, mib) in serves.items()},
    })


def budgets(cfg: Config) -> list[RoleBudget]:
    return [RoleBudget(n, r.device, r.capacity_mib or 0, r.reserve_mib)
            for n, r in sorted(cfg.roles.items())]


def res(serve: str, role: str | tuple[str, ...], mib: int, *,
        external: bool = False) -> Reservation:
    roles = (role,) if isinstance(role, str) else role
    return Reservation(serve, roles[0], mib, 0.0, 0, external, roles[1:])


def decide(old: Config, new: Config, held: list[Reservation], states: dict[str, str], *,
           may_stop: bool = False) -> Transition | Refusal:
    ledger = Ledger.build(budgets(old), held)
    return transition(old=old, new=new, ledger=ledger, budgets=budgets(new), states=states,
                      may_stop=may_stop)


OLD = config({"a": (1000, 100), "b": (1000, 0)}, {"x": ("a", 300), "y": ("a", 200)})


def refused(outcome: Transition | Refusal) -> list[str]:
    assert isinstance(outcome, Refusal), outcome
    return [b.message for b in outcome.blockers]


def test_removed_serve_not_running_is_released() -> None:
    new = config({"a": (1000, 100), "b": (1000, 0)}, {"y": ("a", 200)})
    out = decide(OLD, new, [res("x", "a", 300)], {"x": "admitted"})
    assert isinstance(out, Transition)
    assert out.release == ("x",) and out.stop == ()
    assert "x" not in out.ledger.reservations


def test_removed_running_serve_refuses_a_reload_and_is_stopped_first_by_apply() -> None:
    new = config({"a": (1000, 100), "b": (1000, 0)}, {"y": ("a", 200)})
    held, states = [res("x", "a", 300)], {"x": "running"}
    [message] = refused(decide(OLD, new, held, states))
    assert message == ("x (300 MiB on a): is running and leaves the config: stop it first "
                       "(gpuctl stop), or use gpuctl apply")
    out = decide(OLD, new, held, states, may_stop=True)
    assert isinstance(out, Transition) and out.stop == ("x",) and out.release == ()


def test_serve_moved_to_another_role_gives_up_its_old_reservation() -> None:
    new = config({"a": (1000, 100), "b": (1000, 0)}, {"x": ("b", 300), "y": ("a", 200)})
    out = decide(OLD, new, [res("x", "a", 300)], {"x": "admitted"})
    assert isinstance(out, Transition) and out.release == ("x",)
    [message] = refused(decide(OLD, new, [res("x", "a", 300)], {"x": "starting"}))
    assert "moves to role 'b'" in message


def test_role_removed_under_an_external_reservation_is_refused() -> None:
    new = config({"a": (1000, 100)}, {"x": ("a", 300), "y": ("a", 200)})
    [message] = refused(decide(OLD, new, [res("ext", "b", 54, external=True)], {}))
    assert message.startswith("ext (54 MiB on b): external reservation on role 'b'")


def test_configuring_a_serve_under_an_external_reservations_name_is_refused() -> None:
    new = config({"a": (1000, 100), "b": (1000, 0)}, {"x": ("a", 300), "ext": ("b", 10)})
    [message] = refused(decide(OLD, new, [res("ext", "a", 54, external=True)], {}))
    assert "holds an external reservation" in message


def test_over_commit_is_refused_naming_what_the_role_holds() -> None:
    new = config({"a": (500, 100), "b": (1000, 0)}, {"x": ("a", 300), "y": ("a", 200)})
    held = [res("x", "a", 300), res("y", "a", 200)]
    [message] = refused(decide(OLD, new, held, {}))
    assert message == ("roles.a: committed 500 MiB would exceed capacity - reserve = 400 MiB "
                       "(held: x 300 MiB, y 200 MiB)")
    # Exactly full is not over-committed.
    exact = config({"a": (600, 100), "b": (1000, 0)}, {"x": ("a", 300), "y": ("a", 200)})
    assert isinstance(decide(OLD, exact, held, {}), Transition)


def test_a_role_over_committed_by_adopted_units_may_stay_so_but_not_grow_worse() -> None:
    held = [res("x", "a", 800), res("y", "a", 300)]  # adopted: 1100 on 900
    same = decide(OLD, OLD, held, {"x": "running", "y": "running"})
    assert isinstance(same, Transition)
    worse = config({"a": (1000, 101), "b": (1000, 0)}, {"x": ("a", 300), "y": ("a", 200)})
    assert refused(decide(OLD, worse, held, {"x": "running", "y": "running"}))


def test_over_commit_by_one_mib_is_refused_and_a_refusal_says_everything() -> None:
    new = config({"a": (599, 100), "b": (1000, 0)}, {"x": ("a", 300), "y": ("a", 200)})
    out = decide(OLD, new, [res("x", "a", 300), res("y", "a", 200)], {})
    assert isinstance(out, Refusal)
    [blocker] = out.blockers
    assert blocker.to_json() == {"what": "roles.a", "role": None, "mib": None,
                                 "reason": blocker.reason, "message": blocker.message}
    assert out.message == blocker.message
    two = decide(OLD, config({"a": (1000, 100)}, {}),
                 [res("x", "a", 300), res("ext", "b", 5, external=True)], {"x": "running"})
    assert isinstance(two, Refusal) and len(two.blockers) == 2
    assert two.message == "; ".join(b.message for b in two.blockers)
    assert {b.what: b.to_json()["mib"] for b in two.blockers} == {"x": 300, "ext": 5}


def test_a_live_serve_without_a_reservation_blocks_any_change() -> None:
    [message] = refused(decide(OLD, OLD, [], {"x": "running"}))
    assert message == "x: is running without a reservation"
    assert isinstance(decide(OLD, OLD, [], {"x": "stopping"}), Transition)


def test_restart_only_daemon_keys_are_refused() -> None:
    new = OLD.model_copy(update={"daemon": OLD.daemon.model_copy(
        update={"state_dir": "/elsewhere", "socket": "/run/other.sock"})})
    messages = refused(decide(OLD, new, [], {}))
    assert [m.split(":")[0] for m in messages] == ["daemon.socket", "daemon.state_dir"]
    assert "restart gpud" in messages[0]


def test_orphan_unit_blocks_configuring_its_name_again() -> None:
    [message] = refused(decide(OLD, OLD, [], {"x": "orphan"}))
    assert message.startswith("x: an orphan unit")


def test_violations_names_each_broken_clause() -> None:
    ledger = Ledger.build(budgets(OLD), [res("x", "b", 300), res("ext", "gone", 5, external=True),
                                         res("y", "a", 1200)])
    found = violations(OLD, ledger, {"z": "running"})
    assert "x: reservation on 'b', configured on 'a'" in found
    assert "ext: reservation on role 'gone', which is not configured" in found
    assert "role 'a': committed 1200 > capacity 1000 - reserve 100" in found
    assert "z: running without a reservation" in found
    assert violations(OLD, Ledger.build(budgets(OLD), [res("x", "a", 300)]),
                      {"x": "running"}) == []
    full = Ledger.build(budgets(OLD), [res("x", "a", 900)])  # exactly capacity - reserve
    assert violations(OLD, full, {"x": "running"}) == []
    over_by_one = Ledger.build(budgets(OLD), [res("x", "a", 901)])
    assert violations(OLD, over_by_one, {"x": "running"}) == [
        "role 'a': committed 901 > capacity 1000 - reserve 100"]
    # adopted units may leave a role over by as much as they hold, and no more
    assert violations(OLD, over_by_one, {"x": "running"}, adopted_over={"a": 1}) == []
    assert violations(OLD, Ledger.build(budgets(OLD), [res("x", "a", 902)]), {"x": "running"},
                      adopted_over={"a": 1}) != []
    named = Ledger.build(budgets(OLD), [res("x", "a", 300, external=True)])
    assert violations(OLD, named, {}) == ["x: external reservation under a configured serve's "
                                          "name"]



def test_violated_names_the_roles_each_problem_concerns() -> None:
    ledger = Ledger.build(budgets(OLD), [res("x", "b", 300), res("ext", "gone", 5, external=True),
                                         res("q", ("a", "a"), 1200)])  # counted once on a
    found = {text: roles for roles, text in violated(OLD, ledger, {"z": "running",
                                                                   "w": "starting"})}
    assert found == {
        "x: reservation on 'b', configured on 'a'": ("b", "a"),
        "ext: reservation on role 'gone', which is not configured": ("gone",),
        "q: reservation names a role twice: a, a": ("a", "a"),
        "role 'a': committed 1200 > capacity 1000 - reserve 100": ("a",),
        "z: running without a reservation": (),  # not a configured serve: no roles of its own
        "w: starting without a reservation": (),
    }
    configured = violated(OLD, Ledger.build(budgets(OLD), []), {"x": "running"})
    assert configured == [(("a",), "x: running without a reservation")]


def test_a_role_with_nothing_held_is_violated_only_when_its_reserve_exceeds_its_capacity() -> None:
    # capacity and reserve as resolved (a device smaller than configured): nothing held counts 0
    exact = Ledger.build([RoleBudget("a", "0", 600, 600), RoleBudget("b", "1", 1000, 0)], [])
    assert violations(OLD, exact, {}) == []
    short = Ledger.build([RoleBudget("a", "0", 500, 600), RoleBudget("b", "1", 1000, 0)], [])
    assert violations(OLD, short, {}) == ["role 'a': committed 0 > capacity 500 - reserve 600"]

# ---- the property ----------------------------------------------------------------------------

ROLES = ("r0", "r1", "r2")
SERVES = ("s0", "s1", "s2", "s3")
EXTERNAL = ("e0", "e1")
LIVE = {"starting", "running"}


@st.composite
def configs(draw: st.DrawFn) -> Config:
    roles = {}
    for name in draw(st.lists(st.sampled_from(ROLES), min_size=1, unique=True)):
        capacity = draw(st.integers(200, 2000))
        roles[name] = (capacity, draw(st.integers(0, capacity - 1)))
    serves: dict[str, tuple[str | tuple[str, ...], int]] = {}
    for name in draw(st.lists(st.sampled_from(SERVES), unique=True)):
        # One role, or (tensor parallel) several, each on a device of its own.
        on = draw(st.lists(st.sampled_from(sorted(roles)), min_size=1, max_size=len(roles),
                           unique=True))
        cap = min(roles[r][0] for r in on)
        serves[name] = (on[0] if len(on) == 1 else tuple(on), draw(st.integers(1, cap)))
    return config(roles, serves)


class LedgerWorld(RuleBasedStateMachine):
    """What the service and supervisor do, on values: every change goes through the ledger's
    decide/release or through `transition`, and the invariant holds after each."""

    def __init__(self) -> None:
        super().__init__()
        self.config = config({"r0": (1000, 100)}, {"s0": ("r0", 300)})
        self.ledger = Ledger.build(budgets(self.config), [])
        self.states: dict[str, str] = {}

    def _admit(self, serve: str, role: str | tuple[str, ...], mib: int, external: bool) -> bool:
        out = self.ledger.decide(serve, role, mib, since=0.0, by_uid=0, external=external)
        if isinstance(out, Denial):
            return False
        self.ledger = out[0]
        return True

    @rule(serve=st.sampled_from(SERVES), mib=st.integers(1, 2000))
    def admit(self, serve: str, mib: int) -> None:
        spec = self.config.serves.get(serve)
        if spec is not None and self._admit(serve, spec.all_roles, mib, False) \
                and self.states.get(serve) not in LIVE:
            self.states[serve] = "admitted"

    @rule(name=st.sampled_from(EXTERNAL), role=st.sampled_from(ROLES), mib=st.integers(1, 800))
    def admit_external(self, name: str, role: str, mib: int) -> None:
        held = self.ledger.reservations.get(name)
        if role in self.config.roles and name not in self.config.serves and (
                held is None or held.role == role) and self._admit(name, role, mib, True):
            self.states[name] = "external"

    @rule(serve=st.sampled_from(SERVES + EXTERNAL))
    def release(self, serve: str) -> None:
        if serve in self.ledger.reservations and self.states.get(serve) not in LIVE:
            self.ledger = self.ledger.release(serve)[0]
            self.states[serve] = "declared"

    @rule(serve=st.sampled_from(SERVES))
    def start(self, serve: str) -> None:
        spec = self.config.serves.get(serve)
        if spec is None or self.states.get(serve) in LIVE:
            return
        held = self.ledger.reservations.get(serve)
        if held is None and not self._admit(serve, spec.all_roles, spec.vram_mib, False):
            return
        self.states[serve] = "running"

    @rule(serve=st.sampled_from(SERVES))
    def stop(self, serve: str) -> None:
        if self.states.get(serve) in LIVE and serve in self.config.serves:
            self.ledger = self.ledger.release(serve)[0]
            self.states[serve] = "declared"

    @rule(new=configs(), may_stop=st.booleans())
    def change_config(self, new: Config, may_stop: bool) -> None:
        out = transition(old=self.config, new=new, ledger=self.ledger, budgets=budgets(new),
                         states=self.states, may_stop=may_stop)
        if isinstance(out, Refusal):
            assert out.blockers  # a refusal always says what stands in the way
            return
        for serve in out.stop:  # stopped, then released
            assert may_stop and self.states[serve] in LIVE
            self.states[serve] = "declared"
        for serve in out.release:  # released as they are: a live unit would go on running
            if self.states.get(serve) not in LIVE:
                self.states[serve] = "declared"
        kept = set(self.ledger.reservations) - set(out.released)
        assert set(out.ledger.reservations) == kept  # nothing else is dropped
        self.config, self.ledger = new, out.ledger

    @invariant()
    def holds(self) -> None:
        assert violations(self.config, self.ledger, self.states) == []

    @invariant()
    def never_half_reserved(self) -> None:
        # A serve on several roles holds the same MiB on every one of them, or nothing: each
        # role's committed figure counts it exactly once.
        for name in self.ledger.roles:
            on = [r for r in self.ledger.reservations.values() if name in r.all_roles]
            assert self.ledger.figures(name).committed_mib == sum(r.mib for r in on)
        for r in self.ledger.reservations.values():
            spec = self.config.serves.get(r.serve)
            if spec is not None:
                assert r.all_roles == spec.all_roles


TestLedgerWorld = LedgerWorld.TestCase
TestLedgerWorld.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


@pytest.mark.parametrize("serves", [{}, {"x": ("a", 300)}])
def test_a_change_with_nothing_held_is_never_refused(serves: dict[str, tuple[str, int]]) -> None:
    new = config({"a": (400, 0)}, serves)
    assert isinstance(decide(OLD, new, [], {}), Transition)


# ---- serves on several roles -------------------------------------------------------------------

TP_OLD = config({"a": (1000, 100), "b": (1000, 0)}, {"big": (("a", "b"), 300)})


def test_a_serve_on_two_roles_keeps_its_reservation_when_its_roles_stay() -> None:
    out = decide(TP_OLD, TP_OLD, [res("big", ("a", "b"), 300)], {"big": "running"})
    assert isinstance(out, Transition) and out.released == ()
    assert out.ledger.figures("a").committed_mib == 300
    assert out.ledger.figures("b").committed_mib == 300


def test_a_serve_moving_from_two_roles_to_one_gives_up_the_whole_reservation() -> None:
    new = config({"a": (1000, 100), "b": (1000, 0)}, {"big": ("a", 300)})
    out = decide(TP_OLD, new, [res("big", ("a", "b"), 300)], {"big": "admitted"})
    assert isinstance(out, Transition) and out.release == ("big",)
    assert out.ledger.figures("a").committed_mib == 0
    assert out.ledger.figures("b").committed_mib == 0
    live = decide(TP_OLD, new, [res("big", ("a", "b"), 300)], {"big": "running"})
    assert refused(live) == ["big (300 MiB on a, b): is running and moves to role 'a': stop it "
                             "first (gpuctl stop), or use gpuctl apply"]
    applied = decide(TP_OLD, new, [res("big", ("a", "b"), 300)], {"big": "running"},
                     may_stop=True)
    assert isinstance(applied, Transition) and applied.stop == ("big",)


def test_a_serve_moving_from_one_role_to_two_moves_and_a_reordering_counts_as_a_move() -> None:
    one = config({"a": (1000, 100), "b": (1000, 0)}, {"big": ("a", 300)})
    out = decide(one, TP_OLD, [res("big", "a", 300)], {"big": "admitted"})
    assert isinstance(out, Transition) and out.release == ("big",)
    swapped = config({"a": (1000, 100), "b": (1000, 0)}, {"big": (("b", "a"), 300)})
    out = decide(TP_OLD, swapped, [res("big", ("a", "b"), 300)], {"big": "admitted"})
    assert isinstance(out, Transition) and out.release == ("big",)  # device order changes


def test_removing_one_role_of_a_two_role_reservation_is_refused_or_moves_it_whole() -> None:
    new = config({"a": (1000, 100)}, {"big": ("a", 300)})
    out = decide(TP_OLD, new, [res("big", ("a", "b"), 300)], {"big": "admitted"})
    assert isinstance(out, Transition) and out.release == ("big",)
    assert "big" not in out.ledger.reservations


def test_over_commit_on_either_role_of_a_two_role_serve_is_refused() -> None:
    small_b = config({"a": (1000, 100), "b": (250, 0)}, {"big": (("a", "b"), 300)})
    assert refused(decide(TP_OLD, small_b, [res("big", ("a", "b"), 300)], {})) == [
        "roles.b: committed 300 MiB would exceed capacity - reserve = 250 MiB "
        "(held: big 300 MiB)"]


def test_violations_name_a_half_reserved_serve() -> None:
    half = Ledger.build(budgets(TP_OLD), [res("big", "a", 300)])
    assert violations(TP_OLD, half, {"big": "admitted"}) == [
        "big: reservation on 'a', configured on 'a, b'"]


# _unwakeable: a sleeping serve keeps its sleep reservation through a change and is woken later
# at the port its process listens on, to the size it was launched with; a change that takes any
# of these away would leave it asleep for good.
def sleepy(roles: dict[str, tuple[int, int]], role: str | tuple[str, ...] = "a", *,
           vram: int = 600, level: int = 1, port: int = 8000) -> Config:
    serve: dict[str, Any] = {"vram_mib": vram, "sleep_level": level, "port": port,
                             "front": False, "command": ["/bin/true"]}
    serve.update({"role": role} if isinstance(role, str) else {"roles": list(role)})
    return Config.model_validate({
        "roles": {n: {"device": str(i), "capacity_mib": c, "reserve_mib": r}
                  for i, (n, (c, r)) in enumerate(roles.items())},
        "serves": {"s": serve},
    })


WAS = {"a": (1000, 100), "b": (1000, 0)}
CANNOT = ": it could not be woken; wake it (gpuctl wake) or stop it first"


@pytest.mark.parametrize(("old", "new", "why"), [
    (sleepy(WAS), sleepy(WAS), None),
    (sleepy(WAS), sleepy(WAS, level=2), None),
    (sleepy(WAS), sleepy(WAS, level=0), "its sleep_level is removed"),
    (sleepy(WAS), sleepy(WAS, port=8001),
     "its port changes (8000 -> 8001; its process listens on 8000)"),
    (sleepy(WAS), sleepy(WAS, level=0, port=8001),
     "its sleep_level is removed and its port changes (8000 -> 8001; its process listens on "
     "8000)"),
    # room for the awake size shrinks below it: 650 - 100 = 550 < 600
    (sleepy(WAS), sleepy({"a": (650, 100), "b": (1000, 0)}),
     "role 'a' would hold 550 MiB at most (capacity - reserve), less than the 600 MiB it wakes "
     "to"),
    (sleepy(WAS), sleepy({"a": (1000, 401), "b": (1000, 0)}),
     "role 'a' would hold 599 MiB at most (capacity - reserve), less than the 600 MiB it wakes "
     "to"),
    # exactly its awake size left: it still wakes
    (sleepy(WAS), sleepy({"a": (700, 100), "b": (1000, 0)}), None),
    (sleepy(WAS), sleepy({"a": (1000, 400), "b": (1000, 0)}), None),
    # it could wake exactly before (700 - 100 = 600), not after: made so by this change
    (sleepy({"a": (700, 100), "b": (1000, 0)}), sleepy({"a": (699, 100), "b": (1000, 0)}),
     "role 'a' would hold 599 MiB at most (capacity - reserve), less than the 600 MiB it wakes "
     "to"),
    # it could not wake before either (599 < 600): not this change's doing
    (sleepy({"a": (699, 100), "b": (1000, 0)}), sleepy({"a": (650, 100), "b": (1000, 0)}), None),
    # it wakes to the size its process was launched with, not the new vram_mib
    (sleepy(WAS), sleepy({"a": (800, 100), "b": (1000, 0)}, vram=900), None),
    (sleepy(WAS, vram=800), sleepy({"a": (800, 100), "b": (1000, 0)}, vram=500),
     "role 'a' would hold 700 MiB at most (capacity - reserve), less than the 800 MiB it wakes "
     "to"),
    # on several roles: each one counts, and is named
    (sleepy(WAS, ("a", "b")), sleepy({"a": (1000, 100), "b": (500, 0)}, ("a", "b")),
     "role 'b' would hold 500 MiB at most (capacity - reserve), less than the 600 MiB it wakes "
     "to"),
    (sleepy(WAS, ("a", "b")), sleepy({"a": (500, 0), "b": (500, 0)}, ("a", "b")),
     "role 'a' would hold 500 MiB at most (capacity - reserve), less than the 600 MiB it wakes "
     "to and role 'b' would hold 500 MiB at most (capacity - reserve), less than the 600 MiB "
     "it wakes to"),
])
def test_a_sleeping_serve_must_stay_wakeable(old: Config, new: Config, why: str | None) -> None:
    held = [res("s", old.serves["s"].all_roles, 100)]
    out = decide(old, new, held, {"s": "sleeping"})
    if why is None:
        assert isinstance(out, Transition), out
        assert out.ledger.reservations["s"].mib == 100 and out.release == out.stop == ()
        return
    assert refused(out) == [f"s (100 MiB on {held[0].roles_text}): is sleeping and {why}"
                            f"{CANNOT}"]
    # the same change is no concern of a serve that is awake (it is not woken through them)
    assert isinstance(decide(old, new, held, {"s": "running"}), Transition)


def test_a_sleeping_serve_newly_configured_is_judged_by_the_new_config() -> None:
    # no serve of its name before (a reservation kept from an older config): no port to compare,
    # and it wakes to the new vram_mib
    old = config({"a": (2000, 100), "b": (1000, 0)}, {})
    held = [res("s", "a", 100)]
    assert isinstance(decide(old, sleepy(WAS, port=9000), held, {"s": "sleeping"}), Transition)
    [message] = refused(decide(old, sleepy(WAS, vram=950), held, {"s": "sleeping"}))
    assert "less than the 950 MiB it wakes to" in message


def test_a_role_missing_before_counts_as_no_room_before() -> None:
    # the role held the reservation but was not configured (missing): any shortfall is new
    old = config({"b": (1000, 0)}, {})
    held = [res("s", "a", 100)]
    ledger = Ledger.build(budgets(old), held)
    assert ledger.roles["a"].missing
    new = sleepy({"a": (500, 0), "b": (1000, 0)})
    out = transition(old=old, new=new, ledger=ledger, budgets=budgets(new),
                     states={"s": "sleeping"}, may_stop=False)
    assert "role 'a' would hold 500 MiB at most" in refused(out)[0]


def test_an_external_reservation_on_a_role_that_stays_is_kept_through_a_change() -> None:
    new = config({"a": (1000, 100), "b": (500, 0)}, {"x": ("a", 300)})
    out = decide(OLD, new, [res("ext", "b", 54, external=True)], {"ext": "external"})
    assert isinstance(out, Transition) and out.released == ()
    assert out.ledger.reservations["ext"].mib == 54 and out.ledger.reservations["ext"].external
