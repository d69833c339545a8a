"""The role budgets of a config on the devices seen: pure, values in, values out (the service
and the plan worker both resolve them, the plan worker without the service)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gpud.core.config import Config, RoleConfig
from gpud.core.ledger import RoleBudget
from gpud.errors import ConfigError


def resolve_budgets(cfg: Config, device_total: Callable[[str], int | None],
                    devices: Sequence[str] | None = None,
                    device_problem: Callable[[str], str | None] | None = None,
                    device_id: Callable[[str], str | None] | None = None, *,
                    source: str = "the config") -> list[RoleBudget]:
    """Role budgets with capacity defaulted to the device's total. Capacity may be set lower than
    the device, never higher. `devices`, when observation sees any, lists what it sees: a role
    on a device not among them is an error. `device_problem` says why a device that is there
    cannot be read (lost, reset required): its total is unknown, not its presence.

    The device is the physical bound: roles on one device partition it, their capacities
    together never more than its total (a role whose capacity defaults to the total leaves no
    room for another role there). `device_id` tells which references name the same device
    (an index, a bus id and a UUID may); without it only equal references do. Where no total
    can be known (no observation, no simulation) the sum cannot be checked: it is checked
    when gpud starts on the host. `source` names the config in the error (its file)."""
    problems: list[str] = []
    budgets: list[RoleBudget] = []
    defaulted: set[str] = set()
    for name, role in sorted(cfg.roles.items()):
        problem = device_problem(role.device) if device_problem else None
        budget = _role_budget(name, role, device_total(role.device), devices, problem)
        if isinstance(budget, str):
            problems.append(budget)
            continue
        if role.capacity_mib is None:
            defaulted.add(name)
        budgets.append(budget)

    def same(ref: str) -> str:
        return (device_id(ref) if device_id is not None else None) or ref

    problems += _partition_problems(budgets, defaulted, device_total, same)
    problems += _serve_problems(cfg, budgets, same)
    if problems:
        raise ConfigError(source, problems)
    return budgets


def _role_budget(name: str, role: RoleConfig, total: int | None, devices: Sequence[str] | None,
                 problem: str | None) -> RoleBudget | str:
    """One role's budget on its device (`total`: the device's, None when unknown), or what is
    wrong with it."""
    if devices is not None and total is None and problem is None:
        return (f"roles.{name}.device: no device {role.device!r} on this host "
                f"(present: {', '.join(devices) or 'none'})")
    capacity = role.capacity_mib
    if capacity is None:
        if total is None:
            why = f"cannot be read ({problem})" if problem else "cannot be observed"
            return (f"roles.{name}.capacity_mib: required, since the total of device "
                    f"{role.device!r} {why}")
        capacity = total
    elif total is not None and capacity > total:
        return (f"roles.{name}.capacity_mib: {capacity} exceeds device {role.device!r} total "
                f"{total} MiB")
    if role.reserve_mib >= capacity:
        return f"roles.{name}.reserve_mib: {role.reserve_mib} must be < capacity {capacity}"
    return RoleBudget(name, role.device, capacity, role.reserve_mib, role.note)


def _partition_problems(budgets: Sequence[RoleBudget], defaulted: set[str],
                        device_total: Callable[[str], int | None],
                        same: Callable[[str], str]) -> list[str]:
    """Roles on one device partition it: their capacities together never more than its total
    (named at a role whose capacity defaulted to the whole device, else the last)."""
    problems: list[str] = []
    on_device: dict[str, list[RoleBudget]] = {}
    for resolved in budgets:
        on_device.setdefault(same(resolved.device), []).append(resolved)
    for group in on_device.values():
        total = device_total(group[0].device)
        held = sum(b.capacity_mib for b in group)
        if len(group) > 1 and total is not None and held > total:
            names = [b.name for b in group]
            at = next((n for n in names if n in defaulted), names[-1])
            problems.append(
                f"roles.{at}.capacity_mib: roles {', '.join(names)} are on one device "
                f"({', '.join(sorted({b.device for b in group}))}, total {total} MiB) and "
                f"together hold {held} MiB: roles on a device partition it (a capacity_mib "
                f"not set is the whole device); set capacity_mib on each so that they add up "
                f"to {total} MiB at most")
    return problems


def _serve_problems(cfg: Config, budgets: Sequence[RoleBudget],
                    same: Callable[[str], str]) -> list[str]:
    """Each serve's roles on different devices, its vram_mib within each role's capacity."""
    problems: list[str] = []
    for sname, serve in cfg.serves.items():
        seen: dict[str, str] = {}
        for i, role_name in enumerate(serve.all_roles):
            ref = cfg.roles[role_name].device if role_name in cfg.roles else None
            if ref is not None and len(serve.all_roles) > 1:
                other = seen.setdefault(same(ref), role_name)
                if other != role_name:
                    problems.append(
                        f"serves.{sname}.roles[{i}]: role {role_name!r} is on the same device "
                        f"as role {other!r} ({cfg.roles[other].device!r} and {ref!r} are one "
                        "device): each role of a serve must be on a different device")
        for role_name in serve.all_roles:
            budget = next((b for b in budgets if b.name == role_name), None)
            if budget and serve.vram_mib > budget.capacity_mib:
                problems.append(
                    f"serves.{sname}.vram_mib: {serve.vram_mib} exceeds role {role_name!r} "
                    f"capacity {budget.capacity_mib}")
    return problems
