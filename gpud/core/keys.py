"""The router's API keys: the keys of router.api_keys_file (ApiKey, parse_keys), a token's
SHA-256 and a key's limits and shares (KEY_SHARES). Text in, keys and problems out; the nginx
lines of the keys' limits are gpud.core.limits'.

Pure: no file, process or clock here. gpud.nginx.router reads the file.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from gpud.core.text import did_you_mean

# A key's token: long enough not to be guessed, printable, no spaces.
TOKEN_RE: Final = re.compile(r"[\x21-\x7e]{16,512}")
KEY_NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
ALL_MODELS: Final = "*"


@dataclass(frozen=True)
class ApiKey:
    """A bearer token of router.api_keys_file, kept as its SHA-256 only (the routing script
    is readable by others), with the names it may use ("*": all)."""

    name: str
    sha256: str
    models: tuple[str, ...]
    # docs/router.md, "Who is asking": in the data path (nginx's limit_conn / limit_req), and
    # gpud's queue (priority: smaller first; weight: its share among those waiting)
    max_concurrent: int | None = None
    requests_per_minute: int | None = None
    priority: int = 0
    weight: float = 1.0
    # docs/router.md, "Budgets": prompt + completion tokens a UTC day and month (gpud.core.quota)
    tokens_per_day: int | None = None
    tokens_per_month: int | None = None
    # docs/peers.md, "Who is asking, across hosts": the key another gpud host presents, whose
    # forwarded requester (X-Gpud-Requester) the router takes, as PEER/NAME (forwarded_requester)
    peer: bool = False


def parse_keys(text: str, known: Iterable[str]) -> tuple[list[ApiKey], list[str]]:
    """The keys of an api_keys_file's TOML text, and its problems (each naming its key):

        [keys.alice]
        token = "sk-..."            # at least 16 printable characters
        models = ["chat", "ocr"]    # or ["*"]: every model

    or, instead of the token, its SHA-256 (64 hex digits: the file then holds no token;
    `gpuctl keys add` writes it so): sha256 = "9f86d0..."; and `peer = true` on the key another
    gpud host presents (docs/peers.md).
    """
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        return [], [f"not TOML: {exc}"]
    problems = [f"{key}: unknown key (only [keys.NAME] tables)" for key in doc if key != "keys"]
    table = doc.get("keys", {})
    if not isinstance(table, dict):
        return [], ["keys: must be a table of [keys.NAME] tables"]
    names = set(known)
    keys: list[ApiKey] = []
    seen: dict[str, str] = {}
    for name, entry in sorted(table.items()):
        where = f"keys.{name}"
        if not KEY_NAME_RE.fullmatch(name):
            problems.append(f"{where}: not a key name (letters, digits, . _ @ -)")
            continue
        allowed = (*KEY_SECRETS, "models", *KEY_SHARES, "peer")
        if not isinstance(entry, dict):
            problems.append(f"{where}: a table of token (or sha256), models, "
                            f"{', '.join(KEY_SHARES)} and peer only")
            continue
        unknown_keys = sorted(set(entry) - set(allowed))
        if unknown_keys:
            problems += [f"{where}.{k}: unknown key{did_you_mean(k, allowed)} (a key's table "
                         f"has {', '.join(allowed)})" for k in unknown_keys]
            continue
        shares, wrong = key_shares(entry, where)
        if wrong:
            problems += wrong
            continue
        digest, wrong = key_digest(entry, where)
        if digest is None:
            problems += wrong
            continue
        peer = entry.get("peer", False)
        if not isinstance(peer, bool):
            problems.append(f"{where}.peer: true or false (got {peer!r}): true marks the key "
                            "another gpud host presents, whose forwarded requester is taken")
            continue
        models = entry.get("models")
        if not isinstance(models, list) or not models or \
                not all(isinstance(m, str) for m in models):
            problems.append(f"{where}.models: a list of model names (or [\"*\"])")
            continue
        unknown = [m for m in models if m != ALL_MODELS and m not in names]
        if unknown:
            problems.append(f"{where}.models: no serve answers to {', '.join(map(repr, unknown))}")
            continue
        if digest in seen:
            field = "token" if "token" in entry else "sha256"
            problems.append(f"{where}.{field}: the same token as keys.{seen[digest]}")
            continue
        seen[digest] = name
        mc, rpm = shares.get("max_concurrent"), shares.get("requests_per_minute")
        keys.append(ApiKey(name, digest, tuple(dict.fromkeys(models)),
                           max_concurrent=None if mc is None else int(mc),
                           requests_per_minute=None if rpm is None else int(rpm),
                           priority=int(shares.get("priority", 0)),
                           weight=float(shares.get("weight", 1.0)),
                           tokens_per_day=_whole(shares.get("tokens_per_day")),
                           tokens_per_month=_whole(shares.get("tokens_per_month")),
                           peer=peer))
    return keys, problems


def _whole(value: int | float | None) -> int | None:
    return None if value is None else int(value)


# How a key's table gives its token: the token itself, or its SHA-256 (what the router compares:
# a file of digests holds no token a reader could use).
KEY_SECRETS: Final = ("token", "sha256")
SHA256_RE: Final = re.compile(r"[0-9a-f]{64}")


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def key_digest(entry: Mapping[str, object], where: str) -> tuple[str | None, list[str]]:
    """The SHA-256 of a key's token, from its table's token or sha256 (exactly one of them),
    and the problem (naming the key) when there is none."""
    token, digest = entry.get("token"), entry.get("sha256")
    if token is not None and digest is not None:
        return None, [f"{where}: token or sha256, not both"]
    if digest is not None:
        if not isinstance(digest, str) or not SHA256_RE.fullmatch(digest.lower()):
            return None, [f"{where}.sha256: the token's SHA-256, 64 hex digits"]
        return digest.lower(), []
    if not isinstance(token, str) or not TOKEN_RE.fullmatch(token):
        return None, [f"{where}.token: at least 16 printable characters, no spaces"]
    return token_digest(token), []


# A key's limits and shares (docs/router.md, "Who is asking"): name -> (smallest, largest).
# nginx refuses a limit_conn of 65536 and more ("connection limit must be less 65536",
# ngx_http_limit_conn_module.c): the whole front's config with it.
KEY_SHARES: Final[Mapping[str, tuple[float, float]]] = {
    "max_concurrent": (1, 65_535),
    "requests_per_minute": (1, 1_000_000),
    "priority": (-1000, 1000),
    "weight": (0.01, 1000.0),
    # budgets (gpud.core.quota): 0 lets no request in
    "tokens_per_day": (0, 10**15),
    "tokens_per_month": (0, 10**15),
}


def key_shares(entry: Mapping[str, object], where: str
               ) -> tuple[dict[str, int | float], list[str]]:
    """A key's limits and shares from its table, and its problems (each naming the key)."""
    out: dict[str, int | float] = {}
    problems = []
    for field, (low, high) in KEY_SHARES.items():
        value = entry.get(field)
        if value is None:
            continue
        whole = field != "weight"
        if isinstance(value, bool) or not isinstance(value, int | float) or \
                (whole and not isinstance(value, int)) or not low <= value <= high:
            shown = (f"{int(low)} to {int(high)}" if whole else f"{low:g} to {high:g}")
            problems.append(f"{where}.{field}: {'an integer' if whole else 'a number'} from "
                            f"{shown} (got {value!r})")
            continue
        out[field] = int(value) if whole else float(value)
    return out, problems
