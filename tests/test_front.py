"""The front: its nginx.conf from data (golden), the config keys that make a serve fronted, the
argv of a fronted serve, and the real nginx in front of a real stand-in on a Unix socket."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpud.config import config_warnings, parse_config
from gpud.core.front import (
    DEFAULT_PATHS,
    MAX_WORKERS,
    NOFILE,
    WORKER_CONNECTIONS,
    FrontConfig,
    FrontServe,
    path_problem,
    render,
    socket_path,
)
from gpud.core.launch import serve_argv, show_commands
from gpud.core.observation import DeviceSample
from gpud.core.vocab import ServeState
from gpud.daemon import _warnings
from gpud.errors import ConfigError
from gpud.nginx.front import (
    Front,
    description,
    front_config,
    nginx_argv,
    not_listening,
    unit_properties,
)
from tests.ports import connects, free_port
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[1]
NGINX = REPO / ".venv" / "bin" / "nginx"

GOLDEN = """\
# Written by gpud (gpud/core/front.py); rewritten whenever the serves change.
daemon off;
worker_processes 1;
worker_rlimit_nofile 16384;
pid /run/gpud/front/run/nginx.pid;
error_log stderr warn;
events {
    worker_connections 8192;
}
http {
    access_log off;
    server_tokens off;
    client_header_timeout 10s;
    client_body_timeout 10s;
    send_timeout 30s;
    keepalive_timeout 60s;
    keepalive_requests 1000;
    lingering_time 10s;
    lingering_timeout 5s;
    reset_timedout_connection on;
    client_header_buffer_size 1k;
    large_client_header_buffers 4 8k;
    client_body_temp_path /run/gpud/front/run/body;
    proxy_temp_path /run/gpud/front/run/proxy;
    fastcgi_temp_path /run/gpud/front/run/fastcgi;
    uwsgi_temp_path /run/gpud/front/run/uwsgi;
    scgi_temp_path /run/gpud/front/run/scgi;
    default_type application/json;
    client_max_body_size 64m;
    proxy_buffering off;
    proxy_request_buffering off;
    proxy_http_version 1.1;
    proxy_set_header Connection "";
    proxy_set_header Host $host;
    proxy_set_header X-Gpud-Model "";
    proxy_set_header X-Gpud-Key "";
    proxy_set_header X-Gpud-Requester "";
    proxy_read_timeout 3600s;
    proxy_send_timeout 3600s;
    map $remote_addr $gpud_requester_addr {
        "~^127\\." loopback;
        "::1" loopback;
        "~^::ffff:127\\." loopback;
        default $remote_addr;
    }

    # serve ocr-2
    upstream serve_ocr_2 {
        server unix:/run/gpud/serves/ocr-2.sock;
        keepalive 32;
    }
    server {
        listen 127.0.0.1:30001;
        error_page 502 =503 @down;
        location ^~ /v1/ {
            proxy_pass http://serve_ocr_2;
        }
        location = /health {
            proxy_pass http://serve_ocr_2;
        }
        location / {
            return 404;
        }
        location @down {
            return 503 '{"error":{"message":"serve ocr-2 is not running","type":"server_error","param":null,"code":"model_not_running"}}';
        }
    }
}
"""


def test_golden_config() -> None:
    cfg = FrontConfig(serves=(FrontServe("ocr-2", 30001, "/run/gpud/serves/ocr-2.sock"),),
                      paths=("/v1/", "/health"), run_dir="/run/gpud/front/run")
    assert render(cfg) == GOLDEN


ON_DEMAND = """\
        location ^~ /v1/ {
            auth_request /.gpud-ensure;
            auth_request_set $gpud_reason $upstream_http_x_gpud_reason;
            auth_request_set $gpud_retry $upstream_http_retry_after;
            proxy_pass http://serve_od;
        }
        location = /.gpud-ensure {
            internal;
            proxy_pass http://gpud_api/v1/serves/od/ensure;
            proxy_method POST;
            proxy_pass_request_body off;
            proxy_pass_request_headers off;
            proxy_set_header Content-Length "";
            proxy_set_header X-Gpud-Requester addr:$gpud_requester_addr;
            proxy_read_timeout 65s;
        }
        error_page 403 = @refused;
        error_page 500 = @direct;
        recursive_error_pages on;
        location @refused {
            add_header Retry-After $gpud_retry always;
            return 503 $gpud_reason;
        }
        location @direct {
            proxy_pass http://serve_od;
        }
"""


def test_an_on_demand_serve_asks_gpud_first() -> None:
    text = render(FrontConfig(serves=(FrontServe("od", 30001, "/s/od.sock", 65),),
                              paths=("/v1/",), gpud_socket="/run/gpud/gpud.sock"))
    assert ON_DEMAND in text
    assert "    upstream gpud_api {\n        server unix:/run/gpud/gpud.sock;\n    }\n" in text
    plain = render(FrontConfig(serves=(FrontServe("p", 30001, "/s/p.sock"),)))
    assert "auth_request" not in plain and "gpud_api" not in plain


def test_servers_come_in_port_order_whatever_the_input_order() -> None:
    a, b = FrontServe("a", 30002, "/s/a.sock"), FrontServe("b", 30001, "/s/b.sock")
    assert render(FrontConfig(serves=(a, b))) == render(FrontConfig(serves=(b, a)))
    text = render(FrontConfig(serves=(a, b)))
    assert text.index("listen 127.0.0.1:30001") < text.index("listen 127.0.0.1:30002")


@pytest.mark.parametrize("path", ["/", "v1/", "/v1/{x}", "/a b", "/x;y", "/~*", "/$x", ""])
def test_a_path_that_could_change_the_config_is_refused(path: str) -> None:
    assert path_problem(path) is not None
    with pytest.raises(ValueError, match="front: paths"):
        FrontConfig(serves=(), paths=(path,))


def test_two_serves_on_one_port_are_refused() -> None:
    with pytest.raises(ValueError, match="one port"):
        FrontConfig(serves=(FrontServe("a", 1, "/a.sock"), FrontServe("b", 1, "/b.sock")))


TOML = """
[daemon]
serve_socket_dir = "/run/x/serves"
front_dir = "/run/x/front"
front_nginx = "/opt/nginx"
[roles.r]
device = "GPU-0"
[serves.chat]
role = "r"
vram_mib = 1000
port = 30001
front = true
vllm = { model = "m" }
[serves.tool]
role = "r"
vram_mib = 1000
port = 30002
front = true
command = ["/bin/serve", "--uds", "{socket}"]
[serves.od]
role = "r"
vram_mib = 1000
port = 30004
front = true
on_demand = true
start_timeout_s = 99.5
vllm = { model = "m" }
[serves.plain]
role = "r"
vram_mib = 1000
port = 30003
vllm = { model = "m" }
"""


def test_fronted_serves_listen_on_their_socket_and_the_front_on_their_port() -> None:
    cfg = parse_config(TOML, "t.toml")
    front = front_config(cfg)
    assert front.serves == (FrontServe("chat", 30001, "/run/x/serves/chat.sock"),
                            FrontServe("od", 30004, "/run/x/serves/od.sock", 105),
                            FrontServe("tool", 30002, "/run/x/serves/tool.sock"))
    assert front.paths == DEFAULT_PATHS
    assert front.run_dir == "/run/x/front/run"
    assert nginx_argv(cfg.daemon) == ("/opt/nginx", "-c", "/run/x/front/nginx.conf",
                                      "-p", "/run/x/front/run/")
    sock = socket_path(cfg.daemon.serve_socket_dir, "chat")
    argv = serve_argv(cfg.serves["chat"], total_mib=32607, device_index=0,
                      vllm_executable="vllm", name="chat", socket=sock)
    assert argv[:5] == ["vllm", "serve", "m", "--uds", "/run/x/serves/chat.sock"]
    assert "--port" not in argv and "--host" not in argv
    tool = serve_argv(cfg.serves["tool"], total_mib=32607, device_index=0,
                      vllm_executable="vllm", name="tool",
                      socket=socket_path(cfg.daemon.serve_socket_dir, "tool"))
    assert tool == ["/bin/serve", "--uds", "/run/x/serves/tool.sock"]
    plain = serve_argv(cfg.serves["plain"], total_mib=32607, device_index=0,
                       vllm_executable="vllm", name="plain")
    assert plain[3:7] == ["--host", "127.0.0.1", "--port", "30003"]


@pytest.mark.parametrize(("change", "error"), [
    ("port = 30002\n", "front: a fronted serve needs the port"),
    ('command = ["/bin/serve", "--port", "{port}"]\n', "must listen on {socket}"),
])
def test_a_fronted_serve_that_cannot_be_fronted_is_refused(change: str, error: str) -> None:
    text = TOML.replace('port = 30002\n', "").replace(
        'command = ["/bin/serve", "--uds", "{socket}"]\n', "")
    text = text.replace("[serves.plain]", "").replace("port = 30003\n", "")
    base = text.split("[serves.tool]")[0] + "[serves.tool]\nrole = \"r\"\nvram_mib = 1000\n" \
        "front = true\n"
    if "command" in change:
        base += "port = 30002\n" + change
    else:
        base += 'command = ["/bin/serve", "--uds", "{socket}"]\n'
    with pytest.raises(ConfigError, match=error.replace("{", r"\{").replace("}", r"\}")):
        parse_config(base, "t.toml")


@pytest.mark.parametrize(("lines", "error"), [
    ("front = false\non_demand = true\n", "on_demand: needs front = true"),
    ("front = true\non_demand = true\nresident = true\n", "give one of the two"),
    ("front = true\npreempt = true\n", "preempt: says how an on_demand serve"),
])
def test_on_demand_needs_a_front_and_no_boot(lines: str, error: str) -> None:
    text = TOML.split("[serves.chat]")[0] + (
        '[serves.x]\nrole = "r"\nvram_mib = 1\nport = 1\nvllm = { model = "m" }\n' + lines)
    with pytest.raises(ConfigError, match=error):
        parse_config(text, "t.toml")


def test_a_bad_allow_list_entry_names_its_key() -> None:
    text = TOML.replace('front_nginx = "/opt/nginx"', 'front_paths = ["/v1/", "/"]')
    with pytest.raises(ConfigError, match=r"daemon.front_paths\[1\]: '/' would forward"):
        parse_config(text, "t.toml")


# --- the real nginx in front of a real stand-in --------------------------------------------


def test_with_gpud_unreachable_an_on_demand_serve_goes_by_its_awake_file() -> None:
    text = render(FrontConfig(serves=(FrontServe("od", 30001, "/s/od.sock", 65),),
                              paths=("/v1/",), awake_dir="/run/gpud/front/awake/"))
    assert """\
        location @direct {
            if (!-f /run/gpud/front/awake/od) {
                return 503 '{"error":{"message":"serve od is not running (gpud unreachable)","type":"server_error","param":null,"code":"model_not_running"}}';
            }
            proxy_pass http://serve_od;
        }
""" in text


def test_the_descriptor_limit_stays_above_the_connections() -> None:
    # nginx reclaims idle connections only when worker_connections runs short, never when
    # accept4() fails for want of descriptors: the unit's limit, nginx's and the connections
    # agree.
    props = dict(unit_properties(parse_config(TOML, "t.toml").daemon))
    assert props["LimitNOFILE"].signature == "t"
    assert props["LimitNOFILE"].value == NOFILE
    text = render(FrontConfig(serves=(FrontServe("a", 30001, "/s/a.sock"),)))
    assert f"worker_rlimit_nofile {NOFILE};" in text
    assert f"worker_connections {WORKER_CONNECTIONS};" in text
    assert NOFILE >= 2 * WORKER_CONNECTIONS


@pytest.mark.parametrize("workers", [0, MAX_WORKERS + 1])
def test_workers_are_bounded(workers: int) -> None:
    with pytest.raises(ValueError, match="workers"):
        FrontConfig(serves=(), workers=workers)


def _get(port: int, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=body)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@pytest.fixture
def fronted() -> Iterator[tuple[int, Path, subprocess.Popen[bytes]]]:
    """A stand-in on a Unix socket (with dev mode) and nginx in front of it on a port."""
    if not NGINX.exists():
        pytest.fail(f"{NGINX} missing: run scripts/setup-test")
    # Not pytest's tmp_path (below a 0700 directory): nginx run by root serves from workers
    # that run as nobody.
    tmp_path = Path(tempfile.mkdtemp(prefix="gpud-front-"))
    tmp_path.chmod(0o755)
    sock = tmp_path / "s.sock"
    run = tmp_path / "run"
    for name in ("", "body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (run / name).mkdir(exist_ok=True)
    port = free_port()
    (tmp_path / "nginx.conf").write_text(render(FrontConfig(
        serves=(FrontServe("s", port, str(sock)),), run_dir=str(run))))
    # nginx run by root keeps its master only and serves from workers as `nobody`: the
    # stand-in's socket is then opened up for them (the sandbox test checks the real modes).
    standin = subprocess.Popen(
        [sys.executable, "-m", "gpud.testing.standin", "serve", "m", "--uds", str(sock),
         "--enable-sleep-mode", "--token-interval-s", "0.3"],
        env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = (tmp_path / "nginx.log").open("wb")
    nginx = subprocess.Popen([str(NGINX), "-c", str(tmp_path / "nginx.conf"), "-p", f"{run}/"],
                             stdout=subprocess.DEVNULL, stderr=log)
    try:
        wait_until(sock.exists, what="the stand-in's socket")
        os.chmod(sock, 0o777)
        wait_until(lambda: connects(port), what="nginx listening")
        wait_until(lambda: _get(port, "GET", "/health")[0] == 200, what="health via the front")
        yield port, sock, standin
    finally:
        for proc in (nginx, standin):
            proc.terminate()
            proc.wait(timeout=10)
        log.close()
        shutil.rmtree(tmp_path)


def test_the_config_is_valid_for_nginx(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    conf = tmp_path / "nginx.conf"
    conf.write_text(render(FrontConfig(serves=(FrontServe("a", 30001, "/s/a.sock"),
                                               FrontServe("b-c", 30002, "/s/b-c.sock", 900)),
                                       run_dir=str(run))))
    result = subprocess.run([str(NGINX), "-t", "-c", str(conf), "-p", f"{run}/"],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def test_dev_routes_answer_404_and_the_client_api_goes_through(
        fronted: tuple[int, Path, subprocess.Popen[bytes]]) -> None:
    port, sock, _ = fronted
    for path in ("/sleep?level=1", "/wake_up", "/collective_rpc", "/is_sleeping",
                 "/standin/state", "/v1/../sleep", "/%76%31/../wake_up", "/"):
        status, _body = _get(port, "POST", path, b"{}")
        assert status == 404, path
    # The stand-in itself has them (so the 404 is the front's).
    with socket.socket(socket.AF_UNIX) as direct:
        direct.connect(str(sock))
        direct.sendall(b"GET /is_sleeping HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert direct.recv(100).startswith(b"HTTP/1.1 200")
    status, body = _get(port, "GET", "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == "m"
    assert _get(port, "GET", "/version")[0] == 200


def test_a_stream_comes_through_token_by_token(
        fronted: tuple[int, Path, subprocess.Popen[bytes]]) -> None:
    port, _sock, _ = fronted
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    started = time.monotonic()
    conn.request("POST", "/v1/completions",
                 body=json.dumps({"prompt": "a b c d", "max_tokens": 4, "stream": True}))
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.getheader("Content-Type") == "text/event-stream"
    arrivals = []
    while True:
        line = resp.fp.readline()
        if not line:
            break
        if line.startswith(b"data: "):
            arrivals.append((time.monotonic() - started, line))
        if line.startswith(b"data: [DONE]"):
            break
    conn.close()
    assert len(arrivals) == 5
    # 4 tokens 0.3 s apart, then [DONE]: they reach the client as they are made, not
    # together at the end. (nginx 1.22 passes these on even with proxy_buffering on; the
    # golden text pins it off, as a response larger than its buffers would otherwise wait.)
    assert arrivals[-1][0] - arrivals[0][0] >= 0.9, arrivals


def test_a_serve_that_is_down_answers_503(
        fronted: tuple[int, Path, subprocess.Popen[bytes]]) -> None:
    port, _sock, standin = fronted
    standin.terminate()
    standin.wait(timeout=10)
    status, body = _get(port, "GET", "/v1/models")
    assert status == 503
    assert "not running" in body.decode()


def test_show_commands_shows_a_fronted_serve_on_its_socket() -> None:
    cfg = parse_config(TOML, "t.toml")
    devices = (DeviceSample("GPU-0", 0, "", "", 32607, None, None),)
    argv = [line for line in show_commands(cfg, devices, "test") if line.startswith("  argv: ")]
    assert "  argv: vllm serve m --uds /run/x/serves/chat.sock --gpu-memory-utilization" \
        in argv[0], argv
    assert any("--host 127.0.0.1 --port 30003" in line for line in argv), argv  # as before
    assert "  argv: /bin/serve --uds /run/x/serves/tool.sock" in argv, argv


def test_a_sleep_serve_said_unfronted_is_warned_about() -> None:
    text = TOML.replace('[serves.plain]\nrole = "r"\n',
                        '[serves.plain]\nrole = "r"\nsleep_level = 1\nfront = false\n')
    warnings = config_warnings(parse_config(text, "t.toml"))
    assert [w.split(":")[0] for w in warnings] == ["serves.plain.front"], warnings
    assert "port 30003" in warnings[0] and "without front = false" in warnings[0]
    assert config_warnings(parse_config(TOML, "t.toml")) == []


SERVE = '[serves.x]\nrole = "r"\nvram_mib = 1000\n'
VLLM = 'vllm = { model = "m" }\n'
CONTAINER = 'container = { image = "docker.io/vllm/vllm-openai:v0.33.0" }\nvllm = { model = "m" }\n'


@pytest.mark.parametrize(("lines", "fronted"), [
    ("port = 1\nsleep_level = 1\n" + VLLM, True),
    ("port = 1\nsleep_level = 2\n" + VLLM, True),
    ("port = 1\non_demand = true\n" + VLLM, True),
    ("port = 1\n" + VLLM, False),  # no dev routes: no front unless asked
    ("port = 1\nfront = true\n" + VLLM, True),
    ("port = 1\nsleep_level = 1\nfront = false\n" + VLLM, False),  # the operator's choice
    ("sleep_level = 1\n" + VLLM, False),  # no port to front
    ("port = 1\nsleep_level = 1\n" + CONTAINER, True),
    ('port = 1\nsleep_level = 1\ncommand = ["/bin/s", "--uds", "{socket}"]\n', True),
])
def test_a_serve_that_sleeps_or_starts_on_demand_is_fronted_by_default(
        lines: str, fronted: bool) -> None:
    cfg = parse_config(TOML.split("[serves.chat]")[0] + SERVE + lines, "t.toml")
    assert cfg.serves["x"].front is fronted
    # and the resolved value is what a dump says, so that it validates again as the same serve
    again = type(cfg.serves["x"]).model_validate(cfg.serves["x"].model_dump())
    assert again == cfg.serves["x"]


def test_a_fronted_by_default_vllm_serve_listens_on_its_socket() -> None:
    cfg = parse_config(TOML.split("[serves.chat]")[0] + SERVE + "port = 30009\nsleep_level = 1\n"
                       + VLLM, "t.toml")
    devices = (DeviceSample("GPU-0", 0, "", "", 32607, None, None),)
    argv = [line for line in show_commands(cfg, devices, "test") if line.startswith("  argv: ")]
    assert "--uds /run/x/serves/x.sock" in argv[0] and "--port" not in argv[0], argv
    assert front_config(cfg).serves[0].port == 30009


def test_a_command_serve_that_sleeps_must_listen_on_its_socket_or_say_front_false() -> None:
    text = TOML.split("[serves.chat]")[0] + SERVE + (
        'port = 1\nsleep_level = 1\ncommand = ["/bin/s", "--port", "{port}"]\n')
    with pytest.raises(ConfigError, match=r"serves\.x: .*must listen on \{socket\}.*front = false"):
        parse_config(text, "t.toml")
    assert parse_config(text + "front = false\n", "t.toml").serves["x"].front is False


def test_check_config_warns_when_a_fronted_serve_has_no_nginx_or_front_user(
        tmp_path: Path) -> None:
    text = TOML.replace('front_nginx = "/opt/nginx"', f'front_nginx = "{tmp_path}/nginx"\n'
                        'front_user = "gpud-front-nobody-has"\n'
                        # (whether this host has the serves' default user is not the point)
                        'serve_user = "root"')
    warned = _warnings(parse_config(text, "t.toml"), (tmp_path,))
    assert [w.split(":")[0] for w in warned] == ["daemon.front_nginx", "daemon.front_user"]
    assert "chat, od, tool" in warned[0] and "apt-get install nginx" in warned[0]
    unfronted = text.split("[serves.chat]")[0] + '[serves.p]\nrole = "r"\nvram_mib = 1\n' \
        'port = 1\nvllm = { model = "m" }\n'
    assert _warnings(parse_config(unfronted, "t.toml"), (tmp_path,)) == []


def test_a_fronted_container_serve_binds_its_socket_in_the_shared_directory() -> None:
    """vLLM in the container listens on the socket's own path (the sockets' directory bind-
    mounted), and no port is published: the port is the front's."""
    cfg = parse_config(TOML.split("[serves.chat]")[0] + SERVE + "port = 30009\nsleep_level = 1\n"
                       + CONTAINER, "t.toml")
    spec = cfg.serves["x"]
    argv = serve_argv(spec, total_mib=32607, device_index=0, vllm_executable="vllm", name="x",
                      cdi_devices=["GPU-0"], socket=socket_path("/run/x/serves", "x"))
    assert "--volume=/run/x/serves:/run/x/serves:rw" in argv
    assert not any(a.startswith("--publish") for a in argv), argv
    inner = argv[argv.index(spec.container.image) + 1:]  # what follows the image: vllm serve's
    assert inner[:3] == ["m", "--uds", "/run/x/serves/x.sock"], inner
    assert "--host" not in inner and "--port" not in inner
    # unfronted, as before: vLLM on every interface inside, the port published on 127.0.0.1
    plain = serve_argv(spec.model_copy(update={"front": False}), total_mib=32607,
                       device_index=0, vllm_executable="vllm", name="x", cdi_devices=["GPU-0"])
    assert "--publish=127.0.0.1:30009:30009" in plain and "--host" in plain


def test_a_fronted_container_serve_with_its_own_args_must_listen_on_its_socket() -> None:
    box = ('container = { image = "docker.io/vllm/vllm-openai:v0.33.0", args = ["m", "--port", '
           '"{port}"] }\n')
    text = TOML.split("[serves.chat]")[0] + SERVE + "port = 1\nsleep_level = 1\n" + box
    with pytest.raises(ConfigError, match=r"serves\.x: .*container serve must listen on "
                                          r"\{socket\}.*front = false"):
        parse_config(text, "t.toml")
    ok = parse_config(text.replace('"--port", "{port}"', '"--uds", "{socket}"'), "t.toml")
    argv = serve_argv(ok.serves["x"], total_mib=32607, device_index=0, vllm_executable="vllm",
                      name="x", socket="/run/x/serves/x.sock")
    assert argv[-3:] == ["m", "--uds", "/run/x/serves/x.sock"], argv


def test_awake_files_follow_the_states(tmp_path: Path) -> None:
    # One empty file per fronted serve that runs; the rest removed, a stray one included.
    cfg = parse_config(TOML.replace('front_dir = "/run/x/front"', f'front_dir = "{tmp_path}"'),
                       "t.toml")
    awake = tmp_path / "awake"
    awake.mkdir()
    (awake / "gone").write_text("")
    states = {"chat": ServeState.RUNNING, "od": ServeState.SLEEPING, "plain": ServeState.RUNNING}
    front = Front(None, states=lambda: states)  # type: ignore[arg-type]  # no D-Bus here
    front._config = cfg
    front.mark_awake()
    assert sorted(p.name for p in awake.iterdir()) == ["chat"]
    states.update(chat=ServeState.STOPPING, od=ServeState.RUNNING, tool=ServeState.RUNNING)
    front.mark_awake()
    assert sorted(p.name for p in awake.iterdir()) == ["od", "tool"]


def test_the_front_units_description_names_its_properties() -> None:
    # A front found running with another description was started with other properties (an
    # earlier gpud's): gpud starts it again (gpud.nginx.front.Front.sync).
    d = parse_config(TOML, "t.toml").daemon
    props = dict(unit_properties(d))
    assert props["Description"].value == description(d)
    # the front's memory is bounded by its unit (H3)
    assert (props["MemoryHigh"].value, props["MemoryMax"].value) == (3 << 30, 4 << 30)
    assert description(d) == description(parse_config(TOML, "t.toml").daemon)
    other = d.model_copy(update={"front_dir": "/run/gpud/elsewhere"})
    assert description(other) != description(d)
    assert description(d.model_copy(update={"front_user": "someone-else"})) != description(d)


# --- a started or reloaded front is said to be so once it listens ---------------------------

async def test_a_front_listens_once_every_address_accepts_a_connection() -> None:
    """not_listening: an address that accepts a connection is listening, one nobody binds is
    not (within the wait), and one bound a moment after the start is waited for; the try
    sends nothing, so a listener sees a connection and no request."""
    bound = socket.socket()
    bound.bind(("127.0.0.1", 0))
    bound.listen()
    later, nobody = free_port(), free_port()
    up = f"127.0.0.1:{bound.getsockname()[1]}"
    late = socket.socket()

    async def bind_late() -> None:
        await asyncio.sleep(0.3)
        late.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        late.bind(("127.0.0.1", later))
        late.listen()

    try:
        binding = asyncio.create_task(bind_late())
        began = time.monotonic()
        dark = await not_listening(frozenset({up, f"127.0.0.1:{later}",
                                              f"localhost:{nobody}"}), wait_s=1.5)
        await binding
        assert dark == [f"localhost:{nobody}"]
        assert 1.5 <= time.monotonic() - began < 4  # the dark one was waited for, no longer
        # the listener got a connection that sent nothing
        bound.settimeout(2)
        conn, _ = bound.accept()
        conn.settimeout(2)
        assert conn.recv(1) == b""
        conn.close()
        assert await not_listening(frozenset({up}), wait_s=0) == []
        assert await not_listening(frozenset(), wait_s=5) == []
    finally:
        bound.close()
        late.close()
