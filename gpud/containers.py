"""Container serves at the edge: what podman has locally, and the CDI name of a serve's GPU.

The argv itself is pure (gpud.core.launch.container_argv). Here: before a container serve's unit
starts, its image must be present (``podman image exists``): gpud never pulls on its own, so a
missing image is a start failure that says so, unless the serve sets ``pull = "missing"``, and
then the pull is an event of its own before the start.

podman does not run inside gpud's own process tree: gpud.service is sandboxed (/etc read-only,
no network beyond loopback, no new namespaces, a system-call filter), and podman needs to write
its store and locks (/etc/containers/networks, /var/lib/containers), and a pull needs the
registry. Each podman command runs as a transient unit of its own (`systemd-run --wait --pipe`,
over the system bus gpud uses anyway), with its output piped back and its exit status returned.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gpud import cdi
from gpud.config import ContainerConfig
from gpud.core.launch import CDI_GPU_KIND, cdi_device_name
from gpud.errors import Unavailable

# A pull of a vLLM image is gigabytes; a start waits for it under the device's start lock.
PULL_TIMEOUT_S = 3600.0
QUERY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Outcome:
    ok: bool
    detail: str


def podman_path(engine: str = "podman") -> str | None:
    return shutil.which(engine)


def outside_gpud(argv: list[str], what: str) -> list[str]:
    """`argv` as a transient unit of its own, outside gpud.service's sandbox (see above)."""
    runner = shutil.which("systemd-run")
    if runner is None:
        return argv
    return [runner, "--quiet", "--wait", "--pipe", "--collect", "--service-type=exec",
            f"--description=gpud: {what}", "--property=TimeoutStopSec=10", *argv]


async def _run(argv: list[str], timeout: float, what: str = "podman") -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *outside_gpud(argv, what), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return 124, f"timed out after {timeout:g} s"
    return proc.returncode or 0, out.decode(errors="replace").strip()


async def ensure_image(serve: str, c: ContainerConfig,
                       say: Callable[[str], Awaitable[None]]) -> Outcome:
    """Whether the serve's image is present (pulled first when `pull = "missing"`; `say`
    records that as an event). Never raises: the outcome says why not."""
    podman = podman_path(c.engine)
    if podman is None:
        return Outcome(False, f"{c.engine} is not installed (not found in PATH)")
    rc, out = await _run([podman, "image", "exists", c.image], QUERY_TIMEOUT_S,
                         f"is image {c.image} present (serve {serve})")
    if rc == 0:
        return Outcome(True, "present")
    if rc != 1:
        return Outcome(False, f"`{c.engine} image exists {c.image}` failed ({rc}): {out[-400:]}")
    if c.pull != "missing":
        return Outcome(False, f"image {c.image} is not present locally; gpud never pulls on "
                              f"its own: run `{c.engine} pull {c.image}`, or set "
                              f"serves.{serve}.container.pull = \"missing\"")
    await say(f"{serve}: image {c.image} is not present locally; pulling it "
              f"(serves.{serve}.container.pull = \"missing\")")
    rc, out = await _run([podman, "pull", c.image], PULL_TIMEOUT_S,
                         f"pull image {c.image} (serve {serve})")
    if rc != 0:
        return Outcome(False, f"pulling image {c.image} failed ({rc}): {out[-400:]}")
    await say(f"{serve}: pulled image {c.image}")
    return Outcome(True, "pulled")


def cdi_devices(serve: str, uuid: str, index: int) -> list[str]:
    """The CDI names of the serve's devices (one today), from the host's specs; Unavailable
    when no spec offers the device."""
    names, read = cdi.gpu_names()
    if not read or not names:
        raise Unavailable(f"serve {serve}: {cdi.missing_spec_message()}", {"serve": serve})
    found = cdi_device_name(uuid, index, names)
    if found is None:
        raise Unavailable(
            f"serve {serve}: the CDI specs ({', '.join(read)}) offer no {CDI_GPU_KIND} named "
            f"{uuid!r} or {str(index)!r} (they offer: {', '.join(sorted(names))}); regenerate "
            "them with `nvidia-ctk cdi generate`", {"serve": serve, "device": uuid})
    return [found]
