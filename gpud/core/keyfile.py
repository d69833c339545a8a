"""Edits of router.api_keys_file's text (docs/router.md, "Keys from the command line"): one
``[keys.NAME]`` table added, replaced or removed, the rest of the file (other keys, comments,
blank lines) kept byte for byte. Text in, text out: ``gpuctl keys`` reads the file, checks the
result as gpud's reload does (gpud.core.keys.parse_keys) and writes it.

A key written by an edit holds its token's SHA-256 (``sha256 = "..."``), never the token: the
token is shown once, to whoever made it. An edit that cannot be made on the file's own lines
(the key written as an inline table, or inside a ``[keys]`` table) is refused, naming the key,
rather than the file rewritten from its parsed values (which would drop its comments).

Pure: no file, clock or randomness here.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from gpud.core.keys import KEY_SHARES

_BARE_KEY: Final = re.compile(r"[A-Za-z0-9_-]+")


class KeyFileError(ValueError):
    """An edit that cannot be made: the message names the key and why."""


@dataclass(frozen=True)
class KeyEntry:
    """What an edit writes of one key: its token's SHA-256, the models it may use and its
    limits and shares (gpud.core.keys.KEY_SHARES: name -> value; unset ones left out)."""

    sha256: str
    models: tuple[str, ...]
    shares: Mapping[str, int | float]
    # another gpud host's key (`peer = true`; docs/peers.md): its forwarded requester is taken
    peer: bool = False


def toml_string(text: str) -> str:
    """TEXT as a TOML basic string. JSON's escapes are TOML's, except that TOML allows no raw
    DEL and no escaped surrogate (ensure_ascii=False writes neither)."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def table_header(name: str) -> str:
    return f"[keys.{name if _BARE_KEY.fullmatch(name) else toml_string(name)}]"


def render_entry(name: str, entry: KeyEntry) -> str:
    """The lines of key NAME's table, ending in a newline."""
    lines = [table_header(name), f"sha256 = {toml_string(entry.sha256)}",
             "models = [" + ", ".join(toml_string(m) for m in entry.models) + "]"]
    for field in KEY_SHARES:
        value = entry.shares.get(field)
        if value is not None:
            lines.append(f"{field} = {value!r}")
    if entry.peer:
        lines.append("peer = true")
    return "\n".join(lines) + "\n"


def _header_path(line: str) -> tuple[str, ...] | None:
    """The key path of a table header line ([a.b], [a."b.c"] # note), else None. An array of
    tables ([[x]]) counts as a header too: it ends the table before it."""
    stripped = line.strip()
    if not stripped.startswith("["):
        return None
    try:
        doc: Any = tomllib.loads(stripped)
    except tomllib.TOMLDecodeError:
        return None
    path: list[str] = []
    while isinstance(doc, dict) and len(doc) == 1:
        (key, doc), = doc.items()
        path.append(key)
        if isinstance(doc, list):  # [[x]]
            return tuple(path)
    return tuple(path) if path and doc == {} else None


def _span(lines: Sequence[str], name: str) -> tuple[int, int] | None:
    """The lines [start, end) of key NAME's own table, header to the next header (the blank
    and comment lines right before that header are left to it)."""
    start = None
    for i, line in enumerate(lines):
        path = _header_path(line)
        if path is None:
            continue
        if start is not None:
            end = i
            while end > start + 1 and (not lines[end - 1].strip()
                                       or lines[end - 1].lstrip().startswith("#")):
                end -= 1
            return start, end
        if path == ("keys", name):
            start = i
    return None if start is None else (start, len(lines))


def _keys_of(text: str, what: str) -> dict[str, Any]:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise KeyFileError(f"{what} is not TOML: {exc}") from exc
    table = doc.get("keys", {})
    if not isinstance(table, dict):
        raise KeyFileError(f"{what}: keys must be a table of [keys.NAME] tables")
    return table


def keys_in(text: str) -> dict[str, Any]:
    """The [keys.NAME] tables of a keys file's text (a KeyFileError when it is not TOML)."""
    return _keys_of(text, "the keys file")


def set_key(text: str, name: str, entry: KeyEntry | None) -> str:
    """TEXT with key NAME's table replaced by ENTRY (added at the end when it has none), or
    removed (ENTRY None). Everything else stays as written. A KeyFileError when NAME's table
    is not a [keys.NAME] table of its own (the edit would not be the one asked for)."""
    before = keys_in(text)
    lines = text.splitlines(keepends=True)
    span = _span(lines, name)
    if span is None and name in before:
        raise KeyFileError(f"keys.{name} is not written as a [keys.{name}] table of its own: "
                           "edit the file by hand")
    new = "" if entry is None else render_entry(name, entry)
    if span is None:
        if not new:
            raise KeyFileError(f"no key {name!r} in the keys file")
        head = "".join(lines)
        if head and not head.endswith("\n"):
            head += "\n"
        out = head + ("\n" if head.strip() else "") + new
    else:
        start, end = span
        head, tail = "".join(lines[:start]), "".join(lines[end:])
        if not new and not tail.strip():
            # the last table removed: so are the blank lines an addition put before it
            head = head.rstrip("\n") + "\n" if head.strip() else ""
        out = head + new + tail
    after = _keys_of(out, "the edited keys file")
    expected = {k: v for k, v in before.items() if k != name}
    if entry is not None:
        expected[name] = tomllib.loads(new)["keys"][name]
    if after != expected:
        raise KeyFileError(f"keys.{name}: the file's layout around it cannot be edited line by "
                           "line: edit the file by hand")
    return out


def entry_of(table: Mapping[str, Any], digest: str) -> KeyEntry:
    """An existing key's table with the token digest DIGEST instead of its token (a rotation)."""
    models = table.get("models")
    return KeyEntry(digest, tuple(models) if isinstance(models, list) else (),
                    {f: table[f] for f in KEY_SHARES if f in table},
                    peer=table.get("peer") is True)
