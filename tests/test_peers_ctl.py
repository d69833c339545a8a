"""`gpuctl peers`: its text from GET /v1/peers's answer (a canned one, held to the document)."""

from __future__ import annotations

from datetime import UTC
from typing import Any

from gpud.ctl.commands import COMMANDS
from gpud.ctl.format import format_peers
from gpud.server.openapi import document
from tests.schema import schema_errors

PEERS: dict[str, Any] = {"peers": [
    {"name": "node2", "url": "http://node2.tailnet:8000", "reachable": True,
     "reachable_since": 1_784_000_000.0, "circuit": "closed", "circuit_since": 1_784_000_000.0,
     "circuit_reason": None, "rtt_s": 0.0019, "last_error": None, "checked_at": 1_784_000_100.0,
     "models": [{"id": "ocr", "state": "sleeping", "expected_wait_s": None, "queued": 0},
                {"id": "chat", "state": "stopped", "expected_wait_s": 41.6, "queued": 2}]},
    {"name": "node3", "url": "https://node3.tailnet:8443", "reachable": False,
     "reachable_since": 1_784_000_050.0, "circuit": "open", "circuit_since": 1_784_000_050.0,
     "circuit_reason": "cannot connect: refused", "rtt_s": None,
     "last_error": "cannot connect: refused", "checked_at": 1_784_000_100.0, "models": []},
    {"name": "node4", "url": "http://node4:8000", "reachable": None, "reachable_since": None,
     "circuit": "closed", "circuit_since": 1_784_000_000.0, "circuit_reason": None,
     "rtt_s": None, "last_error": None, "checked_at": None, "models": []},
]}


def test_the_canned_answer_is_what_gpud_answers() -> None:
    assert schema_errors(PEERS, {"$ref": "#/components/schemas/Peers"}, document()) == []


def test_format_peers() -> None:
    assert format_peers(PEERS, UTC).splitlines() == [
        "PEER   URL                         REACHABLE                                    "
        "CIRCUIT  MODELS     RTT",
        "node2  http://node2.tailnet:8000   reachable since 2026-07-14T03:33:20+00:00    "
        "closed        2  1.9 ms",
        "node3  https://node3.tailnet:8443  unreachable since 2026-07-14T03:34:10+00:00  "
        "open          0       -",
        "node4  http://node4:8000           not asked yet                                "
        "closed        0       -",
        "node2 models: ocr (sleeping), chat (stopped, wait 42s, 2 queued)",
        "node3 last error: cannot connect: refused",
        "node3 circuit open since 2026-07-14T03:34:10+00:00: cannot connect: refused",
    ]


def test_no_peers_says_so() -> None:
    assert format_peers({"peers": []}).startswith("no peers: serves.toml has no [peers.NAME]")


def test_peers_is_a_command_of_the_table() -> None:
    assert "peers" in [c.name for c in COMMANDS]
