"""Who holds a TCP port: listening sockets from /proc/net/tcp{,6}, their holders from /proc/PID/fd.

A serve's health answer proves something only when it comes from the serve: another process on
its port (a stale copy, an unrelated server started by hand) answers 200 just as well. The
kernel lists each listening socket with its inode; a process holds the socket when one of its
descriptors links to ``socket:[INODE]``; the process's cgroup names its unit (gpud.cgroups).

Reading every process's descriptors is the expensive part, so callers pass the PIDs to look at
first (those of the serve's own cgroup) and cache the answer per socket inode: a listener keeps
its inode for as long as it listens.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from gpud.cgroups import PROC_ROOT, serve_of_cgroup_file

CGROUP_ROOT = Path("/sys/fs/cgroup")
TCP_LISTEN = "0A"  # the kernel's TCP_LISTEN state, as /proc/net/tcp prints it


@dataclass(frozen=True)
class Holder:
    """A process holding a listening socket, and the systemd unit (or scope) it runs in."""

    pid: int
    unit: str | None
    serve: str | None

    def describe(self) -> str:
        return f"PID {self.pid} ({self.unit or 'no unit'})"


def listening_inodes(port: int, proc_root: Path = PROC_ROOT) -> frozenset[int] | None:
    """Inodes of the sockets listening on ``port`` (any address, IPv4 or IPv6); None when the
    kernel's tables cannot be read at all."""
    found: set[int] = set()
    readable = False
    for table in ("tcp", "tcp6"):
        try:
            text = (proc_root / "net" / table).read_text(encoding="ascii", errors="replace")
        except OSError:
            continue
        readable = True
        for line in text.splitlines()[1:]:
            fields = line.split()
            if len(fields) < 10 or fields[3] != TCP_LISTEN:
                continue
            _addr, _, port_hex = fields[1].rpartition(":")
            try:
                if int(port_hex, 16) == port:
                    found.add(int(fields[9]))
            except ValueError:
                continue
    return frozenset(found) if readable else None


def _socket_inodes(pid: int, proc_root: Path) -> set[int]:
    fd_dir = proc_root / str(pid) / "fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return set()  # gone, or not ours to read
    out: set[int] = set()
    for name in names:
        try:
            target = os.readlink(fd_dir / name)
        except OSError:
            continue
        if target.startswith("socket:[") and target.endswith("]"):
            try:
                out.add(int(target[8:-1]))
            except ValueError:
                continue
    return out


def _all_pids(proc_root: Path) -> list[int]:
    try:
        return [int(n) for n in os.listdir(proc_root) if n.isdigit()]
    except OSError:
        return []


def unit_of_cgroup_file(text: str) -> str | None:
    """The innermost systemd unit (``.service`` or ``.scope``) named by a /proc/PID/cgroup file."""
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[0] == "0" and parts[1] == "":
            units = [p for p in parts[2].split("/") if p.endswith((".service", ".scope"))]
            return units[-1] if units else None
    return None


def holder(pid: int, proc_root: Path = PROC_ROOT) -> Holder:
    try:
        text = (proc_root / str(pid) / "cgroup").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return Holder(pid, None, None)
    return Holder(pid, unit_of_cgroup_file(text), serve_of_cgroup_file(text))


def holders(inodes: Iterable[int], pids: Iterable[int] | None = None,
            proc_root: Path = PROC_ROOT) -> list[Holder]:
    """The processes (among ``pids``, else all) that hold one of the sockets ``inodes``."""
    wanted = set(inodes)
    if not wanted:
        return []
    candidates = list(pids) if pids is not None else _all_pids(proc_root)
    return [holder(pid, proc_root) for pid in sorted(candidates)
            if _socket_inodes(pid, proc_root) & wanted]


def cgroup_pids(control_group: str, cgroup_root: Path = CGROUP_ROOT) -> list[int] | None:
    """Every PID in a unit's cgroup and below it (vLLM's engine core, a container's payload);
    None when the cgroup cannot be read (then callers look at every process)."""
    if not control_group.startswith("/"):
        return None
    top = cgroup_root / control_group.lstrip("/")
    if not top.is_dir():
        return None
    pids: list[int] = []
    for directory, _dirs, files in os.walk(top):
        if "cgroup.procs" not in files:
            continue
        try:
            text = Path(directory, "cgroup.procs").read_text(encoding="ascii")
        except OSError:
            continue
        pids.extend(int(p) for p in text.split() if p.isdigit())
    return pids
