"""One policy, every way in (docs/security.md, "Keys cover every way in"), as a campaign: three
requesters (a greedy key with max_concurrent and requests_per_minute, a polite key with none,
a local user with no key) send the same random sequence of requests through the router and
through each serve's own fronted port, and every door gives the same answers (status and
bytes), sends the serve the same bodies, and counts the same usage. The real nginx and njs,
a fresh front for each door (nginx's zones empty), before serves on Unix sockets that answer
as vLLM 0.32 does and hold a stream open until told, so that the greedy key's requests in
flight are what the campaign says by construction. The seed is printed; GPUD_CAMPAIGN_SEED
sets it."""

from __future__ import annotations

import http.client
import os
import random
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpud.core.front import FrontConfig, FrontServe, render
from gpud.core.keys import parse_keys
from gpud.core.router import RoutedServe, RouterFront
from gpud.core.routerconf import front_policy, http_lines, main_lines
from gpud.core.routerlog import parse_log_line
from gpud.nginx.router import script_text
from tests.ports import connects, free_port
from tests.test_router import NGINX, NJS
from tests.test_router_fronted_body import recording_serve
from tests.waiting import wait_until

GREEDY, POLITE = "sk-greedy-0123456789", "sk-polite-0123456789"
# a minute's worth at once (the burst), then one every 60/RPM s: a campaign takes a second or
# two, far from the next one (checked: RPM_REFILL_S)
RPM = 6
RPM_REFILL_S = 60 / RPM
KEYS = f"""\
[keys.greedy]
token = "{GREEDY}"
models = ["*"]
max_concurrent = 2
requests_per_minute = {RPM}
[keys.polite]
token = "{POLITE}"
models = ["*"]
priority = -1
"""
TOKENS = {"greedy": GREEDY, "polite": POLITE, "local": None}
STEPS = 28


@dataclass
class Serve:
    bodies: list[bytes]
    release: threading.Event = field(default_factory=threading.Event)


@dataclass
class Front:
    tmp: Path
    run: Path
    router: int
    ports: dict[str, int]  # serve -> its fronted port
    serves: dict[str, Serve]
    log: Path
    keys: bool  # the keys file set (else no key is known: every requester its address)


@pytest.fixture
def front(request: pytest.FixtureRequest) -> Iterator[Front]:
    """The config of a front with the router and two fronted serves, `a` (priority scheduling)
    and `b` (first come, first served), both vLLM (their streams' usage asked), with KEYS
    (the fixture's param; default with) or without keys, each fronted port with the router's
    policy (front_policy, which gpud.nginx.front front_config gives every fronted port, with
    keys or without); nginx is started for each door (_run_door)."""
    with_keys = getattr(request, "param", True)
    keys, problems = parse_keys(KEYS, ["a", "b"])
    assert problems == []
    tmp = Path(tempfile.mkdtemp(prefix="gpud-campaign-"))
    tmp.chmod(0o755)
    run = tmp / "run"
    for name in ("", "body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (run / name).mkdir(exist_ok=True)
    serves, servers = {}, []
    for name in ("a", "b"):
        serves[name] = Serve([])
        server = recording_serve(str(tmp / f"{name}.sock"), serves[name].bodies,
                                 serves[name].release)
        os.chmod(tmp / f"{name}.sock", 0o777)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    port, ports = free_port(), {"a": free_port(), "b": free_port()}
    router = RouterFront(
        f"127.0.0.1:{port}",
        (RoutedServe("a", ("a",), socket=str(tmp / "a.sock"), priority_scheduling=True,
                     stream_usage=True),
         RoutedServe("b", ("b",), socket=str(tmp / "b.sock"), stream_usage=True)),
        njs_module=str(NJS), script=str(tmp / "router.js"),
        gpud_socket=str(tmp / "no-gpud.sock"), keys=tuple(keys) if with_keys else None,
        max_body_mib=4, access_log=str(tmp / "access.log"))
    policies = {name: front_policy(router, name) for name in ports}
    (tmp / "router.js").write_text(script_text(router))
    (tmp / "nginx.conf").write_text(render(FrontConfig(
        serves=tuple(FrontServe(name, p, str(tmp / f"{name}.sock")) for name, p in ports.items()),
        run_dir=str(run), listen="127.0.0.1",
        main_extra=tuple(main_lines(router)), http_extra=tuple(http_lines(router)),
        keys=with_keys, policies=tuple(policies.items()))))
    try:
        yield Front(tmp, run, port, ports, serves, tmp / "access.log", with_keys)
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def campaign(seed: int) -> list[tuple[str, str]]:
    """STEPS (requester, kind) drawn from SEED: the greedy key most often; kinds: chat (one
    answer), stream (completions, no usage asked), asked (a chat stream that asks for its
    usage), embed (embeddings: a route whose body a fronted port reads only under priority
    scheduling, `a`, and passes on unread on `b`), hold (a chat stream the serve holds open until a release), release."""
    rnd = random.Random(seed)
    steps = []
    for _ in range(STEPS):
        who = rnd.choices(["greedy", "polite", "local"], [6, 3, 1])[0]
        kind = rnd.choices(["chat", "stream", "asked", "embed", "hold", "release"],
                           [3, 3, 2, 2, 3, 1])[0]
        steps.append(("", "release") if kind == "release" else (who, kind))
    return steps


def _body(model: str, kind: str) -> bytes:
    if kind == "stream":
        return (b'{"model": "%s", "stream": true, "prompt": "\\u00e9 \xf0\x9f\x98\x80",'
                b' "seed": 123456789012345678901234567890}' % model.encode())
    chat = b'"messages": [{"role": "user", "content": "hi"}]'
    if kind == "embed":
        return b'{"model": "%s", "input": "hi"}' % model.encode()
    if kind == "chat":
        return b'{"model": "%s", %s, "priority": -50}' % (model.encode(), chat)
    if kind == "asked":
        return (b'{"model": "%s", "stream": true, "stream_options": {"include_usage": true},'
                b' %s}' % (model.encode(), chat))
    return b'{"model": "%s", "stream": true, "user": "hold", %s}' % (model.encode(), chat)


@dataclass
class Run:
    answers: list[tuple[str, str, int, bytes]] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    usage: list[tuple[str, int, int | None, int | None, bool]] = field(default_factory=list)


def _run_door(front: Front, serve: str, port: int, steps: list[tuple[str, str]]) -> Run:
    """The campaign through PORT on a fresh nginx: each step's answer, the bodies SERVE got,
    and the usage the access log counts."""
    front.log.unlink(missing_ok=True)
    errors = (front.tmp / "nginx.log").open("ab")
    nginx = subprocess.Popen([str(NGINX), "-c", str(front.tmp / "nginx.conf"),
                              "-p", f"{front.run}/"],
                             stdout=subprocess.DEVNULL, stderr=errors)
    out, held = Run(), []
    rec = front.serves[serve]
    before = len(rec.bodies)
    try:
        wait_until(lambda: all(connects(p) for p in (front.router, *front.ports.values())),
                   what="the front listening")
        began = time.monotonic()
        sent = 0
        for who, kind in steps:
            if kind == "release":
                rec.release.set()
                for conn, resp, step in held:
                    out.answers.append((*step, resp.status, resp.read()))
                    conn.close()
                held = []
                rec.release.clear()
                continue
            token = TOKENS[who]
            headers = {"Content-Type": "application/json",
                       **({"Authorization": f"Bearer {token}"} if token else {})}
            route = {"stream": "/v1/completions",
                     "embed": "/v1/embeddings"}.get(kind, "/v1/chat/completions")
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("POST", route, body=_body(serve, kind), headers=headers)
            resp = conn.getresponse()  # a held stream: its header, once the serve has it
            sent += 1
            if kind == "hold" and resp.status == 200:
                held.append((conn, resp, (who, kind)))
                continue
            out.answers.append((who, kind, resp.status, resp.read()))
            conn.close()
        rec.release.set()
        for conn, resp, step in held:
            out.answers.append((*step, resp.status, resp.read()))
            conn.close()
        rec.release.clear()
        # the premise of the rates' answers: no request of the key's came back to its rate
        assert time.monotonic() - began < RPM_REFILL_S, "the campaign took longer than a refill"
        out.bodies = rec.bodies[before:]

        def lines() -> list[str]:
            return front.log.read_text().splitlines() if front.log.exists() else []
        wait_until(lambda: len(lines()) == sent, what=f"{sent} access-log lines")
        for line in lines():
            a = parse_log_line(line, {"a": "a", "b": "b"})
            assert a is not None, line
            out.usage.append((a.key, a.status, a.prompt_tokens, a.completion_tokens,
                              a.hung_up))
        return out
    finally:
        rec.release.set()
        nginx.terminate()
        nginx.wait(timeout=10)
        errors.close()
        rec.release.clear()


@pytest.mark.parametrize("front", [True, False], indirect=True, ids=["keys", "no-keys"])
def test_a_campaign_gets_the_same_answers_and_usage_through_every_door(front: Front) -> None:
    seed = int(os.environ.get("GPUD_CAMPAIGN_SEED") or random.randrange(1 << 32))
    print(f"campaign seed {seed} (GPUD_CAMPAIGN_SEED={seed} runs it again)")
    steps = campaign(seed)
    for serve, port in front.ports.items():
        through_router = _run_door(front, serve, front.router, steps)
        through_port = _run_door(front, serve, port, steps)
        for got in (through_router, through_port):
            # the local user has no key: refused on every way in; the polite key is never
            # held back (without keys: no one is, and the usage is the one bucket "");
            # every answer the serve gave is metered, its usage the serve's
            if front.keys:
                assert {s for who, _k, s, _b in got.answers if who == "local"} <= {401}, seed
            assert all(s == 200 for who, _k, s, _b in got.answers
                       if who == "polite" or not front.keys), seed
            assert front.keys or {k for k, *_ in got.usage} == {""}, (seed, got.usage)
            assert all(p is not None and c is not None for _k, s, p, c, _h in got.usage
                       if s == 200), (seed, got.usage)
            assert not any(b'"usage"' in b for _w, k, s, b in got.answers
                           if k in ("stream", "hold")), seed
        assert through_port.answers == through_router.answers, (seed, serve)
        assert through_port.bodies == through_router.bodies, (seed, serve)
        assert sorted(through_port.usage) == sorted(through_router.usage), (seed, serve)


def test_a_request_refused_by_max_concurrent_takes_none_of_its_keys_rate_on_any_door(
        front: Front) -> None:
    # two held streams: the greedy key at its max_concurrent; three requests refused by it,
    # then as many as its rate lets through: RPM in all, whichever door and route (`b`'s
    # fronted port passes embeddings on unread, from a location of their own)
    steps = [("greedy", "hold")] * 2 + [("greedy", "embed")] * 3 + [("", "release")] + \
        [("greedy", "chat")] * (RPM - 1)
    for serve, port in front.ports.items():
        for door in (front.router, port):
            got = [(kind, status) for _w, kind, status, _b in _run_door(front, serve, door,
                                                                         steps).answers]
            assert got == ([("embed", 429)] * 3 + [("hold", 200)] * 2
                           + [("chat", 200)] * (RPM - 2) + [("chat", 429)]), (serve, door, got)


@pytest.mark.parametrize("front", [False], indirect=True, ids=["no-keys"])
def test_without_keys_a_fronted_port_gives_the_share_and_counts_usage_as_the_router(
        front: Front) -> None:
    # one local user (no key: its address, all of loopback one requester): a chat while its
    # stream is held goes one step behind (the share: priority 1), one after it at 0, and
    # every request is counted in the one bucket without a key, through either door
    steps = [("local", "hold"), ("local", "chat"), ("", "release"), ("local", "chat")]
    chat = _body("a", "chat")
    brace = chat.index(b"{") + 1
    hold = _body("a", "hold")
    for door in (front.router, front.ports["a"]):
        got = _run_door(front, "a", door, steps)
        assert [s for _w, _k, s, _b in got.answers] == [200, 200, 200], (door, got.answers)
        assert got.bodies == [
            hold[:brace] + b'"stream_options":{"include_usage":true},"priority":0,'
            + hold[brace:],
            chat.replace(b'"priority": -50', b'"priority": 1'),
            chat.replace(b'"priority": -50', b'"priority": 0')], (door, got.bodies)
        assert sorted(got.usage) == [("", 200, 5, 2, False), ("", 200, 5, 2, False),
                                     ("", 200, 11, 3, False)], (door, got.usage)
