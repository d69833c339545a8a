"""[peers.NAME] in serves.toml: every refusal names its key; the key file is root's only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpud.config import parse_config, read_peer_key
from gpud.errors import ConfigError
from tests.conftest import REPO

BASE = """
[roles.gpu]
device = "0"
capacity_mib = 32607

[serves.chat]
role = "gpu"
vram_mib = 5120
command = ["x"]
models = ["chat"]
"""


@pytest.fixture
def key(tmp_path: Path) -> Path:
    path = tmp_path / "peer.key"
    path.write_text("sk-peer-node2\n")
    path.chmod(0o600)
    return path


def peer(key: Path, extra: str = "", url: str = "http://node2.tailnet:8000") -> str:
    return BASE + f'\n[peers.node2]\nurl = "{url}"\nkey_file = "{key}"\n{extra}\n'


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(text, "test.toml")
    return info.value.problems


def test_a_peer_as_the_design_writes_it_loads(key: Path, tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    cfg = parse_config(peer(key, f'models = ["ocr", "big"]\ntls_ca = "{ca}"',
                            url="https://node2.tailnet:8443/"), "t")
    p = cfg.peers["node2"]
    assert (p.url, p.key_file, p.models, p.tls_ca) == (
        "https://node2.tailnet:8443/", str(key), ["ocr", "big"], str(ca))
    assert parse_config(peer(key), "t").peers["node2"].models is None
    assert read_peer_key(str(key)) == "sk-peer-node2"


@pytest.mark.parametrize(("extra", "url", "expected"), [
    ("", "ftp://node2:21", "peers.node2.url: 'ftp://node2:21' must be http:// or https://"),
    ("", "http://node2:8000/v1", "peers.node2.url: 'http://node2:8000/v1' must have no path"),
    ("", "http://node2:8000/?a=1", "peers.node2.url: 'http://node2:8000/?a=1' must have no query"),
    ("", "http://:8000", "peers.node2.url: 'http://:8000' names no host"),
    ("", "http://node2:99999", "peers.node2.url: 'http://node2:99999': the port '99999' is not 1-65535"),
    ("", "http://u:p@node2:8000", "peers.node2.url: 'http://u:p@node2:8000' must not carry a user"),
    ("", "http://no de:8000", "peers.node2.url: 'http://no de:8000' must not contain spaces"),
    ("", "http://node2_x:8000", "peers.node2.url: 'http://node2_x:8000': 'node2_x' is not a host"),
    ('tls_ca = "/etc/ca.pem"', "http://node2:8000", "peers.node2.tls_ca: only for an https url"),
    ("models = []", "http://node2:8000", "peers.node2.models: name at least one model"),
    ('models = ["a b"]', "http://node2:8000", "peers.node2.models[0]: 'a b' is not a model name"),
    ('models = ["ocr", "ocr"]', "http://node2:8000", "peers.node2.models[1]: 'ocr' is named twice"),
    ('models = ["ocr", "chat"]', "http://node2:8000",
     "peers.node2.models[1]: 'chat' is also serve 'chat''s here"),
    ("port = 1", "http://node2:8000", "peers.node2.port: unknown key"),
    ("models = 1", "http://node2:8000", "peers.node2.models: must be an array"),
])
def test_refusals_name_the_key(key: Path, extra: str, url: str, expected: str) -> None:
    found = problems(peer(key, extra, url))
    assert any(p.startswith(expected) for p in found), found


def test_a_peer_name_follows_the_serve_name_rule(key: Path) -> None:
    text = BASE + f'\n[peers."Node 2"]\nurl = "http://node2:8000"\nkey_file = "{key}"\n'
    assert problems(text) == ["peers.Node 2: invalid peer name 'Node 2': must match "
                              "^[a-z0-9][a-z0-9_-]{0,62}$"]


def test_url_and_key_file_are_required() -> None:
    found = problems(BASE + "\n[peers.node2]\n")
    assert "peers.node2.url: required" in found and "peers.node2.key_file: required" in found


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o644])
def test_a_key_file_others_may_read_is_refused(key: Path, mode: int) -> None:
    key.chmod(mode)
    assert problems(peer(key)) == [
        f"peers.node2.key_file: {key}: readable or writable by group or others (mode "
        f"{mode:04o}): it holds a key; run `chmod 600 {key}`"]


def test_a_missing_key_file_is_refused(tmp_path: Path) -> None:
    gone = tmp_path / "gone.key"
    assert problems(peer(gone)) == [f"peers.node2.key_file: {gone}: file not found"]


def test_a_key_file_not_roots_is_refused_when_gpud_is_root(key: Path) -> None:
    with pytest.raises(ValueError, match="must be root's"):
        os.chown(key, 65534, 65534)
        read_peer_key(str(key), require_root=True)


@pytest.mark.parametrize("text", ["", "\n", "two words\n", "a\nb\n"])
def test_a_key_file_holds_one_key(key: Path, text: str) -> None:
    key.write_text(text)
    assert problems(peer(key)) == [f"peers.node2.key_file: {key}: must hold one key, one line "
                                   "of printable characters"]


def test_the_key_file_is_not_read_for_a_config_read_back_to_recover(tmp_path: Path) -> None:
    cfg = parse_config(peer(tmp_path / "gone.key"), "t", checkpoints=False)
    assert "node2" in cfg.peers


def test_a_peer_that_does_not_answer_is_a_warning_in_check_config(key: Path,
                                                                   tmp_path: Path) -> None:
    # port 9 on loopback: nothing listens there in the tests (connection refused at once)
    path = tmp_path / "serves.toml"
    path.write_text(peer(key, url="http://127.0.0.1:9"))
    path.chmod(0o600)
    out = subprocess.run([sys.executable, "-m", "gpud.daemon", "--check-config", str(path)],
                         capture_output=True, text=True, cwd=REPO, check=False, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "warning: peers.node2: http://127.0.0.1:9 does not answer" in out.stdout, out.stdout
    assert "circuit" not in out.stdout + out.stderr   # one ask, not a circuit's life


def test_check_config_refuses_a_world_readable_key_file(key: Path, tmp_path: Path) -> None:
    key.chmod(0o644)
    path = tmp_path / "serves.toml"
    path.write_text(peer(key))
    path.chmod(0o600)
    out = subprocess.run([sys.executable, "-m", "gpud.daemon", "--check-config", str(path)],
                         capture_output=True, text=True, cwd=REPO, check=False, timeout=60)
    assert out.returncode == 2
    assert "peers.node2.key_file:" in out.stderr and "mode 0644" in out.stderr


UNIT = (REPO / "units" / "gpud.service").read_text()


def _units(tmp_path: Path, drop_ins: dict[str, str] | None = None,
           lib_drop_ins: dict[str, str] | None = None) -> tuple[Path, ...]:
    """An /etc and a /lib of units: gpud.service installed in /lib (the package's, as
    units/gpud.service ships it), drop-ins in either."""
    etc, lib = tmp_path / "etc", tmp_path / "lib"
    lib.mkdir(parents=True)
    (lib / "gpud.service").write_text(UNIT)
    for where, files in ((etc, drop_ins or {}), (lib, lib_drop_ins or {})):
        (where / "gpud.service.d").mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (where / "gpud.service.d" / name).write_text(text)
    return etc, lib


def test_check_config_warns_when_gpuds_unit_does_not_let_it_reach_a_peer(
        key: Path, tmp_path: Path) -> None:
    """The unit as shipped admits loopback only: a peer at 100.64.0.2 is named, with the
    drop-in that admits it; a drop-in allowing its network, or the peer on loopback, or no
    unit installed: nothing to say."""
    from gpud.host.peers import unit_warnings

    cfg = parse_config(peer(key, url="http://100.64.0.2:8000"), "t")
    dirs = _units(tmp_path)
    [warning] = unit_warnings(cfg, dirs)
    assert warning.startswith("peers.node2: gpud.service (")
    assert "does not let gpud reach 100.64.0.2" in warning
    assert "IPAddressDeny=any, IPAddressAllow=localhost" in warning
    assert "/etc/systemd/system/gpud.service.d/peers.conf" in warning
    assert '"IPAddressAllow=100.64.0.2"' in warning
    # a name: what it resolves to
    named = parse_config(peer(key), "t")
    assert unit_warnings(named, dirs, addresses=lambda host: ["100.64.0.9"]) != []
    assert unit_warnings(named, dirs, addresses=lambda host: []) == []
    # the tailnet's drop-in (docs/peers.md) admits it
    tailnet = _units(tmp_path / "b", {"peers.conf": "[Service]\nIPAddressAllow=100.64.0.0/10\n"})
    assert unit_warnings(cfg, tailnet) == []
    # a drop-in in /etc hides the same-named one in /lib; a later one resetting the list
    # (an empty assignment) takes its allowance back
    hidden = _units(tmp_path / "c", {"peers.conf": "[Service]\nCPUWeight=50\n"},
                    {"peers.conf": "[Service]\nIPAddressAllow=100.64.0.0/10\n"})
    assert len(unit_warnings(cfg, hidden)) == 1
    reset = _units(tmp_path / "d", {"10-peers.conf": "[Service]\nIPAddressAllow=any\n",
                                    "20-reset.conf": "[Service]\nIPAddressAllow=\n"})
    assert len(unit_warnings(cfg, reset)) == 1
    # an allowance outside [Service] is not one
    assert len(unit_warnings(cfg, _units(tmp_path / "e", {
        "peers.conf": "[Unit]\nIPAddressAllow=any\n"}))) == 1
    # loopback, and no unit installed
    assert unit_warnings(parse_config(peer(key, url="http://127.0.0.1:9"), "t"), dirs) == []
    assert unit_warnings(cfg, (tmp_path / "none",)) == []


def test_check_configs_warnings_name_the_unit_drop_in(
        key: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--check-config's warnings (gpud.daemon._warnings) carry the unit's, its dirs given."""
    import gpud.host.peers
    from gpud.daemon import _warnings

    monkeypatch.setattr(gpud.host.peers, "check_peers", lambda cfg: [])
    cfg = parse_config(peer(key, url="http://[fd00::2]:8000"), "t")
    warned = _warnings(cfg, unit_dirs=_units(tmp_path))
    assert any("does not let gpud reach fd00::2" in w for w in warned), warned
    assert not any("gpud.service" in w for w in _warnings(cfg, unit_dirs=()))
