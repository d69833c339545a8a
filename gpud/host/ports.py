"""Who holds a TCP port, and in which unit.

A serve's health answer proves something only when it comes from the serve: another process on
its port (a stale copy, an unrelated server started by hand) answers 200 just as well.

First choice, the kernel's socket diagnostics (``NETLINK_SOCK_DIAG``, what ``ss`` uses): each
listening socket comes with the id of the cgroup it was created in (``INET_DIAG_CGROUP_ID``,
Linux 5.7+), which is the inode of that cgroup's directory under /sys/fs/cgroup: the serve's own
unit, or someone else's. This needs no right over other processes, which matters because gpud
runs with a small capability bounding set (no CAP_SYS_PTRACE, so it may not read the descriptors
of a root serve that holds more capabilities than it does).

Fallback (no netlink, no cgroup ids): /proc/net/tcp{,6} gives each listening socket's inode, and
a process holds it when one of its descriptors links to ``socket:[INODE]``; the process's cgroup
names its unit (gpud.host.cgroups).
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from gpud.host.cgroups import PROC_ROOT, serve_of_cgroup_file

CGROUP_ROOT = Path("/sys/fs/cgroup")
TCP_LISTEN = "0A"  # the kernel's TCP_LISTEN state, as /proc/net/tcp prints it


@dataclass(frozen=True)
class Holder:
    """A process holding a listening socket, and the systemd unit (or scope) it runs in."""

    pid: int
    unit: str | None
    serve: str | None

    def describe(self) -> str:
        if not self.pid:
            return f"a socket left in {self.unit or 'an unknown cgroup'} (no process in it)"
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


# ---- socket diagnostics over netlink ----------------------------------------------------------

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST_DUMP = 0x301
NLMSG_ERROR, NLMSG_DONE = 2, 3
INET_DIAG_CGROUP_ID = 21
_NLMSG = struct.Struct("=IHHII")
_REQ = struct.Struct("=BBBBI48x")  # inet_diag_req_v2: family, protocol, ext, pad, states, id
_MSG_LEN = 72  # inet_diag_msg


@dataclass(frozen=True)
class Listener:
    """A listening TCP socket: its inode, owner uid and the cgroup it was created in."""

    inode: int
    uid: int
    cgroup_id: int | None


def listeners(port: int) -> list[Listener] | None:
    """The sockets listening on ``port`` (IPv4 and IPv6), from the kernel's socket diagnostics;
    None when those cannot be asked or carry no cgroup ids (then use the /proc fallback)."""
    found: list[Listener] = []
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as nl:
                nl.settimeout(2.0)
                request = _REQ.pack(family, socket.IPPROTO_TCP, 0, 0, 1 << 10)  # TCP_LISTEN
                nl.send(_NLMSG.pack(_NLMSG.size + len(request), SOCK_DIAG_BY_FAMILY,
                                    NLM_F_REQUEST_DUMP, 1, 0) + request)
                found.extend(_read_dump(nl, port))
        except OSError:
            return None
    if any(item.cgroup_id is None for item in found):
        return None  # a kernel without INET_DIAG_CGROUP_ID
    return found


def _read_dump(nl: socket.socket, port: int) -> list[Listener]:
    out: list[Listener] = []
    while True:
        data = nl.recv(65536)
        offset = 0
        while offset + _NLMSG.size <= len(data):
            length, kind, _flags, _seq, _pid = _NLMSG.unpack_from(data, offset)
            if kind == NLMSG_DONE:
                return out
            if kind == NLMSG_ERROR or length < _NLMSG.size:
                raise OSError("socket diagnostics answered with an error")
            body = data[offset + _NLMSG.size: offset + length]
            if len(body) >= _MSG_LEN and struct.unpack_from(">H", body, 4)[0] == port:
                uid, inode = struct.unpack_from("=II", body, 64)
                out.append(Listener(inode, uid, _cgroup_attr(body)))
            offset += (length + 3) & ~3
        if not data:
            return out


def _cgroup_attr(body: bytes) -> int | None:
    at = _MSG_LEN
    while at + 4 <= len(body):
        length, kind = struct.unpack_from("=HH", body, at)
        if length < 4:
            break
        if kind == INET_DIAG_CGROUP_ID and length >= 12:
            return int(struct.unpack_from("=Q", body, at + 4)[0])
        at += (length + 3) & ~3
    return None


def cgroup_ids(control_group: str, cgroup_root: Path = CGROUP_ROOT) -> set[int]:
    """The ids (directory inodes) of a unit's cgroup and every cgroup below it."""
    top = cgroup_root / control_group.lstrip("/")
    ids: set[int] = set()
    if not control_group.startswith("/") or not top.is_dir():
        return ids
    for directory, _dirs, _files in os.walk(top):
        try:
            ids.add(os.stat(directory).st_ino)
        except OSError:
            continue
    return ids


def cgroup_holders(cgroup_id: int, cgroup_root: Path = CGROUP_ROOT) -> list[Holder]:
    """The processes of the cgroup with this id, with its unit: who holds a foreign socket."""
    for directory, _dirs, _files in os.walk(cgroup_root):
        try:
            if os.stat(directory).st_ino != cgroup_id:
                continue
        except OSError:
            continue
        path = "/" + os.path.relpath(directory, cgroup_root)
        unit = unit_of_cgroup_file(f"0::{path}\n")
        serve = serve_of_cgroup_file(f"0::{path}\n")
        try:
            pids = [int(p) for p in Path(directory, "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            pids = []
        return [Holder(pid, unit, serve) for pid in sorted(pids)] or [Holder(0, unit, serve)]
    return []
