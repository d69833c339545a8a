"""The observer's answers from samples: draw split, physical view, unknown process lists."""

from __future__ import annotations

import asyncio

from gpud.core.ledger import Ledger, Reservation, RoleBudget
from gpud.core.observation import DeviceSample, Observation, ProcessDraw
from gpud.host.observer import Crossings, Observer


class FakeBackend:
    name = "nvml"

    def __init__(self, devices: tuple[DeviceSample, ...]) -> None:
        self.devices = devices

    def sample(self) -> Observation:
        return Observation("nvml", True, None, self.devices, 0.0)

    def close(self) -> None:
        pass


LEDGER = Ledger.build([RoleBudget("r", "GPU-a", 32607, 4608)], [Reservation("x", "r", 14336, 0)])


def observe(dev: DeviceSample) -> Observer:
    obs = Observer(FakeBackend((dev,)))  # type: ignore[arg-type]
    asyncio.run(obs.sample())
    return obs


def test_split_and_physical_view() -> None:
    dev = DeviceSample("GPU-a", 0, "00000000:01:00.0", "H", 32607, 20000, 12607,
                       (ProcessDraw(1, 14000), ProcessDraw(2, None)))
    obs = observe(dev)
    obs.owners = {1: "x"}
    obs.draws = {"GPU-a": {"x": 14000}}
    draw = obs.draw_for("GPU-a", LEDGER, {"x": "starting"})
    assert draw is not None
    assert (draw.managed_draw_mib, draw.non_ledger_draw_mib, draw.pending_mib) == (14000, 6000, 336)
    view = obs.physical_view("0", "x", LEDGER, {"x": "starting"})
    assert view is not None and view.free_for_serve() == 12607 - 0 + 14000


def test_unknown_process_list_gives_no_split() -> None:
    dev = DeviceSample("GPU-a", 0, "00000000:01:00.0", "H", 32607, 20000, 12607, None)
    obs = observe(dev)
    assert obs.device_total("GPU-a") == 32607
    assert obs.draw_for("GPU-a", LEDGER, {}) is None
    assert obs.physical_view("GPU-a", "x", LEDGER, {}) is None


# The seed's host: a Windows desktop's GPU under WSL2 (WDDM). 20000 MiB used: the display's
# 5837 and the running serve x's ~14000; NVML says nothing of who holds what.
WDDM_USED = 20000


def test_wddm_processes_without_figures_are_attributed_by_reservation() -> None:
    dev = DeviceSample("GPU-a", 0, "00000000:01:00.0", "H", 32607, WDDM_USED, 12607,
                       (ProcessDraw(1, None), ProcessDraw(2, None)))
    obs = observe(dev)
    draw = obs.draw_for("GPU-a", LEDGER, {"x": "running"})
    assert draw is not None and draw.estimated
    # x counted at its reservation: non-ledger 5664 (the display's 5837 less what x draws
    # under its reservation), not the whole 20000 as a false excess over the 4608 reserve
    assert (draw.managed_draw_mib, draw.non_ledger_draw_mib) == (14336, 20000 - 14336)
    assert draw.by_serve == {"x": 14336} and draw.pending_mib == 0
    # strict admission keeps the device's real free memory
    assert draw.effective_free(10**6) == 12607


def test_wsl2_lists_no_process_while_a_serve_runs() -> None:
    dev = DeviceSample("GPU-a", 0, "00000000:01:00.0", "H", 32607, WDDM_USED, 12607, ())
    obs = observe(dev)
    draw = obs.draw_for("GPU-a", LEDGER, {"x": "running"})
    assert draw is not None and draw.estimated and draw.managed_draw_mib == 14336
    # nothing runs: an empty list is just that, not an estimate
    idle = obs.draw_for("GPU-a", LEDGER, {"x": "admitted"})
    assert idle is not None and not idle.estimated
    assert (idle.managed_draw_mib, idle.pending_mib) == (0, 14336)
    # a starting serve is pending, as where figures exist
    starting = obs.draw_for("GPU-a", LEDGER, {"x": "starting"})
    assert starting is not None and starting.pending_mib == 14336


def test_an_estimate_never_attributes_more_than_is_used() -> None:
    dev = DeviceSample("GPU-a", 0, "00000000:01:00.0", "H", 32607, 9000, 23607,
                       (ProcessDraw(1, None),))
    draw = observe(dev).draw_for("GPU-a", LEDGER, {"x": "running"})
    assert draw is not None and (draw.managed_draw_mib, draw.non_ledger_draw_mib) == (9000, 0)


def test_figures_reported_are_no_estimate() -> None:
    dev = DeviceSample("GPU-a", 0, "00000000:01:00.0", "H", 32607, WDDM_USED, 12607,
                       (ProcessDraw(1, None), ProcessDraw(2, 5837)))
    draw = observe(dev).draw_for("GPU-a", LEDGER, {"x": "running"})
    assert draw is not None and not draw.estimated and draw.managed_draw_mib == 0


def test_crossings_fire_once_with_hysteresis() -> None:
    c = Crossings()
    assert c.update({"d": 10}) == (["d"], [])
    assert c.update({"d": 500}) == ([], [])
    assert c.update({"d": -10}) == ([], [])  # within the hysteresis band: still above
    assert c.update({"d": -100}) == ([], ["d"])
    assert c.update({"d": 1}) == (["d"], [])
