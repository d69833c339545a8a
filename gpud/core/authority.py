"""Who may make a config change: what runs, as whom or where needs root; figures do not.

Serves run as root-started systemd units, so a change to a command, a model, an environment, a
user, a device, a port or any [daemon] key hands out root. The admin group may change figures
only (capacity, reserve, reservations, residency, priority, notes) and remove serves.
"""

from __future__ import annotations

import re
from typing import Any

from gpud.core.config import Config

# Key paths the admin group may change, as patterns over dotted paths.
FIGURES = re.compile(
    r"roles\.[^.]+\.(capacity_mib|reserve_mib|note)"
    r"|serves\.[^.]+\.(vram_mib|resident|priority|sleep_mib)"
)


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict):  # an empty table has no paths: what it gains is named
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}" if prefix else str(key), out)
    else:
        out[prefix] = value


def changed_paths(old: Config, new: Config) -> list[str]:
    """Every key path whose value differs (leaves: tables are walked into)."""
    before: dict[str, Any] = {}
    after: dict[str, Any] = {}
    _flatten(old.model_dump(), "", before)
    _flatten(new.model_dump(), "", after)
    paths: set[str] = set()
    for path in before.keys() | after.keys():
        if before.get(path, _ABSENT) != after.get(path, _ABSENT):
            paths.add(path)
    return sorted(paths)


def needs_root(old: Config, new: Config) -> list[str]:
    """The key paths of the change that only root may make; [] when the admin group may."""
    found: set[str] = set()
    removed = set(old.serves) - set(new.serves)
    for path in changed_paths(old, new):
        # Paths under serves and roles are at least three deep: serves.NAME.KEY.
        section, _, rest = path.partition(".")
        name = rest.partition(".")[0]
        if section == "serves" and name in removed:
            continue  # removing a serve is the admin group's to do
        if section == "serves" and name not in old.serves:
            found.add(f"serves.{name}")  # adding a serve decides what runs
        elif section == "roles" and (name not in old.roles or name not in new.roles):
            found.add(f"roles.{name}")
        elif not FIGURES.fullmatch(path):
            found.add(path)
    return sorted(found)


_ABSENT = object()
