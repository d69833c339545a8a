#!/usr/bin/env python3
"""The whole of gpud in one command, on a machine without a GPU and without systemd as PID 1.

Boots a disposable systemd (tools/sandbox.py: its own namespaces over an overlay of /, never the
host's), installs gpud and its units into it, and replays the seed record (T011): the dark-fast
resident set on a simulated 32607 MiB GPU with 5.7 GiB of draw nobody declared, first as it was
(reserve 7168, fast 18432: ocr denied), then the rebalance planned and applied in two commands,
then the router: a request for `ocr` by name, an embeddings request by its purpose name
(`embeddings`, the pooling serve's, answering bge-m3's 1024 dimensions as the record's host
does), and fast put to sleep and woken by a request for its model by name (fast has a
sleep_level in both configs, so it is fronted).
The serves are stand-ins that speak vLLM's /health and /v1/models; the config is
etc/serves.toml, with `vllm` and the OCR binary pointing at the stand-in. Powers the sandbox off
at the end, whatever happened, unless --keep: then it stays up to look around in, and the last
lines say how to enter it and how to power it off.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.sandbox import DEFAULT_WORKDIR_BASE, STATE_FILE, Sandbox  # noqa: E402

PY = sys.executable
NAME = "gpud-demo"
SIM = """
[simulation]
state_file = "/run/gpud/sim.json"
[[simulation.devices]]
uuid = "GPU-sim-3f6c"
total_mib = 32607
"""
# What the record's host drew outside the ledger: the desktop display and the voice sidecars.
EXTERNAL = {"external": [{"device": "GPU-sim-3f6c", "label": "display", "mib": 1450},
                         {"device": "GPU-sim-3f6c", "label": "voice STT/TTS sidecars",
                          "mib": 4387}]}
# PYTHONPATH: the serve units run from /, where `import gpud` would find whichever checkout the
# interpreter has installed, not this one.
# The stand-in's own options after "$@": a vllm argv starts with `serve MODEL`. A pooling serve
# (--runner pooling: embeddings, reranker) answers vectors of bge-m3's width, 1024.
STANDIN = (f'#!/bin/sh\nPYTHONPATH={REPO} exec {PY} -m gpud.testing.standin "$@" '
           '--startup-delay 1 --embedding-width 1024\n')
# The embeddings serve answers to its purpose, as the record's host routes /v1/embeddings
# (T011: "routed /v1/embeddings -> 1024-dim vector"), and to its model's name.
EMBEDDINGS = "priority = 20\nport = 30003\n"
PURPOSE = 'models = ["embeddings", "BAAI/bge-m3"]\n'


# The router (etc/serves.toml's [router], docs/router.md): one address for every serve, in the
# front's nginx with its njs module, copied into the sandbox (its overlay of /) from where
# scripts/setup unpacked them, to the paths Debian's packages install them at.
NGINX = "/usr/local/sbin/nginx"
NJS = "/usr/lib/nginx/modules/ngx_http_js_module.so"
SLEEP = "sleep_level = 1\nsleep_mib = 1024\n"
FAST = "leon-se/gemma-4-E4B-it-FP8-Dynamic"
# fast's line of `gpuctl models`, under the header
MODEL_LINE = f"gpuctl models | grep -E '^(MODEL|{FAST}) '"


def configs() -> tuple[str, str]:
    """(before, after): etc/serves.toml made to run on the simulated GPU with stand-ins."""
    t011 = (REPO / "etc" / "serves.toml").read_text()
    t011 = t011.replace('device = "0"', 'device = "GPU-sim-3f6c"')
    t011 = t011.replace('admin_group = "gpud-admin"',
                        'admin_group = "gpud-admin"\nvllm_executable = "/usr/local/bin/vllm"\n'
                        "health_interval_s = 1.0")
    t011 = t011.replace('"{gpu_memory_utilization}"]',
                        '"{gpu_memory_utilization}", "--served-model-name", "ocr"]')
    t011 = t011.replace('admin_group = "gpud-admin"\n',
                        f'admin_group = "gpud-admin"\nfront_nginx = "{NGINX}"\n', 1)
    # fast can sleep (vLLM's sleep mode, level 1: docs/sleep.md), so it is fronted and the
    # router wakes it for a request by name; the same in both configs: the plan is the seed's.
    t011 = t011.replace("priority = 10\nport = 30001\n",
                        f"priority = 10\nport = 30001\n{SLEEP}", 1)
    t011 = t011.replace(EMBEDDINGS, EMBEDDINGS + PURPOSE, 1)
    t011 += SIM
    t015 = (t011.replace("reserve_mib = 4608", "reserve_mib = 7168")
            .replace("vram_mib = 14336", "vram_mib = 18432")
            .replace('model = "leon-se/gemma-4-E4B-it-FP8-Dynamic"',
                     'model = "google/gemma-4-E4B-it"'))
    return t015, t011


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true",
                        help="leave the sandbox running to look around in (`make demo "
                             "DEMO_ARGS=--keep`); the demo's last lines say how to enter it "
                             "and power it off")
    args = parser.parse_args()
    started = time.monotonic()
    before, after = configs()
    # A kept sandbox lives in the workdir tools/sandbox.py's command line finds by its name, so
    # that its `--name gpud-demo shell` and `poweroff` reach it; one a previous --keep left there
    # is powered off first.
    workdir = None
    if args.keep:
        workdir = DEFAULT_WORKDIR_BASE / NAME
        if (workdir / STATE_FILE).exists():
            Sandbox.attach(workdir).poweroff()
    sb = Sandbox(workdir, name=NAME, detached=args.keep)

    def sh(title: str, command: str) -> None:
        print(f"\n$ {title}", flush=True)
        result = sb.run(command, check=False, timeout=300,
                        env={"GPUD_SOCKET": "/run/gpud/gpud.sock"})
        print((result.stdout + result.stderr).rstrip(), flush=True)

    try:
        print("== booting a disposable systemd (overlay of /, own namespaces) ==", flush=True)
        sb.boot()
        sb.install_gpud(REPO, before)
        sb.write_file("/usr/local/bin/vllm", STANDIN, mode=0o755)
        sb.write_file("/opt/serves/bin/ocr-serve", STANDIN, mode=0o755)
        sb.write_file("/usr/local/bin/gpuctl", f'#!/bin/sh\nexec {PY} -m gpud.ctl "$@"\n',
                      mode=0o755)
        sb.run(["mkdir", "-p", "/run/gpud"])
        sb.run(["install", "-m", "0755", str(REPO / ".venv" / "bin" / "nginx"), NGINX])
        sb.run(["install", "-D", "-m", "0644",
                str(REPO / ".venv" / "lib" / "nginx" / "modules" / "ngx_http_js_module.so"), NJS])
        sb.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                "--groups", "gpud", "gpud-front"])
        sb.write_file("/run/gpud/sim.json", json.dumps(EXTERNAL))
        print("\n== T015: the resident set as it was (reserve 7168, fast 18432) ==", flush=True)
        sh("systemctl start gpud", "systemctl start gpud && systemctl status gpud --no-pager "
           "-n 0 | sed -n '1,8p'")
        wait_boot(sb)
        sh("gpuctl serves", "gpuctl serves")
        sh("gpuctl ledger", "gpuctl ledger")
        sh("journalctl -u gpud GPUD_SERVE=ocr  # why was ocr denied?",
           "journalctl -u gpud GPUD_SERVE=ocr -o cat --no-pager")
        sb.write_file("/etc/gpud/serves.new.toml", after, mode=0o600)
        print("\n== the rebalance: reserve 4608, fast on the FP8 checkpoint at 14336 ==",
              flush=True)
        sh("gpuctl plan /etc/gpud/serves.new.toml", "gpuctl plan /etc/gpud/serves.new.toml")
        sh("gpuctl apply /etc/gpud/serves.new.toml", "gpuctl apply /etc/gpud/serves.new.toml")
        sh("gpuctl ledger", "gpuctl ledger")
        sh("systemctl list-units 'gpud-serve-*'",
           "systemctl list-units 'gpud-serve-*' --no-pager --no-legend")
        sh("curl -s --unix-socket /run/gpud/gpud.sock http://localhost/metrics | grep -E ...",
           "curl -s --unix-socket /run/gpud/gpud.sock http://localhost/metrics "
           "| grep -E '^gpud_(role_(committed|ledger_free)|device_(non_ledger_draw|reserve_excess))_mib'")
        sh("gpuctl events --kind reserve-exceeded,deny,apply --limit 8",
           "gpuctl events --kind reserve-exceeded,deny,apply --limit 8")
        print("\n== one address for every model: the router, by the request's model ==",
              flush=True)
        sh("curl -s 127.0.0.1:8000/v1/models  # every name, its serve and state",
           "curl -s 127.0.0.1:8000/v1/models | " + PY + " -c 'import json, sys; "
           "[print(m[\"id\"], \"->\", m[\"gpud\"][\"serve\"], m[\"gpud\"][\"state\"]) "
           "for m in json.load(sys.stdin)[\"data\"]]'")
        sh("curl -s 127.0.0.1:8000/v1/completions -d '{\"model\": \"ocr\", ...}'",
           "curl -s 127.0.0.1:8000/v1/completions -d '{\"model\": \"ocr\", "
           "\"prompt\": \"scan\", \"max_tokens\": 3}'; echo")
        sh("curl -s 127.0.0.1:8000/v1/embeddings -d '{\"model\": \"embeddings\", ...}'"
           "  # by its purpose name",
           "curl -s 127.0.0.1:8000/v1/embeddings -d '{\"model\": \"embeddings\", "
           "\"input\": \"a page the OCR serve read\"}' | " + PY + " -c 'import json, sys; "
           "a = json.load(sys.stdin); print(\"answered by\", a[\"model\"], \"->\", "
           "len(a[\"data\"][0][\"embedding\"]), \"dimensions, usage\", a[\"usage\"])'")
        print("\n== a sleeping model, woken by a request for it by name ==", flush=True)
        sh("gpuctl sleep fast", "gpuctl sleep fast")
        sh(f"gpuctl models  # {FAST}: before the request", MODEL_LINE)
        sh(f"curl -s 127.0.0.1:8000/v1/chat/completions -d '{{\"model\": \"{FAST}\", ...}}'"
           "  # its wake included",
           "curl -s -o /tmp/answer.json -w 'HTTP %{http_code} in %{time_total} s\\n' "
           "127.0.0.1:8000/v1/chat/completions -d "
           f"'{{\"model\": \"{FAST}\", \"messages\": [{{\"role\": \"user\", "
           "\"content\": \"hi\"}], \"max_tokens\": 3}'; "
           f"{PY} -c 'import json; a = json.load(open(\"/tmp/answer.json\")); "
           "print(\"answered by\", a[\"model\"], \"->\", "
           "repr(a[\"choices\"][0][\"message\"][\"content\"]))'")
        sh(f"gpuctl models  # {FAST}: after", MODEL_LINE)
        sh("gpuctl events --serve fast --kind sleep,wake --limit 2",
           "gpuctl events --serve fast --kind sleep,wake --limit 2")
    finally:
        if not args.keep:
            sb.poweroff()
            print("\n== sandbox powered off ==")
        else:
            print("\n== sandbox left running ==")
            print("\n".join(kept(sb.name)))
    print(f"demo wall time: {time.monotonic() - started:.1f} s")
    print("\n".join(WHAT_NEXT))
    return 0


def kept(name: str) -> list[str]:
    """How to enter a sandbox --keep left running, and power it off (tools/sandbox.py's command
    line, run by this interpreter: the project's, which the sandbox needs)."""
    tool = f"{PY} {REPO / 'tools' / 'sandbox.py'} --name {name}"
    return [f"  enter it:     {tool} shell      (then: gpuctl serves, journalctl -u gpud, ...)",
            f"  power it off: {tool} poweroff"]


WHAT_NEXT = [
    "",
    "== what next ==",
    "  the same on your own GPU: README.md, \"On your own GPU\" (install, one serve and the "
    "router, start, a request)",
    "  look around in this one: make demo DEMO_ARGS=--keep (it stays up; the last lines say how "
    "to enter and power it off)",
    "  the config it ran: etc/serves.toml; the router: docs/router.md; sleep and preemption: "
    "docs/sleep.md",
]


def wait_boot(sb: Sandbox, timeout: float = 60) -> None:
    """Until the resident set has settled (every resident serve running or denied)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = sb.run(f"{PY} -m gpud.ctl --socket /run/gpud/gpud.sock serves --json",
                     check=False).stdout
        try:
            serves = json.loads(out)["serves"]
        except (ValueError, KeyError):
            serves = []
        if serves and all(s["state"] in ("running", "denied", "failed") for s in serves):
            return
        time.sleep(0.5)
    print("(the resident set did not settle in time)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
