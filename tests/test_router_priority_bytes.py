"""The key's priority on every body, every other byte as sent (docs/router.md, "Who is
asking"): the real nginx and njs with the router gpud renders, before a serve under priority
scheduling that records the bytes it is sent."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from gpud.core.keys import parse_keys
from gpud.core.router import RoutedServe, RouterFront
from tests.ports import free_port
from tests.routerrig import NJS, Handler, router_dir, router_running, serving, tcp_server
from tests.test_router import _req

KEYS = """\
[keys.batch]
token = "sk-batch-0123456789"
models = ["m"]
priority = 7
[keys.plain]
token = "sk-plain-0123456789"
models = ["m"]
"""


@dataclass
class Recorder:
    port: int
    bodies: list[bytes]


@dataclass
class PrioRig:
    port: int
    serve: Recorder


@pytest.fixture
def prio_rig() -> Iterator[PrioRig]:
    bodies: list[bytes] = []

    class Serve(Handler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            bodies.append(self.read_body())
            self.answer(200, b'{"usage": {"prompt_tokens": 1, "completion_tokens": 1}}')

    keys, problems = parse_keys(KEYS, ["m"])
    assert problems == []
    server = tcp_server(Serve)
    with router_dir("gpud-router-prio-") as tmp, serving(server):
        port = free_port()
        router = RouterFront(f"127.0.0.1:{port}",
                             (RoutedServe("m", ("m",), port=server.server_address[1],
                                          priority_scheduling=True),),
                             njs_module=str(NJS), script=str(tmp / "router.js"),
                             gpud_socket=str(tmp / "no-gpud.sock"), max_body_mib=4,
                             body_timeout_s=5, keys=tuple(keys))
        with router_running(tmp, router):
            yield PrioRig(port, Recorder(server.server_address[1], bodies))


def _send(rig: PrioRig, token: str, body: bytes) -> tuple[int, bytes, bytes | None]:
    """Status, answer, and the bytes the serve got (None: it got nothing)."""
    before = len(rig.serve.bodies)
    status, _h, answer = _req(rig.port, "POST", "/v1/chat/completions", body,
                              {"Authorization": f"Bearer {token}",
                               "Content-Type": "application/json"})
    got = rig.serve.bodies[before] if len(rig.serve.bodies) > before else None
    return status, answer, got


# a body json.dumps would not give back: an integer past 2^53, escapes (a lone surrogate, a
# quote, a slash escaped), a key given twice, non-BMP text raw and escaped, odd spacing
TRICKY = (b'{ "model" : "m",\n\t"seed": 123456789012345678901234567890,'
          b' "messages": [{"role": "user", "content": "a \\ud800 lone \\"q\\" \\/ '
          + "\U0001F600 raw \u00e9".encode() + b' \\ud83d\\ude00"}],'
          b' "temperature": 1.0E+0, "n": 1, "n": 2, "x": [1.50, -0.0, 1e400] }')


@pytest.mark.parametrize("pad", [0, 70_000])  # parsed, and walked (64 KiB and more)
def test_the_keys_priority_is_put_in_and_every_other_byte_goes_as_sent(
        prio_rig: PrioRig, pad: int) -> None:
    body = TRICKY[:-1] + (b', "pad": "' + b"p" * pad + b'"' if pad else b"") + b"}"
    status, answer, got = _send(prio_rig, "sk-batch-0123456789", body)
    assert status == 200, answer
    brace = body.index(b"{") + 1
    assert got == body[:brace] + b'"priority":7,' + body[brace:]
    # without a key's priority: 0, the share's base
    status, answer, got = _send(prio_rig, "sk-plain-0123456789", body)
    assert status == 200, answer
    assert got == body[:brace] + b'"priority":0,' + body[brace:]


@pytest.mark.parametrize("pad", [0, 70_000])
def test_a_clients_own_priority_is_replaced_in_place(prio_rig: PrioRig, pad: int) -> None:
    for given in (b"-1000", b'"high"', b"{\"a\": [1, 2]}", b"-1e3"):
        body = (b'{"model": "m", "priority" : ' + given + b', "seed": 9007199254740993'
                + (b', "pad": "' + b"p" * pad + b'"' if pad else b"") + b"}")
        status, answer, got = _send(prio_rig, "sk-batch-0123456789", body)
        assert status == 200, answer
        assert got == body.replace(b'"priority" : ' + given, b'"priority" : 7'), got
    # the key written with an escape is the same key to the serve's json.loads
    body = b'{"model": "m", "pri\\u006frity": -5}'
    status, answer, got = _send(prio_rig, "sk-batch-0123456789", body)
    assert status == 200 and got == b'{"model": "m", "pri\\u006frity": 7}', (answer, got)


def test_a_priority_given_twice_is_refused_naming_it(prio_rig: PrioRig) -> None:
    body = b'{"model": "m", "priority": 1, "messages": [], "priority": -9}'
    status, answer, got = _send(prio_rig, "sk-batch-0123456789", body)
    assert status == 400 and got is None, answer
    error = json.loads(answer)["error"]
    assert (error["code"], error["param"]) == ("invalid_priority", "priority"), error
    assert '"priority" 2 times' in error["message"], error
