"""The one endpoint is safe to share (issue 41), under real systemd (the sandbox): two local
users, nobody to gpud, each with a key of the router. The greedy one, in a seeded order, parks
requests on a serve slow to come up (more than gpud lets one requester wait), sends large
bodies of small parts, holds keyless stalled bodies, forges gpud's X-Gpud-* headers with a
nested and an escaped `model` naming a model their key may not use, and sends malformed HTTP;
meanwhile the polite one reads /v1/models, wakes their sleeping serve, completes and streams.

Asserts: the polite user is served within bounds (every call 200, the wake within 20 s, every
other call within 5 s, /v1/models shows gpud's states, never "unknown"), nothing is cut
silently (every stream ends with [DONE], no error event), and every refusal of the greedy user
is typed (OpenAI-shaped JSON with its code: 429 past the waiting bound, 413 too complex, 401
before the body, 404 for the model their key may not use, 400/414 for malformed HTTP); the
ledger invariant holds.

Seeded (GPUD_CAMPAIGN_SEED, printed at the end of every run). Short form in the default run
(20 s); longer with GPUD_CAMPAIGN_SAFETY_S (e.g. 120).
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.campaigns.conftest import invariant_events, knob, rng, seed_note
from tests.integration.gpudctl import PY, SandboxGpud, fronted_gpud, sim_config, standin_uds

pytestmark = pytest.mark.sandbox

CLIENT = str(Path(__file__).resolve().parent / "safety_client.py")
GREEDY, POLITE = "gpud-safety-greedy", "gpud-safety-polite"
TOKENS = {GREEDY: "sk-greedy-campaign-0123456789", POLITE: "sk-polite-campaign-0123456789"}
KEYS = "/etc/gpud-safety-keys.toml"
ROUTER, PORT = 30470, 30471
PER_REQUESTER = 16


def config(seconds: int) -> str:
    dev = 'environment = { VLLM_SERVER_DEV_MODE = "1" }\n'
    serves = (
        f'[serves.chat]\nrole = "r"\nvram_mib = 8000\nport = {PORT}\nsleep_level = 1\n'
        f'sleep_mib = 800\nmodels = ["chat"]\n{dev}'
        f"command = {standin_uds('--enable-sleep-mode', '--token-interval-s', '0.05', '--served-model-name', 'chat')}\n"
        # the greedy user's: comes up once the campaign is over
        f'[serves.b]\nrole = "r1"\nvram_mib = 8000\nport = {PORT + 1}\non_demand = true\n'
        f'start_timeout_s = {seconds + 90}\nmodels = ["b"]\n'
        f"command = {standin_uds('--startup-delay', str(seconds + 5), '--served-model-name', 'b')}\n")
    roles = ('[roles.r]\ndevice = "GPU-sim-0"\nreserve_mib = 1000\n'
             '[roles.r1]\ndevice = "GPU-sim-1"\nreserve_mib = 1000\n')
    router = (f'[router]\nlisten = "127.0.0.1:{ROUTER}"\napi_keys_file = "{KEYS}"\n'
              "loading_feedback_s = 0\n")
    return sim_config(roles, serves, devices=2,
                      daemon=f"ensure_waiting_per_requester = {PER_REQUESTER}") + router


def campaign_seconds() -> int:
    return knob("SAFETY_S", 20)


@pytest.fixture
def shared(campaign_sandbox: Any) -> Iterator[SandboxGpud]:
    gpud = SandboxGpud(campaign_sandbox)
    keys = (f'[keys.greedy]\ntoken = "{TOKENS[GREEDY]}"\nmodels = ["b"]\n'
            f'[keys.polite]\ntoken = "{TOKENS[POLITE]}"\nmodels = ["chat"]\n')
    gpud.sb.run(["bash", "-c", f"umask 077; cat > {KEYS}"], input=keys)
    try:
        with fronted_gpud(gpud, config(campaign_seconds()), [GREEDY, POLITE]):
            yield gpud
    finally:
        gpud.sb.run(["rm", "-f", KEYS], check=False)


def run(gpud: SandboxGpud, user: str, *args: object, timeout: float) -> dict[str, Any]:
    out = gpud.sb.run([PY, CLIENT, *map(str, args)], user=user, timeout=timeout)
    return dict(json.loads(out.stdout))


def test_a_greedy_user_takes_nothing_from_another(shared: SandboxGpud) -> None:
    gpud = shared
    seconds = campaign_seconds()
    seed = rng("safety").randrange(1, 2**31)
    assert gpud.call("POST", "/v1/serves/chat/start", {}).status == 200
    gpud.wait_state("chat", "running")
    assert gpud.call("POST", "/v1/serves/chat/sleep", {}).status == 200
    gpud.wait_state("chat", "sleeping")

    greedy: dict[str, Any] = {}

    def hostile() -> None:
        greedy.update(run(gpud, GREEDY, "greedy", seed, ROUTER, TOKENS[GREEDY], seconds,
                          timeout=seconds + 120))
    thread = threading.Thread(target=hostile, daemon=True)
    thread.start()
    polite = run(gpud, POLITE, "polite", ROUTER, TOKENS[POLITE], seconds, timeout=seconds + 120)
    thread.join(seconds + 130)
    note = seed_note()

    # the polite user: served, within bounds, gpud's states, nothing cut silently
    calls = polite["calls"]
    assert calls and all(c["status"] == 200 for c in calls), (note, calls)
    first = next(c for c in calls if c["kind"] != "models")
    assert first["took_s"] < 20, (note, first)
    slow = [c for c in calls if c is not first and c["took_s"] >= 5]
    assert not slow, (note, slow)
    states = [c["states"] for c in calls if c["kind"] == "models"]
    assert states and all(s.get("chat") in ("sleeping", "running") for s in states), (note, states)
    streams = [c for c in calls if c["kind"] == "stream"]
    assert streams and all(c["done"] and not c["errors"] for c in streams), (note, streams)

    # the greedy user: every refusal typed
    results = greedy["results"]
    assert len(results) == greedy["planned"], (note, len(results), greedy["planned"])
    by = Counter((r["kind"], r["status"], r["code"]) for r in results)
    parked = greedy["parked"]
    assert by[("park", 429, "rate_limit_exceeded")] == parked - PER_REQUESTER, (note, by)
    assert by[("park", 200, None)] == PER_REQUESTER, (note, by)
    expected = {"large": {(413, "too_complex")}, "stalled": {(401, "invalid_api_key")},
                "forged": {(404, "model_not_found")},
                "malformed": {(400, "invalid_request"), (414, "invalid_request")}}
    for result in results:
        if result["kind"] == "park":
            continue
        assert (result["status"], result["code"]) in expected[result["kind"]], (note, result)
        assert result["type"] == "application/json", (note, result)
    stalled = [r["took_s"] for r in results if r["kind"] == "stalled"]
    assert max(stalled) < 2, (note, stalled)
    refused = [r for r in results if r["kind"] == "park" and r["status"] == 429]
    assert all(r["retry_after"] == "5" for r in refused), (note, refused[:3])
    assert invariant_events(gpud.events()) == [], note
    print(f"safety campaign {note}: polite {len(calls)} calls, the slowest "
          f"{max(c['took_s'] for c in calls):.2f} s; greedy {sorted(by.items())}")
