"""`make demo`, the README's first command, end to end: the seed's T015 host booted in a
disposable systemd, ocr denied for the seed's reason, then the T011 rebalance in two commands,
then the router: ocr by name, embeddings by their purpose name, and a sleeping serve woken by a
request for its model.
Checked against the record's own figures, so the demo cannot rot unnoticed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# (what the demo must print, why it is the seed's)
SEED_LINES = [
    ("ocr (denied): ledger bound: need 5120 MiB, free 351 MiB, short 4769 MiB",
     "T015: ocr 5120 denied, 351 free, short 4769"),
    ("gpu_role 'dark-fast': capacity 32607 MiB, reserve 7168 MiB, committed 25088 MiB, "
     "free 351 MiB", "T015's ledger line"),
    ("non-ledger draw 5837 MiB (reserve 7168 MiB)", "the display and sidecars' 5837 MiB"),
    ("free       351 -> 1887 MiB", "the plan's before and after"),
    ("0.5652 -> 0.4396", "fast's utilization, floored (14336 / 32607)"),
    ("gpu_role 'dark-fast': capacity 32607 MiB, reserve 4608 MiB, committed 26112 MiB, "
     "free 1887 MiB", "T011's ledger line"),
    ("ledger free is optimistic by 1229 MiB: non-ledger draw exceeds the reserve",
     "the honesty note: 5837 - 4608"),
    ("applied: dark-fast 26112/27999 MiB committed (free 1887); 4 serves: 4 running",
     "apply's result"),
]


# The router after the rebalance (docs/router.md): every name listed with its serve and
# state, a request for `ocr` by name answered by the ocr serve, and one for embeddings by
# their purpose name answered by the pooling serve with bge-m3's 1024 dimensions, as the
# record's host answers (T011: "routed /v1/embeddings -> 1024-dim vector").
ROUTER_LINES = ["ocr -> ocr running", "leon-se/gemma-4-E4B-it-FP8-Dynamic -> fast running",
                '"model": "ocr"', "embeddings -> embeddings running",
                "answered by embeddings -> 1024 dimensions, usage {'prompt_tokens': 25, "
                "'total_tokens': 25, 'completion_tokens': 0, 'prompt_tokens_details': None}"]
FAST = re.escape("leon-se/gemma-4-E4B-it-FP8-Dynamic")
# Then fast put to sleep, and a request for its model by name through the router: fast asleep
# before it, the request answered by fast (its time printed), fast running after it, and the
# wake's event naming the request, with the serve's own wake time.
WAKE = re.compile(
    rf"^{FAST} +local +fast +sleeping .*"
    r"^HTTP 200 in [0-9.]+ s\n"
    rf"answered by {FAST} -> .*"
    rf"^{FAST} +local +fast +running .*"
    rf"fast awake \(request for model '{FAST}' through the router\): 14336 MiB; "
    r"the serve took \d+ ms", re.S | re.M)


def test_make_demo_replays_the_seed_record() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS")}
    out = subprocess.run(["make", "--no-print-directory", "demo"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600, check=False)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    missing = [f"{why}: {line!r}" for line, why in SEED_LINES if line not in text]
    assert not missing, "\n".join(missing) + "\n" + text[-4000:]
    missing = [line for line in ROUTER_LINES if line not in text]
    assert not missing, "\n".join(missing) + "\n" + text[-4000:]
    assert WAKE.search(text), "no sleeping model woken by name\n" + text[-4000:]
    assert "sandbox powered off" in text
    assert "== what next ==" in text and "DEMO_ARGS=--keep" in text.split("== what next ==")[1]


def test_make_demo_keep_leaves_a_sandbox_its_printed_commands_reach() -> None:
    """`make demo DEMO_ARGS=--keep`: the sandbox stays up, and the two commands the demo prints
    for it work as printed: `shell`'s sandbox is found (its `exec` runs gpuctl inside), and
    `poweroff` powers it off (it could not find it before: the demo's workdir was a temporary
    one, the command line's /var/tmp/NAME)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS")}
    out = subprocess.run(["make", "--no-print-directory", "demo", "DEMO_ARGS=--keep"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=600, check=False)
    text = out.stdout + out.stderr
    poweroff = re.search(r"^  power it off: (.*)$", text, flags=re.M)
    enter = re.search(r"^  enter it: +(.*) shell ", text, flags=re.M)
    try:
        assert out.returncode == 0, text[-4000:]
        assert "== sandbox left running ==" in text and "sandbox powered off" not in text
        assert poweroff is not None and enter is not None, text[-4000:]
        inside = subprocess.run([*enter.group(1).split(), "exec", "--", "/bin/sh", "-c",
                                 "GPUD_SOCKET=/run/gpud/gpud.sock gpuctl serves"],
                                capture_output=True, text=True, timeout=120, check=False)
        assert inside.returncode == 0, inside.stdout + inside.stderr
        assert "ocr" in inside.stdout and "running" in inside.stdout, inside.stdout
    finally:
        if poweroff is not None:
            done = subprocess.run(poweroff.group(1).split(), capture_output=True, text=True,
                                  timeout=120, check=False)
        else:  # the demo said nothing usable: power off what it left, by its name
            done = subprocess.run([sys.executable, str(REPO / "tools" / "sandbox.py"), "--name",
                                   "gpud-demo", "poweroff"], capture_output=True, text=True,
                                  timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sandbox gpud-demo powered off" in done.stdout
