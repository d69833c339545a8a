"""Expensive requests (parsing and planning configs) run off the event loop, and a peer may have
at most gpud.life.offload.PER_PEER of them under way: one more is answered 429 at once."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.fig_flood import flood_config
from gpud.errors import TooManyRequests
from gpud.life.offload import PER_PEER, Offload
from tests.conftest import GpudProcess, UnixHTTPConnection, call, start_gpud

# About 0.9 MiB of JSON: the better part of a second to parse and plan
BIG = json.dumps({"config": flood_config(11_000), "source": "big"}).encode()


@pytest.fixture(scope="module")
def gpud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GpudProcess]:
    gp = start_gpud(tmp_path_factory.mktemp("offload"), flood_config(16))
    # the first plan starts the worker processes: not part of what is measured below
    assert call(gp.socket, "POST", "/v1/plan", raw=BIG).status == 200
    yield gp
    gp.stop()


def _post_plan(sock: Path, answers: list[tuple[int, dict[str, object]]]) -> None:
    reply = call(sock, "POST", "/v1/plan", raw=BIG)
    answers.append((reply.status, reply.body))


def test_a_peer_past_its_limit_is_answered_429(gpud: GpudProcess) -> None:
    answers: list[tuple[int, dict[str, object]]] = []
    threads = [threading.Thread(target=_post_plan, args=(gpud.socket, answers))
               for _ in range(PER_PEER + 6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = sorted(s for s, _ in answers)
    assert set(statuses) == {200, 429}, statuses
    assert statuses.count(200) >= PER_PEER
    refused = next(body for s, body in answers if s == 429)
    error = refused["error"]
    assert isinstance(error, dict) and error["code"] == "too-many-requests"
    assert error["details"] == {"uid": 0, "limit": PER_PEER, "request": "plan", "retry": True}
    # and the slots are given back: a plan alone is answered again
    assert call(gpud.socket, "POST", "/v1/plan", raw=BIG).status == 200


def test_status_answers_while_a_plan_is_being_made(gpud: GpudProcess) -> None:
    """On the event loop, a plan held every other request until it was done: a GET /v1/status
    sent meanwhile waited most of the plan's time. Off the loop, none waits a quarter of it."""
    conn = UnixHTTPConnection(str(gpud.socket), timeout=120)
    plan_done = threading.Event()
    waits: list[float] = []
    try:
        started = time.monotonic()
        conn.request("POST", "/v1/plan", body=BIG, headers={"Content-Type": "application/json"})

        def answer() -> None:
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200
            plan_done.set()

        waiter = threading.Thread(target=answer)
        waiter.start()
        while not plan_done.is_set():
            t = time.monotonic()
            assert call(gpud.socket, "GET", "/v1/status").status == 200
            waits.append(time.monotonic() - t)
        waiter.join()
        plan_s = time.monotonic() - started
    finally:
        conn.close()
    assert len(waits) >= 5, waits
    assert max(waits) < plan_s / 4, (max(waits), plan_s)


def test_slots_are_per_peer_and_given_back() -> None:
    async def scenario() -> None:
        offload = Offload(per_peer=2)
        async with offload.slot(1000, "plan"), offload.slot(1000, "plan"):
            with pytest.raises(TooManyRequests):
                async with offload.slot(1000, "plan"):
                    pass
            async with offload.slot(1001, "plan"):  # another peer has its own
                assert offload.under_way == {1000: 2, 1001: 1}
        assert offload.under_way == {}
        with pytest.raises(ValueError):  # an error gives the slot back too
            async with offload.slot(1000, "apply"):
                raise ValueError("boom")
        assert offload.under_way == {}
        assert await offload.run(sum, [1, 2]) == 3
        offload.close()

    asyncio.run(scenario())


def test_a_plans_refusal_comes_back_from_the_worker_whole(gpud: GpudProcess) -> None:
    reply = gpud.call("POST", "/v1/plan", {"config": "[serves.x]\nrole = 1\n", "source": "s"})
    assert reply.status == 400
    assert reply.body["error"]["code"] == "config-invalid"
    assert reply.body["error"]["details"]["source"] == "s"
    assert "serves.x.role: must be a string" in reply.body["error"]["details"]["problems"]


def test_the_plan_worker_imports_no_daemon_part() -> None:
    # The worker process imports gpud.life.planning alone: the config, the pure core, nothing that
    # opens the store, talks to systemd or runs the service.
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", "import sys, gpud.life.planning; "
         "print(' '.join(sorted(m for m in sys.modules if m.startswith('gpud'))))"],
        capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[1])
    loaded = set(out.stdout.split())
    assert "gpud.life.planning" in loaded
    daemon_parts = {"gpud.life.service", "gpud.durable.store", "gpud.life.supervisor",
                    "gpud.host.units", "gpud.server.api", "gpud.host.observer", "gpud.host.nvml",
                    "gpud.life.sleeping"}
    assert not loaded & daemon_parts, loaded & daemon_parts
    # the packages of the floors it is on load with it (their __init__ holds only a docstring);
    # a release's flag table may be one gpud learned and keeps in its state directory
    # (gpud.vllm.learn, which writes it with gpud.files)
    assert all(m.startswith("gpud.core") or m in {"gpud", "gpud.life", "gpud.life.planning",
                                                    "gpud.config", "gpud.errors", "gpud.bounded",
                                                    "gpud.vllm", "gpud.vllm.vllm_flags",
                                                    "gpud.vllm.learn", "gpud.files"}
               for m in loaded), loaded
