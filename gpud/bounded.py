"""Parsing what a peer sent (a JSON body, a TOML config) within bounds, with the path of what
exceeds them.

Two things in a well-formed document make the parsers themselves fail with something other than
their syntax error: a decimal integer of more than ``sys.get_int_max_str_digits()`` digits (4300:
``int()`` refuses it, and json.loads and tomllib raise a bare ``ValueError`` without a position),
and nesting deeper than the parser allows (``RecursionError``; tomli says 400 levels, json as
deep as the interpreter's recursion limit). Neither may become a 500 or a traceback. Here the
offending value is found by a scan that knows only the format's strings, comments, numbers and
brackets, replaced by a marker string, and the document parsed again: where the marker lands is
the path of the offending value, in the document's own structure (``serves.ocr.vram_mib``). A
parsed document deeper than ``MAX_DEPTH`` (gpud's deepest is ``serves.NAME.vllm.extra_args[i]``)
is refused too, with the path where it goes too deep.

Lengths are bounded before any parse: an API body by its limit (413), a config by its body.
"""

from __future__ import annotations

import functools
import json
import math
import re
import secrets
import sys
from collections.abc import Callable
from typing import Any

try:  # the compiled build of the parser tomllib was made from: about 3x faster on big configs
    import tomli as toml
except ImportError:  # pragma: no cover - the same parser, pure Python
    import tomllib as toml  # type: ignore[no-redef]

MAX_DEPTH = 32


class OutOfBounds(ValueError):
    """``path``: where the value is (``(top level)`` for the document itself); ``reason``: why."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class SyntaxProblem(ValueError):
    """The document is not valid JSON or TOML: the parser's own message."""


_JSON_TOKEN = re.compile(
    r'(?P<s>"[^"\\]*(?:\\.[^"\\]*)*")'
    r"|(?P<n>-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)"
    r"|(?P<o>[\[{])|(?P<c>[\]}])")
_TOML_TOKEN = re.compile(
    r'(?P<s>"""(?:[^\\]|\\.)*?"""(?!")|\'\'\'.*?\'\'\'(?!\')'
    r'|"[^"\\\n]*(?:\\.[^"\\\n]*)*"|\'[^\'\n]*\')'
    r"|(?P<comment>#[^\n]*)"
    # a bare key or a word ends a number before it: `a123 = 1` holds no number
    r"|(?<![A-Za-z0-9_-])(?P<n>[+-]?\d[\d_]*(?:\.\d[\d_]*)?(?:[eE][+-]?\d[\d_]*)?)"
    r"|(?P<o>[\[{])|(?P<c>[\]}])",
    re.DOTALL)


def _digit_limit() -> int:
    limit = sys.get_int_max_str_digits()
    return limit if limit > 0 else sys.maxsize


def _scan(text: str, token: re.Pattern[str]) -> tuple[str, dict[str, tuple[str, int]]]:
    """The text with each value out of bounds replaced by a marker string, and for each marker
    its reason and offset: numbers of too many digits, and what opens deeper than MAX_DEPTH."""
    nonce = secrets.token_hex(12)  # a peer cannot write a marker of its own
    digits = _digit_limit()
    found: dict[str, tuple[str, int]] = {}
    pieces: list[str] = []
    kept = 0
    depth = 0
    deep_from: int | None = None

    def mark(start: int, end: int, reason: str) -> None:
        nonlocal kept
        marker = f"gpud-out-of-bounds-{nonce}-{len(found)}"
        found[marker] = (reason, start)
        pieces.append(text[kept:start])
        pieces.append(f'"{marker}"')
        kept = end

    for m in token.finditer(text):
        kind = m.lastgroup
        if kind == "o":
            depth += 1
            if depth == MAX_DEPTH + 1 and deep_from is None:
                deep_from = m.start()
        elif kind == "c":
            if depth == MAX_DEPTH + 1 and deep_from is not None:
                mark(deep_from, m.end(), f"nested deeper than {MAX_DEPTH} levels")
                deep_from = None
            depth = max(0, depth - 1)
        elif kind == "n" and deep_from is None:
            count = sum(c.isdigit() for c in m.group())
            if count > digits:
                mark(m.start(), m.end(),
                     f"a number of {count} digits: more than the {digits} a number may have")
    if deep_from is not None:  # never closed: the parse of the rest says what is wrong
        mark(deep_from, len(text), f"nested deeper than {MAX_DEPTH} levels")
    pieces.append(text[kept:])
    return "".join(pieces), found


def _name(key: str) -> str:
    shown = key if len(key) <= 80 else key[:77] + "..."
    return shown if re.fullmatch(r"[A-Za-z0-9_-]+", shown) else json.dumps(shown)


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{_name(key)}" if path else _name(key)


@functools.cache
def _too_big(digits: int) -> int:
    big: int = 10 ** min(digits, 100_000)
    return big


def check_bounds(value: Any, markers: dict[str, tuple[str, int]] | None = None, *,
                 finite: bool = False) -> None:
    """Raise OutOfBounds for a value that is a marker of `markers`, lies deeper than MAX_DEPTH,
    or is an integer too large to write in decimal (a hexadecimal TOML integer is not refused
    by int(), but str() would refuse it later). With `finite`, a number that overflowed to
    infinity (JSON's 1e999) is refused too."""
    markers = markers or {}
    digits = _digit_limit()
    big = _too_big(digits) if digits < sys.maxsize else None

    def scalar(item: Any) -> str | None:
        kind = type(item)
        if kind is str:
            return markers[item][0] if item in markers else None
        if kind is int and big is not None and abs(item) >= big:
            return f"a number of more than the {digits} digits a number may have"
        if kind is float and finite and not math.isfinite(item):
            return "a number too large for a float"
        return None

    # (container, its path as a chain (parent chain, key), its depth): paths are spelled out
    # only for the answer, so a large document costs one pass over its values.
    Chain = tuple[Any, str | int] | None
    todo: list[tuple[Any, Chain, int]] = []
    why = scalar(value)
    if why is not None:
        raise OutOfBounds("(top level)", why)
    if type(value) in (dict, list):
        todo.append((value, None, 0))
    while todo:
        item, chain, depth = todo.pop()
        if depth >= MAX_DEPTH and item:
            raise OutOfBounds(_spell(chain), f"nested deeper than {MAX_DEPTH} levels")
        pairs = item.items() if type(item) is dict else enumerate(item)
        for key, sub in pairs:
            if type(key) is str and key in markers:
                raise OutOfBounds(_spell((chain, "(key)")), markers[key][0])
            kind = type(sub)
            if kind is dict or kind is list:
                todo.append((sub, (chain, key), depth + 1))
            elif kind is not bool and (why := scalar(sub)) is not None:
                raise OutOfBounds(_spell((chain, key)), why)


def _spell(chain: Any) -> str:
    keys: list[str | int] = []
    while chain is not None:
        chain, key = chain
        keys.append(key)
    path = ""
    for key in reversed(keys):
        path = _join(path, key)
    return path or "(top level)"


def _position(text: str, offset: int) -> str:
    line = text.count("\n", 0, offset) + 1
    column = offset - (text.rfind("\n", 0, offset) + 1) + 1
    return f"line {line} column {column}"


def _bounded(text: str, parse: Callable[[str], Any], token: re.Pattern[str],
             syntax: tuple[type[ValueError], ...], *, finite: bool = False) -> Any:
    try:
        value = parse(text)
    except syntax:
        raise
    except (ValueError, RecursionError):
        rewritten, markers = _scan(text, token)
        if not markers:
            raise OutOfBounds("(top level)", "a value out of bounds (a number of too many "
                              "digits, or nesting too deep)") from None
        try:
            value = parse(rewritten)
        except (ValueError, RecursionError):
            # the text around the culprit does not parse either: say where the culprit is
            reason, offset = next(iter(markers.values()))
            raise OutOfBounds(f"(at {_position(text, offset)})", reason) from None
        check_bounds(value, markers, finite=finite)
        reason, offset = next(iter(markers.values()))
        raise OutOfBounds(f"(at {_position(text, offset)})", reason) from None
    check_bounds(value, finite=finite)
    return value


def _no_constants(name: str) -> Any:
    raise SyntaxProblem(f"{name} is not a number JSON allows")


def _json(text: str) -> Any:
    return json.loads(text, parse_constant=_no_constants)


def parse_json(text: str) -> Any:
    """json.loads within bounds. Raises json.JSONDecodeError or SyntaxProblem for what is not
    JSON, OutOfBounds for a number of too many digits or nesting deeper than MAX_DEPTH."""
    return _bounded(text, _json, _JSON_TOKEN, (json.JSONDecodeError, SyntaxProblem),
                    finite=True)


def parse_toml(text: str) -> dict[str, Any]:
    """tomllib.loads within bounds. Raises TOMLDecodeError for what is not TOML, OutOfBounds for
    a number of too many digits or nesting deeper than MAX_DEPTH."""
    value: dict[str, Any] = _bounded(text, toml.loads, _TOML_TOKEN,
                                      (toml.TOMLDecodeError,))
    return value


TOMLDecodeError = toml.TOMLDecodeError
