"""Rebalance plans from values: the seed's T015 -> T011 change."""

from __future__ import annotations

from gpud.config import parse_config
from gpud.core.ledger import Ledger, Reservation
from gpud.core.plan import make_plan
from gpud.life.service import resolve_budgets
from tests.conftest import example_toml

T011 = example_toml()
# The record's "before": reserve 7168, fast 18432 on the bf16 checkpoint, ocr as it is.
T015_SEED = (T011.replace("reserve_mib = 4608", "reserve_mib = 7168")
             .replace("vram_mib = 14336", "vram_mib = 18432")
             .replace('model = "leon-se/gemma-4-E4B-it-FP8-Dynamic"',
                      'model = "google/gemma-4-E4B-it"'))


def t015_world() -> tuple:  # type: ignore[type-arg]
    old = parse_config(T015_SEED, "t015")
    assert old.serves["fast"].vllm.quantization is None  # type: ignore[union-attr]
    ledger = Ledger.build(resolve_budgets(old, lambda _d: None), [
        Reservation("fast", "dark-fast", 18432, 1.0),
        Reservation("embeddings", "dark-fast", 3200, 2.0),
        Reservation("reranker", "dark-fast", 3456, 3.0),
    ])
    states = {"fast": "running", "embeddings": "running", "reranker": "running", "ocr": "denied"}
    return old, ledger, states


def plan_to(text: str):  # type: ignore[no-untyped-def]
    old, ledger, states = t015_world()
    new = parse_config(text, "new.toml")
    return make_plan(old=old, new=new, ledger=ledger,
                     new_budgets=resolve_budgets(new, lambda _d: None), states=states,
                     totals={"0": 32607}, source="new.toml")


def test_seed_t015_to_t011() -> None:
    plan = plan_to(T011)
    (name, before, after), = plan.roles
    assert name == "dark-fast"
    assert (before.reserve_mib, after.reserve_mib) == (7168, 4608)
    assert (before.committed_mib, after.committed_mib) == (25088, 26112)
    assert (before.free_mib, after.free_mib) == (351, 1887)
    serves = {s.name: s for s in plan.serves}
    fast = serves["fast"]
    assert (fast.mib_before, fast.mib_after) == (18432, 14336)
    assert (fast.util_before, fast.util_after) == ("0.5652", "0.4396")
    assert fast.restart and fast.change == "changed, resized"
    assert fast.fingerprint_before != fast.fingerprint_after  # new checkpoint
    ocr = serves["ocr"]
    assert (ocr.state_before, ocr.state_after) == ("denied", "admitted")
    assert (ocr.mib_before, ocr.mib_after) == (None, 5120)
    assert not ocr.restart
    assert plan.resident_fits and plan.restart == ["fast"]
    assert plan.to_json()["roles"][0]["after"]["free_mib"] == 1887


def test_plan_that_does_not_fit_names_the_shortfall() -> None:
    plan = plan_to(T011.replace("vram_mib = 5120", "vram_mib = 9000"))
    assert not plan.resident_fits
    (denial,) = plan.denied
    assert (denial.serve, denial.need_mib, denial.free_mib, denial.shortfall_mib) == (
        "ocr", 9000, 7007, 1993)
    assert plan.to_json()["denied"][0]["shortfall_mib"] == 1993


def test_unchanged_config_plans_nothing() -> None:
    plan = plan_to(T015_SEED)
    assert plan.restart == []
    assert {s.change for s in plan.serves} == {"unchanged"}
    assert not plan.resident_fits  # T015's ocr still does not fit


def test_resized_reservations_that_over_commit_block_the_plan_by_role() -> None:
    # fast grows from 18432 to 25000 while it runs: 25000 + 3200 + 3456 = 31656 > 25439.
    plan = plan_to(T015_SEED.replace("vram_mib = 18432", "vram_mib = 25000"))
    assert not plan.ok
    [blocker] = plan.blocked
    assert blocker.what == "roles.dark-fast"
    assert blocker.reason == ("the resized reservations commit 31656 MiB, over capacity - "
                              "reserve = 25439 MiB (held: fast 25000 MiB, embeddings 3200 MiB, "
                              "reranker 3456 MiB)")
    assert all(not d.serve.startswith("(") for d in plan.denied)  # no sentinel serve names


ROLES_AB = """
[roles.a]
device = "0"
capacity_mib = 10000
[roles.b]
device = "1"
capacity_mib = 10000
"""


def _serve(name: str, role: str, mib: int, *, resident: bool) -> str:
    return (f'[serves.{name}]\nrole = "{role}"\nvram_mib = {mib}\ncommand = ["/bin/true"]\n'
            f"resident = {'true' if resident else 'false'}\n")


def test_a_serve_only_admitted_keeps_its_admission_unless_it_moves_and_is_not_resident() -> None:
    old = parse_config(ROLES_AB + _serve("lazy", "a", 1000, resident=False)
                       + _serve("res", "a", 2000, resident=True)
                       + _serve("live", "a", 3000, resident=False), "old")
    ledger = Ledger.build(resolve_budgets(old, lambda _d: None), [
        Reservation("lazy", "a", 1000, 1.0), Reservation("res", "a", 2000, 2.0),
        Reservation("live", "a", 3000, 3.0)])
    states = {"lazy": "admitted", "res": "admitted", "live": "running"}

    def plan(text: str):  # type: ignore[no-untyped-def]
        new = parse_config(ROLES_AB + text, "new")
        return make_plan(old=old, new=new, ledger=ledger,
                         new_budgets=resolve_budgets(new, lambda _d: None), states=states,
                         totals={}, source="new")

    same = plan(_serve("lazy", "a", 1000, resident=False) + _serve("res", "a", 2000, resident=True)
                + _serve("live", "a", 3000, resident=False))
    got = {s.name: (s.state_after, s.mib_after, s.resident) for s in same.serves}
    assert got == {"lazy": ("admitted", 1000, False), "res": ("admitted", 2000, True),
                   "live": ("running", 3000, False)}
    moved = plan(_serve("lazy", "b", 1000, resident=False) + _serve("res", "b", 2000, resident=True)
                 + _serve("live", "b", 3000, resident=False))
    got = {s.name: (s.state_after, s.mib_after) for s in moved.serves}
    # lazy's admission is released as it moves; res (resident) and live (running) hold on b
    assert got == {"lazy": ("declared", None), "res": ("admitted", 2000),
                   "live": ("running", 3000)}
    assert {n: r.role for n, r in moved.after.reservations.items()} == {"res": "b", "live": "b"}
    assert moved.release_first == ("lazy", "res") and moved.stop_first == ("live",)


TWO_DEVICES = """
[roles.a]
device = "0"
capacity_mib = 10000
[roles.b]
device = "1"
capacity_mib = 8000
"""
TP = '[serves.tp]\nroles = ["a", "b"]\nvram_mib = 4000\ncommand = ["/bin/true"]\nresident = true\n'
ONE = '[serves.one]\nrole = "b"\nvram_mib = 2000\ncommand = ["/bin/true"]\nresident = true\n'


def test_a_serve_on_several_roles_is_sized_on_its_smallest_device() -> None:
    old = parse_config(TWO_DEVICES + TP + ONE, "old")
    budgets = resolve_budgets(old, lambda _d: None)
    ledger = Ledger.build(budgets, [Reservation("tp", "a", 4000, 1.0, extra_roles=("b",)),
                                    Reservation("one", "b", 2000, 2.0)])
    states = {"tp": "running", "one": "running"}

    def utils(totals: dict[str, int | None], new_text: str) -> dict[str, tuple[str | None, ...]]:
        new = parse_config(new_text, "new")
        plan = make_plan(old=old, new=new, ledger=ledger, states=states, totals=totals,
                         new_budgets=resolve_budgets(new, lambda _d: None), source="new")
        return {s.name: (s.util_before, s.util_after) for s in plan.serves}

    # against the devices' totals (b's, 16000 MiB, is the smaller), else the roles' capacities
    assert utils({"0": 20000, "1": 16000}, TWO_DEVICES + TP + ONE) == {
        "tp": ("0.2500", "0.2500"), "one": ("0.1250", "0.1250")}
    assert utils({}, TWO_DEVICES + TP + ONE) == {"tp": ("0.5000", "0.5000"),
                                                 "one": ("0.2500", "0.2500")}
    assert utils({"0": 12000}, TWO_DEVICES + TP + ONE)["tp"] == ("0.5000", "0.5000")
    # removed: no figure after
    assert utils({"0": 20000, "1": 16000}, TWO_DEVICES + ONE)["tp"] == ("0.2500", None)


def test_a_plan_that_is_refused_has_no_steps() -> None:
    old = parse_config(TWO_DEVICES + ONE, "old")
    ledger = Ledger.build(resolve_budgets(old, lambda _d: None),
                          [Reservation("one", "b", 2000, 1.0)])
    two = ONE.replace("serves.one", "serves.two")
    for text, ok in ((ONE.replace("2000", "3000"), True),
                     (ONE.replace("2000", "9000") + two, False)):  # the resident set does not fit
        new = parse_config(TWO_DEVICES.replace("8000", "10000") + text, "new")
        plan = make_plan(old=old, new=new, ledger=ledger, states={"one": "running"}, totals={},
                         new_budgets=resolve_budgets(new, lambda _d: None), source="new")
        doc = plan.to_json()
        assert plan.ok is ok and bool(doc["steps"]) is ok


def test_the_plan_says_what_the_boot_starts_together_and_what_alone() -> None:
    """The seed's resident set with fast and embeddings sized in bytes."""
    from gpud.ctl.format import format_plan

    text = (T011.replace("max_model_len = 32768", "max_model_len = 32768\nkv_cache_mib = 2048")
            .replace('model = "BAAI/bge-m3"', 'model = "BAAI/bge-m3"\nkv_cache_mib = 512'))
    plan = plan_to(text)
    steps = [(b.device, b.serves, b.together) for b in plan.boot]
    # fast and embeddings (exactly sized) together; reranker (profiles) alone; ocr (a command
    # serve: its sizing unknown) alone
    assert steps == [("0", ("fast", "embeddings"), True), ("0", ("reranker",), False),
                     ("0", ("ocr",), False)]
    out = format_plan(plan.to_json())
    assert "boot on 0: fast, embeddings together: exactly sized (--kv-cache-memory-bytes): no " \
        "profiling" in out
    assert "boot on 0: reranker alone: starts alone: its KV cache is sized by profiling" in out
    assert "boot on 0: ocr alone: starts alone: not a vllm serve" in out
