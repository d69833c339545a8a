"""The equivalent mutants tools/mutate.py leaves out of a module's score are named by module,
line and description: an entry whose line moved with an edit names no mutant any more (a real
equivalent counted as a survivor), or names another one (a real mutant left out). Every entry
must name a mutant the tool makes today."""

from __future__ import annotations

from collections import defaultdict

from tools import mutate


def test_every_equivalent_entry_names_a_mutant_of_today() -> None:
    by_module: dict[str, set[str]] = defaultdict(set)
    for key in mutate.equivalent():
        by_module[key.split(":", 1)[0]].add(key)
    assert by_module, "no entries read"
    stale = {module: sorted(keys - set(mutate.keys(module)))
             for module, keys in by_module.items()}
    assert not any(stale.values()), stale


def test_the_keys_are_the_mutants_keys() -> None:
    module = "gpud/core/reconcile.py"  # a small module: making its mutants is quick
    assert mutate.keys(module) == [m.key for m in mutate.mutants(module)]


def test_a_moved_entry_is_caught() -> None:
    keys = set(mutate.keys("gpud/core/launch.py"))
    entry = next(k for k in mutate.equivalent() if k.startswith("gpud/core/launch.py:"))
    module, line, description = entry.split(":", 2)
    assert entry in keys
    assert f"{module}:{int(line) + 1}:{description}" not in keys
