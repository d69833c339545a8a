"""How serves are run: the vllm argv (golden), placeholders, the execv shim, fingerprints,
and calibration's recommendation."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from gpud.config import DaemonConfig, ServeConfig, parse_config
from gpud.core.argv64 import decode, encode
from gpud.core.launch import (
    SERVE_CACHE,
    SERVE_CACHE_PATH,
    Hardening,
    Identity,
    command_argv,
    container_argv,
    fingerprint,
    reload_alters_arguments,
    serve_argv,
    serve_environment,
    serve_identity,
    show_commands,
    stop_budget,
    tells_abort,
    through_shim,
    unit_restart,
    vllm_argv,
    vllm_environment,
)
from gpud.core.observation import DeviceSample
from gpud.errors import Refused, Unavailable
from gpud.life.calibration import recommend
from gpud.vllm.vllm_flags import DEFAULT_VERSION, check_serve_args, load_table
from tests.conftest import REPO, example_toml


def example_serves():  # type: ignore[no-untyped-def]
    return parse_config(example_toml(), "etc/serves.toml").serves


def _passes_the_flag_table(argv: list[str]) -> list[str]:
    assert argv[1] == "serve"
    return [p.message for p in check_serve_args(argv[2:], load_table(DEFAULT_VERSION))]


def test_vllm_argv_golden() -> None:
    argv = serve_argv(example_serves()["fast"], total_mib=32607, device_index=0,
                      vllm_executable="/opt/vllm/bin/vllm")
    assert argv == [
        "/opt/vllm/bin/vllm", "serve", "leon-se/gemma-4-E4B-it-FP8-Dynamic",
        "--host", "127.0.0.1", "--port", "30001", "--gpu-memory-utilization", "0.4396",
        "--max-model-len", "32768", "--shutdown-timeout", "20",
    ]
    assert _passes_the_flag_table(argv) == []


def test_vllm_argv_with_every_key_passes_the_table() -> None:
    serve = ServeConfig.model_validate({
        "role": "r", "vram_mib": 8192, "port": 30009, "stop_timeout_s": 12.0,
        "vllm": {"model": "org/m", "revision": "a" * 40, "quantization": "awq",
                 "max_model_len": 8192, "host": "::", "kv_cache_mib": 2048,
                 "extra_args": ["--served-model-name", "m", "m2", "--enforce-eager",
                                "--compilation-config.cudagraph_mode", "NONE"]}})
    argv = serve_argv(serve, total_mib=81559, device_index=0, vllm_executable="vllm")
    assert argv == [
        "vllm", "serve", "org/m", "--revision", "a" * 40, "--host", "::", "--port", "30009",
        "--gpu-memory-utilization", "0.1004", "--max-model-len", "8192", "--quantization", "awq",
        "--kv-cache-memory-bytes", str(2048 << 20), "--shutdown-timeout", "4",
        "--served-model-name", "m", "m2", "--enforce-eager",
        "--compilation-config.cudagraph_mode", "NONE",
    ]
    assert _passes_the_flag_table(argv) == []


def test_every_example_vllm_argv_passes_the_table() -> None:
    serves = example_serves()
    checked = 0
    for name, serve in serves.items():
        if serve.vllm is not None:
            argv = serve_argv(serve, total_mib=32607, device_index=0, vllm_executable="vllm",
                              name=name)
            assert _passes_the_flag_table(argv) == [], name
            checked += 1
    assert checked == 3


def test_vllm_argv_uses_the_current_reservation_and_extra_args() -> None:
    argv = serve_argv(example_serves()["embeddings"], total_mib=32607, device_index=0,
                      vllm_executable="vllm", vram_mib=4096)
    assert argv == ["vllm", "serve", "BAAI/bge-m3", "--host", "127.0.0.1", "--port", "30003",
                    "--gpu-memory-utilization", "0.1256", "--shutdown-timeout", "20",
                    "--runner", "pooling"]


def test_no_guessed_utilization() -> None:
    serves = example_serves()
    with pytest.raises(Unavailable, match="device total is unknown"):
        serve_argv(serves["fast"], total_mib=None, device_index=0, vllm_executable="vllm",
                   name="fast")
    with pytest.raises(Refused, match=r"0\.0000.*reserve at least 9 MiB"):
        serve_argv(serves["fast"], total_mib=81559, device_index=0, vllm_executable="vllm",
                   vram_mib=8, name="fast")
    # A command that does not ask for the utilization needs no total.
    plain = serves["ocr"].model_copy(update={"command": ["/bin/x", "--port", "{port}"]})
    assert serve_argv(plain, total_mib=None, device_index=0, vllm_executable="vllm") == [
        "/bin/x", "--port", "30007"]
    with pytest.raises(Unavailable):
        serve_argv(serves["ocr"], total_mib=None, device_index=0, vllm_executable="vllm")


@pytest.mark.parametrize(("stop_s", "drain", "worker"), [
    (30.0, 20, 5), (15.0, 5, 5), (14.9, 6, 4), (10.0, 4, 3), (3.0, 1, 1), (1.0, 0, 1),
    (0.5, 0, 1),
])
def test_graceful_stop_fits_in_stop_timeout(stop_s: float, drain: int, worker: int) -> None:
    assert stop_budget(stop_s) == (drain, worker)
    # A drain leaves the engine its window and one spare before systemd's SIGKILL.
    assert drain == 0 or drain + 2 * worker <= stop_s


def test_vllm_environment() -> None:
    fast = example_serves()["fast"].model_copy(update={"start_timeout_s": 1200.5})
    assert vllm_environment(fast) == {
        "VLLM_ENGINE_READY_TIMEOUT_S": "1201", "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "5",
        "VLLM_NO_USAGE_STATS": "1"}
    mine = fast.model_copy(update={"environment": {"VLLM_NO_USAGE_STATS": "0", "HF_HOME": "/h"}})
    env = serve_environment(mine)
    assert env["VLLM_NO_USAGE_STATS"] == "0" and env["HF_HOME"] == "/h"
    assert serve_environment(example_serves()["ocr"]) == {}


def test_command_placeholders() -> None:
    argv = serve_argv(example_serves()["ocr"], total_mib=32607, device_index=1,
                      vllm_executable="vllm")
    assert argv == ["/opt/serves/bin/ocr-serve", "--port", "30007",
                    "--gpu-memory-utilization", "0.1570"]


def test_shim_only_for_arguments_systemd_252_alters() -> None:
    plain = ["/bin/x", "--a", "%n", "two words"]
    assert through_shim(plain, "/usr/bin/python3", 252) == plain
    fragile = ["/bin/x", "$HOME", "a;b"]
    wrapped = through_shim(fragile, "/usr/bin/python3", 252)
    assert wrapped[:4] == ["/usr/bin/python3", "-I", "-m", "gpud.execv"]
    assert all(c.isalnum() or c in "-_" for c in wrapped[4])
    assert decode(wrapped[4]) == fragile
    assert through_shim(fragile, "/usr/bin/python3", 256) == fragile


def test_execv_shim_execs_the_command_literally() -> None:
    argv = [sys.executable, "-c", "import sys; print(sys.argv[1:])", "$HOME", "a;b", "%n"]
    out = subprocess.run([sys.executable, "-m", "gpud.execv", encode(argv)], capture_output=True,
                         text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "['$HOME', 'a;b', '%n']"
    with pytest.raises(ValueError):
        decode(encode([]))


def test_fingerprint_follows_what_defines_the_serve() -> None:
    serves = example_serves()
    fast = serves["fast"]
    same = fast.model_copy(update={"vram_mib": 10000, "priority": 1, "port": 1234})
    assert fingerprint(same) == fingerprint(fast)  # reservation and placement are not identity
    for change in ({"revision": "f" * 40}, {"quantization": "fp8"}, {"max_model_len": 8192},
                   {"model": "other/model"}, {"kv_cache_mib": 1024}):
        changed = fast.model_copy(update={"vllm": fast.vllm.model_copy(update=change)})
        assert fingerprint(changed) != fingerprint(fast), change
    ocr = serves["ocr"]
    assert fingerprint(ocr.model_copy(update={"command": [*ocr.command, "--x"]})) != \
        fingerprint(ocr)


@pytest.mark.parametrize(("samples", "expected"), [
    ([3197, 3197, 3197], (3197, 3197, 3584)),
    ([11000, 11500, 11766], (11500, 11766, 12544)),  # 5% margin beats 256
    ([100], (100, 100, 512)),
])
def test_recommendation(samples: list[int], expected: tuple[int, int, int]) -> None:
    assert recommend(samples) == expected
    _steady, peak, rec = recommend(samples)
    assert rec % 256 == 0 and rec >= peak + 256


def test_recommendation_needs_samples() -> None:
    with pytest.raises(ValueError):
        recommend([])


def _check_config(tmp_path, text: str, *args: str) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    path = tmp_path / "serves.toml"
    path.write_text(text)
    return subprocess.run([sys.executable, "-m", "gpud.daemon", "--check-config", str(path), *args],
                          capture_output=True, text=True, cwd=REPO, check=False, timeout=60)


def test_show_commands_prints_what_would_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    text = example_toml().replace('device = "0"', 'device = "GPU-sim-0"')
    text += '[simulation]\nstate_file = "/nonexistent/sim.json"\n[[simulation.devices]]\n' \
            'uuid = "GPU-sim-0"\ntotal_mib = 32607\n'
    done = _check_config(tmp_path, text, "--show-commands")
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert "device totals from the simulation table (no real GPU):" in out
    at = out.index("serve fast: role dark-fast, device 0 (GPU-sim-0, 32607 MiB), 14336 MiB")
    env, argv = out[at + 1], out[at + 2]
    for pair in ("CUDA_DEVICE_ORDER=PCI_BUS_ID", "CUDA_VISIBLE_DEVICES=0",
                 "VLLM_ENGINE_READY_TIMEOUT_S=900", "VLLM_NO_USAGE_STATS=1",
                 "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS=5"):
        assert pair in env.split(), pair
    assert argv == ("  argv: vllm serve leon-se/gemma-4-E4B-it-FP8-Dynamic --host 127.0.0.1 --port "
                    "30001 --gpu-memory-utilization 0.4396 --max-model-len 32768 "
                    "--shutdown-timeout 20")
    assert out[at + 3] == "  runs as: gpud-serve, hardened unit"
    assert "HF_HOME=/var/cache/gpud-serve/huggingface" in env.split()


def test_show_commands_without_a_device_total_refuses(tmp_path) -> None:  # type: ignore[no-untyped-def]
    text = example_toml().replace('device = "0"', 'device = "7"')
    done = _check_config(tmp_path, text, "--show-commands")
    assert done.returncode == 0, done.stderr
    assert "  refused: serve fast: the device total is unknown" in done.stdout
    assert "argv:" not in done.stdout


def test_check_config_names_the_removed_option(tmp_path) -> None:  # type: ignore[no-untyped-def]
    text = example_toml().replace('"--runner", "pooling"', '"--task", "embed"')
    done = _check_config(tmp_path, text)
    assert done.returncode == 2
    assert ("serves.embeddings.vllm.extra_args[0]: --task was removed (not an option of vLLM "
            "0.33.0); use --runner pooling") in done.stderr
    assert _check_config(tmp_path, "", "--show-commands").returncode == 0
    assert subprocess.run([sys.executable, "-m", "gpud.daemon", "--show-commands"], cwd=REPO,
                          capture_output=True, check=False).returncode == 2


def test_context_mib_keeps_util_x_total_plus_context_inside_the_reservation() -> None:
    fast = example_serves()["fast"]
    ctx = fast.model_copy(update={"vllm": fast.vllm.model_copy(update={"context_mib": 400})})
    argv = serve_argv(ctx, total_mib=32607, device_index=0, vllm_executable="vllm")
    util = argv[argv.index("--gpu-memory-utilization") + 1]
    assert util == "0.4273"  # floor((14336 - 400) / 32607, 4 decimals)
    budget = 4273 * 32607 // 10_000
    # All of the reservation, never more (4 decimals of util: 3.3 MiB of 32607, plus a floor).
    assert 0 <= 14336 - (budget + 400) < 32607 / 10_000 + 1
    assert fingerprint(ctx) == fingerprint(fast)  # a sizing figure, not what the serve is
    tiny = ctx.model_copy(update={"vram_mib": 400})
    with pytest.raises(Refused, match=r"does not cover its vllm\.context_mib"):
        serve_argv(tiny, total_mib=32607, device_index=0, vllm_executable="vllm")


# ---- in-process: show_commands, the refusals and the figures at their edges ------------------


def _config(text: str):  # type: ignore[no-untyped-def]
    return parse_config(textwrap.dedent(text), "t.toml")


SHOW = """
[roles.r]
device = "GPU-a"
capacity_mib = 20000
[roles.idx]
device = "7"
capacity_mib = 1000
[roles.lost]
device = "GPU-nowhere"
capacity_mib = 1000
[serves.late]
role = "r"
vram_mib = 2000
priority = 1
command = ["/bin/s", "{gpu_memory_utilization}", "{device_index}"]
environment = { A = "x y" }
[serves.early]
role = "idx"
vram_mib = 100
priority = 0
command = ["/bin/e", "{port}"]
port = 9
[serves.b-same]
role = "lost"
vram_mib = 100
priority = 1
command = ["/bin/b"]
[serves.a-same]
role = "r"
vram_mib = 2
priority = 1
command = ["/bin/a", "{gpu_memory_utilization}"]
"""


CACHE_ENV = (" HF_HOME=/var/cache/gpud-serve/huggingface HOME=/var/cache/gpud-serve"
             " VLLM_CACHE_ROOT=/var/cache/gpud-serve/vllm XDG_CACHE_HOME=/var/cache/gpud-serve")


def test_show_commands_lists_every_serve_by_priority_then_name() -> None:
    dev = DeviceSample("GPU-a", 3, "00000000:03:00.0", "GPU", 30000, 0, 30000)
    seen: list[str] = []

    def extra(uuid: str) -> dict[str, str]:
        seen.append(uuid)
        return {"SIM": uuid}

    lines = show_commands(_config(SHOW), (dev,), "NVML", extra)
    assert lines == [
        "device totals from NVML:",
        "  3: GPU-a 30000 MiB",
        "serve early: role idx, device '7' (total unknown), 100 MiB",
        "  environment: CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=7" + CACHE_ENV,
        "  argv: /bin/e 9",
        "  runs as: gpud-serve, hardened unit",
        "serve a-same: role r, device 3 (GPU-a, 30000 MiB), 2 MiB",
        "  refused: serve a-same: 2 MiB of a 30000 MiB device is --gpu-memory-utilization "
        "0.0000, which vLLM refuses (it must be > 0); reserve at least 3 MiB",
        "serve b-same: role lost, device 'GPU-nowhere' (total unknown), 100 MiB",
        "  refused: device 'GPU-nowhere' cannot be resolved to an index",
        "serve late: role r, device 3 (GPU-a, 30000 MiB), 2000 MiB",
        "  environment: 'A=x y' CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=3 HF_HOME="
        "/var/cache/gpud-serve/huggingface HOME=/var/cache/gpud-serve SIM=GPU-a VLLM_CACHE_ROOT="
        "/var/cache/gpud-serve/vllm XDG_CACHE_HOME=/var/cache/gpud-serve",
        "  argv: /bin/s 0.0666 3",
        "  runs as: gpud-serve, hardened unit",
    ]
    assert set(seen) == {"GPU-a"}  # asked only about a device it knows


def test_show_commands_without_devices() -> None:
    lines = show_commands(_config('[roles.r]\ndevice = "0"\ncapacity_mib = 10\n'), (), "NVML")
    assert lines == ["device totals from NVML:", "  none known"]


@pytest.mark.parametrize(("total", "least"), [(10_001, 2), (19_999, 2), (30_001, 4)])
def test_the_least_reservation_named_is_exact(total: int, least: int) -> None:
    """util = floor(mib / total, 4 decimals) > 0 exactly when mib >= total / 10000."""
    serve = ServeConfig(role="r", vram_mib=least, command=["/x", "{gpu_memory_utilization}"])
    with pytest.raises(Refused, match=f"reserve at least {least} MiB"):
        serve_argv(serve, total_mib=total, device_index=0, vllm_executable="v",
                   vram_mib=least - 1)
    assert serve_argv(serve, total_mib=total, device_index=0, vllm_executable="v") == [
        "/x", "0.0001"]


def test_a_command_serve_hands_out_its_whole_reservation() -> None:
    serve = ServeConfig(role="r", vram_mib=5000, command=["/x", "{gpu_memory_utilization}"])
    assert serve_argv(serve, total_mib=10_000, device_index=0, vllm_executable="v") == [
        "/x", "0.5000"]


def test_a_budget_of_one_mib_is_still_a_budget() -> None:
    fast = example_serves()["fast"]
    ctx = fast.model_copy(update={"vram_mib": 1001,
                                  "vllm": fast.vllm.model_copy(update={"context_mib": 1000})})
    argv = serve_argv(ctx, total_mib=10_000, device_index=0, vllm_executable="vllm")
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.0001"


def test_argv_builders_refuse_the_other_kind_of_serve() -> None:
    serves = example_serves()
    with pytest.raises(ValueError, match="not a vllm serve"):
        vllm_argv(serves["ocr"], executable="v", util="0.1")
    with pytest.raises(ValueError, match="not a command serve"):
        command_argv(serves["fast"], util="0.1", device_index=0)


def test_systemd_253_keeps_arguments_across_a_reload() -> None:
    assert reload_alters_arguments(252) and reload_alters_arguments(None)
    assert not reload_alters_arguments(253)
    assert through_shim(["/bin/x", "$A"], "/py", 253) == ["/bin/x", "$A"]


def test_a_fingerprint_is_16_hex_digits() -> None:
    fp = fingerprint(example_serves()["fast"])
    assert len(fp) == 16 and int(fp, 16) >= 0


IMAGE = "docker.io/vllm/vllm-openai@sha256:" + "0123456789abcdef" * 4


def _container(**container: object) -> ServeConfig:
    return ServeConfig.model_validate({"role": "r", "vram_mib": 1000, "port": 30001,
                                       "command": None,
                                       "container": {"image": IMAGE, **container}})


def test_show_commands_names_the_container_device_by_its_uuid() -> None:
    cfg = _config(f"""
        [roles.r]
        device = "GPU-a"
        capacity_mib = 10000
        [serves.s]
        role = "r"
        vram_mib = 1000
        [serves.s.container]
        image = "{IMAGE}"
        args = ["--x"]
        """)
    dev = DeviceSample("GPU-a", 2, "", "", 10000, None, None)
    lines = show_commands(cfg, (dev,), "NVML", cdi_names={"GPU-a"})
    [argv] = [line for line in lines if line.startswith("  argv: ")]
    assert "--device=nvidia.com/gpu=GPU-a" in argv.split()


def test_container_argv_refuses_a_serve_without_a_container() -> None:
    with pytest.raises(ValueError, match="not a container serve"):
        container_argv("s", example_serves()["ocr"], [], devices=[], forward_env=[])


def test_a_container_serves_fingerprint_follows_its_args() -> None:
    assert fingerprint(_container(args=["--a"])) != fingerprint(_container(args=["--b"]))
    assert fingerprint(_container(args=["--a"])) == fingerprint(_container(args=["--a"]))


def test_a_sleeping_vllm_serve_gets_sleep_mode_and_dev_mode() -> None:
    fast = example_serves()["fast"].model_copy(update={"sleep_level": 1})
    argv = serve_argv(fast, total_mib=32607, device_index=0, vllm_executable="vllm")
    assert argv[-1] == "--enable-sleep-mode"
    assert _passes_the_flag_table(argv) == []
    assert vllm_environment(fast)["VLLM_SERVER_DEV_MODE"] == "1"
    assert "VLLM_SERVER_DEV_MODE" not in vllm_environment(example_serves()["fast"])


def test_a_vllm_serves_unit_restarts_always() -> None:
    # vLLM exits 0 after its engine died: on-failure would not restart it
    serves = parse_config(textwrap.dedent("""
        [roles.r]
        device = "0"
        capacity_mib = 1000
        [serves.v]
        role = "r"
        vram_mib = 100
        port = 30001
        [serves.v.vllm]
        model = "m"
        [serves.never]
        role = "r"
        vram_mib = 100
        port = 30002
        restart = "no"
        [serves.never.vllm]
        model = "m"
        [serves.c]
        role = "r"
        vram_mib = 100
        command = ["/bin/serve"]
        """), "t").serves
    assert unit_restart(serves["v"]) == "always"
    assert unit_restart(serves["never"]) == "no"
    assert unit_restart(serves["c"]) == "on-failure"


def test_a_vllm_serve_without_a_port_is_not_launched() -> None:
    serve = ServeConfig.model_validate({"role": "r", "vram_mib": 1000, "vllm": {"model": "m"}})
    with pytest.raises(Refused, match=r"serve x: a vllm serve needs a port \(serves.x.port\): "
                                      "without --port vLLM binds 8000"):
        serve_argv(serve, total_mib=32607, device_index=0, vllm_executable="vllm", name="x")


def test_kv_cache_fit_mib() -> None:
    from gpud.core.launch import kv_cache_fit_mib

    figures = {"budget_mib": 8000, "context_mib": 500, "kv_cache_mib": 3000}
    assert kv_cache_fit_mib(10000, figures) == (
        10000 - 500 - 5000 - 200,
        "vram_mib 10000 - context 500 - weights, activation peak and CUDA graphs 5000 - "
        "margin 200")
    # vLLM's own recommendation, when it gave one, wins over the KV cache it sized
    assert kv_cache_fit_mib(10000, {**figures, "recommended_kv_cache_mib": 2800})[0] == 4100
    assert kv_cache_fit_mib(1000, figures) == (
        None, "no room for a KV cache: vram_mib 1000 - context 500 - weights, activation peak "
        "and CUDA graphs 5000 - margin 64 = -4564 MiB")
    assert kv_cache_fit_mib(10000, {"kv_cache_mib": 3000})[0] is None


# --- as whom a serve runs ----------------------------------------------------------------------

HOMES = {"gpud-serve": "/var/cache/gpud-serve", "alice": "/home/alice", "root": "/root",
         "daemon": "/usr/sbin"}


def _identity(serve: dict[str, object], *, front_group: str | None = None,
              writable: tuple[str, ...] = (), daemon: dict[str, object] | None = None) -> Identity:
    config = ServeConfig.model_validate({"role": "r", "vram_mib": 1000, **serve})
    return serve_identity("s", config, DaemonConfig.model_validate(daemon or {}),
                          home_of=HOMES.get, front_group=front_group, writable=writable)


def test_a_serve_runs_as_the_unprivileged_default_with_its_cache() -> None:
    ident = _identity({"command": ["/bin/x"]}, front_group="gpud-front",
                      writable=("/run/gpud/sim-procs",))
    assert ident.user == "gpud-serve"
    assert ident.hardening == Hardening("yes", ("/run/gpud/sim-procs", "/run/gpud/serves"),
                                        SERVE_CACHE, ("gpud-front",))
    # every cache vLLM and Hugging Face keep lies in the one directory it may write
    assert dict(ident.environment) == {
        "HOME": "/var/cache/gpud-serve", "XDG_CACHE_HOME": "/var/cache/gpud-serve",
        "HF_HOME": "/var/cache/gpud-serve/huggingface",
        "VLLM_CACHE_ROOT": "/var/cache/gpud-serve/vllm"}
    assert f"/var/cache/{SERVE_CACHE}" == SERVE_CACHE_PATH
    unfronted = _identity({"vllm": {"model": "m"}})
    assert unfronted.hardening is not None
    assert unfronted.hardening.read_write_paths == ()
    assert unfronted.hardening.supplementary_groups == ()


def test_root_only_when_the_config_says_so() -> None:
    assert _identity({"command": ["/bin/x"], "user": "root"}) == Identity("root", {}, None)
    everyone = _identity({"command": ["/bin/x"]}, daemon={"serve_user": "root"})
    assert everyone == Identity("root", {}, None)


def test_a_named_user_runs_as_itself_with_its_home_writable() -> None:
    ident = _identity({"command": ["/bin/x"], "user": "alice"}, front_group="gpud-front")
    assert ident.user == "alice"
    assert ident.environment == {}  # its own HOME, from the user database
    assert ident.hardening == Hardening("no", ("/run/gpud/serves", "-/home/alice"), None,
                                        ("gpud-front",))
    # a home of / is no home: nothing more is made writable
    daemon = _identity({"command": ["/bin/x"], "user": "daemon"})
    assert daemon.hardening is not None and daemon.hardening.read_write_paths == ("-/usr/sbin",)


def test_a_user_the_host_lacks_is_named_by_its_key() -> None:
    with pytest.raises(Unavailable, match=r"^serves\.s\.user: no user 'bob' on this host$") as info:
        _identity({"command": ["/bin/x"], "user": "bob"})
    assert info.value.details == {"serve": "s", "user": "bob", "key": "serves.s.user"}
    with pytest.raises(Unavailable, match=r"^daemon\.serve_user: no user 'nobody-here' on this "
                                          r"host \(the package creates it"):
        _identity({"command": ["/bin/x"]}, daemon={"serve_user": "nobody-here"})


def test_a_container_serve_stays_root_unless_it_names_a_user() -> None:
    container = {"container": {"image": IMAGE}, "vllm": {"model": "m"}}
    assert _identity(container) == Identity(None, {}, None)
    assert _identity({**container, "user": "alice"}) == Identity("alice", {}, None)


def test_check_config_refuses_a_user_the_host_lacks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    text = example_toml()
    text = text.replace("priority = 40\n", 'priority = 40\nuser = "gpud-no-such-user"\n', 1)
    assert 'user = "gpud-no-such-user"' in text
    done = _check_config(tmp_path, text)
    assert done.returncode == 2, done.stdout
    assert done.stderr.strip() == (f"{tmp_path / 'serves.toml'}: serves.ocr.user: no user "
                                   "'gpud-no-such-user' on this host")
    # the default identity missing is the package's to make: said, not refused
    default = _check_config(tmp_path, example_toml().replace(
        "[daemon]\n", '[daemon]\nserve_user = "gpud-no-such-user"\n', 1))
    assert default.returncode == 0, default.stderr
    assert ("warning: daemon.serve_user: no user 'gpud-no-such-user' on this host: the serves "
            "without their own `user` cannot start") in default.stdout


def test_a_vllm_serve_behind_the_router_runs_the_priority_policy() -> None:
    """Behind the router a vllm serve gets --scheduling-policy priority (the body's priority,
    a key's and each requester's first request first, is ordered by only under it), before
    its extra_args; an operator's choice of a policy in extra_args stands, in either form."""
    fast = example_serves()["fast"]
    argv = serve_argv(fast, total_mib=32607, device_index=0,
                      vllm_executable="/opt/vllm/bin/vllm", behind_router=True)
    assert argv == [
        "/opt/vllm/bin/vllm", "serve", "leon-se/gemma-4-E4B-it-FP8-Dynamic",
        "--host", "127.0.0.1", "--port", "30001", "--gpu-memory-utilization", "0.4396",
        "--max-model-len", "32768", "--shutdown-timeout", "20",
        "--scheduling-policy", "priority",
    ]
    assert _passes_the_flag_table(argv) == []
    for chosen in (["--scheduling-policy", "fcfs"], ["--scheduling-policy=fcfs"],
                   ["--scheduling-policy", "priority"]):
        own = fast.model_copy(update={"vllm": fast.vllm.model_copy(  # type: ignore[union-attr]
            update={"extra_args": chosen})})
        argv = serve_argv(own, total_mib=32607, device_index=0, vllm_executable="vllm",
                          behind_router=True)
        assert argv.count("--scheduling-policy") + sum(
            a.startswith("--scheduling-policy=") for a in argv) == 1, argv
        assert argv[-len(chosen):] == chosen
    # not behind the router: as it was
    assert "--scheduling-policy" not in serve_argv(fast, total_mib=32607, device_index=0,
                                                   vllm_executable="vllm")


@pytest.mark.parametrize(("args", "policy"), [
    ([], None), (["--scheduling-policy", "fcfs"], "fcfs"), (["--scheduling-policy=priority"],
                                                            "priority"),
    (["--enforce-eager", "--scheduling-policy", "priority", "-tp", "2"], "priority"),
])
def test_scheduling_policy_read_from_args(args: list[str], policy: str | None) -> None:
    from gpud.core.launch import scheduling_policy
    assert scheduling_policy(args) == policy


def test_a_fronted_vllm_serve_gets_dev_mode_and_is_told_its_end() -> None:
    """Issue 50 item 6: a fronted vllm serve runs in vLLM's dev mode (its /pause behind the
    front), so that what is still in flight when gpud stops it past its drain bound can be
    ended with a told end (tells_abort); a serve reached by nothing, or without dev mode, is
    not."""
    fast = example_serves()["fast"]
    fronted = fast.model_copy(update={"front": True})
    assert vllm_environment(fronted)["VLLM_SERVER_DEV_MODE"] == "1"
    assert tells_abort(fronted)
    assert not fast.front and not tells_abort(fast)  # its own port, no dev mode
    assert tells_abort(fast.model_copy(update={"sleep_level": 1}))  # dev mode, its port
    # the serve's own environment, read as vLLM reads it (bool(int(...)))
    for value, told in (("1", True), ("2", True), ("0", False), ("", False), ("yes", False)):
        own = fast.model_copy(update={"environment": {"VLLM_SERVER_DEV_MODE": value}})
        assert tells_abort(own) is told, value
    # dev mode that gpud cannot reach over HTTP (no port, no front)
    assert not tells_abort(fronted.model_copy(update={"front": False, "port": None}))
