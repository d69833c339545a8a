"""Three gpud hosts (tests/integration/hosts.py), each its own systemd in its own network
namespace with its own address: host a names b and c as its peers (docs/peers.md). a lists both
reachable with their models; b's gpud and router stopped, a shows b's circuit open with its
reason within a poll while c's stays closed; b started again, its circuit closes. Simulated GPUs,
stand-in serves, no request forwarded."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.integration.gpudctl import sim_config, standin_uds
from tests.integration.hosts import Host, Setup, hosts, peer_table
from tests.waiting import wait_until

PORT = 30600
ROUTER_PORT = 8000
KEYS = "/etc/gpud/keys.toml"
ROLE = '[roles.r]\ndevice = "GPU-sim-0"\nreserve_mib = 1000\n'
# The poller asks every 5 s (gpud.host.peers DEFAULT_INTERVAL_S), a dead peer within its 3 s
# bound: a circuit opens or closes within one round, well inside this.
WITHIN_S = 30


def serve(model: str) -> str:
    return (f'[serves.{model}]\nrole = "r"\nvram_mib = 4000\nport = {PORT}\non_demand = true\n'
            f'models = ["{model}"]\n'
            f"command = {standin_uds('--served-model-name', model)}\n")


def token(host: str) -> str:
    return f"sk-a-presents-this-to-{host}-0123"


def configs(hs: list[Host]) -> list[Setup]:
    a, b, c = hs
    out = [Setup(sim_config(ROLE, serve("a-chat"))
                 + "".join(peer_table(h.name, f"http://{h.addr_from(a)}:{ROUTER_PORT}",
                                      f"/etc/gpud/peer-{h.name}.key") for h in (b, c)),
                 {f"/etc/gpud/peer-{h.name}.key": token(h.name) + "\n" for h in (b, c)})]
    for h in (b, c):
        keys = (f'[keys.front-a]\ntoken = "{token(h.name)}"\nmodels = ["*"]\npeer = true\n')
        router = (f'[router]\nlisten = "{h.addr_from(a)}:{ROUTER_PORT}"\n'
                  f'api_keys_file = "{KEYS}"\n')
        out.append(Setup(sim_config(ROLE, serve(f"{h.name}-chat")) + router, {KEYS: keys}))
    return out


def peers_of(host: Host) -> dict[str, dict[str, Any]]:
    return {p["name"]: p for p in host.gpuctl_json("peers")["peers"]}


def until(host: Host, predicate: Callable[[dict[str, dict[str, Any]]], bool],
          what: str) -> dict[str, dict[str, Any]]:
    """HOST's peers once PREDICATE holds of them (their last view and the journal in the error:
    a circuit open is half-open for the moment of each probe, so the view that held is
    returned, never asked again)."""
    def held() -> dict[str, dict[str, Any]] | None:
        got = peers_of(host)
        return got if predicate(got) else None

    try:
        return dict(wait_until(held, timeout=WITHIN_S, what=what))
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {peers_of(host)}\n{host.gpud.journal_tail()}") from None


def test_a_front_door_sees_its_two_peers_and_a_peer_that_goes_and_comes_back() -> None:
    with hosts(3, configs) as (a, b, _c):
        got = until(a, lambda got: all(got[n]["reachable"] and got[n]["circuit"] == "closed"
                                       for n in "bc"), "b and c reachable from a")
        assert [m["id"] for m in got["b"]["models"]] == ["b-chat"], got["b"]
        assert [m["id"] for m in got["c"]["models"]] == ["c-chat"], got["c"]
        assert got["b"]["url"] == f"http://{b.addr_from(a)}:{ROUTER_PORT}"
        assert got["b"]["last_error"] is None and got["b"]["rtt_s"] is not None, got["b"]

        def said(what: str) -> int:
            return a.gpud.journal_tail(400).count(f"peer b: circuit {what}")

        opened, closed = said("opened"), said("closed")
        # b goes away: its gpud and its router
        b.stop_gpud_and_router()
        got = until(a, lambda got: got["b"]["circuit"] == "open", "b's circuit open on a")
        assert got["b"]["reachable"] is False and got["b"]["circuit_reason"], got["b"]
        assert "connect" in got["b"]["circuit_reason"], got["b"]
        assert (got["c"]["circuit"], got["c"]["reachable"]) == ("closed", True), got["c"]
        # a's journal says so, once
        wait_until(lambda: said("opened") == opened + 1, timeout=10,
                   what="a's journal line of b's circuit opening")

        # b back: its circuit closes
        b.gpud.start()
        b.gpud.wait_front()
        got = until(a, lambda got: got["b"]["circuit"] == "closed",
                    "b's circuit closed again on a")
        assert got["b"]["reachable"] is True and [m["id"] for m in got["b"]["models"]] == [
            "b-chat"], got["b"]
        assert got["c"]["circuit"] == "closed", got["c"]
        assert (said("opened"), said("closed")) == (opened + 1, closed + 1)
