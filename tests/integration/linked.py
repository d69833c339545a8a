"""Two or three gpud hosts for the forwarding tests, each in its own sandbox (its own systemd,
network namespace and simulated GPU), the first joined to each other by a veth pair
(tools/sandbox.py Sandbox.link), each with its own gpud, front and router once configured."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import pytest

from tests.integration.conftest import sandbox_unavailable
from tests.integration.gpudctl import SandboxGpud
from tools.sandbox import LINK_NET, Sandbox


@dataclass
class Host:
    """One host: its name (its sandbox's), its gpud, and the address the first host reaches it
    by (for the first host: its own end of the link to the second)."""

    name: str
    gpud: SandboxGpud
    address: str

    @property
    def sb(self) -> Sandbox:
        return self.gpud.sb

    def stop_gpud_and_router(self) -> None:
        self.sb.run("systemctl stop gpud.service gpud-front.service", check=False)

    def cleanup(self) -> None:
        self.gpud.reset()
        self.sb.run("systemctl stop gpud-front.service; systemctl reset-failed "
                    "gpud-front.service; rm -rf /run/gpud/front /run/gpud/serves; "
                    "userdel gpud-front", check=False)


@contextmanager
def linked_hosts(count: int) -> Iterator[list[Host]]:
    """COUNT hosts (2 or 3), booted and linked: the first to each other one (link i to host
    i + 1: 198.18.i.1 there, 198.18.i.2 the other). Not configured: each test writes each
    host's serves.toml (Host.gpud.configure). Every sandbox powered off after, whatever the
    test did."""
    reason = sandbox_unavailable()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"the systemd sandbox cannot run in CI: {reason}")
        pytest.skip(reason)
    with ExitStack() as stack:
        names = [f"gpud-host-{chr(ord('a') + i)}" for i in range(count)]
        boxes = [stack.enter_context(Sandbox(name=name)) for name in names]
        hosts: list[Host] = []
        for i, other in enumerate(boxes[1:]):
            here, there = boxes[0].link(other, i)
            if not hosts:
                hosts.append(Host(names[0], SandboxGpud(boxes[0]), here))
            hosts.append(Host(names[i + 1], SandboxGpud(other), there))
        for host in hosts:
            # what an operator adds on a host with peers (docs/peers.md): gpud.service admits
            # loopback only (IPAddressAllow=localhost), and its poller asks the peers' routers
            host.sb.write_file("/etc/systemd/system/gpud.service.d/peers.conf",
                               f"[Service]\nIPAddressAllow={LINK_NET}.0.0/15\n")
        try:
            yield hosts
        finally:
            for host in hosts:
                host.cleanup()


def install_secret(host: Host, path: str, text: str) -> None:
    """A root-only file (0600) inside HOST: a peer's key_file, a keys file."""
    host.sb.run(["bash", "-c", f"umask 077; mkdir -p \"$(dirname {path})\"; cat > {path}"],
                input=text)


def peer_table(name: str, url: str, key_file: str, extra: str = "") -> str:
    return f'[peers.{name}]\nurl = "{url}"\nkey_file = "{key_file}"\n{extra}\n'
