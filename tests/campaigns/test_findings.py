"""Bugs the campaigns found, each pinned by the smallest reproduction against a real gpud.

An open one is ``xfail(strict=True)``: the suite stays green until gpud is fixed, and then the
strict xfail turns red so the marker is removed and the test guards the fix. (Those found under
systemd live in test_sandbox.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import start_gpud


def strict_sim_config(tmp: Path, external_mib: int) -> str:
    sim = tmp / "sim.json"
    sim.write_text(json.dumps({"external": [
        {"device": "GPU-sim-0", "label": "display", "mib": external_mib}]}))
    return f"""
[daemon]
admission = "strict"
observe_interval_s = 0.1

[roles.dark-fast]
device = "GPU-sim-0"
reserve_mib = 4608

[serves.a]
role = "dark-fast"
vram_mib = 8000
command = ["/bin/true"]

[serves.b]
role = "dark-fast"
vram_mib = 16000
command = ["/bin/true"]

[simulation]
state_file = "{sim}"
[[simulation.devices]]
uuid = "GPU-sim-0"
total_mib = 32607
"""


def test_denied_readmission_keeps_state(tmp_path: Path) -> None:
    """Found by the crash campaign (fixed in a0ac50a): a denied re-admission of a serve holding
    a reservation stored it `denied`; its not-yet-drawing reservation dropped out of `pending`
    and the physical bound over-admitted the next serve."""
    # physical free 32607 - 10000 (display) = 22607
    gp = start_gpud(tmp_path, strict_sim_config(tmp_path, 10_000))
    try:
        ok = gp.call("POST", "/v1/serves/a/admit", {"mib": 8000})
        assert ok.status == 200 and ok.body["check"] == "strict", ok.body
        role = gp.call("GET", "/v1/ledger").body["roles"][0]
        assert role["observed"]["pending_mib"] == 8000
        # a's growth does not fit: denied, and a keeps its 8000 MiB reservation
        grow = gp.call("POST", "/v1/serves/a/admit", {"mib": 30_000})
        assert grow.status == 409
        a = gp.call("GET", "/v1/serves/a").body
        assert a["reserved_mib"] == 8000
        role = gp.call("GET", "/v1/ledger").body["roles"][0]
        # b needs 16000: physically 22607 free, less a's 8000 promised but not drawn = 14607
        b = gp.call("POST", "/v1/serves/b/admit", {"mib": 16_000})
        problems = []
        if a["state"] != "admitted":
            problems.append(f"a holds 8000 MiB but is {a['state']!r} ({a['reason']})")
        if role["observed"]["pending_mib"] != 8000:
            problems.append(f"pending {role['observed']['pending_mib']} MiB, not a's 8000")
        if b.status != 409:
            problems.append(f"b 16000 MiB admitted ({b.body['check']}): a's 8000 + b's 16000 "
                            f"exceed the 22607 MiB physically free")
        assert not problems, "\n".join(problems)
    finally:
        gp.stop()
