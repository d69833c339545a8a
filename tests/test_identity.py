"""Who is asking (docs/router.md): the router and a front tell gpud who asked on every ensure
(X-Gpud-Requester: the key's name, else addr: and the client's address), and the X-Gpud-*
headers gpud reads are nginx's alone: a client's own never reach gpud nor the serve.

Real nginx with the real njs module, a stand-in gpud on a Unix socket that keeps each
ensure's headers, and a serve that answers with the headers it was sent."""

from __future__ import annotations

import hashlib
import http.client
import http.server
import json
import os
import shutil
import socketserver
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpud.core.front import FrontConfig, FrontServe, render
from gpud.core.keys import ApiKey
from gpud.core.nginxblocks import GPUD_REQUEST_HEADERS
from gpud.core.router import ANONYMOUS, EnsureBound, RoutedServe, RouterFront, RouterRequest, router_request
from gpud.core.routerconf import http_lines, main_lines
from gpud.nginx.router import script_text
from tests.ports import connects, free_port
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[1]
NGINX = REPO / ".venv" / "bin" / "nginx"
NJS = REPO / ".venv" / "lib" / "nginx" / "modules" / "ngx_http_js_module.so"
TOKEN = "sk-alice-0123456789abcdef"
# every header gpud reads, and one it does not (yet): none reaches gpud from a client
FORGED = {"X-Gpud-Model": "forged", "X-Gpud-Key": "root", "X-Gpud-Requester": "someone-else",
          "X-Gpud-Priority": "99"}


def _read_by_gpud(headers: dict[str, str]) -> dict[str, str]:
    """What the serve would carry of the names gpud reads (nginx cannot drop a header by
    prefix: the names gpud reads are dropped; the serve reads none of them)."""
    names = {n.lower() for n in GPUD_REQUEST_HEADERS}
    return {k: v for k, v in headers.items() if k in names}


class _Unix(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    seen: list[dict[str, str]]


class _Recorder(http.server.BaseHTTPRequestHandler):
    """gpud's ensure (204, keeping its headers) and the serve (200, answering its headers)."""

    server: _Unix

    def do_POST(self) -> None:
        headers = {k.lower(): v for k, v in self.headers.items()}
        self.server.seen.append(headers)
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        body = json.dumps({"headers": headers}).encode()
        self.send_response(204 if self.path.endswith("/ensure") else 200)
        self.send_header("Content-Length", "0" if self.path.endswith("/ensure")
                         else str(len(body)))
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        if not self.path.endswith("/ensure"):
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@dataclass
class Rig:
    router: int
    front: int
    gpud: _Unix
    serve: _Unix


def _post(port: int, path: str, headers: dict[str, str]) -> tuple[int, dict[str, object]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", path, body=b'{"model": "e", "prompt": "x"}',
                     headers={"Content-Type": "application/json", **headers})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def _unix(path: Path) -> _Unix:
    server = _Unix(str(path), _Recorder)
    server.seen = []
    os.chmod(path, 0o777)  # nginx's workers run as nobody here
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def rig() -> Iterator[Rig]:
    """nginx: the router (keys on: alice may use e) and a front on its own port, both before
    on-demand serve `e` (a recorder), asking a recording gpud to have it up."""
    for path in (NGINX, NJS):
        if not path.exists():
            pytest.fail(f"{path} missing: run scripts/setup-test")
    tmp = Path(tempfile.mkdtemp(prefix="gpud-identity-"))
    tmp.chmod(0o755)
    run = tmp / "run"
    for name in ("", "body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (run / name).mkdir(exist_ok=True)
    gpud, serve = _unix(tmp / "gpud.sock"), _unix(tmp / "e.sock")
    port, front = free_port(), free_port()
    key = ApiKey("alice", hashlib.sha256(TOKEN.encode()).hexdigest(), ("e",))
    router = RouterFront(f"127.0.0.1:{port}",
                         (RoutedServe("e", ("e",), socket=str(tmp / "e.sock"),
                                      ensure_timeout_s=30),),
                         njs_module=str(NJS), script=str(tmp / "router.js"),
                         gpud_socket=str(tmp / "gpud.sock"), keys=(key,))
    (tmp / "router.js").write_text(script_text(router))
    (tmp / "nginx.conf").write_text(render(FrontConfig(
        serves=(FrontServe("e", front, str(tmp / "e.sock"), ensure_timeout_s=30),),
        run_dir=str(run), gpud_socket=str(tmp / "gpud.sock"),
        main_extra=tuple(main_lines(router)), http_extra=tuple(http_lines(router)),
        keys=True)))
    log = (tmp / "nginx.log").open("wb")
    nginx = subprocess.Popen([str(NGINX), "-c", str(tmp / "nginx.conf"), "-p", f"{run}/"],
                             stdout=subprocess.DEVNULL, stderr=log)
    try:
        for p in (port, front):
            wait_until(lambda p=p: connects(p), what="nginx listening")  # type: ignore[misc]
        yield Rig(port, front, gpud, serve)
    except BaseException:
        log.flush()
        print((tmp / "nginx.log").read_text())
        raise
    finally:
        nginx.terminate()
        nginx.wait(timeout=10)
        for server in (gpud, serve):
            server.shutdown()
            server.server_close()
        log.close()
        shutil.rmtree(tmp)


def _gpud_headers(seen: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in seen.items() if k.startswith("x-gpud-")}


def test_the_router_names_the_key_as_requester_and_drops_a_clients_gpud_headers(
        rig: Rig) -> None:
    status, doc = _post(rig.router, "/v1/completions",
                        {"Authorization": f"Bearer {TOKEN}", **FORGED})
    assert status == 200, doc
    [ensure] = rig.gpud.seen
    assert _gpud_headers(ensure) == {"x-gpud-model": "e", "x-gpud-key": "alice",
                                     "x-gpud-requester": "alice"}
    # gpud gets none of the client's headers at all (its token neither)
    assert "authorization" not in ensure and "content-type" not in ensure, ensure
    # the serve gets the client's request, without any X-Gpud-* header
    served = doc["headers"]
    assert isinstance(served, dict) and not _read_by_gpud(served), served
    assert served["authorization"] == f"Bearer {TOKEN}"


def test_with_keys_a_fronted_port_takes_the_same_keys_and_names_the_key(rig: Rig) -> None:
    """M4: with keys on, a serve's own port (its front) takes the router's keys, checked
    before the body (at e8f41a4 it answered anyone); who asked is the key's name."""
    status, doc = _post(rig.front, "/v1/completions", FORGED)
    assert status == 401 and doc["error"]["code"] == "invalid_api_key", doc  # type: ignore[index]
    assert rig.gpud.seen == [] and rig.serve.seen == []
    status, doc = _post(rig.front, "/v1/completions",
                        {"Authorization": f"Bearer {TOKEN}", **FORGED})
    assert status == 200, doc
    [ensure] = rig.gpud.seen
    assert _gpud_headers(ensure) == {"x-gpud-requester": "alice"}
    served = doc["headers"]
    assert isinstance(served, dict) and not _read_by_gpud(served), served


def test_a_front_without_keys_names_the_clients_address() -> None:
    text = render(FrontConfig(serves=(FrontServe("e", 30001, "/s/e.sock", 30),)))
    assert "proxy_set_header X-Gpud-Requester addr:$gpud_requester_addr;" in text
    # every loopback address one requester (docs/security.md)
    assert '        "~^127\\." loopback;' in text
    assert "$router_key_ok" not in text


def test_every_header_gpud_reads_is_dropped_from_clients_in_the_config() -> None:
    text = render(FrontConfig(serves=(FrontServe("e", 30001, "/s/e.sock", 30),)))
    for name in GPUD_REQUEST_HEADERS:
        assert f'    proxy_set_header {name} "";' in text
    # both ensures pass no client header to gpud
    lines = "\n".join(http_lines(RouterFront("127.0.0.1:8000", (
        RoutedServe("e", ("e",), port=1, ensure_timeout_s=30),))))
    for conf in (text, lines):
        ensure = conf[conf.index("/ensure;"):]
        assert "proxy_pass_request_headers off;" in ensure[:400]


def test_the_router_request_of_an_ensures_headers() -> None:
    assert router_request({}) is None
    front = router_request({"X-Gpud-Requester": "addr:10.0.0.7"})
    assert front == RouterRequest(None, None, "addr:10.0.0.7")
    assert front is not None and front.text == "on-demand request from 'addr:10.0.0.7'"
    keyed = router_request({"X-Gpud-Model": "chat", "X-Gpud-Key": "ci",
                            "X-Gpud-Requester": "ci"})
    assert keyed == RouterRequest("chat", "ci", "ci")
    # an older front's ensure: the key's name, else anonymous
    assert RouterRequest("chat", "ci").requester == "ci"
    assert RouterRequest("chat").requester == ANONYMOUS
    # kept to a key's name, "/" and a peer's forwarded requester (PEER/NAME): 64 + 1 + 64
    long = router_request({"X-Gpud-Requester": "x" * 500})
    assert long is not None and len(long.requester) == 129


def test_ensures_are_bounded_per_requester_and_in_all() -> None:
    bound = EnsureBound.empty(per_requester=2, total=3)
    assert bound.enter("alice") is None and bound.enter("alice") is None
    refused = bound.enter("alice")
    assert refused is not None and (refused.limit, refused.value) == (
        "daemon.ensure_waiting_per_requester", 2)
    assert refused.text == ("2 requests of alice wait for a bring-up already "
                            "(daemon.ensure_waiting_per_requester)")
    # another requester is not held by alice's
    assert bound.enter("bob") is None
    full = bound.enter("carol")
    assert full is not None and (full.limit, full.value) == ("daemon.ensure_waiting_total", 3)
    assert "daemon.ensure_waiting_total" in full.text
    assert bound.by == {"alice": 2, "bob": 1}
    bound.leave("alice")
    assert bound.enter("carol") is None
    for name in ("alice", "bob", "carol"):
        bound.leave(name)
    assert bound.by == {} and bound.waiting == 0
