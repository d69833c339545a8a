"""A container serve on two devices under real systemd and real podman: the container is given
both of its GPUs through CDI (in the order of its roles), vLLM is told to run tensor parallel
over them, and the stand-in inside draws on each, attributed to the serve per device."""

from __future__ import annotations

import time

from tests.integration.gpudctl import SandboxGpud, sim_config
from tests.integration.test_containers import (  # noqa: F401 (fixtures)
    PROCS,
    _configure,
    _image_ref,
    gpud,
    podman_sandbox,
)


def test_a_container_serve_on_two_devices_gets_both_and_draws_on_each(gpud: SandboxGpud) -> None:  # noqa: F811
    roles = ('[roles.g1]\ndevice = "GPU-sim-1"\nreserve_mib = 1000\n'
             '[roles.g0]\ndevice = "GPU-sim-0"\nreserve_mib = 1000\n')
    serve = ('[serves.wide]\nroles = ["g1", "g0"]\nvram_mib = 8000\nport = 30060\n'
             'stop_timeout_s = 20\n[serves.wide.vllm]\nmodel = "org/wide"\n'
             f'max_model_len = 4096\n[serves.wide.container]\nimage = "{_image_ref(gpud.sb)}"\n'
             f'volumes = ["{PROCS}:{PROCS}:rw"]\n')
    _configure(gpud, sim_config(roles, serve, devices=2))
    assert gpud.call("POST", "/v1/serves/wide/start", {}).status == 200
    gpud.wait_state("wide", "running", timeout=60)
    argv = gpud.unit_prop("gpud-serve-wide.service", "ExecStart")
    assert "--device=nvidia.com/gpu=GPU-sim-1" in argv and "--device=nvidia.com/gpu=GPU-sim-0" \
        in argv
    assert argv.index("GPU-sim-1") < argv.index("GPU-sim-0")  # the order of its roles
    assert "--tensor-parallel-size 2" in argv
    seen = gpud.sb.run(["podman", "exec", "gpud-serve-wide", "python3", "-c",
                        "import os; print(sorted(os.listdir('/dev/gpud-sim')))"]).stdout
    assert seen.strip() == "['GPU-sim-0', 'GPU-sim-1']"
    # util = floor(8000 / 32607, 4) = 0.2453 -> 7998 MiB on EACH device, attributed per device.
    for _ in range(100):
        roles_now = {r["name"]: (r["observed"] or {}) for r in gpud.get("/v1/ledger")["roles"]}
        if all(o.get("managed_draw_mib", 0) >= 7000 for o in roles_now.values()):
            break
        time.sleep(0.2)
    assert {n: o.get("managed_draw_mib") for n, o in roles_now.items()} == {"g0": 7998,
                                                                           "g1": 7998}
    assert all(o["non_ledger_draw_mib"] == 0 for o in roles_now.values())
