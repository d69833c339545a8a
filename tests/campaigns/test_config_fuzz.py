"""Campaign 3b: hostile config text. ``gpud.config.parse_config`` either returns a Config or
raises ``ConfigError`` naming the problems: never another exception, whatever the text.

Two generators: TOML-ish text built from the config's own vocabulary (tables, keys, hostile
values, garbage lines), and structured documents (nested tables of the right and wrong types)
written out as TOML. Short form in the default run; long form: ``python3 -m pytest -m slow
tests/campaigns -k config`` (GPUD_CAMPAIGN_EXAMPLES).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from gpud.config import Config, parse_config
from gpud.core.launch import command_argv
from gpud.errors import ConfigError
from tests.campaigns.conftest import SEED, knob

TABLES = ["daemon", "roles.r", "roles.dark-fast", "roles.Bad", "serves.s", "serves.ocr",
          "serves.s.vllm", "serves.s.environment", "serves.ocr.vllm", "simulation", "x",
          'roles."a.b"', 'serves."../x"', "serves.s.command"]
ARRAY_TABLES = ["simulation.devices", "serves.s.vllm.extra_args", "roles", "daemon.x"]
KEYS = ["socket", "state_dir", "admission", "admin_group", "socket_group", "observe_interval_s",
        "health_interval_s", "health_failures", "crash_loop_restarts", "crash_loop_window_s",
        "overdraw_tolerance_mib", "memory_return_timeout_s", "vllm_executable", "backups_keep", "config_backups",
        "metrics_listen", "device", "capacity_mib", "reserve_mib", "note", "role", "vram_mib",
        "resident", "priority", "port", "health_path", "command", "environment", "user",
        "start_timeout_s", "stop_timeout_s", "restart", "restart_sec", "model", "revision",
        "quantization", "max_model_len", "extra_args", "executable", "state_file", "uuid",
        "total_mib", "index", "pci_bus_id", "name", "CUDA_VISIBLE_DEVICES", "PATH", "a b",
        "1bad", "vllm", "unknown"]
HOSTILE_INTS = st.sampled_from([0, -1, 1, 2**31 - 1, 2**31, 2**63 - 1, -(2**63), 32607, 65535,
                                65536])
HOSTILE_FLOATS = st.sampled_from(["nan", "+inf", "-inf", "-0.0", "1e308", "5e-324", "0.0",
                                  "1e-9", "3600.0000001"])
HOSTILE_STRINGS = st.sampled_from(["", "strict", "ledger", "0", "GPU-sim-0", "dark-fast",
                                   "{port}", "{gpu_memory_utilization}", "{nope}", "{", "}",
                                   "{{x}}", "{0}", "{port!r}", "{port.real}", "{port[0]}",
                                   "/bin/true", "\\u0000", "a\\nb", "$(id)", "x" * 300,
                                   "\\ud800", "Fast", "-x", "on-failure", "always"])


def toml_string(s: str) -> str:
    # JSON escapes the C0 controls; TOML forbids DEL (U+007F) unescaped too, and the parser
    # refuses it (older tomllib builds let it through).
    return json.dumps(s, ensure_ascii=False).replace("\x7f", "\\u007f")


def scalar_text() -> st.SearchStrategy[str]:
    return st.one_of(
        HOSTILE_INTS.map(str),
        st.integers().map(str),
        HOSTILE_FLOATS,
        st.floats(allow_nan=False, allow_infinity=False).map(repr),
        st.booleans().map(lambda b: "true" if b else "false"),
        HOSTILE_STRINGS.map(lambda s: f'"{s}"'),
        st.text(max_size=20).map(toml_string),
        st.sampled_from(["1979-05-27T07:32:00Z", "07:32:00", "1979-05-27", "0x10", "0o7",
                         "0b1", "1_000", "'literal'", "'''multi\nline'''"]),
    )


def value_text(depth: int = 3) -> st.SearchStrategy[str]:
    if depth == 0:
        return scalar_text()
    inner = value_text(depth - 1)
    return st.one_of(
        scalar_text(),
        st.lists(inner, max_size=4).map(lambda xs: "[" + ", ".join(xs) + "]"),
        st.lists(st.tuples(st.sampled_from(KEYS), inner), max_size=3).map(
            lambda kv: "{" + ", ".join(f"{toml_string(k)} = {v}" for k, v in kv) + "}"),
    )


LINE = st.one_of(
    st.sampled_from(TABLES).map(lambda t: f"[{t}]"),
    st.sampled_from(ARRAY_TABLES).map(lambda t: f"[[{t}]]"),
    st.tuples(st.sampled_from(KEYS), value_text()).map(lambda kv: f"{kv[0]} = {kv[1]}"),
    st.tuples(st.text(max_size=10), value_text(1)).map(lambda kv: f"{toml_string(kv[0])} = {kv[1]}"),
    st.text(max_size=30),
)

TOMLISH = st.lists(LINE, max_size=25).map("\n".join)


# ---- structured documents, written out as TOML -------------------------------------------------


def to_toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return toml_string(v)
    if isinstance(v, list):
        return "[" + ", ".join(to_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{toml_string(k)} = {to_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(type(v))


def to_toml(doc: dict[str, Any]) -> str:
    return "\n".join(f"{toml_string(k)} = {to_toml_value(v)}" for k, v in doc.items())


ANY_SCALAR = st.one_of(st.integers(min_value=-(2**64), max_value=2**64), st.floats(),
                       st.booleans(), st.text(max_size=30), HOSTILE_STRINGS, HOSTILE_INTS)


def field(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Usually a plausible value, sometimes anything at all."""
    return st.one_of(good, good, good, ANY_SCALAR,
                     st.lists(ANY_SCALAR, max_size=3), st.dictionaries(st.text(max_size=5),
                                                                       ANY_SCALAR, max_size=2))


def optional_fields(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({}, optional={k: field(v) for k, v in fields.items()}).flatmap(
        lambda d: st.dictionaries(st.sampled_from(["bogus", "Device", "vram"]), ANY_SCALAR,
                                  max_size=1).map(lambda extra: {**d, **extra}))


NAMES = st.one_of(st.sampled_from(["r", "dark-fast", "s", "ocr", "a_b", "0"]),
                  st.from_regex(r"[a-z0-9][a-z0-9_-]{0,10}", fullmatch=True), st.text(max_size=8))
MIB = st.integers(min_value=-5, max_value=2**31 + 5)
SECONDS = st.one_of(st.floats(min_value=-1, max_value=1e7), st.sampled_from([0.0, 3600.0, 1e-6]))
ARGS = st.lists(st.one_of(HOSTILE_STRINGS, st.text(max_size=15)), max_size=4)

DAEMON = optional_fields({
    "socket": st.text(max_size=20), "state_dir": st.text(max_size=20),
    "admission": st.sampled_from(["strict", "ledger", "loose"]), "admin_group": st.text(max_size=10),
    "observe_interval_s": SECONDS, "health_interval_s": SECONDS,
    "health_failures": st.integers(-2, 2000), "crash_loop_restarts": st.integers(-2, 2000),
    "crash_loop_window_s": SECONDS, "overdraw_tolerance_mib": MIB,
    "memory_return_timeout_s": SECONDS, "backups_keep": st.integers(-1, 2000),
    "metrics_listen": st.sampled_from(["127.0.0.1:9400", ":x", "", "9400"]),
})
ROLE = optional_fields({"device": st.sampled_from(["0", "GPU-sim-0", "", "0000:01:00.0"]),
                        "capacity_mib": MIB, "reserve_mib": MIB, "note": st.text(max_size=10)})
VLLM = optional_fields({"model": st.text(max_size=10), "revision": st.text(max_size=5),
                        "quantization": st.sampled_from(["fp8", "awq", ""]),
                        "max_model_len": st.integers(-1, 2**40), "extra_args": ARGS,
                        "executable": st.text(max_size=10)})
SERVE = optional_fields({
    "role": NAMES, "vram_mib": MIB, "resident": st.booleans(), "priority": st.integers(-1, 2**21),
    "port": st.integers(-1, 70000), "health_path": st.sampled_from(["/health", "health", "/"]),
    "vllm": VLLM, "command": ARGS,
    "environment": st.dictionaries(st.sampled_from(["A", "PATH", "CUDA_VISIBLE_DEVICES", "1x",
                                                    "a b", ""]), st.text(max_size=5), max_size=3),
    "user": st.text(max_size=8), "start_timeout_s": SECONDS, "stop_timeout_s": SECONDS,
    "restart": st.sampled_from(["no", "on-failure", "always", "sometimes"]),
    "restart_sec": SECONDS,
})
DEVICE = optional_fields({"uuid": st.sampled_from(["GPU-sim-0", "GPU-sim-1", ""]),
                          "total_mib": MIB, "index": st.integers(-1, 8),
                          "pci_bus_id": st.text(max_size=12), "name": st.text(max_size=5)})
SIMULATION = optional_fields({"state_file": st.text(max_size=10),
                              "devices": st.lists(DEVICE, max_size=3)})
DOCUMENT = optional_fields({
    "daemon": DAEMON,
    "roles": st.dictionaries(NAMES, ROLE, max_size=3),
    "serves": st.dictionaries(NAMES, SERVE, max_size=4),
    "simulation": SIMULATION,
})


def parse_only_config_errors(text: str) -> Config | None:
    try:
        return parse_config(text, "fuzz.toml")
    except ConfigError as exc:
        assert exc.problems and all(isinstance(p, str) and p for p in exc.problems), exc.problems
        return None


def examples(short: int) -> Callable[[Any], Any]:
    """`short` examples, from the campaign's seed (GPUD_CAMPAIGN_SEED replays them), kept in
    the example database of the run's hypothesis profile (tests/conftest.py)."""
    chosen = settings(max_examples=short, deadline=None,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    return lambda test: seed(SEED)(chosen(test))


def long_examples() -> Callable[[Any], Any]:
    return examples(knob("EXAMPLES", 5000))


def check_tomlish(text: str) -> None:
    parse_only_config_errors(text)


def check_document(doc: dict[str, Any]) -> None:
    cfg = parse_only_config_errors(to_toml(doc))
    if cfg is not None:
        # what was accepted is what was written, and its names are the safe ones
        for name in (*cfg.roles, *cfg.serves):
            assert name == name.strip() and "/" not in name and ".." not in name


@examples(300)
@given(TOMLISH)
def test_tomlish_text_short(text: str) -> None:
    check_tomlish(text)


@examples(300)
@given(DOCUMENT)
def test_structured_documents_short(doc: dict[str, Any]) -> None:
    check_document(doc)


@pytest.mark.slow
@long_examples()
@given(TOMLISH)
def test_tomlish_text_long(text: str) -> None:
    check_tomlish(text)


@pytest.mark.slow
@long_examples()
@given(DOCUMENT)
def test_structured_documents_long(doc: dict[str, Any]) -> None:
    check_document(doc)


@st.composite
def valid_documents(draw: st.DrawFn) -> dict[str, Any]:
    """Configs that must load: valid names, roles that serves name, figures that fit, distinct
    ports, placeholders gpud knows."""
    name = st.from_regex(r"[a-z0-9][a-z0-9_-]{0,12}", fullmatch=True)
    roles: dict[str, Any] = {}
    for role in draw(st.lists(name, min_size=1, max_size=3, unique=True)):
        capacity = draw(st.integers(2, 2**20))
        roles[role] = {"device": draw(st.sampled_from(["0", "1", "GPU-x"])),
                       "capacity_mib": capacity,
                       "reserve_mib": draw(st.integers(0, capacity - 1))}
    serves: dict[str, Any] = {}
    ports = iter(draw(st.lists(st.integers(1, 65535), min_size=4, max_size=4, unique=True)))
    for serve in draw(st.lists(name, max_size=4, unique=True)):
        role = draw(st.sampled_from(sorted(roles)))
        spec: dict[str, Any] = {"role": role,
                                "vram_mib": draw(st.integers(1, roles[role]["capacity_mib"])),
                                "resident": draw(st.booleans()),
                                "priority": draw(st.integers(0, 1_000_000)),
                                "port": next(ports)}
        if draw(st.booleans()):
            spec["command"] = ["/bin/true", draw(st.sampled_from(
                ["{port}", "{gpu_memory_utilization}", "{device_index}", "{vram_mib}", "x"]))]
        else:
            # A model name that begins with "-" would read as an option of `vllm serve`
            # (refused, named so); one that begins with "/", "." or "~" is a local directory,
            # read on this host (gpud.vllm.checkpoint.locate: "~" is a directory without a
            # config.json, refused, named so).
            spec["vllm"] = {"model": draw(st.text(min_size=1, max_size=10).filter(
                lambda t: "\0" not in t and not t.startswith(("-", "/", ".", "~"))))}
        if "vllm" in spec or "{gpu_memory_utilization}" in spec["command"]:
            # A utilization of 0.0000 is refused (vLLM's own bound, and gpud's for a command
            # that is handed one): at least 1/10000 of the total.
            capacity = roles[role]["capacity_mib"]
            spec["vram_mib"] = max(spec["vram_mib"], capacity // 10_000 + 1)
        serves[serve] = spec
    return {"roles": roles, "serves": serves}


@examples(300)
@given(valid_documents())
def test_valid_documents_load_as_written(doc: dict[str, Any]) -> None:
    """A loader that refuses everything fails here: every valid document loads, unchanged."""
    cfg = parse_config(to_toml(doc), "valid.toml")
    assert {n: r.capacity_mib for n, r in cfg.roles.items()} == {
        n: r["capacity_mib"] for n, r in doc["roles"].items()}
    assert {n: (s.role, s.vram_mib, s.port) for n, s in cfg.serves.items()} == {
        n: (s["role"], s["vram_mib"], s["port"]) for n, s in doc["serves"].items()}


def test_a_valid_document_is_accepted() -> None:
    """The generators are not only producing refusals: the same writer yields a valid config."""
    doc = {"roles": {"dark-fast": {"device": "0", "capacity_mib": 32607, "reserve_mib": 4608}},
           "serves": {"ocr": {"role": "dark-fast", "vram_mib": 5120,
                              "command": ["/bin/true", "{port}"], "port": 30007}}}
    cfg = parse_config(to_toml(doc), "x")
    assert cfg.serves["ocr"].vram_mib == 5120


@pytest.mark.parametrize("text", [
    "a = " + "[" * 2000 + "]" * 2000,
    "a = " + "{b = " * 2000 + "1" + "}" * 2000,
], ids=["nested-arrays", "nested-inline-tables"])
def test_deeply_nested_toml_is_a_config_error(text: str) -> None:
    """Found by this campaign (fixed in a0ac50a): tomllib's RecursionError got through."""
    with pytest.raises(ConfigError):
        parse_config(text, "nested.toml")


@pytest.mark.parametrize("arg", ["{gpu_memory_utilization:d}", "{port:s}", "{vram_mib!z}",
                                 "{gpu_memory_utilization:,}", "{port}", "{{x}}"])
def test_accepted_command_can_be_formatted(arg: str) -> None:
    """Found by this campaign (fixed in a0ac50a): a placeholder with a conversion or format
    spec loaded, and the launch failed later with ValueError."""
    text = ('[roles.r]\ndevice = "0"\n[serves.s]\nrole = "r"\nvram_mib = 1000\nport = 30001\n'
            f"command = [\"/bin/true\", {toml_string(arg)}]\n")
    try:
        cfg = parse_config(text, "x")
    except ConfigError:
        return  # refused when loading: what should happen
    command_argv(cfg.serves["s"], util="0.5000", device_index=0)
