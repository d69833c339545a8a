"""Container serves at the edge: what podman has locally, and the CDI name of a serve's GPU.

The argv itself is pure (gpud.core.launch.container_argv). Here: before a container serve's unit
starts, its image must be present (``podman image exists``): gpud never pulls on its own, so a
missing image is a start failure that says so, unless the serve sets ``pull = "missing"``, and
then the pull is an event of its own before the start.

podman does not run inside gpud's own process tree: gpud.service is sandboxed (/etc read-only,
no network beyond loopback, no new namespaces, a system-call filter), and podman needs to write
its store and locks (/etc/containers/networks, /var/lib/containers), and a pull needs the
registry. Each podman command runs as a transient unit of its own (`systemd-run --wait --pipe`),
with its output piped back and its exit status returned: these commands reach systemd through
its own clients, not through the D-Bus adapter (gpud.host.units says why, in its docstring).
Each such unit has a name gpud gives it (``gpud-image-SERVE-XXXXXX.service``): ending the
``systemd-run`` client does not end the unit it started, so a pull that times out, or whose serve
is stopped meanwhile, is ended by stopping that unit by name (``systemctl stop``).

The image check and the pull run before the serve takes its devices' start locks (the serve is
``admitted`` meanwhile, its reservation held): a pull of gigabytes holds up no other start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gpud.config import ContainerConfig
from gpud.core.launch import CDI_GPU_KIND, cdi_device_name
from gpud.errors import Unavailable
from gpud.host import cdi

# A pull of a vLLM image is gigabytes; only the start of the serve pulling waits for it.
PULL_TIMEOUT_S = 3600.0
QUERY_TIMEOUT_S = 60.0
# Stopping a podman unit: its TimeoutStopSec (10 s, below) and systemd's SIGKILL after it.
UNIT_STOP_TIMEOUT_S = 30.0
UNIT_PREFIX = "gpud-image-"

log = logging.getLogger("gpud.containers")


@dataclass(frozen=True)
class ImageCheck:
    ok: bool
    detail: str


def podman_path(engine: str = "podman") -> str | None:
    return shutil.which(engine)


def unit_for(serve: str) -> str:
    """A fresh name for one podman command of the serve's (unique: a unit of a command before,
    not yet collected, or left by a gpud that died mid-pull, never clashes with it)."""
    return f"{UNIT_PREFIX}{serve}-{secrets.token_hex(3)}.service"


def outside_gpud(argv: list[str], what: str, unit: str | None = None) -> list[str]:
    """`argv` as a transient unit of its own (named `unit`), outside gpud.service's sandbox."""
    runner = shutil.which("systemd-run")
    if runner is None:
        return argv
    named = [f"--unit={unit}"] if unit is not None else []
    return [runner, "--quiet", "--wait", "--pipe", "--collect", "--service-type=exec", *named,
            f"--description=gpud: {what}", "--property=TimeoutStopSec=10", *argv]


async def _end(proc: asyncio.subprocess.Process, unit: str | None) -> str | None:
    """End a podman command cut short: its unit first (the client's end would leave it), then
    the client. What went wrong, None when nothing of the command is left."""
    problem = None
    systemctl = shutil.which("systemctl") if unit is not None else None
    if systemctl is not None and unit is not None:
        stopper = await asyncio.create_subprocess_exec(
            systemctl, "stop", "--", unit, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        try:
            _, err = await asyncio.wait_for(stopper.communicate(), UNIT_STOP_TIMEOUT_S)
            if stopper.returncode:
                problem = (f"`systemctl stop {unit}` failed ({stopper.returncode}): "
                           f"{err.decode(errors='replace').strip()[-200:]}")
        except TimeoutError:
            stopper.kill()
            await stopper.wait()
            problem = f"`systemctl stop {unit}` did not end in {UNIT_STOP_TIMEOUT_S:g} s"
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    # The client's pipes close once the unit's process is gone (systemd-run --pipe hands them to
    # it): a unit that could not be stopped would hold this wait forever.
    try:
        await asyncio.wait_for(proc.wait(), UNIT_STOP_TIMEOUT_S)
    except TimeoutError:
        problem = problem or f"unit {unit} still holds the command's output"
    if problem is not None:
        log.warning("a podman command cut short may still run: %s", problem)
    return problem


async def _run(argv: list[str], timeout: float, what: str = "podman",
               unit: str | None = None) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *outside_gpud(argv, what, unit), stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        problem = await _end(proc, unit)
        return 124, f"timed out after {timeout:g} s" + (f"; {problem}" if problem else "")
    except asyncio.CancelledError:
        # The serve was stopped meanwhile: its pull must not go on (shielded, so that the stop,
        # which waits for this task, returns once the unit is gone).
        await asyncio.shield(_end(proc, unit))
        raise
    return proc.returncode or 0, out.decode(errors="replace").strip()


async def stop_leftovers() -> str | None:
    """Stop the podman commands' units a gpud that ended mid-pull left running (nothing waits
    for them any more; a start pulls afresh). What went wrong, None when nothing did."""
    systemctl = shutil.which("systemctl")
    if systemctl is None:
        return None
    proc = await asyncio.create_subprocess_exec(
        systemctl, "stop", "--", f"{UNIT_PREFIX}*.service", stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        _, err = await asyncio.wait_for(proc.communicate(), UNIT_STOP_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return f"`systemctl stop {UNIT_PREFIX}*.service` did not end in {UNIT_STOP_TIMEOUT_S:g} s"
    if proc.returncode:
        return (f"`systemctl stop {UNIT_PREFIX}*.service` failed ({proc.returncode}): "
                f"{err.decode(errors='replace').strip()[-200:]}")
    return None


async def ensure_image(serve: str, c: ContainerConfig,
                       say: Callable[[str], Awaitable[None]]) -> ImageCheck:
    """Whether the serve's image is present (pulled first when `pull = "missing"`; `say`
    records that as an event). Never raises: the outcome says why not."""
    podman = podman_path(c.engine)
    if podman is None:
        return ImageCheck(False, f"{c.engine} is not installed (not found in PATH)")
    rc, out = await _run([podman, "image", "exists", c.image], QUERY_TIMEOUT_S,
                         f"is image {c.image} present (serve {serve})", unit_for(serve))
    if rc == 0:
        return ImageCheck(True, "present")
    if rc != 1:
        return ImageCheck(False, f"`{c.engine} image exists {c.image}` failed ({rc}): {out[-400:]}")
    if c.pull != "missing":
        return ImageCheck(False, f"image {c.image} is not present locally; gpud never pulls on "
                              f"its own: run `{c.engine} pull {c.image}`, or set "
                              f"serves.{serve}.container.pull = \"missing\"")
    unit = unit_for(serve)
    await say(f"{serve}: image {c.image} is not present locally; pulling it "
              f"(serves.{serve}.container.pull = \"missing\") in unit {unit}")
    rc, out = await _run([podman, "pull", c.image], PULL_TIMEOUT_S,
                         f"pull image {c.image} (serve {serve})", unit)
    if rc != 0:
        return ImageCheck(False, f"pulling image {c.image} failed ({rc}): {out[-400:]}")
    await say(f"{serve}: pulled image {c.image}")
    return ImageCheck(True, "pulled")


def cdi_devices(serve: str, uuid: str, index: int) -> list[str]:
    """The CDI names of the serve's devices (one today), from the host's specs; Unavailable
    when no spec offers the device."""
    specs = cdi.scan()
    names, read = specs.names, specs.read
    if not read or not names:
        raise Unavailable(f"serve {serve}: {cdi.missing_spec_message(problems=specs.problems)}",
                          {"serve": serve})
    found = cdi_device_name(uuid, index, names)
    if found is None:
        raise Unavailable(
            f"serve {serve}: the CDI specs ({', '.join(read)}) offer no {CDI_GPU_KIND} named "
            f"{uuid!r} or {str(index)!r} (they offer: {', '.join(sorted(names))}); regenerate "
            f"them with `nvidia-ctk cdi generate`{cdi.unread_message(specs.problems)}",
            {"serve": serve, "device": uuid})
    return [found]
