"""Container serves under real systemd and real podman, in a sandbox of their own.

The image is built here from a rootfs tarball (`podman import`: no registry is reachable) that
holds Python and the stand-in, with vLLM's image's entrypoint (`vllm serve`). Two simulated
GPUs are offered to containers through a CDI spec written here: each device is a device node
named by its UUID under /dev/gpud-sim, which is what the stand-in inside draws on, as CUDA
draws on the GPUs CDI injected. The stand-in registers the PID it sees inside the container's
PID namespace; the simulation reports the host PID, as NVML does.

What the sandbox host needs beyond a stock podman, and why (each is configuration of this host,
written into the sandbox's own /etc, never part of the argv gpud runs):

- storage driver vfs: the sandbox's root is an overlay, and podman's overlay driver refuses to
  stack on one ("'overlay' is not supported over overlayfs");
- the runc runtime: crun 1.8.1 raises RLIMIT_MEMLOCK before loading its device-cgroup eBPF
  program (src/libcrun/ebpf.c: libcrun_ebpf_load) and fails where CAP_SYS_RESOURCE is missing;
- pids_limit = 0: the sandbox's cgroup tree has no pids controller to limit with;
- slirp4netns for the container network (and /dev/net/tun for it): netavark's bridge writes
  sysctls, and the sandbox's /proc/sys is read-only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import booted_sandbox
from tests.integration.gpudctl import PY, SandboxGpud, sim_config
from tests.waiting import wait_until
from tools.sandbox import Sandbox

REPO = Path(__file__).resolve().parents[2]
IMAGE = "localhost/gpud-standin:test"
CDI_SPEC = {
    "cdiVersion": "0.5.0",
    "kind": "nvidia.com/gpu",
    "devices": [
        {"name": uuid, "containerEdits": {
            "env": ["GPUD_SIM_DEVICES_DIR=/dev/gpud-sim"],
            "deviceNodes": [{"path": f"/dev/gpud-sim/{uuid}", "hostPath": "/dev/null"}]}}
        for uuid in ("GPU-sim-0", "GPU-sim-1")
    ],
}
STORAGE_CONF = ('[storage]\ndriver = "vfs"\nrunroot = "/run/containers/storage"\n'
                'graphroot = "/var/lib/containers/storage"\n')
CONTAINERS_CONF = '[containers]\npids_limit = 0\nnetns = "slirp4netns"\n[engine]\nruntime = "runc"\n'
PROCS = "/run/gpud/sim-procs"

# The rootfs: Python, its libraries and the gpud package (the stand-in and what it imports).
BUILD_IMAGE = r"""
set -eu
r=$(mktemp -d /var/tmp/gpud-image.XXXXXX)
mkdir -p "$r/usr/bin" "$r/usr/lib" "$r/usr/lib64" "$r/opt/gpud" "$r/tmp" "$r/proc" "$r/sys" "$r/dev" \
         "$r/etc" "$r/run" "$r/root"
ln -s usr/bin "$r/bin"; ln -s usr/lib "$r/lib"; ln -s usr/lib64 "$r/lib64"
py=$(readlink -f "$(command -v python3)")
cp "$py" "$r/usr/bin/"; ln -s "$(basename "$py")" "$r/usr/bin/python3"
for lib in $(ldd "$py" | grep -o '/[^ ]*'); do
    mkdir -p "$r$(dirname "$lib")"; cp -L "$lib" "$r$lib"
done
stdlib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
mkdir -p "$r$stdlib"
tar -C "$stdlib" --exclude=test --exclude=idlelib --exclude=tkinter --exclude=ensurepip \
    --exclude=site-packages --exclude=dist-packages --exclude=__pycache__ -cf - . \
    | tar -C "$r$stdlib" -xf -
tar -C "$REPO" --exclude=__pycache__ -cf - gpud | tar -C "$r/opt/gpud" -xf -
printf 'root:x:0:0:root:/root:/bin/sh\n' > "$r/etc/passwd"
printf 'root:x:0:\n' > "$r/etc/group"
tar -C "$r" -cf "$r.tar" .
podman import --change 'ENTRYPOINT ["python3", "-m", "gpud.testing.standin", "serve"]' \
    --change 'ENV PYTHONPATH=/opt/gpud' --change 'WORKDIR /' "$r.tar" "$IMAGE" >/dev/null
rm -rf "$r" "$r.tar"
"""


def _podman_missing() -> str | None:
    for tool in ("podman", "runc", "conmon", "slirp4netns"):
        if shutil.which(tool) is None and not Path(f"/usr/libexec/podman/{tool}").exists():
            return f"{tool} is not installed (scripts/setup-test installs it)"
    return None


@pytest.fixture(scope="module")
def podman_sandbox() -> Iterator[Sandbox]:
    missing = _podman_missing()
    if missing is not None:
        if os.environ.get("CI"):
            pytest.fail(missing)
        pytest.skip(missing)
    for sbx in booted_sandbox("gpud-podman"):
        sbx.write_file("/etc/containers/storage.conf", STORAGE_CONF)
        sbx.write_file("/etc/containers/containers.conf", CONTAINERS_CONF)
        sbx.write_file("/etc/cdi/gpud-sim.json", json.dumps(CDI_SPEC))
        sbx.run("mkdir -p /dev/net && mknod -m 0666 /dev/net/tun c 10 200")
        sbx.run(BUILD_IMAGE, env={"REPO": str(REPO), "IMAGE": IMAGE}, timeout=300)
        yield sbx
        sbx.run("podman rm -f -a", check=False, timeout=60)


@pytest.fixture
def gpud(podman_sandbox: Sandbox) -> Iterator[SandboxGpud]:
    ctl = SandboxGpud(podman_sandbox)
    yield ctl
    ctl.reset()
    podman_sandbox.run("podman rm -f -a", check=False, timeout=60)


def _image_ref(sbx: Sandbox) -> str:
    """The image by digest, as an operator pins it."""
    digest = sbx.run(["podman", "image", "inspect", "--format", "{{.Digest}}", IMAGE]).stdout
    return f"localhost/gpud-standin@{digest.strip()}"


def _config(image: str, name: str = "boxed", port: int = 30050, **container: object) -> str:
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in container.items())
    roles = '[roles.one]\ndevice = "GPU-sim-1"\nreserve_mib = 1000\n'
    serves = (f'[serves.{name}]\nrole = "one"\nvram_mib = 8000\nport = {port}\n'
              f'stop_timeout_s = 20\n[serves.{name}.vllm]\nmodel = "org/boxed"\n'
              f'max_model_len = 4096\n[serves.{name}.container]\nimage = "{image}"\n'
              f'volumes = ["{PROCS}:{PROCS}:rw"]\n{extra}')
    return sim_config(roles, serves, devices=2)


def _configure(gpud: SandboxGpud, config: str) -> None:
    gpud.configure(config, start=False)
    gpud.sb.run(["mkdir", "-p", PROCS])
    gpud.start()


def _wait_draw(gpud: SandboxGpud, serve: str, at_least: int,
               timeout: float = 20) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        last = gpud.serve(serve)
        if (last.get("observed_mib") or 0) >= at_least:
            return last
        time.sleep(0.2)
    inside = gpud.sb.run(["podman", "exec", f"gpud-serve-{serve}", "python3", "-c",
                          "import os; print(sorted(os.environ), os.listdir(os.environ"
                          "['GPUD_SIM_PROCS_DIR']))"], check=False)
    raise AssertionError(f"{serve} draws {last.get('observed_mib')} MiB\n{gpud.journal_tail()}\n"
                         f"registered: {gpud.sb.run(['ls', PROCS], check=False).stdout}\n"
                         f"inside: {inside.stdout}{inside.stderr}")


def _payload_pids(gpud: SandboxGpud, unit: str) -> list[int]:
    group = gpud.unit_prop(unit, "ControlGroup")
    out = gpud.sb.run(f"cat /sys/fs/cgroup{group}/libpod-payload-*/cgroup.procs").stdout
    return sorted(int(p) for p in out.split())


def test_container_serve_sees_its_device_and_is_measured_through_the_unit(
        gpud: SandboxGpud) -> None:
    image = _image_ref(gpud.sb)
    _configure(gpud, _config(image))
    assert gpud.call("POST", "/v1/serves/boxed/start", {}).status == 200
    gpud.wait_state("boxed", "running", timeout=60)
    unit = "gpud-serve-boxed.service"
    assert gpud.unit_prop(unit, "Type") == "notify"
    assert gpud.unit_prop(unit, "Delegate") == "yes"
    argv = gpud.unit_prop(unit, "ExecStart")
    assert "--cgroups=split" in argv and "--device=nvidia.com/gpu=GPU-sim-1" in argv
    # Inside, the container was given exactly the serve's device.
    seen = gpud.sb.run(["podman", "exec", "gpud-serve-boxed", "python3", "-c",
                        "import os; print(sorted(os.listdir('/dev/gpud-sim')))"]).stdout
    assert seen.strip() == "['GPU-sim-1']"
    # The draw lands on GPU-sim-1, is held by a process in the unit's payload cgroup (host
    # PID), and is the serve's: util = floor((8000) / 32607, 4) = 0.2453 -> 7998 MiB.
    view = _wait_draw(gpud, "boxed", 7000)
    assert view["observed_mib"] <= 8000
    obs = gpud.get("/v1/ledger")["roles"][0]["observed"]  # role "one", on GPU-sim-1
    assert obs["managed_draw_mib"] == view["observed_mib"]
    assert obs["non_ledger_draw_mib"] == 0
    payload = _payload_pids(gpud, unit)
    # the registrations (files; the stand-ins' load windows are kept in a folder beside them)
    registered = gpud.sb.run(f"find {PROCS} -maxdepth 1 -type f -printf '%f\\n'").stdout.split()
    assert registered and all(".ns" in name for name in registered), registered
    main_pid = int(gpud.unit_prop(unit, "MainPID"))
    assert main_pid not in payload  # conmon is the main PID; vLLM's processes are below it
    assert gpud.events(kind="container-outside-unit") == []

    # Stop through the unit: conmon hands SIGTERM to the container, which shuts down cleanly.
    assert gpud.call("POST", "/v1/serves/boxed/stop", {}).status == 200
    gpud.wait_state("boxed", "declared", "admitted", timeout=40)
    assert gpud.sb.run(["podman", "ps", "-a", "--format", "{{.Names}}"]).stdout.strip() == ""
    log = gpud.sb.run(["journalctl", "-u", unit, "--no-pager"]).stdout
    assert "SIGTERM received: [shutdown]" in log, log[-2000:]


def test_a_fronted_container_serve_listens_on_its_socket_behind_the_front(
        gpud: SandboxGpud) -> None:
    # A container serve that sleeps is fronted like any other: vLLM inside binds the socket's
    # path in the bind-mounted directory, no port is published, the front answers the port.
    config = _config(_image_ref(gpud.sb), name="boxfront", port=30052).replace(
        "stop_timeout_s = 20\n", "stop_timeout_s = 20\nsleep_level = 2\nsleep_mib = 800\n")
    _configure(gpud, config)
    assert gpud.call("POST", "/v1/serves/boxfront/start", {}).status == 200
    view = gpud.wait_state("boxfront", "running", timeout=60)
    assert view["front"] is True
    argv = gpud.unit_prop("gpud-serve-boxfront.service", "ExecStart")
    assert "--volume=/run/gpud/serves:/run/gpud/serves:rw" in argv, argv
    assert "--publish" not in argv and "--uds /run/gpud/serves/boxfront.sock" in argv, argv

    def through_port(method: str, path: str) -> str:
        return gpud.sb.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", method,
                            f"http://127.0.0.1:30052{path}"], user="nobody").stdout

    wait_until(lambda: through_port("GET", "/v1/models") == "200", timeout=30,
               what="the front forwarding to the container's socket")
    assert [through_port("POST", p) for p in ("/wake_up", "/sleep?level=1",
                                              "/collective_rpc")] == ["404"] * 3
    # gpud's sleep and wake reach it over the socket
    assert gpud.call("POST", "/v1/serves/boxfront/sleep", {}).status == 200
    assert gpud.serve("boxfront")["state"] == "sleeping"
    assert gpud.call("POST", "/v1/serves/boxfront/wake", {}).status == 200
    assert through_port("GET", "/v1/models") == "200"


def test_container_serve_is_adopted_after_a_gpud_restart(gpud: SandboxGpud) -> None:
    _configure(gpud, _config(_image_ref(gpud.sb), name="kept", port=30051))
    assert gpud.call("POST", "/v1/serves/kept/start", {}).status == 200
    gpud.wait_state("kept", "running", timeout=60)
    unit = "gpud-serve-kept.service"
    before = (gpud.unit_prop(unit, "MainPID"), _payload_pids(gpud, unit))
    gpud.sb.run(["systemctl", "restart", "gpud.service"], timeout=60)
    gpud.wait_state("kept", "running", timeout=30)
    assert len(gpud.events(kind="adopt", serve="kept")) == 1
    assert len(gpud.events(kind="start", serve="kept")) == 1  # not started a second time
    assert (gpud.unit_prop(unit, "MainPID"), _payload_pids(gpud, unit)) == before
    _wait_draw(gpud, "kept", 7000)


def test_missing_image_fails_the_start_with_its_reason(gpud: SandboxGpud) -> None:
    _configure(gpud, _config("localhost/not-here:1", name="ghost", port=30052))
    gpud.call("POST", "/v1/serves/ghost/start", {})
    failed = gpud.wait_state("ghost", "failed", timeout=30)
    assert "image localhost/not-here:1 is not present locally" in failed["reason"]
    assert "gpud never pulls on its own" in failed["reason"]
    assert gpud.serve_units() == []
    # pull = "missing": gpud tries, says so in the events, and the failed pull is the reason
    _configure(gpud, _config("localhost/not-here:1", name="ghost", port=30052, pull="missing"))
    gpud.call("POST", "/v1/serves/ghost/start", {})
    failed = gpud.wait_state("ghost", "failed", timeout=60)
    assert "pulling image localhost/not-here:1 failed" in failed["reason"]
    pulls = gpud.events(kind="pull", serve="ghost")
    assert any("pulling it" in ev["message"] for ev in pulls), pulls


def test_a_container_outside_the_unit_raises_an_event(gpud: SandboxGpud) -> None:
    _configure(gpud, _config(_image_ref(gpud.sb)))
    # Run by hand with podman's default cgroups (machine.slice/libpod-ID.scope): no unit.
    gpud.sb.run(["podman", "run", "-d", "--name", "stray", "--device=nvidia.com/gpu=GPU-sim-0",
                 f"--volume={PROCS}:{PROCS}:rw", "--env", f"GPUD_SIM_PROCS_DIR={PROCS}",
                 "--env", "GPUD_SIM_TOTAL_MIB=32607", "--env", "GPUD_SIM_PIDNS=0",
                 IMAGE, "org/stray", "--gpu-memory-utilization", "0.1"], timeout=60)
    ev = gpud.wait_event("container-outside-unit", timeout=30)
    assert "libpod-" in ev["details"]["container"]
    assert ev["details"]["device"] == "GPU-sim-0"
    assert "counted as non-ledger draw" in ev["message"]
    gpud.wait_polls(3)  # reported once per process, not once per poll
    assert len(gpud.events(kind="container-outside-unit")) == 1


def test_a_host_without_a_cdi_spec_is_told_so_at_start(gpud: SandboxGpud) -> None:
    _configure(gpud, _config(_image_ref(gpud.sb), name="nocdi", port=30053))
    gpud.sb.run(["mv", "/etc/cdi/gpud-sim.json", "/run/gpud-sim.json.away"])
    try:
        reply = gpud.call("POST", "/v1/serves/nocdi/start", {})
        assert reply.status == 409, reply.raw
        assert "no CDI spec offers nvidia.com/gpu devices" in reply.body["error"]["message"]
        assert "nvidia-ctk cdi generate" in gpud.serve("nocdi")["reason"]
        assert gpud.serve_units() == []
    finally:
        gpud.sb.run(["mv", "/run/gpud-sim.json.away", "/etc/cdi/gpud-sim.json"])


# `podman` as gpud finds it first on PATH (/usr/local/bin before /usr/bin): the real one, except
# that image localhost/slow:1 is missing and its pull stalls (its PID written down).
SLOW_PODMAN = """#!/bin/sh
case "$*" in
    "image exists localhost/slow:1") exit 1 ;;
    "pull localhost/slow:1") echo $$ > /run/gpud-slow-pull.pid; exec sleep 600 ;;
esac
exec /usr/bin/podman "$@"
"""


def test_a_slow_pull_holds_up_no_other_start_and_a_stop_ends_it(gpud: SandboxGpud) -> None:
    roles = '[roles.one]\ndevice = "GPU-sim-1"\nreserve_mib = 1000\n'
    serves = ""
    for name, port, image, pull in (("slowpull", 30054, "localhost/slow:1", "missing"),
                                     ("quick", 30055, _image_ref(gpud.sb), "never")):
        serves += (f'[serves.{name}]\nrole = "one"\nvram_mib = 8000\nport = {port}\n'
                   f'stop_timeout_s = 20\n[serves.{name}.vllm]\nmodel = "org/{name}"\n'
                   f'max_model_len = 4096\n[serves.{name}.container]\nimage = "{image}"\n'
                   f'pull = "{pull}"\nvolumes = ["{PROCS}:{PROCS}:rw"]\n')
    gpud.sb.write_file("/usr/local/bin/podman", SLOW_PODMAN, mode=0o755)
    try:
        _configure(gpud, sim_config(roles, serves, devices=2))
        assert gpud.call("POST", "/v1/serves/slowpull/start", {}).status == 200
        pulling = gpud.wait_event("pull", timeout=30, serve="slowpull")
        found = re.search(r"in unit (gpud-image-slowpull-[0-9a-f]+\.service)", pulling["message"])
        assert found is not None, pulling
        unit = found.group(1)
        deadline = time.monotonic() + 20
        while gpud.sb.run(["test", "-s", "/run/gpud-slow-pull.pid"], check=False).returncode:
            assert time.monotonic() < deadline, gpud.journal_tail()
            time.sleep(0.1)
        pid = gpud.sb.run(["cat", "/run/gpud-slow-pull.pid"]).stdout.strip()
        assert gpud.sb.run(["systemctl", "is-active", unit], check=False).stdout.strip() == "active"
        # The pull holds its reservation and no lock of the device: the other serve there starts.
        assert gpud.serve("slowpull")["state"] == "admitted"
        assert gpud.serve("slowpull")["reserved_mib"] == 8000
        assert gpud.call("POST", "/v1/serves/quick/start", {}).status == 200
        gpud.wait_state("quick", "running", timeout=60)
        assert gpud.serve("slowpull")["state"] == "admitted"
        # A stop during the pull ends it: its unit is stopped by name, nothing of it is left.
        assert gpud.call("POST", "/v1/serves/slowpull/stop", {}).status == 200
        assert gpud.serve("slowpull")["state"] == "declared"
        assert gpud.sb.run(["systemctl", "show", "-p", "LoadState", "--value", unit]
                           ).stdout.strip() == "not-found"
        assert gpud.sb.run(["systemctl", "list-units", "--all", "--plain", "--no-legend",
                            "gpud-image-*"]).stdout.strip() == ""
        assert gpud.sb.run(["kill", "-0", pid], check=False).returncode != 0
        assert gpud.events(kind="start", serve="slowpull") == []
        assert gpud.serve("quick")["state"] == "running"
        assert gpud.call("POST", "/v1/serves/quick/stop", {}).status == 200
    finally:
        gpud.sb.run(["rm", "-f", "/usr/local/bin/podman", "/run/gpud-slow-pull.pid"])


def test_a_podman_command_that_times_out_leaves_no_unit(podman_sandbox: Sandbox) -> None:
    # gpud's own helper, run under the sandbox's systemd with a one-second limit: the command's
    # unit is stopped by name, not only its systemd-run client killed.
    script = (
        "import asyncio, sys\n"
        "from gpud.host import containers\n"
        "unit = containers.unit_for('late')\n"
        "print(unit)\n"
        "print(asyncio.run(containers._run(['/bin/sleep', '600'], 1.0, 'sleeps', unit)))\n")
    out = podman_sandbox.run([PY, "-c", script], env={"PYTHONPATH": str(REPO)}, timeout=60).stdout
    unit, outcome = out.splitlines()
    assert outcome == "(124, 'timed out after 1 s')"
    assert unit.startswith("gpud-image-late-")
    assert podman_sandbox.run(["systemctl", "show", "-p", "LoadState", "--value", unit]
                              ).stdout.strip() == "not-found"
    assert podman_sandbox.run(["pgrep", "-f", "/bin/sleep 600"], check=False).returncode == 1


def test_a_pull_left_by_an_earlier_gpud_is_stopped_at_boot(gpud: SandboxGpud) -> None:
    left = "gpud-image-kept-0a1b2c.service"
    gpud.configure(_config(_image_ref(gpud.sb), name="kept", port=30056), start=False)
    gpud.sb.run(["systemd-run", f"--unit={left}", "--collect", "/bin/sleep", "600"])
    assert gpud.sb.run(["systemctl", "is-active", left], check=False).stdout.strip() == "active"
    gpud.sb.run(["mkdir", "-p", PROCS])
    gpud.start()
    assert gpud.sb.run(["systemctl", "show", "-p", "LoadState", "--value", left]
                       ).stdout.strip() == "not-found"
    assert "may still run" not in gpud.journal_tail(200)
