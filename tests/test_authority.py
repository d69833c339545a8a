"""Who may make a config change: figures for the admin group, what runs, as whom or where for
root."""

from __future__ import annotations

import pytest

from gpud.config import parse_config
from gpud.core.authority import needs_root

BASE = """
[roles.r]
device = "0"
capacity_mib = 10000
reserve_mib = 100
note = "display"

[serves.a]
role = "r"
vram_mib = 1000
port = 30001
command = ["/opt/serve", "--port", "{port}"]

[serves.b]
role = "r"
vram_mib = 500
[serves.b.vllm]
model = "m"
"""


def paths(new_text: str) -> list[str]:
    return needs_root(parse_config(BASE, "old"), parse_config(new_text, "new"))


@pytest.mark.parametrize("old, new", [
    ("capacity_mib = 10000", "capacity_mib = 9000"),
    ("reserve_mib = 100", "reserve_mib = 200"),
    ('note = "display"', 'note = "display and voice"'),
    ("vram_mib = 1000", "vram_mib = 900\nresident = true\npriority = 5"),
])
def test_figures_are_the_admin_groups(old: str, new: str) -> None:
    assert paths(BASE.replace(old, new)) == []


def test_removing_a_serve_is_the_admin_groups() -> None:
    assert paths(BASE[:BASE.index("[serves.b]")]) == []


@pytest.mark.parametrize("old, new, expected", [
    ('"--port", "{port}"]', '"--port", "{port}", "--evil"]', ["serves.a.command"]),
    ('model = "m"', 'model = "other"', ["serves.b.vllm.model"]),
    ('model = "m"', 'model = "m"\nextra_args = ["--trust-remote-code"]',
     ["serves.b.vllm.extra_args"]),
    ("port = 30001", "port = 30001\nuser = \"root\"", ["serves.a.user"]),
    ("port = 30001", "port = 30001\nuser = \"gpud-serve\"", ["serves.a.user"]),
    ("[roles.r]", '[daemon]\nserve_user = "root"\n\n[roles.r]', ["daemon.serve_user"]),
    ("port = 30001", 'port = 30001\nenvironment = { LD_PRELOAD = "/x.so" }',
     ["serves.a.environment.LD_PRELOAD"]),
    ("port = 30001", "port = 22", ["serves.a.port"]),
    ('device = "0"', 'device = "1"', ["roles.r.device"]),
    ("[roles.r]", '[daemon]\nvllm_executable = "/tmp/vllm"\n\n[roles.r]',
     ["daemon.vllm_executable"]),
    ("[roles.r]", '[daemon]\nadmin_group = "users"\n\n[roles.r]', ["daemon.admin_group"]),
    ("[roles.r]", '[daemon]\nmetrics_listen = "0.0.0.0:9400"\n\n[roles.r]',
     ["daemon.metrics_listen"]),
])
def test_what_runs_as_whom_or_where_needs_root(old: str, new: str, expected: list[str]) -> None:
    assert paths(BASE.replace(old, new)) == expected


def test_adding_a_serve_or_a_role_needs_root_and_is_named_once() -> None:
    added = BASE + '\n[serves.c]\nrole = "r"\nvram_mib = 10\ncommand = ["/bin/sh"]\n'
    assert paths(added) == ["serves.c"]
    role = BASE + '\n[roles.q]\ndevice = "1"\ncapacity_mib = 100\n'
    assert paths(role) == ["roles.q"]


def test_a_mixed_change_names_only_the_root_parts() -> None:
    new = BASE.replace("vram_mib = 1000", "vram_mib = 800").replace('model = "m"',
                                                                    'model = "n"')
    assert paths(new) == ["serves.b.vllm.model"]


CONTAINED = BASE + """
[roles.q]
device = "1"
capacity_mib = 10000

[serves.c]
role = "r"
vram_mib = 2000
port = 30003
front = false  # the image's own command: nowhere to tell it {socket}
sleep_level = 1
sleep_mib = 300
[serves.c.container]
image = "registry.example/vllm:1"
volumes = ["/srv/models:/models:ro"]
"""


@pytest.mark.parametrize("old, new, expected", [
    # a serve's sleep reservation is a figure
    ("sleep_mib = 300", "sleep_mib = 400", []),
    # how it runs (vLLM's --enable-sleep-mode, the dev endpoints), and whether others may stop it
    ("sleep_level = 1", "sleep_level = 2", ["serves.c.sleep_level"]),
    ("sleep_mib = 300", 'sleep_mib = 300\npreemptible = "stop"', ["serves.c.preemptible"]),
    # where it runs: every device of a serve on several
    ('role = "r"\nvram_mib = 2000', 'roles = ["r", "q"]\nvram_mib = 2000',
     ["serves.c.role", "serves.c.roles"]),
    # what the container is: its image, what it mounts, its IPC namespace, its pulls
    ('image = "registry.example/vllm:1"', 'image = "evil/vllm:1"', ["serves.c.container.image"]),
    ('"/srv/models:/models:ro"', '"/:/host"', ["serves.c.container.volumes"]),
    ('volumes = ["/srv/models:/models:ro"]', 'volumes = ["/srv/models:/models:ro"]\nipc = "host"',
     ["serves.c.container.ipc"]),
    ('volumes = ["/srv/models:/models:ro"]', 'volumes = ["/srv/models:/models:ro"]\n'
     'pull = "missing"', ["serves.c.container.pull"]),
    # the daemon's keys of sleep and preemption
    ("[roles.r]", "[daemon]\nauto_wake = false\n\n[roles.r]", ["daemon.auto_wake"]),
    ("[roles.r]", "[daemon]\npreempt_at_boot = true\n\n[roles.r]", ["daemon.preempt_at_boot"]),
    ("[roles.r]", "[daemon]\nsleep_host_margin_mib = 0\n\n[roles.r]",
     ["daemon.sleep_host_margin_mib"]),
])
def test_the_keys_of_sleep_roles_and_containers(old: str, new: str,
                                                expected: list[str]) -> None:
    assert old in CONTAINED
    assert needs_root(parse_config(CONTAINED, "old"),
                      parse_config(CONTAINED.replace(old, new, 1), "new")) == expected


def test_taking_a_serve_off_root_or_onto_it_is_roots_alone() -> None:
    # Serves run unprivileged by default: dropping `user = "root"` changes as whom it runs too.
    as_root = BASE.replace("port = 30001", 'port = 30001\nuser = "root"')
    assert needs_root(parse_config(as_root, "old"), parse_config(BASE, "new")) == ["serves.a.user"]
    assert needs_root(parse_config(BASE, "old"), parse_config(as_root, "new")) == ["serves.a.user"]
