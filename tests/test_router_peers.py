"""The router forwards a request for a model that lives only on a peer (docs/peers.md): real
nginx and njs on loopback, a stand-in gpud (its /v1/peers) and stand-in peers (an HTTP server
that answers as a peer's router would, or dies, or is not there at all)."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpud.core.keys import ApiKey, token_digest
from gpud.core.router import RoutedPeer, RoutedServe, RouterFront
from gpud.core.routerlog import parse_log_line
from tests.ports import free_port
from tests.routerrig import (
    NJS,
    Handler,
    UnixServer,
    answering,
    need_nginx,
    router_dir,
    router_running,
    serving,
    tcp_server,
    unix_server,
)
from tests.waiting import wait_until

KEY = "sk-a-presents-this-to-b-0123456789"


class _GpudServer(UnixServer):
    # GET /v1/route's answers by model (a peer's name, "" this host, None none; absent: none;
    # "garbage": not gpud's answer), and the models it was asked for
    routes: dict[str, str | None]
    asked: list[str]


class _Gpud(Handler):
    """This host's gpud: no serves, peer b's view (its models' states), and which host takes a
    model on several hosts as the test sets it (GET /v1/route: gpud.core.peers.choose_host's
    answer, tested against the real gpud in tests/test_peers_daemon.py)."""

    server: _GpudServer

    def do_GET(self) -> None:
        if self.path == "/v1/serves":
            body = json.dumps({"serves": []}).encode()
        elif self.path.startswith("/v1/route?"):
            [model] = urllib.parse.parse_qs(self.path.partition("?")[2])["model"]
            self.server.asked.append(model)
            host = self.server.routes.get(model)
            body = b"<html>no</html>" if host == "garbage" else json.dumps({
                "model": model, "found": model in self.server.routes,
                "peer": host or None, "hosts": []}).encode()
        else:
            body = json.dumps({"peers": [
                {"name": "b", "circuit": "closed", "models": [
                    {"id": "echo", "state": "sleeping", "expected_wait_s": 7.0, "queued": 2}]},
                {"name": "d", "circuit": "open", "models": []}]}).encode()
        self.answer(200, body)


# This host's serve "t" (its models "t" and "u").
_Serve = answering(b'{"served": "hosta"}')


class _Peer(Handler):
    """Peer b's router: the model in the body decides the answer."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        body = self.read_body()
        model = json.loads(body)["model"]
        if model in ("echo", "t"):
            self.answer_json(200, {"path": self.path, "length": len(body),
                                   "headers": {k.lower(): v for k, v in self.headers.items()}})
        elif model == "typed":
            self.answer_json(503, {"error": {"message": "no memory for it on b", "type":
                                             "server_error", "param": None,
                                             "code": "model_unavailable"}})
        elif model == "html":
            self.answer(502, b"<html>502 Bad Gateway</html>", "text/html")
        else:  # "stream", "dies": an SSE stream, whole or cut after its first event
            # chunked to an HTTP/1.1 request, else to the connection's end (as nginx answers)
            chunked = self.request_version == "HTTP/1.1"
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            if chunked:
                self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            events = [": loading stream\n\n", 'data: {"n": 1}\n\n', 'data: {"n": 2}\n\n',
                      "data: [DONE]\n\n"]
            for event in events[:2] if model == "dies" else events:
                data = event.encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
                self.wfile.flush()
            if model == "dies" or not chunked:
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
                return
            self.wfile.write(b"0\r\n\r\n")


@dataclass
class Rig:
    port: int
    log: Path
    access: Path
    gpud: _GpudServer


@pytest.fixture
def rig() -> Iterator[Rig]:
    with _rig(None) as r:
        yield r


@contextlib.contextmanager
def _rig(keys: tuple[ApiKey, ...] | None) -> Iterator[Rig]:
    need_nginx()
    with router_dir("gpud-peers-") as tmp:
        gpud = _GpudServer(str(tmp / "gpud.sock"), _Gpud)
        gpud.routes, gpud.asked = {}, []
        (tmp / "gpud.sock").chmod(0o777)
        peer = tcp_server(_Peer)
        port, nobody = free_port(), free_port()
        models = ("echo", "stream", "dies", "typed", "html")
        router = RouterFront(
            f"127.0.0.1:{port}",
            (RoutedServe("t", ("t", "u"), socket=str(tmp / "t.sock")),),
            njs_module=str(NJS), script=str(tmp / "router.js"),
            gpud_socket=str(tmp / "gpud.sock"), access_log=str(tmp / "access.log"),
            host="hosta", keys=keys,
            # b also offers "t", this host's model (and f does): gpud says which host takes it
            peers=(RoutedPeer("b", "http", "127.0.0.1", peer.server_address[1], KEY,
                              (*models, "t")),
                   # nobody listens there
                   RoutedPeer("c", "http", "127.0.0.1", nobody, KEY, ("nowhere",)),
                   # its circuit open
                   RoutedPeer("d", "http", "127.0.0.1", nobody, KEY, ("closedoff", "both", "t"),
                              open_reason="cannot connect: refused", open_since=1.0),
                   # "both" on d (open) and e: e takes it
                   RoutedPeer("e", "http", "127.0.0.1", peer.server_address[1], KEY, ("both",)),
                   # a peer listing this host's own model: this host's serve takes it
                   RoutedPeer("f", "http", "127.0.0.1", nobody, KEY, ("t",))))
        with serving(gpud, unix_server(tmp / "t.sock", _Serve), peer), \
                router_running(tmp, router):
            yield Rig(port, tmp / "nginx.log", tmp / "access.log", gpud)


def _post(port: int, model: str, route: str = "/v1/chat/completions",
          headers: dict[str, str] | None = None, extra: bytes = b""
          ) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        body = json.dumps({"model": model, "messages": [], "stream": True}).encode()
        if extra:
            body = body[:-1] + b', "pad": "' + extra + b'"}'
        conn.request("POST", route, body=body,
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def test_a_request_goes_to_the_peer_with_this_hosts_key_requester_and_hop(rig: Rig) -> None:
    """Its route and body as sent (2 MiB: as large as the router takes locally), the client's
    key, requester and hop header never passed on as sent."""
    pad = b"x" * (2 << 20)
    status, _, body = _post(rig.port, "echo", "/v1/embeddings", extra=pad, headers={
        "Authorization": "Bearer sk-the-clients-own", "X-Api-Key": "sk-the-clients-own",
        "X-Gpud-Requester": "mallory"})
    assert status == 200, body[:300]
    seen = json.loads(body)
    assert seen["path"] == "/v1/embeddings"
    assert seen["length"] > 2 << 20
    h = seen["headers"]
    assert h["authorization"] == f"Bearer {KEY}"
    assert h.get("x-api-key", "") == ""
    assert h["x-gpud-via"] == "hosta"
    assert h["x-gpud-requester"] == "addr:loopback"


def test_a_request_that_came_from_a_peer_is_never_forwarded_again(rig: Rig) -> None:
    status, _, body = _post(rig.port, "echo", headers={"X-Gpud-Via": "hostb"})
    assert status == 404, body
    assert json.loads(body)["error"]["code"] == "model_not_found"


def test_a_stream_passes_whole_and_unbuffered_and_the_log_names_the_peer(rig: Rig) -> None:
    status, headers, body = _post(rig.port, "stream")
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert body.decode().split("\n\n")[:4] == [": loading stream", 'data: {"n": 1}',
                                               'data: {"n": 2}', "data: [DONE]"], body
    lines = wait_until(lambda: rig.access.read_text().splitlines(), what="a log line")
    answered = parse_log_line(lines[-1], {"t": "t"})
    assert answered is not None
    assert (answered.peer, answered.model, answered.status_class) == ("b", "stream", "2xx")


def test_a_peer_gone_mid_stream_ends_the_stream_with_an_error_event(rig: Rig) -> None:
    status, _, body = _post(rig.port, "dies")
    events = [e for e in body.decode().split("\n\n") if e.strip()]
    assert status == 200
    assert events[1] == 'data: {"n": 1}', events
    assert events[-1] == "data: [DONE]", events
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "peer_unreachable" and "host b" in error["message"], error


def test_a_typed_answer_of_the_peers_gpud_passes_as_it_came(rig: Rig) -> None:
    status, _, body = _post(rig.port, "typed")
    assert status == 503
    assert json.loads(body)["error"] == {"message": "no memory for it on b", "type":
                                         "server_error", "param": None,
                                         "code": "model_unavailable"}


@pytest.mark.parametrize("model", ["html", "nowhere"])
def test_a_peer_that_does_not_answer_is_502_naming_it(rig: Rig, model: str) -> None:
    """A proxy's HTML 502 between the hosts, and a peer nobody listens for."""
    status, headers, body = _post(rig.port, model)
    assert status == 502, body
    error = json.loads(body)["error"]
    assert error["code"] == "peer_unreachable" and error["type"] == "server_error", error
    assert f"host {'b' if model == 'html' else 'c'} did not answer" in error["message"]
    assert headers["retry-after"] == "5"


def test_a_peer_whose_circuit_is_open_is_503_at_once_and_another_host_takes_it(
        rig: Rig) -> None:
    status, headers, body = _post(rig.port, "closedoff")
    assert status == 503, body
    assert headers["retry-after"] == "5"
    error = json.loads(body)["error"]
    assert error["code"] == "peer_unreachable"
    assert "host d (unreachable: cannot connect: refused)" in error["message"], error
    status, _, body = _post(rig.port, "both")
    assert status == 200, body


def test_a_model_on_one_host_never_asks_gpud_which_host(rig: Rig) -> None:
    """No added cost for a model on one host: only a model on several asks GET /v1/route."""
    for model in ("u", "echo", "nowhere"):
        _post(rig.port, model)
    assert rig.gpud.asked == []
    _post(rig.port, "t")
    _post(rig.port, "both")
    assert rig.gpud.asked == ["t", "both"]


@pytest.mark.parametrize(("choice", "served_by"), [
    ("b", "b"),          # gpud chose peer b
    ("", "hosta"),       # this host
    (None, "hosta"),     # no host can: this host answers as it does (its serve, its refusal)
    ("d", "hosta"),      # a peer whose circuit the router knows open: never
    ("garbage", "hosta"),  # gpud's answer unreadable: the model stays here
    ("absent", "hosta"),   # gpud finds no host
])
def test_a_model_on_several_hosts_goes_where_gpud_chooses(
        rig: Rig, choice: str | None, served_by: str) -> None:
    if choice != "absent":
        rig.gpud.routes["t"] = choice
    status, _, body = _post(rig.port, "t", "/v1/embeddings")
    assert status == 200, body
    doc = json.loads(body)
    if served_by == "b":
        assert doc["path"] == "/v1/embeddings" and doc["headers"]["x-gpud-via"] == "hosta"
        assert doc["headers"]["authorization"] == f"Bearer {KEY}"
        lines = wait_until(lambda: rig.access.read_text().splitlines(), what="a log line")
        answered = parse_log_line(lines[-1], {"t": "t"})
        assert answered is not None and answered.peer == "b", lines[-1]
    else:
        assert doc == {"served": "hosta"}
    assert rig.gpud.asked == ["t"]


def test_a_model_only_on_peers_goes_to_the_peer_gpud_chooses(rig: Rig) -> None:
    """"both" on d (its circuit open) and e: gpud choosing e (its view fresher than the
    router's) sends it there; gpud naming d, known open here, falls to the first closed."""
    rig.gpud.routes["both"] = "e"
    assert _post(rig.port, "both")[0] == 200
    rig.gpud.routes["both"] = "d"
    status, _, body = _post(rig.port, "both")
    assert status == 200, body


def test_a_request_that_came_from_a_peer_never_asks_which_host(rig: Rig) -> None:
    rig.gpud.routes["t"] = "b"
    status, _, body = _post(rig.port, "t", headers={"X-Gpud-Via": "hostb"})
    assert status == 200 and json.loads(body) == {"served": "hosta"}, body
    assert rig.gpud.asked == []


def test_models_lists_the_peers_models_with_their_host_and_state(rig: Rig) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", rig.port, timeout=20)
    with contextlib.closing(conn):
        conn.request("GET", "/v1/models")
        doc = json.loads(conn.getresponse().read())
    by = {m["id"]: m["gpud"] for m in doc["data"]}
    assert by["t"]["host"] == "hosta" and "via" not in by["t"]
    # a model here and on peers: listed once, with every host that has it
    assert by["t"]["hosts"] == ["hosta", "b", "d", "f"] and "hosts" not in by["u"]
    assert by["echo"] == {"host": "b", "hosts": ["b"], "via": "b", "state": "sleeping",
                          "expected_wait_s": 7.0, "queued": 2}
    assert by["closedoff"]["state"] == "unreachable"
    assert by["closedoff"]["reason"] == "cannot connect: refused"
    assert by["both"]["host"] == "e" and by["both"]["hosts"] == ["d", "e"]
    assert "t" not in [m for m, g in by.items() if g.get("via")]
    conn = http.client.HTTPConnection("127.0.0.1", rig.port, timeout=20)
    with contextlib.closing(conn):
        conn.request("GET", "/v1/models", headers={"X-Gpud-Via": "hostb"})
        hopped = json.loads(conn.getresponse().read())
    assert [m["id"] for m in hopped["data"]] == ["t", "u"]


def test_models_id_of_a_peers_model_names_its_host(rig: Rig) -> None:
    def get(path: str, headers: dict[str, str] | None = None) -> tuple[int, object]:
        conn = http.client.HTTPConnection("127.0.0.1", rig.port, timeout=20)
        with contextlib.closing(conn):
            conn.request("GET", path, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read())
    status, doc = get("/v1/models/echo")
    assert status == 200 and isinstance(doc, dict), doc
    assert doc["id"] == "echo" and doc["gpud"]["host"] == "b", doc
    # a peer asking: not offered on
    status, doc = get("/v1/models/echo", {"X-Gpud-Via": "hostb"})
    assert status == 404, doc


def test_a_keys_limits_hold_for_a_forwarded_request_and_its_key_stays_here() -> None:
    """The client's key is checked here (its requests_per_minute too: 429 from this router, in
    OpenAI's shape), and the peer sees this host's key and the key's name as requester."""
    token = "sk-alice-0123456789abcdef"
    with _rig((ApiKey("alice", token_digest(token), ("*",), requests_per_minute=2),)) as rig:
        auth = {"Authorization": f"Bearer {token}"}
        assert _post(rig.port, "echo")[0] == 401
        for _ in range(2):   # a minute's worth at once (burst), then at the rate
            status, _, body = _post(rig.port, "echo", headers=auth)
            assert status == 200, body
        h = json.loads(body)["headers"]
        assert h["authorization"] == f"Bearer {KEY}" and h["x-gpud-requester"] == "alice", h
        status, headers, body = _post(rig.port, "echo", headers=auth)
        assert status == 429, body
        error = json.loads(body)["error"]
        assert error["code"] == "rate_limit_exceeded" and error["gpud"]["key"] == "alice"
        assert headers["retry-after"] == "30"


def test_a_key_of_one_request_a_minute_loads() -> None:
    """nginx refused the whole config with "burst=0" (a key's requests_per_minute = 1)."""
    token = "sk-bob-0123456789abcdef0"
    with _rig((ApiKey("bob", token_digest(token), ("*",), requests_per_minute=1),)) as rig:
        auth = {"Authorization": f"Bearer {token}"}
        assert _post(rig.port, "echo", headers=auth)[0] == 200
        assert _post(rig.port, "echo", headers=auth)[0] == 429
