"""Config loading: every refusal names the key path and the reason."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from gpud.config import load_config, parse_config
from gpud.errors import ConfigError
from tests.conftest import REPO, T015

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
    good = subprocess.run([sys.executable, "-m", "gpud.daemon", "--check-config",
                           str(REPO / "etc" / "serves.toml")], capture_output=True, text=True,
                          cwd=REPO, check=False)
    assert good.returncode == 0, good.stderr
    assert "fast 14336 MiB (resident, priority 10)" in good.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text(BASE + '[serves.ocr]\nrole = "gpu"\nvram_mib = 0\ncommand = ["x"]\n')
    bad.chmod(0o600)
    out = subprocess.run([sys.executable, "-m", "gpud.daemon", "--check-config", str(bad)],
                         capture_output=True, text=True, cwd=REPO, check=False)
    assert out.returncode == 2
    assert "serves.ocr.vram_mib: must be > 0" in out.stderr
