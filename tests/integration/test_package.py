"""The Debian package (packaging/build-deb), installed inside the sandbox: gpud comes up from it alone.

The sandbox's root is an overlay of the host's, so ``dpkg -i`` inside writes only to the overlay;
the package is never installed on the host. The sandbox is shared by the whole session, so what
this module installs, starts and creates it removes again, and it refuses to run over gpud files
another test left behind (they would shadow the package's units and config).

``GPUD_DEB=/path/to/gpud_X_amd64.deb`` tests a package built beforehand instead of building one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tools.sandbox import Sandbox

PREFIX = "/opt/gpud"
UNITS = ("gpud.service", "gpud.socket", "gpud.slice")
GROUPS = ("gpud", "gpud-admin")
INSIDE_DEB = "/var/tmp/gpud-test-package.deb"
ASIDE = "/var/tmp/gpud-test-package.aside"
# Other tests install units/ into /etc/systemd/system (tools/sandbox.py install_gpud) and leave
# them, with their drop-ins and /etc/gpud, for the next test: they would shadow the package's
# units and config. They are moved aside while the package is installed and put back after.
# So is a /usr/sbin/policy-rc.d that the host's image may have (container images ship one that
# refuses every action): a booted Debian host has none, and deb-systemd-invoke obeys it.
SET_ASIDE = r"""
set -e
aside=$1
for p in $(find /etc/systemd/system -maxdepth 2 -name 'gpud.*' -prune) \
         /etc/gpud /var/lib/gpud /run/gpud /opt/gpud /usr/sbin/policy-rc.d; do
    [ -e "$p" ] || [ -L "$p" ] || continue
    mkdir -p "$aside$(dirname "$p")"
    mv "$p" "$aside$p"
    echo "$p"
done
systemctl daemon-reload
"""


@pytest.fixture(scope="module")
def deb(sandbox: Sandbox, repo_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package: GPUD_DEB, or built once for this module by packaging/build-deb.

    Built with OUT_DIR outside the checkout (nothing may land in the checkout's build/ then),
    keeping the wheel cache in build/ so that a rebuild needs no network.
    """
    prebuilt = os.environ.get("GPUD_DEB")
    if prebuilt:
        return Path(prebuilt)
    for tool in ("dpkg-deb", "/usr/bin/python3"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is missing: the package is built for Debian's python3 with dpkg-deb")
    out_dir = tmp_path_factory.mktemp("deb")
    cache = repo_root / "build"
    before = set(cache.glob("*")) if cache.exists() else set()
    started = time.monotonic()
    result = subprocess.run(
        [str(repo_root / "packaging" / "build-deb")],
        capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "OUT_DIR": str(out_dir), "DEB_CACHE_DIR": str(cache)},
    )  # fmt: skip
    if result.returncode != 0:
        pytest.fail(f"packaging/build-deb failed ({result.returncode}):\n{result.stderr[-6000:]}")
    path = Path(result.stdout.strip().splitlines()[-1])
    assert path.is_file(), result.stdout
    assert path.parent == out_dir
    # only the caches may appear in the checkout's build/, never the package's own files
    added = {p.name for p in set(cache.glob("*")) - before}
    assert all(n == "wheelhouse" or n.startswith("buildenv-") for n in added), added
    print(f"built {path.name} in {time.monotonic() - started:.1f} s")
    return path


def _sh(sandbox: Sandbox, command: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return sandbox.run(command, check=False, timeout=timeout)


def _purge(sandbox: Sandbox) -> None:
    _sh(sandbox, "systemctl disable --now gpud.service gpud.socket")
    installed = _sh(sandbox, "dpkg-query -W -f '${Status}' gpud").stdout
    if "installed" in installed or "config-files" in installed:
        sandbox.run(["dpkg", "--purge", "gpud"], env={"DEBIAN_FRONTEND": "noninteractive"}, timeout=120)


WANTS_BEFORE: set[str] = set()


def _wants_dirs(sandbox: Sandbox) -> set[str]:
    out = _sh(sandbox, "find /etc/systemd/system -maxdepth 1 -name '*.wants' -type d").stdout
    return set(out.split())


def _gpud_units(sandbox: Sandbox) -> set[str]:
    out = sandbox.run(["systemctl", "list-units", "--all", "--no-legend", "--plain", "gpud*"]).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@pytest.fixture(scope="module")
def installed(sandbox: Sandbox, deb: Path) -> Iterator[set[str]]:
    """The package installed in the sandbox (dpkg -i); yields the gpud* units loaded before.

    At the end the package is purged, the groups it created are deleted and what was set aside
    is put back.
    """
    for unit in ("gpud.service", "gpud.socket"):
        state = _sh(sandbox, f"systemctl is-active {unit}").stdout.strip()
        assert state != "active", f"{unit} is running in the shared sandbox: another test left it"
    assert _sh(sandbox, "dpkg-query -W gpud").returncode != 0, "gpud is already installed in the sandbox"
    groups_before = {g for g in GROUPS if _sh(sandbox, f"getent group {g}").returncode == 0}
    units_before = _gpud_units(sandbox)
    WANTS_BEFORE.clear()
    WANTS_BEFORE.update(_wants_dirs(sandbox))
    moved: list[str] = []
    try:
        moved = sandbox.run(["/bin/sh", "-c", SET_ASIDE, "sh", ASIDE]).stdout.split()
        if moved:
            print(f"set aside while the package is installed: {' '.join(moved)}")
        shutil.copyfile(deb, sandbox.host_path(INSIDE_DEB))
        sandbox.run(["dpkg", "-i", INSIDE_DEB], env={"DEBIAN_FRONTEND": "noninteractive"}, timeout=120)
        yield units_before
    finally:
        _purge(sandbox)
        sandbox.run(["rm", "-f", INSIDE_DEB])
        for group in GROUPS:
            if group not in groups_before:
                _sh(sandbox, f"groupdel {group}")
        for path in moved:
            sandbox.run(["sh", "-c", 'rm -rf "$1" && mv "$2$1" "$1"', "sh", path, ASIDE])
        sandbox.run(["rm", "-rf", ASIDE])
        sandbox.run(["systemctl", "daemon-reload"])


def test_install_layout(sandbox: Sandbox, installed: set[str]) -> None:
    # gpud and gpuctl are the package's own, from its venv, not the host's pip-installed gpud
    for tool in ("gpud", "gpuctl"):
        target = sandbox.run(["readlink", "-f", f"/usr/bin/{tool}"]).stdout.strip()
        assert target == f"{PREFIX}/bin/{tool}"
        shebang = sandbox.host_path(target).read_text().splitlines()[0]
        assert shebang == f"#!{PREFIX}/bin/python3 -I"
    probe = sandbox.run(
        [f"{PREFIX}/bin/python3", "-I", "-c",
         "import sys, gpud, pydantic, pynvml; print(sys.prefix); print(gpud.__file__);"
         " print(pydantic.VERSION); print(pynvml.__file__)"],
        env={"PYTHONPATH": "/nowhere"},
    ).stdout.split()  # fmt: skip
    assert probe[0] == PREFIX
    assert probe[1] == f"{PREFIX}/lib/python3.11/site-packages/gpud/__init__.py"
    assert probe[2].startswith("2.")
    assert probe[3].startswith(f"{PREFIX}/")
    assert sandbox.run(["gpud", "--version"]).stdout.startswith("gpud ")
    # the front's user (docs/front.md), in group gpud to reach gpud's socket
    groups = sandbox.run(["id", "-nG", "gpud-front"]).stdout.split()
    assert "gpud" in groups, groups
    # whom the serves run as by default (docs/security.md), its home their model cache
    serve_user = sandbox.run(["getent", "passwd", "gpud-serve"]).stdout.strip().split(":")
    assert serve_user[2] != "0" and serve_user[5:] == ["/var/cache/gpud-serve", "/usr/sbin/nologin"]

    stat = "stat -c '%a %U %G %n'"
    listing = sandbox.run(
        f"{stat} /etc/gpud/serves.toml /lib/systemd/system/gpud.* "
        "/usr/lib/sysusers.d/gpud.conf /usr/lib/tmpfiles.d/gpud.conf /var/lib/gpud /run/gpud"
    ).stdout.splitlines()
    assert listing == [
        "600 root root /etc/gpud/serves.toml",
        "644 root root /lib/systemd/system/gpud.service",
        "644 root root /lib/systemd/system/gpud.slice",
        "644 root root /lib/systemd/system/gpud.socket",
        "644 root root /usr/lib/sysusers.d/gpud.conf",
        "644 root root /usr/lib/tmpfiles.d/gpud.conf",
        "750 root root /var/lib/gpud",
        "755 root root /run/gpud",
    ]
    assert "/etc/gpud/serves.toml" in sandbox.run(["dpkg-query", "-W", "-f", "${Conffiles}", "gpud"]).stdout
    assert sandbox.run(["dpkg", "--verify", "gpud"], check=False).stdout == ""
    for group in GROUPS:
        assert _sh(sandbox, f"getent group {group}").returncode == 0, f"group {group} missing"
    # installing starts and enables nothing: the shipped config is an example
    for unit in ("gpud.service", "gpud.socket"):
        assert _sh(sandbox, f"systemctl is-enabled {unit}").stdout.strip() == "disabled"
        assert _sh(sandbox, f"systemctl is-active {unit}").stdout.strip() == "inactive"


def _wait_status(sandbox: Sandbox, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    deadline = time.monotonic() + timeout
    while True:
        result = _sh(sandbox, "/usr/bin/gpuctl status")
        if result.returncode == 0 or time.monotonic() > deadline:
            return result
        time.sleep(0.2)


def _check_socket(sandbox: Sandbox) -> None:
    """The API socket: 0660 root:gpud, usable by the group gpud and by no one else."""
    sock = sandbox.run(["stat", "-c", "%a %U %G %F", "/run/gpud/gpud.sock"]).stdout.strip()
    assert sock == "660 root gpud socket"
    as_user = "setpriv --reuid=nobody --regid=nogroup --groups={} -- /usr/bin/gpuctl --json status"
    assert _sh(sandbox, as_user.format("gpud")).returncode == 0
    assert _sh(sandbox, as_user.format("nogroup")).returncode == 3
    if _sh(sandbox, "command -v curl").returncode == 0:
        ledger = sandbox.run("curl -sf --unix-socket /run/gpud/gpud.sock http://localhost/v1/ledger")
        assert "dark-fast" in ledger.stdout


def test_enable_now_brings_gpud_up_from_the_package(sandbox: Sandbox, installed: set[str]) -> None:
    try:
        sandbox.run(["systemctl", "enable", "--now", "gpud"], timeout=60)
        status = _wait_status(sandbox)
        assert status.returncode == 0, (
            f"gpuctl status: {status.returncode}\n{status.stdout}{status.stderr}\n"
            + _sh(sandbox, "journalctl -b -u gpud --no-pager -n 40").stdout
        )
        assert "version:" in status.stdout

        def show(unit: str, prop: str) -> str:
            return sandbox.run(["systemctl", "show", unit, "-p", prop, "--value"]).stdout.strip()

        # the package's units, as they are in units/, with nothing laid over them
        assert show("gpud.service", "FragmentPath") == "/lib/systemd/system/gpud.service"
        assert show("gpud.socket", "FragmentPath") == "/lib/systemd/system/gpud.socket"
        assert show("gpud.service", "DropInPaths") == ""
        assert "path=/usr/bin/gpud" in show("gpud.service", "ExecStart")
        assert show("gpud.service", "ActiveState") == "active"
        # Also=gpud.socket: enabled with the service (so from the next boot on gpud is socket
        # activated), though `enable --now` starts only the unit named: gpud bound the socket
        for unit in ("gpud.service", "gpud.socket"):
            assert show(unit, "UnitFileState") == "enabled"

        # the main process runs the venv's interpreter and has the venv's compiled modules mapped
        pid = show("gpud.service", "MainPID")
        argv = sandbox.host_path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert argv[:3] == [f"{PREFIX}/bin/python3".encode(), b"-I", b"/usr/bin/gpud"], argv
        maps = sandbox.host_path(f"/proc/{pid}/maps").read_text()
        assert f"{PREFIX}/lib/python3.11/site-packages/pydantic_core/" in maps
        assert "/.pyenv/" not in maps
        _check_socket(sandbox)

        # socket activation through the package's gpud.socket: the first client starts gpud
        sandbox.run("systemctl stop gpud.service && systemctl start gpud.socket")
        assert show("gpud.service", "ActiveState") == "inactive"
        status = _wait_status(sandbox)
        assert status.returncode == 0, status.stdout + status.stderr
        # gpud answers reads from the moment it listens, while it still reconciles: the unit
        # is "activating" until gpud says READY=1 (Type=notify), which the client did not wait for
        deadline = time.monotonic() + 30
        while show("gpud.service", "ActiveState") == "activating" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert show("gpud.service", "ActiveState") == "active"
        assert show("gpud.socket", "ActiveState") == "active"
        assert "gpud.socket" in show("gpud.service", "TriggeredBy")
        _check_socket(sandbox)
    finally:
        stop = _sh(sandbox, "systemctl disable --now gpud gpud.socket")
        assert stop.returncode == 0, stop.stderr


def test_a_unit_of_the_same_name_is_reported(sandbox: Sandbox, installed: set[str]) -> None:
    """Another gpud's unit in /etc/systemd/system would override the package's: postinst says so."""
    foreign = "/etc/systemd/system/gpud.service"
    assert not sandbox.host_path(foreign).exists()
    sandbox.write_file(foreign, "[Service]\nExecStart=/usr/local/bin/gpud run\n")
    try:
        again = sandbox.run(["dpkg", "-i", INSIDE_DEB], env={"DEBIAN_FRONTEND": "noninteractive"},
                            timeout=120)
        assert f"{foreign} exists and overrides this package's" in again.stderr, again.stderr
    finally:
        sandbox.run(["rm", "-f", foreign])
        sandbox.run(["systemctl", "daemon-reload"])


def test_dpkg_refuses_another_package_shipping_gpud(sandbox: Sandbox, installed: set[str],
                                                    tmp_path: Path) -> None:
    """A package that ships /usr/bin/gpud too (another gpud) is refused, not overwriting ours."""
    root = tmp_path / "other"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "usr" / "bin" / "gpud").write_text("#!/bin/sh\necho another gpud\n")
    (root / "usr" / "bin" / "gpud").chmod(0o755)
    (root / "DEBIAN" / "control").write_text(
        "Package: other-gpud\nVersion: 1.0\nArchitecture: all\nMaintainer: nobody <n@gpud.invalid>\n"
        "Description: a test package shipping /usr/bin/gpud\n")
    other = tmp_path / "other-gpud.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(root), str(other)],
                   capture_output=True, check=True)
    inside = "/var/tmp/gpud-test-other.deb"
    shutil.copyfile(other, sandbox.host_path(inside))
    try:
        result = _sh(sandbox, f"dpkg -i {inside}")
        assert result.returncode != 0
        assert "trying to overwrite '/usr/bin/gpud', which is also in package gpud" in result.stderr, \
            result.stderr
        target = sandbox.run(["readlink", "-f", "/usr/bin/gpud"]).stdout.strip()
        assert target == f"{PREFIX}/bin/gpud"
    finally:
        _sh(sandbox, "dpkg --purge other-gpud")
        sandbox.run(["rm", "-f", inside])


def test_purge_leaves_nothing_behind(sandbox: Sandbox, installed: set[str]) -> None:
    _purge(sandbox)
    assert _sh(sandbox, "dpkg-query -W gpud").returncode != 0
    paths = [PREFIX, "/etc/gpud", "/var/lib/gpud", "/run/gpud", "/usr/bin/gpud", "/usr/bin/gpuctl",
             "/usr/lib/sysusers.d/gpud.conf", "/usr/lib/tmpfiles.d/gpud.conf",
             *(f"/lib/systemd/system/{u}" for u in UNITS)]  # fmt: skip
    assert [p for p in paths if sandbox.host_path(p).exists()] == []
    wants = _sh(sandbox, "ls /etc/systemd/system/*.wants/ | grep -x 'gpud.*'").stdout
    assert wants == ""
    # nor the directories enabling made (sockets.target.wants/ was left empty once)
    assert _wants_dirs(sandbox) <= WANTS_BEFORE, _wants_dirs(sandbox) - WANTS_BEFORE
    assert not sandbox.host_path("/var/lib/systemd/deb-systemd-helper-enabled/gpud.service.dsh-also").exists()
    # no gpud unit left loaded: not gpud itself, not a serve it launched from the example config
    assert _gpud_units(sandbox) <= installed


def test_control_fields(deb: Path, repo_root: Path) -> None:
    out = subprocess.run(["dpkg-deb", "-f", str(deb)], capture_output=True, text=True, check=True).stdout
    fields = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line and line[0] != " ")
    version = tomllib.loads((repo_root / "pyproject.toml").read_text())["project"]["version"]
    assert fields["Package"] == "gpud"
    assert fields["Version"].replace("~", "") == version
    depends = [d.strip() for d in fields["Depends"].split(",")]
    for needed in ("python3 (>= 3.11)", "python3 (<< 3.12)", "systemd", "dbus"):
        assert needed in depends
    # the front's nginx and the router's njs module (docs/router.md): not Depends, whose nginx
    # would start nginx.service on port 80 at install
    assert fields["Recommends"] == "nginx, libnginx-mod-http-js"
    conffiles = subprocess.run(["dpkg-deb", "-I", str(deb), "conffiles"], capture_output=True, text=True)
    assert conffiles.stdout.split() == ["/etc/gpud/serves.toml"]


def test_lintian_clean(deb: Path) -> None:
    """No error and no warning; overrides only those /opt/gpud's venv design implies."""
    lintian = shutil.which("lintian")
    if lintian is None:
        if os.environ.get("CI"):
            pytest.fail("lintian is missing: scripts/setup-test installs it")
        pytest.skip("lintian is missing: run scripts/setup-test")
    result = subprocess.run([lintian, "--show-overrides", str(deb)], capture_output=True, text=True,
                            timeout=300, check=False)
    tags = [line for line in result.stdout.splitlines() if line[:2] in ("E:", "W:")]
    assert tags == [], "\n".join(tags)
    overridden = {line.split()[2] for line in result.stdout.splitlines() if line.startswith("O:")}
    assert overridden <= {"dir-or-file-in-opt", "wrong-path-for-interpreter"}, overridden
    listing = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True,
                             check=True).stdout
    for unwanted in ("__pycache__", ".pyc", "/gpud/standin.py", "site-packages/example.py"):
        assert unwanted not in listing, unwanted
    assert "./usr/share/man/man8/gpud.8.gz" in listing
