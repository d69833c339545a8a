"""Which GPUs the host's CDI specs offer a container (``--device nvidia.com/gpu=NAME``).

The Container Device Interface (github.com/cncf-tags/container-device-interface, SPEC.md) keeps
its specs in ``/etc/cdi`` and ``/var/run/cdi`` (podman's ``cdi_spec_dirs`` default), as JSON or
YAML files with a ``kind`` (``nvidia.com/gpu``) and ``devices``, each with a ``name``.
``nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml`` writes NVIDIA's (named by index, by
UUID or both: ``--device-name-strategy``). A host without one cannot give a container a GPU:
gpud says so at ``--check-config`` and refuses the start.

The specs nvidia-ctk writes are YAML of one plain shape; gpud carries no YAML parser (its
dependencies are fixed), so a YAML spec is read for its top-level ``kind:`` and the ``name:`` of
each item under ``devices:``, which is all gpud needs of it. A JSON spec is parsed whole.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

SPEC_DIRS: tuple[Path, ...] = (Path("/etc/cdi"), Path("/var/run/cdi"))
GPU_KIND = "nvidia.com/gpu"

_TOP_KEY = re.compile(r"^([A-Za-z][A-Za-z0-9_]*)\s*:\s*(.*?)\s*$")
_ITEM = re.compile(r"^(\s*)-\s+([A-Za-z][A-Za-z0-9_]*)\s*:\s*(.*?)\s*$")
_NAME = re.compile(r"^(\s+)name\s*:\s*(.*?)\s*$")


def _scalar(text: str) -> str:
    text = text.split(" #", 1)[0].strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def parse_spec(text: str, filename: str) -> tuple[str, list[str]]:
    """(kind, device names) of one spec file's text. Raises ValueError when it is neither."""
    if filename.endswith(".json"):
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("kind"), str):
            raise ValueError("no kind")
        devices = data.get("devices") or []
        return data["kind"], [d["name"] for d in devices
                              if isinstance(d, dict) and isinstance(d.get("name"), str)]
    kind = None
    names: list[str] = []
    in_devices = False
    item_indent: int | None = None
    for raw in text.splitlines():
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        top = _TOP_KEY.match(raw)
        if top is not None:
            in_devices = top.group(1) == "devices"
            if top.group(1) == "kind":
                kind = _scalar(top.group(2))
            continue
        if not in_devices:
            continue
        item = _ITEM.match(raw)
        if item is not None and (item_indent is None or len(item.group(1)) == item_indent):
            # the first list item under devices: sets the items' indent; nested lists are deeper
            item_indent = len(item.group(1))
            if item.group(2) == "name":
                names.append(_scalar(item.group(3)))
            continue
        name = _NAME.match(raw)
        # `- containerEdits: ...` then `  name: X` at the item's key indent (item indent + 2)
        if name is not None and item_indent is not None and len(name.group(1)) == item_indent + 2:
            names.append(_scalar(name.group(2)))
    if kind is None:
        raise ValueError("no kind")
    return kind, names


def gpu_names(dirs: Iterable[Path] = SPEC_DIRS, kind: str = GPU_KIND) -> tuple[set[str], list[str]]:
    """The device names of `kind` in every spec under `dirs`, and the spec files read (an empty
    list: the host has no CDI spec at all). A spec that cannot be read or parsed is skipped."""
    names: set[str] = set()
    read: list[str] = []
    for folder in dirs:
        try:
            entries = sorted(folder.iterdir())
        except OSError:
            continue
        for path in entries:
            if path.suffix not in (".json", ".yaml", ".yml"):
                continue
            try:
                spec_kind, spec_names = parse_spec(path.read_text(encoding="utf-8"), path.name)
            except (OSError, ValueError, UnicodeDecodeError, KeyError, TypeError):
                continue
            read.append(str(path))
            if spec_kind == kind:
                names.update(spec_names)
    return names, read


def missing_spec_message(kind: str = GPU_KIND) -> str:
    return (f"no CDI spec offers {kind} devices (looked in "
            f"{', '.join(str(d) for d in SPEC_DIRS)}): generate one with `nvidia-ctk cdi "
            "generate --output=/etc/cdi/nvidia.yaml` (NVIDIA Container Toolkit)")
