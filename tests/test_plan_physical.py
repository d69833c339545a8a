"""A plan checks every bound its apply will: the ledger's, and under strict admission what the
device physically has free (DESIGN.md, "The arithmetic"), at each admission the apply makes, in
its order. The property: on a simulated device, the plan's verdict is what the apply's own
admissions decide, step by step, through `Ledger.decide` with the service's physical view."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from gpud.config import Config, parse_config
from gpud.core.actions import actions
from gpud.core.budgets import resolve_budgets
from gpud.core.ledger import (
    Denial,
    Ledger,
    PhysicalView,
    Reservation,
    device_draw,
    pending_share,
)
from gpud.core.plan import RebalancePlan, device_rooms, make_plan
from gpud.core.vocab import ADMITTED, DECLARED, RUNNING, STARTING, ServeState, StepKind
from gpud.ctl.format import format_plan

TOTAL = 8192
DEVICE = "0"


def role(reserve: int) -> str:
    return f'[roles.r]\ndevice = "{DEVICE}"\nreserve_mib = {reserve}\n'


def serve(name: str, mib: int, *, resident: bool, priority: int) -> str:
    return (f'[serves.{name}]\nrole = "r"\nvram_mib = {mib}\ncommand = ["/bin/true"]\n'
            f"resident = {'true' if resident else 'false'}\npriority = {priority}\n")


@dataclass
class World:
    """The device and the serves on it now: reservations, states, what each draws, and the
    draw nobody declared (the simulation's external draw)."""

    ledger: Ledger
    states: dict[str, ServeState]
    draws: dict[str, int]
    external: int

    def draw(self) -> object:
        used = self.external + sum(self.draws.values())
        return device_draw(total_mib=TOTAL, used_mib=used, free_mib=TOTAL - used,
                           draws=self.draws, reservations=list(self.ledger.reservations.values()),
                           states=self.states,
                           reserve_mib=sum(b.reserve_mib for b in self.ledger.roles.values()))

    def view(self, name: str) -> PhysicalView:
        """gpud.host.observer.Observer.physical_view, on this world."""
        d = self.draw()
        own = self.draws.get(name, 0)
        return PhysicalView(d.physical_free_mib, d.pending_mib, own,  # type: ignore[attr-defined]
                            pending_share(self.ledger.reservations.get(name),
                                          self.states.get(name), own))


def plan_of(old: Config, new: Config, world: World, *, physical: bool = True) -> RebalancePlan:
    rooms = (device_rooms({DEVICE: world.draw()}, world.ledger, world.states,  # type: ignore[dict-item]
                          lambda d: d) if physical else None)
    return make_plan(old=old, new=new, ledger=world.ledger,
                     new_budgets=resolve_budgets(new, lambda _d: TOTAL), states=world.states,
                     totals={DEVICE: TOTAL}, source="new.toml", rooms=rooms,
                     device_key=lambda d: d)


def apply_admissions(plan: RebalancePlan, new: Config, world: World) -> Denial | None:
    """The apply of `plan` carried out on the world (gpud.life.rebalance._do): each admission
    decided by `Ledger.decide` with strict admission's physical view of the world as it is at
    that step. A serve that starts draws its reservation (vLLM fills its utilization). The first
    refusal, or None."""
    ledger, states, draws = world.ledger, dict(world.states), dict(world.draws)
    w = World(ledger, states, draws, world.external)

    def admit(name: str, mib: int) -> Denial | None:
        out = w.ledger.decide(name, new.serves[name].all_roles, mib, since=9.0, by_uid=None,
                              physical={r: w.view(name) for r in new.serves[name].all_roles},
                              check="strict")
        if isinstance(out, Denial):
            return out
        w.ledger = out[0]
        return None

    for step in actions(plan):
        name = step.serve
        if step.kind == StepKind.RELOAD:
            budgets = resolve_budgets(new, lambda _d: TOTAL)
            w.ledger = Ledger({b.name: b for b in budgets}, w.ledger.reservations)
        if name is None:
            continue
        if step.kind in (StepKind.STOP, StepKind.RELEASE):
            w.ledger = w.ledger.release(name)[0]
            draws.pop(name, None)
            states[name] = DECLARED
        elif step.kind in (StepKind.RESTART, StepKind.RESIZE):
            if step.kind == StepKind.RESTART:
                draws.pop(name, None)  # stopped, its reservation kept
                states[name] = ADMITTED
            assert step.mib_after is not None
            denied = admit(name, step.mib_after)
            if denied is not None:
                return denied
            if step.kind == StepKind.RESTART:
                draws[name], states[name] = step.mib_after, RUNNING
        elif step.kind == StepKind.START:
            if name not in w.ledger.reservations:
                denied = admit(name, new.serves[name].vram_mib)
                if denied is not None:
                    return denied
            draws[name], states[name] = w.ledger.reservations[name].mib, RUNNING
    return None


# ---- the case --------------------------------------------------------------------------


def test_a_serve_the_device_has_no_room_for_is_denied_by_the_plan_on_the_physical_bound() -> None:
    """Ledger free 3072 MiB, but the display draws 3430 MiB against a reserve of 1024: the
    device has 666 MiB free. Adding a 1024 MiB serve fits the ledger and not the device."""
    old = parse_config(role(1024) + serve("a", 4096, resident=True, priority=10), "old")
    world = World(Ledger.build(resolve_budgets(old, lambda _d: TOTAL),
                               [Reservation("a", "r", 4096, 1.0)]),
                  {"a": RUNNING}, {"a": 4096}, external=TOTAL - 4096 - 666)
    new = parse_config(role(1024) + serve("a", 4096, resident=True, priority=10)
                       + serve("new", 1024, resident=True, priority=20), "new.toml")
    assert plan_of(old, new, world, physical=False).resident_fits  # the ledger alone: fits
    plan = plan_of(old, new, world)
    assert not plan.ok
    assert plan.denied == [Denial("new", "r", "physical", 1024, 666)]
    assert apply_admissions(plan_of(old, new, world, physical=False), new, world) == \
        plan.denied[0]
    text = format_plan(plan.to_json())  # type: ignore[arg-type]
    assert ("resident set: DOES NOT FIT: new on r: physical bound (strict admission: what the "
            "device has free, less what admitted serves will draw): need 1024 MiB, free 666 MiB, "
            "short 358 MiB") in text
    assert "resident set: fits" not in text
    # the serve's line says it is denied, and why
    (line,) = [s for s in plan.serves if s.name == "new"]
    assert line.state_after == "denied" and line.reason is not None and "physical" in line.reason


def test_in_ledger_admission_the_plan_checks_the_ledger_bound_alone() -> None:
    old = parse_config(role(1024) + serve("a", 4096, resident=True, priority=10), "old")
    world = World(Ledger.build(resolve_budgets(old, lambda _d: TOTAL),
                               [Reservation("a", "r", 4096, 1.0)]),
                  {"a": RUNNING}, {"a": 4096}, external=TOTAL - 4096 - 666)
    new = parse_config('[daemon]\nadmission = "ledger"\n' + role(1024)
                       + serve("a", 4096, resident=True, priority=10)
                       + serve("new", 1024, resident=True, priority=20), "new.toml")
    assert plan_of(old, new, world).ok


# ---- the property ------------------------------------------------------------------------------

MIB = st.integers(1, 12).map(lambda n: n * 256)


@st.composite
def worlds(draw: st.DrawFn) -> tuple[Config, Config, World]:
    reserve = draw(st.integers(0, 6).map(lambda n: n * 256))
    n_old = draw(st.integers(0, 4))
    new_reserve = draw(st.integers(0, 6).map(lambda n: n * 256))
    old_text, new_text = role(reserve), role(new_reserve)
    held: list[Reservation] = []
    states: dict[str, ServeState] = {}
    draws: dict[str, int] = {}
    for i in range(n_old):
        name = f"s{i}"
        mib = draw(MIB)
        resident = draw(st.booleans())
        old_text += serve(name, mib, resident=resident, priority=draw(st.integers(0, 50)))
        state = draw(st.sampled_from([RUNNING, STARTING, ADMITTED, DECLARED]))
        if state != DECLARED:
            held.append(Reservation(name, "r", mib, float(i)))
            draws[name] = {RUNNING: draw(st.integers(mib // 2, mib)),
                           STARTING: draw(st.integers(0, mib)), ADMITTED: 0}[state]
        states[name] = state
        what = draw(st.sampled_from(["keep", "resize", "remove"]))
        if what != "remove":
            new_mib = draw(MIB) if what == "resize" else mib
            new_text += serve(name, new_mib, resident=draw(st.booleans()),
                              priority=draw(st.integers(0, 50)))
    for j in range(draw(st.integers(0, 3))):
        new_text += serve(f"n{j}", draw(MIB), resident=True, priority=draw(st.integers(0, 50)))
    # the draw nobody declared, about the reserve: below it the ledger bound is the tighter,
    # above it what the device has free
    external = max(0, new_reserve + draw(st.integers(-4, 12)) * 256)
    assume(external + sum(draws.values()) <= TOTAL)
    old = parse_config(old_text, "old")
    ledger = Ledger.build(resolve_budgets(old, lambda _d: TOTAL), held)
    assume(not ledger.over_committed())
    return old, parse_config(new_text, "new.toml"), World(ledger, states, draws, external)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(worlds())
def test_the_plans_verdict_is_what_the_applys_admissions_decide(
        case: tuple[Config, Config, World]) -> None:
    old, new, world = case
    ledger_only = plan_of(old, new, world, physical=False)
    plan = plan_of(old, new, world)
    assume(not ledger_only.blocked)
    if not ledger_only.resident_fits:
        event("ledger bound refuses")
        # refused at validation, nothing done: the plan says the same, for the same reason
        assert plan.denied == ledger_only.denied
        return
    refused = apply_admissions(ledger_only, new, world)
    event(f"apply: {refused.bound + ' bound refuses' if refused else 'applied'}")
    if refused is None:
        assert plan.ok, plan.denied
    else:
        assert not plan.ok and plan.denied == [refused]
