"""The preemption planner (gpud/core/preempt.py): table cases and properties against a brute
force over every subset."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpud.core import preempt
from gpud.core.preempt import Candidate, NoPlan, PreemptPlan, plan_on_roles, plan_preemption


def c(serve: str, priority: int, held: int, action: str = "sleep", keeps: int = 0) -> Candidate:
    return Candidate(serve, priority, held, action, keeps)  # type: ignore[arg-type]


@pytest.mark.parametrize(("need", "free", "cands", "victims"), [
    # fits already: nothing to do
    (1000, 1000, [c("lo", 50, 5000, keeps=500)], []),
    # one sleep frees enough
    (6000, 2000, [c("lo", 50, 5000, keeps=500)], ["lo"]),
    # the one large serve rather than two small ones (fewest)
    (6000, 1000, [c("a", 60, 3000), c("b", 70, 3000), c("big", 50, 6000, keeps=500)], ["big"]),
    # two needed: the least important first
    (7000, 1000, [c("a", 60, 4000), c("b", 70, 4000), c("x", 80, 100)], ["b", "a"]),
    # among sets of the fewest size, the least important serve that still completes it
    (5000, 0, [c("mid", 60, 5000), c("low", 90, 5000)], ["low"]),
    # a stop frees everything, a sleep only what it does not keep
    (4500, 0, [c("s", 60, 5000, keeps=1000), c("t", 70, 4500, "stop")], ["t"]),
    # the least important cannot complete the smallest set alone: a larger one is taken
    (5000, 0, [c("mid", 60, 5000), c("low", 90, 1000)], ["mid"]),
])
def test_plans(need: int, free: int, cands: list[Candidate], victims: list[str]) -> None:
    plan = plan_preemption("hi", 10, need, free, cands)
    assert isinstance(plan, PreemptPlan)
    assert [s.serve for s in plan.steps] == victims
    assert plan.free_after_mib >= need
    lines = plan.lines()
    assert lines[0].startswith(f"preempt for hi (priority 10): need {need} MiB")
    assert len(lines) == len(victims) + 2


def test_equal_and_higher_priority_never_touched() -> None:
    out = plan_preemption("hi", 50, 8000, 0, [c("same", 50, 9000), c("higher", 10, 9000)])
    assert isinstance(out, NoPlan)
    assert "no serve of lower priority than 50" in out.reason


def test_not_enough_says_how_much() -> None:
    out = plan_preemption("hi", 10, 9000, 1000, [c("a", 60, 3000, keeps=500), c("b", 70, 2000)])
    assert isinstance(out, NoPlan)
    assert out.could_free_mib == 4500
    assert "free 4500 MiB together, 8000 MiB are needed" in out.reason
    assert "(b, a)" in out.reason


def test_the_serve_itself_and_nothing_to_free_are_not_victims() -> None:
    out = plan_preemption("hi", 10, 2000, 0, [c("hi", 90, 5000), c("empty", 90, 500, keeps=500)])
    assert isinstance(out, NoPlan)


def test_steps_undo_and_json() -> None:
    plan = plan_preemption("hi", 10, 9000, 0, [c("a", 60, 5000, keeps=500), c("b", 70, 5000,
                                                                               "stop")])
    assert isinstance(plan, PreemptPlan)
    assert [(s.serve, s.action, s.undo) for s in plan.steps] == [("b", "stop", "start"),
                                                                 ("a", "sleep", "wake")]
    assert plan.to_json()["free_after_mib"] == 9500


def test_need_must_be_positive() -> None:
    with pytest.raises(ValueError):
        plan_preemption("hi", 10, 0, 0, [])


candidates = st.lists(
    st.builds(Candidate, serve=st.sampled_from("abcdefgh"), priority=st.integers(0, 5),
              held_mib=st.integers(1, 40), action=st.sampled_from(["sleep", "stop"]),
              keeps_mib=st.integers(0, 10)),
    max_size=7, unique_by=lambda x: x.serve)


@settings(max_examples=400, deadline=None)
@given(candidates, st.integers(0, 5), st.integers(1, 120), st.integers(-20, 60))
def test_properties(cands: list[Candidate], priority: int, need: int, free: int) -> None:
    out = plan_preemption("hi", priority, need, free, cands)
    eligible = [x for x in cands if x.priority > priority and x.frees_mib > 0]
    # the fewest victims any subset of eligible serves could do with (brute force)
    best: int | None = None
    for k in range(len(eligible) + 1):
        if any(free + sum(x.frees_mib for x in combo) >= need
               for combo in itertools.combinations(eligible, k)):
            best = k
            break
    if isinstance(out, NoPlan):
        assert best is None, f"a plan of {best} existed"
        return
    victims = {s.serve for s in out.steps}
    by_name = {x.serve: x for x in cands}
    assert len(victims) == len(out.steps)  # no serve twice
    assert all(by_name[v].priority > priority for v in victims)  # never equal or higher
    assert out.free_after_mib >= need  # after the plan it fits
    assert len(out.steps) == best  # the fewest
    assert all(s.frees_mib == by_name[s.serve].frees_mib for s in out.steps)


# ---- a serve on several roles ----------------------------------------------------------------

def cr(serve: str, priority: int, held: int, roles: tuple[str, ...], action: str = "sleep",
       keeps: int = 0) -> Candidate:
    return Candidate(serve, priority, held, action, keeps, roles)  # type: ignore[arg-type]


def test_on_several_roles_victims_on_each_role_are_taken() -> None:
    # hi needs 6000 on a and on b: short 4000 on a, 5000 on b; lo-a is only on a, lo-b only on b
    plan = plan_on_roles("hi", 10, 6000, {"a": 2000, "b": 1000},
                         [cr("lo-a", 50, 5000, ("a",)), cr("lo-b", 60, 5000, ("b",))])
    assert isinstance(plan, PreemptPlan)
    assert sorted(s.serve for s in plan.steps) == ["lo-a", "lo-b"]
    assert {r.role: r.free_after_mib for r in plan.roles} == {"a": 7000, "b": 6000}
    assert plan.free_after_mib == 6000 and plan.free_mib == 1000
    assert "on each of its roles" in plan.lines()[0]
    assert plan.to_json()["roles"] == [r.to_json() for r in plan.roles]


def test_a_victim_on_both_roles_frees_on_each_and_is_fewest() -> None:
    plan = plan_on_roles("hi", 10, 6000, {"a": 2000, "b": 1000},
                         [cr("lo-a", 90, 5000, ("a",)), cr("lo-b", 90, 5000, ("b",)),
                          cr("tp", 50, 5000, ("a", "b"), keeps=0)])
    assert isinstance(plan, PreemptPlan)
    assert [(s.serve, s.roles) for s in plan.steps] == [("tp", ("a", "b"))]
    assert "on each of a, b" in plan.steps[0].line()


def test_a_role_no_preemption_can_help_is_named() -> None:
    out = plan_on_roles("hi", 10, 6000, {"a": 2000, "b": 1000},
                        [cr("lo-a", 50, 5000, ("a",)), cr("same-b", 10, 9000, ("b",))])
    assert isinstance(out, NoPlan)
    assert out.role == "b" and "on role 'b'" in out.reason
    assert out.to_json()["role"] == "b"


def test_on_several_roles_that_fit_nothing_to_do() -> None:
    plan = plan_on_roles("hi", 10, 1000, {"a": 2000, "b": 1000}, [cr("lo", 50, 5000, ("a",))])
    assert isinstance(plan, PreemptPlan) and plan.steps == ()


role_candidates = st.lists(
    st.builds(Candidate, serve=st.sampled_from("abcdefgh"), priority=st.integers(0, 5),
              held_mib=st.integers(1, 40), action=st.sampled_from(["sleep", "stop"]),
              keeps_mib=st.integers(0, 10),
              roles=st.sampled_from([("x",), ("y",), ("z",), ("x", "y"), ("y", "z"),
                                     ("x", "z"), ("x", "y", "z")])),
    max_size=7, unique_by=lambda x: x.serve)


@settings(max_examples=400, deadline=None)
@given(role_candidates, st.integers(0, 5), st.integers(1, 90),
       st.dictionaries(st.sampled_from("xyz"), st.integers(-20, 60), min_size=1))
def test_properties_on_several_roles(cands: list[Candidate], priority: int, need: int,
                                     free: dict[str, int]) -> None:
    out = plan_on_roles("hi", priority, need, free, cands)
    eligible = [x for x in cands if x.priority > priority and x.frees_mib > 0]

    def fits(combo: tuple[Candidate, ...]) -> bool:
        return all(room + sum(x.frees_mib for x in combo if role in x.roles) >= need
                   for role, room in free.items())

    best: int | None = None
    for k in range(len(eligible) + 1):
        if any(fits(combo) for combo in itertools.combinations(eligible, k)):
            best = k
            break
    if isinstance(out, NoPlan):
        assert best is None, f"a plan of {best} existed"
        assert out.role is None or out.role in free
        return
    by_name = {x.serve: x for x in cands}
    chosen = tuple(by_name[s.serve] for s in out.steps)
    assert len({s.serve for s in out.steps}) == len(out.steps)  # no serve twice
    assert all(x.priority > priority for x in chosen)  # never equal or higher
    assert fits(chosen)  # after the plan it fits on every role
    assert len(chosen) == best  # the fewest overall
    # among the covering sets of that size, the least important first (as on one role)
    if len(free) > 1:
        order = sorted(eligible, key=lambda x: (-x.priority, -x.frees_mib, x.serve))
        first = next(combo for combo in itertools.combinations(order, best) if fits(combo))
        assert [x.serve for x in chosen] == [x.serve for x in first]
    assert out.free_after_mib >= need
    for room in out.roles:  # what the plan says it frees, role by role, is what it frees
        assert room.free_after_mib == free[room.role] + sum(
            x.frees_mib for x in chosen if room.role in x.roles)
    assert all(s.roles == tuple(r for r in free if r in by_name[s.serve].roles)
               for s in out.steps) or len(free) == 1


def _crowd(seed: int, n: int = 64) -> tuple[list[Candidate], int]:
    """`n` serves of about 1 GiB each on two roles (or both), and a need that only many of
    them cover: the exact search over such a crowd is exponential."""
    rng = random.Random(seed)
    cands = [Candidate(f"s{i}", 10 + i, rng.randint(900, 1100), "sleep", 0,
                       rng.choice([("a",), ("b",), ("a", "b")])) for i in range(n)]
    totals = [sum(c.frees_mib for c in cands if c.on(r)) for r in ("a", "b")]
    return cands, int(min(totals) * rng.uniform(0.5, 0.99))


@pytest.mark.parametrize("seed", range(4))
def test_a_crowd_on_two_roles_gets_a_plan_within_the_search_budget(seed: int) -> None:
    cands, need = _crowd(seed)
    out = plan_on_roles("hi", 1, need, {"a": 0, "b": 0}, cands)
    assert isinstance(out, PreemptPlan)
    chosen = [c for c in cands if c.serve in {s.serve for s in out.steps}]
    for role in ("a", "b"):
        assert sum(c.frees_mib for c in chosen if c.on(role)) >= need
    # no victim the others cover without
    for c in chosen:
        others = [o for o in chosen if o is not c]
        assert any(sum(o.frees_mib for o in others if o.on(r)) < need for r in ("a", "b"))


@settings(max_examples=200, deadline=None)
@given(role_candidates, st.integers(0, 5), st.integers(1, 90),
       st.dictionaries(st.sampled_from("xyz"), st.integers(-20, 60), min_size=2))
def test_past_the_search_budget_the_plan_still_covers_every_role(
        cands: list[Candidate], priority: int, need: int, free: dict[str, int]) -> None:
    exact = plan_on_roles("hi", priority, need, free, cands)
    old = preempt.SEARCH_BUDGET
    preempt.SEARCH_BUDGET = 0
    try:
        greedy = plan_on_roles("hi", priority, need, free, cands)
    finally:
        preempt.SEARCH_BUDGET = old
    assert isinstance(greedy, NoPlan) == isinstance(exact, NoPlan)
    if isinstance(greedy, NoPlan) or isinstance(exact, NoPlan):
        return
    by_name = {x.serve: x for x in cands}
    chosen = [by_name[s.serve] for s in greedy.steps]
    assert all(x.priority > priority for x in chosen)
    assert all(room + sum(x.frees_mib for x in chosen if x.on(role)) >= need
               for role, room in free.items())
    assert len(chosen) >= len(exact.steps)  # the exact search is the fewest


# ---- what a plan says, and the edges of eligibility ------------------------------------------

def test_a_candidate_frees_what_it_does_not_keep_and_never_less_than_nothing() -> None:
    assert Candidate("s", 5, 1000, "stop").frees_mib == 1000  # stopped, it keeps nothing
    assert c("s", 5, 1000, keeps=1000).frees_mib == 0
    assert c("s", 5, 1000, keeps=1500).frees_mib == 0


def test_a_step_and_a_plan_say_what_they_do() -> None:
    plan = plan_preemption("hi", 10, 9000, 1000, [c("a", 60, 5000, keeps=500),
                                                   c("b", 70, 4000, "stop")])
    assert isinstance(plan, PreemptPlan)
    assert plan.lines() == [
        "preempt for hi (priority 10): need 9000 MiB, free 1000 MiB, short 8000 MiB",
        "  1. stop b (priority 70): frees 4000 MiB; undo: start",
        "  2. put to sleep a (priority 60): frees 4500 MiB; undo: wake",
        "after: free 9500 MiB, hi fits"]
    assert plan.to_json()["steps"] == [
        {"serve": "b", "action": "stop", "frees_mib": 4000, "priority": 70, "undo": "start"},
        {"serve": "a", "action": "sleep", "frees_mib": 4500, "priority": 60, "undo": "wake"}]
    assert "roles" not in plan.to_json()
    one = preempt.Step("t", "sleep", 100, 50, ("a",))
    assert one.line() == "put to sleep t (priority 50): frees 100 MiB on a; undo: wake"
    assert one.to_json()["roles"] == ["a"]
    assert preempt.RoleRoom("a", 5, 10).to_json() == {"role": "a", "free_mib": 5,
                                                      "free_after_mib": 10}


def test_what_frees_nothing_or_is_not_of_lower_priority_is_no_victim() -> None:
    out = plan_preemption("hi", 10, 2000, 0, [c("hi", 90, 5000), c("empty", 90, 500, keeps=500),
                                               c("same", 10, 5000)])
    assert isinstance(out, NoPlan)
    assert out.reason == ("no serve of lower priority than 10 on the role can be put to sleep "
                          "or stopped")
    assert out.could_free_mib == 0
    out = plan_preemption("hi", 10, 2000, 0, [c("empty", 90, 500, keeps=500), c("a", 60, 1000)])
    assert isinstance(out, NoPlan) and "(a) free 1000 MiB together" in out.reason
    # one MiB freed is one MiB
    plan = plan_preemption("hi", 10, 2000, 1999, [c("tiny", 90, 1)])
    assert isinstance(plan, PreemptPlan) and [s.serve for s in plan.steps] == ["tiny"]


def test_on_several_roles_the_need_and_the_roles_are_checked() -> None:
    with pytest.raises(ValueError, match="need_mib must be positive"):
        plan_on_roles("hi", 10, 0, {"a": 0, "b": 0}, [])
    with pytest.raises(ValueError, match="at least one role"):
        plan_on_roles("hi", 10, 100, {}, [])


def test_on_one_role_a_plan_on_roles_is_the_single_role_plan() -> None:
    cands = [cr("lo", 50, 5000, ("a",)), cr("elsewhere", 90, 5000, ("b",))]
    plan = plan_on_roles("hi", 10, 6000, {"a": 2000}, cands)
    assert plan == plan_preemption("hi", 10, 6000, 2000, cands[:1])
    assert isinstance(plan, PreemptPlan) and plan.roles == () and "roles" not in plan.to_json()


def test_on_several_roles_what_frees_nothing_is_not_named() -> None:
    out = plan_on_roles("hi", 10, 6000, {"a": 2000, "b": 1000},
                        [cr("lo-a", 50, 5000, ("a",)), cr("empty-b", 90, 500, ("b",), keeps=500),
                         cr("lo-b", 60, 1000, ("b",))])
    assert isinstance(out, NoPlan)
    assert out.reason == ("on role 'b': the serves of lower priority (lo-b) free 1000 MiB "
                          "together, 5000 MiB are needed")
    out = plan_on_roles("hi", 10, 6000, {"a": 2000, "b": 1000},
                        [cr("lo-a", 50, 5000, ("a",)), cr("empty-b", 90, 500, ("b",), keeps=500)])
    assert isinstance(out, NoPlan)
    assert out.reason == ("on role 'b': no serve of lower priority than 10 can be put to sleep "
                          "or stopped")


def test_on_several_roles_one_mib_freed_is_one_mib() -> None:
    plan = plan_on_roles("hi", 10, 1000, {"a": 999, "b": 1000}, [cr("tiny", 90, 1, ("a",))])
    assert isinstance(plan, PreemptPlan) and [s.serve for s in plan.steps] == ["tiny"]


def test_a_victim_on_other_roles_frees_nothing_on_this_one() -> None:
    # x frees all of a and nothing on b: b needs 1000 more, which lo (999) cannot give
    plan = plan_on_roles("hi", 10, 1000, {"a": 0, "b": 0},
                         [cr("x", 90, 1000, ("a",)), cr("lo", 80, 999, ("b",)),
                          cr("big", 70, 1000, ("b",))])
    assert isinstance(plan, PreemptPlan)
    assert [s.serve for s in plan.steps] == ["x", "big"]


def test_the_exact_search_finds_fewer_victims_than_the_greedy_cover() -> None:
    cands = [cr("s0", 13, 12, ("y",)), cr("s1", 10, 8, ("x",)), cr("s2", 11, 5, ("x", "y")),
             cr("s3", 12, 2, ("x", "y"))]
    plan = plan_on_roles("hi", 1, 8, {"x": 0, "y": 2}, cands)
    assert isinstance(plan, PreemptPlan) and [s.serve for s in plan.steps] == ["s0", "s1"]
    old = preempt.SEARCH_BUDGET
    preempt.SEARCH_BUDGET = 0
    try:
        greedy = plan_on_roles("hi", 1, 8, {"x": 0, "y": 2}, cands)
    finally:
        preempt.SEARCH_BUDGET = old
    assert isinstance(greedy, PreemptPlan) and len(greedy.steps) == 3


def _g(serve: str, frees: int, roles: str) -> Candidate:
    return Candidate(serve, 10, frees, "sleep", 0, tuple(roles))


@pytest.mark.parametrize(("short", "cands", "chosen"), [
    # the candidate that makes up most of what is lacking first, counting on each role at most
    # what that role still lacks
    ({"x": 10, "y": 1, "z": 2},
     [_g("s0", 10, "xz"), _g("s1", 8, "xyz"), _g("s2", 7, "xy"), _g("s3", 11, "xz"),
      _g("s4", 2, "y"), _g("s5", 3, "y")], ["s0", "s1"]),
    ({"x": 1, "y": 8, "z": 2},
     [_g("s0", 2, "z"), _g("s1", 8, "y"), _g("s2", 9, "xy"), _g("s3", 6, "xyz"),
      _g("s4", 4, "xyz")], ["s0", "s2"]),
    # only what it frees on the roles still lacking counts
    ({"x": 3, "y": 15, "z": 8},
     [_g("s0", 7, "yz"), _g("s1", 6, "xz"), _g("s2", 12, "x"), _g("s3", 10, "yz"),
      _g("s4", 6, "xyz"), _g("s5", 2, "xyz")], ["s3", "s4"]),
    ({"x": 3, "y": 1, "z": 14},
     [_g("s0", 8, "y"), _g("s1", 11, "xyz"), _g("s2", 8, "xyz"), _g("s3", 12, "xz"),
      _g("s4", 2, "xy")], ["s1", "s2"]),
    # a victim the others cover without is dropped, also when they cover exactly
    ({"x": 8, "y": 15, "z": 13},
     [_g("s0", 3, "z"), _g("s1", 6, "xyz"), _g("s2", 12, "xz"), _g("s3", 3, "yz"),
      _g("s4", 3, "x"), _g("s5", 6, "xyz")], ["s1", "s3", "s5"]),
])
def test_the_greedy_cover_picks_by_what_is_still_lacking(
        short: dict[str, int], cands: list[Candidate], chosen: list[str]) -> None:
    assert [x.serve for x in preempt._greedy_cover(cands, short)] == chosen


def test_a_plan_that_fits_already_says_so() -> None:
    plan = plan_on_roles("hi", 10, 1000, {"r": 3807}, [])
    assert isinstance(plan, PreemptPlan) and not plan.steps
    assert plan.lines()[0] == ("preempt for hi (priority 10): need 1000 MiB, free 3807 MiB, it "
                               "fits already: nothing to preempt")


def test_a_wake_is_planned_as_a_start_is() -> None:
    """od1 (priority 30, on demand, preempt) fell asleep at 800 MiB; od2 (priority 40) started
    in the room it left. Waking od1 to its 16000 MiB (807 free beside od2, its own 800 counted
    back in: what LedgerService.free_for gives) puts od2 to sleep, as a start of od1 would; a
    serve of higher priority (10) is never touched."""
    free = 807 + 800
    plan = plan_on_roles("od1", 30, 16000, {"r": free},
                         [c("od2", 40, 16000, keeps=800), c("resident", 10, 8000, keeps=500)])
    assert isinstance(plan, PreemptPlan)
    assert [(s.serve, str(s.action)) for s in plan.steps] == [("od2", "sleep")]
    assert plan.free_after_mib == free + 15200 >= 16000
    # the same plan a start of od1 from nothing would be made with, at the same free figure
    assert plan == plan_preemption("od1", 30, 16000, free,
                                   [c("od2", 40, 16000, keeps=800),
                                    c("resident", 10, 8000, keeps=500)])
    # od2 (priority 40) asleep and od1 running: od2's wake cannot take it back
    lost = plan_on_roles("od2", 40, 16000, {"r": free}, [c("od1", 30, 16000, keeps=800)])
    assert isinstance(lost, NoPlan)


def test_a_candidates_action_given_as_text_is_the_member() -> None:
    # the sleep controller passes "sleep" or "stop"; what is kept is the member (its type is
    # what a match on SleepAction and the JSON of a plan see)
    c = Candidate("a", 1, 100, "sleep")  # type: ignore[arg-type]
    assert type(c.action) is preempt.SleepAction and c.action is preempt.SleepAction.SLEEP
