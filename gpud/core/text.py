"""Text that came from a peer, made safe to show: one function for gpuctl's output and the
journal's MESSAGE (standard library only: gpuctl imports it, and it costs it nothing).

A serve name in an error, an apply's `source` label, an event's message: any of it may hold what
a terminal obeys rather than shows, ESC sequences (``\\x1b[2J`` clears the screen, others set the
title or colours), the 8-bit C1 controls (U+009B is a CSI of its own on some terminals), a
carriage return or backspaces that overwrite what came before, and the bidirectional overrides
that reorder what is read (U+202E). Each is written as its escape instead: ``\\x1b``, ``\\x9b``,
``\\u202e``. Newlines and tabs are kept (they are how gpuctl lays out its own text).
"""

from __future__ import annotations

# Not ``typing.TYPE_CHECKING``: gpuctl imports this module, and typing costs it startup time.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable

_KEPT = {"\n", "\t"}
_CONTROLS = [c for c in range(0x00, 0x20) if chr(c) not in _KEPT] + list(range(0x7F, 0xA0))
# bidirectional embeddings, overrides and isolates; the line and paragraph separators
_FORMATS = [*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x200E, 0x200F, 0x061C, 0x2028,
            0x2029]

_TEXT = {c: f"\\x{c:02x}" for c in _CONTROLS} | {c: f"\\u{c:04x}" for c in _FORMATS}
_TEXT.update({0x0D: "\\r", 0x08: "\\b"})
# In JSON (gpuctl --json) an escape must stay JSON: \uXXXX, the same character once decoded.
_JSON = {c: f"\\u{c:04x}" for c in [*_CONTROLS, *_FORMATS]}


def printable(text: str, *, json: bool = False) -> str:
    """`text` with every control character a terminal would obey written as its escape; with
    `json`, as a JSON escape (for text that is a JSON document)."""
    return text.translate(_JSON if json else _TEXT)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`; did you mean 'vram_mib'?` for the choice nearest to a mistyped `word` (difflib's
    ratio at least 0.6), else the empty string."""
    import difflib  # here: gpuctl imports this module and rarely needs it

    near = difflib.get_close_matches(word, sorted(set(choices)), n=1, cutoff=0.6)
    return f"; did you mean {near[0]!r}?" if near else ""
