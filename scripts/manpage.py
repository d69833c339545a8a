#!/usr/bin/env python3
"""Write docs/gpuctl.1 and docs/gpud.8 from the programs' own parsers and help texts (so the
pages cannot drift from --help), and gpud(8)'s [daemon] keys from the config model.

    python3 scripts/manpage.py            # rewrite both pages
    python3 scripts/manpage.py --check    # exit 1 when either is out of date

Both pass `mandoc -T lint` and render within 80 columns (tests/test_manpage.py checks).
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

# argparse wraps usage lines to the terminal: pin it so the pages are stable, and narrow enough
# that a usage block still fits 80 columns inside man's indentation of 7
os.environ["COLUMNS"] = "72"

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpud import __version__, daemon  # noqa: E402
from gpud.config import DaemonConfig, RoleConfig, ServeConfig  # noqa: E402
from gpud.ctl import commands as ctl_commands  # noqa: E402
from gpud.ctl import main as ctl_main  # noqa: E402
from tools.generated import write_or_check  # noqa: E402

# The date in .TH: when the pages' content last changed in substance. Bump it with them.
DATE = "2026-12-01"
SOURCE = f"gpud {__version__}"
MANUAL = "gpud manual"
GPUCTL = REPO / "docs" / "gpuctl.1"
GPUD = REPO / "docs" / "gpud.8"
COMMON = {"--socket", "--json", "--timeout", "-h", "--help"}


# man indents body text by 7 columns; a page must read on an 80-column terminal
BODY_WIDTH = 80 - 7


def esc(text: str) -> str:
    """One line of text for roff: backslashes and hyphens escaped, no control character first."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    if text.startswith((".", "'")):
        text = "\\&" + text
    return text


def filled(text: str) -> list[str]:
    """Text the formatter fills, as source lines of at most 79 bytes (mandoc's style)."""
    words = " ".join(text.split())
    return [esc(line) for line in textwrap.wrap(words, 70, break_long_words=False,
                                                break_on_hyphens=False)]


def source_lines(parts: list[str]) -> str:
    """The page: text lines outside .nf blocks (already roff) rewrapped to at most 79 bytes."""
    out: list[str] = []
    nofill = False
    for line in parts:
        if line.startswith(".nf"):
            nofill = True
        elif line.startswith(".fi"):
            nofill = False
        if nofill or line.startswith((".", "'")) or len(line) < 80:
            out.append(line)
            continue
        out += textwrap.wrap(line, 79, break_long_words=False, break_on_hyphens=False)
    return "\n".join(out) + "\n"


def _fit(line: str, width: int) -> list[str]:
    """A verbatim line too wide for the page, broken after a comma or a space, continued with
    two more spaces of indentation."""
    out = []
    indent = len(line) - len(line.lstrip())
    while len(line) > width:
        cut = max(line.rfind(", ", indent + 1, width - 1) + 1, line.rfind(" ", indent + 1, width))
        if cut <= indent:
            break
        out.append(line[:cut].rstrip())
        line = " " * (indent + 2) + line[cut:].lstrip()
    return [*out, line]


def verbatim(text: str, indent: int = 0) -> list[str]:
    lines = [".nf"]
    if indent:
        lines.append(f".RS {indent}")
    for line in textwrap.dedent(text.rstrip("\n")).splitlines():
        lines += [esc(part) for part in _fit(line, BODY_WIDTH - indent)]
    if indent:
        lines.append(".RE")
    return [*lines, ".fi"]


def paragraphs(text: str, first: bool = False) -> list[str]:
    """Plain paragraphs filled by the formatter; paragraphs laid out by hand kept as written.
    ``first``: right after a section heading, which already starts a paragraph."""
    out: list[str] = []
    for para in text.strip().split("\n\n"):
        if out or not first:
            out.append(".PP")
        if para.startswith(" ") or any(line.startswith(" ") for line in para.splitlines()):
            out += verbatim(para)
        else:
            out += filled(para)
    return out


def option_entry(action: argparse.Action) -> list[str]:
    names = ", ".join(f"\\fB{esc(s)}\\fR" for s in action.option_strings)
    if action.nargs != 0:
        meta = action.metavar or (("{" + ",".join(action.choices) + "}") if action.choices
                                  else action.dest.upper())
        names += f" \\fI{esc(str(meta))}\\fR"
    help_text = (action.help or "").replace("%(default)s", str(action.default))
    return [".TP", names, *filled(help_text)]


def usage(parser: argparse.ArgumentParser) -> list[str]:
    text = parser.format_usage().strip()
    return verbatim(text[len("usage: "):] if text.startswith("usage: ") else text)


def header(name: str, section: int, summary: str) -> list[str]:
    return [f'.TH {name.upper()} {section} {DATE} "{SOURCE}" "{MANUAL}"',
            ".SH NAME", f"{name} \\- {esc(summary)}"]


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(subs.choices)


def render_gpuctl() -> str:
    parser = ctl_main.build_parser()
    commands = subparsers(parser)
    parts = header("gpuctl", 1, "the command-line client of gpud, the GPU-memory ledger of this host")
    parts += [".SH SYNOPSIS", ".B gpuctl",
              "[\\fB\\-\\-socket\\fR \\fIPATH\\fR] [\\fB\\-\\-json\\fR] [\\fB\\-\\-timeout\\fR "
              "\\fIS\\fR] \\fICOMMAND\\fR [\\fIARGS\\fR]",
              ".SH DESCRIPTION", *paragraphs(ctl_main.DESCRIPTION, first=True)]
    parts += [".PP", "Commands:", ".RS 4", ".PD 0"]
    for cmd in ctl_commands.COMMANDS:
        parts += [".TP 12", f"\\fB{cmd.name}\\fR", esc(cmd.summary)]
    parts += [".PD", ".RE", ".SH OPTIONS",
              "These may be given before or after \\fICOMMAND\\fR."]
    for action in parser._actions:
        if action.option_strings:
            parts += option_entry(action)
    parts.append(".SH COMMANDS")
    for cmd in ctl_commands.COMMANDS:
        sub = commands[cmd.name]
        parts += [f".SS {cmd.name}", *usage(sub), *paragraphs(cmd.description)]
        own = [a for a in sub._actions if not set(a.option_strings) & COMMON]
        if own:
            parts += [".PP", "Arguments and options:"]
            for action in own:
                if action.option_strings:
                    parts += option_entry(action)
                else:
                    parts += [".TP", f"\\fI{esc(str(action.metavar or action.dest))}\\fR",
                              *filled(action.help or "")]
        parts += [".PP", "Examples:", *verbatim(cmd.examples.strip("\n"), indent=4)]
    parts += [
        ".SH EXIT STATUS",
        ".TP", "0", "ok",
        ".TP", "1", "denied, refused, forbidden, conflict, unavailable, or a daemon fault",
        ".TP", "2", "usage or bad input (also an unknown serve or role)",
        ".TP", "3", "gpud cannot be reached (not running, or no permission on its socket)",
        ".SH ENVIRONMENT",
        ".TP", f"\\fB{ctl_main.SOCKET_ENV}\\fR",
        f"gpud's socket when \\fB\\-\\-socket\\fR is not given (default: "
        f"\\fI{esc(ctl_main.DEFAULT_SOCKET)}\\fR).",
        ".TP", "\\fBCOLUMNS\\fR", "The width help texts and tables are laid out for.",
        ".SH FILES",
        ".TP", f"\\fI{esc(ctl_main.DEFAULT_SOCKET)}\\fR",
        "gpud's API socket (mode 0660, group \\fBgpud\\fR): members of group \\fBgpud\\fR may "
        "read; root and the configured admin group (\\fBgpud\\-admin\\fR) may change the ledger.",
        ".TP", "\\fI/etc/gpud/serves.toml\\fR",
        "gpud's configuration, which \\fBplan\\fR and \\fBapply\\fR compare a new one against.",
        ".TP", "\\fI/usr/share/bash\\-completion/completions/gpuctl\\fR, "
        "\\fI/usr/share/zsh/vendor\\-completions/_gpuctl\\fR",
        "Completion for bash and zsh.",
        ".SH SEE ALSO",
        ".BR gpud (8),",
        ".BR systemctl (1),",
        ".BR journalctl (1)",
    ]
    return source_lines(parts)


def _field_default(field: Any) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


def _keys(model: type[Any]) -> list[str]:
    """The table's keys with their defaults, as TOML would write them."""
    rows = []
    for name, field in model.model_fields.items():
        default = _field_default(field)
        rows.append(f"# {name} = ...   (required)" if default == "required" else
                    f"# {name} = {default}" if default == "unset" else f"{name} = {default}")
    return verbatim("\n".join(rows), indent=4)


def render_gpud() -> str:
    parser = daemon.build_parser()
    parts = header("gpud", 8, "the GPU-memory ledger daemon of a host that runs model serves")
    parts += [".SH SYNOPSIS", *usage(parser), ".SH DESCRIPTION"]
    parts += paragraphs(
        "gpud owns the GPU-memory ledger of this host: which model serve (vLLM and similar) holds "
        "how many MiB on which GPU role. It admits or denies each reservation with the bound that "
        "failed, launches admitted serves as transient systemd units (gpud-serve-NAME.service in "
        "gpud.slice) over the system bus, starts the resident set at boot (one start at a time "
        "per device), watches NVML for memory nobody declared, and records every event in SQLite "
        "and journald. Clients talk to it over HTTP and JSON on a Unix socket; gpuctl(1) is its "
        "command-line client.\n\n"
        "It runs in the foreground, normally as gpud.service (Type=notify: READY=1 once the API "
        "listens and the running serves are adopted; WATCHDOG=1 while it works). Without a "
        "reachable system bus launching is unavailable (a clear 503 on start) and the ledger "
        "still works; without NVML it admits on the ledger bound alone and says so.", first=True)
    parts.append(".SH OPTIONS")
    for action in parser._actions:
        if action.option_strings:
            parts += option_entry(action)
    parts += [".SH CONFIGURATION"]
    parts += paragraphs(
        "The configuration is TOML (default /etc/gpud/serves.toml), refused when group or others "
        "may write it. Unknown keys are errors, and every error names its key path "
        "(serves.ocr.vram_mib: must be > 0). The tables are [daemon], [roles.NAME] (a named use "
        "of one device), [serves.NAME] (with a [serves.NAME.vllm] table or a command argv) and "
        "[simulation] for machines without a GPU. An annotated example ships as "
        "/etc/gpud/serves.toml; the API is described in /usr/share/doc/gpud/api.md.", first=True)
    parts += [".PP", "The keys and their defaults (# unset: no default):"]
    parts += [".SS [daemon]", *_keys(DaemonConfig),
              ".SS [roles.NAME]", *_keys(RoleConfig),
              ".SS [serves.NAME]", *_keys(ServeConfig)]
    parts += paragraphs(
        "serves.NAME.front unset is on for a serve with a sleep_level or on_demand that has a "
        "port: vLLM's dev routes, which sleep opens, then reach no one but gpud and the front "
        "(nginx, gpud-front.service), and the serve listens on its socket (vllm serve --uds, in "
        "a container too; {socket} in a command or container.args). front = false keeps a "
        "sleeping serve on its port, warned about by --check-config (docs/front.md in the "
        "source).")
    parts += paragraphs(
        "History is kept as configured: the store keeps the newest daemon.events_keep events "
        "(pruned after every twentieth of it, so at most about 5% more), and an apply keeps the "
        "newest daemon.backups_keep backups of the config file under backups/ beside it (its "
        "former name config_backups is still read). An apply that changes nothing (the text "
        "gpud runs, which the file already holds) writes no backup.")
    parts += [
        ".SH SIGNALS",
        ".TP", "\\fBSIGTERM\\fR, \\fBSIGINT\\fR",
        "Stop: close the API, finish the transaction in progress and exit 0. The serves are units "
        "of their own and keep running; the next gpud adopts them.",
        ".TP", "\\fBSIGHUP\\fR",
        "Re-read the configuration (systemctl reload gpud). A configuration that is invalid, or "
        "whose reservations cannot hold, is refused whole and the running one is kept. A SIGHUP "
        "during start-up waits until gpud is ready.",
        ".SH SOCKET",
        "The API listens on \\fBdaemon.socket\\fR (default \\fI/run/gpud/gpud.sock\\fR), mode 0660, "
        "group \\fBdaemon.socket_group\\fR (\\fBgpud\\fR). Under gpud.socket it takes the listening "
        "socket from systemd (LISTEN_FDS) instead of binding it. Every request is authorized by "
        "the peer's credentials (SO_PEERCRED): anyone who can open the socket may read; changes "
        "need uid 0 or \\fBdaemon.admin_group\\fR. "
        "\\fBcurl \\-\\-unix\\-socket /run/gpud/gpud.sock http://localhost/v1/ledger\\fR works. "
        "A request's headers must arrive within \\fBdaemon.request_read_timeout_s\\fR "
        "(10 s) of its first byte and its body within as long of the start of its handling, "
        "whoever the peer: later headers close the connection, a later body is answered 408. "
        "Each peer may have 2 plans, applies or reloads under way; one more is answered 429. "
        "\\fBdaemon.metrics_listen\\fR (e.g. 127.0.0.1:9835) adds a TCP listener that serves only "
        "/metrics (Prometheus text).",
        ".SH EXIT STATUS",
        ".TP", "0", "stopped by a signal, or \\fB\\-\\-check\\-config\\fR found the file valid",
        ".TP", "1", "gpud cannot run: another gpud already answers on the socket, permission denied, or "
        "another fault it cannot recover from",
        ".TP", "2", "usage, or the configuration is invalid",
        ".SH ENVIRONMENT",
        ".TP", "\\fBNOTIFY_SOCKET\\fR, \\fBWATCHDOG_USEC\\fR",
        "Set by systemd: readiness, status and watchdog notifications are sent there.",
        ".TP", "\\fBLISTEN_FDS\\fR, \\fBLISTEN_PID\\fR",
        "Set by systemd under gpud.socket: the API socket is inherited.",
        ".TP", "\\fBJOURNAL_STREAM\\fR",
        "Set by systemd: with \\fB\\-\\-log\\-target auto\\fR, log to journald with structured "
        "fields (GPUD_EVENT, GPUD_SERVE, GPUD_ROLE, GPUD_MIB).",
        ".TP", "\\fBDBUS_SYSTEM_BUS_ADDRESS\\fR",
        "The system bus, where serves are launched (default: /run/dbus/system_bus_socket).",
        ".SH FILES",
        ".TP", "\\fI/etc/gpud/serves.toml\\fR", "the configuration (0600 root)",
        ".TP", "\\fI/etc/gpud/backups/\\fR", "configurations replaced by \\fBgpuctl apply\\fR",
        ".TP", "\\fI/var/lib/gpud/\\fR",
        "the SQLite ledger, events and calibrations",
        ".TP", "\\fI/run/gpud/gpud.sock\\fR", "the API socket",
        ".TP", "\\fI/lib/systemd/system/gpud.service\\fR, \\fIgpud.socket\\fR, \\fIgpud.slice\\fR",
        "the units",
        ".SH EXAMPLES",
        *verbatim("gpud --check-config /etc/gpud/serves.toml\n"
                  "systemctl enable --now gpud\n"
                  "journalctl -u gpud GPUD_SERVE=ocr GPUD_EVENT=deny", indent=4),
        ".SH SEE ALSO",
        ".BR gpuctl (1),",
        ".BR systemctl (1),",
        ".BR journalctl (1),",
        ".BR systemd.unit (5)",
    ]
    return source_lines(parts)


def main() -> int:
    return write_or_check({GPUCTL: render_gpuctl(), GPUD: render_gpud()}, "scripts/manpage.py")


if __name__ == "__main__":
    sys.exit(main())
