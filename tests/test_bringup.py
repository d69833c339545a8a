"""On-demand bring-ups bounded: the pure policy (gpud.core.bringup) and OnDemand's ensure with
a supervisor stand-in that counts its starts (the sandbox test in tests/integration/test_front.py
does the same against real systemd)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import pytest

from gpud.core import bringup
from gpud.core.bringup import Policy, Tries, Why
from gpud.core.lifecycle import IDLE_LIFE, ServeLife
from gpud.core.serverecord import Stored
from gpud.core.vocab import FAILED, RUNNING, ServeState
from gpud.errors import Denied, Unavailable
from gpud.life.records import ServeRecords
from gpud.life.writes import COALESCE_REFUSALS
from gpud.server.ondemand import OnDemand

# ---- the policy -----------------------------------------------------------------------------


def test_the_backoff_doubles_to_its_cap() -> None:
    p = Policy(refusal_hold_s=5, first_s=10, max_s=300)
    assert [p.backoff_s(n) for n in range(1, 8)] == [10, 20, 40, 80, 160, 300, 300]
    assert p.backoff_s(10_000) == 300  # no overflow however long the run


def test_a_failure_holds_requests_for_the_backoff_left() -> None:
    p = Policy(refusal_hold_s=5, first_s=10, max_s=300)
    t = bringup.failed(None, 100.0, "crash-loop", p)
    hold = bringup.held(t, 100.0)
    assert hold is not None and (hold.why, hold.retry_after_s, hold.failures) == (
        Why.FAILED, 10, 1)
    assert bringup.held(t, 107.2).retry_after_s == 3  # type: ignore[union-attr]  # rounded up
    assert bringup.held(t, 110.0) is None
    t = bringup.failed(t, 110.0, "crash-loop", p)
    assert bringup.held(t, 110.0).retry_after_s == 20  # type: ignore[union-attr]


def test_a_refusal_holds_briefly_and_keeps_the_failures_in_a_row() -> None:
    p = Policy(refusal_hold_s=5, first_s=10, max_s=300)
    t = bringup.refused(Tries(failures=2), 0.0, Why.NO_MEMORY, "need 16000 MiB", p)
    assert t.failures == 2
    assert bringup.held(t, 1.0).retry_after_s == 4  # type: ignore[union-attr]
    assert bringup.held(t, 5.0) is None


@pytest.mark.parametrize(("code", "details", "why"), [
    ("denied", {"bound": "ledger"}, Why.NO_MEMORY),
    ("denied", {"bound": "physical"}, Why.NO_MEMORY),
    ("denied", {"bound": "device"}, Why.UNAVAILABLE),
    ("denied", {"bound": "held"}, Why.UNAVAILABLE),
    ("unavailable", {"state": "failed"}, Why.FAILED),
    ("unavailable", {"state": "starting"}, Why.STARTING),
    ("unavailable", {}, Why.UNAVAILABLE),
    ("conflict", {}, Why.REFUSED),
])
def test_errors_are_classified(code: str, details: dict[str, Any], why: Why) -> None:
    assert bringup.classify(code, details) == why


def test_the_public_reason_has_the_class_only() -> None:
    assert bringup.public_reason("od1", Why.NO_MEMORY, 5) == \
        "serve od1: not enough GPU memory; retry after 5 s"


# ---- ensure, with a supervisor that counts -----------------------------------------------


@dataclass
class Clock:
    t: float = 1000.0

    def __call__(self) -> float:
        return self.t


@dataclass
class FakeService:
    """What OnDemand reads of the service: the spec, the state and its record."""

    clock: Clock
    states: dict[str, ServeState] = field(default_factory=dict)
    records: ServeRecords = field(default_factory=ServeRecords)
    ready: bool = True
    # no [router]: no queue (a refusal is answered at once)
    config: Any = field(default_factory=lambda: SimpleNamespace(router=None, serves={}))
    # its role r (gpud.core.ledger.RoleBudget's figures): room for its 16000 MiB
    ledger: Any = field(default_factory=lambda: SimpleNamespace(
        roles={"r": SimpleNamespace(capacity_mib=32000, reserve_mib=2000)}))

    def serve_spec(self, name: str) -> Any:
        return SimpleNamespace(on_demand=True, preempt=False, start_timeout_s=30.0,
                               vram_mib=16000, all_roles=("r",))

    def state_of(self, name: str) -> ServeState:
        return self.states.get(name, ServeState.DECLARED)

    def set(self, name: str, state: ServeState, reason: str | None = None) -> None:
        self.states[name] = state
        self.records.apply(name, Stored(state, reason, self.clock()))


class BringUps:
    """What OnDemand keeps on the supervisor: each serve's bring-up while it runs (the real
    supervisor's Handles.bringup)."""

    def __init__(self) -> None:
        self.bringups: dict[str, asyncio.Task[None]] = {}
        # OnDemand asks the supervisor's parts (its runtime, its start, its stop): here, one object.
        self.runtime = self.launch_job = self.stop_job = self

    def bringup(self, serve: str) -> asyncio.Task[None] | None:
        return self.bringups.get(serve)

    def hold_bringup(self, serve: str, task: asyncio.Task[None]) -> None:
        self.bringups[serve] = task

        def ended(done: asyncio.Task[None]) -> None:
            if self.bringups.get(serve) is done:
                del self.bringups[serve]

        task.add_done_callback(ended)


class CrashLooping(BringUps):
    """A supervisor whose every start of a serve ends with it failed: crash-loop (after its
    unit held the device's start lock), or, with `denied`, is refused for want of memory."""

    def __init__(self, svc: FakeService, *, denied: bool = False) -> None:
        super().__init__()
        self.svc = svc
        self.denied = denied
        self.starts: list[str] = []
        self.coalesced: list[bool] = []

    async def start(self, serve: str, uid: int | None, *, wait: bool = False,
                    preempt: bool = False) -> None:
        self.starts.append(serve)
        self.coalesced.append(COALESCE_REFUSALS.get())
        if self.denied:
            raise Denied(f"{serve} denied on r: need 16000 MiB, free 807 MiB; lo holds 9000",
                         {"serve": serve, "bound": "ledger", "need_mib": 16000, "free_mib": 807})
        self.svc.set(serve, FAILED, "crash-loop: 5 restarts in 60 s")

    def life(self, serve: str) -> ServeLife:
        """No sleep or stop of gpud's under way (what OnDemand.up waits out first)."""
        return IDLE_LIFE


def on_demand(*, denied: bool = False) -> tuple[OnDemand, CrashLooping, FakeService, Clock]:
    clock = Clock()
    svc = FakeService(clock)
    sup = CrashLooping(svc, denied=denied)
    od = OnDemand(cast(Any, svc), cast(Any, sup), clock=clock,
                  policy=Policy(refusal_hold_s=5, first_s=10, max_s=300))
    return od, sup, svc, clock


async def test_a_crash_looping_serve_is_not_restarted_per_request() -> None:
    od, sup, _svc, clock = on_demand()
    answers = []
    for _ in range(200):  # four clients hammering it for 30 s, as it was found
        answers.append(await od.ensure("od"))
        clock.t += 0.15
    assert sup.starts == ["od", "od"], sup.starts  # at 0 s and after the 10 s backoff, no more
    assert sup.coalesced == [True, True]  # its refusals stored coalesced
    assert {a.status for a in answers} == {403}
    # held: Retry-After the time left, counting down
    first_held = answers[1]
    assert first_held.headers["Retry-After"] == "10"
    assert json.loads(first_held.headers["X-Gpud-Reason"])["error"]["details"]["class"] == "failed"
    assert answers[-1].headers["Retry-After"] == str(10 + 20 - 30 + 1)  # 2nd backoff, 20 s


async def test_an_operators_start_resets_the_backoff() -> None:
    od, sup, svc, clock = on_demand()
    await od.ensure("od")
    clock.t += 1
    assert (await od.ensure("od")).status == 403 and sup.starts == ["od"]
    od.operator_started("od")
    svc.set("od", RUNNING)
    clock.t += 1
    assert (await od.ensure("od")).status == 204
    # it fails again later (a crash-loop once up): the backoff starts over at its first step
    clock.t += 100
    svc.set("od", FAILED, "crash-loop")
    reply = await od.ensure("od")
    assert reply.status == 403 and reply.headers["Retry-After"] == "10", reply.headers
    assert sup.starts == ["od"]


async def test_a_failure_long_ago_holds_nothing() -> None:
    od, sup, svc, clock = on_demand()
    svc.set("od", FAILED, "exited")  # found failed, failed an hour ago
    svc.records.apply("od", Stored(FAILED, "exited", clock() - 3600))
    await od.ensure("od")
    assert sup.starts == ["od"]


async def test_a_refused_serve_is_tried_again_after_the_hold_and_says_only_the_class() -> None:
    od, sup, _svc, clock = on_demand(denied=True)
    first = await od.ensure("od")
    clock.t += 1
    second = await od.ensure("od")
    assert sup.starts == ["od"]
    for reply in (first, second):
        header = reply.headers["X-Gpud-Reason"]
        said = json.loads(header)["error"]
        assert said["code"] == "denied" and said["details"]["class"] == "no-memory"
        # nothing of the ledger, of other serves or of a plan
        for secret in ("16000", "807", "lo ", "MiB"):
            assert secret not in header, header
        # the whole reason is the body's (the front's and root's)
        assert "need 16000 MiB" in reply.text or "not tried again" in reply.text
    assert first.headers["Retry-After"] == "5" and second.headers["Retry-After"] == "4"
    clock.t += 4
    await od.ensure("od")
    assert sup.starts == ["od", "od"]


async def test_a_serve_that_can_never_fit_says_so_not_retry_after() -> None:
    """16000 MiB on a role that holds 10000 MiB with nothing else on it: no wait makes room,
    and no request is told to retry, the first or those held after it."""
    od, sup, svc, clock = on_demand(denied=True)
    svc.ledger.roles["r"] = SimpleNamespace(capacity_mib=12000, reserve_mib=2000)
    first = await od.ensure("od")
    clock.t += 1
    held = await od.ensure("od")
    assert sup.starts == ["od"]
    for reply in (first, held):
        said = json.loads(reply.headers["X-Gpud-Reason"])["error"]
        assert said["message"] == f"serve od: {bringup.NEVER_FITS}"
        assert "retry after" not in said["message"] and "16000" not in said["message"]
        # the operator's error (the body, the journal): the figures
        body = json.loads(reply.text)["error"]
        assert body["message"].endswith(
            "; can never fit as configured: it needs 16000 MiB and role 'r' holds at most "
            "10000 MiB with nothing else on it (capacity less reserve): lower its vram_mib, or "
            "the role's reserve_mib"), body
        assert body["details"]["never_fits"] is True


def test_never_fits_only_past_what_a_role_holds_with_nothing_else_on_it() -> None:
    assert bringup.never_fits(16000, {"r": 10000}) is not None
    assert bringup.never_fits(10000, {"r": 10000}) is None
    assert bringup.never_fits(16000, {"a": 20000, "b": 12000}) == (
        "it needs 16000 MiB and role 'b' holds at most 12000 MiB with nothing else on it "
        "(capacity less reserve): lower its vram_mib, or the role's reserve_mib")
    assert bringup.never_fits(16000, {}) is None


async def test_a_running_serve_is_never_held() -> None:
    od, _sup, svc, _clock = on_demand()
    await od.ensure("od")
    svc.set("od", RUNNING)  # an operator started it, or it came up another way
    assert (await od.ensure("od")).status == 204


def test_unavailable_details_name_the_hold() -> None:
    # the class a held request carries overrides what the code would say
    exc = Unavailable("x", {"class": "failed"})
    assert Why(exc.details["class"]) == Why.FAILED


async def test_the_refusals_journal_lines_are_one_per_window_with_the_count(
        caplog: pytest.LogCaptureFixture) -> None:
    od, _sup, _svc, clock = on_demand()
    with caplog.at_level("WARNING", "gpud.ondemand"):
        for _ in range(300):
            await od.ensure("od")
            clock.t += 0.1
        clock.t += 60
        od._flush_refusal_log(clock())
    lines = [r for r in caplog.records if "not brought up" in r.getMessage()]
    # the first of each class, then one line standing for the rest of its window, its count
    # in the message and in journald's GPUD_REPEATED
    assert len(lines) <= 4, [r.getMessage() for r in lines]
    counted = [getattr(r, "journal", {}).get("GPUD_REPEATED", 0) for r in lines]
    assert len(lines) + sum(counted) - sum(1 for c in counted if c) == 300, counted


def test_a_serve_that_comes_up_and_dies_goes_on_doubling_until_it_stays_up() -> None:
    p = Policy(refusal_hold_s=5, first_s=10, max_s=300, stable_s=60)
    t = bringup.failed(None, 0.0, "exited", p)
    t = bringup.came_up(t, 10.0)  # up again after its backoff: no hold
    assert t is not None and bringup.held(t, 10.0) is None
    t = bringup.failed(t, 11.0, "exited", p)  # dead a second later: the second in a row
    assert (t.failures, t.not_before) == (2, 31.0)
    t = bringup.came_up(t, 31.0)
    t = bringup.failed(t, 31.0 + 60, "exited", p)  # up a minute: a first failure again
    assert (t.failures, t.not_before) == (1, 101.0)
    assert bringup.came_up(None, 5.0) is None


async def test_a_failure_written_twice_is_counted_once() -> None:
    """A crash-loop writes the failed state, then its release writes it again: one failure."""
    od, sup, svc, clock = on_demand()
    await od.ensure("od")  # started, failed: the first failure, 10 s
    clock.t += 0.5
    svc.set("od", FAILED, "crash-loop: 4 restarts; reservation released")
    reply = await od.ensure("od")
    assert reply.headers["Retry-After"] == "10", reply.headers  # 9.5 s left, rounded up
    assert od.tries["od"].failures == 1
    assert sup.starts == ["od"]


@pytest.mark.parametrize(("code", "details", "why"), [
    ("unavailable", {"class": "queue-full"}, Why.QUEUE_FULL),
    ("unavailable", {"class": "gpud-stopping"}, Why.GPUD_STOPPING),
    ("denied", {"bound": "ledger"}, Why.NO_MEMORY),
    ("unavailable", {"state": "failed"}, Why.FAILED),
    ("unavailable", {"timeout": True}, Why.STARTING),
])
def test_a_refusals_class_is_the_one_it_names_else_its_code_and_details(
        code: str, details: dict[str, object], why: Why) -> None:
    from gpud.core.bringup import refusal_class
    assert refusal_class(code, details) == why
