"""What a health answer means (gpud.core.health), and who holds a port (gpud.host.ports)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from gpud.core.health import Answer, HealthVerdict, Probe, healthy_at_start, judge_running
from gpud.host import ports

OK = Answer(Probe.OK, "200")
REFUSED = Answer(Probe.REFUSED, "cannot connect (Connection refused)")
DEAD = Answer(Probe.ENGINE_DEAD, "503")
TIMEOUT = Answer(Probe.FAILED, "timeout")
FOREIGN = Answer(Probe.FOREIGN, "port 1 is held by PID 7 (x.service), not by the serve's unit")


@pytest.mark.parametrize(("answer", "failures", "vllm", "verdict"), [
    (OK, 2, True, HealthVerdict(0, None)),
    (OK, 2, False, HealthVerdict(0, None)),
    # vLLM answers 503 only once its engine is dead (it exits within ~5 s): at once a verdict
    (DEAD, 0, True, HealthVerdict(1, "unhealthy: engine died (/health answered 503 after the serve "
                               "was healthy)")),
    # a serve given by `command` may 503 for a moment: counted like any failure
    (DEAD, 0, False, HealthVerdict(1, None)),
    (DEAD, 2, False, HealthVerdict(3, "unhealthy: 3 health checks in a row failed on /health "
                                "(last: 503)")),
    (REFUSED, 0, True, HealthVerdict(1, None)),
    (REFUSED, 2, True, HealthVerdict(3, "unhealthy: 3 health checks in a row failed on /health "
                                  "(last: cannot connect (Connection refused))")),
    (TIMEOUT, 1, False, HealthVerdict(2, None)),
    # a 200 from someone else's socket is no health at all
    (FOREIGN, 2, False, HealthVerdict(3, "unhealthy: 3 health checks in a row failed on /health "
                                   "(last: port 1 is held by PID 7 (x.service), not by the "
                                   "serve's unit)")),
])
def test_judge_running(answer: Answer, failures: int, vllm: bool, verdict: HealthVerdict) -> None:
    assert judge_running(answer, failures, 3, vllm=vllm, health_path="/health") == verdict


@pytest.mark.parametrize(("answer", "healthy"), [
    (OK, True), (REFUSED, False), (DEAD, False), (TIMEOUT, False), (FOREIGN, False)])
def test_at_start_only_the_serves_own_200_counts(answer: Answer, healthy: bool) -> None:
    # vLLM 0.33 does not listen until loaded: refused means "loading", until the start timeout
    assert healthy_at_start(answer) is healthy


TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:7531 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1
   1: 0100007F:7531 0100007F:D2F0 01 00000000:00000000 00:00000000 00000000     0        0 4343 1
   2: 00000000:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 17 1
"""
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue
   0: 00000000000000000000000000000000:7531 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 5151 1
"""


def test_listening_inodes_from_proc_net(tmp_path: Path) -> None:
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "tcp").write_text(TCP)
    (tmp_path / "net" / "tcp6").write_text(TCP6)
    # 0x7531 = 30001: the listening sockets, not the established connection (4343)
    assert ports.listening_inodes(30001, tmp_path) == {4242, 5151}
    assert ports.listening_inodes(22, tmp_path) == {17}
    assert ports.listening_inodes(8080, tmp_path) == frozenset()
    assert ports.listening_inodes(30001, tmp_path / "nothing") is None


def test_unit_of_cgroup_file() -> None:
    assert ports.unit_of_cgroup_file("0::/gpud.slice/gpud-serve-a.service\n") == \
        "gpud-serve-a.service"
    assert ports.unit_of_cgroup_file(
        "0::/gpud.slice/gpud-serve-a.service/libpod-payload-3f\n") == "gpud-serve-a.service"
    assert ports.unit_of_cgroup_file("0::/user.slice/user-0.slice/session-3.scope\n") == \
        "session-3.scope"
    assert ports.unit_of_cgroup_file("0::/\n") is None


def test_holder_of_a_real_listening_socket() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        inodes = ports.listening_inodes(port)
        assert inodes is not None and len(inodes) == 1
        # among given PIDs only: this process holds it, another does not
        assert [h.pid for h in ports.holders(inodes, [os.getpid()])] == [os.getpid()]
        assert ports.holders(inodes, [1]) == [] or os.getpid() == 1
        found = ports.holders(inodes)
        assert os.getpid() in [h.pid for h in found]
    assert ports.listening_inodes(port) == frozenset()


def test_socket_diagnostics_name_the_listeners_cgroup() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        found = ports.listeners(port)
        if found is None:
            pytest.skip("no NETLINK_SOCK_DIAG with cgroup ids on this kernel")
        assert [item.inode for item in found] == sorted(ports.listening_inodes(port) or ())
        assert found[0].uid == os.geteuid() and found[0].cgroup_id is not None
        own = Path("/proc/self/cgroup").read_text().splitlines()
        unified = [line.split("::", 1)[1] for line in own if line.startswith("0::")]
        if unified and ports.cgroup_ids(unified[0]):
            # the socket's cgroup is this process's cgroup (a directory's inode is its id)
            assert found[0].cgroup_id in ports.cgroup_ids(unified[0])
    assert ports.listeners(port) == []
