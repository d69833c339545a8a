"""``gpuctl keys``: the router's keys (router.api_keys_file, docs/router.md) listed, added,
rotated and revoked.

The edit is made here, by gpuctl with its user's own rights, not by gpud: the keys file is
root's and 0600 (it may hold tokens), so only root can read or change it, and no route of gpud's
socket hands out a token. The file named by the config in force (GET /v1/status gives its
path) is edited under a lock (its directory's), the whole result checked as gpud's reload checks
it (gpud.core.keys.parse_keys, with the model names gpud routes now) before it replaces the
old file (written atomically, 0600), and then gpud reloads, which gives the router its new keys.
When gpud refuses that reload the old file is put back. A new token comes from ``secrets``, is
printed once, and only its SHA-256 is written.
"""

from __future__ import annotations

import os

from gpud.ctl.client import MUTATION_TIMEOUT
from gpud.ctl.errors import EXIT_OK, EXIT_REFUSED, EXIT_USAGE, CtlError, usage_error

TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from typing import Any

    from gpud.core.keyfile import KeyEntry

    # `ctl` below is gpud.ctl.commands.Ctl, which imports this module: not imported back
    Ctl = Any

ACTIONS = ("list", "add", "rotate", "revoke")
# A new token: 32 random bytes (256 bits), URL-safe, after a prefix that says whose it is.
TOKEN_PREFIX = "sk-gpud-"
TOKEN_BYTES = 32


def new_token() -> str:
    import secrets

    return TOKEN_PREFIX + secrets.token_urlsafe(TOKEN_BYTES)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", metavar="ACTION", choices=ACTIONS,
                   help="list, add NAME, rotate NAME (a new token, the old one refused) or "
                        "revoke NAME (the key removed)")
    p.add_argument("key_name", metavar="NAME", nargs="?",
                   help="the key's name (letters, digits, . _ @ -): its requests' requester")
    p.add_argument("--models", nargs="+", metavar="MODEL",
                   help="with add: the model names the key may use (default: * , every model)")
    p.add_argument("--max-concurrent", type=int, metavar="N",
                   help="with add: requests of the key in flight at once (nginx limit_conn)")
    p.add_argument("--requests-per-minute", type=int, metavar="N",
                   help="with add: the key's requests a minute (nginx limit_req)")
    p.add_argument("--priority", type=int, metavar="N",
                   help="with add: the key's priority in gpud's queue and vLLM's scheduler "
                        "(smaller first, -1000 to 1000)")
    p.add_argument("--weight", type=float, metavar="W",
                   help="with add: the key's share among those waiting (0.01 to 1000)")
    p.add_argument("--tokens-per-day", type=int, metavar="N",
                   help="with add: the key's prompt + completion tokens a UTC day; past them "
                        "its requests are answered 429 insufficient_quota until the day ends")
    p.add_argument("--tokens-per-month", type=int, metavar="N",
                   help="with add: the key's prompt + completion tokens a UTC month, alike")
    p.add_argument("--peer", action="store_true",
                   help="with add: the key another gpud host presents (peer = true): the "
                        "requester it forwards is taken, counted as NAME/REQUESTER")


def _shares(args: argparse.Namespace) -> dict[str, int | float]:
    given = {"max_concurrent": args.max_concurrent,
             "requests_per_minute": args.requests_per_minute,
             "priority": args.priority, "weight": args.weight,
             "tokens_per_day": args.tokens_per_day, "tokens_per_month": args.tokens_per_month}
    return {k: v for k, v in given.items() if v is not None}


def _check_args(args: argparse.Namespace) -> None:
    from gpud.core.keys import KEY_NAME_RE

    if args.action == "list":
        if args.key_name is not None:
            raise usage_error("keys list takes no NAME")
    elif args.key_name is None:
        raise usage_error(f"keys {args.action} needs the key's NAME")
    elif not KEY_NAME_RE.fullmatch(args.key_name):
        raise usage_error(f"{args.key_name!r} is not a key name (letters, digits, . _ @ -, up "
                          "to 64)", key=args.key_name)
    if args.action != "add" and (args.models is not None or _shares(args) or args.peer):
        raise usage_error("--models, --peer and the limits go with add (rotate keeps the "
                          "key's own; to change them, revoke and add it again)")


def _where(ctl: Ctl, mutating: bool) -> str:
    """The router.api_keys_file of the config file in force, read from the config file itself
    with this user's rights. Mutating: refused while the file on disk is not the config in
    force, since the reload that follows the edit would put that in force too."""
    import tomllib

    status = ctl.client.call("GET", "/v1/status")
    config = status.get("config")
    if not config:
        raise CtlError("conflict", "gpud runs without a config file: no keys file to edit",
                       EXIT_REFUSED)
    differs = status.get("config_file") or {}
    if mutating and differs.get("differs"):
        raise CtlError("conflict", f"{config} on disk is not the config in force "
                       f"({differs.get('reason')}): the reload after a key's change would put "
                       "it in force too; reload or apply it first (gpuctl plan, gpuctl apply)",
                       EXIT_REFUSED, {"config": config})
    try:
        with open(config, "rb") as handle:
            doc = tomllib.load(handle)
    except PermissionError:
        raise _root_only(config) from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise CtlError("conflict", f"cannot read {config}: {exc}", EXIT_REFUSED) from exc
    router = doc.get("router")
    path = router.get("api_keys_file") if isinstance(router, dict) else None
    if not isinstance(path, str):
        raise CtlError("conflict", f"{config} has no router.api_keys_file: keys are off (the "
                       "router is open to whoever reaches it). Set it (docs/router.md), then "
                       "gpuctl keys add", EXIT_REFUSED, {"config": config})
    return path


def _root_only(path: str) -> CtlError:
    return CtlError("forbidden", f"cannot read {path}: permission denied (uid {os.geteuid()}): "
                    "the config and the keys file are root's, run gpuctl keys as root",
                    EXIT_REFUSED, {"path": path, "uid": os.geteuid()})


def _read(path: str) -> str | None:
    """The keys file's text; None when there is none yet."""
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except FileNotFoundError:
        return None
    except PermissionError:
        raise _root_only(path) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CtlError("conflict", f"cannot read {path}: {exc}", EXIT_REFUSED,
                       {"path": path}) from exc


def _write(path: str, text: str | None) -> None:
    from pathlib import Path

    from gpud.errors import GpudError
    from gpud.files import write_atomically

    try:
        if text is None:
            os.unlink(path)
        else:
            write_atomically(Path(path), text, 0o600)
    except PermissionError:
        raise _root_only(path) from None
    except (OSError, GpudError) as exc:
        raise CtlError("conflict", str(exc), EXIT_REFUSED, {"path": path}) from exc


def run(ctl: Ctl, args: argparse.Namespace) -> int:
    _check_args(args)
    path = _where(ctl, mutating=args.action != "list")
    if args.action == "list":
        return _list(ctl, path)
    known = [m for s in ctl.client.call("GET", "/v1/serves").get("serves") or []
             for m in s.get("models") or []]
    where = os.path.dirname(os.path.abspath(path))
    try:
        directory = os.open(where, os.O_RDONLY | os.O_DIRECTORY)
    except PermissionError:
        raise _root_only(where) from None
    except OSError as exc:
        raise CtlError("conflict", f"cannot open {where}, the keys file's directory: "
                       f"{exc.strerror or exc}", EXIT_REFUSED, {"path": path}) from exc
    try:
        import fcntl

        # one edit at a time: the file is replaced, so its directory is what stays to lock
        fcntl.flock(directory, fcntl.LOCK_EX)
        return _edit(ctl, args, path, known)
    finally:
        os.close(directory)


def _edit(ctl: Ctl, args: argparse.Namespace, path: str, known: list[str]) -> int:
    from gpud.core.keyfile import KeyFileError, keys_in, set_key
    from gpud.core.keys import parse_keys

    old = _read(path)
    name = args.key_name
    try:
        tables = keys_in(old or "")
        token = None
        if args.action == "add":
            if name in tables:
                raise CtlError("conflict", f"key {name!r} exists: rotate or revoke it",
                               EXIT_REFUSED, {"key": name})
            token = new_token()
            new = set_key(old or "", name, _entry(args, token))
        elif name not in tables:
            raise CtlError("not-found", f"no key {name!r} in {path}", EXIT_USAGE,
                           {"key": name, "path": path})
        elif args.action == "rotate":
            from gpud.core.keyfile import entry_of
            from gpud.core.keys import token_digest

            token = new_token()
            new = set_key(old or "", name, entry_of(tables[name], token_digest(token)))
        else:
            new = set_key(old or "", name, None)
    except KeyFileError as exc:
        raise CtlError("conflict", f"{path}: {exc}", EXIT_REFUSED, {"path": path}) from exc
    _, problems = parse_keys(new, known)
    if problems:
        raise CtlError("config-invalid", f"{path} would be refused, nothing changed: "
                       + "; ".join(problems), EXIT_USAGE, {"path": path, "problems": problems})
    _write(path, new)
    try:
        reloaded = ctl.client.call("POST", "/v1/reload", {}, MUTATION_TIMEOUT)
    except CtlError as exc:
        _write(path, old)
        raise CtlError(exc.code, f"gpud refused the reload, {path} is as it was: {exc}",
                       exc.exit_code, exc.details) from exc
    doc: dict[str, Any] = {"key": name, "action": args.action, "file": path,
                           "reloaded": reloaded}
    if token is not None:
        doc["token"] = token
    ctl.emit(doc, _human)
    return EXIT_OK


def _entry(args: argparse.Namespace, token: str) -> KeyEntry:
    from gpud.core.keyfile import KeyEntry
    from gpud.core.keys import token_digest

    models = tuple(dict.fromkeys(args.models)) if args.models else ("*",)
    return KeyEntry(token_digest(token), models, _shares(args), peer=args.peer)


def _human(doc: dict[str, Any]) -> str:
    done = {"add": "added", "rotate": "rotated", "revoke": "revoked"}[doc["action"]]
    lines = [f"key {doc['key']} {done} in {doc['file']}; gpud reloaded"]
    if "token" in doc:
        lines.append(f"token: {doc['token']}")
        lines.append("(shown once: the file keeps only its SHA-256)")
    return "\n".join(lines)


def _list(ctl: Ctl, path: str) -> int:
    from gpud.core.keyfile import KeyFileError, keys_in
    from gpud.core.keys import KEY_SHARES

    text = _read(path)
    try:
        tables = keys_in(text or "")
    except KeyFileError as exc:
        raise CtlError("config-invalid", f"{path}: {exc}", EXIT_USAGE, {"path": path}) from exc
    rows = []
    for name, table in sorted(tables.items()):
        table = table if isinstance(table, dict) else {}
        models = table.get("models")
        rows.append({"name": name,
                     "models": models if isinstance(models, list) else [],
                     "stored": "sha256" if "sha256" in table else "token",
                     **{f: table.get(f) for f in KEY_SHARES},
                     "peer": table.get("peer") is True})
    ctl.emit({"file": path, "exists": text is not None, "keys": rows}, _format_list)
    return EXIT_OK


def _format_list(doc: dict[str, Any]) -> str:
    if not doc["keys"]:
        return f"no keys in {doc['file']}" + ("" if doc["exists"] else " (no such file yet)")
    head = ["KEY", "MODELS", "STORED", "MAX_CONC", "RPM", "PRIORITY", "WEIGHT", "TOKENS/DAY",
            "TOKENS/MONTH", "PEER"]
    table = [head] + [
        [k["name"], ",".join(map(str, k["models"])), k["stored"],
         *("-" if k[f] is None else str(k[f])
           for f in ("max_concurrent", "requests_per_minute", "priority", "weight",
                     "tokens_per_day", "tokens_per_month")),
         "yes" if k.get("peer") else "-"]
        for k in doc["keys"]]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                     for row in table)
