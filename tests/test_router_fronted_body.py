"""One body, every way in (docs/security.md, "Keys cover every way in"): a request through a
serve's own fronted port reaches the serve with the same body as through the router: the
key's priority (or the share's) in its top-level "priority", a stream's usage asked, every
other byte as sent, by the same code (router.js keyPriority, askUsage). The real nginx and
njs, the router and the fronted port in one front, before a serve on a Unix socket that
records the bytes it is sent and answers as vLLM 0.32 does."""

from __future__ import annotations

import http.client
import http.server
import json
import os
import socketserver
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpud.config import parse_config
from gpud.core.front import SEND_LOCATION, FrontConfig, FrontServe, render
from gpud.core.keys import parse_keys
from gpud.core.router import RoutedServe, RouterFront
from gpud.core.routerconf import front_policy, http_lines, main_lines
from gpud.core.routerlog import Answered, parse_log_line
from gpud.nginx.front import front_config
from gpud.nginx.router import router_front, script_text
from tests.ports import connects, free_port
from tests.test_router import NGINX, NJS, TOML
from tests.test_router_priority_bytes import TRICKY
from tests.test_router_stream_usage import WORDS, vllm_stream
from tests.waiting import wait_until

BATCH, PLAIN, BOTH = "sk-batch-0123456789", "sk-plain-0123456789", "sk-both-01234567890"
KEYS = f"""\
[keys.batch]
token = "{BATCH}"
models = ["a"]
priority = 7
[keys.plain]
token = "{PLAIN}"
models = ["a"]
[keys.both]
token = "{BOTH}"
models = ["a", "a2"]
"""


@dataclass
class Doors:
    router: int
    front: int
    bodies: list[bytes]
    log: Path


class _UnixHTTP(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def recording_serve(path: str, bodies: list[bytes],
                    release: threading.Event | None = None) -> _UnixHTTP:
    """A serve on the Unix socket PATH that records each body and answers as vLLM 0.32 does:
    a stream (vllm_stream), else one JSON document with the usage. A stream whose body's
    "user" is "hold" is held after its first event until RELEASE is set."""

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            bodies.append(body)
            doc = json.loads(body)
            if doc.get("stream") is True:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for i, event in enumerate(vllm_stream(self.path, doc)):
                    if i == 1 and doc.get("user") == "hold" and release is not None:
                        release.wait(timeout=30)
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                return
            out = b'{"usage": {"prompt_tokens": 5, "completion_tokens": 2}}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def address_string(self) -> str:
            return "unix"

        def log_message(self, *args: object) -> None:
            pass

    return _UnixHTTP(path, Handler)


@pytest.fixture
def doors() -> Iterator[Doors]:
    keys, problems = parse_keys(KEYS, ["a", "a2"])
    assert problems == []
    tmp = Path(tempfile.mkdtemp(prefix="gpud-body-doors-"))
    tmp.chmod(0o755)
    sock, run = tmp / "a.sock", tmp / "run"
    for name in ("", "body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (run / name).mkdir(exist_ok=True)
    bodies: list[bytes] = []
    serve = recording_serve(str(sock), bodies)
    os.chmod(sock, 0o777)
    threading.Thread(target=serve.serve_forever, daemon=True).start()
    port, fport = free_port(), free_port()
    router = RouterFront(f"127.0.0.1:{port}",
                         (RoutedServe("a", ("a", "a2"), socket=str(sock),
                                      priority_scheduling=True, stream_usage=True),),
                         njs_module=str(NJS), script=str(tmp / "router.js"),
                         gpud_socket=str(tmp / "no-gpud.sock"), keys=tuple(keys),
                         max_body_mib=4, access_log=str(tmp / "access.log"))
    policy = front_policy(router, "a")
    (tmp / "router.js").write_text(script_text(router))
    (tmp / "nginx.conf").write_text(render(FrontConfig(
        serves=(FrontServe("a", fport, str(sock)),), run_dir=str(run), listen="127.0.0.1",
        main_extra=tuple(main_lines(router)), http_extra=tuple(http_lines(router)),
        keys=True, policies=(("a", policy),))))
    errors = (tmp / "nginx.log").open("wb")
    nginx = subprocess.Popen([str(NGINX), "-c", str(tmp / "nginx.conf"), "-p", f"{run}/"],
                             stdout=subprocess.DEVNULL, stderr=errors)
    try:
        wait_until(lambda: connects(port) and connects(fport), what="the front listening")
        yield Doors(port, fport, bodies, tmp / "access.log")
        errors.flush()
        assert "js exception" not in (tmp / "nginx.log").read_text()
    except BaseException:
        errors.flush()
        print((tmp / "nginx.log").read_text())
        raise
    finally:
        nginx.terminate()
        nginx.wait(timeout=10)
        serve.shutdown()
        serve.server_close()
        errors.close()


def _send(doors: Doors, door: int, token: str, body: bytes,
          route: str = "/v1/chat/completions") -> tuple[int, bytes, bytes | None]:
    """Status, answer, and the bytes the serve got (None: nothing)."""
    before = len(doors.bodies)
    conn = http.client.HTTPConnection("127.0.0.1", door, timeout=10)
    try:
        conn.request("POST", route, body=body, headers={
            "Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        resp = conn.getresponse()
        status, answer = resp.status, resp.read()
    finally:
        conn.close()
    return status, answer, doors.bodies[before] if len(doors.bodies) > before else None


def _lines(doors: Doors) -> list[Answered]:
    text = doors.log.read_text() if doors.log.exists() else ""
    got = [parse_log_line(line, {"a": "a"}) for line in text.splitlines()]
    return [a for a in got if a is not None]


@pytest.mark.parametrize("pad", [0, 70_000])  # parsed, and walked (64 KiB and more)
def test_the_keys_priority_is_put_in_through_the_fronted_port_as_through_the_router(
        doors: Doors, pad: int) -> None:
    body = TRICKY.replace(b'"m"', b'"a"', 1)
    body = body[:-1] + (b', "pad": "' + b"p" * pad + b'"' if pad else b"") + b"}"
    brace = body.index(b"{") + 1
    for token, prio in ((BATCH, b"7"), (PLAIN, b"0")):  # the key's, the share's base
        got = []
        for door in (doors.router, doors.front):
            status, answer, sent = _send(doors, door, token, body)
            assert status == 200, (door, answer)
            got.append(sent)
        assert got[0] == got[1] == body[:brace] + b'"priority":' + prio + b"," + body[brace:]
    # a client's own priority is replaced in place, a second one refused, on either way in
    own = b'{"model": "a", "priority" : -1000, "seed": 9007199254740993}'
    for door in (doors.router, doors.front):
        status, answer, sent = _send(doors, door, BATCH, own)
        assert status == 200 and sent == own.replace(b"-1000", b"7"), (door, answer, sent)
        status, answer, sent = _send(doors, door, BATCH,
                                     b'{"model": "a", "priority": 1, "priority": -9}')
        assert status == 400 and sent is None, (door, answer)
        assert json.loads(answer)["error"]["code"] == "invalid_priority"


def test_a_stream_that_did_not_ask_is_metered_the_same_through_the_fronted_port(
        doors: Doors) -> None:
    body = b'{"model": "a", "stream": true, "prompt": "\\u00e9 ' + "\U0001F600".encode() + b'"}'
    for door in (doors.router, doors.front):
        n = len(_lines(doors))
        status, answer, sent = _send(doors, door, PLAIN, body, "/v1/completions")
        assert status == 200, answer
        assert sent == (b'{"stream_options":{"include_usage":true},"priority":0,'
                        + body[1:]), sent
        assert answer == b"".join(vllm_stream("/v1/completions", json.loads(body)))
        wait_until(lambda: len(_lines(doors)) > n, what="the request's log line")  # noqa: B023
        line = _lines(doors)[-1]
        assert (line.key, line.model, line.prompt_tokens, line.completion_tokens) == (
            "plain", "a", 11, len(WORDS)), (door, line)


def test_a_fronted_port_answers_a_model_it_does_not_serve_as_the_router(doors: Doors) -> None:
    # a name of no serve; a name of the port's serve the key may not use: the router's 404,
    # byte for byte, before the serve is reached
    for token, model in ((PLAIN, "nope"), (PLAIN, "a2"), (BOTH, "a3")):
        body = b'{"model": "%s", "messages": []}' % model.encode()
        got = [_send(doors, door, token, body) for door in (doors.router, doors.front)]
        assert got[0] == got[1], (model, got)
        status, answer, sent = got[0]
        assert status == 404 and sent is None, (model, answer)
        assert json.loads(answer)["error"]["code"] == "model_not_found"
    # a name of the serve's the key may use, through either door, counted under that name
    # (nginx logs a request once its answer is sent: each door's line awaited by its count)
    def counted() -> int:
        text = doors.log.read_text() if doors.log.exists() else ""
        return sum(1 for line in text.splitlines()
                   if json.loads(line)["model"] == "a2" and json.loads(line)["status"] == "200")
    for i, door in enumerate((doors.router, doors.front)):
        status, answer, sent = _send(doors, door, BOTH, b'{"model": "a2", "messages": []}')
        assert status == 200 and sent is not None, answer
        wait_until(lambda: counted() == i + 1, what="the request's log line")  # noqa: B023
    # no model at all: the router needs one (400); the serve's own port lets vLLM take it as
    # its first name's (vllm 0.32 _is_model_supported: none named is supported)
    status, answer, _sent = _send(doors, doors.router, PLAIN, b'{"messages": []}')
    assert status == 400 and json.loads(answer)["error"]["code"] == "missing_model"
    status, answer, sent = _send(doors, doors.front, PLAIN, b'{"messages": []}')
    assert status == 200 and sent == b'{"priority":0,"messages": []}', (answer, sent)


def test_a_fronted_port_answers_a_body_over_max_body_mib_as_the_router(doors: Doors) -> None:
    body = b'{"model": "a", "pad": "' + b"p" * (4 * 1024 * 1024) + b'"}'
    got = [_send(doors, door, PLAIN, body) for door in (doors.router, doors.front)]
    assert got[0] == got[1], [g[:2] for g in got]
    status, answer, sent = got[0]
    assert status == 413 and sent is None
    assert json.loads(answer)["error"]["code"] == "request_too_large", answer


def test_gpud_gives_a_fronted_vllm_serve_the_routers_body_routes() -> None:
    text = TOML.replace('listen = "127.0.0.1:8000"\n',
                        'listen = "127.0.0.1:8000"\napi_keys_file = "/etc/gpud/keys.toml"\n')
    cfg = parse_config(text, "t")
    keys, problems = parse_keys('[keys.k]\ntoken = "sk-k-0123456789abcdef"\nmodels = ["*"]\n',
                                ["chat", "chat-fast", "ocr", "read", "tool"])
    assert problems == []
    router = router_front(cfg, tuple(keys))
    assert router is not None
    # vLLM serves have their streams' usage asked; a command serve is not known to read it
    assert {s.name: s.stream_usage for s in router.serves} == {
        "chat": True, "ocr": True, "tool": False}
    conf = render(front_config(cfg, router))
    chat = conf[conf.index("listen 127.0.0.1:30001;"):]
    chat = chat[:chat.index("\n    }\n")]
    # chat's own port reads the body of its priority routes through the router's script
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings"):
        assert f"        location = {path} {{" in chat, path
    assert chat.count("js_content router.fronted;") == 4
    assert f"location {SEND_LOCATION} {{" in chat and "proxy_set_body $router_fair_body;" in chat


def test_gpud_gives_a_fronted_port_the_routers_policy_without_keys_too() -> None:
    cfg = parse_config(TOML, "t")
    router = router_front(cfg, None)
    assert router is not None and router.keys is None
    conf = render(front_config(cfg, router))
    chat = conf[conf.index("listen 127.0.0.1:30001;"):]
    chat = chat[:chat.index("\n    }\n")]
    # no key's check, but the port's serve for the script, the body routes it rewrites (the
    # share's priority, a stream's usage asked), the meter and the access log
    assert "$router_key_ok" not in chat
    assert "        set $gpud_serve chat;" in chat
    assert chat.count("js_content router.fronted;") == 4
    assert "proxy_set_body $router_fair_body;" in chat
    assert "js_body_filter router.meter" in chat
    assert "access_log " in chat
