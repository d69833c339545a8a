#!/usr/bin/env python3
"""A disposable real systemd to test gpud against.

The host this project is developed on has systemd and dbus installed, but systemd is not PID 1.
A ``Sandbox`` boots ``/lib/systemd/systemd --system`` as PID 1 of new pid, mount, net, uts, ipc and
cgroup namespaces, whose root is an overlay of the host's ``/`` with every write going to a tmpfs,
and fresh tmpfs on ``/run``, ``/tmp`` and ``/dev``. Tests, benchmarks and the demo then start
gpud as a real unit, launch transient units over the real system bus and read the real journal.

Why each piece is there:

- The overlay: booted over the real root, systemd-tmpfiles wiped the host's /tmp and journald
  wrote into the host's /var/log/journal. Every mount is made inside the sandbox's private mount
  namespace, so the host's mount table never shows one and nothing is left mounted once the
  namespace's last process is gone.
- The cgroup namespace, rooted in a cgroup of its own on the host: the sandbox's systemd sees a
  cgroup tree of its own (``0::/gpud.slice/gpud-serve-x.service`` reads inside as it would on a
  real host) and two sandboxes do not fight over one tree.
- ``container=gpud-sandbox`` in PID 1's environment, /sys and /proc/sys read-only and a /dev with
  only the pseudo devices (plus /dev/nvidia* when the host has them): systemd skips what a
  container must not do to its host (load kernel modules, apply sysctls, fsck, move pstore).
- ``MASKED_UNITS``: what would still reach the network or the host, or only makes boot slow.
- Failed units of the host's own (``openipmi.service`` finds no ``/proc/modules`` in a
  container; any unit the host enables may fail here): named on stderr and tolerated
  (``foreign_failures``); a failed unit of gpud's or one the sandbox needs refuses the boot.
- The safety net: PID 1 is started under ``unshare --kill-child`` whose own parent-death signal is
  SIGKILL, so even a ``kill -9`` of the Python process that booted it ends the sandbox; an atexit
  hook and SIGTERM/SIGHUP handlers power it off on an ordinary exit.

Used as a library (``with Sandbox() as sbx: sbx.run(["systemctl", "start", "gpud"])``) and as a
command line (``python3 tools/sandbox.py boot``, ``exec -- CMD``, ``shell``, ``poweroff``), where a
booted sandbox outlives the command that booted it and is found again by its name.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

SYSTEMD = "/lib/systemd/systemd"
CONTAINER_NAME = "gpud-sandbox"
# The host-side cgroup of every sandbox is named with this prefix, so a stale one (from a run
# that was SIGKILLed) can be recognised and removed once it is empty.
CGROUP_PREFIX = "gpud-sandbox."
STATE_FILE = "sandbox.json"
DEFAULT_WORKDIR_BASE = Path("/var/tmp")
INSIDE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

MASKED_UNITS: tuple[str, ...] = (
    # the network and the clock: the sandbox has only a loopback interface
    "systemd-networkd.service",
    "systemd-networkd.socket",
    "systemd-networkd-wait-online.service",
    "systemd-network-generator.service",
    "systemd-resolved.service",
    "systemd-timesyncd.service",
    "systemd-time-wait-sync.service",
    "networking.service",
    "ifupdown-pre.service",
    # package and disk maintenance timers of the host's image
    "apt-daily.timer",
    "apt-daily-upgrade.timer",
    "dpkg-db-backup.timer",
    "man-db.timer",
    "fstrim.timer",
    "e2scrub_all.timer",
    "e2scrub_reap.service",
    # services the host image enables that have nothing to do with gpud
    "postgresql.service",
    "cron.service",
    "ssh.service",
    # units that read or write state of the kernel shared with the host: pstore records would be
    # moved off the host, modules loaded into its kernel, its sysctls and binfmt set, its audit
    # stream read. Most already skip in a container; masking makes that independent of detection.
    "systemd-pstore.service",
    "systemd-modules-load.service",
    "kmod-static-nodes.service",
    "systemd-sysctl.service",
    "systemd-binfmt.service",
    "proc-sys-fs-binfmt_misc.automount",
    "proc-sys-fs-binfmt_misc.mount",
    "sys-kernel-debug.mount",
    "sys-kernel-tracing.mount",
    "sys-kernel-config.mount",
    "sys-fs-fuse-connections.mount",
    "systemd-journald-audit.socket",
    "systemd-random-seed.service",
    "systemd-remount-fs.service",
    "systemd-fsck-root.service",
    "systemd-repart.service",
    "systemd-rfkill.socket",
    "ldconfig.service",
    # consoles: the sandbox has no tty for a getty to wait on
    "getty.target",
    "console-getty.service",
    "getty@tty1.service",
    "systemd-ask-password-console.path",
    "systemd-ask-password-wall.path",
)

# A failure of one of these, or of a unit of gpud's (gpud.*, gpud-serve-*), refuses the boot: the
# sandbox is no use without its bus and its journal. Any other failed unit is the host's own.
ESSENTIAL_UNITS: frozenset[str] = frozenset({
    "dbus.service",
    "dbus.socket",
    "systemd-journald.service",
    "systemd-journald.socket",
    "systemd-journald-dev-log.socket",
})


def is_foreign_unit(unit: str) -> bool:
    """A unit the sandbox may boot without: neither gpud's nor one of ``ESSENTIAL_UNITS``."""
    return unit not in ESSENTIAL_UNITS and not unit.startswith(("gpud.", "gpud-"))


# Runs as PID 1 of the new namespaces and ends by exec'ing systemd (a file of its own, so that
# shellcheck reads it).
BOOT_SCRIPT = Path(__file__).resolve().with_name("sandbox-boot.sh")
# The network of the links between sandboxes (Sandbox.link): 198.18.0.0/15 is set aside for
# benchmarking network devices (RFC 2544, RFC 6890) and routed nowhere, so it cannot be mistaken
# for (or clash with) a network of the host's.
LINK_NET = "198.18"


# Mounted afresh inside the sandbox: what the host has there is not seen through the overlay.
FRESH_MOUNTS = (Path("/tmp"), Path("/run"), Path("/dev"), Path("/proc"), Path("/sys"))


def needs_bind(path: Path) -> bool:
    """Whether a host directory would be missing inside (the overlay shows / only)."""
    path = path.resolve()
    if any(path == m or m in path.parents for m in FRESH_MOUNTS):
        return True
    try:
        return os.stat(path).st_dev != os.stat("/").st_dev
    except OSError:
        return False


def interpreter_dirs() -> list[Path]:
    """Where the running interpreter lives: its prefix (a virtualenv, e.g. the project's .venv)
    and, for a venv, the base installation its ``bin/python`` symlinks into."""
    dirs = {Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(),
            Path(os.path.realpath(sys.executable)).parent}
    return sorted(dirs)


# What gpud.service's PrivateTmp=yes replaces with empty directories of its own.
PRIVATE_TMP = (Path("/tmp"), Path("/var/tmp"))


def hidden_by_private_tmp(paths: Sequence[Path]) -> bool:
    """Whether gpud.service would not see one of PATHS (a checkout, an interpreter).

    PrivateTmp=yes gives the unit fresh /tmp and /var/tmp; ProtectHome=read-only and
    ProtectSystem=full leave home, /srv and /opt readable, which is all gpud needs of them.
    """
    return any(h == p or h in p.parents for h in PRIVATE_TMP for p in map(Path, paths))


class SandboxError(RuntimeError):
    """The sandbox could not be booted, reached, or powered off."""


class SandboxCommandError(subprocess.CalledProcessError):
    """A command inside the sandbox exited non-zero; the message carries its output."""

    def __str__(self) -> str:
        text = super().__str__()
        for label, stream in (("stdout", self.stdout), ("stderr", self.stderr)):
            if stream:
                text += f"\n--- {label} ---\n{str(stream)[-4000:]}"
        return text


def _tool(name: str) -> str:
    found = shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")
    if found is None:
        raise SandboxError(f"{name} not found on the host; the sandbox needs util-linux")
    return found


def _start_time(pid: int) -> int | None:
    """The kernel's start time of PID (clock ticks since boot), or None once it is gone.

    Recorded at boot and compared before any signal, so a recycled PID is never signalled.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ')'
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19])


def _processes_where(field: int, value: int) -> list[int]:
    """PIDs whose /proc/PID/stat field (counted after the command name: 1 = ppid, 2 = pgrp)
    equals value."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2 :].split()[field]) == value:
            found.append(int(entry))
    return found


def _children_of(pid: int) -> list[int]:
    return _processes_where(1, pid)


def _process_group(pgid: int) -> list[int]:
    return _processes_where(2, pgid)


def host_cgroup_base() -> Path:
    """The host cgroup v2 directory this process lives in (hybrid hosts mount v2 at .../unified)."""
    mount_point = None
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        before, _, after = line.partition(" - ")
        if after.split(" ", 1)[0] == "cgroup2":
            mount_point = before.split()[4]
            break
    if mount_point is None:
        raise SandboxError("no cgroup2 hierarchy is mounted on the host")
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return Path(mount_point) / line[3:].lstrip("/")
    raise SandboxError("this process has no cgroup v2 path")


def _remove_cgroup_tree(top: Path, timeout: float = 5.0) -> None:
    """rmdir a cgroup and everything under it once no process is left in it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            events = (top / "cgroup.events").read_text()
        except FileNotFoundError:
            return
        if "populated 0" in events:
            break
        if time.monotonic() > deadline:
            raise SandboxError(f"cgroup {top} still has processes after {timeout:.0f} s")
        time.sleep(0.05)
    for dirpath, _dirnames, _files in os.walk(top, topdown=False):
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(dirpath)


def _remove_stale(cgroup_base: Path, workdir_base: Path) -> None:
    """Remove what sandboxes that were SIGKILLed left: empty cgroups, workdirs of dead PIDs.

    A cgroup younger than a minute may belong to a sandbox booting right now (it is created
    empty, then its launcher moves in), so it is left alone.
    """
    with contextlib.suppress(FileNotFoundError):
        for child in cgroup_base.iterdir():
            if not child.name.startswith(CGROUP_PREFIX) or not child.is_dir():
                continue
            with contextlib.suppress(OSError, SandboxError):
                if time.time() - child.stat().st_ctime > 60:
                    _remove_cgroup_tree(child, timeout=0)
    with contextlib.suppress(FileNotFoundError):
        for state_file in workdir_base.glob(f"*/{STATE_FILE}"):
            with contextlib.suppress(OSError, ValueError, KeyError):
                state = json.loads(state_file.read_text())
                workdir = state_file.parent
                if (
                    state["tool"] == CONTAINER_NAME
                    and state["owns_workdir"]
                    and _start_time(int(state["pid"])) != state["start_time"]
                    and not _mounts_under(workdir)
                ):
                    shutil.rmtree(workdir)


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve()).rstrip("/") + "/"
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4]
        if point == prefix[:-1] or point.startswith(prefix):
            found.append(point)
    return found


# --- the safety net ---------------------------------------------------------------------------

_LIVE: set[Sandbox] = set()
_LIVE_LOCK = threading.Lock()
_NET_INSTALLED = False


def _power_off_all(graceful: bool) -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for sandbox in live:
        with contextlib.suppress(Exception):
            sandbox.poweroff(timeout=5 if graceful else 0)


def _on_fatal_signal(signum: int, frame: types.FrameType | None) -> None:
    _power_off_all(graceful=False)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_safety_net() -> None:
    global _NET_INSTALLED
    if _NET_INSTALLED:
        return
    _NET_INSTALLED = True
    atexit.register(_power_off_all, True)
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGHUP):
            # never take a signal over from a program that already handles it
            if signal.getsignal(signum) == signal.SIG_DFL:
                signal.signal(signum, _on_fatal_signal)


# --- the sandbox -------------------------------------------------------------------------------


class Sandbox:
    """A real systemd, booted as PID 1 of fresh namespaces over a throw-away overlay of ``/``.

    ``workdir`` is a host directory (default: a new one under /var/tmp, never /tmp) that holds the
    mount point of the overlay's tmpfs (mounted only inside the sandbox), systemd's console log
    and a state file (PID, start time) by which the command line finds the sandbox and a later
    boot cleans up after one that was SIGKILLed. It is removed at poweroff if this object created
    it. Two sandboxes with different workdirs run side by side without seeing each other.

    ``detached=True`` (the command line) lets the sandbox outlive this Python process: no
    parent-death signal and no atexit hook; ``poweroff`` on an ``attach``-ed object ends it.
    """

    def __init__(
        self,
        workdir: Path | None = None,
        *,
        name: str = "gpud-sbx",
        detached: bool = False,
        binds: Sequence[Path] = (),
        root_files: Path | None = None,
    ) -> None:
        self.name = name
        self.detached = detached
        # A host directory whose tree is copied over the sandbox's / before systemd starts (into
        # the overlay's upper layer: the host's own files are untouched), as if the host had it.
        self.root_files = None if root_files is None else Path(root_files).resolve()
        # Units of the host's that failed at boot and were tolerated (see is_foreign_unit).
        self.foreign_failures: tuple[str, ...] = ()
        # This checkout, the interpreter's prefix (the project's .venv) and the base interpreter
        # that venv's python links to must be visible inside: bound in when the overlay of /
        # would not show them.
        wanted = [*binds, Path(__file__).resolve().parents[1], *interpreter_dirs()]
        self.binds = sorted({p for p in wanted if needs_bind(p)})
        if workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix=f"{name}.", dir=DEFAULT_WORKDIR_BASE))
            self._owns_workdir = True
        else:
            self.workdir = Path(workdir).absolute()
            self._owns_workdir = not self.workdir.exists()
            self.workdir.mkdir(parents=True, exist_ok=True)
        self._proc: subprocess.Popen[bytes] | None = None
        self._console: IO[bytes] | None = None
        self._pid: int | None = None
        self._start: int | None = None
        self._cgroup: Path | None = None
        self._lock = threading.Lock()

    # -- lifecycle --------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        """Host PID of the sandbox's systemd (PID 1 inside)."""
        if self._pid is None:
            raise SandboxError(f"sandbox {self.name} is not booted")
        return self._pid

    @property
    def host_cgroup(self) -> Path | None:
        """The host cgroup the sandbox is rooted in (its cgroup namespace's root), once booted."""
        return self._cgroup

    @property
    def console_log(self) -> Path:
        """What the sandbox's systemd printed to its console (host path)."""
        return self.workdir / "console.log"

    def is_running(self) -> bool:
        return self._pid is not None and _start_time(self._pid) == self._start

    def boot(self, timeout: float = 60) -> None:
        """Boot and wait until ``systemctl is-system-running`` says ``running``.

        ``degraded`` only by failed units of the host's own (``is_foreign_unit``) is tolerated:
        they are named on stderr and kept in ``foreign_failures``. On any other ``degraded`` (or
        any failure to get there) the failed units and their logs are printed to stderr, the
        sandbox is powered off and ``SandboxError`` is raised.
        """
        if self._pid is not None:
            raise SandboxError(f"sandbox {self.name} is already booted")
        deadline = time.monotonic() + timeout
        try:
            self._spawn()
            state = self._wait_until_up(deadline)
        except BaseException:
            with contextlib.suppress(Exception):
                if self._pid is not None:
                    print(self._diagnostics(), file=sys.stderr)
            self.poweroff(timeout=5)
            raise
        if state == "degraded":
            failed = self._failed_units()
            if failed and all(is_foreign_unit(u) for u in failed):
                self.foreign_failures = tuple(failed)
                print(f"sandbox {self.name}: booted degraded by units of the host's own that fail "
                      f"here, not gpud's; tolerated: {', '.join(failed)}", file=sys.stderr)
                return
        if state != "running":
            report = self._diagnostics()
            print(report, file=sys.stderr)
            self.poweroff(timeout=5)
            raise SandboxError(f"sandbox {self.name} booted {state!r}, not running:\n{report}")

    def _spawn(self) -> None:
        base = host_cgroup_base()
        _remove_stale(base, DEFAULT_WORKDIR_BASE)
        self._cgroup = base / f"{CGROUP_PREFIX}{self.name}.{uuid.uuid4().hex[:8]}"
        self._cgroup.mkdir()
        mnt = self.workdir / "mnt"
        mnt.mkdir(parents=True, exist_ok=True)
        self._console = self.console_log.open("ab")
        unshare = [
            _tool("unshare"),
            "--pid", "--mount", "--net", "--uts", "--ipc", "--cgroup",
            "--propagation", "private", "--fork", "--kill-child=SIGKILL",
            "--", "/bin/sh", str(BOOT_SCRIPT),
            str(mnt), self.name, *MASKED_UNITS,
        ]  # fmt: skip
        if not self.detached:
            # A SIGKILLed test run must not leave a systemd behind. The parent is the calling
            # thread, so only arm it when that thread lives as long as the process.
            if threading.current_thread() is threading.main_thread():
                unshare = [_tool("setpriv"), "--pdeathsig", "KILL", "--", *unshare]
            _install_safety_net()
        # The cgroup namespace is rooted in the cgroup of the process that unshares it, so the
        # launcher moves itself into the sandbox's own cgroup before exec'ing unshare.
        argv = ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(self._cgroup)]
        self._proc = subprocess.Popen(
            [*argv, *unshare],
            stdin=subprocess.DEVNULL,
            stdout=self._console,
            stderr=subprocess.STDOUT,
            env={"container": CONTAINER_NAME, "PATH": INSIDE_PATH, "LANG": "C.UTF-8",
                 "GPUD_SANDBOX_BINDS": "\n".join(str(b) for b in self.binds),
                 "GPUD_SANDBOX_ROOT_FILES": str(self.root_files or "")},
            start_new_session=self.detached,
        )
        with _LIVE_LOCK:
            _LIVE.add(self)
        self._pid = self._find_pid1()
        self._start = _start_time(self._pid)
        self._save_state()

    def _find_pid1(self) -> int:
        assert self._proc is not None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise SandboxError(f"the sandbox exited at once:\n{self._console_tail()}")
            children = _children_of(self._proc.pid)
            if children:
                # PID 1 must have pivoted into the overlay before anything is run "inside" it
                pid = children[0]
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/exe").endswith("/systemd"):
                        return pid
            time.sleep(0.01)
        raise SandboxError(f"systemd did not start in the sandbox:\n{self._console_tail()}")

    def _wait_until_up(self, deadline: float) -> str:
        state = "offline"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SandboxError(f"sandbox {self.name} still {state!r} after the boot timeout")
            if not self.is_running():
                raise SandboxError(f"the sandbox's systemd exited:\n{self._console_tail()}")
            try:
                result = self.run(
                    ["systemctl", "is-system-running", "--wait"], check=False, timeout=remaining
                )
            except subprocess.TimeoutExpired:
                continue
            state = result.stdout.strip() or "offline"
            if state in ("running", "degraded", "maintenance"):
                return state
            # "offline": PID 1 does not listen on its private socket yet
            time.sleep(0.05)

    def _failed_units(self) -> list[str]:
        failed = self.run(["systemctl", "list-units", "--failed", "--no-legend", "--plain"],
                          timeout=10)  # fmt: skip
        return sorted(line.split()[0] for line in failed.stdout.splitlines() if line.split())

    def _diagnostics(self) -> str:
        parts = [f"sandbox {self.name} (pid {self._pid}, workdir {self.workdir})"]
        failed = self.run(
            ["systemctl", "list-units", "--failed", "--no-legend", "--plain"],
            check=False,
            timeout=10,
        )
        parts.append("failed units:\n" + (failed.stdout.strip() or "(none)"))
        for line in failed.stdout.splitlines():
            unit = line.split()[0] if line.split() else ""
            if unit:
                log = self.run(
                    ["journalctl", "-b", "-u", unit, "--no-pager", "-n", "30"],
                    check=False,
                    timeout=10,
                )
                parts.append(f"--- journal of {unit} ---\n{log.stdout.strip()}")
        parts.append(f"--- console ---\n{self._console_tail()}")
        return "\n".join(parts)

    def _console_tail(self, lines: int = 40) -> str:
        try:
            text = self.console_log.read_text(errors="replace")
        except FileNotFoundError:
            return "(no console log)"
        return "\n".join(text.splitlines()[-lines:])

    def poweroff(self, timeout: float = 30) -> None:
        """Power the sandbox off and remove what it left on the host. Idempotent.

        ``systemctl poweroff`` inside; if PID 1 has not ended within ``timeout``, SIGKILL to it
        (only after checking that PID is still the process this sandbox started). Every mount
        lived in the sandbox's namespace and is gone with it; this checks that none is left on the
        host, removes the host cgroup and, if this object created it, the workdir.
        """
        with self._lock:
            if self._pid is None and self._proc is not None and self._proc.poll() is None:
                # booting failed before PID 1 was known: the launcher's --kill-child ends it
                self._proc.kill()
            if self._pid is not None and self.is_running():
                if timeout > 0:
                    with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                        self.run(["systemctl", "poweroff", "--no-block"], check=False, timeout=10)
                if not self._wait_gone(timeout):
                    self._kill_pid1()
                    if not self._wait_gone(10):
                        raise SandboxError(f"sandbox systemd {self._pid} survived SIGKILL")
            if self._proc is not None:
                # the launcher (unshare) exits right after its child, PID 1
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(timeout=10)
                self._proc = None
            self._pid = None
            self._start = None
            if self._console is not None:
                self._console.close()
                self._console = None
            with _LIVE_LOCK:
                _LIVE.discard(self)
            if self._cgroup is not None:
                _remove_cgroup_tree(self._cgroup)
                self._cgroup = None
            self._remove_workdir()

    def _wait_gone(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.is_running():
            if time.monotonic() >= deadline:
                return False
            if self._proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(timeout=0.05)
            else:
                time.sleep(0.05)
        return True

    def _kill_pid1(self) -> None:
        if self._pid is not None and _start_time(self._pid) == self._start:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, signal.SIGKILL)

    def _remove_workdir(self) -> None:
        if not self.workdir.exists():
            return
        left = _mounts_under(self.workdir)
        if left:
            # never recurse into a mounted file system
            raise SandboxError(f"mounts left under {self.workdir}: {left}")
        if self._owns_workdir:
            shutil.rmtree(self.workdir)
        else:
            for entry in ("mnt", "console.log", STATE_FILE):
                path = self.workdir / entry
                if path.is_dir():
                    path.rmdir()
                else:
                    path.unlink(missing_ok=True)

    def __enter__(self) -> Sandbox:
        if self._pid is None:
            self.boot()
        return self

    def __exit__(self, *exc: object) -> None:
        self.poweroff()

    # -- the command line's view: a sandbox found again by its workdir -----------------------

    def _save_state(self) -> None:
        # read by `attach` (the command line) and by a later boot cleaning up after a SIGKILL
        state = {
            "tool": CONTAINER_NAME,
            "name": self.name,
            "pid": self._pid,
            "start_time": self._start,
            "cgroup": str(self._cgroup),
            "owns_workdir": self._owns_workdir,
        }
        (self.workdir / STATE_FILE).write_text(json.dumps(state) + "\n")

    @classmethod
    def attach(cls, workdir: Path) -> Sandbox:
        """The detached sandbox booted with this workdir (by the command line)."""
        try:
            state = json.loads((workdir / STATE_FILE).read_text())
        except FileNotFoundError:
            raise SandboxError(f"no sandbox was booted in {workdir}") from None
        sandbox = cls(workdir, name=state["name"], detached=True)
        sandbox._owns_workdir = bool(state["owns_workdir"])
        sandbox._pid = int(state["pid"])
        sandbox._start = int(state["start_time"])
        sandbox._cgroup = Path(state["cgroup"])
        return sandbox

    # -- inside -------------------------------------------------------------------------------

    def _inside(
        self,
        argv: Sequence[str] | str,
        env: Mapping[str, str] | None,
        user: str | int | None,
    ) -> tuple[list[str], dict[str, str]]:
        command = ["/bin/sh", "-c", argv] if isinstance(argv, str) else list(argv)
        if user is not None:
            # setpriv inside resolves the name against the sandbox's /etc/passwd
            drop = (
                'g=$(id -g -- "$0" 2>/dev/null) && '
                'exec setpriv --reuid="$0" --regid="$g" --init-groups -- "$@"; '
                'exec setpriv --reuid="$0" --regid="$0" --clear-groups -- "$@"'
            )
            command = ["/bin/sh", "-c", drop, str(user), *command]
        full_env = {
            "PATH": INSIDE_PATH,
            "LANG": "C.UTF-8",
            "HOME": "/root",
            "SYSTEMD_PAGER": "",
            "SYSTEMD_COLORS": "0",
        }
        if env:
            full_env.update(env)
        nsenter = [
            _tool("nsenter"), "--target", str(self.pid),
            "--mount", "--uts", "--ipc", "--net", "--pid", "--cgroup",
            "--root", "--wd",
        ]  # fmt: skip
        return [*nsenter, "--", *command], full_env

    def popen(
        self,
        argv: Sequence[str] | str,
        *,
        env: Mapping[str, str] | None = None,
        user: str | int | None = None,
        **kw: Any,
    ) -> subprocess.Popen[str]:
        """Start ARGV inside the sandbox (text mode), not waited for.

        It runs in a new session; stop it with ``kill``, not ``proc.kill()`` (see there). Anything
        still running at poweroff dies with the sandbox's pid namespace.
        """
        command, full_env = self._inside(argv, env, user)
        kw.setdefault("text", True)
        if kw["text"]:
            kw.setdefault("encoding", "utf-8")
            kw.setdefault("errors", "replace")
        kw.setdefault("start_new_session", True)
        proc: subprocess.Popen[str] = subprocess.Popen(command, env=full_env, **kw)
        return proc

    def kill(self, proc: subprocess.Popen[Any], sig: int = signal.SIGKILL) -> None:
        """Send SIG to what PROC (from ``popen``) runs inside, and let nsenter reap it.

        ``proc`` is nsenter, which forked the command into the sandbox's pid namespace. Killing
        nsenter first would orphan the command to the host's PID 1, where it lingers as a zombie
        if that init does not reap; so the command's process group is signalled first, nsenter
        then exits with the command's status, and only a nsenter still there is killed.
        """
        for _ in range(20):
            members = [pid for pid in _process_group(proc.pid) if pid != proc.pid]
            if not members:
                break
            for pid in members:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.1)
                return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)

    def run(
        self,
        argv: Sequence[str] | str,
        *,
        check: bool = True,
        timeout: float = 60,
        input: str | None = None,
        env: Mapping[str, str] | None = None,
        user: str | int | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ARGV inside all the sandbox's namespaces and its root; a str runs via /bin/sh -c.

        stdout and stderr are captured as text; a non-zero exit raises ``SandboxCommandError``
        (a ``CalledProcessError`` whose message shows both) when ``check``. On timeout the
        command is killed inside (``kill``) and ``subprocess.TimeoutExpired`` raised.
        """
        proc = self.popen(
            argv,
            env=env,
            user=user,
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            stdout, stderr = proc.communicate(input, timeout=timeout)
        except BaseException:
            self.kill(proc)
            proc.communicate()
            raise
        result = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        if check and result.returncode != 0:
            shown = argv if isinstance(argv, str) else list(argv)
            raise SandboxCommandError(result.returncode, shown, stdout, stderr)
        return result

    def host_path(self, path: str) -> Path:
        """Where PATH inside the sandbox is reachable from the host.

        ``/proc/PID/root`` of the sandbox's systemd: it shows the sandbox's whole mount tree
        (/run, /tmp and /dev included), which no directory of the host's own mount table does.
        A Unix socket inside is connectable at this path too (it stays under 108 bytes).
        """
        return Path(f"/proc/{self.pid}/root") / path.lstrip("/")

    def write_file(self, path: str, content: str, mode: int = 0o644) -> None:
        """Write a root-owned file inside the sandbox (into its overlay, never the host)."""
        target = self.host_path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(content)
            os.chmod(tmp, mode)
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def journal(self, *matches: str, unit: str | None = None,
                since: float | None = None) -> list[dict[str, str]]:
        """Entries of the sandbox's journal: ``journalctl -o json [-u UNIT] [FIELD=value...]``,
        only those logged at or after ``since`` (a ``time.time()``: the sandbox shares the
        host's clock) when given.

        Binary field values are decoded as UTF-8; a field sent several times in one entry has
        its values joined with newlines.
        """
        argv = ["journalctl", "-q", "-o", "json", "--no-pager"]
        if unit is not None:
            argv += ["-u", unit]
        if since is not None:
            argv.append(f"--since=@{since:.6f}")
        argv += list(matches)
        result = self.run(argv, timeout=30)
        return [_journal_entry(json.loads(line)) for line in result.stdout.splitlines() if line]

    def wait_journal(
        self, *matches: str, unit: str | None = None, timeout: float = 10,
        since: float | None = None,
    ) -> list[dict[str, str]]:
        """``journal`` polled until it has at least one entry (journald files asynchronously)."""
        deadline = time.monotonic() + timeout
        while True:
            entries = self.journal(*matches, unit=unit, since=since)
            if entries or time.monotonic() > deadline:
                return entries
            time.sleep(0.1)

    # -- links between sandboxes ----------------------------------------------------------------

    def link(self, other: Sandbox, index: int = 0) -> tuple[str, str]:
        """Join this sandbox and OTHER by a veth pair, as two hosts on one private network (the
        multi-host tests: docs/peers.md). Returns (this one's address, OTHER's address): link
        INDEX is LINK_NET.INDEX.0/24, this end .1, the other .2; the interfaces are
        ``gpl{INDEX}a`` here and ``gpl{INDEX}b`` there.

        The pair is made inside the two network namespaces, never in the host's: ``ip link
        add`` runs in this sandbox's namespace (nsenter --net only, so that OTHER's PID 1 is
        named by its host PID) and puts the peer end straight into OTHER's. Neither end has a
        route beyond the link, so no traffic leaves the two sandboxes; a veth pair is destroyed
        with the namespace of either end, so the link is gone with either sandbox."""
        if not 0 <= index <= 255:
            raise SandboxError(f"link index {index}: must be 0-255")
        mine, theirs = f"gpl{index}a", f"gpl{index}b"
        here, there = f"{LINK_NET}.{index}.1", f"{LINK_NET}.{index}.2"
        ip = _tool("ip")
        subprocess.run([_tool("nsenter"), "--target", str(self.pid), "--net", "--",
                        ip, "link", "add", mine, "type", "veth", "peer", "name", theirs,
                        "netns", str(other.pid)], check=True, capture_output=True, timeout=30)
        for sandbox, name, address in ((self, mine, here), (other, theirs, there)):
            sandbox.run(["ip", "addr", "add", f"{address}/24", "dev", name])
            sandbox.run(["ip", "link", "set", name, "up"])
        return here, there

    # -- gpud -----------------------------------------------------------------------------------

    def install_gpud(self, repo: Path, config_text: str) -> None:
        """Install gpud's units from REPO and CONFIG_TEXT as /etc/gpud/serves.toml; not started.

        The overlay shows the host's interpreter and what is installed into it, so the unit's
        ExecStart is replaced (in a drop-in) by this interpreter running ``-m gpud.daemon``, with
        REPO first on its path. Groups ``gpud`` and ``gpud-admin`` are created inside.
        """
        repo = Path(repo).resolve()
        units = sorted((repo / "units").glob("gpud.*"))
        if not units:
            raise SandboxError(f"no units in {repo / 'units'}")
        # the overlay shows only the host's root file system, not what is mounted elsewhere
        for needed in (repo / "gpud", Path(sys.executable), Path(os.path.realpath(sys.executable))):
            if not self.host_path(str(needed)).exists():
                raise SandboxError(f"{needed} is not visible inside the sandbox (another mount?)")
        for unit in units:
            self.write_file(f"/etc/systemd/system/{unit.name}", unit.read_text())
        self.host_path("/etc/gpud").mkdir(mode=0o755, exist_ok=True)
        self.write_file("/etc/gpud/serves.toml", config_text, mode=0o600)
        for group in ("gpud", "gpud-admin"):
            self.run(["groupadd", "--force", "--system", group])
        # Whom the serves run as by default (daemon.serve_user), as the package's sysusers.d
        # makes it.
        self.run(["sh", "-c", "getent passwd gpud-serve >/dev/null || useradd --system "
                  "--no-create-home --home-dir /var/cache/gpud-serve --shell /usr/sbin/nologin "
                  "--user-group gpud-serve"])
        serves_see = self._open_to_serves([repo, *interpreter_dirs()])
        python = _systemd_quote(sys.executable)
        pythonpath = _systemd_quote(f"PYTHONPATH={repo}")
        private_tmp = "PrivateTmp=no\n" if hidden_by_private_tmp([repo, *interpreter_dirs()]) else ""
        self.write_file(
            "/etc/systemd/system/gpud.service.d/sandbox.conf",
            "# written by tools/sandbox.py: the host's interpreter runs the repo's gpud\n"
            "[Service]\n"
            "ExecStart=\n"
            f"ExecStart={python} -m gpud.daemon --config /etc/gpud/serves.toml\n"
            f"Environment={pythonpath} PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1\n"
            + private_tmp,
        )
        # Serves started from the repo (the stand-ins: python -m gpud.standin) import the repo's
        # gpud too, not whatever checkout the interpreter has installed: a drop-in for every
        # unit named gpud-serve-* (systemd applies "gpud-serve-.service.d" by prefix).
        self.write_file(
            "/etc/systemd/system/gpud-serve-.service.d/sandbox.conf",
            "# written by tools/sandbox.py: serves import the repo's gpud\n"
            f"[Service]\nEnvironment={pythonpath}\n" + serves_see,
        )
        self.run(["systemctl", "daemon-reload"])


    def _open_to_serves(self, paths: Sequence[Path]) -> str:
        """Make PATHS (the checkout, the interpreter) reachable for an unprivileged serve: the
        drop-in lines that let its sandbox see them, and o+x on each directory above them that
        other users may not enter (pyenv's interpreters live under /root, 0700), changed in the
        overlay only (the host's directory stays as it is; one bound in from the host is left
        alone)."""
        for path in paths:
            for folder in [*reversed(path.parents), path]:
                if needs_bind(folder):
                    break
                if not os.stat(folder).st_mode & 0o001:
                    self.run(["chmod", "o+x", str(folder)])
        lines = ""
        if hidden_by_private_tmp(paths):
            # Without a /tmp of its own a serve writes the host's (the overlay's): under
            # ProtectSystem=strict it is read-only unless named (vLLM's tempfile needs one).
            lines += "PrivateTmp=no\nReadWritePaths=/tmp /var/tmp\n"
        if any(h == p or h in p.parents for h in HOMES for p in paths):
            lines += "ProtectHome=read-only\n"
        return lines


# What a serve's ProtectHome=yes hides.
HOMES = (Path("/home"), Path("/root"), Path("/run/user"))


def _systemd_quote(word: str) -> str:
    if all(c.isalnum() or c in "/._-=+:,@" for c in word):
        return word
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _journal_value(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        if all(isinstance(v, int) for v in value):
            return bytes(value).decode("utf-8", errors="replace")
        return "\n".join(_journal_value(v) for v in value)
    return str(value)


def _journal_entry(raw: dict[str, object]) -> dict[str, str]:
    # a null value is a field too large for journalctl to print: leave it out
    return {key: _journal_value(value) for key, value in raw.items() if value is not None}


# --- command line --------------------------------------------------------------------------


def _default_workdir(name: str) -> Path:
    return DEFAULT_WORKDIR_BASE / name


def _attach(args: argparse.Namespace) -> Sandbox:
    workdir = args.workdir or _default_workdir(args.name)
    sandbox = Sandbox.attach(workdir)
    if not sandbox.is_running():
        raise SandboxError(
            f"sandbox {sandbox.name} is not running; `poweroff --name {sandbox.name}` cleans up"
        )
    return sandbox


def _exec_interactive(sandbox: Sandbox, argv: Sequence[str], user: str | None) -> int:
    env = {"TERM": os.environ.get("TERM", "dumb")}
    proc = sandbox.popen(argv, env=env, user=user, text=False, start_new_session=False)
    with contextlib.suppress(KeyboardInterrupt):
        return proc.wait()
    return proc.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="sandbox.py", description="A disposable real systemd for gpud's tests."
    )
    parser.add_argument("--name", default="gpud-sbx", help="sandbox name (default: gpud-sbx)")
    parser.add_argument(
        "--workdir", type=Path, help="host directory of the sandbox (default: /var/tmp/NAME)"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    boot = commands.add_parser("boot", help="boot a sandbox that outlives this command")
    boot.add_argument("--timeout", type=float, default=60)
    run = commands.add_parser("exec", help="run a command inside, e.g. exec -- systemctl status")
    run.add_argument("--user", help="user name or uid inside")
    run.add_argument("argv", nargs=argparse.REMAINDER)
    shell = commands.add_parser("shell", help="an interactive shell inside")
    shell.add_argument("--user", help="user name or uid inside")
    commands.add_parser("poweroff", help="power off and clean up")
    commands.add_parser("status", help="say whether the sandbox runs")
    args = parser.parse_args(argv)

    try:
        if args.command == "boot":
            workdir = args.workdir or _default_workdir(args.name)
            if (workdir / STATE_FILE).exists():
                previous = Sandbox.attach(workdir)
                if previous.is_running():
                    raise SandboxError(f"sandbox {args.name} already runs (pid {previous.pid})")
                previous.poweroff()  # what a dead one left behind
            sandbox = Sandbox(workdir, name=args.name, detached=True)
            started = time.monotonic()
            sandbox.boot(timeout=args.timeout)
            print(
                f"sandbox {sandbox.name} running: pid {sandbox.pid}, workdir {sandbox.workdir},"
                f" booted in {time.monotonic() - started:.1f} s"
            )
            return 0
        if args.command == "poweroff":
            workdir = args.workdir or _default_workdir(args.name)
            Sandbox.attach(workdir).poweroff()
            print(f"sandbox {args.name} powered off")
            return 0
        sandbox = _attach(args)
        if args.command == "status":
            print(f"sandbox {sandbox.name} running: pid {sandbox.pid}, workdir {sandbox.workdir}")
            return 0
        if args.command == "shell":
            return _exec_interactive(sandbox, ["/bin/bash", "-l"], args.user)
        command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        if not command:
            parser.error("exec needs a command: exec -- CMD [ARG...]")
        return _exec_interactive(sandbox, command, args.user)
    except SandboxError as exc:
        print(f"sandbox.py: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
