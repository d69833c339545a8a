"""The preemption planner (gpud/core/preempt.py): table cases and properties against a brute
force over every subset."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpud.core.preempt import Candidate, NoPlan, Plan, plan_preemption


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
    assert isinstance(plan, Plan)
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
    assert isinstance(plan, Plan)
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
