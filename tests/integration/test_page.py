"""The status page (docs/status-page.md) in a real browser: Debian's chromium, headless, loads
gpud's /ui inside the sandbox (through a loopback port forwarded to gpud's socket, as an
operator's `ssh -L` does), runs the page's script against the live API, and this test reads
what it shows: serve names, states, the ledger's figures, the non-ledger draw, the queue by
requester, usage per key, the last events. A screenshot is kept under the test's tmp dir."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tests.integration.gpudctl import PY, REPO, SandboxGpud, fronted_gpud, sim_config, standin_uds
from tests.waiting import wait_until

ROUTER = 30490
PORT = 30491
PAGE = 30499  # the loopback port forwarded to gpud's socket
KEYS = "/etc/gpud-router-keys.toml"
TOKEN = "sk-page-0123456789abcdef"
USER = "gpud-page-client"  # a local user who is nobody to gpud
VIEWER = "gpud-page-viewer"  # in group gpud: may read, not change
CHROMIUM = "/usr/bin/chromium"
SHOT = "/run/gpud-page.png"



@pytest.fixture(autouse=True)
def _chromium() -> None:
    """Debian's chromium, which scripts/setup-test installs: in CI its absence fails (a skip
    there would count as a pass), elsewhere it skips and says why."""
    if shutil.which("chromium") is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing: scripts/setup-test installs it")
        pytest.skip("chromium is missing: run scripts/setup-test")


def page_config() -> str:
    serves = (
        # on demand, running, behind the router; busy and up for less than router.min_awake_s:
        # not evicted for big
        f'[serves.chat]\nrole = "r"\nvram_mib = 9000\nport = {PORT}\non_demand = true\n'
        'models = ["chat"]\n'
        f"command = {standin_uds('--token-interval-s', '0.2', '--served-model-name', 'chat')}\n"
        # on demand, does not fit beside chat: a request for it waits in the router's queue
        f'[serves.big]\nrole = "r"\nvram_mib = 20000\nport = {PORT + 1}\non_demand = true\n'
        'models = ["big"]\n'
        f"command = {standin_uds('--served-model-name', 'big')}\n"
        # never started: declared
        f'[serves.idle]\nrole = "r"\nvram_mib = 2000\nport = {PORT + 2}\nfront = true\n'
        'models = ["idle"]\n'
        f"command = {standin_uds('--served-model-name', 'idle')}\n"
    )
    role = '[roles.r]\ndevice = "GPU-sim-0"\nreserve_mib = 4000\nnote = "display"\n'
    router = (f'[router]\nlisten = "127.0.0.1:{ROUTER}"\napi_keys_file = "{KEYS}"\n'
              "queue_timeout_s = 300\nmax_queued = 8\nmin_awake_s = 600\n")
    return sim_config(role, serves) + router


@pytest.fixture
def paged(gpud: SandboxGpud) -> Iterator[SandboxGpud]:
    keys = f'[keys.ci]\ntoken = "{TOKEN}"\nmodels = ["*"]\n'
    with gpud.keys_file(KEYS, keys, SHOT), fronted_gpud(gpud, page_config(), [USER, VIEWER]):
        gpud.sb.run(["usermod", "-aG", "gpud", VIEWER])
        gpud.set_external([{"device": "GPU-sim-0", "label": "display", "mib": 3500}])
        yield gpud


class Shown(HTMLParser):
    """What the page's DOM shows: the text of each element with a data-field (by its row's
    data-serve, data-key or data-role), of each element with an id, and the bars' segments."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[tuple[str, dict[str, str], list[str]]] = []
        self.by_id: dict[str, str] = {}
        self.serves: dict[str, dict[str, str]] = {}
        self.usage: dict[tuple[str, str], dict[str, str]] = {}
        self.figures: dict[tuple[str, str], str] = {}
        self.bars: dict[tuple[str, str], list[str]] = {}
        self.events: list[dict[str, str]] = []
        self.problems: list[str] = []
        self.body: dict[str, str] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "body":
            self.body = a
        if "data-event" in a:
            self.events.append({"id": a["data-event"]})
        if tag in ("meta", "br", "link", "input", "img"):
            return
        self.stack.append((tag, a, []))

    def handle_data(self, data: str) -> None:
        for _tag, _a, texts in self.stack:
            texts.append(data)

    def _up(self, key: str) -> str | None:
        return next((a[key] for _t, a, _x in reversed(self.stack) if key in a), None)

    def handle_endtag(self, tag: str) -> None:
        if not self.stack or self.stack[-1][0] != tag:
            return
        _tag, a, texts = self.stack.pop()
        text = " ".join("".join(texts).split())
        if "id" in a:
            self.by_id[a["id"]] = text
        field, serve, key, role = a.get("data-field"), self._up("data-serve"), \
            self._up("data-key"), self._up("data-role")
        if field and serve:
            self.serves.setdefault(serve, {})[field] = text
        if field and key:
            self.usage.setdefault((key, self._up("data-model") or ""), {})[field] = text
        if "data-figures" in a and role:
            self.figures[(role, a["data-figures"])] = text
        if tag == "span" and role and self._up("data-bar"):
            self.bars.setdefault((role, self._up("data-bar") or ""), []).append(text)
        if tag == "li" and self._up("id") == "problems":
            self.problems.append(text)
        if field and self._up("data-event") and self.events:
            self.events[-1][field] = text


def chromium(gpud: SandboxGpud, *args: str) -> str:
    """Headless chromium inside the sandbox on the page; its stdout. --virtual-time-budget:
    the page's script runs (its first poll of the API, and the next) before the DOM is dumped
    or the screenshot taken."""
    result = gpud.sb.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--user-data-dir=/tmp/gpud-page-chromium", "--virtual-time-budget=5000",
         *args, f"http://127.0.0.1:{PAGE}/ui"],
        env={"HOME": "/tmp"}, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@contextlib.contextmanager
def page_forwarded(gpud: SandboxGpud, user: str | None = None) -> Iterator[None]:
    """127.0.0.1:PAGE in the sandbox forwarded to gpud's socket (socket_proxy.py), as USER
    (root when None), while the block runs."""
    proxy = gpud.sb.popen([PY, str(REPO / "tests" / "integration" / "socket_proxy.py"),
                           f"127.0.0.1:{PAGE}", "/run/gpud/gpud.sock"], user=user,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert proxy.stdout is not None and proxy.stdout.readline().strip() == "listening"
        yield
    finally:
        gpud.sb.kill(proxy)
        if proxy.stdout is not None:
            proxy.stdout.close()


def shown_page(gpud: SandboxGpud) -> Shown:
    """What headless chromium shows of the page once its script has run (page_forwarded)."""
    shown = Shown()
    shown.feed(chromium(gpud, "--dump-dom"))
    return shown


def test_the_page_shows_the_ledger_the_serves_the_queue_and_usage_live(
        paged: SandboxGpud, tmp_path: Path) -> None:
    gpud = paged
    sb = gpud.sb
    # chat is brought up by its first request through the router
    body = json.dumps({"model": "chat", "prompt": "a b", "max_tokens": 2})
    for _ in range(2):
        out = sb.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-H",
                      f"Authorization: Bearer {TOKEN}", "-d", body,
                      f"http://127.0.0.1:{ROUTER}/v1/completions"], user=USER).stdout
        assert out == "200", out
    gpud.wait_state("chat", "running")
    # usage is read from the router's log and stored every few seconds: until it is there
    wait_until(lambda: gpud.get("/v1/usage")["rows"], timeout=30, what="usage stored")
    usage = {(r["key"], r["model"]): r for r in gpud.get("/v1/usage")["rows"]}
    # a long request keeps chat busy (in flight for minutes)
    busy = sb.popen(["curl", "-s", "-o", "/dev/null", "-H", f"Authorization: Bearer {TOKEN}",
                     "-d", json.dumps({"model": "chat", "prompt": "a", "max_tokens": 3000,
                                       "ignore_eos": True}),
                     f"http://127.0.0.1:{ROUTER}/v1/completions"], user=USER,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until(lambda: gpud.serve("chat")["in_flight"], timeout=30, what="chat busy")
    # a request for big waits in the queue (chat is busy and up for less than min_awake_s):
    # the queue, by requester
    waiting = sb.popen(["curl", "-s", "-o", "/dev/null", "-H", f"Authorization: Bearer {TOKEN}",
                        "-d", json.dumps({"model": "big", "prompt": "a", "max_tokens": 1}),
                        f"http://127.0.0.1:{ROUTER}/v1/completions"], user=USER,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: gpud.serve("big").get("queue"), timeout=30,
                   what="a request queued for big")
        ledger = {r["name"]: r for r in gpud.get("/v1/ledger")["roles"]}["r"]
        states = {s["name"]: s["state"] for s in gpud.get("/v1/serves")["serves"]}
        with page_forwarded(gpud, VIEWER):  # a reader: in group gpud, not an admin
            shown = shown_page(gpud)
            chromium(gpud, f"--screenshot={SHOT}", "--window-size=1400,1000",
                     "--hide-scrollbars")
        (tmp_path / "status-page.png").write_bytes(sb.host_path(SHOT).read_bytes())
    finally:
        sb.kill(waiting)
        sb.kill(busy)

    # the script ran and read every route (a failed read says "gpud unreachable")
    assert shown.body.get("data-updated"), shown.by_id
    # live: it polled again, with no reload (5 s of the page's time, a poll every 2 s)
    assert int(shown.body.get("data-polls", "0")) >= 2, shown.body
    assert shown.by_id["live"].startswith("live"), shown.by_id["live"]
    host = sb.run(["hostname"]).stdout.strip()
    assert shown.by_id["title"] == f"gpud on {host}"
    assert "simulated GPU" in shown.by_id["meta"]
    assert shown.by_id["router"] == f"router: listening on 127.0.0.1:{ROUTER}"
    assert shown.problems == []  # launching, observation, store, front: all well

    # each serve: its models, state and host; the queue by requester and its wait
    assert states["chat"] == "running" and states["idle"] == "declared", states
    assert {n: (s["models"], s["state"], s["host"]) for n, s in shown.serves.items()} == {
        n: (n, states[n], host) for n in ("chat", "big", "idle")}, shown.serves
    assert shown.serves["chat"]["reserved"] == "9000"
    assert shown.serves["big"]["queue"] == "ci \u00d7 1 (#1)", shown.serves["big"]
    # the wait to expect: from measured bring-ups ahead, else said unmeasured
    assert re.fullmatch(r"unmeasured|\d+ (s|min)|\d+\.\d h", shown.serves["big"]["wait"])
    assert shown.serves["chat"]["queue"] == "—" and shown.serves["chat"]["wait"] == "—"

    # the device: the ledger's figures, and the observed draw with the non-ledger part
    obs = ledger["observed"]
    assert shown.figures[("r", "ledger")] == (
        f"capacity {ledger['capacity_mib']} MiB · reserve 4000 · committed "
        f"{ledger['committed_mib']} · ledger free {ledger['free_mib']}"), shown.figures
    assert ledger["committed_mib"] == 9000  # chat's; big waits for room
    observed = shown.figures[("r", "observed")]
    assert f"non-ledger draw {obs['non_ledger_draw_mib']}" in observed, observed
    assert obs["non_ledger_draw_mib"] >= 3500  # the simulated display
    assert f"used {obs['used_mib']} of {obs['total_mib']} MiB" in observed, observed
    assert shown.bars[("r", "reserved")] == ["reserve 4000", "chat 9000"]
    assert f"non-ledger {obs['non_ledger_draw_mib']}" in shown.bars[("r", "used")]

    # usage per key: the two requests of key ci to chat, with their tokens
    row = usage[("ci", "chat")]
    assert row["requests"] == 2
    assert shown.usage[("ci", "chat")] == {
        "key": "ci", "model": "chat", "requests": "2",
        "prompt_tokens": str(row["prompt_tokens"]),
        "completion_tokens": str(row["completion_tokens"]), "unmetered": "0",
        "statuses": "200: 2"}, shown.usage

    # the last events, newest first, as stored: chat's admit, start and healthy among them
    stored = gpud.events()
    assert [int(e["id"]) for e in shown.events] == sorted(
        (int(e["id"]) for e in shown.events), reverse=True)
    by_id = {e["id"]: e for e in stored}
    for e in shown.events:
        was = by_id[int(e["id"])]
        assert (e["kind"], e["serve"], e["message"]) == (was["kind"], was["serve"] or "",
                                                         was["message"]), (e, was)
    assert {("admit", "chat"), ("start", "chat"), ("healthy", "chat"), ("deny", "big")} <= {
        (e["kind"], e["serve"]) for e in shown.events}, shown.events
    assert (tmp_path / "status-page.png").stat().st_size > 10_000


def test_the_page_is_served_on_the_socket_only(paged: SandboxGpud) -> None:
    """/ui answers on gpud's socket to a reader, with a policy that lets its one script run;
    the router does not carry it."""
    gpud = paged
    reply = gpud.call("GET", "/ui")
    assert reply.status == 200 and reply.raw.startswith(b"<!doctype html>")
    csp = reply.headers["Content-Security-Policy"]
    assert "script-src 'sha256-" in csp and "connect-src 'self'" in csp, csp
    out = gpud.sb.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                       f"http://127.0.0.1:{ROUTER}/ui"], user=USER).stdout
    assert out == "404", out
    # a reader may load it; one who cannot open the socket cannot
    viewer = gpud.sb.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                          "--unix-socket", "/run/gpud/gpud.sock", "http://localhost/ui"],
                         user=VIEWER, check=False).stdout
    assert viewer == "200", viewer
    nobody = gpud.sb.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                          "--unix-socket", "/run/gpud/gpud.sock", "http://localhost/ui"],
                         user=USER, check=False)
    assert nobody.returncode == 7 and nobody.stdout == "000", nobody
