"""gpuctl's entry point: the parser built from the command table, and ``main``.

``main`` turns arguments into one command's run and its outcome into an exit code (see
gpud.ctl.errors); it talks to gpud through the socket named by --socket, $GPUD_SOCKET or the
default, unless a transport is passed in (tests).
"""

from __future__ import annotations

import os
import sys

from gpud.core.text import printable
from gpud.ctl.arguments import positive_float
from gpud.ctl.client import Client, UnixTransport
from gpud.ctl.commands import COMMANDS, Ctl
from gpud.ctl.errors import (
    EXIT_BROKEN_PIPE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    CtlError,
    usage_error,
)
from gpud.ctl.format import dump_json, format_error

# Not ``typing.TYPE_CHECKING``: importing typing costs startup time. mypy treats any name
# TYPE_CHECKING as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from collections.abc import Mapping, Sequence
    from typing import Any

    from gpud.ctl.client import Transport

class Escaped:
    """A text stream whose every write passes through gpud.core.text.printable: what gpuctl
    prints holds text that came from peers (serve names in errors, an apply's source label,
    event messages), and no control character of theirs reaches the terminal. gpuctl's own
    control sequences (ledger --watch clears the screen) go to `unescaped`."""

    def __init__(self, stream: Any, *, json: bool = False) -> None:
        self.unescaped = stream
        self.json = json

    def write(self, text: str) -> int:
        return int(self.unescaped.write(printable(text, json=self.json)))

    def flush(self) -> None:
        self.unescaped.flush()

    def isatty(self) -> bool:
        return bool(self.unescaped.isatty())

    def fileno(self) -> int:
        return int(self.unescaped.fileno())


DEFAULT_SOCKET = "/run/gpud/gpud.sock"
SOCKET_ENV = "GPUD_SOCKET"


DESCRIPTION = """\
gpuctl talks to gpud, the daemon that owns the GPU-memory ledger of this host: which model serve
holds how many MiB on which GPU role, what is free, and what the devices really draw.

Answers are printed for people by default; --json prints the daemon's JSON answer instead (on
failure, its error object), for scripts. The exit code says how it went either way."""

EPILOG = """\
socket:
  --socket PATH, else $GPUD_SOCKET, else /run/gpud/gpud.sock. Reading needs access to the
  socket (group gpud); changing the ledger needs root or the admin group.

exit status:
  0  ok
  1  denied, refused, forbidden, conflict, unavailable, or a daemon fault
  2  usage or bad input (also an unknown serve or role)
  3  gpud cannot be reached (not running, or no permission on its socket)

examples:
  gpuctl ledger
  gpuctl admit ocr 5120
  gpuctl serves ocr
  gpuctl events --serve ocr --kind deny --since 1d

Run `gpuctl COMMAND --help` for each command."""

SUB_EPILOG = """\
options --socket, --json and --timeout may also be given before COMMAND.
exit status: 0 ok, 1 refused, 2 usage or bad input, 3 gpud unreachable."""


class UsageError(Exception):
    def __init__(self, usage: str, prog: str, message: str) -> None:
        super().__init__(message)
        self.usage = usage
        self.prog = prog
        self.message = message


def _add_common(p: argparse.ArgumentParser, suppress: bool) -> None:
    import argparse

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    p.add_argument("--socket", metavar="PATH", default=default(None),
                   help=f"gpud's socket (default: ${SOCKET_ENV}, else {DEFAULT_SOCKET})")
    p.add_argument("--json", action="store_true", default=default(False),
                   help="print the daemon's JSON answer (or error) instead of text")
    p.add_argument("--timeout", type=positive_float, metavar="S", default=default(None),
                   help="seconds to wait for an answer (default: 30 for reads, 120 for "
                        "changes, 600 for start, stop and restart)")


def command_named(argv: Sequence[str]) -> str | None:
    """The command ``argv`` runs when only global options precede it, else None.

    Building the parsers of all commands costs more than the rest of a ``gpuctl status`` run
    (argparse looks up translations and the terminal size for every option), so ``main`` builds
    only the one it needs. Anything unusual before the command (--help, an abbreviated option)
    answers None, and the whole tree is built.
    """
    names = {cmd.name for cmd in COMMANDS}
    i = 0
    while i < len(argv):
        token = argv[i]
        if token in ("--socket", "--timeout"):
            i += 2
        elif token == "--json" or token.startswith(("--socket=", "--timeout=")):
            i += 1
        elif token == "--":
            return argv[i + 1] if i + 1 < len(argv) and argv[i + 1] in names else None
        else:
            return token if token in names else None
    return None


def terminal_width() -> int:
    """$COLUMNS, else the width of the terminal on stdout, else 80 (as shutil decides)."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    stream = sys.__stdout__
    try:
        return (os.get_terminal_size(stream.fileno()).columns or 80) if stream else 80
    except (AttributeError, ValueError, OSError):
        return 80


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """gpuctl's parser; with ``only``, that command's alone (the rest are left out)."""
    import argparse

    from gpud import __version__

    class Parser(argparse.ArgumentParser):
        def error(self, message: str) -> Any:
            raise UsageError(self.format_usage(), self.prog, message)

    class Formatter(argparse.RawDescriptionHelpFormatter):
        # argparse asks shutil for the terminal width, and importing shutil costs a tenth of
        # gpuctl's start: ask os, which shutil asks too.
        def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                     width: int | None = None) -> None:
            super().__init__(prog, indent_increment, max_help_position,
                             width if width is not None else terminal_width() - 2)

        # Fill plain paragraphs to the terminal; keep paragraphs with line breaks (examples,
        # tables) as written.
        def _fill_text(self, text: str, width: int, indent: str) -> str:
            import textwrap

            return "\n\n".join(
                para if "\n" in para or para.startswith(" ")
                else textwrap.fill(para, width, initial_indent=indent, subsequent_indent=indent)
                for para in text.split("\n\n"))

    fmt = Formatter
    parser = Parser(prog="gpuctl", description=DESCRIPTION, epilog=EPILOG, formatter_class=fmt)
    _add_common(parser, suppress=False)
    parser.add_argument("--version", action="version", version=f"gpuctl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                title="commands")
    for cmd in COMMANDS:
        if only is not None and cmd.name != only:
            continue
        p = sub.add_parser(cmd.name, help=cmd.summary, description=cmd.description,
                           epilog=f"examples:\n{cmd.examples}\n\n{SUB_EPILOG}",
                           formatter_class=fmt)
        cmd.configure(p)
        _add_common(p, suppress=True)  # per-command position; the global one stays otherwise
        p.set_defaults(run=cmd.run)
    return parser


def resolve_socket(option: str | None, environ: Mapping[str, str]) -> str:
    return option or environ.get(SOCKET_ENV) or DEFAULT_SOCKET


def main(argv: list[str] | None = None, transport: Transport | None = None) -> int:
    """Run gpuctl with ``argv`` (default: the process's arguments); return the exit code.

    ``transport``, when given, carries every request instead of the socket (--socket is then
    not used).
    """
    args_in = sys.argv[1:] if argv is None else list(argv)
    wants_json = "--json" in args_in
    out: Any = Escaped(sys.stdout, json=wants_json)
    err: Any = Escaped(sys.stderr)
    try:
        try:
            args = build_parser(command_named(args_in)).parse_args(args_in)
        except UsageError as exc:
            err.write(f"{exc.usage}{exc.prog}: error: {exc.message}\n")
            if wants_json:
                print(dump_json(usage_error(exc.message).to_json()), file=out)
            return EXIT_USAGE
        except SystemExit as exc:  # --help, --version
            return exc.code if isinstance(exc.code, int) else EXIT_OK
        if transport is None:
            transport = UnixTransport(resolve_socket(args.socket, os.environ))
        client = Client(transport, args.timeout)
        out.json = bool(args.json)
        ctl = Ctl(client, bool(args.json), out, err)
        try:
            code: int = args.run(ctl, args)
            return code
        except CtlError as exc:
            if ctl.as_json:
                print(dump_json(exc.to_json(), compact=ctl.ndjson), file=out, flush=True)
            else:
                print(format_error(exc), file=err, flush=True)
            return exc.exit_code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (gpuctl events | head). Point stdout at /dev/null so that the
        # interpreter's final flush does not complain a second time.
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass  # stdout without a file descriptor: nothing will flush into the pipe
        finally:
            os.close(devnull)
        return EXIT_BROKEN_PIPE
