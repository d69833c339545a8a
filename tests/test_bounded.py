"""What a peer sends is parsed within bounds (gpud.bounded): a number of more digits than
Python converts, nesting deeper than MAX_DEPTH, an integer too large to print, are answered 400
(a config: exit 2) with the path of the offending value, never a 500 or a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpud.bounded import MAX_DEPTH, OutOfBounds, parse_json, parse_toml
from gpud.config import parse_config
from gpud.errors import ConfigError
from tests.conftest import REPO, T015, GpudProcess, start_gpud, write_config

HUGE = "9" * 5000  # Python's int() refuses more than 4300 decimal digits


@pytest.fixture(scope="module")
def gpud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GpudProcess]:
    gp = start_gpud(tmp_path_factory.mktemp("bounded"), T015)
    yield gp
    gp.stop()


@pytest.mark.parametrize(("text", "path", "reason"), [
    ('{"config": "", "n": ' + HUGE + "}", "n", "a number of 5000 digits"),
    ('{"a": [1, {"b": -' + HUGE + "}]}", "a[1].b", "a number of 5000 digits"),
    (HUGE, "(top level)", "a number of 5000 digits"),
    ('{"a": 1e999}', "a", "a number too large for a float"),
    ('{"a": ' + "[" * 3000 + "]" * 3000 + "}", "a" + "[0]" * (MAX_DEPTH - 1), "nested deeper"),
    ('{"a": ' + "[" * 40 + "]" * 40 + "}", "a" + "[0]" * (MAX_DEPTH - 1), "nested deeper"),
    ('{"a": "' + HUGE + '"}', None, None),  # digits in a string are text
])
def test_json_out_of_bounds_names_the_path(text: str, path: str | None, reason: str | None) -> None:
    if path is None:
        assert parse_json(text) == json.loads(text)
        return
    with pytest.raises(OutOfBounds) as info:
        parse_json(text)
    assert info.value.path == path
    assert reason is not None and info.value.reason.startswith(reason)


@pytest.mark.parametrize(("text", "path"), [
    ('[serves.ocr]\nrole = "x"\nvram_mib = ' + HUGE + "\n", "serves.ocr.vram_mib"),
    ('[serves."a.b"]\nx = [{y = 1_' + HUGE + "}]\n", 'serves."a.b".x[0].y'),
    ("[serves.s.vllm]\nmax_model_len = 0x" + "f" * 4000 + "\n", "serves.s.vllm.max_model_len"),
    ("a = " + "[" * 1000 + "]" * 1000, "a" + "[0]" * (MAX_DEPTH - 1)),
    (".".join(["a"] * 100) + " = 1", ".".join(["a"] * MAX_DEPTH)),
])
def test_toml_out_of_bounds_names_the_key_path(text: str, path: str) -> None:
    with pytest.raises(OutOfBounds) as info:
        parse_toml(text)
    assert info.value.path == path
    with pytest.raises(ConfigError) as config:
        parse_config(text, "big.toml")
    assert config.value.problems == [f"{path}: {info.value.reason}"]


def test_digits_in_strings_comments_and_keys_are_not_numbers() -> None:
    text = (f's = "{HUGE}"\nt = \'\'\'{HUGE}\'\'\'\n# {HUGE}\nk{HUGE} = 1\n'
            f'u = """a\\"""{HUGE}"""\n')
    assert parse_toml(text)["s"] == HUGE


def test_api_answers_400_with_the_path(gpud: GpudProcess) -> None:
    """The issue's report: 500 `internal error: ValueError` on every POST route."""
    raw = ('{"config": "", "n": ' + HUGE + "}").encode()
    for route in ("/v1/plan", "/v1/apply", "/v1/serves/ocr/admit", "/v1/reload"):
        reply = gpud.call("POST", route, raw=raw, headers={"Content-Type": "application/json"})
        assert reply.status == 400, (route, reply.raw[:300])
        assert reply.body["error"]["code"] == "bad-request"
        assert reply.body["error"]["details"] == {"path": "n"}
        assert reply.body["error"]["message"].startswith("n: a number of 5000 digits")
    deep = ('{"mib": ' + "[" * 5000 + "]" * 5000 + "}").encode()
    reply = gpud.call("POST", "/v1/serves/ocr/admit", raw=deep)
    assert reply.status == 400
    assert reply.body["error"]["details"]["path"] == "mib" + "[0]" * (MAX_DEPTH - 1)


def test_config_in_a_plan_answers_400_with_the_key_path(gpud: GpudProcess) -> None:
    config = T015.replace("vram_mib = 5120", f"vram_mib = {HUGE}")
    for route in ("/v1/plan", "/v1/apply"):
        reply = gpud.call("POST", route, {"config": config})
        assert reply.status == 400, reply.raw[:300]
        assert reply.body["error"]["code"] == "config-invalid"
        assert reply.body["error"]["details"]["problems"] == [
            "serves.ocr.vram_mib: a number of 5000 digits: more than the 4300 a number may have"]
    assert gpud.alive()


def test_check_config_and_start_exit_2_with_the_key_path(tmp_path: Path) -> None:
    path = write_config(tmp_path, T015.replace("vram_mib = 5120", f"vram_mib = {HUGE}"))
    want = "serves.ocr.vram_mib: a number of 5000 digits"
    check = subprocess.run([sys.executable, "-m", "gpud.daemon", "--check-config", str(path)],
                           capture_output=True, text=True, cwd=REPO, check=False, timeout=60)
    assert check.returncode == 2, check.stderr
    assert want in check.stderr and "Traceback" not in check.stderr
    start = subprocess.run([sys.executable, "-m", "gpud.daemon", "--config", str(path),
                            "--socket", str(tmp_path / "s.sock"), "--state-dir",
                            str(tmp_path / "state"), "--log-target", "stderr"],
                           capture_output=True, text=True, cwd=REPO, check=False, timeout=60)
    assert start.returncode == 2, start.stderr
    assert want in start.stderr and "Traceback" not in start.stderr
