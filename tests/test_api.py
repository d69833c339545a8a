"""The API of a real gpud process on a real Unix socket, with a real SQLite store."""

from __future__ import annotations

import json
import os
import pwd
import socket
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

import gpud.server.api
from tests.conftest import T015, GpudProcess, call, start_gpud


def admit(gp: GpudProcess, serve: str, mib: object, role: str | None = None) -> tuple[int, dict]:
    body: dict[str, object] = {"mib": mib}
    if role:
        body["role"] = role
    reply = gp.call("POST", f"/v1/serves/{serve}/admit", body)
    return reply.status, reply.body


def ledger_of(gp: GpudProcess) -> dict:
    return gp.call("GET", "/v1/ledger").body["roles"][0]


def fill_t015(gp: GpudProcess) -> None:
    for serve, mib in (("fast", 18432), ("embeddings", 3200), ("reranker", 3456)):
        status, body = admit(gp, serve, mib)
        assert status == 200, body


def test_seed_t015_denial_through_the_socket(gpud_t015: GpudProcess) -> None:
    fill_t015(gpud_t015)
    role = ledger_of(gpud_t015)
    assert (role["committed_mib"], role["free_mib"]) == (25088, 351)
    status, body = admit(gpud_t015, "ocr", 5120)
    assert status == 409
    assert body["error"]["code"] == "denied"
    details = body["error"]["details"]
    assert {k: details[k] for k in ("bound", "need_mib", "free_mib", "shortfall_mib")} == {
        "bound": "ledger", "need_mib": 5120, "free_mib": 351, "shortfall_mib": 4769}
    ocr = gpud_t015.call("GET", "/v1/serves/ocr").body
    assert ocr["state"] == "denied"
    assert ocr["reason"] == "ledger bound: need 5120 MiB, free 351 MiB, short 4769 MiB"
    assert ledger_of(gpud_t015)["committed_mib"] == 25088
    events = gpud_t015.call("GET", "/v1/events?serve=ocr").body["events"]
    assert [e["kind"] for e in events] == ["deny"]
    assert events[0]["details"]["shortfall_mib"] == 4769


def test_ledger_survives_restart_and_changed_config(tmp_path: Path) -> None:
    gp = start_gpud(tmp_path, T015)
    fill_t015(gp)
    before = ledger_of(gp)["reservations"]
    assert gp.stop() == 0
    # The same store under a config whose capacity shrank below what is held: the change is
    # refused (the ledger would over-commit), gpud runs the config it last ran with and says so.
    gp = start_gpud(tmp_path, T015.replace("capacity_mib = 32607", "capacity_mib = 30000"),
                    state_dir=tmp_path / "state")
    try:
        role = ledger_of(gp)
        assert role["reservations"] == before
        assert role["over_committed"] is False and role["free_mib"] == 351
        status = gp.call("GET", "/v1/status").body
        assert status["over_committed"] == []
        assert status["config_file"]["differs"] is True
        reason = status["config_file"]["reason"]
        assert reason.startswith("refused at start: roles.dark-fast: committed 25088 MiB")
        assert "exceed capacity - reserve = 22832 MiB" in reason
    finally:
        gp.stop()
    # A change the ledger can follow is taken at the next start, and the file is in force again.
    gp = start_gpud(tmp_path, T015.replace("capacity_mib = 32607", "capacity_mib = 32500"),
                    state_dir=tmp_path / "state")
    try:
        assert ledger_of(gp)["free_mib"] == 351 - 107
        assert gp.call("GET", "/v1/status").body["config_file"] == {"differs": False,
                                                                   "reason": None}
    finally:
        gp.stop()


def test_replace_and_release(gpud_t015: GpudProcess) -> None:
    fill_t015(gpud_t015)
    status, body = admit(gpud_t015, "fast", 14336)
    assert status == 200 and body["replaced_mib"] == 18432
    assert body["figures"]["free_mib"] == 351 + 18432 - 14336
    reply = gpud_t015.call("POST", "/v1/serves/fast/release", {})
    assert reply.status == 200 and reply.body["released_mib"] == 14336
    again = gpud_t015.call("POST", "/v1/serves/fast/release", {})
    assert again.status == 409 and "holds no reservation" in again.body["error"]["message"]


def test_external_reservation_needs_a_role(gpud_t015: GpudProcess) -> None:
    status, body = admit(gpud_t015, "sidecar", 300)
    assert status == 404 and "--role" in body["error"]["message"]
    status, body = admit(gpud_t015, "sidecar", 300, role="dark-fast")
    assert status == 200
    assert gpud_t015.call("GET", "/v1/serves/sidecar").body["state"] == "external"
    status, body = admit(gpud_t015, "sidecar", 300, role="nope")
    assert status == 404 and "unknown role 'nope'" in body["error"]["message"]
    status, body = admit(gpud_t015, "fast", 300, role="other")
    assert status == 400 and "configured on role 'dark-fast'" in body["error"]["message"]


BAD_BODIES = [
    (b"{", 400, "invalid JSON"),
    (b"[1, 2]", 400, "must be a JSON object"),
    (b'{"mib": -5}', 400, "mib: must be > 0"),
    (b'{"mib": 0}', 400, "mib: must be > 0"),
    (b'{"mib": 1.5}', 400, "must be a positive integer number of MiB, got 1.5"),
    (b'{"mib": NaN}', 400, "NaN is not a number JSON allows"),
    (b'{"mib": Infinity}', 400, "Infinity is not a number JSON allows"),
    (b'{"mib": "5120"}', 400, 'got "5120"'),
    (b'{"mib": true}', 400, "must be a positive integer number of MiB"),
    (b'{"mib": null}', 400, "must be a positive integer number of MiB"),
    (json.dumps({"mib": 2**70}).encode(), 400, "mib: must be <= 2147483647"),
    (b'{"mib": 5, "evil": 1}', 400, "evil: unknown key"),
    (b'{"mib": 5, "role": 7}', 400, "role: must be a string"),
    # a dry run without preempt would have been an admission carried out
    (b'{"mib": 5, "dry_run": true}', 400, "dry_run goes with preempt"),
    (b"", 400, "body is empty"),
    (b"\xff\xfe", 400, "not UTF-8"),
    (b"[" * 100000 + b"]" * 100000, 413, "over the limit"),
    (b'{"mib": 5, "pad": "' + b"x" * 70000 + b'"}', 413, "over the limit"),
]


@pytest.mark.parametrize(("raw", "status", "text"), BAD_BODIES,
                         ids=[f"bad{i}" for i in range(len(BAD_BODIES))])
def test_bad_bodies_refused_and_ledger_unchanged(gpud_t015: GpudProcess, raw: bytes,
                                                 status: int, text: str) -> None:
    fill_t015(gpud_t015)
    before = ledger_of(gpud_t015)
    reply = gpud_t015.call("POST", "/v1/serves/ocr/admit", raw=raw,
                           headers={"Content-Type": "application/json"})
    assert reply.status == status, reply.raw[:300]
    assert set(reply.body) == {"error"} and set(reply.body["error"]) == {"code", "message", "details"}
    assert text in reply.body["error"]["message"]
    assert ledger_of(gpud_t015) == before
    assert gpud_t015.alive()


def test_deeply_nested_json_within_limit(gpud_t015: GpudProcess) -> None:
    reply = gpud_t015.call("POST", "/v1/serves/ocr/admit", raw=b"[" * 30000 + b"]" * 30000)
    assert reply.status == 400
    assert gpud_t015.alive()


@pytest.mark.parametrize("name", ["../x", "a b;rm -rf /", "%n", "ocr\u00e9", "x" * 300, "Fast",
                                  "-x", "a/b", ".."], ids=lambda n: repr(n[:20]))
def test_hostile_names(gpud_t015: GpudProcess, name: str) -> None:
    from urllib.parse import quote

    reply = gpud_t015.call("POST", f"/v1/serves/{quote(name, safe='')}/admit", {"mib": 5})
    assert reply.status in (400, 404), reply.raw
    if reply.status == 400:
        assert "invalid serve name" in reply.body["error"]["message"]
    get = gpud_t015.call("GET", f"/v1/serves/{quote(name, safe='')}")
    assert get.status in (400, 404) and get.body["error"]["code"] in ("bad-request", "not-found")
    assert ledger_of(gpud_t015)["committed_mib"] == 0
    assert gpud_t015.alive()


def test_unknown_serve_and_route(gpud_t015: GpudProcess) -> None:
    reply = gpud_t015.call("GET", "/v1/serves/nobody")
    assert reply.status == 404 and reply.body["error"]["code"] == "not-found"
    reply = gpud_t015.call("GET", "/v2/anything")
    assert reply.status == 404 and reply.body["error"]["code"] == "not-found"
    reply = gpud_t015.call("DELETE", "/v1/ledger")
    assert reply.status == 405 and reply.body["error"]["code"] == "bad-request"


def test_launching_unavailable_is_503(gpud_t015: GpudProcess) -> None:
    # conftest gives gpud a system bus address where nothing listens.
    reply = gpud_t015.call("POST", "/v1/serves/fast/start", {})
    assert reply.status == 503
    assert reply.body["error"]["code"] == "unavailable"
    message = reply.body["error"]["message"]
    # The reason the README promises: the system bus, and why it cannot be reached.
    assert message.startswith("launching is unavailable: system bus: "), message
    assert "no-system-bus" in message or "No such file" in message, message
    status = gpud_t015.call("GET", "/v1/status").body
    assert status["launching"]["available"] is False and status["launching"]["reason"]
    # The ledger works all the same.
    assert gpud_t015.call("POST", "/v1/serves/fast/admit", {"mib": 100}).status == 200
    assert gpud_t015.alive()


def _as_user(sock: Path, method: str, path: str, body: dict | None, uid: int,
             groups: list[int]) -> tuple[int, dict]:
    """Make a request from a forked child that has dropped to `uid`: SO_PEERCRED sees it."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.close(read)
            os.setgroups(groups)
            os.setgid(groups[0] if groups else 65534)
            os.setuid(uid)
            reply = call(sock, method, path, body)
            os.write(write, json.dumps([reply.status, reply.body]).encode())
        except BaseException as exc:
            os.write(write, json.dumps([-1, {"exc": repr(exc)}]).encode())
        finally:
            os._exit(0)
    os.close(write)
    data = b""
    while chunk := os.read(read, 65536):
        data += chunk
    os.close(read)
    os.waitpid(pid, 0)
    status, payload = json.loads(data)
    return status, payload


@pytest.fixture
def open_socket_gpud() -> GpudProcess:
    # A socket directory others can traverse; the socket opened to all so the peer check, not
    # the file mode, is what refuses.
    tmp = Path(tempfile.mkdtemp(prefix="gpud-test-"))
    tmp.chmod(0o755)
    gp = start_gpud(tmp, T015.replace('admission = "ledger"',
                                      'admission = "ledger"\nadmin_group = "users"'))
    gp.socket.chmod(0o666)
    yield gp
    gp.stop()
    subprocess.run(["rm", "-rf", str(tmp)], check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users")
def test_peer_credentials_decide_mutations(open_socket_gpud: GpudProcess) -> None:
    gp = open_socket_gpud
    users_gid = 100
    status, body = _as_user(gp.socket, "GET", "/v1/ledger", None, 65534, [65534])
    assert status == 200 and body["roles"][0]["committed_mib"] == 0
    status, body = _as_user(gp.socket, "POST", "/v1/serves/fast/admit", {"mib": 100}, 65534,
                            [65534])
    assert status == 403, body
    assert body["error"]["code"] == "forbidden" and "uid 65534" in body["error"]["message"]
    assert ledger_of(gp)["committed_mib"] == 0
    # Membership of the admin group is enough.
    status, body = _as_user(gp.socket, "POST", "/v1/serves/fast/admit", {"mib": 100}, 65534,
                            [65534, users_gid])
    assert status == 200, body
    assert ledger_of(gp)["reservations"][0]["by_uid"] == 65534
    assert "refused POST /v1/serves/fast/admit from uid 65534" in gp.output()


def test_socket_mode_and_refusal_when_in_use(gpud_t015: GpudProcess, tmp_path: Path) -> None:
    st = gpud_t015.socket.stat()
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
    other = start_gpud(tmp_path / "second" if (tmp_path / "second").mkdir() is None else tmp_path,
                       T015, wait=False, sock=gpud_t015.socket, state_dir=tmp_path / "st2")
    assert other.proc.wait(20) == 1
    assert "another gpud is already answering" in other.output()
    assert gpud_t015.call("GET", "/v1/status").status == 200


def test_stale_socket_replaced(tmp_path: Path) -> None:
    stale = tmp_path / "gpud.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()  # bound, nobody listening: stale
    gp = start_gpud(tmp_path, T015, sock=stale)
    try:
        assert gp.call("GET", "/v1/status").status == 200
    finally:
        gp.stop()
    assert not stale.exists()


def test_refuses_to_replace_a_regular_file(tmp_path: Path) -> None:
    path = tmp_path / "gpud.sock"
    path.write_text("precious")
    gp = start_gpud(tmp_path, T015, wait=False, sock=path)
    assert gp.proc.wait(20) == 1
    assert "is not a socket" in gp.output()
    assert path.read_text() == "precious"


@pytest.mark.parametrize(("text", "message"), [
    ("[roles.x\n", "TOML syntax"),
    ('[roles.x]\ndevice = "0"\n', "roles.x.capacity_mib: required"),
    ('[serves.a]\nrole = "r"\nvram_mib = 1\ncommand = ["x"]\n', "serves.a.role: unknown role"),
])
def test_broken_config_exits_2(tmp_path: Path, text: str, message: str) -> None:
    gp = start_gpud(tmp_path, text, wait=False)
    assert gp.proc.wait(20) == 2
    assert message in gp.output()


def test_events_filters_and_openapi(gpud_t015: GpudProcess) -> None:
    fill_t015(gpud_t015)
    admit(gpud_t015, "ocr", 5120)
    evs = gpud_t015.call("GET", "/v1/events?kind=admit&limit=2").body["events"]
    assert [e["serve"] for e in evs] == ["embeddings", "reranker"]
    since = evs[-1]["ts"]
    later = gpud_t015.call("GET", f"/v1/events?since={since}").body["events"]
    assert [e["kind"] for e in later] == ["admit", "deny"]
    bad = gpud_t015.call("GET", "/v1/events?since=yesterday-ish")
    assert bad.status == 400 and "since" in bad.body["error"]["message"]
    bad = gpud_t015.call("GET", "/v1/events?limit=0")
    assert bad.status == 400
    doc = gpud_t015.call("GET", "/v1/openapi.json").body
    assert doc["openapi"].startswith("3.") and "/v1/serves/{name}/admit" in doc["paths"]


def test_concurrent_admissions_never_over_commit(tmp_path: Path) -> None:
    """16 clients race for 10 slots of 2799 MiB on 27999 free: exactly 10 win."""
    serves = "".join(
        f'[serves.s{i}]\nrole = "dark-fast"\nvram_mib = 2799\ncommand = ["/bin/true"]\n'
        for i in range(16))
    cfg = T015.split("[serves.fast]")[0].replace("reserve_mib = 7168", "reserve_mib = 4608")
    gp = start_gpud(tmp_path, cfg + serves)
    try:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda i: admit(gp, f"s{i}", 2799)[0], range(16)))
        assert sorted(results) == [200] * 10 + [409] * 6
        role = ledger_of(gp)
        assert role["committed_mib"] == 27990 and role["free_mib"] == 9
    finally:
        gp.stop()


def test_release_with_stop_of_what_gpud_does_not_run(gpud_t015: GpudProcess) -> None:
    # An external reservation has no unit of gpud's: --stop releases it all the same.
    assert admit(gpud_t015, "sidecar", 300, role="dark-fast")[0] == 200
    reply = gpud_t015.call("POST", "/v1/serves/sidecar/release", {"stop": True})
    assert reply.status == 200 and reply.body["released_mib"] == 300
    # A configured serve holding nothing: refused before anything is stopped.
    reply = gpud_t015.call("POST", "/v1/serves/ocr/release", {"stop": True})
    assert reply.status == 409 and "holds no reservation" in reply.body["error"]["message"]
    assert [e["kind"] for e in gpud_t015.call("GET", "/v1/events?serve=ocr").body["events"]] == []


def test_preempt_only_for_configured_serves(gpud_t015: GpudProcess) -> None:
    before = ledger_of(gpud_t015)
    for name in ("sidecar", "fresh"):
        reply = gpud_t015.call("POST", f"/v1/serves/{name}/admit",
                               {"mib": 300, "role": "dark-fast", "preempt": True})
        assert reply.status == 400, reply.raw
        assert "a preemption makes room only for a serve gpud launches" in \
            reply.body["error"]["message"]
        assert ledger_of(gpud_t015) == before
        status, _ = admit(gpud_t015, "sidecar", 300, role="dark-fast")
        assert status == 200
        before = ledger_of(gpud_t015)
    reply = gpud_t015.call("POST", "/v1/serves/sidecar/admit",
                           {"mib": 400, "preempt": True})
    assert reply.status == 400 and "holds an external reservation" in \
        reply.body["error"]["message"], reply.raw
    assert ledger_of(gpud_t015) == before


def test_the_front_user_not_found_is_looked_up_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # the package may create the front's user after gpud started: a miss is not remembered
    calls: list[str] = []

    def getpwnam(name: str) -> pwd.struct_passwd:
        calls.append(name)
        if len(calls) == 1:
            raise KeyError(name)
        return pwd.struct_passwd(("later", "x", 4242, 4242, "", "/", "/usr/sbin/nologin"))

    monkeypatch.setattr(gpud.server.api.pwd, "getpwnam", getpwnam)
    assert gpud.server.api._uid_of("gpud-front-made-later") is None
    assert gpud.server.api._uid_of("gpud-front-made-later") == 4242
    assert gpud.server.api._uid_of("gpud-front-made-later") == 4242 and len(calls) == 2


def test_status_says_whether_the_router_listens(tmp_path: Path) -> None:
    """GET /v1/status: with a [router], its address and whether a connection to it is
    accepted now (gpuctl status's router line); no [router], no such part."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        gp = start_gpud(tmp_path, T015 + f'\n[router]\nlisten = "127.0.0.1:{port}"\n')
        try:
            status = gp.call("GET", "/v1/status").body
            assert status["router"] == {"listen": f"127.0.0.1:{port}", "listening": False,
                                        "degraded": []}, status
            held.listen()
            status = gp.call("GET", "/v1/status").body
            assert status["router"]["listening"] is True, status
            assert status["host"] == socket.gethostname()
        finally:
            gp.stop()
    (tmp_path / "no-router").mkdir()
    gp = start_gpud(tmp_path / "no-router", T015)
    try:
        assert "router" not in gp.call("GET", "/v1/status").body
    finally:
        gp.stop()
