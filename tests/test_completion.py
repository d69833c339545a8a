"""gpuctl's bash and zsh completion, generated from its parser, asked through real bash and zsh.

The generator (scripts/completion.py) reads gpuctl's parser; these tests read the parser too and
ask the shells what they offer, so a command or an option added to gpuctl without regenerating
the completion fails here (as does a generator that drops one).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

import pytest

from gpud.core.vocab import EVENT_KINDS
from gpud.ctl.commands import COMMANDS
from gpud.ctl.main import build_parser
from tests.conftest import REPO

BASH = REPO / "contrib" / "completion" / "gpuctl.bash"
ZSH = REPO / "contrib" / "completion" / "_gpuctl"
BASH_COMPLETION = "/usr/share/bash-completion/bash_completion"


def shell(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing: scripts/setup-test installs it")
        pytest.skip(f"{name} is missing: run scripts/setup-test")
    return found


def parser_tree() -> tuple[set[str], dict[str, argparse.ArgumentParser]]:
    top = build_parser()
    subs = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    top_options = {s for a in top._actions for s in a.option_strings}
    return top_options, dict(subs.choices)


def options_of(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def test_completion_files_are_current() -> None:
    result = subprocess.run([sys.executable, "scripts/completion.py", "--check"], cwd=REPO,
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


BASH_DRIVER = r"""
source "$1"; source "$2"; shift 2
# each argument: one command line, words separated by spaces, the last one being completed
for line in "$@"; do
    read -ra COMP_WORDS <<< "$line"
    [[ $line == *" " ]] && COMP_WORDS+=("")
    COMP_CWORD=$((${#COMP_WORDS[@]} - 1)); COMPREPLY=()
    _gpuctl
    printf '%s\t%s\n' "$line" "${COMPREPLY[*]}"
done
"""


def bash_complete(*lines: str) -> dict[str, set[str]]:
    out = subprocess.run(
        [shell("bash"), "--norc", "--noprofile", "-c", BASH_DRIVER, "bash", BASH_COMPLETION, str(BASH),
         *lines],
        capture_output=True, text=True, timeout=60, check=True,
        env={"PATH": "/nowhere", "HOME": "/nonexistent"},  # no gpuctl: no names from a daemon
    ).stdout
    answers = {}
    for row in out.splitlines():
        line, _, words = row.partition("\t")
        answers[line] = set(words.split())
    assert set(answers) == set(lines), out
    return answers


def test_bash_offers_every_command_and_option() -> None:
    if not os.path.exists(BASH_COMPLETION):
        if os.environ.get("CI"):
            pytest.fail("bash-completion is missing: scripts/setup-test installs it")
        pytest.skip("bash-completion is missing: run scripts/setup-test")
    top_options, commands = parser_tree()
    lines = ["gpuctl ", "gpuctl -", *(f"gpuctl {name} -" for name in commands),
             "gpuctl events --kind ", "gpuctl events --kind deny ", "gpuctl --socket /x st"]
    got = bash_complete(*lines)
    assert got["gpuctl "] == set(commands)
    assert got["gpuctl -"] == top_options
    for name, sub in commands.items():
        assert got[f"gpuctl {name} -"] == options_of(sub), name
    assert got["gpuctl events --kind "] == set(EVENT_KINDS)
    assert got["gpuctl events --kind deny "] == set(EVENT_KINDS)
    assert got["gpuctl --socket /x st"] == {"status", "start", "stop"}


# zsh's completion system needs a terminal to drive; instead _arguments and _describe are
# stubbed, so that sourcing _gpuctl prints what it hands them: the commands with their
# descriptions, and each command's _arguments specs (zsh itself expands the {-f,--follow} braces).
SPEC_OPTION = re.compile(r"^(?:\([^)]*\))?\*?(--?[a-z][-a-z]*)")


def test_zsh_describes_every_command_and_option() -> None:
    zsh = shell("zsh")
    assert subprocess.run([zsh, "-n", str(ZSH)], capture_output=True, check=False).returncode == 0
    _, commands = parser_tree()
    # top level: state "command" describes the commands
    out = subprocess.run(
        [zsh, "-f", "-c",
         '_arguments() { print -rl -- "== top" "${@:#-C}"; state=command }\n'
         '_describe() { print -rl -- "== commands" "${(@P)4}" }\n'
         'source $1', "zsh", str(ZSH)],
        capture_output=True, text=True, timeout=60, check=True).stdout
    top_specs, _, described_text = out.partition("== commands\n")
    described = described_text.splitlines()
    expected = [f"{c.name}:{c.summary}" for c in COMMANDS]
    assert [d.replace("\\:", ":") for d in described] == expected
    assert {c.name for c in COMMANDS} == set(commands)
    top_options, _ = parser_tree()
    assert {m.group(1) for s in top_specs.splitlines() if (m := SPEC_OPTION.match(s))} == top_options
    # each command: state "argument" with words=(COMMAND) hands _arguments the command's specs
    for name, sub in commands.items():
        out = subprocess.run(
            [zsh, "-f", "-c",
             'first=1\n'
             '_arguments() { if ((first)); then first=0; state=argument; else print -rl -- "$@"; fi }\n'
             '_describe() { }\n'
             'words=($2); source $1', "zsh", str(ZSH), name],
            capture_output=True, text=True, timeout=60, check=True).stdout
        specs = out.splitlines()
        offered = {m.group(1) for s in specs if (m := SPEC_OPTION.match(s))}
        assert offered == options_of(sub), name
        positionals = [a for a in sub._actions if not a.option_strings]
        assert len([s for s in specs if re.match(r"^\d+:", s)]) == len(positionals), (name, specs)
        if name == "events":
            kind = next(s for s in specs if s.startswith("*--kind="))
            assert set(kind.split("compadd - ", 1)[1].split()) == set(EVENT_KINDS)
