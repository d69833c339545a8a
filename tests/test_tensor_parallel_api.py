"""A serve on several devices against a real gpud (simulated 2- and 4-device hosts, no system
bus): admission all or none, release and re-admission as one, plan/apply moving a serve from
one role to two and back, events and metrics per device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, GpudProcess, start_gpud
from tests.test_invariant_api import apply


def host(tmp: Path, n: int, *, admission: str = "strict", serves: str = "") -> str:
    state = tmp / "sim.json"
    if not state.exists():
        state.write_text("{}")
    roles = "".join(f'[roles.g{i}]\ndevice = "GPU-sim-{i}"\nreserve_mib = 1000\n'
                    for i in range(n))
    devices = "".join(f'[[simulation.devices]]\nuuid = "GPU-sim-{i}"\ntotal_mib = 40960\n'
                      for i in range(n))
    return (f'[daemon]\nadmission = "{admission}"\n{roles}{serves}'
            f'[simulation]\nstate_file = "{state}"\n{devices}')


BIG = '[serves.big]\nroles = ["g0", "g1"]\nvram_mib = 20000\ncommand = ["/bin/true"]\n'
SMALL = '[serves.small]\nrole = "g1"\nvram_mib = 15000\ncommand = ["/bin/true"]\n'


@pytest.fixture
def two(tmp_path: Path) -> GpudProcess:
    gp = start_gpud(tmp_path, host(tmp_path, 2, serves=BIG + SMALL))
    yield gp
    gp.stop()


def committed(gp: GpudProcess) -> dict[str, int]:
    return {r["name"]: r["committed_mib"] for r in gp.call("GET", "/v1/ledger").body["roles"]}


def listed(gp: GpudProcess) -> dict[str, list[tuple[str, int, str | None]]]:
    return {r["name"]: [(x["serve"], x["mib"], x.get("part")) for x in r["reservations"]]
            for r in gp.call("GET", "/v1/ledger").body["roles"]}


def test_admission_reserves_on_every_role_and_the_ledger_lists_each_part(two: GpudProcess) -> None:
    reply = two.call("POST", "/v1/serves/big/admit", {"mib": 20000})
    assert reply.status == 200, reply.body
    assert reply.body["roles"] == ["g0", "g1"]
    assert reply.body["figures_by_role"]["g1"]["free_mib"] == 40960 - 1000 - 20000
    assert listed(two) == {"g0": [("big", 20000, "1/2")], "g1": [("big", 20000, "2/2")]}
    serve = two.call("GET", "/v1/serves/big").body
    assert serve["roles"] == ["g0", "g1"] and serve["reserved_mib"] == 20000
    # what it draws on each device, beside the reservation held on each (nothing yet)
    assert serve["observed_by_role"] == {"g0": 0, "g1": 0}


def test_one_role_lacking_room_denies_it_all_and_nothing_is_reserved_anywhere(
        two: GpudProcess) -> None:
    assert two.call("POST", "/v1/serves/small/admit", {"mib": 15000}).status == 200
    reply = two.call("POST", "/v1/serves/big/admit", {"mib": 30000})
    assert reply.status == 409
    err = reply.body["error"]
    assert (err["details"]["role"], err["details"]["shortfall_mib"]) == ("g1", 5040)
    assert "lacking" not in err["details"]  # only one role lacks room
    # Only g1 lacks room (39960 - 15000 = 24960 < 30000): named with need, free, shortfall.
    assert err["message"] == ("big denied on g1: ledger bound: need 30000 MiB, free 24960 MiB, "
                              "short 5040 MiB")
    assert committed(two) == {"g0": 0, "g1": 15000}
    events = two.call("GET", "/v1/events?serve=big").body["events"]
    assert events[-1]["kind"] == "deny" and events[-1]["details"]["roles"] == ["g0", "g1"]
    # Found by either role.
    by_g0 = two.call("GET", "/v1/events?role=g0").body["events"]
    assert [e["kind"] for e in by_g0 if e["serve"] == "big"] == ["deny"]


def test_a_denial_names_each_role_that_lacks_room(two: GpudProcess) -> None:
    assert two.call("POST", "/v1/serves/small/admit", {"mib": 15000}).status == 200
    assert two.call("POST", "/v1/serves/other/admit", {"mib": 25000, "role": "g0"}).status == 200
    reply = two.call("POST", "/v1/serves/big/admit", {"mib": 30000})
    assert reply.status == 409
    err = reply.body["error"]
    assert err["message"] == (
        "big denied (nothing reserved; lacking room on g0, g1): on g0: ledger bound: need 30000 "
        "MiB, free 14960 MiB, short 15040 MiB; on g1: ledger bound: need 30000 MiB, free 24960 "
        "MiB, short 5040 MiB")
    assert [(x["role"], x["shortfall_mib"]) for x in err["details"]["lacking"]] == [
        ("g0", 15040), ("g1", 5040)]
    assert committed(two) == {"g0": 25000, "g1": 15000}


def test_strict_admission_checks_the_physical_bound_of_every_device(tmp_path: Path) -> None:
    # 25000 MiB nobody declared on GPU-sim-1 (read at gpud's first observation): physically
    # 15960 MiB free there, while the ledger has 39960 free on both.
    (tmp_path / "sim.json").write_text(json.dumps(
        {"external": [{"device": "GPU-sim-1", "label": "other", "mib": 25000}]}))
    gp = start_gpud(tmp_path, host(tmp_path, 2, serves=BIG))
    try:
        reply = gp.call("POST", "/v1/serves/big/admit", {"mib": 20000})
        assert reply.status == 409, reply.body
        details = reply.body["error"]["details"]
        assert (details["role"], details["bound"], details["free_mib"], details["check"]) == \
            ("g1", "physical", 15960, "strict")
        assert committed(gp) == {"g0": 0, "g1": 0}
        assert gp.call("POST", "/v1/serves/big/admit", {"mib": 15000}).status == 200
    finally:
        gp.stop()


def test_release_frees_every_role_at_once(two: GpudProcess) -> None:
    assert two.call("POST", "/v1/serves/big/admit", {"mib": 20000}).status == 200
    reply = two.call("POST", "/v1/serves/big/release", {})
    assert reply.status == 200 and reply.body["roles"] == ["g0", "g1"]
    assert committed(two) == {"g0": 0, "g1": 0}
    release = two.call("GET", "/v1/events?serve=big&kind=release").body["events"][-1]
    assert release["message"].startswith("big released 20000 MiB on each of g0, g1 (released); ")


def test_a_restart_reads_both_rows_back(tmp_path: Path) -> None:
    text = host(tmp_path, 2, serves=BIG)
    gp = start_gpud(tmp_path, text)
    try:
        assert gp.call("POST", "/v1/serves/big/admit", {"mib": 20000}).status == 200
    finally:
        gp.stop()
    again = start_gpud(tmp_path, text, state_dir=gp.state_dir)
    try:
        assert listed(again) == {"g0": [("big", 20000, "1/2")], "g1": [("big", 20000, "2/2")]}
    finally:
        again.stop()


def test_plan_and_apply_move_a_serve_from_one_role_to_four_and_back(tmp_path: Path) -> None:
    # Not resident: an apply starts it nowhere. Admitted only, its admission is released as it
    # moves (the plan says so); released first, it is admitted on its new roles after the apply.
    one = '[serves.big]\nrole = "g2"\nvram_mib = 20000\ncommand = ["/bin/true"]\n'
    four = '[serves.big]\nroles = ["g0", "g1", "g2", "g3"]\nvram_mib = 20000\n' \
        'command = ["/bin/true"]\n'
    gp = start_gpud(tmp_path, host(tmp_path, 4, admission="ledger", serves=one))
    try:
        assert gp.call("POST", "/v1/serves/big/admit", {"mib": 20000}).status == 200
        plan = gp.call("POST", "/v1/plan", {"config": host(tmp_path, 4, admission="ledger",
                                                           serves=four)}).body
        big = next(s for s in plan["serves"] if s["name"] == "big")
        assert (big["role_before"], big["role_after"]) == ("g2", "g0+g1+g2+g3")
        assert (big["state_after"], big["mib_after"]) == ("declared", None)
        assert [(r["name"], r["after"]["committed_mib"]) for r in plan["roles"]] == [
            ("g0", 0), ("g1", 0), ("g2", 0), ("g3", 0)]
        assert plan["blocked"] == []
        assert [s["kind"] for s in plan["steps"]] == ["backup", "release", "write", "reload",
                                                      "verify"]
        assert gp.call("POST", "/v1/serves/big/release", {}).status == 200
        lines = apply(gp, host(tmp_path, 4, admission="ledger", serves=four))
        assert lines[-1]["result"] == "applied", lines
        assert gp.call("POST", "/v1/serves/big/admit", {"mib": 20000}).status == 200
        assert committed(gp) == {"g0": 20000, "g1": 20000, "g2": 20000, "g3": 20000}
        assert listed(gp)["g3"] == [("big", 20000, "4/4")]
        # A reload that moves it back while it holds its reservation releases it on all four.
        (gp.config).write_text(host(tmp_path, 4, admission="ledger", serves=one))
        assert gp.call("POST", "/v1/reload", {}).status == 200
        assert committed(gp) == {"g0": 0, "g1": 0, "g2": 0, "g3": 0}
        assert gp.call("POST", "/v1/serves/big/admit", {"mib": 20000}).status == 200
        assert committed(gp) == {"g0": 0, "g1": 0, "g2": 20000, "g3": 0}
        assert listed(gp)["g2"] == [("big", 20000, None)]
    finally:
        gp.stop()


def test_metrics_carry_one_series_per_device(two: GpudProcess) -> None:
    assert two.call("POST", "/v1/serves/big/admit", {"mib": 20000}).status == 200
    text = two.call("GET", "/metrics").raw.decode()
    series = [line for line in text.splitlines()
              if line.startswith("gpud_serve_reservation_mib{") and 'serve="big"' in line]
    assert len(series) == 2
    assert any('role="g0"' in s and 'UUID="GPU-sim-0"' in s for s in series), series
    assert any('role="g1"' in s and 'UUID="GPU-sim-1"' in s for s in series), series


def gpuctl(gp: GpudProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpud.ctl", "--socket", str(gp.socket), *args],
                          capture_output=True, text=True, cwd=REPO, check=False, timeout=60)


def test_gpuctl_admits_lists_and_releases_a_serve_on_two_roles(two: GpudProcess) -> None:
    done = gpuctl(two, "admit", "big", "20000")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ("admitted big: 20000 MiB on each of g0, g1; g0 free 19960 "
                                   "MiB, g1 free 19960 MiB")
    ledger = gpuctl(two, "ledger").stdout.splitlines()
    at0 = ledger.index("gpu_role 'g0': capacity 40960 MiB, reserve 1000 MiB, committed 20000 "
                       "MiB, free 19960 MiB")
    assert ledger[at0 + 1] == "  big 20000 MiB (admitted; 1/2 of g0, g1)"
    at1 = ledger.index("gpu_role 'g1': capacity 40960 MiB, reserve 1000 MiB, committed 20000 "
                       "MiB, free 19960 MiB")
    assert ledger[at1 + 1] == "  big 20000 MiB (admitted; 2/2 of g0, g1)"
    serves = gpuctl(two, "serves").stdout.splitlines()
    big = next(line for line in serves if line.startswith("big "))
    assert big.split()[:3] == ["big", "g0,g1", "admitted"]
    small = next(line for line in serves if line.startswith("small "))
    assert small.split()[:3] == ["small", "g1", "declared"]  # a single-role serve as before
    denied = gpuctl(two, "admit", "small", "25000")
    assert denied.returncode == 1
    released = gpuctl(two, "release", "big")
    assert released.returncode == 0, released.stderr
    assert released.stdout.strip() == ("released big: 20000 MiB on each of g0, g1; g0 free "
                                       "39960 MiB, g1 free 39960 MiB")


def test_gpuctl_names_each_role_of_a_denial(two: GpudProcess) -> None:
    assert gpuctl(two, "admit", "small", "15000").returncode == 0
    assert gpuctl(two, "admit", "other", "25000", "--role", "g0").returncode == 0
    done = gpuctl(two, "admit", "big", "30000")
    assert done.returncode == 1
    assert done.stderr.splitlines()[1:] == [
        "gpuctl: need 30000 MiB, free 14960 MiB, shortfall 15040 MiB (ledger bound on g0)",
        "gpuctl: need 30000 MiB, free 24960 MiB, shortfall 5040 MiB (ledger bound on g1)"]


def test_answers_about_a_serve_on_two_roles_match_the_served_document(two: GpudProcess) -> None:
    from tests.campaigns.test_api_fuzz import Conformance

    doc = two.call("GET", "/v1/openapi.json").body
    check = Conformance(doc)
    problems: list[str] = []
    for method, path, template, body in (
            ("post", "/v1/serves/big/admit", "/v1/serves/{name}/admit", {"mib": 20000}),
            ("get", "/v1/ledger", "/v1/ledger", None),
            ("get", "/v1/serves", "/v1/serves", None),
            ("get", "/v1/serves/big", "/v1/serves/{name}", None),
            ("post", "/v1/serves/small/admit", "/v1/serves/{name}/admit", {"mib": 25000}),
            ("post", "/v1/serves/big/release", "/v1/serves/{name}/release", {})):
        reply = two.call(method.upper(), path, body)
        problems += check.check(method, template, reply.status, "application/json", reply.raw)
        if template == "/v1/ledger":
            # the document says what the extra keys are, and checks them
            assert any(r.get("part") == "2/2" for role in reply.body["roles"]
                       for r in role["reservations"])
    assert problems == []
    schemas = doc["components"]["schemas"]
    # Declared (answers hold exactly the fields described), and optional: single-role answers
    # do not carry them.
    for name, keys in (("Reservation", {"roles", "part"}), ("Serve", {"roles", "observed_by_role"}),
                       ("Admitted", {"roles", "figures_by_role"}),
                       ("Released", {"roles", "figures_by_role"}), ("PlanDenied", {"lacking"})):
        assert schemas[name]["additionalProperties"] is False
        assert keys <= set(schemas[name]["properties"]), name
        assert not keys & set(schemas[name]["required"]), name
