"""The observer's answers from samples: draw split, physical view, unknown process lists."""

from __future__ import annotations

import asyncio

from gpud.core.ledger import Ledger, Reservation, RoleBudget
from gpud.core.observation import DeviceSample, Observation, ProcessDraw
from gpud.observer import Crossings, Observer


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


def test_crossings_fire_once_with_hysteresis() -> None:
    c = Crossings()
    assert c.update({"d": 10}) == (["d"], [])
    assert c.update({"d": 500}) == ([], [])
    assert c.update({"d": -10}) == ([], [])  # within the hysteresis band: still above
    assert c.update({"d": -100}) == ([], ["d"])
    assert c.update({"d": 1}) == (["d"], [])
