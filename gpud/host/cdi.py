"""Which GPUs the host's CDI specs offer a container (``--device nvidia.com/gpu=NAME``).

The Container Device Interface (github.com/cncf-tags/container-device-interface, SPEC.md) keeps
its specs in ``/etc/cdi`` and ``/var/run/cdi`` (podman's ``cdi_spec_dirs`` default), as JSON or
YAML files with a ``kind`` (``nvidia.com/gpu``) and ``devices``, each with a ``name``.
``nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml`` writes NVIDIA's (named by index, by
UUID or both: ``--device-name-strategy``, plus ``all``). A host without one cannot give a
container a GPU: gpud says so at ``--check-config`` and refuses the start.

A spec is read as podman's CDI library reads it (tags.cncf.io/container-device-interface,
pkg/cdi/spec.go: ParseSpec, sigs.k8s.io/yaml's UnmarshalStrict): any YAML, flow style, anchors
and aliases included, of which the first document is the spec; JSON is YAML. PyYAML's safe loader
reads it (no tags that make objects), refusing a key given twice as the strict unmarshal does.
What is wrong (not YAML, no ``kind``, a device without a ``name`` string, a name CDI does not
allow) is said with the file and, for YAML, the line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

SPEC_DIRS: tuple[Path, ...] = (Path("/etc/cdi"), Path("/var/run/cdi"))
GPU_KIND = "nvidia.com/gpu"
SUFFIXES = (".json", ".yaml", ".yml")

# A CDI device name: letters, digits, then `_`, `-`, `.` and `:` between (cncf-tags/
# container-device-interface, pkg/parser/parser.go: ValidateDeviceName).
DEVICE_NAME_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9_.:-]*[A-Za-z0-9])?$")


class SpecError(ValueError):
    """A spec gpud cannot read: the message names the line and what is wrong."""


@dataclass
class Scan:
    """What the specs under the CDI folders offer."""

    names: set[str] = field(default_factory=set)  # device names of the kind asked for
    read: list[str] = field(default_factory=list)  # the spec files read
    problems: list[str] = field(default_factory=list)  # "PATH: why" for each one not read


def _device_names(names: list[str]) -> list[str]:
    for name in names:
        if not DEVICE_NAME_RE.fullmatch(name):  # `$` alone would let "a\n" through
            raise SpecError(f"device name {name!r} is not a CDI device name (letters, "
                            "digits, and _ - . : between them)")
    return names


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that gives one key twice (safe_load keeps the
    last silently; CDI's strict unmarshal refuses it)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor`: what it merges in may be overridden here
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                continue  # a key YAML allows and no CDI field is: the mapping says what it is
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{key!r} a second time", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _load(text: str, is_json: bool) -> object:
    if is_json:
        try:
            return json.loads(text)
        except ValueError as exc:
            raise SpecError(f"not valid JSON: {exc}") from exc
    try:
        # the first document is the spec, as CDI's own parser reads it
        return next(iter(yaml.load_all(text, Loader=_Loader)), None)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}: " if mark is not None else ""
        raise SpecError(f"{where}not valid YAML: {exc.problem or exc.context}") from exc
    except yaml.YAMLError as exc:
        raise SpecError(f"not valid YAML: {exc}") from exc


def parse_spec(text: str, filename: str) -> tuple[str, list[str]]:
    """(kind, device names) of one spec file's text. Raises SpecError saying why not."""
    text = text.removeprefix("\ufeff")
    data = _load(text, filename.endswith(".json"))
    if not isinstance(data, dict):
        raise SpecError("the spec is not a mapping (an object with kind and devices)")
    kind = data.get("kind")
    if not isinstance(kind, str) or not kind:
        raise SpecError("no \"kind\" string")
    devices = data.get("devices")
    if devices is None:
        devices = []
    if not isinstance(devices, list):
        raise SpecError("\"devices\" is not a list")
    names: list[str] = []
    for i, device in enumerate(devices):
        name = device.get("name") if isinstance(device, dict) else None
        if not isinstance(name, str):
            hint = f" ({name!r} unquoted is not a string in YAML)" if name is not None else ""
            raise SpecError(f"devices[{i}] has no \"name\" string{hint}")
        names.append(name)
    return kind, _device_names(names)


def scan(dirs: Iterable[Path] = SPEC_DIRS, kind: str = GPU_KIND) -> Scan:
    """The device names of `kind` in every spec under `dirs`, the spec files read (none: the
    host has no CDI spec at all) and, for each spec that cannot be read, why."""
    found = Scan()
    for folder in dirs:
        try:
            entries = sorted(folder.iterdir())
        except OSError:
            continue
        for path in entries:
            if path.suffix not in SUFFIXES:
                continue
            try:
                spec_kind, spec_names = parse_spec(path.read_text(encoding="utf-8"), path.name)
            except SpecError as exc:
                found.problems.append(f"{path}: {exc}")
                continue
            except (OSError, UnicodeDecodeError) as exc:
                found.problems.append(f"{path}: cannot read it: {exc}")
                continue
            found.read.append(str(path))
            if spec_kind == kind:
                found.names.update(spec_names)
    return found


def gpu_names(dirs: Iterable[Path] = SPEC_DIRS, kind: str = GPU_KIND) -> tuple[set[str], list[str]]:
    """The device names of `kind` under `dirs` and the spec files read (see `scan`)."""
    found = scan(dirs, kind)
    return found.names, found.read


def unread_message(problems: list[str]) -> str:
    return (f"; gpud could not read {'; '.join(problems)}" if problems else "")


def missing_spec_message(kind: str = GPU_KIND, problems: list[str] | None = None) -> str:
    return (f"no CDI spec offers {kind} devices (looked in "
            f"{', '.join(str(d) for d in SPEC_DIRS)}): generate one with `nvidia-ctk cdi "
            "generate --output=/etc/cdi/nvidia.yaml` (NVIDIA Container Toolkit)"
            + unread_message(problems or []))
