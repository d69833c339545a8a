"""Logs where an operator looks, under real systemd and journald: a serve whose load raises a
Python exception fails with that exception and where it was raised in its reason, and
`gpuctl logs NAME` shows its whole traceback from its unit's journal, to root, and refuses a
user who may not read the system journal with a plain error. Simulated GPU, a stand-in serve."""

from __future__ import annotations

import time

from tests.integration.gpudctl import PY, REPO, SandboxGpud, sim_config, standin

USER = "gpud-logs-reader"  # a local user in no group of gpud's or journald's


def gpuctl_logs(gpud: SandboxGpud, *argv: str, user: str | None = None) -> tuple[int, str, str]:
    out = gpud.sb.run(["/usr/bin/env", f"PYTHONPATH={REPO}", PY, "-m", "gpud.ctl", "logs",
                       *argv], check=False, timeout=60, user=user)
    return out.returncode, out.stdout, out.stderr


def test_a_failed_serve_names_its_exception_and_gpuctl_logs_shows_the_traceback(
        gpud: SandboxGpud) -> None:
    serves = ('[serves.broken]\nrole = "r"\nvram_mib = 1000\nport = 30301\nrestart = "no"\n'
              f"command = {standin('--raise-at-start', 'no weights at /srv/models/broken')}\n")
    gpud.configure(sim_config('[roles.r]\ndevice = "GPU-sim-0"\nreserve_mib = 0\n', serves))
    try:
        gpud.sb.run(["useradd", "--no-create-home", USER], check=False)
        gpud.call("POST", "/v1/serves/broken/start", {})  # launched; it fails on its own
        failed = gpud.wait_state("broken", "failed")
        standin_py = f"{REPO}/gpud/testing/standin.py"
        reason = failed["reason"]
        assert "its log: RuntimeError: no weights at /srv/models/broken (at " in reason, reason
        assert f"(at {standin_py}:" in reason and reason.endswith(" in _load_model)"), reason

        code, out, err = gpuctl_logs(gpud, "broken")
        assert code == 0, err
        lines = out.splitlines()
        at = next(i for i, line in enumerate(lines) if "Traceback (most recent call last):" in line)
        assert any("in _load_model" in line for line in lines[at:])
        assert "RuntimeError: no weights at /srv/models/broken" in lines[-1] or any(
            "RuntimeError: no weights at /srv/models/broken" in line for line in lines[at:])
        # --since an hour from now: none of it; --lines 1: the last line alone
        code, out, _ = gpuctl_logs(gpud, "broken", "--since", str(int(time.time()) + 3600))
        assert code == 0 and "Traceback" not in out, out
        code, out, _ = gpuctl_logs(gpud, "broken", "--lines", "1", "--json")
        assert code == 0 and len(out.splitlines()) == 1 and '"_SYSTEMD_UNIT"' in out, out

        # a user who may not read the system journal: told so, not shown someone else's rights
        code, out, err = gpuctl_logs(gpud, "broken", user=USER)
        assert (code, out) == (1, ""), (code, out, err)
        assert "may not read the system journal, where gpud-serve-broken.service logs" in err
    finally:
        gpud.sb.run(["userdel", USER], check=False)
