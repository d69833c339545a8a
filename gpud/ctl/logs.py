"""``gpuctl logs NAME``: a serve's own journal (its unit gpud-serve-NAME.service, where systemd
puts what the serve writes), shown by journalctl run as gpuctl's own user.

Not through gpud: gpud reads the journal as root, and a route that handed its lines to whoever
may open the socket would lend them root's rights. journalctl, run as the reader, shows what the
reader may see; a reader who may not read the system journal (not root, not in group
systemd-journal or adm, as journald's file ACLs say) gets that said plainly, instead of
journalctl's empty answer. It works while gpud is down, when the logs matter most.
"""

from __future__ import annotations

import os

from gpud.core.vocab import NAME_RE, serve_unit
from gpud.ctl.errors import EXIT_REFUSED, CtlError, usage_error

TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence
    from typing import Any

# Where journald keeps the system journal: persistent, else volatile (systemd-journald.service(8)).
JOURNAL_DIRS = ("/var/log/journal", "/run/log/journal")


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", metavar="NAME", help="the serve, as named in serves.toml")
    p.add_argument("-f", "--follow", action="store_true",
                   help="keep printing new lines as the serve writes them, until Ctrl-C")
    p.add_argument("--since", metavar="T",
                   help="from T on: ISO 8601 (local time unless an offset is given), epoch "
                        "seconds, or an age such as 10m, 2h, 1d")
    p.add_argument("-n", "--lines", type=int, metavar="N",
                   help="the last N lines only (default: all, or 10 with --follow)")


def journal_argv(name: str, *, follow: bool = False, since: float | None = None,
                 lines: int | None = None, as_json: bool = False) -> list[str]:
    """journalctl's argv for serve NAME's journal (a usage error for a name that is no
    serve's)."""
    if not NAME_RE.match(name):
        raise usage_error(f"{name!r} is not a serve name (lowercase letters, digits, _ and -)",
                          serve=name)
    argv = ["journalctl", "--unit", serve_unit(name)]
    if since is not None:
        argv += ["--since", f"@{int(since)}"]  # systemd.time(7): seconds since the epoch
    if lines is not None:
        if lines < 0:
            raise usage_error(f"--lines must be 0 or more, got {lines}")
        argv += ["--lines", str(lines)]
    if follow:
        argv.append("--follow")
    if as_json:
        argv += ["--output", "json"]
    return argv


def may_read_system_journal(dirs: Sequence[str] = JOURNAL_DIRS) -> bool | None:
    """Whether this process may read the system journal's files (their ACLs give groups
    systemd-journal and adm read access); None when there are none to ask (no journald here:
    journalctl says what it finds)."""
    if os.geteuid() == 0:
        return True
    found = False  # a system journal there, or a journal directory this reader may not list
    for top in dirs:
        try:
            machines = os.listdir(top)
        except PermissionError:
            found = True
            continue
        except OSError:
            continue
        for machine in machines:
            path = os.path.join(top, machine, "system.journal")
            try:
                os.stat(path)
            except PermissionError:
                found = True
                continue
            except OSError:
                continue
            found = True
            if os.access(path, os.R_OK):
                return True
    return False if found else None


def run(ctl: Any, args: argparse.Namespace, since: float | None) -> int:
    """gpud.ctl.commands.run_logs's (`ctl` its Ctl, SINCE the parsed --since: this module does
    not import it back). Replaces gpuctl with journalctl; returns only when that cannot be
    done."""
    argv = journal_argv(args.name, follow=args.follow, since=since, lines=args.lines,
                        as_json=ctl.as_json)
    if may_read_system_journal(JOURNAL_DIRS) is False:
        uid = os.geteuid()
        raise CtlError("forbidden", f"uid {uid} may not read the system journal, where "
                       f"{serve_unit(args.name)} logs: root and the members of group "
                       "systemd-journal (or adm) may; gpuctl reads it with your rights only",
                       EXIT_REFUSED, {"uid": uid, "unit": serve_unit(args.name)})
    ctl.out.flush()
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        raise CtlError("unavailable", f"cannot run journalctl: {exc.strerror or exc} (the "
                       f"serve's journal: journalctl -u {serve_unit(args.name)})",
                       EXIT_REFUSED, {"argv": argv}) from exc
    return EXIT_REFUSED  # not reached: execvp returns only by raising
