"""Attribution of PIDs to serves through /proc/PID/cgroup."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpud.host.cgroups import (
    CachedAttribution,
    serve_of_cgroup_file,
    serve_of_cgroup_path,
    serve_of_pid,
)

CGROUP_FILES = {
    # cgroup v2, the unit itself
    100: "0::/gpud.slice/gpud-serve-fast.service\n",
    # vLLM's engine core: same unit
    101: "0::/gpud.slice/gpud-serve-fast.service\n",
    # a container's payload below the unit (podman --cgroups=split)
    102: "0::/gpud.slice/gpud-serve-ocr.service/libpod-payload-3f2a9c/init.scope\n",
    103: "0::/gpud.slice/gpud-serve-ocr.service/payload\n",
    # v1 hybrid: name=systemd carries the unit, the unified line is there too
    104: (
        "12:memory:/gpud.slice/gpud-serve-embed_2.service\n"
        "1:name=systemd:/gpud.slice/gpud-serve-embed_2.service\n"
        "0::/gpud.slice/gpud-serve-embed_2.service\n"
    ),
    # legacy v1 only
    105: (
        "4:cpu,cpuacct:/gpud.slice/gpud-serve-x.service\n"
        "1:name=systemd:/gpud.slice/gpud-serve-x.service\n"
    ),
    # not serves
    200: "0::/user.slice/user-1000.slice/session-2.scope\n",
    201: "0::/system.slice/gpud.service\n",
    202: "0::/\n",
    # a user manager's unit of the same name is not gpud's
    203: "0::/user.slice/user-1000.slice/user@1000.service/app.slice/gpud-serve-fast.service\n",
    # invalid serve name
    204: "0::/gpud.slice/gpud-serve-Fast.service\n",
    205: "",
}


@pytest.fixture
def proc_root(tmp_path: Path) -> Path:
    for pid, text in CGROUP_FILES.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cgroup").write_text(text)
    return tmp_path


def test_attribute_fake_tree(proc_root: Path) -> None:
    pids = [*CGROUP_FILES, 999]  # 999 vanished
    assert CachedAttribution(proc_root)(pids) == {
        100: "fast",
        101: "fast",
        102: "ocr",
        103: "ocr",
        104: "embed_2",
        105: "x",
    }


def test_vanished_pid_is_none(proc_root: Path) -> None:
    assert serve_of_pid(999, proc_root) is None
    (proc_root / "998").mkdir()  # the directory is there, the file went with the process
    assert serve_of_pid(998, proc_root) is None


@pytest.mark.parametrize(
    ("path", "serve"),
    [
        ("/gpud.slice/gpud-serve-a.service", "a"),
        ("/gpud.slice/gpud-serve-a-b.service/payload", "a-b"),
        ("/gpud-serve-z9.service", "z9"),
        ("/machine.slice/gpud-serve-a.service", "a"),
        ("/gpud.slice/gpud-serve-.service", None),
        ("/gpud.slice/gpud-serve-a.scope", None),
        ("/gpud.slice/gpud-serve-" + "a" * 64 + ".service", None),
        ("/gpud.slice/gpud-serve-" + "a" * 63 + ".service", "a" * 63),
        ("/gpud.slice/other-serve-a.service", None),
        ("", None),
    ],
)
def test_serve_of_cgroup_path(path: str, serve: str | None) -> None:
    assert serve_of_cgroup_path(path) == serve


def test_unified_line_preferred() -> None:
    text = (
        "1:name=systemd:/gpud.slice/gpud-serve-old.service\n0::/gpud.slice/gpud-serve-new.service\n"
    )
    assert serve_of_cgroup_file(text) == "new"


def test_own_process_real_proc() -> None:
    text = Path("/proc/self/cgroup").read_text()
    serve_of_cgroup_file(text)  # parses without error
    own = serve_of_pid(os.getpid())
    assert own is None or isinstance(own, str)
    assert CachedAttribution()([os.getpid()]) == ({} if own is None else {os.getpid(): own})


def test_cached_attribution_reads_once_per_ttl(tmp_path: Path) -> None:
    now = [0.0]
    proc = tmp_path / "proc"
    (proc / "7").mkdir(parents=True)
    (proc / "7" / "cgroup").write_text("0::/gpud.slice/gpud-serve-a.service\n")
    cache = CachedAttribution(proc, ttl=10, clock=lambda: now[0])
    assert cache([7]) == {7: "a"}
    (proc / "7" / "cgroup").write_text("0::/gpud.slice/gpud-serve-b.service\n")
    now[0] = 5
    assert cache([7]) == {7: "a"}  # trusted within the ttl
    now[0] = 11
    assert cache([7]) == {7: "b"}  # read again after it
    (proc / "7" / "cgroup").write_text("0::/system.slice/x.service\n")
    assert cache([]) == {}  # a PID that left the sample is forgotten...
    assert cache([7]) == {}  # ...and read afresh when it comes back
