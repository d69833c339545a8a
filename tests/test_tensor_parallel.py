"""Serves on several roles (tensor parallel across devices): config, store schema 5, launch argv
and environment, --show-commands, and the simulated stand-in's draw on several devices."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from gpud.config import parse_config, summary
from gpud.core.launch import serve_argv, smallest_total, visible_devices
from gpud.core.ledger import Reservation
from gpud.durable.store import MIGRATIONS, SCHEMA_VERSION, Changes, Event, EventQuery, Store
from gpud.errors import ConfigError, StoreError
from gpud.host.simulation import SimulatedBackend, SimulatedDevice, register_process
from gpud.host.unit_properties import UnitSpec, build_properties
from tests.conftest import REPO
from tests.test_store import schema_version

FOUR = """
[roles.d0]
device = "GPU-sim-0"
reserve_mib = 1000
[roles.d1]
device = "GPU-sim-1"
[roles.d2]
device = "GPU-sim-2"
[roles.d3]
device = "GPU-sim-3"
[simulation]
state_file = "/nonexistent/sim.json"
[[simulation.devices]]
uuid = "GPU-sim-0"
total_mib = 81559
[[simulation.devices]]
uuid = "GPU-sim-1"
total_mib = 81559
[[simulation.devices]]
uuid = "GPU-sim-2"
total_mib = 40960
[[simulation.devices]]
uuid = "GPU-sim-3"
total_mib = 40960
"""

BIG = """
[serves.big]
roles = ["d0", "d1"]
vram_mib = 30000
port = 30100
[serves.big.vllm]
model = "org/big"
"""


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(text, "test.toml")
    return info.value.problems


# ---- config --------------------------------------------------------------------------------------


def test_roles_gives_every_role_in_order_and_role_stays_the_first() -> None:
    cfg = parse_config(FOUR + BIG, "t.toml")
    big = cfg.serves["big"]
    assert big.all_roles == ("d0", "d1") and big.role == "d0" and big.extra_roles == ("d1",)


@pytest.mark.parametrize(("serve", "expected"), [
    ('[serves.x]\nrole = "d0"\nroles = ["d0", "d1"]\nvram_mib = 10\ncommand = ["/bin/true"]\n',
     "serves.x: give exactly one of role or roles"),
    ('[serves.x]\nroles = []\nvram_mib = 10\ncommand = ["/bin/true"]\n',
     "serves.x: roles: must name at least one role"),
    ('[serves.x]\nroles = ["d0", "d0"]\nvram_mib = 10\ncommand = ["/bin/true"]\n',
     "serves.x.roles[1]: role 'd0' is named twice"),
    ('[serves.x]\nroles = ["d0", "nope"]\nvram_mib = 10\ncommand = ["/bin/true"]\n',
     "serves.x.roles[1]: unknown role 'nope' (roles: d0, d1, d2, d3, same0)"),
    ('[serves.x]\nroles = ["d0", "same0"]\nvram_mib = 10\ncommand = ["/bin/true"]\n',
     "serves.x.roles[1]: role 'same0' is on device 'GPU-sim-0', like role 'd0': each role of "
     "a serve must be on a different device"),
])
def test_bad_roles_are_refused_naming_the_key(serve: str, expected: str) -> None:
    extra = '[roles.same0]\ndevice = "GPU-sim-0"\ncapacity_mib = 1000\n'
    assert expected in problems(FOUR + extra + serve)


@pytest.mark.parametrize("extra", ['["--tensor-parallel-size", "4"]', '["-tp", "1"]',
                                   '["--tensor-parallel-size=3"]'])
def test_an_explicit_tensor_parallel_size_that_disagrees_is_a_config_error(extra: str) -> None:
    found = problems(FOUR + BIG + f"extra_args = {extra}\n")
    assert any(p.startswith("serves.big.vllm.extra_args[0]: ") and "disagrees with the serve's "
               "2 role(s)" in p for p in found), found


@pytest.mark.parametrize("extra", ['["-pp", "2"]', '["--data-parallel-size=2"]'])
def test_other_parallel_sizes_than_1_are_a_config_error(extra: str) -> None:
    found = problems(FOUR + BIG + f"extra_args = {extra}\n")
    assert any(p.startswith("serves.big.vllm.extra_args[0]: ") and "other parallel sizes must "
               "stay 1" in p for p in found), found
    assert parse_config(FOUR + BIG + 'extra_args = ["-pp", "1"]\n', "t.toml")


def test_an_explicit_tensor_parallel_size_that_agrees_is_accepted() -> None:
    cfg = parse_config(FOUR + BIG + 'extra_args = ["-tp", "2"]\n', "t.toml")
    assert cfg.serves["big"].vllm is not None


def test_a_single_role_vllm_serve_asking_for_two_gpus_is_refused() -> None:
    # What made vLLM fail with "World size (2) is larger than the number of available GPUs
    # (1)": now a config error before anything runs.
    text = FOUR + '[serves.one]\nrole = "d2"\nvram_mib = 1000\n[serves.one.vllm]\n' \
        'model = "m"\nextra_args = ["--tensor-parallel-size", "2"]\n'
    assert any("disagrees with the serve's 1 role(s)" in p for p in problems(text))


def test_vram_over_the_capacity_of_either_role_is_refused() -> None:
    text = FOUR.replace('[roles.d1]\ndevice = "GPU-sim-1"\n',
                        '[roles.d1]\ndevice = "GPU-sim-1"\ncapacity_mib = 20000\n') + BIG
    assert "serves.big.vram_mib: 30000 exceeds role 'd1' capacity_mib 20000" in problems(text)


def test_check_config_summary_lists_the_serve_under_each_role() -> None:
    lines = summary(parse_config(FOUR + BIG, "t.toml")).splitlines()
    assert "  big 30000 MiB (started by gpuctl start, priority 100; 1/2 of d0, d1)" in lines
    assert "  big 30000 MiB (started by gpuctl start, priority 100; 2/2 of d0, d1)" in lines


# ---- launch --------------------------------------------------------------------------------------


def test_vllm_argv_passes_the_tensor_parallel_size_and_the_smallest_total() -> None:
    cfg = parse_config(FOUR + '[serves.wide]\nroles = ["d0", "d2"]\nvram_mib = 30000\n'
                       'port = 30101\n[serves.wide.vllm]\nmodel = "org/wide"\n', "t.toml")
    total = smallest_total([81559, 40960])
    assert total == 40960
    argv = serve_argv(cfg.serves["wide"], total_mib=total, device_index=0, device_indexes=[0, 2],
                      vllm_executable="vllm")
    assert argv == ["vllm", "serve", "org/wide", "--host", "127.0.0.1", "--port", "30101",
                    "--gpu-memory-utilization", "0.7324", "--tensor-parallel-size", "2",
                    "--shutdown-timeout", "20"]
    # util x total within the reservation on every device: 0.7324 x 40960 = 29999.1.
    assert 0.7324 * 40960 <= 30000 and 0.7324 * 81559 > 30000  # why the smallest total
    assert smallest_total([81559, None]) is None


def test_command_placeholders_give_the_first_index_and_the_list() -> None:
    cfg = parse_config(FOUR + '[serves.c]\nroles = ["d3", "d1"]\nvram_mib = 4096\n'
                       'command = ["/opt/s", "--gpu", "{device_index}", "--gpus", '
                       '"{device_indexes}", "--util", "{gpu_memory_utilization}"]\n', "t.toml")
    argv = serve_argv(cfg.serves["c"], total_mib=40960, device_index=3, device_indexes=[3, 1],
                      vllm_executable="vllm")
    assert argv == ["/opt/s", "--gpu", "3", "--gpus", "3,1", "--util", "0.1000"]
    assert visible_devices([3, 1]) == "3,1"


def _environment(spec: UnitSpec) -> list[str]:
    props = {name: variant.value for name, variant in build_properties(spec, 252)}
    return list(props["Environment"])


def test_unit_environment_lists_the_devices_in_the_order_of_the_roles() -> None:
    spec = UnitSpec(serve="big", argv=("/bin/true",), device_index=2, device_indexes=(2, 0),
                    description="d")
    assert _environment(spec) == ["CUDA_DEVICE_ORDER=PCI_BUS_ID", "CUDA_VISIBLE_DEVICES=2,0"]
    one = UnitSpec(serve="one", argv=("/bin/true",), device_index=1, description="d")
    assert _environment(one) == ["CUDA_DEVICE_ORDER=PCI_BUS_ID", "CUDA_VISIBLE_DEVICES=1"]
    with pytest.raises(Exception, match="must be distinct"):
        UnitSpec(serve="bad", argv=("/bin/true",), device_index=1, device_indexes=(2, 1),
                 description="d")


def test_show_commands_shows_the_list_of_devices(tmp_path: Path) -> None:
    path = tmp_path / "serves.toml"
    path.write_text(FOUR + BIG)
    done = subprocess.run([sys.executable, "-m", "gpud.daemon", "--check-config", str(path),
                           "--show-commands"], capture_output=True, text=True, cwd=REPO,
                          check=False, timeout=60)
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    at = out.index("serve big: roles d0, d1, devices device 0 (GPU-sim-0, 81559 MiB); device 1 "
                   "(GPU-sim-1, 81559 MiB), 30000 MiB on each")
    env, argv = out[at + 1].split(), out[at + 2]
    assert "CUDA_VISIBLE_DEVICES=0,1" in env and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in env
    assert "GPUD_SIM_DEVICES=GPU-sim-0,GPU-sim-1" in env
    assert argv == ("  argv: vllm serve org/big --host 127.0.0.1 --port 30100 "
                    "--gpu-memory-utilization 0.3678 --tensor-parallel-size 2 "
                    "--shutdown-timeout 20")


# ---- store, schema 5 -------------------------------------------------------------------------


def test_a_two_role_reservation_is_two_rows_written_and_read_as_one(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    big = Reservation("big", "d0", 30000, 1.0, 0, False, ("d1",))
    store.commit(Changes(put=[big, Reservation("one", "d2", 100, 2.0)]))
    rows = sqlite3.connect(tmp_path / "s.db").execute(
        "SELECT serve, role, position, mib FROM reservations ORDER BY serve, position").fetchall()
    assert rows == [("big", "d0", 0, 30000), ("big", "d1", 1, 30000), ("one", "d2", 0, 100)]
    assert store.reservations() == [big, Reservation("one", "d2", 100, 2.0)]
    # Moving from two roles to one leaves nothing behind on the other.
    store.commit(Changes(put=[Reservation("big", "d3", 30000, 1.0)]))
    assert store.reservations()[0] == Reservation("big", "d3", 30000, 1.0)
    store.commit(Changes(delete=["big"]))
    assert [r.serve for r in store.reservations()] == ["one"]


def test_a_failed_transaction_leaves_a_two_role_reservation_whole(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    big = Reservation("big", "d0", 30000, 1.0, 0, False, ("d1",))
    store.commit(Changes(put=[big]))
    # A replacement whose second role row breaks the (serve, role) key fails after its old rows
    # were deleted and its first row written: the whole transaction rolls back.
    bad = Reservation("big", "d2", 100, 3.0, 0, False, ("d2",))
    with pytest.raises(StoreError, match="could not commit"):
        store.commit(Changes(put=[bad], events=[Event("admit", "big", 3.0, "big")]))
    assert store.reservations() == [big]
    assert store.events(EventQuery()) == []


def test_schema_4_rows_migrate_to_position_0(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    db = sqlite3.connect(path)
    db.executescript(";".join(MIGRATIONS[:4]) + "; PRAGMA user_version=4;")
    db.execute("INSERT INTO reservations VALUES ('a', 'r', 5, 1.0, 7, 0)")
    db.execute("INSERT INTO reservations VALUES ('e', 'r', 9, 2.0, NULL, 1)")
    db.commit()
    db.close()
    store = Store(path)
    assert schema_version(path) == SCHEMA_VERSION == 7
    assert store.reservations() == [Reservation("a", "r", 5, 1.0, 7, False),
                                    Reservation("e", "r", 9, 2.0, None, True)]


def test_rows_of_one_serve_that_disagree_are_refused(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    db = sqlite3.connect(tmp_path / "s.db")
    db.execute("INSERT INTO reservations VALUES ('big', 'a', 0, 10, 1.0, 0, 0)")
    db.execute("INSERT INTO reservations VALUES ('big', 'b', 1, 20, 1.0, 0, 0)")
    db.commit()
    with pytest.raises(StoreError, match="disagree"):
        store.reservations()


def test_events_of_a_two_role_serve_are_found_by_any_of_its_roles(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    store.commit(Changes(events=[
        Event("admit", "big", 1.0, "big", "d0", 10, details={"roles": ["d0", "d1"]}),
        Event("admit", "one", 2.0, "one", "d2", 10)]))
    assert [e.serve for e in store.events(EventQuery(roles=["d1"]))] == ["big"]
    assert [e.serve for e in store.events(EventQuery(roles=["d0", "d2"]))] == ["big", "one"]


# ---- the simulated backend: a draw on several devices ----------------------------------------


def test_a_registration_on_several_devices_draws_on_each(tmp_path: Path) -> None:
    devices = [SimulatedDevice(f"GPU-sim-{i}", 40960) for i in range(4)]
    state = tmp_path / "sim.json"
    state.write_text("{}")
    backend = SimulatedBackend(devices, state)
    register_process(backend.procs_dir, 1, "GPU-sim-1", 30000, also=["GPU-sim-3"])
    obs = backend.sample()
    used = {d.uuid: d.used_mib for d in obs.devices}
    assert used == {"GPU-sim-0": 0, "GPU-sim-1": 30000, "GPU-sim-2": 0, "GPU-sim-3": 30000}
    by_pid = {d.uuid: [(p.pid, p.mib) for p in d.processes or ()] for d in obs.devices}
    assert by_pid["GPU-sim-3"] == [(1, 30000)]
    env = backend.environment_for("GPU-sim-1", "GPU-sim-3")
    assert env["GPUD_SIM_DEVICES"] == "GPU-sim-1,GPU-sim-3"
    assert "GPUD_SIM_DEVICES" not in backend.environment_for("GPU-sim-1")


def test_the_standin_registers_its_draw_on_every_device_it_is_given(tmp_path: Path) -> None:
    from gpud.host import simulation
    from gpud.testing import standin as standin_mod
    from tests.test_standin import free_port, registrations
    from tests.waiting import wait_until

    assert standin_mod.GPUD_SIM_DEVICES == simulation.GPUD_SIM_DEVICES
    procs = tmp_path / "procs"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUD_SIM_")}
    env |= simulation.standin_environment(procs, "GPU-sim-1", 40960, ["GPU-sim-3"])
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gpud.testing.standin", "--port", str(port),
                             "--gpu-memory-utilization", "0.5"], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: len(registrations(procs)) == 1, what="the engine's draw")
        (record,) = registrations(procs).values()
        assert (record["device"], record["also_devices"], record["mib"]) == \
            ("GPU-sim-1", ["GPU-sim-3"], 20480)
        backend = SimulatedBackend([SimulatedDevice(f"GPU-sim-{i}", 40960) for i in range(4)],
                                   tmp_path / "sim.json", procs_dir=procs)
        (tmp_path / "sim.json").write_text("{}")
        used = {d.uuid: d.used_mib for d in backend.sample().devices}
        assert used == {"GPU-sim-0": 0, "GPU-sim-1": 20480, "GPU-sim-2": 0, "GPU-sim-3": 20480}
    finally:
        proc.terminate()
        proc.wait(10)
    assert registrations(procs) == {}  # gone from every device with the process


def test_the_fingerprint_follows_the_number_of_devices_only_when_there_are_several() -> None:
    from gpud.core.launch import fingerprint

    cfg = parse_config(FOUR + BIG + '[serves.one]\nrole = "d2"\nvram_mib = 1000\n'
                       '[serves.one.vllm]\nmodel = "org/big"\n'
                       '[serves.three]\nroles = ["d0", "d1", "d2"]\nvram_mib = 1000\n'
                       '[serves.three.vllm]\nmodel = "org/big"\n', "t.toml")
    prints = {n: fingerprint(s) for n, s in cfg.serves.items()}
    assert len(set(prints.values())) == 3
    # A serve on one device keeps the fingerprint it always had (its calibrations stay valid):
    # the hash of the same keys as before serves could span devices.
    import hashlib
    import json

    before = {"model": "org/big", "revision": None, "quantization": None, "max_model_len": None,
              "extra_args": [], "command": None}
    assert prints["one"] == hashlib.sha256(
        json.dumps(before, sort_keys=True).encode()).hexdigest()[:16]


# ---- plans ---------------------------------------------------------------------------------------


def test_a_plan_moves_a_running_serve_from_one_role_to_two_and_sizes_it_on_the_smallest() -> None:
    from gpud.config import Config
    from gpud.core.ledger import Ledger, RoleBudget
    from gpud.core.plan import make_plan

    def cfg(serves: dict[str, dict[str, object]]) -> Config:
        return Config.model_validate({
            "roles": {"a": {"device": "0", "capacity_mib": 40000},
                      "b": {"device": "1", "capacity_mib": 20000, "reserve_mib": 2000}},
            "serves": {n: {"command": ["/bin/true"], **s} for n, s in serves.items()}})

    old = cfg({"big": {"role": "a", "vram_mib": 10000, "resident": True},
               "side": {"role": "b", "vram_mib": 9000, "resident": True}})
    new = cfg({"big": {"roles": ["a", "b"], "vram_mib": 10000, "resident": True},
               "side": {"role": "b", "vram_mib": 9000, "resident": True}})
    budgets = [RoleBudget("a", "0", 40000, 0), RoleBudget("b", "1", 20000, 2000)]
    held = Ledger.build(budgets, [Reservation("big", "a", 10000, 1.0),
                                  Reservation("side", "b", 9000, 2.0)])
    states = {"big": "running", "side": "running"}
    plan = make_plan(old=old, new=new, ledger=held, new_budgets=budgets, states=states,
                     totals={"0": 40000, "1": 20000}, source="t")
    big = next(s for s in plan.serves if s.name == "big")
    assert (big.role_before, big.role_after, big.restart) == ("a", "a+b", True)
    # Against the smallest total (20000), not the first device's 40000.
    assert (big.util_before, big.util_after) == ("0.2500", "0.5000")
    assert plan.stop_first == ("big",)
    # b: side 9000 + big 10000 = 19000 > 20000 - 2000: the move does not fit there.
    assert [b.what for b in plan.blocked] == ["roles.b"]
    smaller = cfg({"big": {"roles": ["a", "b"], "vram_mib": 9000, "resident": True},
                   "side": {"role": "b", "vram_mib": 9000, "resident": True}})
    plan = make_plan(old=old, new=smaller, ledger=held, new_budgets=budgets, states=states,
                     totals={"0": 40000, "1": 20000}, source="t")
    assert plan.ok, plan.blocked
    assert {n: f.committed_mib for n, _, f in plan.roles if f} == {"a": 9000, "b": 18000}


# ---- the service: a failed transaction leaves the serve's reservation as it was ---------------


def test_a_failed_commit_of_a_two_role_admission_or_release_changes_nothing(
        tmp_path: Path) -> None:
    import asyncio

    from gpud.life.service import LedgerService
    from tests.test_group_commit import GatedStore

    text = ('[daemon]\nadmission = "ledger"\n[roles.a]\ndevice = "0"\ncapacity_mib = 1000\n'
            '[roles.b]\ndevice = "1"\ncapacity_mib = 1000\n'
            '[serves.big]\nroles = ["a", "b"]\nvram_mib = 600\ncommand = ["/bin/true"]\n')
    store = GatedStore(tmp_path / "gpud.sqlite3")
    svc = LedgerService(parse_config(text, "t"), store)
    svc.load()

    def committed() -> tuple[int, int]:
        return svc.ledger.figures("a").committed_mib, svc.ledger.figures("b").committed_mib

    async def run() -> None:
        store.fail_next = True
        with pytest.raises(StoreError):
            await svc.admit("big", 600)
        assert committed() == (0, 0) and store.reservations() == []
        await svc.admit("big", 600)
        assert committed() == (600, 600)
        store.fail_next = True
        with pytest.raises(StoreError):
            await svc.release("big")
        assert committed() == (600, 600)
        assert [r.all_roles for r in store.reservations()] == [("a", "b")]
        # the next decision starts from what is durable: the release goes through whole
        await svc.release("big")
        assert committed() == (0, 0) and store.reservations() == []

    try:
        asyncio.run(run())
    finally:
        svc.close()
        store.close()


def test_a_serve_dumps_as_written_and_moving_it_to_more_devices_needs_root() -> None:
    from gpud.core.authority import needs_root

    one = parse_config(FOUR + BIG.replace('roles = ["d0", "d1"]', 'role = "d0"'), "t.toml")
    two = parse_config(FOUR + BIG, "t.toml")
    assert "roles" not in one.model_dump()["serves"]["big"]  # as before roles existed
    dumped = two.model_dump()["serves"]["big"]
    assert "role" not in dumped and dumped["roles"] == ["d0", "d1"]
    assert type(two).model_validate(two.model_dump()) == two
    assert needs_root(one, two) and needs_root(two, one)
    more = parse_config(FOUR + BIG.replace("vram_mib = 30000", "vram_mib = 31000"), "t.toml")
    assert needs_root(two, more) == []  # a figure: the admin group may change it


# ---- container serves on several devices -----------------------------------------------------


def test_a_container_serve_on_two_roles_gets_both_devices_and_the_tensor_parallel_size() -> None:
    from gpud.config import ServeConfig

    image = "docker.io/vllm/vllm-openai@sha256:" + "0123456789abcdef" * 4
    vllm = ServeConfig.model_validate({
        "roles": ["a", "b"], "vram_mib": 20000, "port": 30001,
        "vllm": {"model": "org/big"}, "container": {"image": image}})
    argv = serve_argv(vllm, total_mib=40960, device_index=2, device_indexes=[2, 3],
                      vllm_executable="vllm", name="big", cdi_devices=["GPU-a", "GPU-b"],
                      forward_env=["CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"])
    assert [a for a in argv if a.startswith("--device=")] == [
        "--device=nvidia.com/gpu=GPU-a", "--device=nvidia.com/gpu=GPU-b"]
    assert not any(a.startswith("--env=CUDA_") for a in argv)  # CDI numbers them inside
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    args = ServeConfig.model_validate({
        "roles": ["a", "b"], "vram_mib": 20000, "port": 30002,
        "container": {"image": image, "args": ["--gpus", "{device_indexes}", "--first",
                                               "{device_index}"]}})
    argv = serve_argv(args, total_mib=40960, device_index=2, device_indexes=[2, 3],
                      vllm_executable="vllm", name="c", cdi_devices=["2", "3"])
    # Inside the container its devices are numbered from 0, in the order of its roles.
    assert argv[-4:] == ["--gpus", "0,1", "--first", "0"]
