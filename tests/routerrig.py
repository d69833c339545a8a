"""The router's nginx on loopback, and the stand-ins it talks to, for the tests and benches that
run it: the config and script this tree's gpud renders (gpud.core.front.render,
gpud.core.routerconf's lines, gpud.nginx.router.script_text) under the nginx and njs module
scripts/setup-test unpacks into .venv, before stand-in serves, gpuds and peers that answer over
HTTP on a Unix socket or a loopback port. Standard library and gpud only (no pytest): bench/
imports it too."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shutil
import socketserver
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from gpud.core.front import FrontConfig, render
from gpud.core.router import RouterFront
from gpud.core.routerconf import http_lines, main_lines
from gpud.nginx.router import script_text
from tests.ports import connects
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[1]
NGINX = REPO / ".venv" / "bin" / "nginx"
NJS = REPO / ".venv" / "lib" / "nginx" / "modules" / "ngx_http_js_module.so"
# the temporary directories nginx keeps under its prefix
TEMP_DIRS = ("", "body", "proxy", "fastcgi", "uwsgi", "scgi")


def need_nginx() -> None:
    """AssertionError naming what is missing when .venv has no nginx or njs module."""
    for path in (NGINX, NJS):
        if not path.exists():
            raise AssertionError(f"{path} missing: run scripts/setup-test")


@contextlib.contextmanager
def router_dir(prefix: str) -> Iterator[Path]:
    """A fresh directory (PREFIX its name's start) that nginx's workers, run as nobody, can
    read; removed afterwards."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        tmp.chmod(0o755)
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_router(router: RouterFront, run: Path, conf: Path,
                 front: FrontConfig | None = None) -> None:
    """ROUTER's script (at router.script) and nginx's config at CONF: the router's lines added
    to FRONT (default: no fronted serves), nginx's prefix RUN (made, with nginx's temporary
    directories)."""
    for name in TEMP_DIRS:
        (run / name).mkdir(parents=True, exist_ok=True)
    Path(router.script).write_text(script_text(router))
    base = front if front is not None else FrontConfig(serves=())
    conf.write_text(render(replace(base, run_dir=str(run),
                                   main_extra=(*base.main_extra, *main_lines(router)),
                                   http_extra=(*base.http_extra, *http_lines(router)))))


def start_nginx(conf: Path, run: Path, log: Path,
                prefix: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    """nginx with CONF, its prefix RUN, its error output to LOG (PREFIX before it: taskset)."""
    with log.open("wb") as err:
        return subprocess.Popen([*prefix, str(NGINX), "-c", str(conf), "-p", f"{run}/"],
                                stdout=subprocess.DEVNULL, stderr=err)


@contextlib.contextmanager
def nginx_running(tmp: Path, *ports: int) -> Iterator[subprocess.Popen[bytes]]:
    """nginx with TMP/nginx.conf (prefix TMP/run, errors to TMP/nginx.log) until the end,
    once it listens on each of PORTS: AssertionError with its log if it does not; its log
    printed if anything fails while it runs."""
    log = tmp / "nginx.log"
    nginx = start_nginx(tmp / "nginx.conf", tmp / "run", log)
    try:
        for port in ports:
            try:
                wait_until(lambda p=port: connects(p),  # type: ignore[misc]
                           what=f"nginx listening on {port}")
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n{log.read_text()}") from None
        yield nginx
    except BaseException:
        print(log.read_text())
        raise
    finally:
        nginx.terminate()
        nginx.wait(timeout=10)


@contextlib.contextmanager
def router_running(tmp: Path, router: RouterFront, *ports: int,
                   front: FrontConfig | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """ROUTER (its script and TMP/nginx.conf written: `write_router`) under nginx, listening
    on its own port and each of PORTS (`nginx_running`)."""
    write_router(router, tmp / "run", tmp / "nginx.conf", front)
    with nginx_running(tmp, int(router.listen.rpartition(":")[2]), *ports) as nginx:
        yield nginx


class UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """An HTTP server on a Unix socket, a thread a connection."""

    daemon_threads = True


def unix_server(path: Path, handler: type[http.server.BaseHTTPRequestHandler]) -> UnixServer:
    """HANDLER's server on the socket PATH, which nginx's workers (run as nobody) may use."""
    server = UnixServer(str(path), handler)
    os.chmod(path, 0o777)
    return server


def tcp_server(handler: type[http.server.BaseHTTPRequestHandler],
               port: int = 0) -> http.server.ThreadingHTTPServer:
    """HANDLER's server on 127.0.0.1:PORT (0: any free port), a thread a connection."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    server.daemon_threads = True
    return server


@contextlib.contextmanager
def serving(*servers: socketserver.BaseServer) -> Iterator[None]:
    """SERVERS answering, each on a thread of its own, until the end; then shut and closed."""
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


class Handler(http.server.BaseHTTPRequestHandler):
    """A stand-in's handler: quiet (no line a request), with a whole answer in one call."""

    def answer(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def answer_json(self, status: int, doc: object) -> None:
        self.answer(status, json.dumps(doc).encode())

    def read_body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def log_message(self, format: str, *args: object) -> None:
        pass

    # What a request line does not say is said on stderr, where a failing test shows it: an
    # error (a request it could not read, a timeout: http.server closes such a connection with
    # no answer, which nginx logs as "upstream prematurely closed connection"), and a
    # connection that ended before its first request line.
    def log_error(self, format: str, *args: object) -> None:
        sys.stderr.write(f"{type(self).__name__} {self.client_address}: {format % args}\n")

    def handle(self) -> None:
        super().handle()
        if not getattr(self, "requestline", ""):
            self.log_error("the connection ended before its first request line")


def answering(body: bytes) -> type[Handler]:
    """A serve's handler (HTTP/1.1, keep-alive) that reads each POST and answers 200 with
    BODY (JSON)."""

    class Serve(Handler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self.read_body()
            self.answer(200, body)

    return Serve


def key_file(path: Path, token: str) -> Path:
    """TOKEN in PATH as a peer's key_file is kept (one line, the owner's only)."""
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path
