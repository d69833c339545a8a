"""Which GPUs the host's CDI specs offer a container (``--device nvidia.com/gpu=NAME``).

The Container Device Interface (github.com/cncf-tags/container-device-interface, SPEC.md) keeps
its specs in ``/etc/cdi`` and ``/var/run/cdi`` (podman's ``cdi_spec_dirs`` default), as JSON or
YAML files with a ``kind`` (``nvidia.com/gpu``) and ``devices``, each with a ``name``.
``nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml`` writes NVIDIA's (named by index, by
UUID or both: ``--device-name-strategy``, plus ``all``). A host without one cannot give a
container a GPU: gpud says so at ``--check-config`` and refuses the start.

gpud carries no YAML parser (its dependencies are fixed). A JSON spec (``.json``, or a ``.yaml``
whose text is JSON, which YAML reads as it is) is parsed whole. A YAML spec is read for what
gpud needs of it, its top-level ``kind`` and the ``name`` of each item of its top-level
``devices`` sequence, in the block layout nvidia-ctk writes (one document, ``---`` first,
sequences indented by four or at their key's column, ``name: "0"`` quoted where YAML needs it,
``containerEdits`` beside it; NVIDIA/nvidia-container-toolkit,
cmd/nvidia-ctk/cdi/generate/generate_test.go). YAML it cannot read with certainty (flow style,
several documents, anchors, tags, block scalars, tabs, an item without a name, a name CDI does
not allow) is refused with the file and line named, never guessed at.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

SPEC_DIRS: tuple[Path, ...] = (Path("/etc/cdi"), Path("/var/run/cdi"))
GPU_KIND = "nvidia.com/gpu"
SUFFIXES = (".json", ".yaml", ".yml")

# A CDI device name: letters, digits, then `_`, `-`, `.` and `:` between (cncf-tags/
# container-device-interface, pkg/parser/parser.go: ValidateDeviceName).
DEVICE_NAME_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
_KEY = r"(?:[A-Za-z_][A-Za-z0-9_-]*|\"[A-Za-z_][A-Za-z0-9_-]*\"|'[A-Za-z_][A-Za-z0-9_-]*')"
_MAPPING = re.compile(rf"^({_KEY})\s*:(?:\s+(.*))?$")
_ITEM = re.compile(r"^-(?:\s+(.*))?$")


class SpecError(ValueError):
    """A spec gpud cannot read: the message names the line and what is wrong."""


@dataclass
class Scan:
    """What the specs under the CDI folders offer."""

    names: set[str] = field(default_factory=set)  # device names of the kind asked for
    read: list[str] = field(default_factory=list)  # the spec files read
    problems: list[str] = field(default_factory=list)  # "PATH: why" for each one not read


def _uncomment(text: str) -> str:
    """The line without its comment (`#` at its start or after a blank, outside quotes)."""
    quote = None
    for i, ch in enumerate(text):
        if quote is not None:
            if ch == quote:
                quote = None
        elif ch in "'\"" and (i == 0 or text[i - 1] in " \t:-[{,"):
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1] in " \t"):
            return text[:i].rstrip()
    return text.rstrip()


def _key(raw: str) -> str:
    return raw[1:-1] if raw[0] in "'\"" else raw


def _scalar(text: str, line: int, what: str) -> str:
    """A YAML scalar as nvidia-ctk writes one: plain, single- or double-quoted."""
    text = text.strip()
    if not text:
        raise SpecError(f"line {line}: {what} has no value")
    if text[0] == '"':
        try:
            value = json.loads(text)  # YAML's double-quoted escapes are JSON's, for a name
        except ValueError as exc:
            raise SpecError(f"line {line}: {what} {text} is not a string gpud can read") from exc
        if not isinstance(value, str):
            raise SpecError(f"line {line}: {what} {text} is not a string")
        return value
    if text[0] == "'":
        if len(text) < 2 or text[-1] != "'" or "'" in text[1:-1].replace("''", ""):
            raise SpecError(f"line {line}: {what} {text} is not a string gpud can read")
        return text[1:-1].replace("''", "'")
    if text[0] in "[{&*!|>%@`":
        raise SpecError(f"line {line}: {what} {text!r} is YAML gpud does not read (flow "
                        "style, an anchor, alias, tag or block scalar)")
    return text


def _device_names(names: list[tuple[int, str]]) -> list[str]:
    for line, name in names:
        if not DEVICE_NAME_RE.match(name):
            where = f"line {line}: " if line else ""
            raise SpecError(f"{where}device name {name!r} is not a CDI device name (letters, "
                            "digits, and _ - . : between them)")
    return [name for _, name in names]


def _parse_json(text: str) -> tuple[str, list[str]]:
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise SpecError(f"not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise SpecError("not a JSON object")
    kind = data.get("kind")
    if not isinstance(kind, str) or not kind:
        raise SpecError("no \"kind\" string")
    devices = data.get("devices", [])
    if not isinstance(devices, list):
        raise SpecError("\"devices\" is not a list")
    names: list[tuple[int, str]] = []
    for i, device in enumerate(devices):
        if not isinstance(device, dict) or not isinstance(device.get("name"), str):
            raise SpecError(f"devices[{i}] has no \"name\" string")
        names.append((0, device["name"]))
    return kind, _device_names(names)


def _parse_yaml(text: str) -> tuple[str, list[str]]:
    kind: str | None = None
    names: list[tuple[int, str]] = []
    seen_top: set[str] = set()
    started = False  # a document has begun (`---` or its first key)
    in_devices = False
    item_col: int | None = None  # the column of the devices' `-`
    key_col: int | None = None  # the column of the current item's keys
    item_line = 0
    item_keys: set[str] = set()

    def end_item() -> None:
        if item_line and "name" not in item_keys:
            raise SpecError(f"line {item_line}: a device has no name")

    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.lstrip(" ")
        if stripped.startswith("\t"):
            raise SpecError(f"line {number}: a tab in the indentation (YAML forbids it)")
        line = _uncomment(raw)
        if not line.strip():
            continue
        col = len(line) - len(line.lstrip(" "))
        body = line.strip()
        if col == 0 and body.startswith("%"):
            if started:
                raise SpecError(f"line {number}: a YAML directive inside the document")
            continue
        if col == 0 and (body == "---" or body.startswith("--- ")):
            if started:
                raise SpecError(f"line {number}: a second YAML document (a spec is one)")
            started = True
            if body != "---":
                raise SpecError(f"line {number}: content after `---` on its line")
            continue
        if col == 0 and body == "...":
            break
        started = True
        item = _ITEM.match(body)
        if in_devices and item is not None and (item_col is None or col == item_col):
            end_item()
            item_col, item_line, item_keys = col, number, set()
            rest = item.group(1)
            if rest is None:
                key_col = None  # the item's keys begin on the next line
                continue
            key_col = col + (len(body) - len(rest))
            pair = _MAPPING.match(rest)
            if pair is None:
                raise SpecError(f"line {number}: a device that is not a mapping ({rest!r})")
            key = _key(pair.group(1))
            item_keys.add(key)
            if key == "name":
                names.append((number, _scalar(pair.group(2) or "", number, "the name")))
            continue
        if col == 0:
            if item is not None:
                raise SpecError(f"line {number}: a sequence at the top (a spec is a mapping)")
            pair = _MAPPING.match(body)
            if pair is None:
                raise SpecError(f"line {number}: {body[:40]!r} is not a `key: value` line")
            end_item()
            item_line = 0
            key, value = _key(pair.group(1)), (pair.group(2) or "").strip()
            if key in seen_top:
                raise SpecError(f"line {number}: {key!r} a second time")
            seen_top.add(key)
            in_devices, item_col, key_col = key == "devices", None, None
            if key == "kind":
                kind = _scalar(value, number, "kind")
            elif key == "devices" and value not in ("", "[]"):
                raise SpecError(f"line {number}: devices in flow style ({value[:40]!r}); gpud "
                                "reads the block style nvidia-ctk writes, or JSON")
            continue
        if not in_devices:
            continue  # inside another top-level key (containerEdits, annotations, ...)
        if item_col is None or col <= item_col:
            raise SpecError(f"line {number}: {body[:40]!r} is not an item of devices")
        if key_col is None:
            key_col = col  # `-` alone on its line: this is the item's first key
        if col < key_col:
            raise SpecError(f"line {number}: {body[:40]!r} is indented between the device's "
                            "`-` and its keys")
        if col > key_col:
            continue  # inside one of the item's keys (containerEdits, annotations, ...)
        pair = _MAPPING.match(body)
        if pair is None:
            raise SpecError(f"line {number}: {body[:40]!r} is not a `key: value` line")
        key = _key(pair.group(1))
        if key in item_keys:
            raise SpecError(f"line {number}: the device has {key!r} a second time")
        item_keys.add(key)
        if key == "name":
            names.append((number, _scalar(pair.group(2) or "", number, "the name")))
    end_item()
    if kind is None:
        raise SpecError("no top-level kind")
    return kind, _device_names(names)


def parse_spec(text: str, filename: str) -> tuple[str, list[str]]:
    """(kind, device names) of one spec file's text. Raises SpecError saying why not."""
    text = text.removeprefix("\ufeff")
    if filename.endswith(".json") or text.lstrip().startswith("{"):
        return _parse_json(text)
    return _parse_yaml(text)


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
