"""What `vllm serve` accepts, from the flag table of one vLLM version, and the check of an argv
against it. Pure: the table is data (gpud/data/vllm-serve-flags-VERSION.json, written by
scripts/vllm-flags from vLLM's own parser), the check takes arguments and returns problems.

The check reads an argv the way vLLM's FlexibleArgumentParser does
(vllm/utils/argparse_utils.py: parse_args): `_` and `-` are the same in an option name up to
its first `.`; `--opt=value` and `--opt value`; `--opt.key value` for an option that takes JSON;
`-O3` is `--optimization-level 3`. Anything it does not know is a problem, with the table's hint
for an option that is gone and the nearest names otherwise. Abbreviations, which argparse would
take, are refused too: a config names options in full.

Tables, looked for in this order (`load_table`): gpud's own, shipped in gpud/data (0.33.0, the
default, DEFAULT_VERSION, and 0.34.0); one an operator put in `daemon.vllm_flags_dir`
(/etc/gpud); one gpud learned from the installed vLLM's own parser (gpud.vllm.learn) and keeps
in its state directory (`LEARNED_DIR`), keyed by version. 0.34.0's was
walked from its own parser too (the PyPI wheel installed `--no-deps` over the CPU tier's
packages: scripts/vllm-flags says how); its FlexibleArgumentParser reads an argv the same way
(vllm/utils/argparse_utils.py of 0.34.0), and `--no-enable-extensible-kv-cache`, which gpud
passes on 0.34 (gpud.core.vllm_versions), is the hidden BooleanOptionalAction spelling of the
`--enable-`/`--disable-extensible-kv-cache` pair its table shows.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from gpud.core.vllm_versions import DEFAULT_VERSION as DEFAULT_VERSION

_DATA_PREFIX = "vllm-serve-flags-"
# Under daemon.state_dir: the tables gpud learned from the installed vLLM (gpud.vllm.learn).
LEARNED_DIR = "vllm-flags"
SHIPPED = "gpud's own table"
_NUMBER = re.compile(r"^-\d|^-\.\d")


@dataclass(frozen=True)
class Option:
    names: tuple[str, ...]
    dest: str
    takes_value: bool
    nargs: str | int | None
    choices: tuple[str, ...] | None
    json: bool
    deprecated: bool


@dataclass(frozen=True)
class FlagTable:
    version: str
    options: dict[str, Option]  # by every name of the option
    removed: dict[str, str]  # name -> what to do instead
    source: str = SHIPPED  # where it was read: SHIPPED, or a file's path

    @property
    def series(self) -> str:
        return ".".join(self.version.split(".")[:2])


@dataclass(frozen=True)
class Problem:
    index: int  # into the checked argv
    message: str


def available_versions() -> list[str]:
    names = [p.name for p in resources.files("gpud").joinpath("data").iterdir()]
    return sorted(n[len(_DATA_PREFIX):-len(".json")] for n in names
                  if n.startswith(_DATA_PREFIX) and n.endswith(".json"))


def table_name(version: str) -> str:
    return f"{_DATA_PREFIX}{version}.json"


def load_table(version: str = DEFAULT_VERSION, dirs: Sequence[str] = ()) -> FlagTable:
    """The table of `version`: gpud's own, else the first of DIRS that has one (the operator's
    directory, then the learned ones). KeyError says where it looked; TableError names a file
    that is there but is not the table of `version`."""
    try:
        return _shipped(version)
    except KeyError:
        pass
    for directory in dirs:
        path = Path(directory) / table_name(version)
        try:
            st = path.stat()
        except OSError:
            continue
        return _from_file(str(path), version, st.st_mtime_ns, st.st_size)
    where = ", ".join([f"gpud's own ({', '.join(available_versions()) or 'none'})",
                       *(str(Path(d) / table_name(version)) for d in dirs)])
    raise KeyError(f"no vllm serve flag table for vLLM {version!r} (looked in: {where})")


class TableError(ValueError):
    """A flag table file that is there but cannot be used: the message names it and why."""


@cache
def _shipped(version: str) -> FlagTable:
    path = resources.files("gpud").joinpath("data", table_name(version))
    if not path.is_file():
        raise KeyError(version)
    return table_from_json(json.loads(path.read_text()))


@cache
def _from_file(path: str, version: str, _mtime_ns: int, _size: int) -> FlagTable:
    """A table file (cached by path, modification time and size: a new file is read anew)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise TableError(f"{path}: not a readable flag table ({exc})") from None
    return checked_table(data, version, path)


def checked_table(data: Any, version: str, source: str) -> FlagTable:
    """DATA as the flag table of `version` read from SOURCE, or TableError saying why not."""
    try:
        table = table_from_json(data)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise TableError(f"{source}: not a flag table of vllm serve (scripts/vllm-flags writes "
                         f"one): {type(exc).__name__} {exc}") from None
    if table.version != version:
        raise TableError(f"{source}: the table of vLLM {table.version}, not {version}")
    if not table.options:
        raise TableError(f"{source}: lists no option")
    return FlagTable(table.version, table.options, table.removed, source)


def table_from_json(data: dict[str, Any]) -> FlagTable:
    options: dict[str, Option] = {}
    for raw in data["options"]:
        opt = Option(
            names=tuple(raw["names"]), dest=raw["dest"], takes_value=bool(raw["takes_value"]),
            nargs=raw.get("nargs"),
            choices=tuple(raw["choices"]) if raw.get("choices") is not None else None,
            json=bool(raw.get("json")), deprecated=bool(raw.get("deprecated")))
        for name in opt.names:
            options[name] = opt
    for opt in list(options.values()):
        for name in hidden_aliases(opt):
            options.setdefault(name, opt)
    return FlagTable(str(data["vllm"]), options, dict(data.get("removed", {})))


def hidden_aliases(opt: Option) -> tuple[str, ...]:
    """Names vLLM accepts for an option that its parser's list of names does not show. A flag
    that vLLM shows as `--enable-X` / `--disable-X` is a BooleanOptionalAction underneath
    (vllm/engine/arg_utils.py:379 of 0.32.0: "Creates --no-<name> and --<name> flags", where
    `--no-enable-prefix-caching` is its name; 0.33 shows `--disable-...` and still takes the
    `--no-enable-...` spelling), so `--no-enable-X` is the same option."""
    if opt.takes_value:
        return ()
    return tuple(f"--no-{name[2:]}" for name in opt.names
                 if name.startswith("--enable-") and f"--disable-{name[9:]}" in opt.names)


def _normalize(name: str) -> str:
    """vLLM's rule: in a `--` option, `_` becomes `-` up to the first `.`."""
    if not name.startswith("--"):
        return name
    head, dot, tail = name[2:].partition(".")
    return "--" + head.replace("_", "-") + dot + tail


def _is_option(arg: str) -> bool:
    return arg.startswith("-") and arg != "-" and not _NUMBER.match(arg)


def check_serve_args(args: Sequence[str], table: FlagTable) -> list[Problem]:
    """Problems in the arguments after `vllm serve` (a leading MODEL positional is allowed)."""
    problems: list[Problem] = []
    i = 0
    positionals = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            problems.append(Problem(i, "'--' is not an option of vllm serve"))
            break
        if not _is_option(arg):
            positionals += 1
            if positionals > 1 or i > 0:
                problems.append(Problem(i, f"unexpected argument {arg!r}: vllm serve takes one "
                                           "positional argument, the model, first"))
            i += 1
            continue
        if arg.startswith("-O") and not arg.startswith("--") and arg != "-O":
            # -O3, -O=3: vLLM rewrites these to --optimization-level
            i += 1
            continue
        name, eq, inline = arg.partition("=")
        name = _normalize(name)
        base, dot, _ = name.partition(".")
        if base == "-O":
            base = "--optimization-level"
        opt = table.options.get(base)
        if opt is None:
            problems.append(Problem(i, _unknown(base, table)))
            # Skip its value if it looks like one: one problem per option, not two.
            i += 1 if eq or i + 1 >= len(args) or _is_option(args[i + 1]) else 2
            continue
        if dot and not opt.json:
            problems.append(Problem(i, f"{base} does not take JSON, so not the {name} form"))
        if not opt.takes_value:
            if eq:
                problems.append(Problem(i, f"{base} takes no value (got {arg!r})"))
            i += 1
            continue
        values: list[str] = []
        if eq:
            values.append(inline)
            i += 1
        else:
            i += 1
            many = opt.nargs in ("+", "*") or isinstance(opt.nargs, int)
            while i < len(args) and not _is_option(args[i]):
                values.append(args[i])
                i += 1
                if not many:
                    break
        if not values and opt.nargs not in ("?", "*"):
            problems.append(Problem(i - 1, f"{base} needs a value"))
            continue
        if opt.choices is not None and not dot:
            for value in values:
                if value not in opt.choices:
                    problems.append(Problem(i - 1, f"{base} {value!r}: not one of "
                                                   f"{_listing(opt.choices)}"))
    return problems


def _unknown(name: str, table: FlagTable) -> str:
    hint = table.removed.get(name)
    if hint is not None:
        return f"{name} was removed (not an option of vLLM {table.version}); {hint}"
    if name.startswith("--"):
        longer = sorted(n for n in table.options if n.startswith(name))
        if longer and len({table.options[n].dest for n in longer}) == 1:
            return (f"{name} is an abbreviation of {longer[0]}: write the option in full "
                    f"(vLLM {table.version})")
    close = difflib.get_close_matches(name, list(table.options), n=3, cutoff=0.75)
    suggestion = f"; did you mean {' or '.join(close)}?" if close else ""
    return f"{name} is not an option of vllm serve in vLLM {table.version}{suggestion}"


def _listing(choices: Sequence[str]) -> str:
    shown = ", ".join(choices[:12])
    return shown + (f", ... ({len(choices)} in all)" if len(choices) > 12 else "")
