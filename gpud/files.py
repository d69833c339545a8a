"""Files gpud writes: whole or not at all."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from gpud.errors import GpudError


def write_atomically(path: Path, text: str, mode: int = 0o600, *, gid: int | None = None) -> None:
    """Write, fsync, rename over, fsync the directory: a crash leaves the old or the new file,
    and a failure (a full disk) leaves the old file and no temporary one. `gid`: the file's
    group, given before the rename (never readable by the wrong group in between)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            if gid is not None:
                os.fchown(fd, -1, gid)
            os.fchmod(fd, mode)
            data = text.encode()
            while data:
                data = data[os.write(fd, data):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise GpudError(f"cannot write {path}: {exc.strerror or exc}") from exc
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
