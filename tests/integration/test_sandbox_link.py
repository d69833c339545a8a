"""Several sandboxes as several hosts: a veth pair made inside two of them (tools/sandbox.py
Sandbox.link), each with its own address on a private test network; one reaches the other, the
host's own namespace never sees the link, and it is gone with either sandbox."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tests.waiting import wait_until
from tools.sandbox import Sandbox


def host_links() -> str:
    return subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                          check=True).stdout


@contextmanager
def listener(sandbox: Sandbox, address: str, text: str) -> Iterator[None]:
    """An HTTP server inside SANDBOX on ADDRESS:8080 whose /hello.txt is TEXT."""
    sandbox.write_file("/tmp/www/hello.txt", text)
    server = sandbox.popen(["python3", "-m", "http.server", "--bind", address, "--directory",
                            "/tmp/www", "8080"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        sandbox.kill(server)


def fetch(sandbox: Sandbox, url: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    """curl URL from inside SANDBOX, again until it answers (a listener just started)."""
    deadline = time.monotonic() + timeout
    while True:
        got = sandbox.run(["curl", "-sS", "--max-time", "5", url], check=False)
        if got.returncode == 0 or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def test_two_sandboxes_linked_reach_each_other() -> None:
    with Sandbox(name="gpud-host-a") as a, Sandbox(name="gpud-host-b") as b:
        here, there = a.link(b)
        assert (here, there) == ("198.18.0.1", "198.18.0.2")
        assert f"inet {here}/24" in a.run(["ip", "-o", "addr", "show", "gpl0a"]).stdout
        assert f"inet {there}/24" in b.run(["ip", "-o", "addr", "show", "gpl0b"]).stdout
        # made inside them: the host's namespace has neither end
        assert "gpl0a" not in host_links() and "gpl0b" not in host_links()
        with listener(b, there, "from host b\n"):
            got = fetch(a, f"http://{there}:8080/hello.txt")
            assert got.returncode == 0, got.stderr
            assert got.stdout == "from host b\n"
            # and only on the link: B's listener is not on A's loopback
            assert a.run(["curl", "-sS", "--max-time", "5", "http://127.0.0.1:8080/"],
                         check=False).returncode != 0
        b.poweroff()
        # the pair went with B's namespace: A's end is gone too. The kernel tears a network
        # namespace down after its last process is gone, in a work queue of its own
        # (net/core/net_namespace.c cleanup_net): A's end goes a moment after B's poweroff.
        wait_until(lambda: a.run(["ip", "link", "show", "gpl0a"], check=False).returncode != 0,
                   timeout=30, what="A's end of the link gone with B's namespace")


def test_three_sandboxes_each_link_its_own_network() -> None:
    with Sandbox(name="gpud-host-a") as a, Sandbox(name="gpud-host-b") as b, \
            Sandbox(name="gpud-host-c") as c:
        assert a.link(b, 0) == ("198.18.0.1", "198.18.0.2")
        assert a.link(c, 1) == ("198.18.1.1", "198.18.1.2")
        with listener(b, "198.18.0.2", "b\n"), listener(c, "198.18.1.2", "c\n"):
            assert fetch(a, "http://198.18.0.2:8080/hello.txt").stdout == "b\n"
            assert fetch(a, "http://198.18.1.2:8080/hello.txt").stdout == "c\n"
            # B and C share no link: B has no route to C's address
            route = b.run(["ip", "route", "get", "198.18.1.2"], check=False)
            assert route.returncode != 0 and "unreachable" in route.stderr, route
