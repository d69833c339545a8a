"""Config loading: every refusal names the key path and the reason."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from gpud.config import load_config, parse_config
from gpud.core.vocab import SleepAction
from gpud.errors import ConfigError
from tests.conftest import REPO, T015, example_toml

BASE = """
[roles.gpu]
device = "0"
capacity_mib = 32607
reserve_mib = 4608
"""


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(text, "test.toml")
    return info.value.problems


def test_example_config_loads() -> None:
    cfg = load_config(REPO / "etc" / "serves.toml", require_private=False)
    assert sum(s.vram_mib for s in cfg.serves.values()) == 26112
    assert cfg.roles["dark-fast"].reserve_mib == 4608


def test_seed_t015_is_valid_even_though_ocr_does_not_fit() -> None:
    cfg = parse_config(T015, "t015")
    assert len(cfg.serves) == 4


@pytest.mark.parametrize(("snippet", "expected"), [
    ('[serves.ocr]\nrole = "gpu"\nvram_mib = 0\ncommand = ["x"]', "serves.ocr.vram_mib: must be > 0"),
    ('[serves.ocr]\nrole = "gpu"\nvram_mib = -5\ncommand = ["x"]', "serves.ocr.vram_mib: must be > 0"),
    ('[serves.ocr]\nrole = "gpu"\nvram_mib = 1.5\ncommand = ["x"]',
     "serves.ocr.vram_mib: must be an integer"),
    ('[serves.ocr]\nrole = "gpu"\nvram_mib = "5120"\ncommand = ["x"]',
     "serves.ocr.vram_mib: must be an integer"),
    ('[serves.ocr]\nrole = "gpu"\nvram_mib = 5120\ncommand = ["x"]\nvram = 1',
     "serves.ocr.vram: unknown key"),
    ('[serves.ocr]\nrole = "nope"\nvram_mib = 5120\ncommand = ["x"]',
     "serves.ocr.role: unknown role 'nope' (roles: gpu)"),
    ('[serves.ocr]\nrole = "gpu"\nvram_mib = 40000\ncommand = ["x"]',
     "serves.ocr.vram_mib: 40000 exceeds role 'gpu' capacity_mib 32607"),
    ('[serves.ocr]\nrole = "gpu"\nvram_mib = 5120', "serves.ocr: give exactly one of a [vllm] table or a command"),
    ('[serves.ocr]\nrole = "gpu"\nvram_mib = 5120\ncommand = ["x", "{model}"]',
     "serves.ocr.command[1]: unknown placeholder {model}"),
    ('[serves.ocr]\nrole = "gpu"\nvram_mib = 5120\ncommand = ["x"]\n[serves.ocr.environment]\nCUDA_VISIBLE_DEVICES = "1"',
     "serves.ocr.environment.CUDA_VISIBLE_DEVICES: set by gpud"),
    ('[serves."a b;rm -rf /"]\nrole = "gpu"\nvram_mib = 1\ncommand = ["x"]',
     "serves.a b;rm -rf /: invalid serve name"),
    ('[serves."../x"]\nrole = "gpu"\nvram_mib = 1\ncommand = ["x"]', "invalid serve name '../x'"),
    ('[serves.Ocr]\nrole = "gpu"\nvram_mib = 1\ncommand = ["x"]', "invalid serve name 'Ocr'"),
    (f'[serves.{"x" * 300}]\nrole = "gpu"\nvram_mib = 1\ncommand = ["x"]', "invalid serve name"),
    ('[serves."%n"]\nrole = "gpu"\nvram_mib = 1\ncommand = ["x"]', "invalid serve name '%n'"),
    ('[serves."ocré"]\nrole = "gpu"\nvram_mib = 1\ncommand = ["x"]', "invalid serve name 'ocré'"),
    ('[daemon]\nadmission = "loose"', "daemon.admission: must be one of 'strict' or 'ledger'"),
    ('[daemon]\nsockett = "/x"', "daemon.sockett: unknown key"),
    # an empty User= is root to systemd
    ('[daemon]\nserve_user = ""', "daemon.serve_user: String should have at least 1 character"),
    ('[serves.x]\nrole = "gpu"\nvram_mib = 1\ncommand = ["x"]\nuser = ""',
     "serves.x.user: String should have at least 1 character"),
])
def test_refusals_name_the_key(snippet: str, expected: str) -> None:
    found = problems(BASE + snippet)
    assert any(expected in p for p in found), found


def test_two_serves_on_one_port() -> None:
    text = BASE + """
[serves.a]
role = "gpu"
vram_mib = 1
port = 30001
command = ["x"]
[serves.b]
role = "gpu"
vram_mib = 1
port = 30001
command = ["x"]
"""
    assert "serves.b.port: 30001 is already used by serve 'a'" in problems(text)


def test_reserve_not_below_capacity() -> None:
    text = '[roles.gpu]\ndevice = "0"\ncapacity_mib = 1000\nreserve_mib = 1000\n'
    assert problems(text) == ["roles.gpu.reserve_mib: 1000 must be < capacity_mib 1000"]


def test_all_problems_at_once() -> None:
    text = BASE + '[serves.a]\nrole = "gpu"\nvram_mib = 0\nport = 0\ncommand = ["x"]\n'
    found = problems(text)
    assert "serves.a.vram_mib: must be > 0" in found
    assert "serves.a.port: must be >= 1" in found


def test_toml_syntax_error() -> None:
    found = problems("[roles.gpu\ndevice = 0")
    assert found[0].startswith("TOML syntax:")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nope.toml")
    assert info.value.problems == ["file not found"]


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "x.toml"
    path.write_bytes(b"\xff\xfe[roles]")
    with pytest.raises(ConfigError) as info:
        load_config(path, require_private=False)
    assert "not UTF-8" in info.value.problems[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="the check applies when gpud runs as root")
def test_writable_by_others_refused(tmp_path: Path) -> None:
    path = tmp_path / "serves.toml"
    path.write_text(BASE)
    path.chmod(0o666)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "writable by group or others (mode 0666)" in info.value.problems[0]
    path.chmod(0o644)
    assert load_config(path).roles["gpu"].capacity_mib == 32607


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to read as another user")
def test_unreadable() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o755)
        path = Path(tmp) / "serves.toml"
        path.write_text(BASE)
        path.chmod(0o600)
        os.seteuid(65534)  # root reads anything: read it as nobody
        try:
            with pytest.raises(ConfigError) as info:
                load_config(path)
        finally:
            os.seteuid(0)
    assert info.value.problems == ["permission denied"]


def test_check_config_cli(tmp_path: Path) -> None:
    example = tmp_path / "serves.toml"
    example.write_text(example_toml())
    example.chmod(0o600)
    good = subprocess.run([sys.executable, "-m", "gpud.daemon", "--check-config",
                           str(example)], capture_output=True, text=True, cwd=REPO, check=False)
    assert good.returncode == 0, good.stderr
    assert "fast 14336 MiB (resident, priority 10)" in good.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text(BASE + '[serves.ocr]\nrole = "gpu"\nvram_mib = 0\ncommand = ["x"]\n')
    bad.chmod(0o600)
    out = subprocess.run([sys.executable, "-m", "gpud.daemon", "--check-config", str(bad)],
                         capture_output=True, text=True, cwd=REPO, check=False)
    assert out.returncode == 2
    assert "serves.ocr.vram_mib: must be > 0" in out.stderr


VLLM_SERVE = """
[serves.emb]
role = "gpu"
vram_mib = 3200
port = 30003
[serves.emb.vllm]
model = "BAAI/bge-m3"
"""


@pytest.mark.parametrize(("extra", "expected"), [
    ('extra_args = ["--task", "embed"]',
     "serves.emb.vllm.extra_args[0]: --task was removed (not an option of vLLM 0.33.0); use "
     "--runner pooling"),
    ('extra_args = ["--runner", "pooling", "--swap-space", "4"]',
     "serves.emb.vllm.extra_args[2]: --swap-space was removed"),
    ('extra_args = ["--port", "1"]',
     "serves.emb.vllm.extra_args[0]: --port is set by gpud from serves.emb.port: set that instead"),
    ('extra_args = ["--gpu_memory_utilization=0.5"]',
     "serves.emb.vllm.extra_args[0]: --gpu-memory-utilization is set by gpud from serves.emb.vram_mib"),
    ('extra_args = ["--host", "0.0.0.0"]', "serves.emb.vllm.extra_args[0]: --host is set by gpud from "
     "serves.emb.vllm.host"),
    ('quantization = "fp9"', "serves.emb.vllm.quantization: --quantization 'fp9': not one of"),
    ('revision = "56e30bf6"', "serves.emb.vllm.revision: '56e30bf6' is an abbreviated commit; pin "
     "the full 40-hex SHA"),
    ("kv_cache_mib = 3200", "serves.emb.vllm.kv_cache_mib: 3200 (+ context_mib 0) must be below "
     "vram_mib 3200"),
    ("kv_cache_mib = 0", "serves.emb.vllm.kv_cache_mib: must be > 0"),
    ('host = ""', "serves.emb.vllm.host: String should have at least 1 character"),
    ('host = "::1"', "serves.emb.vllm.host: '::1' is not reached by gpud's health checks"),
    ('extra_args = ["--uds", "/run/v.sock"]', "serves.emb.vllm.extra_args[0]: --uds serves "
     "vLLM's API on a Unix socket, not on the serve's port"),
    ('extra_args = ["--headless"]', "serves.emb.vllm.extra_args[0]: --headless starts no API "
     "server"),
    ('extra_args = ["--grpc"]', "serves.emb.vllm.extra_args[0]: --grpc serves gRPC on the port"),
])
def test_vllm_serve_problems_name_their_key(extra: str, expected: str) -> None:
    found = problems(BASE + VLLM_SERVE + extra)
    assert len(found) == 1, found
    assert found[0].startswith(expected), found


@pytest.mark.parametrize("flag", ["--disable-sleep-mode", "--no-enable-sleep-mode"])
def test_sleep_mode_cannot_be_turned_off_under_a_sleep_level(flag: str) -> None:
    sleeper = VLLM_SERVE.replace("port = 30003", "port = 30003\nsleep_level = 1")
    assert problems(BASE + sleeper + f'extra_args = ["{flag}"]') == [
        f"serves.emb.vllm.extra_args[0]: {flag} turns off the sleep mode serves.emb.sleep_level "
        "= 1 needs: drop it, or set sleep_level = 0"]
    # without a sleep_level it only says what is the default
    parse_config(BASE + VLLM_SERVE + f'extra_args = ["{flag}"]', "t")


def test_a_hidden_boolean_alias_is_accepted() -> None:
    # --enable-prefix-caching is a BooleanOptionalAction: --no-enable-prefix-caching is its
    # negation, which vLLM takes although its flag table shows --disable-prefix-caching
    cfg = parse_config(BASE + VLLM_SERVE + 'extra_args = ["--no-enable-prefix-caching"]', "t")
    assert cfg.serves["emb"].vllm is not None
    assert problems(BASE + VLLM_SERVE + 'extra_args = ["--no-headless"]')[0].startswith(
        "serves.emb.vllm.extra_args[0]: --no-headless is not an option of vllm serve")


def test_vllm_engine_ready_timeout_must_cover_the_start_timeout() -> None:
    text = BASE + VLLM_SERVE.replace("port = 30003", "port = 30003\nstart_timeout_s = 900")
    text += '[serves.emb.environment]\nVLLM_ENGINE_READY_TIMEOUT_S = "600"\n'
    assert problems(text) == [
        "serves.emb.environment.VLLM_ENGINE_READY_TIMEOUT_S: '600' must be a whole number of "
        "seconds >= start_timeout_s 900 (vLLM would give up on its engine before gpud does)"]
    ok = parse_config(text.replace('"600"', '"900"'), "t")
    assert ok.serves["emb"].environment["VLLM_ENGINE_READY_TIMEOUT_S"] == "900"


def test_a_utilization_that_floors_to_zero_is_a_config_error_when_the_total_is_known() -> None:
    tiny = VLLM_SERVE.replace("vram_mib = 3200", "vram_mib = 3")
    assert problems(BASE + tiny) == [
        "serves.emb.vram_mib: 3 MiB is --gpu-memory-utilization 0.0000 of at most 32607 MiB; "
        "vLLM requires > 0"]
    sim = ('[simulation]\n[[simulation.devices]]\nuuid = "GPU-sim-0"\ntotal_mib = 81559\n')
    no_capacity = BASE.replace("capacity_mib = 32607\nreserve_mib = 4608\n", "")
    assert problems(no_capacity + tiny.replace("vram_mib = 3", "vram_mib = 8") + sim) == [
        "serves.emb.vram_mib: 8 MiB is --gpu-memory-utilization 0.0000 of the device total "
        "81559 MiB; vLLM requires > 0"]
    # The total unknown (no capacity, no simulated device): decided at launch, not here.
    assert parse_config(no_capacity + tiny, "t").serves["emb"].vram_mib == 3
    # A command that asks for the utilization is held to the same rule.
    cmd = '[serves.x]\nrole = "gpu"\nvram_mib = 1\ncommand = ["/bin/x", "{gpu_memory_utilization}"]\n'
    assert problems(BASE + cmd)[0].startswith("serves.x.vram_mib: 1 MiB is --gpu-memory-utilization")


def test_unknown_vllm_version() -> None:
    daemon = ('[daemon]\nvllm_version = "0.1.0"\nvllm_flags_dir = "/nonexistent/etc"\n'
              'state_dir = "/nonexistent/state"\nvllm_executable = "/nonexistent/vllm"\n')
    found = problems(daemon + BASE + VLLM_SERVE)
    assert found == [
        "daemon.vllm_version: no vllm serve flag table for vLLM '0.1.0' (looked in: gpud's own "
        "(0.33.0, 0.34.0), /nonexistent/etc/vllm-serve-flags-0.1.0.json, /nonexistent/state/"
        "vllm-flags/vllm-serve-flags-0.1.0.json); learning it from the installed vLLM failed: "
        "'/nonexistent/vllm' is not found (daemon.vllm_executable). Put the table of vLLM 0.1.0 "
        "in /nonexistent/etc (scripts/vllm-flags 0.1.0 writes it), or set "
        "daemon.vllm_executable to the vllm the serves run"]
    # without a vllm serve there is no argv to check: the release alone is no error
    assert parse_config(daemon + BASE, "t").daemon.vllm_version == "0.1.0"


def test_context_and_kv_cache_must_leave_room_in_the_reservation() -> None:
    assert problems(BASE + VLLM_SERVE + "context_mib = 3200") == [
        "serves.emb.vllm.context_mib: 3200 must be below vram_mib 3200"]
    assert problems(BASE + VLLM_SERVE + "context_mib = 400\nkv_cache_mib = 2800") == [
        "serves.emb.vllm.kv_cache_mib: 2800 (+ context_mib 400) must be below vram_mib 3200 "
        "(the weights need room too)"]
    ok = parse_config(BASE + VLLM_SERVE + "context_mib = 400\nkv_cache_mib = 1024", "t")
    assert ok.serves["emb"].vllm.context_mib == 400


def test_kv_cache_mib_is_mib_or_calibrated() -> None:
    ok = parse_config(BASE + VLLM_SERVE + 'kv_cache_mib = "calibrated"', "t")
    assert ok.serves["emb"].vllm is not None and ok.serves["emb"].vllm.kv_cache_mib == "calibrated"
    found = problems(BASE + VLLM_SERVE + 'kv_cache_mib = "auto"')
    assert any(p.startswith("serves.emb.vllm.kv_cache_mib") and "calibrated" in p
               for p in found), found
    assert any(p.startswith("serves.emb.vllm.kv_cache_mib") for p in
               problems(BASE + VLLM_SERVE + "kv_cache_mib = 0")), found


@pytest.mark.parametrize(("snippet", "expected"), [
    ('[serves.s]\nrole = "gpu"\nvram_mib = 5120\ncommand = ["x"]\nsleep_level = 3',
     "serves.s.sleep_level"),
    ('[serves.s]\nrole = "gpu"\nvram_mib = 5120\ncommand = ["x"]\nsleep_level = 1\n'
     'sleep_mib = 5120', "sleep_mib: 5120 must be below vram_mib 5120"),
    ('[serves.s]\nrole = "gpu"\nvram_mib = 5120\ncommand = ["x"]\npreemptible = "sleep"',
     'preemptible: "sleep" needs a sleep_level of 1 or 2'),
    ('[serves.s]\nrole = "gpu"\nvram_mib = 5120\npreemptible = "kill"\ncommand = ["x"]',
     "serves.s.preemptible: must be one of 'sleep' or 'stop'"),
    ('[serves.s]\nrole = "gpu"\nvram_mib = 5120\npreemptible = 1\ncommand = ["x"]',
     "serves.s.preemptible: must be one of 'sleep' or 'stop'"),
    ('[serves.s]\nrole = "gpu"\nvram_mib = 5120\nsleep_level = 1\n[serves.s.vllm]\n'
     'model = "m"\nhost = "0.0.0.0"', "serves.s.vllm.host: a serve with sleep_level binds "
     "127.0.0.1"),
])
def test_sleep_keys_refused(snippet: str, expected: str) -> None:
    found = problems(BASE + snippet)
    assert any(expected in p for p in found), found


def test_sleep_keys_and_their_defaults() -> None:
    cfg = parse_config(BASE + '[serves.s]\nrole = "gpu"\nvram_mib = 5120\ncommand = ["x"]\n'
                       'sleep_level = 2\nsleep_mib = 600\npreemptible = "stop"\n', "t")
    s = cfg.serves["s"]
    assert (s.sleep_level, s.sleep_mib, s.preemptible) == (2, 600, SleepAction.STOP)
    assert type(s.preemptible) is SleepAction
    plain = parse_config(BASE + '[serves.p]\nrole = "gpu"\nvram_mib = 5120\ncommand = ["x"]\n',
                         "t").serves["p"]
    assert (plain.sleep_level, plain.sleep_mib, plain.preemptible) == (0, None, None)
    assert cfg.daemon.auto_wake is True and cfg.daemon.preempt_at_boot is False


def test_history_keys_and_their_defaults() -> None:
    daemon = parse_config("", "t").daemon
    assert (daemon.backups_keep, daemon.events_keep) == (10, 100_000)
    daemon = parse_config("[daemon]\nbackups_keep = 3\nevents_keep = 500\n", "t").daemon
    assert (daemon.backups_keep, daemon.events_keep) == (3, 500)
    # its former name is still read
    assert parse_config("[daemon]\nconfig_backups = 4\n", "t").daemon.backups_keep == 4


@pytest.mark.parametrize(("snippet", "expected"), [
    ("[daemon]\nbackups_keep = 0", "daemon.backups_keep: must be >= 1"),
    ("[daemon]\nbackups_keep = 1001", "daemon.backups_keep: must be <= 1000"),
    ("[daemon]\nconfig_backups = 0", "daemon.config_backups: must be >= 1"),
    ("[daemon]\nbackups_keep = 2\nconfig_backups = 3", "daemon.config_backups: unknown key"),
    ("[daemon]\nevents_keep = 99", "daemon.events_keep: must be >= 100"),
])
def test_history_keys_refused(snippet: str, expected: str) -> None:
    found = problems(snippet)
    assert any(expected in p for p in found), found


@pytest.mark.parametrize(("snippet", "expected"), [
    (BASE + '[serves.ocr]\nrole = "gpu"\nvram_mb = 5120\ncommand = ["x"]\n',
     "serves.ocr.vram_mb: unknown key; did you mean 'vram_mib'?"),
    ('[daemon]\nadmision = "ledger"\n', "daemon.admision: unknown key; did you mean 'admission'?"),
    ('[deamon]\nadmission = "ledger"\n', "deamon: unknown key; did you mean 'daemon'?"),
    (BASE + '[serves.e]\nrole = "gpu"\nvram_mib = 3200\n[serves.e.vllm]\nmodle = "m"\n',
     "serves.e.vllm.modle: unknown key; did you mean 'model'?"),
    ('[simulation]\nstate_file = "/run/s.json"\n[[simulation.devices]]\nuid = "GPU-0"\n'
     'total_mib = 8000\n', "simulation.devices.0.uid: unknown key; did you mean 'uuid'?"),
    ('[daemon]\nzzzzzz = 1\n', "daemon.zzzzzz: unknown key"),
])
def test_a_mistyped_key_is_named_with_the_key_it_was_meant_to_be(snippet: str,
                                                                  expected: str) -> None:
    assert expected in problems(snippet)


def test_an_error_found_on_the_devices_is_headed_by_the_config_files_name(
        tmp_path: Path) -> None:
    """The role budgets are checked against the devices after the file parsed: their errors
    name the file too, never "config"."""
    path = tmp_path / "serves.toml"
    path.write_text('[roles.gpu]\ndevice = "GPU-sim-0"\n[serves.big]\nrole = "gpu"\n'
                    'vram_mib = 9000\ncommand = ["x"]\n[simulation]\nstate_file = "/run/s.json"\n'
                    '[[simulation.devices]]\nuuid = "GPU-sim-0"\ntotal_mib = 8000\n')
    path.chmod(0o600)
    out = subprocess.run([sys.executable, "-m", "gpud.daemon", "--check-config", str(path)],
                         capture_output=True, text=True, cwd=REPO, check=False)
    assert out.returncode == 2
    assert out.stderr.splitlines()[:2] == [
        f"{path}: invalid config", "  serves.big.vram_mib: 9000 exceeds role 'gpu' capacity 8000"]


def test_check_config_says_which_serves_start_how() -> None:
    from gpud.config import summary

    cfg = parse_config(BASE + '[serves.a]\nrole = "gpu"\nvram_mib = 1000\ncommand = ["x"]\n'
                       'resident = true\n'
                       '[serves.b]\nrole = "gpu"\nvram_mib = 1000\ncommand = ["x", "{socket}"]\n'
                       'port = 30002\n'
                       'front = true\non_demand = true\n'
                       '[serves.c]\nrole = "gpu"\nvram_mib = 1000\ncommand = ["x"]\n', "t.toml")
    lines = summary(cfg).splitlines()
    assert "  a 1000 MiB (resident, priority 100)" in lines
    assert "  b 1000 MiB (on demand, priority 100)" in lines
    assert "  c 1000 MiB (started by gpuctl start, priority 100)" in lines
