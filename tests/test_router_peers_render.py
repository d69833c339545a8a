"""The router's forwarding to peers as rendered (gpud.core.router): the peer's address, the
models each takes, the named locations' lines, the script's table and the access log's peer."""

from __future__ import annotations

import json

import pytest

from gpud.core.router import (
    RoutedPeer,
    RoutedServe,
    RouterFront,
    peer_address,
    peer_table,
    shared_table,
)
from gpud.core.routerconf import http_lines, render_script
from gpud.core.routerlog import parse_log_line

KEY = "sk-node1-presents-this-to-node2"


@pytest.mark.parametrize(("url", "address"), [
    ("http://node2.tailnet:8000", ("http", "node2.tailnet", 8000)),
    ("https://node2.tailnet/", ("https", "node2.tailnet", 443)),
    ("HTTP://10.0.0.2", ("http", "10.0.0.2", 80)),
    ("http://[fd7a::2]:8000", ("http", "[fd7a::2]", 8000)),
])
def test_peer_address(url: str, address: tuple[str, str, int]) -> None:
    assert peer_address(url) == address


def test_a_model_a_local_serve_answers_to_stays_here_and_peers_go_by_name() -> None:
    peers = [RoutedPeer("c", "http", "10.0.0.3", 80, KEY, ("ocr", "chat")),
             RoutedPeer("b", "http", "10.0.0.2", 80, KEY, ("ocr", "embed"))]
    assert peer_table(["chat"], peers) == {"ocr": ["b", "c"], "embed": ["b"]}


@pytest.mark.parametrize("key", ['sk-"quoted"', "sk-$router_key", "sk-a;b", "sk-a b", "sk-{x}",
                                 "sk-back\\slash", ""])
def test_a_key_nginx_would_read_otherwise_is_refused(key: str) -> None:
    with pytest.raises(ValueError, match="peer b: the key holds a character"):
        RoutedPeer("b", "http", "10.0.0.2", 80, key)


def _router(*peers: RoutedPeer) -> RouterFront:
    return RouterFront("127.0.0.1:8000", (RoutedServe("chat", ("chat",), port=30001),),
                       host="node1", peers=peers, access_log="/run/gpud/front/log/router.log")


def _location(lines: list[str], name: str) -> list[str]:
    start = lines.index(f"        location {name} {{")
    return lines[start:lines.index("        }", start)]


def test_the_peers_location_sets_its_key_requester_and_hop_and_streams() -> None:
    lines = "\n".join(http_lines(_router(RoutedPeer(
        "node-2", "https", "node2.tailnet", 8443, KEY, ("ocr",), tls_ca="/etc/gpud/ca.pem"))))
    out = lines.split("\n")
    assert "    upstream router_peer_node_2 {" in out
    assert "        server node2.tailnet:8443;" in out
    for name, version in (("@router_peer_node_2", "1.1"), ("@router_peer_node_2_stream", "1.0")):
        loc = [line.strip() for line in _location(out, name)]
        assert "proxy_pass https://router_peer_node_2;" in loc
        assert f"proxy_http_version {version};" in loc
        assert f'proxy_set_header Authorization "Bearer {KEY}";' in loc
        assert 'proxy_set_header X-Api-Key "";' in loc
        assert "proxy_set_header X-Gpud-Requester $router_requester;" in loc
        assert 'proxy_set_header X-Gpud-Via "node1";' in loc
        assert "proxy_buffering off;" in loc
        assert "proxy_next_upstream off;" in loc
        assert "error_page 502 504 = @router_peer_down;" in loc
        assert "proxy_ssl_trusted_certificate /etc/gpud/ca.pem;" in loc
        assert "proxy_ssl_name node2.tailnet;" in loc
        assert "proxy_ssl_verify on;" in loc
        # only nginx's own failures are answered here: the peer's other answers pass
        assert not [line for line in loc if line.startswith("error_page")
                    and "502 504" not in line]
    assert "js_var $router_peer;" in lines
    assert '"peer":"$router_peer"' in lines


def test_no_peers_no_peer_lines() -> None:
    lines = "\n".join(http_lines(_router()))
    assert "router_peer_" not in lines and "/.gpud-router-peers" not in lines
    assert "/.gpud-router-route" not in lines and "router_gpud_route" not in lines


def test_a_model_on_several_hosts_asks_gpud_on_a_kept_connection() -> None:
    """CONFIG.shared: the models on more than one host ("" this host), and only those; the
    question's location reaches gpud's GET /v1/route on connections nginx keeps."""
    router = _router(RoutedPeer("b", "http", "10.0.0.2", 80, KEY, ("ocr", "chat")),
                     RoutedPeer("c", "http", "10.0.0.3", 80, KEY, ("ocr", "embed")))
    assert shared_table(["chat"], router.peers) == {"chat": ["", "b"], "ocr": ["b", "c"]}
    text = render_script(router, "")
    config = json.loads(text.split("var CONFIG = ", 1)[1].rsplit(";", 1)[0])
    assert config["shared"] == {"chat": ["", "b"], "ocr": ["b", "c"]}
    assert '\nvar ROUTE_LOCATION = "/.gpud-router-route";\n' in text
    out = "\n".join(http_lines(router)).split("\n")
    upstream = out[out.index("    upstream router_gpud_route {"):][:4]
    assert upstream[2] == "        keepalive 2;", upstream
    location = _location(out, "= /.gpud-router-route")
    assert "            internal;" in location
    assert "            proxy_pass http://router_gpud_route/v1/route;" in location
    assert "            proxy_http_version 1.1;" in location
    assert '            proxy_set_header Connection "";' in location


def test_the_script_knows_each_peer_its_models_and_open_circuits() -> None:
    text = render_script(_router(
        RoutedPeer("b", "http", "10.0.0.2", 80, KEY, ("ocr", "chat")),
        RoutedPeer("c", "http", "10.0.0.3", 80, KEY, ("ocr",), open_reason="cannot connect",
                   open_since=12.0)), "")
    config = json.loads(text.split("var CONFIG = ", 1)[1].rsplit(";", 1)[0])
    assert config["host"] == "node1"
    assert config["peer_models"] == {"ocr": ["b", "c"]}
    assert config["peers"] == {"b": {"location": "@router_peer_b", "open": None},
                               "c": {"location": "@router_peer_c",
                                     "open": {"reason": "cannot connect", "since": 12.0}}}
    # the key goes to nginx.conf only (0640, root's, the front's group), never the script
    assert KEY not in text


def test_the_access_log_names_the_peer_and_its_model() -> None:
    line = json.dumps({"model": "ocr", "serve": "", "status": "200", "request_s": "0.010",
                       "upstream_s": "0.009", "ensure_s": "", "sse": "", "key": "alice",
                       "ts": "1.0", "prompt_tokens": "", "completion_tokens": "",
                       "complete": "OK", "peer": "b"})
    answered = parse_log_line(line, {"chat": "chat"})
    assert answered is not None
    assert (answered.peer, answered.model, answered.serve, answered.status_class) == (
        "b", "ocr", "", "2xx")
    # a line of an older config has no peer: answered here
    old = json.loads(line)
    del old["peer"]
    answered = parse_log_line(json.dumps(old), {"chat": "chat"})
    assert answered is not None and answered.peer == "" and answered.model == ""


def test_an_https_peer_names_the_ca_its_certificate_is_checked_against() -> None:
    with pytest.raises(ValueError, match="peer b: https needs the CA file"):
        RoutedPeer("b", "https", "node2.tailnet", 443, KEY)
    with pytest.raises(ValueError, match="peer b: https needs the CA file"):
        RoutedPeer("b", "https", "node2.tailnet", 443, KEY, tls_ca="/etc/my ca.pem")
