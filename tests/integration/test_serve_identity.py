"""As whom a serve runs, under real systemd in the sandbox: the unprivileged default identity
with its model cache and its hardened unit, root only where the config says so. Stand-in
serves, simulated GPU."""

from __future__ import annotations

import json

from tests.integration.gpudctl import SandboxGpud, sim_config, standin

ROLE = '[roles.r]\ndevice = "GPU-sim-0"\nreserve_mib = 1000\n'
CACHE = "/var/cache/gpud-serve"
SEED = f"{CACHE}/huggingface/seed"
# The stand-in behind a shell that reads a file of the model cache, writes one, and fails
# (the serve never starts) if it can write outside its cache.
PROBE = ('cat "$HF_HOME/seed" > "$HF_HOME/copy" && if touch /etc/gpud/probe 2>/dev/null; '
         'then exit 9; fi; exec "$0" "$@"')
# `systemd-analyze security` of the default identity's unit: measured 3.4 in the sandbox (where
# its drop-in makes ProtectHome= read-only for an interpreter under /root; a checkout under
# /var/tmp turns PrivateTmp= off there, some 0.2 more). Root's unhardened unit: 9.3 there
# (9.6 without that drop-in).
HARDENED_AT_MOST = 4.0


def serves() -> str:
    probed = json.dumps(["/bin/sh", "-c", PROBE, *json.loads(standin())])
    return (f'[serves.plain]\nrole = "r"\nvram_mib = 1000\nport = 30101\nresident = true\n'
            f"priority = 1\ncommand = {probed}\n"
            f'[serves.rooted]\nrole = "r"\nvram_mib = 1000\nport = 30102\nresident = true\n'
            f'priority = 2\nuser = "root"\ncommand = {standin()}\n')


def uid_of(gpud: SandboxGpud, unit: str) -> int:
    pid = gpud.unit_prop(unit, "MainPID")
    status = gpud.sb.run(["cat", f"/proc/{pid}/status"]).stdout
    line = next(line for line in status.splitlines() if line.startswith("Uid:"))
    return int(line.split()[1])  # the real uid (then effective, saved, file system)


def security(gpud: SandboxGpud, unit: str) -> float:
    report = gpud.sb.run(["systemd-analyze", "security", "--no-pager", unit],
                         check=False).stdout.splitlines()[-1]
    return float(report.split(f"{unit}:")[1].split()[0])


def test_a_serve_runs_unprivileged_with_its_cache_and_root_only_when_configured(
        gpud: SandboxGpud) -> None:
    sb = gpud.sb
    gpud.configure(sim_config(ROLE, serves()), start=False)
    # a model file an operator placed in the cache beforehand, readable by the serves' user only
    sb.run(["sh", "-c", f"mkdir -p {CACHE}/huggingface && echo weights > {SEED} && "
            f"chown -R gpud-serve:gpud-serve {CACHE} && chmod 0700 {CACHE} && chmod 0600 {SEED}"])
    gpud.start()
    gpud.wait_state("plain", "running")
    gpud.wait_state("rooted", "running")
    serve_uid = int(sb.run(["id", "-u", "gpud-serve"]).stdout)
    assert serve_uid != 0
    assert uid_of(gpud, "gpud-serve-plain.service") == serve_uid
    assert uid_of(gpud, "gpud-serve-rooted.service") == 0
    assert gpud.unit_prop("gpud-serve-plain.service", "User") == "gpud-serve"
    # it read the cache and wrote into it (nowhere else: the probe's touch failed)
    assert sb.run(["stat", "-c", "%U", f"{CACHE}/huggingface/copy"]).stdout.strip() == "gpud-serve"
    assert sb.run(["cat", f"{CACHE}/huggingface/copy"]).stdout == "weights\n"
    assert not sb.host_path("/etc/gpud/probe").exists()
    # vLLM's and Hugging Face's caches point into it
    pid = gpud.unit_prop("gpud-serve-plain.service", "MainPID")
    env = dict(item.split("=", 1) for item in
               sb.run(["cat", f"/proc/{pid}/environ"]).stdout.split("\0") if "=" in item)
    assert env["HF_HOME"] == f"{CACHE}/huggingface" and env["HOME"] == CACHE
    assert env["VLLM_CACHE_ROOT"] == f"{CACHE}/vllm"
    # the simulated GPU saw its draw: it registered in the shared folder as gpud-serve
    registered = sb.run(["sh", "-c", "stat -c %U /run/gpud/sim-procs/*.json"]).stdout.split()
    assert "gpud-serve" in registered and "root" in registered, registered
    plain, rooted = (security(gpud, f"gpud-serve-{n}.service") for n in ("plain", "rooted"))
    print(f"systemd-analyze security: root {rooted}, gpud-serve {plain}")
    assert rooted > 9.0  # root's unit is as every serve's was
    assert plain <= HARDENED_AT_MOST, plain


def test_a_user_the_host_lacks_fails_the_start_naming_the_key(gpud: SandboxGpud) -> None:
    gpud.configure(sim_config(ROLE, f'[serves.ghost]\nrole = "r"\nvram_mib = 1000\nport = 30103\n'
                                    f'user = "gpud-no-such-user"\ncommand = {standin()}\n'))
    reply = gpud.call("POST", "/v1/serves/ghost/start", {})
    assert reply.status == 409, reply.raw
    assert "serves.ghost.user: no user 'gpud-no-such-user' on this host" in \
        reply.body["error"]["message"]
    assert gpud.serve_units() == []  # systemd was never asked
    ghost = gpud.serve("ghost")
    assert ghost["state"] == "failed" and "serves.ghost.user" in ghost["reason"], ghost
