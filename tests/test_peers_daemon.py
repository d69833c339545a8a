"""A real gpud with a [peers.node2] whose router is a real HTTP server on loopback: the peer
answers, dies, comes back; gpud's GET /v1/peers, `gpuctl peers`, its metrics and its log follow
(the circuit opens and closes, one log line each)."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO, T015, GpudProcess, start_gpud
from tests.ports import free_port
from tests.routerrig import Handler, key_file, tcp_server

KEY = "sk-front-node1"
MODELS = {"object": "list", "data": [
    {"id": "ocr", "object": "model", "created": 1, "owned_by": "gpud",
     "gpud": {"serve": "ocr", "state": "sleeping"}}]}


class _Models(Handler):
    def do_GET(self) -> None:
        ok = self.path == "/v1/models" and self.headers.get("Authorization") == f"Bearer {KEY}"
        self.answer_json(200 if ok else 401, MODELS if ok else {"error": {
            "message": "no", "type": "invalid_request_error", "param": None,
            "code": "invalid_api_key"}})


class Peer:
    def __init__(self) -> None:
        self.port = 0
        self.server: http.server.ThreadingHTTPServer | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.server = tcp_server(_Models, self.port)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


@pytest.fixture
def peer() -> Iterator[Peer]:
    p = Peer()
    p.start()
    yield p
    p.stop()


@pytest.fixture
def gp(tmp_path: Path, peer: Peer) -> Iterator[GpudProcess]:
    key = key_file(tmp_path / "node2.key", KEY)
    state = tmp_path / "sim.json"
    state.write_text('{"external": []}')
    proc = start_gpud(tmp_path, f"""
[peers.node2]
url = "http://127.0.0.1:{peer.port}"
key_file = "{key}"

[simulation]
state_file = "{state}"
[[simulation.devices]]
uuid = "GPU-sim-0"
total_mib = 32607
""")
    yield proc
    proc.stop()


def until(what: Callable[[], Any], timeout: float = 30) -> Any:
    """WHAT's answer once it is truthy (gpud asks its peers every 5 s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if answer := what():
            return answer
        time.sleep(0.1)
    raise AssertionError("not within the timeout")


def node2(gp: GpudProcess) -> dict[str, Any]:
    [p] = gp.call("GET", "/v1/peers").body["peers"]
    assert p["name"] == "node2"
    return dict(p)


def gpuctl(gp: GpudProcess, *argv: str) -> str:
    out = subprocess.run([sys.executable, "-m", "gpud.ctl", "--socket", str(gp.socket), *argv],
                         capture_output=True, text=True, cwd=REPO, check=True, timeout=30)
    return out.stdout


def peer_up(gp: GpudProcess) -> float:
    for family in text_string_to_metric_families(gp.call("GET", "/metrics").raw.decode()):
        for s in family.samples:
            if s.name == "gpud_peer_up" and s.labels == {"peer": "node2"}:
                return s.value
    raise AssertionError("no gpud_peer_up{peer=node2}")


def test_a_peer_that_answers_dies_and_comes_back(gp: GpudProcess, peer: Peer) -> None:
    up = until(lambda: (p := node2(gp))["reachable"] and p)
    assert up["circuit"] == "closed" and [m["id"] for m in up["models"]] == ["ocr"]
    assert up["rtt_s"] > 0 and up["last_error"] is None
    assert peer_up(gp) == 1
    text = gpuctl(gp, "peers")
    assert "node2" in text and "reachable since" in text and "closed" in text, text
    assert "node2 models: ocr (sleeping)" in text, text
    assert json.loads(gpuctl(gp, "--json", "peers"))["peers"][0]["models"][0]["id"] == "ocr"

    peer.stop()
    down = until(lambda: (p := node2(gp))["circuit"] == "open" and p)
    assert down["reachable"] is False and down["models"] == []
    assert down["last_error"].startswith("cannot connect"), down
    assert peer_up(gp) == 0
    text = gpuctl(gp, "peers")
    assert "unreachable since" in text and "node2 last error: cannot connect" in text, text

    peer.start()
    back = until(lambda: (p := node2(gp))["circuit"] == "closed" and p, timeout=30)
    assert back["reachable"] is True and [m["id"] for m in back["models"]] == ["ocr"]
    log = gp.output()
    assert log.count("peer node2: circuit opened") == 1, log
    assert log.count("peer node2: circuit closed") == 1, log


def test_plan_refuses_a_peer_key_others_may_read_and_reload_takes_a_new_peer(
        gp: GpudProcess, tmp_path: Path) -> None:
    loose = tmp_path / "node3.key"
    loose.write_text(KEY + "\n")
    loose.chmod(0o644)
    text = gp.config.read_text() + (f'\n[peers.node3]\nurl = "http://127.0.0.1:9"\n'
                                     f'key_file = "{loose}"\n')
    reply = gp.call("POST", "/v1/plan", {"config": text})
    assert reply.status == 400, reply.body
    problems = reply.body["error"]["details"]["problems"]
    assert any(p.startswith("peers.node3.key_file:") and "mode 0644" in p
               for p in problems), problems

    loose.chmod(0o600)
    gp.config.write_text(text)
    assert gp.call("POST", "/v1/reload", {}).status == 200
    node3 = until(lambda: [p for p in gp.call("GET", "/v1/peers").body["peers"]
                           if p["name"] == "node3" and p["checked_at"] is not None])
    assert node3[0]["reachable"] is False and node3[0]["circuit"] == "open"
    assert node3[0]["last_error"].startswith("cannot connect"), node3


def test_which_host_takes_a_model_is_gpuds_choice(gp: GpudProcess, peer: Peer) -> None:
    """GET /v1/route (the router asks it for a model on several hosts): the peer that lists the
    model while its circuit is closed; no host once its circuit opens; a bad query named."""
    until(lambda: node2(gp)["reachable"])
    assert gp.call("GET", "/v1/route?model=ocr").body == {
        "model": "ocr", "found": True, "peer": "node2", "hosts": ["node2"]}
    assert gp.call("GET", "/v1/route?model=chat").body == {
        "model": "chat", "found": False, "peer": None, "hosts": []}
    bad = gp.call("GET", "/v1/route?model=%20x")
    assert bad.status == 400 and "not a model name" in bad.body["error"]["message"], bad.body
    assert gp.call("GET", "/v1/route?model=ocr&host=b").status == 400
    peer.stop()
    until(lambda: node2(gp)["circuit"] == "open")
    assert gp.call("GET", "/v1/route?model=ocr").body["found"] is False


def test_a_model_here_and_on_a_peer_goes_where_it_is_awake(tmp_path: Path, peer: Peer,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """This host's serve "ocr" (not running: no system bus here) and node2's "ocr": asleep on
    both, no wait said, this host takes it (a tie); awake on node2, node2 does."""
    key = key_file(tmp_path / "node2.key", KEY)
    gp = start_gpud(tmp_path, T015 + f"""
[router]
listen = "127.0.0.1:{free_port()}"

[peers.node2]
url = "http://127.0.0.1:{peer.port}"
key_file = "{key}"
""")
    try:
        until(lambda: node2(gp)["reachable"])
        assert gp.call("GET", "/v1/route?model=ocr").body == {
            "model": "ocr", "found": True, "peer": None, "hosts": ["", "node2"]}
        awake = json.loads(json.dumps(MODELS))
        awake["data"][0]["gpud"]["state"] = "running"
        monkeypatch.setattr(sys.modules[__name__], "MODELS", awake)
        until(lambda: node2(gp)["models"][0]["state"] == "running")
        assert gp.call("GET", "/v1/route?model=ocr").body["peer"] == "node2"
        # a model of this host's only: here
        assert gp.call("GET", "/v1/route?model=embeddings").body == {
            "model": "embeddings", "found": True, "peer": None, "hosts": [""]}
    finally:
        gp.stop()
