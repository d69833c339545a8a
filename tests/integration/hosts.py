"""Several gpud hosts for the sandbox tests (docs/peers.md): N sandboxes, each its own systemd,
gpud, router (the front's nginx) and simulated GPU, every pair joined by a veth link made inside
them (tools/sandbox.py Sandbox.link), each end with its own address on a private network.

    with hosts(3, lambda hs: [config_a(hs), config_b(hs), config_c(hs)]) as (a, b, c):
        a.gpuctl_json("peers")
        b.sandbox.run(["systemctl", "stop", "gpud.service"])

A host's config may name the others' addresses (`b.addr`: where the first host, the front door,
reaches B; `b.addr_from(c)`: where C reaches B), so configs are made once the hosts are linked,
by a function of the hosts. A config is its serves.toml text, or a Setup with root-only files to
write first (a keys file, a peer's key file); each gpud's unit admits the links' addresses (a
drop-in: the unit admits loopback only). Everything ends with the sandboxes: a link goes
with either end's network namespace, every process with its pid namespace.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import sandbox_unavailable
from tests.integration.gpudctl import SandboxGpud
from tools.sandbox import LINK_NET, Sandbox

REPO = Path(__file__).resolve().parents[2]
NAMES = "abcdefghij"
PEERS_DROP_IN = "/etc/systemd/system/gpud.service.d/peers.conf"


@dataclass(frozen=True)
class Setup:
    """A host's serves.toml and the root-only (0600) files to write before gpud starts, by
    path."""

    config: str
    files: Mapping[str, str] = field(default_factory=dict)


@dataclass
class Host:
    name: str
    sandbox: Sandbox
    gpud: SandboxGpud
    # the other host's name -> this host's address on their link
    addrs: dict[str, str] = field(default_factory=dict)
    # the host's names in order: the first is the front door
    order: tuple[str, ...] = ()

    @property
    def addr(self) -> str:
        """Where the first host reaches this one (the first host: where the second reaches
        it)."""
        first = self.order[0] if self.order[0] != self.name else self.order[1]
        return self.addrs[first]

    def addr_from(self, other: Host) -> str:
        """Where OTHER reaches this host."""
        return self.addrs[other.name]

    def write_root_file(self, path: str, text: str) -> None:
        """A root-only file (0600) inside this host: a peer's key_file, a keys file."""
        self.sandbox.run(["bash", "-c", f"mkdir -p $(dirname {path}); umask 077; cat > {path}"],
                         input=text)

    def stop_gpud_and_router(self) -> None:
        """This host gone, as its peers see it: its gpud and its router (the front) stopped."""
        self.sandbox.run(["systemctl", "stop", "gpud.service", "gpud-front.service"],
                         timeout=60)

    def configure(self, setup: Setup | str, *, wait_front: bool | None = None) -> None:
        """gpud with SETUP started (its files written first); with WAIT_FRONT (default: when
        the config has a [router]), once the front's nginx listens."""
        setup = Setup(setup) if isinstance(setup, str) else setup
        self.gpud.configure(setup.config, start=False)
        for path, text in setup.files.items():
            self.write_root_file(path, text)
        # gpud's unit admits loopback only (IPAddressAllow=localhost): its peers' addresses
        # are the operator's drop-in to add (docs/peers.md), here the links' network
        self.sandbox.write_file(PEERS_DROP_IN, f"[Service]\nIPAddressAllow={LINK_NET}.0.0/15\n")
        self.sandbox.run(["systemctl", "daemon-reload"])
        self.gpud.start()
        if wait_front if wait_front is not None else "[router]" in setup.config:
            self.gpud.wait_front()

    def gpuctl(self, *args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
        """gpuctl ARGS against this host's gpud (its socket, from outside: root's)."""
        return subprocess.run([sys.executable, "-m", "gpud.ctl", "--socket",
                               str(self.gpud.socket), *args], capture_output=True, text=True,
                              cwd=REPO, timeout=60, check=check)

    def gpuctl_json(self, *args: str) -> Any:
        got = self.gpuctl("--json", *args)
        if got.returncode != 0:
            raise AssertionError(f"gpuctl --json {' '.join(args)} on host {self.name}: "
                                 f"exit {got.returncode}: {got.stderr}")
        return json.loads(got.stdout)


def peer_table(name: str, url: str, key_file: str, extra: str = "") -> str:
    """A [peers.NAME] table of serves.toml (EXTRA: its other lines)."""
    return f'[peers.{name}]\nurl = "{url}"\nkey_file = "{key_file}"\n{extra}\n'


Configs = Callable[[list["Host"]], Sequence["Setup | str"]]


@contextlib.contextmanager
def hosts(n: int, configs: Configs | None = None) -> Iterator[list[Host]]:
    """N hosts named a, b, c, ..., each pair linked (link i: 198.18.i.0/24), each with gpud
    configured by CONFIGS (a function of the linked hosts: one Setup or serves.toml text per
    host; None: none configured, gpud installed by the test with Host.configure). All powered
    off at the end, whatever the test did."""
    if not 2 <= n <= len(NAMES):
        raise ValueError(f"hosts: 2 to {len(NAMES)} hosts, not {n}")
    reason = sandbox_unavailable()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"the systemd sandbox cannot run in CI: {reason}")
        pytest.skip(reason)
    names = tuple(NAMES[:n])
    with contextlib.ExitStack() as stack:
        made: list[Host] = []
        for name in names:
            sandbox = stack.enter_context(Sandbox(name=f"gpud-host-{name}"))
            made.append(Host(name, sandbox, SandboxGpud(sandbox), order=names))
        index = 0
        for i, one in enumerate(made):
            for other in made[i + 1:]:
                here, there = one.sandbox.link(other.sandbox, index)
                one.addrs[other.name], other.addrs[one.name] = here, there
                index += 1
        if configs is not None:
            setups = list(configs(made))
            if len(setups) != n:
                raise ValueError(f"hosts: {len(setups)} configs for {n} hosts")
            # the front door last: its peers answer when it first asks them
            for host, setup in reversed(list(zip(made, setups, strict=True))):
                host.configure(setup)
        yield made
