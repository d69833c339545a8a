"""One policy, every way in (docs/security.md, "Keys cover every way in"): a key's limits and
its usage are the same through the router and through a serve's own fronted port, one limit
and one count (the same nginx zones, the same access log), the fronted port's lines made from
the router's own parts (gpud.core.routerconf.front_policy). The real nginx and njs before a
stand-in, the router and the fronted port in one front."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpud.core.front import FrontConfig, FrontServe, render
from gpud.core.keys import parse_keys
from gpud.core.router import RoutedServe, RouterFront
from gpud.core.routerconf import front_policy, http_lines, main_lines
from gpud.core.routerlog import Answered, parse_log_line
from gpud.nginx.router import script_text
from tests.ports import connects, free_port
from tests.test_router import NGINX, NJS, _req
from tests.waiting import wait_until

ALICE, BOB, PROBE = "sk-alice-0123456789", "sk-bob-01234567890", "sk-probe-0123456789"
KEYS = f"""\
[keys.alice]
token = "{ALICE}"
models = ["a"]
max_concurrent = 1
[keys.bob]
token = "{BOB}"
models = ["a"]
requests_per_minute = 3
[keys.probe]
token = "{PROBE}"
models = ["*"]
"""


@dataclass
class Doors:
    router: int
    front: int
    log: Path


@pytest.fixture
def doors() -> Iterator[Doors]:
    keys, problems = parse_keys(KEYS, ["a"])
    assert problems == []
    tmp = Path(tempfile.mkdtemp(prefix="gpud-doors-"))
    tmp.chmod(0o755)
    sock, run = tmp / "a.sock", tmp / "run"
    for name in ("", "body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (run / name).mkdir(exist_ok=True)
    port, fport = free_port(), free_port()
    router = RouterFront(f"127.0.0.1:{port}", (RoutedServe("a", ("a",), socket=str(sock)),),
                         njs_module=str(NJS), script=str(tmp / "router.js"),
                         gpud_socket=str(tmp / "no-gpud.sock"), keys=tuple(keys),
                         access_log=str(tmp / "access.log"))
    policy = front_policy(router, "a")
    (tmp / "router.js").write_text(script_text(router))
    (tmp / "nginx.conf").write_text(render(FrontConfig(
        serves=(FrontServe("a", fport, str(sock)),), run_dir=str(run), listen="127.0.0.1",
        main_extra=tuple(main_lines(router)), http_extra=tuple(http_lines(router)),
        keys=True, policies=(("a", policy),))))
    serve = subprocess.Popen([sys.executable, "-m", "gpud.testing.standin", "serve", "m",
                              "--token-interval-s", "0.2", "--uds", str(sock),
                              "--served-model-name", "a"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    errors = (tmp / "nginx.log").open("wb")
    nginx = subprocess.Popen([str(NGINX), "-c", str(tmp / "nginx.conf"), "-p", f"{run}/"],
                             stdout=subprocess.DEVNULL, stderr=errors)
    try:
        wait_until(sock.exists, what="a's socket")
        os.chmod(sock, 0o777)
        wait_until(lambda: connects(port) and connects(fport), what="the front listening")
        wait_until(lambda: _req(fport, "GET", "/health", None,
                                {"Authorization": f"Bearer {PROBE}"})[0] == 200,
                   what="a answering")
        yield Doors(port, fport, tmp / "access.log")
    except BaseException:
        errors.flush()
        print((tmp / "nginx.log").read_text())
        raise
    finally:
        for proc in (nginx, serve):
            proc.terminate()
            proc.wait(timeout=10)
        errors.close()


def _ask(port: int, token: str, doc: dict[str, object]) -> tuple[int, dict[str, object]]:
    status, _h, body = _req(port, "POST", "/v1/chat/completions", json.dumps(doc).encode(),
                            {"Authorization": f"Bearer {token}",
                             "Content-Type": "application/json"})
    return status, json.loads(body)


CHAT = {"model": "a", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def _logged(doors: Doors, n: int, key: str) -> list[Answered]:
    """KEY's lines of the access log, once there are N (nginx writes a request's line after
    its answer is sent: the client can have the answer first)."""
    def lines() -> list[Answered]:
        text = doors.log.read_text() if doors.log.exists() else ""
        got = [parse_log_line(line, {"a": "a"}) for line in text.splitlines()]
        return [a for a in got if a is not None and a.key == key]
    wait_until(lambda: len(lines()) >= n, what=f"{n} lines of {key} in the access log")
    return lines()


def test_a_keys_max_concurrent_is_one_limit_whichever_way_its_requests_come(
        doors: Doors) -> None:
    for holder, other in ((doors.router, doors.front), (doors.front, doors.router)):
        conn = http.client.HTTPConnection("127.0.0.1", holder, timeout=30)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(
            {**CHAT, "max_tokens": 30, "stream": True}),
            headers={"Authorization": f"Bearer {ALICE}", "Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")  # in flight
        status, doc = _ask(other, ALICE, CHAT)
        assert status == 429, doc
        assert doc["error"]["gpud"]["limit"] == "max_concurrent", doc  # type: ignore[index]
        conn.close()
        # another key is not held by alice's limit, on either way in
        assert _ask(other, PROBE, CHAT)[0] == 200


def test_a_keys_requests_per_minute_is_one_limit_and_its_usage_one_count(doors: Doors) -> None:
    answers = [_ask(door, BOB, CHAT) for door in
               (doors.router, doors.front, doors.router, doors.front, doors.router)]
    assert [status for status, _ in answers] == [200, 200, 200, 429, 429], answers
    refused = answers[3][1]["error"]
    assert refused["gpud"]["limit"] == "requests_per_minute", refused  # type: ignore[index]
    # usage: every request counted under its key and the model, with the serve's usage
    got = _logged(doors, 5, "bob")
    assert [(a.model, a.status) for a in got] == [("a", s) for s, _ in answers]
    for a, (status, doc) in zip(got, answers, strict=True):
        if status == 200:
            usage = doc["usage"]
            assert (a.prompt_tokens, a.completion_tokens) == (
                usage["prompt_tokens"], usage["completion_tokens"])  # type: ignore[index]


def test_a_fronted_port_still_refuses_a_request_without_a_key(doors: Doors) -> None:
    status, _h, body = _req(doors.front, "POST", "/v1/chat/completions",
                            json.dumps(CHAT).encode(), {"Content-Type": "application/json"})
    assert status == 401, body
