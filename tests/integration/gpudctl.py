"""Drive a gpud installed in the sandbox: configure, (re)start, call its API, read systemd."""

from __future__ import annotations

import contextlib
import json
import sys
import textwrap
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gpud.core.router import DEFAULT_NJS_MODULE
from tests.conftest import Reply, call
from tests.waiting import wait_until
from tools.sandbox import Sandbox

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
# PYTHONPATH: a serve unit runs from /, where `import gpud` would find whichever checkout the
# interpreter has installed, not this one.
STANDIN = ["/usr/bin/env", f"PYTHONPATH={REPO}", PY, "-m", "gpud.testing.standin"]


# Where the sandbox's gpud-front.service finds nginx: the unit runs with PrivateTmp= and
# ProtectHome=, so a checkout under /tmp, /var/tmp or a home directory (where CI clones it) is
# not visible to it; scripts/setup-test's nginx is copied into the sandbox's own /usr/local/sbin (its
# overlay: the host's stays untouched), where a host's own nginx would be.
NGINX = "/usr/local/sbin/nginx"
SERVE_SOCKETS = "/run/gpud/serves"  # daemon.serve_socket_dir's default
NJS_MODULE = REPO / ".venv" / "lib" / "nginx" / "modules" / "ngx_http_js_module.so"


def standin(*args: str) -> str:
    """A TOML array for a stand-in serve command on its port (a serve without a front)."""
    return json.dumps([*STANDIN, "--port", "{port}", "--gpu-memory-utilization",
                       "{gpu_memory_utilization}", *args])


def standin_uds(*args: str) -> str:
    """A TOML array for a fronted stand-in serve: it listens on its socket, the front on its
    port."""
    return json.dumps([*STANDIN, "serve", "m", "--uds", "{socket}",
                       "--gpu-memory-utilization", "{gpu_memory_utilization}", *args])


def install_front(sb: Sandbox) -> None:
    """nginx and the front's user in the sandbox: what the package and an operator provide.
    Every configured gpud has them, so that any fronted serve (the default for one that
    sleeps) has its front."""
    sb.run(["install", "-m", "0755", str(REPO / ".venv" / "bin" / "nginx"), NGINX])
    # and its njs module (the router, docs/router.md) where Debian's package puts it: router.
    # njs_module's default
    if NJS_MODULE.exists():
        sb.run(["install", "-D", "-m", "0644", str(NJS_MODULE), DEFAULT_NJS_MODULE])
    # The front's user: in group gpud, whose members may open gpud's socket (the on-demand
    # check).
    sb.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
            "--groups", "gpud", "gpud-front"], check=False)


def sim_config(roles: str, serves: str, *, devices: int = 1, daemon: str = "",
               total_mib: int = 32607) -> str:
    devs = "".join(f'[[simulation.devices]]\nuuid = "GPU-sim-{i}"\ntotal_mib = {total_mib}\n'
                   for i in range(devices))
    return (f"[daemon]\nhealth_interval_s = 0.5\nobserve_interval_s = 0.5\n"
            f'front_nginx = "{NGINX}"\n{daemon}\n'
            f"{textwrap.dedent(roles)}\n{textwrap.dedent(serves)}\n"
            f'[simulation]\nstate_file = "/run/gpud/sim.json"\n{devs}')


# A role on the first simulated GPU (32607 MiB) with 1000 MiB kept back.
ROLE_R = '[roles.r]\ndevice = "GPU-sim-0"\nreserve_mib = 1000\n'
def on_demand(name: str, port: int, *args: str, mib: int = 20000) -> str:
    """[serves.NAME] of role r (ROLE_R): MIB of VRAM, on demand, up within 30 s, its one
    model NAME, a fronted stand-in (ARGS more of its arguments) on PORT."""
    return (f'[serves.{name}]\nrole = "r"\nvram_mib = {mib}\nport = {port}\non_demand = true\n'
            f'start_timeout_s = 30\nmodels = ["{name}"]\n'
            f"command = {standin_uds(*args, '--served-model-name', name)}\n")


# Waits (10 s at most) until every address the front's nginx.conf listens on accepts a
# connection.
LISTENING = ("for listen in $(sed -n 's/^ *listen \\([^;]*\\);.*/\\1/p' /run/gpud/front/nginx.conf); do "
             "for i in $(seq 500); do (exec 3<>/dev/tcp/${listen%:*}/${listen##*:}) 2>/dev/null "
             "&& break; sleep 0.02; done; "
             "(exec 3<>/dev/tcp/${listen%:*}/${listen##*:}) || exit 1; done")


class SandboxGpud:
    def __init__(self, sandbox: Sandbox) -> None:
        self.sb = sandbox
        # When this test's gpud was set up: the sandbox's journal outlives each test's gpud,
        # so what a test reads of it starts here.
        self.since = time.time()

    @property
    def socket(self) -> Path:
        return self.sb.host_path("/run/gpud/gpud.sock")

    def reset(self) -> None:
        """No gpud, no serve units, no state: every test starts from nothing."""
        self.since = time.time()
        self.sb.run(["systemctl", "stop", "gpud.service"], check=False)
        self.sb.run("systemctl stop 'gpud-serve-*' gpud-front.service; "
                    "systemctl reset-failed 'gpud-serve-*' gpud-front.service; "
                    "rm -rf /var/lib/gpud /run/gpud/sim.json /run/gpud/sim-procs /etc/gpud/backups "
                    f"/run/gpud/front {SERVE_SOCKETS}", check=False)

    def configure(self, config: str, *, external: list[dict[str, Any]] | None = None,
                  start: bool = True) -> None:
        self.reset()
        self.sb.install_gpud(REPO, config)
        install_front(self.sb)
        self.sb.run(["mkdir", "-p", "/run/gpud"])
        self.set_external(external or [])
        if start:
            self.start()

    def wait_journal(self, *matches: str, unit: str | None = "gpud.service",
                     timeout: float = 10) -> list[dict[str, str]]:
        """The journal's entries matching ``matches`` since this test's gpud was set up."""
        return self.sb.wait_journal(*matches, unit=unit, timeout=timeout, since=self.since)

    def set_external(self, external: list[dict[str, Any]]) -> None:
        self.sb.write_file("/run/gpud/sim.json", json.dumps({"external": external}))

    def start(self) -> None:
        result = self.sb.run(["systemctl", "start", "gpud.service"], timeout=60, check=False)
        if result.returncode != 0:
            raise AssertionError("gpud did not start:\n" + self.journal_tail())

    def journal_tail(self, lines: int = 40) -> str:
        return str(self.sb.run(f"journalctl -u gpud -u 'gpud-serve-*' --no-pager | tail -{lines}",
                               check=False).stdout)

    def call(self, method: str, path: str, body: Any = None) -> Reply:
        return call(self.socket, method, path, body)

    def get(self, path: str) -> Any:
        reply = self.call("GET", path)
        assert reply.status == 200, reply.raw
        return reply.body

    def serve(self, name: str) -> dict[str, Any]:
        return dict(self.get(f"/v1/serves/{name}"))

    def events(self, **query: str) -> list[dict[str, Any]]:
        qs = "&".join(f"{k}={v}" for k, v in query.items())
        return list(self.get(f"/v1/events?limit=10000&{qs}")["events"])

    def wait_state(self, name: str, *states: str, timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            last = self.serve(name)
            if last["state"] in states:
                return last
            time.sleep(0.1)
        raise AssertionError(f"{name} not in {states} after {timeout} s: {last}\n"
                             + self.journal_tail())

    def wait_event(self, kind: str, timeout: float = 20, **match: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for ev in self.events(kind=kind, **match):
                return ev
            time.sleep(0.1)
        raise AssertionError(f"no {kind} event {match} after {timeout} s")

    def wait_polls(self, count: int = 3, timeout: float = 20) -> None:
        """Until observation has taken `count` samples after this call: gpud reacts to each
        sample (alerts, events) before it takes the next, so every sample but the last one seen
        has been acted on. What a test asserts did not happen "over several polls" is then
        certain for `count - 1` polls."""
        def taken_at() -> float | None:
            at = self.get("/v1/status")["observation"].get("taken_at")
            return float(at) if at is not None else None

        seen = {taken_at()}
        deadline = time.monotonic() + timeout
        while len(seen) <= count:
            if time.monotonic() > deadline:
                raise AssertionError(f"observation took {len(seen) - 1} of {count} samples in "
                                     f"{timeout} s\n" + self.journal_tail())
            time.sleep(0.05)
            seen.add(taken_at())

    def metrics(self, name: str) -> list[tuple[dict[str, str], float]]:
        """The samples named NAME of /metrics, as Prometheus' own parser reads them."""
        text = self.sb.run(["curl", "-s", "--unix-socket", "/run/gpud/gpud.sock",
                            "http://localhost/metrics"]).stdout  # fmt: skip
        return [(s.labels, s.value) for f in text_string_to_metric_families(text)
                for s in f.samples if s.name == name]  # fmt: skip

    def standin_state(self, name: str) -> dict[str, Any]:
        """What the stand-in serve NAME says of itself (GET /standin/state): over its socket
        when it is fronted (the front forwards no such path), else on its port."""
        spec = self.serve(name)
        where = (["--unix-socket", f"{SERVE_SOCKETS}/{name}.sock", "http://localhost"]
                 if spec["front"] else [f"http://127.0.0.1:{spec['port']}"])
        out = self.sb.run(["curl", "-s", *where[:-1], where[-1] + "/standin/state"]).stdout
        return dict(json.loads(out))

    def unit_prop(self, unit: str, prop: str) -> str:
        return self.sb.run(["systemctl", "show", "-p", prop, "--value", unit]).stdout.strip()

    def wait_front(self) -> None:
        """Until gpud-front.service is active (its journal in the error when it is not) and
        listening on every address of its nginx.conf: the unit is Type=exec, active once
        nginx is executed, before it has bound its listeners (a test's first request was
        refused). Each is tried by a connection with no request: no access-log line."""
        try:
            wait_until(lambda: self.unit_prop("gpud-front.service", "ActiveState") == "active",
                       timeout=30, what="gpud-front.service active")
        except AssertionError:
            raise AssertionError(self.journal_tail() + self.sb.run(
                "journalctl -u gpud-front --no-pager | tail -20", check=False).stdout
            ) from None
        self.sb.run(["bash", "-c", LISTENING], timeout=30)

    @contextlib.contextmanager
    def keys_file(self, path: str, text: str, *also: str) -> Iterator[None]:
        """TEXT at PATH in the sandbox (a router's api_keys_file), its owner's only, until the
        end; then PATH is removed (and ALSO, more files the test leaves there)."""
        self.sb.run(["bash", "-c", f"umask 077; cat > {path}"], input=text)
        try:
            yield
        finally:
            self.sb.run(["rm", "-f", path, *also], check=False)

    def wait_router(self, port: int) -> None:
        """Until the router on PORT answers GET /v1/models with keys on (401)."""
        wait_until(lambda: self.sb.run(
            ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
             f"http://127.0.0.1:{port}/v1/models"], check=False).stdout == "401",
            timeout=30, what="the router answering")

    def serve_units(self) -> list[str]:
        out = self.sb.run(["systemctl", "list-units", "gpud-serve-*", "--no-legend", "--plain",
                           "--state=active"]).stdout
        return sorted(line.split()[0] for line in out.splitlines() if line.strip())


@contextlib.contextmanager
def fronted_gpud(gpud: SandboxGpud, config: str, users: Sequence[str] = (), *,
                 wait_front: bool = True) -> Iterator[SandboxGpud]:
    """gpud with CONFIG (fronted serves) started, after local USERS (nobody to gpud: no group
    of its) are made; with WAIT_FRONT, once gpud-front.service is active (its journal in the
    error when it is not). Afterwards no gpud, no front, none of its files, nor the users."""
    sb = gpud.sb
    try:
        gpud.configure(config, start=False)
        for user in users:
            sb.run(["useradd", "--no-create-home", user], check=False)
        gpud.start()
        if wait_front:
            gpud.wait_front()
        yield gpud
    finally:
        gpud.reset()
        sb.run("systemctl stop gpud-front.service; systemctl reset-failed gpud-front.service; "
               "rm -rf /run/gpud/front /run/gpud/serves; "
               + "".join(f"userdel {user}; " for user in users) + "userdel gpud-front",
               check=False)
