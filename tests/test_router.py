"""The router: its table and config checks (pure), and the real nginx with the real njs module
routing by `model` to two real stand-ins (one on a Unix socket, one on a TCP port), with the
OpenAI-shaped errors of bad input. gpud itself is not running here (the sandbox test,
tests/integration/test_router.py, has it): /v1/models says every state is unknown."""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import http.server
import json
import os
import select
import shutil
import signal
import socket
import socketserver
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpud.config import model_names, parse_config, routed
from gpud.core.front import FrontConfig, FrontServe, render
from gpud.core.keys import ApiKey, parse_keys
from gpud.core.launch import vllm_argv
from gpud.core.quota import Over
from gpud.core.router import (
    DEFAULT_LARGE_BODIES_PER_REQUESTER,
    ROUTED_PATHS,
    RoutedServe,
    RouterFront,
    RouterRequest,
    duplicate_names,
    listen_problem,
    routing_table,
)
from gpud.core.routerconf import front_policy, http_lines, main_lines
from gpud.core.routerlog import parse_log_line
from gpud.ctl.format import format_models
from gpud.daemon import check_config
from gpud.errors import ConfigError
from gpud.nginx.front import check_front, front_config
from gpud.nginx.router import load_keys, router_front, script_code, script_text
from tests.ports import connects, free_port
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[1]
NGINX = REPO / ".venv" / "bin" / "nginx"
NJS = REPO / ".venv" / "lib" / "nginx" / "modules" / "ngx_http_js_module.so"

TOML = """\
[daemon]
front_nginx = "/opt/nginx"
[router]
listen = "127.0.0.1:8000"
[roles.r]
device = "0"
[serves.chat]
role = "r"
vram_mib = 1000
port = 30001
sleep_level = 1
models = ["chat", "chat-fast"]
vllm = { model = "org/chat-model" }
[serves.ocr]
role = "r"
vram_mib = 1000
port = 30002
vllm = { model = "org/ocr-model", extra_args = ["--served-model-name", "ocr", "read"] }
[serves.tool]
role = "r"
vram_mib = 1000
port = 30003
command = ["/bin/tool", "--port", "{port}"]
[serves.batch]
role = "r"
vram_mib = 1000
command = ["/bin/batch"]
"""


def with_njs_module(text: str, module: Path) -> str:
    """TEXT with its router loading MODULE: a test says which njs module it means, never
    leaning on whether this host has Debian's at the default path."""
    return text.replace('listen = "127.0.0.1:8000"\n',
                        f'listen = "127.0.0.1:8000"\nnjs_module = "{module}"\n')


# --- the table and the config -----------------------------------------------------------------

def test_names_default_to_what_the_serve_answers_to() -> None:
    cfg = parse_config(TOML, "t")
    assert model_names("chat", cfg.serves["chat"]) == ("chat", "chat-fast")
    assert model_names("ocr", cfg.serves["ocr"]) == ("ocr", "read")
    assert model_names("tool", cfg.serves["tool"]) == ("tool",)
    plain = parse_config(TOML.replace(', extra_args = ["--served-model-name", "ocr", "read"]',
                                      ""), "t")
    assert model_names("ocr", plain.serves["ocr"]) == ("org/ocr-model",)
    # a serve with no port cannot be reached
    assert set(routed(cfg)) == {"chat", "ocr", "tool"}
    assert routed(parse_config(TOML.replace('[router]\nlisten = "127.0.0.1:8000"\n', ""),
                               "t")) == {}


def test_a_vllm_serve_with_models_answers_to_every_one_of_them() -> None:
    cfg = parse_config(TOML, "t")
    argv = vllm_argv(cfg.serves["chat"], executable="vllm", util="0.5")
    at = argv.index("--served-model-name")
    assert argv[at + 1:at + 3] == ["chat", "chat-fast"]
    assert "--served-model-name" not in vllm_argv(cfg.serves["tool"].model_copy(update={
        "vllm": cfg.serves["chat"].vllm, "command": None}), executable="vllm", util="0.5")


def test_one_name_on_two_serves_is_a_config_error_naming_both() -> None:
    text = TOML.replace('models = ["chat", "chat-fast"]', 'models = ["chat", "read"]')
    with pytest.raises(ConfigError) as err:
        parse_config(text, "t")
    assert "model name 'read' is on serves chat and ocr" in str(err.value)
    with pytest.raises(ValueError, match="'x' is on two serves: a and b"):
        routing_table({"a": ["x"], "b": ["x"]})
    assert duplicate_names({"a": ["x", "x"], "b": ["y"]}) == []


@pytest.mark.parametrize(("change", "error"), [
    (('listen = "127.0.0.1:8000"', 'listen = "127.0.0.1:30002"'),
     "router.listen: port 30002 is serve 'ocr'"),
    (('listen = "127.0.0.1:8000"', 'listen = "8000"'), "router.listen: '8000' is not HOST:PORT"),
    (('models = ["chat", "chat-fast"]', 'models = ["chat", "bad name"]'),
     "serves.chat.models[1]: 'bad name' is not a model name"),
    (('models = ["chat", "chat-fast"]', "models = []"), "serves.chat.models: name at least one"),
    (('port = 30002\n', 'port = 30002\nmodels = ["o"]\n'),
     "serves.ocr.vllm.extra_args: --served-model-name is set from models"),
])
def test_bad_router_config_names_its_key(change: tuple[str, str], error: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(TOML.replace(*change), "t")
    assert error in str(err.value)


def test_listen_problems() -> None:
    assert listen_problem("127.0.0.1:8000") is None
    assert listen_problem("[::1]:8000") is None
    assert listen_problem("0.0.0.0:99999") is not None
    assert listen_problem("example.com:80") is not None
    assert listen_problem("127.0.0.1:80; evil") is not None


def test_the_router_reaches_fronted_serves_on_their_socket_others_on_their_port() -> None:
    cfg = parse_config(TOML, "t")
    router = router_front(cfg)
    assert router is not None
    by = {s.name: s for s in router.serves}
    assert by["chat"].server == "unix:/run/gpud/serves/chat.sock"
    assert by["ocr"].server == "127.0.0.1:30002"
    # gpud is asked first only for a serve it can bring up (sleeps here; or on demand)
    assert by["chat"].ensure_timeout_s is not None and by["ocr"].ensure_timeout_s is None
    text = render(front_config(cfg))
    assert text.startswith("# Written by gpud") and main_lines(router)[0] in text
    assert "listen 127.0.0.1:8000;" in text and "auth_request /.gpud-router-ensure/chat;" in text
    # the front's own server for chat is still there
    assert "listen 127.0.0.1:30001;" in text
    script = script_text(router)
    assert '"chat-fast": {\n   "ensure": true,\n   "location": "@router_chat",' in script
    assert script.endswith(script_code())


def test_an_always_on_serve_asks_gpud_only_when_it_does_not_answer() -> None:
    cfg = parse_config(TOML, "t")
    router = router_front(cfg)
    assert router is not None
    by = {s.name: s for s in router.serves}
    # ocr is always on: no ensure before each request, a wait for gpud's word on a 502
    assert by["ocr"].ensure_timeout_s is None and by["ocr"].wait_timeout_s is not None
    assert by["chat"].wait_timeout_s is None
    text = render(front_config(cfg))
    ocr = text[text.index("location @router_ocr {"):]
    ocr = ocr[:ocr.index("        }")]
    assert "auth_request" not in ocr and "error_page 502 = @router_ocr_starting;" in ocr
    starting = text[text.index("location @router_ocr_starting {"):]
    starting = starting[:starting.index("        }")]
    assert "auth_request /.gpud-router-ensure/ocr;" in starting
    assert "error_page 403 = @router_refused;" in starting
    assert "error_page 500 502 504 = @router_down;" in starting
    ensure = text[text.index("location = /.gpud-router-ensure/ocr {"):]
    ensure = ensure[:ensure.index("        }")]
    assert f"proxy_read_timeout {by['ocr'].wait_timeout_s}s;" in ensure
    assert "@router_chat_starting" not in text


def test_every_carried_route_and_nothing_else_runs_the_script() -> None:
    router = RouterFront("127.0.0.1:8000", (RoutedServe("a", ("a",), port=1),))
    lines = "\n".join(http_lines(router))
    for path in ROUTED_PATHS:
        # its counts before it (conn_lines: large_bodies_per_requester), the script's route
        block = lines.split(f"location = {path} {{\n", 1)[1].split("}", 1)[0]
        assert "            js_content router.route;" in block, block
    assert lines.count("js_content router.route;") == len(ROUTED_PATHS)
    assert "location / {\n            return 404" in lines


# --- the real nginx and njs in front of two stand-ins -----------------------------------------

@dataclass
class Rig:
    port: int
    sock_serve: subprocess.Popen[bytes]
    tcp_serve: subprocess.Popen[bytes]
    nginx: subprocess.Popen[bytes]
    script: str
    router: RouterFront
    conf: Path
    run: Path

    def workers(self) -> set[str]:
        pid = self.nginx.pid
        return set(Path(f"/proc/{pid}/task/{pid}/children").read_text().split())

    def reload(self) -> None:
        """nginx's graceful reload (as gpud's): the new workers read the script again; until
        the old worker has gone."""
        old = self.workers()
        self.nginx.send_signal(signal.SIGHUP)
        wait_until(lambda: (w := self.workers()) and not w & old, what="the old worker gone")


# The rig's readiness probe sends it (a key of the rig's keys when they have one).
RIG_TOKEN = "sk-rig-probe-0123456789"


def _req(port: int, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def _post(port: int, path: str, doc: object) -> tuple[int, dict[str, object]]:
    status, _h, body = _req(port, "POST", path, json.dumps(doc).encode(),
                            {"Content-Type": "application/json"})
    return status, json.loads(body)


def _openai_error(doc: dict[str, object]) -> dict[str, object]:
    err = doc["error"]
    assert isinstance(err, dict) and set(err) >= {"message", "type", "param", "code"}, doc
    return err


@pytest.fixture
def rig() -> Iterator[Rig]:
    """nginx with the router (max body 1 MiB, body timeout 1 s) before stand-in `a` (names
    a, a-fast) on a socket and `b` (names b, org/b-model) on a TCP port."""
    with router_rig() as made:
        yield made


@contextlib.contextmanager
def router_rig(keys: tuple[ApiKey, ...] | None = None, standin_args: tuple[str, ...] = (),
               access_log: bool = False, priority_scheduling: bool = False,
               large_bodies: int = DEFAULT_LARGE_BODIES_PER_REQUESTER,
               over_budget: tuple[Over, ...] = ()) -> Iterator[Rig]:
    """The rig, with KEYS (their limits in nginx's config), the keys past a token budget and
    more stand-in arguments."""
    for path in (NGINX, NJS):
        if not path.exists():
            pytest.fail(f"{path} missing: run scripts/setup")
    tmp = Path(tempfile.mkdtemp(prefix="gpud-router-"))
    tmp.chmod(0o755)
    sock = tmp / "a.sock"
    run = tmp / "run"
    for name in ("", "body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (run / name).mkdir(exist_ok=True)
    port, b_port = free_port(), free_port()
    router = RouterFront(f"127.0.0.1:{port}",
                         (RoutedServe("a", ("a", "a-fast"), socket=str(sock),
                                      priority_scheduling=priority_scheduling),
                          RoutedServe("b", ("b", "org/b-model"), port=b_port)),
                         njs_module=str(NJS), script=str(tmp / "router.js"),
                         gpud_socket=str(tmp / "no-gpud.sock"), max_body_mib=1,
                         body_timeout_s=1, keys=keys, large_bodies_per_requester=large_bodies,
                         access_log=str(tmp / "access.log") if access_log else None,
                         over_budget=over_budget)
    (tmp / "router.js").write_text(script_text(router))
    (tmp / "nginx.conf").write_text(render(FrontConfig(
        serves=(), run_dir=str(run), main_extra=tuple(main_lines(router)),
        http_extra=tuple(http_lines(router)))))
    standin = [sys.executable, "-m", "gpud.testing.standin", "serve", "m",
               "--token-interval-s", "0.3", *standin_args]
    a = subprocess.Popen([*standin, "--uds", str(sock), "--served-model-name", "a", "a-fast"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    b = subprocess.Popen([*standin, "--port", str(b_port), "--served-model-name", "b",
                          "org/b-model"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = (tmp / "nginx.log").open("wb")
    nginx = subprocess.Popen([str(NGINX), "-c", str(tmp / "nginx.conf"), "-p", f"{run}/"],
                             stdout=subprocess.DEVNULL, stderr=log)
    try:
        wait_until(sock.exists, what="a's socket")
        os.chmod(sock, 0o777)  # nginx's workers run as nobody here
        wait_until(lambda: connects(port), what="the router listening")
        probes = 0

        def answering(model: str) -> bool:
            nonlocal probes
            probes += 1
            return _req(port, "POST", "/tokenize", json.dumps({"model": model}).encode(),
                        {"Authorization": f"Bearer {RIG_TOKEN}"})[0] != 503

        for model in ("a", "b"):
            wait_until(lambda m=model: answering(m),  # type: ignore[misc]
                       what=f"{model} answering through the router")
        if access_log:  # each probe's line is written once it is freed: as the fed fixture
            wait_until(lambda: len((tmp / "access.log").read_text().splitlines()) == probes,
                       what="the readiness probes' access-log lines")
        yield Rig(port, a, b, nginx, str(tmp / "router.js"), router, tmp / "nginx.conf", run)
    except BaseException:
        log.flush()
        print((tmp / "nginx.log").read_text())
        raise
    finally:
        for proc in (nginx, a, b):
            proc.terminate()
            proc.wait(timeout=10)
        log.close()
        shutil.rmtree(tmp)


def test_the_config_is_valid_for_nginx_with_njs(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    script = tmp_path / "router.js"
    router = RouterFront("127.0.0.1:8000", (RoutedServe("a", ("a",), port=1),
                                            RoutedServe("b-c", ("b",), socket="/s/b.sock",
                                                        ensure_timeout_s=905)),
                         njs_module=str(NJS), script=str(script))
    script.write_text(script_text(router))
    conf = tmp_path / "nginx.conf"
    conf.write_text(render(FrontConfig(serves=(), run_dir=str(run),
                                       main_extra=tuple(main_lines(router)),
                                       http_extra=tuple(http_lines(router)))))
    result = subprocess.run([str(NGINX), "-t", "-c", str(conf), "-p", f"{run}/"],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def test_a_request_goes_to_the_serve_its_model_names(rig: Rig) -> None:
    for model in ("a", "a-fast", "b", "org/b-model"):
        for path in ("/v1/completions", "/v1/chat/completions"):
            body = ({"prompt": "x y", "max_tokens": 2} if path == "/v1/completions"
                    else {"messages": [{"role": "user", "content": "x y"}], "max_tokens": 2})
            status, doc = _post(rig.port, path, {"model": model, **body})
            # each stand-in answers only its own names: a 200 is the right serve
            assert status == 200 and doc["model"] == model, (model, path, doc)


def test_models_lists_every_name_with_its_serve(rig: Rig) -> None:
    status, _h, body = _req(rig.port, "GET", "/v1/models")
    doc = json.loads(body)
    assert status == 200 and doc["object"] == "list"
    assert [(m["id"], m["object"], m["gpud"]["serve"]) for m in doc["data"]] == [
        ("a", "model", "a"), ("a-fast", "model", "a"), ("b", "model", "b"),
        ("org/b-model", "model", "b")]
    # no gpud here to ask
    assert {m["gpud"]["state"] for m in doc["data"]} == {"unknown"}
    status, _h, body = _req(rig.port, "GET", "/v1/models/org/b-model")
    assert status == 200 and json.loads(body)["id"] == "org/b-model"
    status, _h, body = _req(rig.port, "GET", "/v1/models/a-fats")
    err = _openai_error(json.loads(body))
    assert status == 404 and '"a-fast"' in str(err["message"])


def test_bad_input_gets_openai_shaped_errors(rig: Rig) -> None:
    port = rig.port
    status, _h, body = _req(port, "POST", "/v1/chat/completions", b'{"model": "a"',
                            {"Content-Type": "application/json"})
    assert status == 400 and _openai_error(json.loads(body))["code"] == "invalid_json"
    status, doc = _post(port, "/v1/chat/completions", {"messages": []})
    assert status == 400 and _openai_error(doc)["param"] == "model"
    status, doc = _post(port, "/v1/chat/completions", {"model": 7})
    assert status == 400 and _openai_error(doc)["code"] == "invalid_model"
    status, doc = _post(port, "/v1/chat/completions", ["model"])
    assert status == 400
    status, doc = _post(port, "/v1/chat/completions", {"model": "a-fst"})
    err = _openai_error(doc)
    assert status == 404 and err["code"] == "model_not_found"
    assert '"a-fst"' in str(err["message"]) and '"a-fast"' in str(err["message"])
    # a name with control characters comes back escaped, not raw
    status, _h, body = _req(port, "POST", "/v1/completions",
                            json.dumps({"model": "x\x1b[31m\ny"}).encode())
    assert status == 404 and b"\x1b" not in body and b"\\u001b" in body
    # over max_body_mib (1 MiB here)
    status, _h, body = _req(port, "POST", "/v1/completions",
                            b'{"model": "a", "prompt": "' + b"x" * (1 << 20) + b'"}')
    assert status == 413 and _openai_error(json.loads(body))["code"] == "request_too_large"
    # GET on a routed path
    status, _h, body = _req(port, "GET", "/v1/chat/completions")
    assert status == 405 and _openai_error(json.loads(body))


def test_a_slow_body_is_cut_after_body_timeout_s(rig: Rig) -> None:
    """nginx answers no 408 to a read timeout: it closes the connection (docs/router.md), with
    a reset (the front's reset_timedout_connection: no lingering on a client that stalls)."""
    with socket.create_connection(("127.0.0.1", rig.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
                  b'{"model":')
        started = time.monotonic()
        try:
            got = s.recv(4096)
        except ConnectionResetError:
            got = b""
    assert got == b"", got
    assert 0.8 <= time.monotonic() - started < 5


@pytest.mark.parametrize("path", ["/sleep", "/wake_up", "/collective_rpc", "/is_sleeping",
                                  "/v1/load_lora_adapter", "/update_weights", "/health",
                                  "/v1/realtime", "/", "/v1/../sleep"])
def test_dev_and_unknown_routes_are_404(rig: Rig, path: str) -> None:
    status, _h, body = _req(rig.port, "POST", path, b'{"model": "a"}')
    assert status == 404, path
    assert _openai_error(json.loads(body))["code"] == "route_not_found"


def test_a_multipart_form_is_routed_by_its_model_field(rig: Rig) -> None:
    def form(model: str) -> tuple[int, bytes]:
        boundary = "gpudboundary"
        body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
                "filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\n").encode() + \
            bytes(range(256)) + (f"\r\n--{boundary}\r\nContent-Disposition: form-data; "
                                 f"name=\"model\"\r\n\r\n{model}\r\n--{boundary}--\r\n").encode()
        status, _h, out = _req(rig.port, "POST", "/v1/audio/transcriptions", body,
                               {"Content-Type": f"multipart/form-data; boundary={boundary}"})
        return status, out

    status, out = form("nope")
    assert status == 404 and json.loads(out)["error"]["code"] == "model_not_found"
    # routed to the stand-in, which has no audio route: its own 404, not the router's
    status, out = form("b")
    assert status == 404 and "model_not_found" not in out.decode(), out


def test_a_multipart_form_is_read_as_the_serve_reads_it(rig: Rig) -> None:
    """M5: the file's bytes may hold what looks like a "model" part, and a field may come
    twice: the router reads the parts by their boundary, the last "model" field, as the
    serve's form parser does (at e8f41a4 the first `name="model"` anywhere in the body)."""
    boundary = "gpudboundary"
    fake = b'Content-Disposition: form-data; name="model"\r\n\r\nb\r\n'
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
            "filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\n").encode() + fake + \
        (f"\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nb"
         f"\r\n--{boundary}\r\nContent-Disposition: form-data; name=model\r\n\r\nnope\r\n"
         f"--{boundary}--\r\n").encode()
    status, _h, out = _req(rig.port, "POST", "/v1/audio/transcriptions", body,
                           {"Content-Type": f"multipart/form-data; boundary={boundary}"})
    error = _openai_error(json.loads(out))
    assert status == 404 and error["code"] == "model_not_found" and '"nope"' in str(
        error["message"]), out


def test_a_serve_that_is_down_answers_503_naming_the_model(rig: Rig) -> None:
    rig.tcp_serve.terminate()
    rig.tcp_serve.wait(timeout=10)
    status, headers, body = _req(rig.port, "POST", "/v1/completions", b'{"model": "b"}')
    err = _openai_error(json.loads(body))
    assert status == 503 and "serve b is not running" in str(err["message"])
    assert headers.get("Retry-After") == "30"
    # the other serve is unaffected
    assert _post(rig.port, "/v1/completions", {"model": "a", "prompt": "x", "max_tokens": 1}
                 )[0] == 200


def test_a_stream_comes_through_token_by_token(rig: Rig) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", rig.port, timeout=10)
    started = time.monotonic()
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"model": "a-fast", "prompt": "a b c d", "max_tokens": 4, "stream": True}))
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
    arrivals = []
    while line := resp.fp.readline():
        if line.startswith(b"data: "):
            arrivals.append(time.monotonic() - started)
        if line.startswith(b"data: [DONE]"):
            break
    conn.close()
    assert len(arrivals) == 5
    assert arrivals[-1] - arrivals[0] >= 0.9, arrivals


def test_a_large_body_is_routed_by_its_top_level_model(rig: Rig) -> None:
    """From 64 KiB on the script walks the body's top level for its "model" key (a nested one
    is not it) without parsing the rest."""
    pad = "x " * (100 << 10)
    status, doc = _post(rig.port, "/v1/completions",
                        {"prompt": pad, "max_tokens": 1, "model": "b"})
    assert status == 200 and doc["model"] == "b", doc
    status, doc = _post(rig.port, "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": pad}],
                         "metadata": {"model": "a"}, "model": "b", "max_tokens": 1})
    assert status == 200 and doc["model"] == "b", doc
    status, _h, body = _req(rig.port, "POST", "/v1/completions",
                            json.dumps({"prompt": pad, "model": "nope"}).encode())
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"
    status, _h, body = _req(rig.port, "POST", "/v1/completions",
                            b'{"prompt": "' + pad.encode() + b'", "model": 5}')
    assert status == 400 and json.loads(body)["error"]["code"] == "invalid_model"


# --- one reading of `model`, within a budget (docs/router.md) -----------------------

PAD = "x " * (100 << 10)  # past the 64 KiB from which the script walks the body


def _send(rig: Rig, raw: bytes) -> tuple[int, dict[str, object]]:
    status, _h, body = _req(rig.port, "POST", "/v1/completions", raw,
                            {"Content-Type": "application/json"})
    return status, json.loads(body)


def test_a_nested_model_does_not_route_a_large_body(rig: Rig) -> None:
    """M5: the top-level key, escaped, is the one the serve reads: the router reads it too
    (at e8f41a4 the one unescaped "model" key, nested, routed it to a's serve)."""
    raw = ('{"metadata": {"model": "a"}, "mod\\u0065l": "b", "max_tokens": 1, "prompt": "'
           + PAD + '"}').encode()
    status, doc = _send(rig, raw)
    assert status == 200 and doc["model"] == "b", doc
    # an escaped value is read as the serve reads it too
    raw = ('{"prompt": "' + PAD + '", "model": "\\u0062", "max_tokens": 1}').encode()
    status, doc = _send(rig, raw)
    assert status == 200 and doc["model"] == "b", doc


def test_a_model_given_twice_is_its_last_as_the_serve_reads_it(rig: Rig) -> None:
    raw = ('{"model": "a", "prompt": "' + PAD + '", "max_tokens": 1, "model": "b"}').encode()
    status, doc = _send(rig, raw)
    assert status == 200 and doc["model"] == "b", doc


def test_a_body_not_in_utf8_is_refused(rig: Rig) -> None:
    raw = json.dumps({"model": "b", "prompt": PAD}).encode("utf-16")
    status, doc = _send(rig, raw)
    error = doc["error"]
    assert status == 400 and isinstance(error, dict) and error["code"] == "invalid_json", doc


def test_a_large_body_of_small_parts_is_walked_not_parsed(rig: Rig) -> None:
    """H2: a body of small objects is walked, not parsed (at e8f41a4, parsed whole when it
    had no single "model" key: 64 MiB held a worker 7.6 s): the model after them found, and
    past the walk's budget (about 80 ms of a worker) a 413 at once."""
    parts = '{"a":[1,{"b":2}]},' * 8000
    raw = ('{"messages": [' + parts + '{}], "prompt": "x", "model": "b", '
           '"max_tokens": 1}').encode()
    status, doc = _send(rig, raw)
    assert status == 200 and doc["model"] == "b", doc
    raw = ('{"messages": [' + parts + '{}], "prompt": "x"}').encode()
    status, doc = _send(rig, raw)
    assert status == 400 and doc["error"]["code"] == "missing_model", doc  # type: ignore[index]
    many = '{"a":[1,{"b":2}]},' * ((1 << 20) // 18 - 8)
    began = time.monotonic()
    status, doc = _send(rig, ('{"messages": [' + many + '{}], "model": "b"}').encode())
    assert status == 413 and doc["error"]["code"] == "too_complex", doc  # type: ignore[index]
    assert time.monotonic() - began < 1.0


def test_a_malformed_large_body_is_refused_by_the_router(rig: Rig) -> None:
    for raw, code in ((b'{"model": "b", "prompt": "' + PAD.encode() + b'"', "invalid_json"),
                      (b'{"model": "b", "prompt": "' + PAD.encode() + b'"} x', "invalid_json"),
                      (b'["model", "' + PAD.encode() + b'"]', "invalid_json")):
        status, doc = _send(rig, raw)
        assert status == 400 and doc["error"]["code"] == code, doc  # type: ignore[index]


# --- keys ---------------------------------------------------------------------------------------

KEYS = """\
[keys.alice]
token = "sk-alice-0123456789"
models = ["a", "a-fast"]
[keys.ops]
token = "sk-ops-0123456789abc"
models = ["*"]
"""


def test_keys_are_parsed_and_checked() -> None:
    keys, problems = parse_keys(KEYS, ["a", "a-fast", "b"])
    assert problems == [] and [(k.name, k.models) for k in keys] == [
        ("alice", ("a", "a-fast")), ("ops", ("*",))]
    assert "sk-alice" not in repr(keys)  # only the digest is kept
    _, problems = parse_keys(KEYS.replace('"a-fast"]', '"nope"]').replace(
        "sk-ops-0123456789abc", "short"), ["a"])
    assert problems == ["keys.alice.models: no serve answers to 'nope'",
                        "keys.ops.token: at least 16 printable characters, no spaces"]
    _, problems = parse_keys(KEYS.replace("sk-ops-0123456789abc", "sk-alice-0123456789"),
                             ["a", "a-fast"])
    assert problems == ["keys.ops.token: the same token as keys.alice"]
    assert parse_keys("keys = 3", [])[1] == ["keys: must be a table of [keys.NAME] tables"]


def test_a_keys_file_that_others_can_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(KEYS)
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="must be root's and 0600"):
        load_keys(str(path), ["a", "a-fast"], require_root=True)
    path.chmod(0o600)
    assert len(load_keys(str(path), ["a", "a-fast"], require_root=True)) == 2


@pytest.fixture
def keyed(rig: Rig, tmp_path: Path) -> Iterator[Rig]:
    """The rig's router with keys: its script rewritten, nginx reloaded."""
    keys, _ = parse_keys(KEYS, ["a", "a-fast", "b", "org/b-model"])
    router = dataclasses.replace(rig.router, keys=tuple(keys))
    Path(rig.script).write_text(script_text(router))
    rig.conf.write_text(render(FrontConfig(
        serves=(), run_dir=str(rig.run), main_extra=tuple(main_lines(router)),
        http_extra=tuple(http_lines(router)))))
    rig.reload()
    yield rig


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}


def test_with_keys_a_request_needs_one_that_may_use_its_model(keyed: Rig) -> None:
    port = keyed.port
    body = json.dumps({"model": "a", "prompt": "x", "max_tokens": 1}).encode()
    status, headers, out = _req(port, "POST", "/v1/completions", body)
    assert status == 401 and json.loads(out)["error"]["code"] == "invalid_api_key"
    assert headers.get("WWW-Authenticate") == "Bearer"
    status, _h, out = _req(port, "POST", "/v1/completions", body, _auth("sk-wrong-0123456789"))
    assert status == 401 and "Incorrect API key" in json.loads(out)["error"]["message"]
    assert _req(port, "POST", "/v1/completions", body, _auth("sk-alice-0123456789"))[0] == 200
    b_body = json.dumps({"model": "b", "prompt": "x", "max_tokens": 1}).encode()
    status, _h, out = _req(port, "POST", "/v1/completions", b_body, _auth("sk-alice-0123456789"))
    err = json.loads(out)["error"]
    # L3: as a model that does not exist (GET /v1/models/b says the same), naming none of the
    # others
    assert status == 404 and err["code"] == "model_not_found", err
    assert "org/b-model" not in err["message"] and '"b"?' not in err["message"], err
    assert _req(port, "POST", "/v1/completions", b_body, _auth("sk-ops-0123456789abc"))[0] == 200
    # /v1/models: only what the key may use
    status, _h, out = _req(port, "GET", "/v1/models", None, _auth("sk-alice-0123456789"))
    assert status == 200 and [m["id"] for m in json.loads(out)["data"]] == ["a", "a-fast"]
    assert _req(port, "GET", "/v1/models")[0] == 401
    assert _req(port, "GET", "/v1/models/b", None, _auth("sk-alice-0123456789"))[0] == 404


def test_with_keys_a_request_without_one_is_answered_before_its_body(keyed: Rig) -> None:
    """H3: a client without a key holds no body buffer: answered 401 as soon as its headers
    are in (at e8f41a4 nginx read the whole body first, or waited for it)."""
    for auth in (b"", b"Authorization: Bearer sk-wrong-0123456789\r\n"):
        with socket.create_connection(("127.0.0.1", keyed.port), timeout=5) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth +
                           b"Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n"
                           b'{"model": "a", ')
            client.settimeout(0.5)
            got = b""
            while b"}}" not in got:  # the headers, then the error document
                got += client.recv(65536)
            head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 401") and b"WWW-Authenticate: Bearer" in head, head
        error = json.loads(body)["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert ("Incorrect" if auth else "No API key") in error["message"], error


def _raw(port: int, data: bytes) -> tuple[int, dict[str, str], dict[str, object]]:
    """A request sent as bytes: the status, headers and JSON document of its answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
        client.sendall(data)
        client.settimeout(2)
        got = b""
        with contextlib.suppress(OSError):
            while (part := client.recv(65536)) and not got.endswith(b"}}"):
                got += part
    head, _, body = got.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


@pytest.mark.parametrize(("request_bytes", "status", "code"), [
    (b"GARBAGE\r\n\r\n", 400, "invalid_request"),
    (b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414, "invalid_request"),
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n", 400,
     "invalid_request"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-ops-0123456789abc"
     b"\r\nContent-Length: 10000000\r\n\r\n{", 413, "request_too_large"),
    (b"POST /nope HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}", 404,
     "route_not_found"),
    (b"TRACE /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", 405, "method_not_allowed"),
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-ops-0123456789abc\r\n"
     b'If-Match: "x"\r\n\r\n', 412, "precondition_failed"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 501,
     "not_implemented"),
    (b"GET /v1/models HTTP/2.0\r\nHost: x\r\n\r\n", 505, "http_version_not_supported"),
])
def test_nginxs_own_errors_are_openai_shaped(keyed: Rig, request_bytes: bytes, status: int,
                                              code: str) -> None:
    """L2: at e8f41a4 nginx's own 400, 414 and 494 (and a 413 with keys on) were HTML; at
    310a618 its 405 (TRACE), 412, 501 and 505 still were."""
    got, headers, doc = _raw(keyed.port, request_bytes)
    assert got == status and headers["Content-Type"] == "application/json", (got, doc)
    assert _openai_error(doc)["code"] == code, doc


def test_the_script_holds_the_keys_digests_never_their_tokens(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(KEYS.replace('["a", "a-fast"]', '["chat"]'))
    path.chmod(0o600)
    text = TOML.replace('listen = "127.0.0.1:8000"\n',
                        f'listen = "127.0.0.1:8000"\napi_keys_file = "{path}"\n')
    router = router_front(parse_config(text, "t"))
    assert router is not None and router.keys is not None
    script = script_text(router)
    assert "sk-alice" not in script and '"name": "alice"' in script
    # a file that names a model no serve answers to: the router is not rewritten
    path.write_text(KEYS)
    with pytest.raises(ConfigError, match=r"keys\.alice\.models: no serve answers to 'a'"):
        router_front(parse_config(text, "t"))


# --- a client that goes away ----------------------------------------------------------------


def test_a_client_that_disconnects_closes_its_request_upstream(tmp_path: Path) -> None:
    """nginx closes the connection to the serve when the client of a stream goes away; vLLM
    aborts a request whose connection closed (vllm/entrypoints/serve/utils/api_utils.py:36
    listen_for_disconnect, :51 with_cancellation). The upstream here is a recorder that
    streams one event and then waits for its peer to close."""
    closed = threading.Event()
    listener = socket.create_server(("127.0.0.1", 0))
    up_port = listener.getsockname()[1]

    def upstream() -> None:
        conn, _ = listener.accept()
        with conn:
            got = b""
            while b"\r\n\r\n" not in got:
                got += conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            event = b"data: {\"n\": 1}\n\n"
            conn.sendall(b"%x\r\n%s\r\n" % (len(event), event))
            conn.settimeout(20)
            with contextlib.suppress(OSError):
                while conn.recv(65536):
                    pass
            closed.set()

    thread = threading.Thread(target=upstream, daemon=True)
    thread.start()
    run = tmp_path / "run"
    run.mkdir()
    tmp_path.chmod(0o755)
    port = free_port()
    router = RouterFront(f"127.0.0.1:{port}", (RoutedServe("c", ("c",), port=up_port),),
                         njs_module=str(NJS), script=str(tmp_path / "router.js"))
    (tmp_path / "router.js").write_text(script_text(router))
    (tmp_path / "nginx.conf").write_text(render(FrontConfig(
        serves=(), run_dir=str(run), main_extra=tuple(main_lines(router)),
        http_extra=tuple(http_lines(router)))))
    nginx = subprocess.Popen([str(NGINX), "-c", str(tmp_path / "nginx.conf"), "-p", f"{run}/"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: connects(port), what="the router listening")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            body = b'{"model": "c", "stream": true}'
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d"
                           b"\r\n\r\n%s" % (len(body), body))
            got = b""
            while b"data: " not in got:
                got += client.recv(65536)
            # the stream is open while the client is there
            assert not closed.wait(0.5)
        assert closed.wait(5), "the serve's connection was left open"
    finally:
        nginx.terminate()
        nginx.wait(timeout=10)
        listener.close()


def test_gpuctl_models_lists_each_name_with_its_serve() -> None:
    doc = {"serves": [
        {"name": "chat", "state": "sleeping", "port": 30001, "front": True,
         "models": ["chat-fast", "chat"], "in_flight": None, "queued": 3},
        {"name": "batch", "state": "running", "port": None, "front": False},
        {"name": "code", "state": "running", "port": 30002, "front": True, "models": ["code"],
         "in_flight": 2, "queued": 0},
    ]}
    assert format_models(doc).splitlines() == [  # type: ignore[arg-type]
        "MODEL      HOST   SERVE  STATE      PORT  FRONT  IN FLIGHT  QUEUED",
        "chat       local  chat   sleeping  30001  yes            -       3",
        "chat-fast  local  chat   sleeping  30001  yes            -       3",
        "code       local  code   running   30002  yes            2       0"]
    # the peers' models, each with its host (docs/peers.md); one whose circuit is open named
    peers = {"peers": [
        {"name": "node2", "circuit": "closed", "models": [
            {"id": "ocr", "state": "sleeping", "expected_wait_s": None, "queued": 2}]},
        {"name": "node3", "circuit": "open", "circuit_reason": "cannot connect: refused",
         "models": []}]}
    assert format_models(doc, peers).splitlines() == [  # type: ignore[arg-type]
        "MODEL      HOST   SERVE  STATE      PORT  FRONT  IN FLIGHT  QUEUED",
        "chat       local  chat   sleeping  30001  yes            -       3",
        "chat-fast  local  chat   sleeping  30001  yes            -       3",
        "code       local  code   running   30002  yes            2       0",
        "ocr        node2  -      sleeping      -  -              -       2",
        "host node3 unreachable (cannot connect: refused): its models are answered 503 until "
        "it answers again"]
    assert format_models({"serves": []}).startswith("no models")  # type: ignore[typeddict-item]
    doc["serves"][0].update(queue=[{"requester": "alice", "waiting": 2, "position": 1},
                                   {"requester": "addr:127.0.0.1", "waiting": 1,
                                    "position": 3}], expected_wait_s=12.34)
    assert format_models(doc).splitlines()[-1] == (  # type: ignore[arg-type]
        "waiting for chat, expected wait 12 s: alice 2 (position 1), addr:127.0.0.1 1 "
        "(position 3)")


def test_a_router_that_cannot_run_is_left_out_and_the_fronts_go_on(tmp_path: Path) -> None:
    """nginx refuses a whole config whose module is missing: the fronts' servers with it. What
    would be dark is named by the config key it is about."""
    missing = tmp_path / "modules" / "ngx_http_js_module.so"
    cfg = parse_config(with_njs_module(TOML, missing), "t")
    assert cfg.router is not None and cfg.router.njs_module == str(missing)
    check = check_front(cfg)
    assert check.router is None
    assert [d.message for d in check.dark] == [
        f"router.njs_module: {missing} not found, so the "
        "router would be off (apt-get install libnginx-mod-http-js)"]
    # the front of chat is still rendered
    assert "listen 127.0.0.1:30001;" in render(front_config(cfg, None))
    with_njs = with_njs_module(TOML, NJS)
    assert check_front(parse_config(with_njs, "t")).router is not None
    # keys that cannot be read: off, not open
    bad = with_njs.replace('listen = "127.0.0.1:8000"\n',
                           f'listen = "127.0.0.1:8000"\napi_keys_file = "{tmp_path}/none"\n')
    check = check_front(parse_config(bad, "t"))
    assert check.router is None
    assert [d.message for d in check.dark] == [
        f"router.api_keys_file: {tmp_path}/none: cannot read: No such file or directory"]


def test_check_config_refuses_a_router_that_would_be_dark(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """H5: --check-config refuses (exit 2) what would leave the router dark, naming it: at
    e8f41a4 it printed "ok" and a warning, or a traceback for a model name it could not
    carry (M8)."""
    path = tmp_path / "gpud.toml"
    base = TOML.replace('[roles.r]\ndevice = "0"\n', '[roles.r]\ndevice = "0"\ncapacity_mib = 20000\n')
    missing = tmp_path / "modules" / "ngx_http_js_module.so"
    path.write_text(with_njs_module(base, missing))
    assert check_config(path) == 2
    err = capsys.readouterr().err
    assert f"{path}: router.njs_module: {missing} not found" in err, err
    text = with_njs_module(base, NJS)
    keys = tmp_path / "keys.toml"
    keys.write_text('[keys.ci]\ntoken = "sk-ci-0123456789abcdef"\nmodels = ["chta"]\n')
    keys.chmod(0o600)
    path.write_text(text.replace('listen = "127.0.0.1:8000"\n',
                                 f'listen = "127.0.0.1:8000"\napi_keys_file = "{keys}"\n'))
    assert check_config(path) == 2
    err = capsys.readouterr().err
    assert f"router.api_keys_file: {keys}: keys.ci.models: no serve answers to 'chta'" in err
    # a vllm serve whose name is a local path: routed (vLLM answers to it)
    local = text + ('[serves.local]\nrole = "r"\nvram_mib = 1000\nport = 30009\n'
                    'vllm = { model = "/models/local" }\n')
    path.write_text(local)
    assert check_config(path) == 0, capsys.readouterr().err
    router = check_front(parse_config(local, "t")).router
    assert router is not None and router.table["/models/local"] == "local"
    capsys.readouterr()
    # a port another process holds
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        path.write_text(text.replace('listen = "127.0.0.1:8000"',
                                     f'listen = "127.0.0.1:{port}"'))
        assert check_config(path) == 2
    err = capsys.readouterr().err
    assert f"router.listen: 127.0.0.1:{port} is in use by another process" in err, err


def test_nginx_waits_for_the_ensure_as_long_as_the_queue_and_the_bring_up() -> None:
    """The ensure may be held in the router's queue (router.queue_timeout_s) before the
    bring-up's own wait: nginx's proxy_read_timeout for it covers both (docs/router.md)."""
    def timeout(extra: str) -> int:
        cfg = parse_config(TOML.replace('listen = "127.0.0.1:8000"\n',
                                        f'listen = "127.0.0.1:8000"\n{extra}'), "t")
        router = router_front(cfg)
        assert router is not None
        (chat,) = [s for s in router.serves if s.name == "chat"]
        assert chat.ensure_timeout_s is not None
        assert f"proxy_read_timeout {chat.ensure_timeout_s}s;" in render(front_config(cfg))
        return chat.ensure_timeout_s
    bare = timeout("max_queued = 0\n")  # no queue: the bring-up's wait and the margin
    assert timeout("") == bare + 60  # the default queue_timeout_s
    assert timeout("queue_timeout_s = 300\n") == bare + 300


@pytest.mark.parametrize(("key", "error"), [
    ("queue_timeout_s = 0", "router.queue_timeout_s"),
    ("max_queued = -1", "router.max_queued"),
    ("min_awake_s = -5", "router.min_awake_s"),
    ('evict_busy = "no"', "router.evict_busy"),
    ("evict_busy = 0", "router.evict_busy"),
])
def test_the_queue_keys_are_checked(key: str, error: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(TOML.replace('listen = "127.0.0.1:8000"\n',
                                  f'listen = "127.0.0.1:8000"\n{key}\n'), "t")
    assert error in str(err.value)


# --- loading feedback and the access log, with a gpud that takes its time ------------------


class _Gpud(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """A stand-in for gpud's ensure: answers `status` after `delay_s` (403 with a reason),
    and keeps each ensure's X-Gpud-Model and X-Gpud-Key."""

    daemon_threads = True
    delay_s = 0.0
    status = 204
    # GET /v1/serves's serves (None: not answered), as the router's states read them
    serves: list[dict[str, object]] | None = None
    serves_delay_s = 0.0  # how long GET /v1/serves takes
    # the X-Gpud-Reason of a 403 (None: a ledger's denial)
    reason: dict[str, object] | None = None
    seen: list[tuple[str, str]]
    requesters: list[str]
    gone: threading.Event


class _Ensure(http.server.BaseHTTPRequestHandler):
    server: _Gpud

    def do_POST(self) -> None:
        self.server.seen.append((self.headers.get("X-Gpud-Model", ""),
                                 self.headers.get("X-Gpud-Key", "")))
        self.server.requesters.append(self.headers.get("X-Gpud-Requester", ""))
        # waits as gpud does, noticing when nginx closes the ensure's connection
        deadline = time.monotonic() + self.server.delay_s
        while (left := deadline - time.monotonic()) > 0:
            if select.select([self.connection], [], [], left)[0] and \
                    not self.connection.recv(1, socket.MSG_PEEK):
                self.server.gone.set()
                return
        self.send_response(self.server.status)
        if self.server.status == 403:
            self.send_header("X-Gpud-Reason", json.dumps(self.server.reason or
                {"error": {"message": "ledger bound: no room", "code": "denied"}}))
            self.send_header("Retry-After", "5" if self.server.reason else "7")
        # a refusal's body is gpud's error document, as gpud's (error_response)
        body = json.dumps(self.server.reason or {"error": {"message": "no room"}}).encode() \
            if self.server.status == 403 else b""
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        time.sleep(self.server.serves_delay_s)
        body = json.dumps({"serves": self.server.serves}).encode()
        self.send_response(200 if self.server.serves is not None else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@dataclass
class Fed:
    port: int
    gpud: _Gpud
    log: Path
    awake: Path
    errors: Path  # nginx's error log
    serve: subprocess.Popen[bytes]  # the stand-in behind `a`


@pytest.fixture
def fed() -> Iterator[Fed]:
    """nginx with the router before stand-in `a` (names a, a-fast; and hasOwnProperty, which
    the stand-in does not answer to), which the router asks a
    stand-in gpud to have up before each request; loading feedback every second; the
    access log gpud reads."""
    with fed_rig() as made:
        yield made


def a_front(tmp: Path, sock: Path, gpud_sock: Path, fport: int,
            router: RouterFront) -> FrontConfig:
    """The front of `a` (on demand: its port asks gpud's ensure) with ROUTER's lines and
    policy, as gpud.nginx.front front_config gives it."""
    return FrontConfig(
        serves=(FrontServe("a", fport, str(sock), ensure_timeout_s=60),),
        run_dir=str(tmp / "run"), gpud_socket=str(gpud_sock), awake_dir=str(tmp / "awake"),
        main_extra=tuple(main_lines(router)), http_extra=tuple(http_lines(router)),
        policies=(("a", front_policy(router, "a")),))


@contextlib.contextmanager
def fed_rig(*, fronted: bool = False, logged: bool = True) -> Iterator[Fed]:
    """The `fed` rig. FRONTED: `a` fronted on a port of its own too, its front with the
    router's lines and policy as gpud.nginx.front front_config gives it (on demand: its port
    asks gpud's ensure), and that port the one the tests are given; LOGGED: the access log."""
    tmp = Path(tempfile.mkdtemp(prefix="gpud-router-"))
    tmp.chmod(0o755)
    sock, gpud_sock, run = tmp / "a.sock", tmp / "gpud.sock", tmp / "run"
    for name in ("", "body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (run / name).mkdir(exist_ok=True)
    port, fport = free_port(), free_port()
    router = RouterFront(f"127.0.0.1:{port}",
                         (RoutedServe("a", ("a", "a-fast", "hasOwnProperty"), socket=str(sock),
                                      ensure_timeout_s=60, stream_usage=True),),
                         njs_module=str(NJS), script=str(tmp / "router.js"),
                         gpud_socket=str(gpud_sock), loading_feedback_s=1,
                         access_log=str(tmp / "router.log") if logged else None,
                         awake_dir=str(tmp / "awake"))
    (tmp / "awake").mkdir()
    (tmp / "awake" / "a").touch()  # gpud last said it was running and awake
    (tmp / "router.js").write_text(script_text(router))
    (tmp / "nginx.conf").write_text(render(
        a_front(tmp, sock, gpud_sock, fport, router) if fronted else FrontConfig(
            serves=(), run_dir=str(run), main_extra=tuple(main_lines(router)),
            http_extra=tuple(http_lines(router)))))
    gpud = _Gpud(str(gpud_sock), _Ensure)
    gpud.seen, gpud.requesters, gpud.gone = [], [], threading.Event()
    os.chmod(gpud_sock, 0o777)
    threading.Thread(target=gpud.serve_forever, daemon=True).start()
    a = subprocess.Popen([sys.executable, "-m", "gpud.testing.standin", "serve", "m",
                          "--token-interval-s", "0.1", "--uds", str(sock),
                          "--served-model-name", "a", "a-fast"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = (tmp / "nginx.log").open("wb")
    nginx = subprocess.Popen([str(NGINX), "-c", str(tmp / "nginx.conf"), "-p", f"{run}/"],
                             stdout=subprocess.DEVNULL, stderr=log)
    given = fport if fronted else port
    try:
        wait_until(sock.exists, what="a's socket")
        os.chmod(sock, 0o777)
        wait_until(lambda: connects(port) and (not fronted or connects(fport)),
                   what="the router listening")
        # nginx writes a request's access-log line once the request is freed, after its
        # answer is sent (ngx_http_free_request calls ngx_http_log_request, nginx
        # src/http/ngx_http_request.c): the client can have the answer before the line is
        # written. Every warm-up request's line is waited for here, so that a test that
        # empties the log and counts its own lines never gets a late one of these (1 in 30
        # fixtures had the last one unwritten when the test began: the hang-up test's
        # "the request ended" then saw 2 lines)
        warm = 0

        def answering() -> bool:
            nonlocal warm
            warm += 1
            return _req(given, "POST", "/v1/completions",
                        b'{"model": "a", "prompt": "x", "max_tokens": 1}')[0] == 200

        wait_until(answering, what="a answering through the router")
        if logged:
            wait_until(lambda: len((tmp / "router.log").read_text().splitlines()) == warm,
                       what="the warm-up requests' access-log lines")
        gpud.seen.clear()
        gpud.requesters.clear()
        yield Fed(given, gpud, tmp / "router.log", tmp / "awake" / "a", tmp / "nginx.log", a)
        # whatever the test did, the script threw nothing, left nothing pending, and nginx
        # saw nothing it calls an alert (a subrequest finalized twice, a request leaked)
        log.flush()
        errors = (tmp / "nginx.log").read_text()
        assert not any(bad in errors for bad in ("js exception", "pending events", "[alert]",
                                                 "[emerg]")), errors
    except BaseException:
        log.flush()
        print((tmp / "nginx.log").read_text())
        raise
    finally:
        for proc in (nginx, a):
            proc.terminate()
            proc.wait(timeout=10)
        gpud.shutdown()
        gpud.server_close()
        log.close()
        shutil.rmtree(tmp)


def _stream(port: int, doc: dict[str, object]) -> tuple[int, dict[str, str], list[str]]:
    """A streamed request's status, headers and lines, with the time of each line's arrival
    since the request (as "+S.S line")."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        began = time.monotonic()
        conn.request("POST", "/v1/completions", body=json.dumps({**doc, "stream": True}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        lines = []
        while line := resp.readline():
            if line.strip():
                lines.append(f"+{time.monotonic() - began:.1f} {line.decode().strip()}")
        return resp.status, dict(resp.getheaders()), lines
    finally:
        conn.close()


def _events(lines: list[str]) -> list[str]:
    return [line.split(" ", 1)[1] for line in lines]


def test_a_stream_waiting_on_a_bring_up_is_sent_comments_then_the_stream(fed: Fed) -> None:
    fed.gpud.delay_s = 3.5
    status, headers, lines = _stream(fed.port, {"model": "a-fast", "prompt": "x y z",
                                                "max_tokens": 3})
    events = _events(lines)
    assert status == 200 and headers["Content-Type"] == "text/event-stream", (status, lines)
    # a comment past the first second, and one a second after (0 at most in between)
    comments = [e for e in events if e.startswith(":")]
    assert comments[0] == ": loading a-fast" and len(comments) >= 2, lines
    first_data = next(i for i, e in enumerate(events) if e.startswith("data:"))
    assert all(e.startswith(":") for e in events[:first_data]), lines
    # then the serve's own stream, token by token, to its end
    data = [json.loads(e[6:]) for e in events[first_data:-1]]
    assert [d["choices"][0]["text"] for d in data if d["choices"][0]["text"]], lines
    assert events[-1] == "data: [DONE]", lines
    # the serve had the request's body: the model the request named
    assert {d["model"] for d in data} == {"a-fast"}, data
    assert fed.gpud.seen == [("a-fast", "")]
    # who asked: without keys, the client's address, all of loopback one (the script's own
    # ensure, as nginx's)
    assert fed.gpud.requesters[-1] == "addr:loopback"


def test_an_error_answer_after_loading_feedback_is_an_error_event(fed: Fed) -> None:
    fed.gpud.delay_s = 3.0
    status, _h, lines = _stream(fed.port, {"model": "a", "prompt": "x", "max_tokens": 0})
    events = _events(lines)
    assert status == 200 and events[0] == ": loading a", lines
    # the serve's error document (vLLM's shape, {"error": {...}}) as the event's data
    error = _openai_error(json.loads(events[-2].removeprefix("data: ")))
    assert error["message"] == "max_tokens must be a positive integer", lines
    assert events[-1] == "data: [DONE]", lines


def test_a_refusal_after_loading_feedback_is_an_error_event(fed: Fed) -> None:
    fed.gpud.delay_s, fed.gpud.status = 3.0, 403
    status, _h, lines = _stream(fed.port, {"model": "a", "prompt": "x"})
    events = _events(lines)
    assert status == 200 and events[0] == ": loading a", lines
    error = _openai_error(json.loads(events[-2].removeprefix("data: ")))
    assert error["code"] == "model_unavailable" and "ledger bound: no room" in str(
        error["message"]), lines
    assert events[-1] == "data: [DONE]", lines
    assert all(e == ": loading a" for e in events[:-2]), lines


# gpud's refusal of an ensure past daemon.ensure_waiting_per_requester (its X-Gpud-Reason:
# gpud.server.api._too_many_waiting)
TOO_MANY_WAITING = {"error": {
    "code": "too-many-requests",
    "message": "serve a: 16 requests of addr:127.0.0.1 wait for a bring-up already "
               "(daemon.ensure_waiting_per_requester); retry in 5 s",
    "details": {"serve": "a", "class": "too-many-waiting", "requester": "addr:127.0.0.1",
                "limit": "daemon.ensure_waiting_per_requester", "value": 16,
                "retry_after_s": 5}}}


def _rate_limit_error(doc: dict[str, object]) -> dict[str, object]:
    """The router's one 429 document (a key's limits and gpud's bound alike): OpenAI's own
    (type "requests", code "rate_limit_exceeded"), which limit and its figure under gpud."""
    err = doc["error"]
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code", "gpud"}
    assert (err["type"], err["param"], err["code"]) == ("requests", None, "rate_limit_exceeded")
    gpud = err["gpud"]
    assert isinstance(gpud, dict) and {"limit", "value", "retry_after_s"} <= set(gpud), err
    return gpud


def test_gpuds_bound_on_waiting_requests_is_the_routers_one_429(fed: Fed) -> None:
    """At 310a618 this 429 had type "rate_limit_error" and gpud's reason as it came, beside the
    keys' limits' "requests" with limit and value: now one shape, with Retry-After."""
    fed.gpud.status, fed.gpud.reason = 403, TOO_MANY_WAITING
    status, headers, body = _req(fed.port, "POST", "/v1/completions",
                                 b'{"model": "a", "prompt": "x"}')
    assert status == 429 and headers["Content-Type"] == "application/json", body
    said = _rate_limit_error(json.loads(body))
    assert said == {"limit": "daemon.ensure_waiting_per_requester", "value": 16,
                    "retry_after_s": 5, "serve": "a", "requester": "addr:127.0.0.1"}, said
    assert headers["Retry-After"] == "5"
    assert "ensure_waiting_per_requester" in json.loads(body)["error"]["message"]
    # a stream: at once, the same (nothing sent yet); after loading feedback, as its event
    status, headers, lines = _stream(fed.port, {"model": "a", "prompt": "x"})
    assert status == 429 and headers["Retry-After"] == "5", lines
    fed.gpud.delay_s = 1.5
    status, _h, lines = _stream(fed.port, {"model": "a", "prompt": "x"})
    events = _events(lines)
    assert status == 200 and events[0] == ": loading a" and events[-1] == "data: [DONE]", lines
    assert _rate_limit_error(json.loads(events[-2].removeprefix("data: "))) == said


def _anthropic_stream_error(port: int, **extra: object) -> Any:
    """A stream of Anthropic's messages through the router, read by Anthropic's own library:
    the error it raises (the test fails if the stream ends without one)."""
    import anthropic

    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="unused",
                                 max_retries=0, timeout=30)
    request: dict[str, Any] = {"model": "a", "max_tokens": 4,
                               "messages": [{"role": "user", "content": "x y"}], **extra}
    with pytest.raises(anthropic.APIStatusError) as caught:
        for _event in client.messages.create(stream=True, **request):
            pass
    return caught.value


def test_an_error_after_loading_feedback_is_anthropics_event_on_messages(fed: Fed) -> None:
    """Anthropic's clients read only named events: at 310a618 a refusal (or a serve's error)
    after loading feedback came as OpenAI's `data:` event and [DONE], which Anthropic's SDK
    skips, so the stream ended as if answered. Now `event: error` with Anthropic's document,
    which the SDK raises."""
    fed.gpud.status, fed.gpud.delay_s = 403, 1.5
    err = _anthropic_stream_error(fed.port)
    assert err.body["type"] == "error", err.body
    assert err.body["error"]["type"] == "overloaded_error", err.body
    assert "cannot be brought up: ledger bound: no room" in err.body["error"]["message"]
    # past the requests waiting already: Anthropic's rate_limit_error
    fed.gpud.reason = TOO_MANY_WAITING
    err = _anthropic_stream_error(fed.port)
    assert err.body["error"]["type"] == "rate_limit_error", err.body
    # the serve's own error (vLLM's, in Anthropic's shape already) goes as it came
    fed.gpud.status, fed.gpud.reason = 204, None
    err = _anthropic_stream_error(fed.port, max_tokens=0)
    assert err.body["error"] == {"type": "BadRequestError",
                                 "message": "max_tokens: a positive integer is required"}
    # the raw bytes: comments, then the one named event, no [DONE]
    conn = http.client.HTTPConnection("127.0.0.1", fed.port, timeout=30)
    fed.gpud.status = 403
    try:
        conn.request("POST", "/v1/messages", body=json.dumps(
            {"model": "a", "max_tokens": 4, "stream": True,
             "messages": [{"role": "user", "content": "x"}]}))
        events = [e for e in conn.getresponse().read().decode().split("\n\n") if e]
    finally:
        conn.close()
    assert events[0] == ": loading a" and not any("[DONE]" in e for e in events), events
    assert events[-1].startswith('event: error\ndata: {"type":"error","error":'), events


def test_a_quick_answer_from_gpud_sends_no_comment(fed: Fed) -> None:
    """gpud answering within the first second (the serve is up): the request goes on to
    its serve as any other, a refusal the usual 503 with Retry-After."""
    status, headers, lines = _stream(fed.port, {"model": "a", "prompt": "x y"})
    assert status == 200 and not any(" :" in line for line in lines), lines
    assert _events(lines)[-1] == "data: [DONE]"
    fed.gpud.status = 403
    status, headers, lines = _stream(fed.port, {"model": "a", "prompt": "x y"})
    assert status == 503 and headers["Retry-After"] == "7", (status, lines)
    # a request that does not stream is never sent comments, however long gpud takes
    fed.gpud.delay_s, fed.gpud.status = 1.8, 204
    code, headers, body = _req(fed.port, "POST", "/v1/completions",
                               b'{"model": "a", "prompt": "x"}')
    assert code == 200 and headers["Content-Type"] == "application/json", body
    assert json.loads(body)["model"] == "a"


def test_the_access_log_gives_requests_by_model_and_the_routers_own_latency(fed: Fed) -> None:
    table = {"a": "a", "a-fast": "a"}
    fed.log.write_text("")
    for doc in ({"model": "a", "prompt": "x"}, {"model": "a-fast", "prompt": "x"},
                {"model": "nope", "prompt": "x"}, {"prompt": "x"}):
        _req(fed.port, "POST", "/v1/completions", json.dumps(doc).encode())
    fed.gpud.delay_s = 3.0
    _stream(fed.port, {"model": "a", "prompt": "x"})
    fed.gpud.status = 403
    _stream(fed.port, {"model": "a", "prompt": "x"})
    # nginx writes a request's line once it has ended
    wait_until(lambda: len(fed.log.read_text().splitlines()) == 6, what="six lines")
    answered = [parse_log_line(line, table) for line in fed.log.read_text().splitlines()]
    assert [(a.model, a.serve, a.status_class) for a in answered if a is not None] == [
        ("a", "a", "2xx"), ("a-fast", "a", "2xx"), ("", "", "4xx"), ("", "", "4xx"),
        ("a", "a", "2xx"), ("a", "a", "5xx")]
    # the router's own share: what the serve answered within the request, gpud's ensure
    # taken out; none for a request no serve answered, nor for one answered through the
    # loading feedback (its serve answered a subrequest)
    overheads = [a.overhead_s for a in answered if a is not None]
    assert all(o is not None and 0 <= o < 1.0 for o in overheads[:2]), overheads
    assert overheads[2:] == [None, None, None, None], overheads


def test_the_journal_names_the_request_and_its_key_escaped() -> None:
    assert RouterRequest("chat-fast").text == "request for model 'chat-fast' through the router"
    assert RouterRequest("a\x1b[31m", "ci").text == \
        "request for model 'a\\\\x1b[31m' with key 'ci' through the router"
    router = RouterFront("127.0.0.1:8000", (RoutedServe("a", ("a",), port=1,
                                                        ensure_timeout_s=30),))
    # the ensure carries both, and gpud's share is kept apart from the router's own
    lines = "\n".join(http_lines(router))
    assert "proxy_set_header X-Gpud-Model $router_model;" in lines
    assert "proxy_set_header X-Gpud-Key $router_key_name;" in lines
    assert "auth_request_set $router_ensure_s $upstream_response_time;" in lines


def test_a_client_that_goes_away_while_its_stream_waits_leaves_gpuds_queue(fed: Fed) -> None:
    """The client of a stream waiting on a bring-up goes away: the script's next comment
    fails, nginx ends the request and closes its ensure (gpud counts the request gone from
    its queue), and the router serves on."""
    fed.gpud.delay_s = 30
    with socket.create_connection(("127.0.0.1", fed.port), timeout=10) as client:
        body = b'{"model": "a", "prompt": "x", "stream": true}'
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d"
                       b"\r\n\r\n%s" % (len(body), body))
        got = b""
        while b": loading a" not in got:
            got += client.recv(65536)
    assert fed.gpud.gone.wait(20), "the ensure was left waiting"
    fed.gpud.delay_s = 0
    status, _h, lines = _stream(fed.port, {"model": "a", "prompt": "x y"})
    assert status == 200 and _events(lines)[-1] == "data: [DONE]", lines


def _hang_up_after_two_comments(fed: Fed, reset: bool, pause_s: float = 0.0) -> None:
    """A stream for a through the rig, its client gone PAUSE_S after its second loading
    comment: closed (a FIN), or with RESET an RST (a zero linger)."""
    with socket.create_connection(("127.0.0.1", fed.port), timeout=10) as client:
        body = b'{"model": "a", "prompt": "x", "stream": true}'
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d"
                       b"\r\n\r\n%s" % (len(body), body))
        got = b""
        while got.count(b": loading a") < 2:
            got += client.recv(65536)
        time.sleep(pause_s)
        if reset:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
def test_a_hang_up_during_loading_comments_ends_the_request_cleanly(fed: Fed,
                                                                   reset: bool) -> None:
    """L8: the client of a stream that is being sent loading comments hangs up (closes, or
    resets the connection); the script's next comment cannot be sent. The request ends, its
    ensure closed (gpud counts it gone from its queue) and no later comment is tried, without
    an njs exception in nginx's error log (at 310a618 each hang-up logged `js exception`, the
    comment's failed send)."""
    fed.gpud.delay_s = 30
    fed.log.write_text("")
    _hang_up_after_two_comments(fed, reset)
    began = time.monotonic()
    assert fed.gpud.gone.wait(20), "the ensure was left waiting"
    # the failed comment comes at most two comments (2 s) after the hang-up
    assert time.monotonic() - began < 5
    # nginx writes the request's line once it has ended: it has, whole
    wait_until(lambda: len(fed.log.read_text().splitlines()) == 1, what="the request ended")
    time.sleep(1.5)  # a comment's timer left ticking would fire by now
    errors = fed.errors.read_text()
    assert "js exception" not in errors and "pending events" not in errors, errors
    fed.gpud.delay_s = 0
    status, _h, lines = _stream(fed.port, {"model": "a", "prompt": "x y"})
    assert status == 200 and _events(lines)[-1] == "data: [DONE]", lines


@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
def test_a_hang_up_while_the_queue_note_is_asked_ends_the_request_cleanly(
        fed: Fed, reset: bool) -> None:
    """L8: the client hangs up while the script's queue note (its subrequest to gpud's
    GET /v1/serves, a promise) is out. Were the subrequest ended for it (nginx's
    ngx_http_upstream_check_broken_connection finalizing it with 499), its promise would never
    resolve (njs's ngx_http_js_subrequest_done returns before the callback when
    r->connection->error) and the script would stay pending: the request still ends, its
    line written once, its ensure closed, nothing left pending (as measured here, nginx
    notices the hang-up at the next comment's send, 0.8-1.8 s later)."""
    fed.gpud.delay_s, fed.gpud.serves_delay_s = 30, 0.6
    fed.log.write_text("")
    _hang_up_after_two_comments(fed, reset, pause_s=0.2)  # the second note is out for 0.6 s
    assert fed.gpud.gone.wait(5), "the ensure was left waiting"
    wait_until(lambda: len(fed.log.read_text().splitlines()) == 1, what="the request ended")
    time.sleep(1.5)
    assert len(fed.log.read_text().splitlines()) == 1
    errors = fed.errors.read_text()
    assert "js exception" not in errors and "pending events" not in errors, errors


def test_with_gpud_unreachable_the_router_goes_by_the_awake_file(fed: Fed) -> None:
    """M3: gpud not answering its ensure (nginx's auth_request takes it as an error, as a
    socket nobody listens on), the router reaches the serve only when gpud last said it was
    running and awake, as the fronts do; else 503 at once (at e8f41a4 it sent the request on
    to a serve that may be asleep, where it hung)."""
    fed.gpud.status = 500
    status, _h, body = _req(fed.port, "POST", "/v1/completions",
                            b'{"model": "a", "prompt": "x", "max_tokens": 1}')
    assert status == 200 and json.loads(body)["model"] == "a", body
    fed.awake.unlink()
    began = time.monotonic()
    status, headers, body = _req(fed.port, "POST", "/v1/completions",
                                 b'{"model": "a", "prompt": "x", "max_tokens": 1}')
    error = _openai_error(json.loads(body))
    assert status == 503 and error["code"] == "model_not_running", body
    assert headers.get("Retry-After") and time.monotonic() - began < 2


def test_a_streams_ensure_that_gpud_does_not_answer_goes_by_the_awake_file(fed: Fed) -> None:
    """The loading feedback's own ensure (a detached subrequest whose answer the script looks
    for): gpud answering 500, or nobody on its socket (nginx's 502, @router_ensure_failed),
    is said to the script too, never waited on: as the auth_request's, the serve when gpud
    last said it was awake, else 503 at once."""
    fed.gpud.status, fed.gpud.delay_s = 500, 1.5
    status, _h, lines = _stream(fed.port, {"model": "a", "prompt": "x y"})
    events = _events(lines)
    assert status == 200 and events[0] == ": loading a" and events[-1] == "data: [DONE]", lines
    fed.gpud.shutdown()
    fed.gpud.server_close()  # its socket's file is left, with nobody listening
    status, _h, lines = _stream(fed.port, {"model": "a", "prompt": "x y"})
    assert status == 200 and _events(lines)[-1] == "data: [DONE]", lines
    fed.awake.unlink()
    began = time.monotonic()
    status, _h, body = _req(fed.port, "POST", "/v1/completions",
                                 b'{"model": "a", "prompt": "x", "stream": true}')
    assert status == 503 and _openai_error(json.loads(body))["code"] == "model_not_running"
    assert time.monotonic() - began < 2, body


def test_a_serve_gone_after_gpud_said_it_was_up_answers_503_in_openais_shape(fed: Fed) -> None:
    """gpud's ensure says yes, then the serve's socket refuses (it went away in between): the
    serve location's own error pages replace the server's, so its 502 must be named there too,
    else nginx's HTML page goes out (a raw 502 seen once in the fairness storm)."""
    fed.serve.terminate()
    fed.serve.wait(timeout=10)
    status, headers, body = _req(fed.port, "POST", "/v1/completions",
                                 b'{"model": "a", "prompt": "x", "max_tokens": 1}')
    error = _openai_error(json.loads(body))
    assert status == 503 and error["code"] == "model_not_running", body
    assert headers.get("Retry-After") and fed.gpud.seen, body


def test_a_router_beyond_loopback_without_keys_is_warned_about() -> None:
    """L6: at e8f41a4 nothing was said."""
    from gpud.daemon import _warnings

    wide = TOML.replace('listen = "127.0.0.1:8000"', 'listen = "0.0.0.0:8000"')
    assert ("router.listen: 0.0.0.0:8000 is reachable beyond this host and "
            "router.api_keys_file is not set") in "\n".join(_warnings(parse_config(wide, "t"), ()))
    assert not any(w.startswith("router.listen") for w in _warnings(parse_config(TOML, "t"), ()))


def test_a_model_answers_get_only(rig: Rig) -> None:
    """L7: at e8f41a4 DELETE /v1/models/a answered 200."""
    status, headers, body = _req(rig.port, "DELETE", "/v1/models/a")
    assert status == 405 and headers.get("Allow") == "GET, HEAD", body
    assert _openai_error(json.loads(body))["code"] == "method_not_allowed"
    assert _req(rig.port, "GET", "/v1/models/a")[0] == 200



class _Units:
    """The D-Bus calls Front.sync makes, of a front that is running: what it was asked."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def active_state(self, unit: str) -> str:
        return "active"

    async def unit_property(self, unit: str, prop: str) -> str:
        from gpud.nginx.front import description

        return description(self.cfg.daemon)

    async def kill_main(self, unit: str, sig: int) -> None:
        self.calls.append(f"kill {sig}")

    cfg: Any


async def test_one_sync_reads_the_keys_once_and_keeps_the_last_good_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """45.3: a sync computes the router once and reads its keys file once (at e8f41a4: four
    times). H4: a keys file refused under a running config leaves the router up with the keys
    last read, and says so."""
    import gpud.nginx.front
    import gpud.nginx.router
    from gpud.nginx.front import Front

    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS.replace('models = ["a", "a-fast"]', 'models = ["chat"]'))
    keys.chmod(0o600)
    text = TOML.replace('listen = "127.0.0.1:8000"\n',
                        f'listen = "127.0.0.1:8000"\nnjs_module = "{NJS}"\n'
                        f'api_keys_file = "{keys}"\n')
    text = text.replace("[daemon]\n", f'[daemon]\nfront_dir = "{tmp_path}/front"\n'
                        f'serve_socket_dir = "{tmp_path}/serves"\n')
    cfg = parse_config(text, "t")
    ids = (os.getuid(), os.getgid())
    monkeypatch.setattr(gpud.nginx.front, "_front_ids", lambda d: ids)
    reads: list[str] = []
    real = gpud.nginx.router.load_keys

    def counted(path: str, known: list[str], **kw: Any) -> Any:
        reads.append(path)
        return real(path, known, **kw)
    monkeypatch.setattr(gpud.nginx.router, "load_keys", counted)
    units = _Units()
    units.cfg = cfg

    async def listening(addresses: frozenset[str]) -> list[str]:
        return []  # no nginx here: the front is taken to listen once reloaded
    front = Front(units, listening=listening)  # type: ignore[arg-type]
    await front.sync(cfg)
    assert reads == [str(keys)] and front.degraded == ()
    script = (tmp_path / "front" / "router.js").read_text()
    assert '"name": "alice"' in script and '"name": "ops"' in script
    # the keys file turns bad under the running config: the keys last read are kept
    keys.write_text('[keys.alice]\ntoken = "short"\nmodels = ["chat"]\n')
    reads.clear()
    await front.sync(cfg)
    assert reads == [str(keys)]
    assert len(front.degraded) == 1 and front.degraded[0].startswith(
        f"router.api_keys_file: {keys}: keys.alice.token") and front.degraded[0].endswith(
        "(keeping the keys last read)"), front.degraded
    assert (tmp_path / "front" / "router.js").read_text() == script
    # and by a gpud that starts anew: from the script the front runs
    fresh = Front(units, listening=listening)  # type: ignore[arg-type]
    await fresh.sync(cfg)
    assert (tmp_path / "front" / "router.js").read_text() == script
    assert fresh.degraded == front.degraded
    # a reload after which the front does not listen is said as such, not taken as done
    (tmp_path / "front" / "nginx.conf").unlink()

    async def nothing_listens(addresses: frozenset[str]) -> list[str]:
        return sorted(addresses)
    dark = Front(units, listening=nothing_listens)  # type: ignore[arg-type]
    await dark.sync(cfg)
    assert dark.degraded == (*front.degraded,
                             "127.0.0.1:30001, 127.0.0.1:8000: the front reloaded but does not "
                             "listen there after 5 s (its log: journalctl -u gpud-front.service)")


def test_a_model_named_like_an_object_method_breaks_nothing(fed: Fed) -> None:
    """L1: at e8f41a4 a model named hasOwnProperty made every routed POST an HTML 500."""
    status, _h, body = _req(fed.port, "POST", "/v1/completions",
                            b'{"model": "a", "prompt": "x", "max_tokens": 1}')
    assert status == 200 and json.loads(body)["model"] == "a", body
    # routed to a's serve (which has no such name: its own 404, not the router's)
    status, _h, body = _req(fed.port, "POST", "/v1/completions",
                            b'{"model": "hasOwnProperty", "prompt": "x", "max_tokens": 1}')
    assert status == 404 and "model_not_found" not in body.decode(), body
    status, _h, body = _req(fed.port, "GET", "/v1/models")
    assert status == 200 and "hasOwnProperty" in body.decode(), body


def test_the_router_sets_priority_on_a_vllm_serve_unless_its_policy_is_another() -> None:
    """A vllm serve the router reaches is launched with the priority policy (gpud.core.launch):
    the router sets the body's priority on it unless its extra_args chose another policy; a
    command serve only when its own argv says so."""
    from gpud.nginx.router import priority_scheduling
    cfg = parse_config(TOML, "t")
    chat = cfg.serves["chat"]
    assert chat.vllm is not None and priority_scheduling(chat)

    def with_args(*args: str) -> bool:
        return priority_scheduling(chat.model_copy(update={
            "vllm": chat.vllm.model_copy(update={"extra_args": list(args)})}))  # type: ignore[union-attr]
    assert not with_args("--scheduling-policy", "fcfs")
    assert not with_args("--scheduling-policy=fcfs")
    assert with_args("--scheduling-policy=priority")
    tool = cfg.serves["tool"]
    assert tool.vllm is None and not priority_scheduling(tool)
    assert priority_scheduling(tool.model_copy(update={
        "command": [*(tool.command or ()), "--scheduling-policy", "priority"]}))


def test_gpuctl_shows_a_serve_with_requests_waiting_as_waiting_with_what_for() -> None:
    from gpud.ctl.format import format_serves
    serve = {"name": "b", "role": "r", "state": "denied", "reason": "ledger bound: need 20000",
             "port": 30002, "front": True, "models": ["b"], "in_flight": None, "queued": 16,
             "vram_mib": 20000, "waiting": {"requests": 16, "in_s": 286.4,
                                            "reason": "a may be evicted in 287 s (min_awake_s)"}}
    models = format_models({"serves": [serve]}).splitlines()  # type: ignore[list-item]
    assert models[1].split()[:4] == ["b", "local", "b", "waiting"], models
    assert "b (waiting): 16 requests; a may be evicted in 287 s (min_awake_s)" in models
    serves = format_serves({"serves": [serve]}).splitlines()  # type: ignore[list-item]
    assert "waiting" in serves[1].split() and "denied" not in serves[1], serves
    assert serves[-1] == "b (waiting): 16 requests; a may be evicted in 287 s (min_awake_s)"
