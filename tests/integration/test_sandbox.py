"""Smoke tests of tools/sandbox.py and of units/: the disposable systemd works and stays put."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.gpudctl import SandboxGpud, sim_config, standin
from tools.sandbox import CGROUP_PREFIX, Sandbox, SandboxCommandError, is_foreign_unit


def _wait_main_pid(sandbox: Sandbox, unit: str, timeout: float = 10) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = sandbox.run(["systemctl", "show", "-p", "MainPID", "--value", unit]).stdout
        if out.strip() not in ("", "0"):
            return int(out)
        time.sleep(0.05)
    raise AssertionError(f"{unit} has no main process after {timeout} s")


@pytest.fixture
def smoke_serve(sandbox: Sandbox) -> Iterator[int]:
    """A transient unit started the way gpud starts a serve; yields its PID inside."""
    unit = "gpud-serve-smoke.service"
    sandbox.run(
        ["systemd-run", "--unit", unit, "--slice", "gpud.slice", "--",
         "/bin/sh", "-c", "echo smoke serve up; exec sleep infinity"]
    )  # fmt: skip
    try:
        yield _wait_main_pid(sandbox, unit)
    finally:
        sandbox.run(["systemctl", "stop", unit], check=False)
        sandbox.run(["systemctl", "reset-failed", unit], check=False)


def test_boot_reaches_running_with_no_failed_units(sandbox: Sandbox) -> None:
    # on a host whose own units fail in a container only those are failed (and tolerated)
    state = sandbox.run(["systemctl", "is-system-running"], check=False).stdout.strip()
    failed = sandbox.run(["systemctl", "list-units", "--failed", "--no-legend", "--plain"])
    # (the sandbox is the session's: a failed unit here may be one an earlier test left)
    assert state == ("degraded" if sandbox.foreign_failures else "running"), failed.stdout
    assert sorted(line.split()[0] for line in failed.stdout.splitlines()) == sorted(
        sandbox.foreign_failures)
    # PID 1 inside is the sandbox's systemd, and it knows it runs in a container
    assert sandbox.run(["readlink", "/proc/1/exe"]).stdout.strip().endswith("/systemd")
    assert sandbox.run(["systemd-detect-virt", "--container"]).stdout.strip() == "container-other"
    assert sandbox.run(["hostname"]).stdout.strip() == sandbox.name


def test_transient_unit_lands_in_gpud_slice(sandbox: Sandbox, smoke_serve: int) -> None:
    cgroup = sandbox.run(["cat", f"/proc/{smoke_serve}/cgroup"]).stdout.splitlines()
    assert "0::/gpud.slice/gpud-serve-smoke.service" in cgroup
    entries = sandbox.wait_journal("MESSAGE=smoke serve up", unit="gpud-serve-smoke.service")
    assert entries, "the transient unit's stdout did not reach the journal"


def test_structured_journal_entry_is_found(sandbox: Sandbox) -> None:
    marker = uuid.uuid4().hex
    sandbox.run(
        ["logger", "--journald"],
        input=f"MESSAGE=smoke {marker}\nGPUD_EVENT=smoke\nGPUD_SMOKE_ID={marker}\n",
    )
    entries = [
        e for e in sandbox.wait_journal("GPUD_EVENT=smoke") if e.get("GPUD_SMOKE_ID") == marker
    ]
    assert len(entries) == 1
    assert entries[0]["MESSAGE"] == f"smoke {marker}"
    assert sandbox.journal("GPUD_EVENT=no-such-event") == []


def test_run_popen_and_files(sandbox: Sandbox) -> None:
    assert sandbox.run("echo $((6 * 7))").stdout == "42\n"
    assert sandbox.run(["cat"], input="through stdin").stdout == "through stdin"
    assert sandbox.run(["printenv", "GPUD_X"], env={"GPUD_X": "y"}).stdout == "y\n"
    assert sandbox.run(["id", "-un"], user="nobody").stdout == "nobody\n"
    assert sandbox.run(["id", "-u"], user=4242).stdout == "4242\n"
    with pytest.raises(SandboxCommandError, match="no-such-file"):
        sandbox.run(["cat", "/no-such-file"])
    assert sandbox.run(["false"], check=False).returncode == 1
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        sandbox.run(["sleep", "29.5"], timeout=0.5)
    assert time.monotonic() - started < 10
    # the timed-out command was killed inside too, not only the nsenter in front of it
    assert sandbox.run(["pgrep", "-fx", "sleep 29.5"], check=False).stdout.strip() == ""

    proc = sandbox.popen(["sh", "-c", "read line; echo got $line"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
    out, _ = proc.communicate("it\n", timeout=10)
    assert out == "got it\n"

    path = f"/etc/gpud-smoke-{uuid.uuid4().hex[:8]}"
    sandbox.write_file(path, "inside only\n", mode=0o600)
    try:
        assert sandbox.run(["stat", "-c", "%a %U", path]).stdout == "600 root\n"
        assert sandbox.host_path(path).read_text() == "inside only\n"
        assert not Path(path).exists(), "write_file reached the host's /etc"
    finally:
        sandbox.run(["rm", "-f", path])


STANDIN = r"""
import json, os, socket, sys, time

results = {"listen_fds": os.environ.get("LISTEN_FDS"), "pid": os.getpid()}
bus = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
bus.connect("/run/dbus/system_bus_socket")
bus.sendall(b"\0AUTH EXTERNAL " + str(os.getuid()).encode().hex().encode() + b"\r\n")
results["bus_auth"] = bus.recv(256).decode().split(" ")[0]
with open(f"/proc/{os.environ['PROBE_PID']}/cgroup") as f:
    results["serve_cgroup"] = f.read().splitlines()
with open("/etc/gpud/.probe.tmp", "w") as f:
    f.write("x")
os.replace("/etc/gpud/.probe.tmp", "/etc/gpud/.probe")
os.unlink("/etc/gpud/.probe")
results["etc_gpud_writable"] = True
for name, path in (("etc", "/etc/.gpud-probe"), ("usr", "/usr/.gpud-probe")):
    try:
        open(path, "w").close()
        results[name + "_writable"] = True
    except OSError:
        results[name + "_writable"] = False
try:
    os.close(os.open("/dev/gpud-probe-fuse", os.O_RDONLY))
    results["other_device"] = "opened"
except OSError as exc:
    results["other_device"] = exc.strerror
with open("/dev/null", "w") as f:
    results["dev_null"] = f.write("ok") == 2
with open("/run/gpud/standin.json", "w") as f:
    json.dump(results, f)
addr = os.environ["NOTIFY_SOCKET"]
notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
notify.connect("\0" + addr[1:] if addr.startswith("@") else addr)
notify.sendall(b"READY=1\nSTATUS=stand-in for gpud")
while True:
    time.sleep(10)
    notify.sendall(b"WATCHDOG=1")
"""


@pytest.fixture
def installed_units(sandbox: Sandbox, repo_root: Path) -> Iterator[None]:
    """units/ installed with install_gpud; everything it and the test did is undone after."""
    sandbox.install_gpud(repo_root, "# smoke config\n")
    try:
        yield
    finally:
        sandbox.run(["systemctl", "stop", "gpud.service", "gpud.socket"], check=False)
        sandbox.run(
            "rm -rf /etc/systemd/system/gpud.* /etc/gpud /run/gpud /var/lib/gpud"
            " /usr/local/lib/gpud-standin.py /dev/gpud-probe-fuse /usr/bin/gpud /tmp/verify"
        )
        sandbox.run(["groupdel", "gpud-admin"], check=False)
        sandbox.run(["groupdel", "gpud"], check=False)
        sandbox.run(["systemctl", "daemon-reload"])
        sandbox.run(["systemctl", "reset-failed"], check=False)


def test_install_gpud_layout(sandbox: Sandbox, installed_units: None, repo_root: Path) -> None:
    assert sandbox.run(["stat", "-c", "%a %U", "/etc/gpud/serves.toml"]).stdout == "600 root\n"
    assert sandbox.run(["getent", "group", "gpud"]).returncode == 0
    assert sandbox.run(["getent", "group", "gpud-admin"]).returncode == 0
    exec_start = sandbox.run(["systemctl", "show", "-p", "ExecStart", "gpud.service"]).stdout
    assert f"path={sys.executable} ;" in exec_start
    assert "-m gpud.daemon --config /etc/gpud/serves.toml" in exec_start
    assert "/usr/bin/gpud" not in exec_start
    environment = sandbox.run(["systemctl", "show", "-p", "Environment", "gpud.service"]).stdout
    assert f"PYTHONPATH={repo_root.resolve()}" in environment
    # install_gpud must not start anything
    assert sandbox.run(["systemctl", "is-active", "gpud.service"], check=False).returncode != 0
    assert sandbox.run(["systemctl", "is-active", "gpud.socket"], check=False).returncode != 0


def test_units_verify_as_shipped(sandbox: Sandbox, installed_units: None, repo_root: Path) -> None:
    # the shipped ExecStart=/usr/bin/gpud must exist for verify; the overlay takes the stub
    sandbox.write_file("/usr/bin/gpud", "#!/bin/sh\nexit 0\n", mode=0o755)
    # Documentation=man:gpud(8) man:gpuctl(1): verify looks the pages up, as the package ships them
    for page, section in (("gpud.8", 8), ("gpuctl.1", 1)):
        sandbox.write_file(f"/usr/share/man/man{section}/{page}", (repo_root / "docs" / page).read_text())
    for unit in sorted((repo_root / "units").iterdir()):
        sandbox.write_file(f"/tmp/verify/{unit.name}", unit.read_text())
    verify = sandbox.run(
        "systemd-analyze verify /tmp/verify/gpud.service /tmp/verify/gpud.socket"
        " /tmp/verify/gpud.slice",
        check=False,
    )
    assert verify.returncode == 0, verify.stderr
    assert verify.stderr.strip() == "", verify.stderr


def test_hardened_service_still_reaches_what_gpud_needs(
    sandbox: Sandbox, installed_units: None, smoke_serve: int
) -> None:
    """The shipped hardening, run by a stand-in daemon through socket activation."""
    sandbox.write_file("/usr/local/lib/gpud-standin.py", STANDIN)
    # a device outside DevicePolicy=closed's pseudo devices and char-nvidia*: /dev/fuse's numbers
    sandbox.run(["mknod", "-m", "0666", "/dev/gpud-probe-fuse", "c", "10", "229"])
    sandbox.write_file(
        "/etc/systemd/system/gpud.service.d/zz-standin.conf",
        "[Service]\nExecStart=\n"
        f"ExecStart={sys.executable} /usr/local/lib/gpud-standin.py\n"
        f"Environment=PROBE_PID={smoke_serve}\n",
    )
    sandbox.run(["systemctl", "daemon-reload"])
    sandbox.run(["systemctl", "start", "gpud.socket"])
    socket_stat = sandbox.run(["stat", "-c", "%a %U %G %F", "/run/gpud/gpud.sock"]).stdout
    assert socket_stat == "660 root gpud socket\n"

    sandbox.run(["systemctl", "start", "gpud.service"], timeout=30)
    status = sandbox.run(["systemctl", "show", "-p", "ActiveState,StatusText", "gpud.service"])
    assert "ActiveState=active" in status.stdout
    assert "StatusText=stand-in for gpud" in status.stdout
    results = json.loads(sandbox.host_path("/run/gpud/standin.json").read_text())
    assert results["listen_fds"] == "1"
    assert results["bus_auth"] == "OK"
    assert "0::/gpud.slice/gpud-serve-smoke.service" in results["serve_cgroup"]
    assert results["etc_gpud_writable"] is True
    assert results["etc_writable"] is False
    assert results["usr_writable"] is False
    assert results["dev_null"] is True
    assert results["other_device"] == "Operation not permitted"
    cgroup = sandbox.run(["cat", f"/proc/{results['pid']}/cgroup"]).stdout.splitlines()
    assert "0::/system.slice/gpud.service" in cgroup

    # stopping gpud leaves the socket (and /run/gpud) to gpud.socket; stopping that removes it
    sandbox.run(["systemctl", "stop", "gpud.service"])
    assert sandbox.run(["test", "-S", "/run/gpud/gpud.sock"]).returncode == 0
    sandbox.run(["systemctl", "stop", "gpud.socket"])
    assert sandbox.run(["test", "-e", "/run/gpud/gpud.sock"], check=False).returncode == 1


def _tree(path: Path) -> dict[str, tuple[int, int]]:
    """path -> (size, mtime_ns) of everything under PATH."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            found[full] = (st.st_size, st.st_mtime_ns)
    return found


# What a systemd booted over the host would write in the host's /run (the host runs none, so
# nothing else touches these): compared before and after, not the whole of /run, where any
# process of the host may come and go.
SYSTEMD_RUN = ("systemd", "log", "dbus", "user", "udev", "tmpfiles.d", "nologin", "utmp")


def _systemd_run_trees() -> dict[str, tuple[int, int]]:
    found: dict[str, tuple[int, int]] = {}
    for name in SYSTEMD_RUN:
        path = Path("/run") / name
        if path.exists():
            st = path.lstat()
            found[str(path)] = (st.st_size, st.st_mtime_ns)
            found.update(_tree(path))
    return found


def test_lifecycle_leaves_host_untouched(sandbox: Sandbox) -> None:
    """A second sandbox beside the session's: boots, is independent, powers off without a trace."""
    marker = Path("/tmp") / f"gpud-sandbox-marker-{uuid.uuid4().hex[:8]}"
    marker.write_text("must survive the sandbox's systemd-tmpfiles\n")
    journal_before = _tree(Path("/var/log/journal"))
    run_before = _systemd_run_trees()
    try:
        second = Sandbox(name="gpud-test-2")
        with second:
            pid, workdir = second.pid, second.workdir
            assert pid != sandbox.pid
            assert second.run(["hostname"]).stdout.strip() == "gpud-test-2"
            second.run(["systemd-run", "--unit", "only-in-second", "sleep", "infinity"])
            in_first = sandbox.run(["systemctl", "is-active", "only-in-second"], check=False)
            assert in_first.stdout.strip() == "inactive"
            second.write_file("/tmp/inside-only", "x")
            assert not Path("/tmp/inside-only").exists()
            assert marker.exists()
            cgroup = second.host_cgroup
            assert cgroup is not None
            assert cgroup.name.startswith(CGROUP_PREFIX)
            assert (cgroup / "init.scope").is_dir()
        assert not Path(f"/proc/{pid}").exists() or _is_other_process(pid)
        mounts = Path("/proc/self/mountinfo").read_text()
        assert str(workdir) not in mounts
        assert " gpud-sandbox " not in mounts
        assert not workdir.exists()
        assert not cgroup.exists()
        assert marker.read_text().startswith("must survive")
        assert _tree(Path("/var/log/journal")) == journal_before
        assert _systemd_run_trees() == run_before
    finally:
        marker.unlink(missing_ok=True)


def _is_other_process(pid: int) -> bool:
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return True
    return not exe.endswith("/systemd")


HOST_UNIT_THAT_FAILS = """\
# as openipmi.service does in a container (no /proc/modules): any unit the host enables may fail
[Unit]
Description=a host unit that fails inside the sandbox

[Service]
Type=oneshot
ExecStart=/bin/false

[Install]
WantedBy=multi-user.target
"""


def test_host_unit_that_fails_does_not_stop_gpud(tmp_path: Path) -> None:
    """A unit the host enables that fails in the sandbox is tolerated and named; gpud works."""
    unit = f"host-fails-{uuid.uuid4().hex[:6]}.service"
    system = tmp_path / "etc" / "systemd" / "system"
    (system / "multi-user.target.wants").mkdir(parents=True)
    (system / unit).write_text(HOST_UNIT_THAT_FAILS)
    (system / "multi-user.target.wants" / unit).symlink_to(f"/etc/systemd/system/{unit}")
    with Sandbox(name="gpud-test-hostunit", root_files=tmp_path) as sbx:
        assert unit in sbx.foreign_failures
        assert sbx.run(["systemctl", "is-failed", unit], check=False).stdout.strip() == "failed"
        assert not Path(f"/etc/systemd/system/{unit}").exists(), "the unit reached the host"
        ctl = SandboxGpud(sbx)
        ctl.configure(sim_config(
            '[roles.dark-fast]\ndevice = "GPU-sim-0"\nreserve_mib = 7168\n',
            f'[serves.fast]\nrole = "dark-fast"\nvram_mib = 14336\nresident = true\nport = 30011\n'
            f"command = {standin()}\n"))  # fmt: skip
        assert ctl.wait_state("fast", "running")["state"] == "running"
        assert [u for u in sbx.foreign_failures if not is_foreign_unit(u)] == []


def test_failed_unit_of_gpud_is_not_foreign() -> None:
    assert is_foreign_unit("openipmi.service")
    assert is_foreign_unit("prometheus-node-exporter.service")
    for unit in ("gpud.service", "gpud.socket", "gpud-serve-ocr.service", "dbus.service",
                 "systemd-journald.service"):
        assert not is_foreign_unit(unit), unit
