"""Every TOML snippet of README.md and docs/*.md, and etc/serves.toml, passes
`gpud --check-config` (docs/router.md's lead example once lacked a serve's role and vram_mib).

A snippet is a ```toml block. One of `[keys.NAME]` tables is an api_keys_file: it is checked as
the router checks one (gpud.nginx.router.load_keys) against the model names of its document's
config snippets. Any other is a serves.toml: checked whole, by the function `--check-config`
runs (gpud.daemon.check_config), with three things of this host's put aside, each by
construction: a snippet with no `[roles.NAME]` gets etc/serves.toml's (the docs' examples all
run on its `dark-fast` role, which they would repeat otherwise); the router's njs module is read
from where scripts/setup unpacked Debian's when the host has none installed (as the demo
installs it); and an address this shared test host holds is not the snippet's concern
(gpud.nginx.front.in_use answers no), nor is whether a peer's host answers now. A peer's
key_file is written as a root 0600 file of one token. An api_keys_file a snippet names is its document's keys
snippet, written to a root 0600 file.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

import pytest

from gpud.config import model_names, parse_config
from gpud.daemon import check_config
from gpud.nginx.router import load_keys
from tests.conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
EXAMPLE = REPO / "etc" / "serves.toml"
NJS = "/usr/lib/nginx/modules/ngx_http_js_module.so"
UNPACKED_NJS = REPO / ".venv" / "lib" / "nginx" / "modules" / "ngx_http_js_module.so"


def snippets(doc: Path) -> list[tuple[int, str]]:
    """The ```toml blocks of DOC: (line number, text)."""
    text = doc.read_text()
    return [(text[:m.start()].count("\n") + 1, m.group(1))
            for m in re.finditer(r"^```toml\n(.*?)^```", text, flags=re.S | re.M)]


def is_keys_file(text: str) -> bool:
    doc = tomllib.loads(text)
    return set(doc) == {"keys"}


def example_roles() -> str:
    """etc/serves.toml's [roles.NAME] tables, as text."""
    text = EXAMPLE.read_text()
    return "".join(re.findall(r"^(\[roles\.[^\]]+\]\n(?:(?!\[)[^\n]*\n)*)", text, flags=re.M))


def keys_of(doc: Path) -> str:
    found = [text for _line, text in snippets(doc) if is_keys_file(text)]
    assert found, f"{doc.name} names an api_keys_file but shows no [keys.NAME] snippet"
    return found[0]


def as_config(doc: Path, text: str, tmp_path: Path) -> str:
    if not re.search(r"^\[roles\.", text, flags=re.M):
        text = example_roles() + "\n" + text
    if "njs_module" not in text and "[router]" in text:
        text = text.replace("[router]\n", f'[router]\nnjs_module = "{NJS}"\n', 1)
    if not os.path.isfile(NJS):
        assert UNPACKED_NJS.is_file(), "scripts/setup unpacks Debian's njs module there"
        text = text.replace(NJS, str(UNPACKED_NJS))
    for i, peer_key in enumerate(re.findall(r'^key_file = "([^"]+)"', text, flags=re.M)):
        # the key a peer snippet presents: a root 0600 file of one token, as the docs ask
        written = tmp_path / f"peer-{i}.key"
        written.write_text("sk-peer-0123456789abcdef\n")
        written.chmod(0o600)
        text = text.replace(f'"{peer_key}"', f'"{written}"')
    found = re.search(r'^api_keys_file = "([^"]+)"', text, flags=re.M)
    if found:
        keys = tmp_path / "router-keys.toml"
        keys.write_text(keys_of(doc))
        keys.chmod(0o600)
        text = text.replace(found.group(1), str(keys))
    return text


def check(path: Path, text: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    path.write_text(text)
    path.chmod(0o600)
    capsys.readouterr()
    code = check_config(path)
    out = capsys.readouterr()
    return code, out.out + out.err


CASES = [(doc, line, text) for doc in DOCS for line, text in snippets(doc)]


def test_the_docs_have_snippets_to_check() -> None:
    # the README's own config, and docs/router.md's, at least
    where = {doc.name for doc, _line, _text in CASES}
    assert {"README.md", "router.md", "sleep.md", "front.md"} <= where, where


@pytest.mark.parametrize(("doc", "line", "text"), CASES,
                         ids=[f"{d.name}:{n}" for d, n, _t in CASES])
def test_each_snippet_passes_check_config(doc: Path, line: int, text: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gpud.nginx.front.in_use", lambda _listen: False)
    # whether a peer's host answers now is not the snippet's concern (and no test reaches
    # beyond this host): --check-config only warns of it
    monkeypatch.setattr("gpud.host.peers.check_peers", lambda _cfg: [])
    if is_keys_file(text):
        known = sorted({name for _l, other in snippets(doc) if not is_keys_file(other)
                        for serve, cfg in parse_config(
                            as_config(doc, other, tmp_path), "snippet").serves.items()
                        for name in model_names(serve, cfg)})
        keys = tmp_path / "keys.toml"
        keys.write_text(text)
        keys.chmod(0o600)
        assert load_keys(str(keys), known), f"{doc.name}:{line}: no keys"
        return
    code, said = check(tmp_path / "serves.toml", as_config(doc, text, tmp_path), capsys)
    assert code == 0, f"{doc.name}:{line}: gpud --check-config refuses it:\n{said}"


def test_the_example_passes_check_config_with_its_router(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gpud.nginx.front.in_use", lambda _listen: False)
    text = EXAMPLE.read_text()
    assert re.search(r'^\[router\]\nlisten = "', text, flags=re.M), "etc/serves.toml: no router"
    code, said = check(tmp_path / "serves.toml", as_config(EXAMPLE, text, tmp_path), capsys)
    assert code == 0, said


def test_a_snippet_missing_what_a_serve_needs_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What the check catches: docs/router.md's lead example as it was (no role, no vram_mib)."""
    monkeypatch.setattr("gpud.nginx.front.in_use", lambda _listen: False)
    text = '[router]\nlisten = "127.0.0.1:8000"\n\n[serves.chat]\nport = 30001\n' \
           'vllm = { model = "Qwen/Qwen3-8B" }\n'
    code, said = check(tmp_path / "serves.toml", as_config(REPO / "README.md", text, tmp_path),
                       capsys)
    assert code == 2
    assert "serves.chat.role" in said or "serves.chat" in said, said
    assert "vram_mib" in said, said
