"""What the router is made of (gpud.core.router), as values: model names and the routing table,
the serves and peers behind it and their checks, the peers' tables, the router's settings, who
asked and the bound on ensures. Pure: no nginx here (tests/test_router*.py run the real one)."""

from __future__ import annotations

import re

import pytest

from gpud.core.quota import Over
from gpud.core.router import (
    ANONYMOUS,
    EnsureBound,
    RoutedPeer,
    RoutedServe,
    RouterFront,
    RouterRequest,
    duplicate_names,
    listen_port,
    listen_problem,
    model_name_problem,
    peer_address,
    peer_key_problem,
    peer_table,
    router_request,
    routing_table,
    shared_table,
)


def test_a_model_name_starts_with_a_letter_digit_or_slash_and_is_at_most_255() -> None:
    for good in ("chat", "Qwen/Qwen3-8B", "/models/llama", "9b", "a" * 255, "m:v1@x+y_z.q"):
        assert model_name_problem(good) is None, good
    for bad in ("", "-chat", ".hidden", "a" * 256, "bad name", 'q"uote'):
        problem = model_name_problem(bad)
        assert problem is not None and repr(bad) in problem and "at most 255" in problem


@pytest.mark.parametrize("listen", ["127.0.0.1:8000", "[::1]:8000", "localhost:1",
                                    "0.0.0.0:65535", "[::]:443"])
def test_a_listen_address_is_an_ip_or_localhost_and_a_port(listen: str) -> None:
    assert listen_problem(listen) is None


@pytest.mark.parametrize(("listen", "says"), [
    ("8000", "is not HOST:PORT"),
    ("127.0.0.1:", "is not HOST:PORT"),
    ("127.0.0.1:0", "is not HOST:PORT"),
    ("127.0.0.1:65536", "is not HOST:PORT"),
    ("127.0.0.1:http", "is not HOST:PORT"),
    ("example.com:80", "the host is an IP address"),
    ("::1:80", "the host is an IP address"),
    ("127.0.0.1:80; evil", "is not HOST:PORT"),
])
def test_a_listen_address_that_is_not_one_is_named(listen: str, says: str) -> None:
    problem = listen_problem(listen)
    assert problem is not None and repr(listen) in problem and says in problem


def test_the_listen_port_is_after_the_last_colon() -> None:
    assert listen_port("127.0.0.1:8000") == 8000
    assert listen_port("[::1]:9") == 9


def test_the_routing_table_maps_each_name_to_its_serve() -> None:
    assert routing_table({"b": ["y", "y"], "a": ["x", "x2"]}) == {"x": "a", "x2": "a", "y": "b"}
    assert routing_table({}) == {}
    with pytest.raises(ValueError, match="model name 'x' is on two serves: a and b"):
        routing_table({"b": ["x"], "a": ["x"]})


def test_a_name_on_several_serves_is_named_once_with_them_all() -> None:
    assert duplicate_names({"c": ["x", "z"], "a": ["x", "x"], "b": ["x", "z"], "d": ["w"]}) == [
        "model name 'x' is on serves a and b and c: one name, one serve",
        "model name 'z' is on serves b and c: one name, one serve"]
    assert duplicate_names({"a": ["x", "x"]}) == []


def test_a_routed_serve_listens_on_a_socket_or_a_port() -> None:
    sock = RoutedServe("chat-fast", ("chat",), socket="/run/gpud/serves/chat.sock")
    assert sock.server == "unix:/run/gpud/serves/chat.sock"
    assert sock.upstream == "router_chat_fast" and sock.location == "@router_chat_fast"
    assert RoutedServe("ocr", ("ocr",), port=30002).server == "127.0.0.1:30002"
    for where in ({}, {"socket": "/run/s.sock", "port": 1}):
        with pytest.raises(ValueError, match="serve x: give exactly one of socket or port"):
            RoutedServe("x", ("x",), **where)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"serve x: socket 'run/s.sock' is not a plain"):
        RoutedServe("x", ("x",), socket="run/s.sock")
    with pytest.raises(ValueError, match="serve x: 'bad name' is not a model name"):
        RoutedServe("x", ("ok", "bad name"), port=1)


def peer(name: str = "node-2", **kw: object) -> RoutedPeer:
    fields: dict[str, object] = {"scheme": "http", "host": "node2", "port": 8000,
                                 "key": "sk-peer"}
    fields.update(kw)
    return RoutedPeer(name, **fields)  # type: ignore[arg-type]


def test_a_peer_key_is_what_nginx_can_send_as_it_is() -> None:
    assert peer_key_problem("sk-0123/+=:@%!*,^|~") is None
    assert peer_key_problem("k" * 512) is None
    for bad in ("", "k" * 513, "a b", 'a"b', "a$b", "a;b", "a{b", "a\\b"):
        problem = peer_key_problem(bad)
        assert problem is not None and "cannot send" in problem, bad
    with pytest.raises(ValueError, match="router: peer node-2: the key holds a character"):
        peer(key="a b")


def test_a_routed_peer_is_checked_and_named() -> None:
    p = peer(models=("chat",))
    assert (p.upstream, p.location, p.authority) == (
        "router_peer_node_2", "@router_peer_node_2", "node2:8000")
    assert p.closed and not peer(open_reason="refused", open_since=1.0).closed
    assert peer(host="[::1]").authority == "[::1]:8000"
    assert peer(scheme="https", tls_ca="/etc/gpud/ca.pem").scheme == "https"
    with pytest.raises(ValueError, match="router: peer node-2: scheme 'ftp'"):
        peer(scheme="ftp")
    for ca in (None, "ca.pem"):
        with pytest.raises(ValueError, match="peer node-2: https needs the CA file"):
            peer(scheme="https", tls_ca=ca)
    for host in ("node 2", "::1", "[::1"):
        with pytest.raises(ValueError, match=re.escape(f"router: peer node-2: host {host!r}")):
            peer(host=host)
    with pytest.raises(ValueError, match="router: peer node-2: 'bad name' is not a model"):
        peer(models=("chat", "bad name"))


@pytest.mark.parametrize(("url", "address"), [
    ("http://node2:8000", ("http", "node2", 8000)),
    ("http://node2", ("http", "node2", 80)),
    ("HTTPS://node2/", ("https", "node2", 443)),
    ("https://node2:8443/", ("https", "node2", 8443)),
    ("http://[::1]:9000", ("http", "[::1]", 9000)),
    ("https://[fd00::2]", ("https", "[fd00::2]", 443)),
])
def test_a_peers_address_from_its_url(url: str, address: tuple[str, str, int]) -> None:
    assert peer_address(url) == address


def test_a_model_no_local_serve_answers_to_goes_to_the_peers_that_offer_it() -> None:
    peers = [peer("b", models=("chat", "code")), peer("a", models=("code", "vision")),
             peer("c", models=())]
    assert peer_table(["chat", "local"], peers) == {"code": ["a", "b"], "vision": ["a"]}
    # every model on more than one host: "" is this host, first
    assert shared_table(["chat", "local"], peers) == {"chat": ["", "b"], "code": ["a", "b"]}
    assert peer_table([], []) == {} and shared_table(["x"], []) == {}


def front(**kw: object) -> RouterFront:
    fields: dict[str, object] = {"listen": "127.0.0.1:8000",
                                 "serves": (RoutedServe("a", ("x", "y"), port=1),
                                            RoutedServe("b", ("z",), port=2))}
    fields.update(kw)
    return RouterFront(**fields)  # type: ignore[arg-type]


def test_the_router_front_checks_its_settings() -> None:
    assert front().table == {"x": "a", "y": "a", "z": "b"}
    good = front(access_log="/var/log/gpud/router.log", awake_dir="/run/gpud/awake",
                 peers=(peer("p"), peer("q")), host="node-1.lan",
                 over_budget=(Over("alice", 10, "day", 1, 1),))
    assert good.host == "node-1.lan"
    with pytest.raises(ValueError, match="router: listen: '8000' is not HOST:PORT"):
        front(listen="8000")
    for field in ("njs_module", "script", "gpud_socket", "access_log", "awake_dir"):
        for path in ("relative/path", "/with space"):
            with pytest.raises(ValueError, match=f"router: {path!r} is not a plain absolute"):
                front(**{field: path})
    with pytest.raises(ValueError, match="model name 'x' is on two serves: a and b"):
        front(serves=(RoutedServe("a", ("x",), port=1), RoutedServe("b", ("x",), port=2)))
    with pytest.raises(ValueError, match="router: host name 'a b' is not letters"):
        front(host="a b")
    with pytest.raises(ValueError, match=r"router: a peer named twice in \['p', 'q', 'p'\]"):
        front(peers=(peer("p"), peer("q"), peer("p")))


def test_who_asked_is_the_requester_else_the_key_else_anonymous() -> None:
    assert RouterRequest("chat", "ci", "addr:10.0.0.7").requester == "addr:10.0.0.7"
    assert RouterRequest("chat", "ci").requester == "ci"
    assert RouterRequest("chat").requester == ANONYMOUS
    assert RouterRequest(None, None, "").requester == ANONYMOUS


def test_a_router_requests_text_is_printable_and_bounded() -> None:
    assert RouterRequest("chat").text == "request for model 'chat' through the router"
    assert RouterRequest("chat", "ci").text == (
        "request for model 'chat' with key 'ci' through the router")
    assert RouterRequest(None, None, "addr:loopback").text == (
        "on-demand request from 'addr:loopback'")
    long = RouterRequest("m" * 300, "k" * 100, "r" * 300)
    assert f"'{'m' * 256}'" in long.text and f"'{'k' * 64}'" in long.text
    # a requester is kept to a key's name, "/" and a peer's forwarded one: 64 + 1 + 64
    assert RouterRequest(None, None, "r" * 300).text == (
        f"on-demand request from '{'r' * 129}'")
    assert "\x1b" not in RouterRequest("a\x1b[2Jb", "k\x1b").text


def test_an_ensures_headers_name_the_request() -> None:
    assert router_request({}) is None
    assert router_request({"X-Gpud-Model": "", "X-Gpud-Key": "", "X-Gpud-Requester": ""}) is None
    assert router_request({"X-Gpud-Model": "chat"}) == RouterRequest("chat", None, ANONYMOUS)
    assert router_request({"X-Gpud-Key": "ci"}) == RouterRequest(None, "ci", "ci")
    assert router_request({"X-Gpud-Requester": "r" * 200}) == RouterRequest(
        None, None, "r" * 129)


def test_an_ensure_is_let_in_up_to_each_bound_exactly() -> None:
    bound = EnsureBound.empty(per_requester=2, total=3)
    assert bound.waiting == 0
    assert bound.enter("alice") is None and bound.by == {"alice": 1}
    assert bound.enter("alice") is None and bound.waiting == 2
    refused = bound.enter("alice")
    assert refused is not None and refused.value == 2
    assert refused.limit == "daemon.ensure_waiting_per_requester"
    assert refused.text == ("2 requests of alice wait for a bring-up already "
                            "(daemon.ensure_waiting_per_requester)")
    assert bound.by == {"alice": 2}  # nothing counted for a refusal
    assert bound.enter("bob") is None
    full = bound.enter("carol")
    assert full is not None and (full.limit, full.value) == ("daemon.ensure_waiting_total", 3)
    assert full.text == ("3 requests wait for a bring-up already "
                         "(daemon.ensure_waiting_total)")
    assert bound.by == {"alice": 2, "bob": 1} and bound.waiting == 3
    bound.leave("alice")
    assert bound.by == {"alice": 1, "bob": 1}
    bound.leave("alice")
    bound.leave("nobody")  # one that never entered leaves nothing behind
    assert bound.by == {"bob": 1}


def test_the_routers_defaults_are_those_docs_router_md_gives() -> None:
    router = RouterFront("127.0.0.1:8000", ())
    assert (router.max_body_mib, router.body_timeout_s, router.large_bodies_per_requester,
            router.loading_feedback_s) == (64, 30, 16, 5)
