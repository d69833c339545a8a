"""Which serve a process belongs to, from its cgroup.

gpud launches each serve as the systemd unit ``gpud-serve-NAME.service``; every process the serve
starts (vLLM's engine core, a container's payload) stays in that unit's cgroup or below it, so
``/proc/PID/cgroup`` names the serve:

    0::/gpud.slice/gpud-serve-fast.service                         (cgroup v2)
    0::/gpud.slice/gpud-serve-ocr.service/libpod-payload-3f2a...   (podman --cgroups=split)
    1:name=systemd:/gpud.slice/gpud-serve-fast.service             (v1 / hybrid)

The first path component that is such a unit names the serve. A unit under a user manager
(``.../user@1000.service/...``) is not one of gpud's (gpud launches on the system bus), and an
unprivileged user could name a unit anything: such processes stay unattributed.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from gpud.core.vocab import SERVE_UNIT_PREFIX, SERVE_UNIT_SUFFIX, serve_of_unit

PROC_ROOT = Path("/proc")
_USER_MANAGER = re.compile(r"^user@[0-9]+\.service$")


def serve_of_cgroup_path(path: str) -> str | None:
    """The serve whose unit holds ``path`` (a cgroup path such as ``/gpud.slice/...``), or None."""
    for part in path.split("/"):
        if _USER_MANAGER.match(part):
            return None
        if part.startswith(SERVE_UNIT_PREFIX) and part.endswith(SERVE_UNIT_SUFFIX):
            return serve_of_unit(part)
    return None


def serve_of_cgroup_file(text: str) -> str | None:
    """The serve named by the content of a ``/proc/PID/cgroup`` file, or None.

    The unified (v2) line ``0::PATH`` is preferred, then v1's ``name=systemd`` line (the one
    systemd manages on hybrid and legacy hosts), then any other v1 controller line.
    """
    unified: list[str] = []
    systemd: list[str] = []
    others: list[str] = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            unified.append(path)
        elif "name=systemd" in controllers.split(","):
            systemd.append(path)
        else:
            others.append(path)
    for path in (*unified, *systemd, *others):
        name = serve_of_cgroup_path(path)
        if name is not None:
            return name
    return None


# A container's cgroup as the common engines name it: podman (``libpod-ID.scope`` under
# machine.slice, ``libpod-payload-ID`` with --cgroups=split), docker (``docker-ID.scope``, or
# ``/docker/ID`` with cgroupfs), containerd and CRI-O.
_CONTAINER = re.compile(
    r"^(libpod-payload-|libpod-|docker-|cri-containerd-|crio-)([0-9a-f]{64})(?:\.scope)?$")


def container_of_cgroup_file(text: str) -> tuple[str, str] | None:
    """(container, cgroup path) when the ``/proc/PID/cgroup`` content puts the process in a
    container's cgroup (``container``: the engine's prefix and the ID's first 12 characters,
    ``libpod-3f2a1b4c5d6e``); None otherwise. Says nothing about whether a serve unit holds it:
    ask serve_of_cgroup_file first."""
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        components = parts[2].split("/")
        for i, part in enumerate(components):
            match = _CONTAINER.match(part)
            if match is not None:
                return f"{match.group(1)}{match.group(2)[:12]}", parts[2]
            if part == "docker" and i + 1 < len(components) and re.fullmatch(
                    r"[0-9a-f]{64}", components[i + 1]):
                return f"docker-{components[i + 1][:12]}", parts[2]
    return None


def container_of_pid(pid: int, proc_root: Path = PROC_ROOT) -> tuple[str, str] | None:
    try:
        text = (proc_root / str(pid) / "cgroup").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return container_of_cgroup_file(text)


def serve_of_pid(pid: int, proc_root: Path = PROC_ROOT) -> str | None:
    """The serve process ``pid`` belongs to; None when it belongs to none or is gone."""
    try:
        text = (proc_root / str(pid) / "cgroup").read_text(encoding="utf-8", errors="replace")
    except OSError:
        # Gone (ENOENT, or ESRCH while reading a dying process) or unreadable: not attributable.
        return None
    return serve_of_cgroup_file(text)


class CachedAttribution:
    """The serve of each PID that belongs to one (PIDs of no serve, or gone, are left out),
    with memory: a PID's serve is read once and trusted for `ttl` seconds.

    A process does not leave its unit's cgroup, and observation runs every second: re-reading
    /proc/PID/cgroup for every GPU process at every sample is most of a sample's cost. A PID
    that disappears from the sample is forgotten, so a reused PID is read afresh; within `ttl`
    a PID reused between two samples could keep its old attribution, at worst for `ttl`.
    """

    def __init__(self, proc_root: Path = PROC_ROOT, ttl: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.proc_root = proc_root
        self.ttl = ttl
        self.clock = clock
        self._known: dict[int, tuple[str | None, float]] = {}

    def __call__(self, pids: Iterable[int]) -> dict[int, str]:
        now = self.clock()
        wanted = set(pids)
        for pid in set(self._known) - wanted:
            del self._known[pid]
        found: dict[int, str] = {}
        for pid in wanted:
            cached = self._known.get(pid)
            if cached is None or now - cached[1] >= self.ttl:
                cached = (serve_of_pid(pid, self.proc_root), now)
                self._known[pid] = cached
            if cached[0] is not None:
                found[pid] = cached[0]
        return found
