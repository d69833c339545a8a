"""A checkpoint on disk, read without loading a tensor: where a model is (a local directory, or
the Hugging Face cache at a pinned revision), its config.json, and every tensor's name, dtype and
shape from its safetensors headers (every shard, through model.safetensors.index.json).
Standard library only: gpuctl reads checkpoints itself (`gpuctl size`).

The safetensors format (huggingface/safetensors, safetensors/src/tensor.rs): 8 bytes, a
little-endian u64 N; N bytes of JSON, {name: {"dtype", "shape", "data_offsets": [begin, end]},
"__metadata__": {...}}; then the data, offsets relative to its start. The library refuses a
header over 100,000,000 bytes (tensor.rs:10 MAX_HEADER_SIZE), and so does this.

Reading is bounded: no more than the header and a few small JSON files is read, a FIFO or a
device is never opened for reading (it could block), and every problem is a CheckpointError
naming the file.
"""

from __future__ import annotations

import json
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpud.core.sizing import SAFETENSORS_BITS, Tensor

MAX_HEADER_BYTES = 100_000_000
# config.json and the shard index are small (an index of a model of ~100k tensors: a few MiB)
MAX_JSON_BYTES = 64 << 20
INDEX = "model.safetensors.index.json"
_SNAPSHOT = re.compile(r"[0-9a-f]{40}")
# A repository id: NAME or ORG/NAME (huggingface_hub's validate_repo_id, in short).
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as it says it is: the message names the file."""


class MissingFile(CheckpointError):
    """A file the checkpoint names is not there (a shard the index lists, its config.json)."""


class NotOnDisk(Exception):
    """The model is not (fully) on disk here: its needs are unknown until its first start."""


@dataclass(frozen=True)
class Checkpoint:
    """What was read: the directory, the config, every tensor, and the files they came from."""

    directory: Path
    config: dict[str, Any]
    tensors: tuple[Tensor, ...]
    files: tuple[str, ...]

    def where(self) -> str:
        shown = ", ".join(self.files[:2]) + (f" and {len(self.files) - 2} more"
                                            if len(self.files) > 2 else "")
        return f"{self.directory} ({len(self.tensors)} tensors in {shown})"


def _open_regular(path: Path) -> int:
    """A descriptor of `path`, a regular file (O_NONBLOCK: opening a FIFO does not wait for a
    writer; it is refused once seen)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise MissingFile(f"{path}: missing") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot open: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{path}: not a regular file")
    return fd


def _read_exactly(fd: int, n: int, path: Path, what: str) -> bytes:
    chunks: list[bytes] = []
    left = n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise CheckpointError(f"{path}: truncated: {what} of {n} bytes ends after "
                                  f"{n - left}")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_json(path: Path, limit: int = MAX_JSON_BYTES) -> Any:
    fd = _open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CheckpointError(f"{path}: {size} bytes, more than the {limit} read of a "
                                  "JSON file")
        raw = _read_exactly(fd, size, path, "the file")
    finally:
        os.close(fd)
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: not JSON: {exc}") from None


def read_header(path: Path) -> list[Tensor]:
    """The tensors of one safetensors file, from its header alone, checked as the safetensors
    library checks it: the header within the file and within 100,000,000 bytes, every tensor a
    known dtype, a shape of whole numbers and data offsets inside the file that match its
    size."""
    fd = _open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size < 8:
            raise CheckpointError(f"{path}: truncated: {size} bytes, no safetensors header")
        (n,) = struct.unpack("<Q", _read_exactly(fd, 8, path, "the header length"))
        if n > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: header of {n} bytes is over the "
                                  f"{MAX_HEADER_BYTES} safetensors allows")
        if n > size - 8:
            raise CheckpointError(f"{path}: truncated: the header claims {n} bytes, the file "
                                  f"holds {size - 8} after its length")
        raw = _read_exactly(fd, n, path, "the header")
    finally:
        os.close(fd)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    data = size - 8 - n
    tensors: list[Tensor] = []
    end_max = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise CheckpointError(f"{path}: tensor {name!r}: not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in SAFETENSORS_BITS:
            raise CheckpointError(f"{path}: tensor {name!r}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise CheckpointError(f"{path}: tensor {name!r}: shape {shape!r} is not a list of "
                                  "whole numbers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(
                isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
                and offsets[0] <= offsets[1]):
            raise CheckpointError(f"{path}: tensor {name!r}: data_offsets {offsets!r} is not "
                                  "[begin, end]")
        t = Tensor(str(name), str(dtype), tuple(shape))
        if offsets[1] - offsets[0] != t.stored_bytes:
            raise CheckpointError(f"{path}: tensor {name!r}: {dtype} {shape} is "
                                  f"{t.stored_bytes} bytes, its data_offsets span "
                                  f"{offsets[1] - offsets[0]}")
        end_max = max(end_max, offsets[1])
        tensors.append(t)
    if end_max > data:
        raise CheckpointError(f"{path}: truncated: the header places tensor data up to byte "
                              f"{end_max}, the file holds {data} bytes of data")
    return tensors


def _shard_files(directory: Path) -> list[str]:
    """The safetensors files vLLM would load: those the index names (vLLM filters by it:
    vllm/model_executor/model_loader/weight_utils.py filter_duplicate_safetensors_files), else
    model.safetensors, else every *.safetensors."""
    index = directory / INDEX
    if index.exists():
        doc = _read_json(index)
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no weight_map")
        files = sorted({str(f) for f in weight_map.values()})
        for f in files:
            if "/" in f or f in ("", ".", "..") or "\0" in f:
                raise CheckpointError(f"{index}: shard {f!r} is not a file name in "
                                      f"{directory}")
        return files
    if (directory / "model.safetensors").exists():
        return ["model.safetensors"]
    return sorted(p.name for p in directory.glob("*.safetensors"))


def read_checkpoint(directory: Path) -> Checkpoint:
    """The checkpoint in `directory` (CheckpointError naming the file; NotOnDisk when it has
    no safetensors: gpud reads no other format)."""
    config = _read_json(directory / "config.json")
    if not isinstance(config, dict):
        raise CheckpointError(f"{directory / 'config.json'}: not a JSON object")
    files = _shard_files(directory)
    if not files:
        raise NotOnDisk(f"{directory}: no safetensors files (gpud reads only their headers)")
    tensors: list[Tensor] = []
    for f in files:
        tensors += read_header(directory / f)
    return Checkpoint(directory, config, tuple(tensors), tuple(files))


def hub_directory(hub_cache: Path, repo_id: str, revision: str | None) -> Path:
    """A model's snapshot in the Hugging Face cache (huggingface_hub's layout:
    HUB/models--ORG--NAME/snapshots/COMMIT/, refs/BRANCH holding the commit), at `revision`
    (a commit, a branch or a tag; default main). NotOnDisk when it is not there."""
    repo = hub_cache / ("models--" + repo_id.replace("/", "--"))
    rev = revision or "main"
    if not _SNAPSHOT.fullmatch(rev):
        ref = repo / "refs" / rev
        try:
            fd = _open_regular(ref)
            try:
                commit = _read_exactly(fd, min(os.fstat(fd).st_size, 128), ref, "the ref")
            finally:
                os.close(fd)
        except CheckpointError:
            raise NotOnDisk(f"{repo_id}@{rev}: not in the model cache {hub_cache}") from None
        rev = commit.decode("ascii", "replace").strip()
        if not _SNAPSHOT.fullmatch(rev):
            raise CheckpointError(f"{ref}: not a commit: {rev[:60]!r}")
    snapshot = repo / "snapshots" / rev
    if not (snapshot / "config.json").exists():
        raise NotOnDisk(f"{repo_id}@{rev}: not in the model cache {hub_cache}")
    return snapshot


def hub_cache_of(environment: dict[str, str]) -> Path:
    """Where huggingface_hub keeps models for a process with `environment`: HF_HUB_CACHE, else
    HF_HOME/hub, else XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub
    (huggingface_hub/constants.py)."""
    if environment.get("HF_HUB_CACHE"):
        return Path(environment["HF_HUB_CACHE"])
    if environment.get("HF_HOME"):
        return Path(environment["HF_HOME"]) / "hub"
    if environment.get("XDG_CACHE_HOME"):
        return Path(environment["XDG_CACHE_HOME"]) / "huggingface" / "hub"
    return Path(environment.get("HOME") or "/root") / ".cache" / "huggingface" / "hub"


def locate(model: str, revision: str | None, hub_cache: Path) -> tuple[Path, bool]:
    """(the directory holding `model`, whether it is a local path). A local path is absolute
    (or starts with "~" or "."); anything else is a repository id looked for in `hub_cache`. A
    bare relative name is not taken for a directory: it would be one relative to whichever
    directory gpud or gpuctl runs in, not the serve's. NotOnDisk when it is not there."""
    try:
        path = Path(model).expanduser()
    except RuntimeError:  # "~name/..." where this host has no user "name" (pathlib's refusal)
        raise NotOnDisk(f"{model}: no such directory (no home directory for "
                        f"{model[1:].partition('/')[0]!r} on this host)") from None
    if path.is_absolute() or model.startswith((".", "~")):
        if not path.is_dir():
            raise NotOnDisk(f"{model}: no such directory")
        return path, True
    if not _REPO_ID.fullmatch(model) or ".." in model:
        raise NotOnDisk(f"{model}: neither a directory nor a repository id")
    return hub_directory(hub_cache, model, revision), False
