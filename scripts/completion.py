#!/usr/bin/env python3
"""Write gpuctl's bash and zsh completion from gpuctl's own parser (so they cannot go stale).

    python3 scripts/completion.py            # rewrite contrib/completion/{gpuctl.bash,_gpuctl}
    python3 scripts/completion.py --check    # exit 1 when either is out of date

Every command, its summary and every option come from ``gpud.ctl.main.build_parser()`` (built from the
``COMMANDS`` table), the event kinds from ``gpud.core.vocab.EVENT_KINDS``. What completes an option's
value or a positional argument is chosen here by its ``dest`` in ``COMPLETERS``: a new option
whose dest is not there stops the generator, so nobody adds one without deciding.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

os.environ["COLUMNS"] = "80"

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpud.core.vocab import EVENT_KINDS  # noqa: E402
from gpud.ctl.commands import COMMANDS  # noqa: E402
from gpud.ctl.keys import ACTIONS as KEY_ACTIONS  # noqa: E402
from gpud.ctl.main import build_parser  # noqa: E402
from tools.generated import write_or_check  # noqa: E402

BASH = REPO / "contrib" / "completion" / "gpuctl.bash"
ZSH = REPO / "contrib" / "completion" / "_gpuctl"

# dest -> what completes its value: serve and role names (asked of gpud), event kinds, files,
# serves.toml files, a few ages, or nothing (a number).
COMPLETERS = {
    "socket": "file",
    "name": "serve",
    "serve": "serve",
    "role": "role",
    "kind": "kind",
    "file": "toml",
    "since": "since",
    "mib": "none",
    "timeout": "none",
    "interval": "none",
    "limit": "none",
    "key": "none",
    # gpuctl keys: its action, a key's name (the keys file is root's: not offered), its limits
    "action": "keyaction",
    "key_name": "none",
    "models": "none",
    "max_concurrent": "none",
    "requests_per_minute": "none",
    "tokens_per_day": "none",
    "tokens_per_month": "none",
    "priority": "none",
    "weight": "none",
    "lines": "none",  # gpuctl logs --lines N
    "window": "none",
    "level": "none",  # 1 or 2
    # gpuctl size: a checkpoint directory (or a repository id), its figures
    "model": "file",
    "hf_home": "file",
    "max_model_len": "none",
    "quantization": "none",
    "kv_cache_dtype": "none",
    "dtype": "none",
    "revision": "none",
    "context_mib": "none",
    "devices": "none",
    "vram_mib": "none",
    "concurrency": "none",
    "vllm_version": "none",  # one of gpud.core.vllm_versions.KNOWN_VERSIONS
    "device_mib": "none",
}
SINCE_HINTS = "10m 1h 2h 1d 7d"


@dataclass(frozen=True)
class Option:
    strings: tuple[str, ...]
    help: str
    completer: str | None  # None: a flag, takes no value
    repeat: bool  # may be given more than once
    many: bool  # takes one or more values (nargs="+")
    metavar: str


@dataclass(frozen=True)
class Positional:
    metavar: str
    help: str
    completer: str
    optional: bool


@dataclass(frozen=True)
class Cmd:
    name: str
    summary: str
    options: tuple[Option, ...]
    positionals: tuple[Positional, ...]


def _completer(action: argparse.Action) -> str:
    try:
        return COMPLETERS[action.dest]
    except KeyError:
        raise SystemExit(
            f"scripts/completion.py: no completer for {action.dest!r} "
            f"({'/'.join(action.option_strings) or action.metavar}): add it to COMPLETERS"
        ) from None


def _first_sentence(text: str | None) -> str:
    text = " ".join((text or "").split())
    for end in (". ", "; ", " (", ": "):
        if end in text:
            text = text.split(end, 1)[0]
    return text.rstrip(".")


def _options(parser: argparse.ArgumentParser) -> tuple[tuple[Option, ...], tuple[Positional, ...]]:
    options, positionals = [], []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            continue
        if not action.option_strings:
            positionals.append(Positional(str(action.metavar or action.dest), _first_sentence(action.help),
                                          _completer(action), action.nargs in ("?", "*")))
            continue
        takes_value = action.nargs != 0
        options.append(Option(
            strings=tuple(action.option_strings),
            help=_first_sentence(action.help),
            completer=_completer(action) if takes_value else None,
            repeat=isinstance(action, argparse._AppendAction | argparse._ExtendAction),
            many=action.nargs == "+",
            metavar=str(action.metavar or action.dest),
        ))
    return tuple(options), tuple(positionals)


def commands() -> tuple[tuple[Option, ...], tuple[Cmd, ...]]:
    """The top level's options and every command, as gpuctl's parser has them."""
    top = build_parser()
    top_options, _ = _options(top)
    subs = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    summaries = {cmd.name: cmd.summary for cmd in COMMANDS}
    cmds = []
    for name, parser in subs.choices.items():
        options, positionals = _options(parser)
        cmds.append(Cmd(name, summaries[name], options, positionals))
    return top_options, tuple(cmds)


# ---- bash ---------------------------------------------------------------------------------------

BASH_HEAD = r"""# bash completion for gpuctl, the client of gpud                    -*- shell-script -*-
# shellcheck shell=bash
#
# GENERATED by scripts/completion.py from gpuctl's parser: do not edit; run
# `python3 scripts/completion.py` after changing a command or an option.
#
# Install as /usr/share/bash-completion/completions/gpuctl (or source it from ~/.bashrc).
# Serve and role names come from the daemon itself (`gpuctl serves --names`, `gpuctl ledger`),
# over the socket named on the command line (--socket), else $GPUD_SOCKET, else the default;
# when gpud cannot be reached there is simply nothing to offer.
"""

BASH_BODY = r"""
# _gpuctl_value KIND: complete the current word as a value of that kind
_gpuctl_value() {
    local words
    case $1 in
        serve) words=$(gpuctl "${socket[@]}" serves --names 2>/dev/null) ;;
        role) words=$(gpuctl "${socket[@]}" ledger 2>/dev/null |
                      sed -n "s/^gpu_role '\([^']*\)'.*/\1/p") ;;
        kind) words=$_gpuctl_kinds ;;
        since) words=$_gpuctl_since ;;
        keyaction) words=$_gpuctl_keyactions ;;
        file) mapfile -t COMPREPLY < <(compgen -f -- "$cur"); return ;;
        toml) mapfile -t COMPREPLY < <(compgen -f -X '!*.toml' -- "$cur"; compgen -d -- "$cur")
              return ;;
        *) COMPREPLY=(); return ;;
    esac
    mapfile -t COMPREPLY < <(compgen -W "$words" -- "$cur")
}

_gpuctl() {
    local cur prev i word kind command="" positionals=0
    local -a socket=()
    cur=${COMP_WORDS[COMP_CWORD]}
    prev=${COMP_WORDS[COMP_CWORD-1]}

    # Find the command and count its positional arguments before the word being completed.
    for ((i = 1; i < COMP_CWORD; i++)); do
        word=${COMP_WORDS[i]}
        case $word in
            --socket=*) socket=("$word"); continue ;;
            -*)
                kind=$(_gpuctl_option_value "$command" "$word")
                if [[ -n $kind ]]; then
                    [[ $word == --socket ]] && socket=(--socket "${COMP_WORDS[i+1]}")
                    ((i++))
                    if [[ " $_gpuctl_many " == *" $word "* ]]; then
                        # takes one or more values: skip them all
                        while ((i + 1 < COMP_CWORD)) && [[ ${COMP_WORDS[i+1]} != -* ]]; do ((i++)); done
                    fi
                fi ;;
            *) if [[ -z $command ]]; then command=$word; else ((positionals++)); fi ;;
        esac
    done

    # the value of an option
    if [[ $prev == -* ]]; then
        kind=$(_gpuctl_option_value "$command" "$prev")
        if [[ -n $kind ]]; then _gpuctl_value "$kind"; return; fi
    fi
    # the second and later values of an option that takes several (--kind K [K ...])
    if [[ $cur != -* ]]; then
        for ((i = COMP_CWORD - 1; i > 0; i--)); do
            word=${COMP_WORDS[i]}
            [[ $word == -* ]] || continue
            if [[ " $_gpuctl_many " == *" $word "* ]]; then
                _gpuctl_value "$(_gpuctl_option_value "$command" "$word")"; return
            fi
            break
        done
    fi

    if [[ $cur == -* ]]; then
        mapfile -t COMPREPLY < <(compgen -W "$(_gpuctl_options "$command")" -- "$cur")
    elif [[ -z $command ]]; then
        mapfile -t COMPREPLY < <(compgen -W "$_gpuctl_commands" -- "$cur")
    else
        _gpuctl_value "$(_gpuctl_positional "$command" "$positionals")"
    fi
}

complete -F _gpuctl gpuctl
"""


def _bash_case(rows: list[tuple[str, str]], default: str = "") -> str:
    lines = [f"        {pattern}) echo {value} ;;" for pattern, value in rows]
    if default:
        lines.append(f"        *) echo {default} ;;")
    return "\n".join(lines)


def render_bash() -> str:
    top, cmds = commands()
    option_rows = [('""', _words(o for o in top))]
    option_rows += [(c.name, _words(c.options)) for c in cmds]
    value_rows: list[tuple[str, str]] = []
    many: set[str] = set()
    for cname, opts in [("", top), *((c.name, c.options) for c in cmds)]:
        for opt in opts:
            if opt.completer is None:
                continue
            for s in opt.strings:
                value_rows.append((f'"{cname}:{s}"', opt.completer))
                if opt.many:
                    many.add(s)
    positional_rows = [(f'"{c.name}:{i}"', p.completer) for c in cmds for i, p in enumerate(c.positionals)]
    parts = [
        BASH_HEAD,
        f'_gpuctl_commands="{" ".join(c.name for c in cmds)}"',
        f'_gpuctl_kinds="{" ".join(EVENT_KINDS)}"',
        f'_gpuctl_keyactions="{" ".join(KEY_ACTIONS)}"',
        f'_gpuctl_since="{SINCE_HINTS}"',
        "# options that take one or more values",
        f'_gpuctl_many="{" ".join(sorted(many))}"',
        "",
        "# _gpuctl_options COMMAND: the options of COMMAND (\"\": before the command)",
        "_gpuctl_options() {",
        '    case $1 in',
        _bash_case([(pattern, f'"{words}"') for pattern, words in option_rows]),
        "    esac",
        "}",
        "",
        "# _gpuctl_option_value COMMAND OPTION: what completes the option's value; nothing: a flag",
        "_gpuctl_option_value() {",
        '    case "$1:$2" in',
        _bash_case(value_rows),
        "    esac",
        "}",
        "",
        "# _gpuctl_positional COMMAND N: what completes the command's Nth positional argument (from 0)",
        "_gpuctl_positional() {",
        '    case "$1:$2" in',
        _bash_case(positional_rows, default="none"),
        "    esac",
        "}",
        BASH_BODY,
    ]
    return "\n".join(parts)


def _words(options: object) -> str:
    return " ".join(s for o in options for s in o.strings)  # type: ignore[attr-defined]


# ---- zsh ----------------------------------------------------------------------------------------

ZSH_HEAD = r"""#compdef gpuctl
# zsh completion for gpuctl, the client of gpud.
#
# GENERATED by scripts/completion.py from gpuctl's parser: do not edit; run
# `python3 scripts/completion.py` after changing a command or an option.
#
# Install into a directory on $fpath (e.g. /usr/share/zsh/vendor-completions/_gpuctl).
# Serve and role names come from the daemon itself (`gpuctl serves --names`, `gpuctl ledger`),
# over the socket named on the command line (--socket), else $GPUD_SOCKET, else the default;
# when gpud cannot be reached there is simply nothing to offer.

_gpuctl_serves() {
  local -a names
  names=(${(f)"$(_call_program serves gpuctl $_gpuctl_socket serves --names 2>/dev/null)"})
  _wanted serves expl 'serve' compadd -a names
}

_gpuctl_roles() {
  local -a roles
  roles=(${(f)"$(_call_program roles gpuctl $_gpuctl_socket ledger 2>/dev/null |
                 sed -n "s/^gpu_role '\([^']*\)'.*/\1/p")"})
  _wanted roles expl 'role' compadd -a roles
}
"""


def _zsh_quote(text: str) -> str:
    return text.replace("'", "'\\''")


def _zsh_help(text: str) -> str:
    return _zsh_quote(text.replace("[", "\\[").replace("]", "\\]").replace(":", "\\:"))


def _zsh_action(completer: str, many: bool) -> str:
    if completer == "kind":
        kinds = " ".join(EVENT_KINDS)
        # comma-separated (K1,K2) as gpuctl accepts them, or one per word
        return f"_sequence compadd - {kinds}"
    return {
        "serve": "_gpuctl_serves",
        "role": "_gpuctl_roles",
        "file": "_files",
        "toml": "_files -g \"*.toml\"",
        "since": f"({SINCE_HINTS})",
        "keyaction": f"({' '.join(KEY_ACTIONS)})",
        "none": " ",
    }[completer]


def _zsh_option(opt: Option) -> list[str]:
    help_text = _zsh_help(opt.help)
    value = ""
    if opt.completer is not None:
        value = f":{_zsh_help(opt.metavar.lower())}:{_zsh_quote(_zsh_action(opt.completer, opt.many))}"
    if len(opt.strings) > 1:
        excl = " ".join(opt.strings)
        if opt.strings == ("-h", "--help"):
            excl = "- *"
        return [f"'({excl})'{{{','.join(opt.strings)}}}'{'=' if value else ''}[{help_text}]{value}'"]
    prefix = "*" if opt.repeat or opt.many else ""
    eq = "=" if value else ""
    return [f"'{prefix}{opt.strings[0]}{eq}[{help_text}]{value}'"]


def render_zsh() -> str:
    top, cmds = commands()
    lines = [ZSH_HEAD, "_gpuctl() {",
             '  local curcontext="$curcontext" state line ret=1',
             "  local -a _gpuctl_socket",
             "  typeset -A opt_args",
             "",
             "  _arguments -C \\"]
    for opt in top:
        lines += [f"    {spec} \\" for spec in _zsh_option(opt)]
    lines += ["    '1:command:->command' \\", "    '*::argument:->argument' && ret=0", "",
              "  [[ -n ${opt_args[--socket]} ]] && _gpuctl_socket=(--socket ${opt_args[--socket]})",
              "", "  case $state in", "    command)", "      local -a commands", "      commands=("]
    lines += [f"        '{c.name}:{_zsh_quote(c.summary.replace(':', chr(92) + ':'))}'" for c in cmds]
    lines += ["      )", "      _describe -t commands 'gpuctl command' commands && ret=0", "      ;;",
              "    argument)", '      curcontext="${curcontext%:*:*}:gpuctl-$words[1]:"',
              "      case $words[1] in"]
    for c in cmds:
        specs = [s for o in c.options for s in _zsh_option(o)]
        for i, p in enumerate(c.positionals, start=1):
            colon = "::" if p.optional else ":"
            specs.append(f"'{i}{colon}{_zsh_help(p.metavar.lower())}:"
                         f"{_zsh_quote(_zsh_action(p.completer, False))}'")
        lines.append(f"        {c.name})")
        lines.append("          _arguments \\")
        lines += [f"            {spec} \\" for spec in specs[:-1]]
        lines.append(f"            {specs[-1]} && ret=0 ;;")
    lines += ["      esac", "      ;;", "  esac", "  return ret", "}", "", '_gpuctl "$@"', ""]
    return "\n".join(lines)


def main() -> int:
    return write_or_check({BASH: render_bash(), ZSH: render_zsh()}, "scripts/completion.py")


if __name__ == "__main__":
    sys.exit(main())
