"""The peer poller against a real HTTP peer on loopback (a real socket): a good answer, each
fault bounded and named, the circuit opening and closing with one journal line each, and what
GET /v1/peers and the metrics say of it."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from gpud.config import Config, parse_config
from gpud.core.peers import MAX_MODELS_BYTES, CircuitState, PeerModel, PeerOutcome
from gpud.host.peers import PeerPoller, check_peers, fetch_models
from gpud.nginx.router import RouterLog
from gpud.server.metrics import _Family, _peer_families
from gpud.server.openapi import document
from tests.schema import schema_errors

KEY = "sk-front-node1"

MODELS = {"object": "list", "data": [
    {"id": "ocr", "object": "model", "created": 1, "owned_by": "gpud",
     "gpud": {"serve": "ocr", "state": "sleeping"}},
    {"id": "chat", "object": "model", "created": 1, "owned_by": "gpud",
     "gpud": {"serve": "chat", "state": "stopped", "expected_wait_s": 12.0,
              "queue": [{"requester": "a", "position": 1, "waiting": 2}]}},
    {"id": "elsewhere", "object": "model", "created": 1, "owned_by": "gpud",
     "gpud": {"state": "running", "via": "node3"}},
]}


@dataclass
class Peer:
    """A peer's router on 127.0.0.1: MODE says how /v1/models answers."""

    mode: str = "good"
    port: int = 0
    asked: list[str] = field(default_factory=list)
    runner: web.AppRunner | None = None
    never: asyncio.Event = field(default_factory=asyncio.Event)

    async def models(self, request: web.Request) -> web.StreamResponse:
        self.asked.append(request.path)
        if request.headers.get("Authorization") != f"Bearer {KEY}":
            # the router's own 401 (router.js keyOf -> fail)
            return web.json_response({"error": {
                "message": "invalid API key", "type": "invalid_request_error", "param": None,
                "code": "invalid_api_key"}}, status=401)
        if self.mode == "good":
            return web.json_response(MODELS)
        if self.mode == "garbage":
            return web.Response(text="<html>it works</html>")
        if self.mode == "redirect":
            raise web.HTTPFound("http://127.0.0.1:1/v1/models")
        if self.mode == "bad-gateway":
            return web.Response(status=502, text="<html>502 Bad Gateway</html>")
        if self.mode == "gpud-503":
            return web.json_response({"error": {"message": "no memory", "type": "server_error",
                                                "param": None, "code": "model_unavailable"}},
                                     status=503)
        resp = web.StreamResponse()
        await resp.prepare(request)
        if self.mode == "huge":
            for _ in range(MAX_MODELS_BYTES // 65536 + 2):
                await resp.write(b" " * 65536)
            await resp.write_eof()
            return resp
        if self.mode == "endless":
            while True:
                await resp.write(b" " * 65536)
        # "drip": a byte, then nothing, never an end
        await resp.write(b"{")
        await self.never.wait()
        return resp

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        assert self.runner is not None
        self.never.set()
        await self.runner.cleanup()
        self.never = asyncio.Event()


@pytest.fixture
async def peer() -> AsyncIterator[Peer]:
    p = Peer()
    await p.start()
    yield p
    await p.stop()


def config(tmp_path: Path, port: int, key: str = KEY, extra: str = "") -> Config:
    path = tmp_path / "node2.key"
    path.write_text(key + "\n")
    path.chmod(0o600)
    return parse_config(f'[peers.node2]\nurl = "http://127.0.0.1:{port}"\n'
                        f'key_file = "{path}"\n{extra}\n', "t")


async def test_a_good_answer_lists_the_models_it_serves(peer: Peer, tmp_path: Path) -> None:
    cfg = config(tmp_path, peer.port)
    async with aiohttp.ClientSession() as session:
        got = await fetch_models(session, cfg.peers["node2"], KEY)
    assert got.outcome == PeerOutcome.OK and got.error is None and got.rtt_s is not None
    # what node2 only offers from node3 (the hop marker) is not offered again
    assert got.models == (PeerModel("ocr", "sleeping"), PeerModel("chat", "stopped", 12.0, 2))
    assert peer.asked == ["/v1/models"]


async def test_the_models_setting_picks_among_the_peers(peer: Peer, tmp_path: Path) -> None:
    cfg = config(tmp_path, peer.port, extra='models = ["chat"]')
    async with aiohttp.ClientSession() as session:
        got = await fetch_models(session, cfg.peers["node2"], KEY)
    assert got.models == (PeerModel("chat", "stopped", 12.0, 2),)


@pytest.mark.parametrize(("mode", "key", "outcome", "error"), [
    ("good", "sk-wrong", PeerOutcome.ANSWER, "the key was refused (401 invalid_api_key)"),
    ("garbage", KEY, PeerOutcome.FAILURE, "garbage: answer not JSON"),
    ("redirect", KEY, PeerOutcome.FAILURE, "redirected (302) to http://127.0.0.1:1/v1/models"),
    ("huge", KEY, PeerOutcome.FAILURE, f"answer over {MAX_MODELS_BYTES} bytes"),
    ("endless", KEY, PeerOutcome.FAILURE, f"answer over {MAX_MODELS_BYTES} bytes"),
    ("drip", KEY, PeerOutcome.FAILURE, "no whole answer within 0.3 s"),
    ("bad-gateway", KEY, PeerOutcome.FAILURE, "answered 502 (not gpud's)"),
    ("gpud-503", KEY, PeerOutcome.ANSWER, "answered 503 (model_unavailable)"),
])
async def test_each_fault_is_bounded_and_named(peer: Peer, tmp_path: Path, mode: str, key: str,
                                               outcome: PeerOutcome, error: str) -> None:
    peer.mode = mode
    cfg = config(tmp_path, peer.port)
    async with aiohttp.ClientSession() as session:
        got = await fetch_models(session, cfg.peers["node2"], key, timeout_s=0.3)
    assert got.outcome == outcome and got.models is None
    assert got.error is not None and got.error.startswith(error), got.error


async def test_a_peer_not_listening_is_a_connect_failure(tmp_path: Path) -> None:
    cfg = config(tmp_path, 9)
    async with aiohttp.ClientSession() as session:
        got = await fetch_models(session, cfg.peers["node2"], KEY)
    assert got.outcome == PeerOutcome.FAILURE and got.error is not None
    assert got.error.startswith("cannot connect"), got.error


async def test_the_circuit_opens_and_closes_with_one_journal_line_each(
        peer: Peer, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = config(tmp_path, peer.port)
    poller = PeerPoller(lambda: cfg, timeout_s=2.0)
    caplog.set_level(logging.WARNING, logger="gpud.peers")
    async with aiohttp.ClientSession() as session:
        await poller.poll_all(session)
        v = poller.views["node2"]
        assert (v.reachable, v.circuit.state, [m.id for m in v.models]) == (
            True, CircuitState.CLOSED, ["ocr", "chat"])
        up_since = v.reachable_since

        await peer.stop()   # it dies: connection refused
        await poller.poll_all(session)
        assert v.circuit.state == CircuitState.OPEN and v.reachable is False
        assert v.models == () and v.last_error and v.last_error.startswith("cannot connect")
        assert v.circuit.reason == v.last_error
        # asked twice: the poll, and again at once after the failure that opened it
        await poller.poll_all(session)    # still dead: a probe, half-open, open again
        assert v.circuit.state == CircuitState.OPEN

        await peer.start()  # it comes back, on the same port
        await poller.poll_all(session)
        assert v.circuit.state == CircuitState.CLOSED and v.reachable is True
        assert v.last_error is None and v.reachable_since is not None
        assert up_since is not None and v.reachable_since >= up_since
    lines = [r.getMessage() for r in caplog.records if r.name == "gpud.peers"]
    assert len([line for line in lines if "circuit opened" in line]) == 1, lines
    assert len([line for line in lines if "circuit closed" in line]) == 1, lines
    assert len(lines) == 2, lines
    # what it was asked while open: its model list only
    assert set(peer.asked) == {"/v1/models"}


async def test_a_typed_refusal_does_not_open_the_circuit(peer: Peer, tmp_path: Path) -> None:
    cfg = config(tmp_path, peer.port)
    peer.mode = "gpud-503"
    poller = PeerPoller(lambda: cfg)
    async with aiohttp.ClientSession() as session:
        await poller.poll_all(session)
    assert poller.views["node2"].circuit.state == CircuitState.CLOSED
    assert poller.views["node2"].reachable is True


async def test_the_answer_and_the_metrics(peer: Peer, tmp_path: Path) -> None:
    cfg = config(tmp_path, peer.port)
    poller = PeerPoller(lambda: cfg)
    before = poller.answer()["peers"][0]
    assert before["reachable"] is None and before["circuit"] == "closed"
    async with aiohttp.ClientSession() as session:
        await poller.poll_all(session)
    answer = poller.answer()
    doc = document()
    assert schema_errors(answer, {"$ref": "#/components/schemas/Peers"}, doc) == []
    p = answer["peers"][0]
    assert (p["name"], p["reachable"], p["circuit"], [m["id"] for m in p["models"]]) == (
        "node2", True, "closed", ["ocr", "chat"])
    assert p["rtt_s"] is not None and p["rtt_s"] > 0
    fams: dict[str, _Family] = {}
    _peer_families(fams, poller)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in fams.values() for s in f.metric.samples}
    assert samples[("gpud_peer_up", (("peer", "node2"),))] == 1
    assert samples[("gpud_peer_rtt_seconds", (("peer", "node2"),))] == p["rtt_s"]
    assert samples[("gpud_peer_requests_total", (("code", "5xx"), ("peer", "node2")))] == 0
    await peer.stop()
    async with aiohttp.ClientSession() as session:
        await poller.poll_all(session)
    fams = {}
    _peer_families(fams, poller)
    assert [s.value for s in fams["gpud_peer_up"].metric.samples] == [0]
    await peer.start()


async def test_a_refused_key_is_alive_but_not_up(peer: Peer, tmp_path: Path) -> None:
    cfg = config(tmp_path, peer.port, key="sk-wrong")
    poller = PeerPoller(lambda: cfg)
    async with aiohttp.ClientSession() as session:
        await poller.poll_all(session)
    v = poller.views["node2"]
    assert v.reachable is True and v.circuit.state == CircuitState.CLOSED and v.models == ()
    assert v.last_error is not None and "the key was refused (401" in v.last_error
    fams: dict[str, _Family] = {}
    _peer_families(fams, poller)
    assert [s.value for s in fams["gpud_peer_up"].metric.samples] == [0]


def test_check_config_warns_of_a_peer_that_does_not_answer(tmp_path: Path) -> None:
    cfg = config(tmp_path, 9)
    [warning] = check_peers(cfg)
    assert warning.startswith("peers.node2: http://127.0.0.1:9 does not answer its /v1/models "
                              "(cannot connect"), warning


def test_check_config_names_a_refused_key(tmp_path: Path) -> None:
    async def serve() -> list[str]:
        p = Peer()
        await p.start()
        try:
            return await asyncio.to_thread(check_peers, config(tmp_path, p.port, "sk-wrong"))
        finally:
            await p.stop()

    [warning] = asyncio.run(serve())
    assert "the key was refused (401 invalid_api_key)" in warning, warning
    assert json.dumps(warning)


async def test_the_router_is_told_of_a_change_of_models_or_circuit_only(
        peer: Peer, tmp_path: Path) -> None:
    """What the router is made of (routing) changes when the peer's models or its circuit do,
    never with a state: the models it last listed are kept while it is down (listed
    unreachable, answered 503 at once), with the key and the reason it opened."""
    cfg = config(tmp_path, peer.port)
    poller = PeerPoller(lambda: cfg, timeout_s=2.0)
    assert poller.routing() == (("node2", (), True),)
    async with aiohttp.ClientSession() as session:
        await poller.poll_all(session)
        up = poller.routing()
        assert up == (("node2", ("ocr", "chat"), True),)
        MODELS["data"][0]["gpud"]["state"] = "running"   # a state: nothing to render
        try:
            await poller.poll_all(session)
        finally:
            MODELS["data"][0]["gpud"]["state"] = "sleeping"
        assert poller.routing() == up
        (routed,) = poller.routed()
        assert (routed.name, routed.host, routed.port, routed.key, routed.models,
                routed.closed) == ("node2", "127.0.0.1", peer.port, KEY, ("ocr", "chat"), True)

        await peer.stop()
        await poller.poll_all(session)
        assert poller.routing() == (("node2", ("ocr", "chat"), False),)
        (routed,) = poller.routed()
        assert routed.open_reason is not None and routed.open_reason.startswith("cannot connect")
        await peer.start()
        await poller.poll_all(session)
        assert poller.routing() == up


async def test_run_renders_again_only_when_routing_changes(peer: Peer, tmp_path: Path) -> None:
    cfg = config(tmp_path, peer.port)
    poller = PeerPoller(lambda: cfg, timeout_s=2.0, interval_s=0.01)
    seen: list[tuple[tuple[str, tuple[str, ...], bool], ...]] = []

    async def changed() -> None:
        seen.append(poller.routing())

    poller.watch(changed)
    task = asyncio.create_task(poller.run())
    try:
        while len(peer.asked) < 5:   # five rounds, one change among them
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert seen == [(("node2", ("ocr", "chat"), True),)]


def test_forwarded_requests_are_counted_by_peer_and_class(tmp_path: Path) -> None:
    cfg = config(tmp_path, 1)
    poller = PeerPoller(lambda: cfg)
    poller.count("node2", "2xx")
    poller.count("node2", "2xx")
    poller.count("node2", "5xx", 503)   # a peer's answer: nothing more
    assert not poller._kick.is_set()
    poller.count("node2", "5xx", 502)   # the router's own: the peer did not answer
    assert poller._kick.is_set()        # asked at once
    poller.count("gone", "2xx")   # a peer no longer in the config: not counted
    fams: dict[str, _Family] = {}
    _peer_families(fams, poller)
    samples = {tuple(sorted(s.labels.items())): s.value
               for s in fams["gpud_peer_requests_total"].metric.samples}
    assert samples[(("code", "2xx"), ("peer", "node2"))] == 2
    assert samples[(("code", "5xx"), ("peer", "node2"))] == 2
    assert all(("peer", "gone") not in k for k in samples)


def _forwarded(status: int) -> str:
    """The router's access-log line of a request forwarded to node2 (gpud.core.router
    LOG_FIELDS): 502 its own for a peer that took no connection (router.js peerDown)."""
    return json.dumps({"model": "ocr", "serve": "", "status": str(status), "request_s": "0.001",
                       "upstream_s": "-", "ensure_s": "", "sse": "", "key": "", "ts": "1.0",
                       "prompt_tokens": "", "completion_tokens": "", "complete": "OK",
                       "peer": "node2"}) + "\n"


async def test_a_peer_dead_on_the_data_path_opens_its_circuit_within_seconds(
        peer: Peer, tmp_path: Path) -> None:
    """The peer's poll interval an hour: only the data path can open its circuit. The peer
    dies; a forwarded request the peer's gpud answered (its typed 503, passed on) asks
    nothing; the router's own 502 (the connection refused) is read from its access log within
    LOG_PEEK_S (1 s) and has the peer asked at once: its circuit opens within 2.5 s."""
    key = tmp_path / "node2.key"
    key.write_text(KEY + "\n")
    key.chmod(0o600)
    cfg = parse_config(f'[daemon]\nfront_dir = "{tmp_path}"\n[peers.node2]\n'
                       f'url = "http://127.0.0.1:{peer.port}"\nkey_file = "{key}"\n', "t")
    (tmp_path / "log").mkdir()
    log = tmp_path / "log" / "router.log"
    log.write_text("")
    poller = PeerPoller(lambda: cfg, interval_s=3600.0)
    router_log = RouterLog(lambda: cfg, peer=poller.count)
    polling = asyncio.create_task(poller.run())
    reading = asyncio.create_task(router_log.loop())
    try:
        async def until(what: object, timeout: float) -> float:
            began = time.monotonic()
            while not what():  # type: ignore[operator]
                assert time.monotonic() - began < timeout, "not within the bound"
                await asyncio.sleep(0.01)
            return time.monotonic() - began

        await until(lambda: "node2" in poller.views and poller.views["node2"].reachable, 10)
        v = poller.views["node2"]
        await peer.stop()
        with log.open("a") as f:
            f.write(_forwarded(503))
        await until(lambda: v.requests.get("5xx") == 1, 10)
        assert v.circuit.state == CircuitState.CLOSED and v.reachable is True
        with log.open("a") as f:
            f.write(_forwarded(502))
        took = await until(lambda: v.circuit.state == CircuitState.OPEN, 2.5)
        assert v.last_error is not None and v.last_error.startswith("cannot connect"), took
    finally:
        polling.cancel()
        reading.cancel()
        await asyncio.gather(polling, reading, return_exceptions=True)
