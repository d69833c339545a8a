"""The serve flags of an installed vLLM, learned from that vLLM itself: its own interpreter runs
its own `vllm serve` parser through gpud/vllm/parser_walk.py, once per version; the caller keeps
the table in gpud's state directory (gpud.config), so the next load reads the file.

The interpreter is the one the serves run vLLM with: `daemon.vllm_executable` (the `vllm`
console script, on PATH or by path) names it in its `#!` line, as pip writes one; `python3 -m
vllm` setups are not guessed at. Importing vLLM's argument parser imports torch (seconds, tens
of seconds on a cold disk): LEARN_TIMEOUT_S bounds it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from gpud.vllm.vllm_flags import FlagTable, TableError, checked_table

WALKER = Path(__file__).resolve().with_name("parser_walk.py")
LEARN_TIMEOUT_S = 300.0


class LearnError(Exception):
    """Why the flags could not be learned (the message says it for an operator)."""


def interpreter_of(executable: str) -> str:
    """The Python interpreter of the `vllm` console script EXECUTABLE (its `#!` line)."""
    found = shutil.which(executable)
    if found is None:
        raise LearnError(f"{executable!r} is not found (daemon.vllm_executable)")
    try:
        with open(found, "rb") as f:
            head = f.readline(512)
    except OSError as exc:
        raise LearnError(f"cannot read {found}: {exc.strerror or exc}") from None
    if not head.startswith(b"#!"):
        raise LearnError(f"{found} is not a script with a #! line naming its Python (a pip "
                         "console script)")
    words = head[2:].decode(errors="replace").split()
    if words and os.path.basename(words[0]) == "env" and len(words) > 1:
        words = words[1:]
        python = shutil.which(words[0])
        if python is None:
            raise LearnError(f"{found}: its interpreter {words[0]!r} is not found")
        return python
    if not words or not os.access(words[0], os.X_OK):
        raise LearnError(f"{found}: its interpreter {' '.join(words)!r} cannot be run")
    return words[0]


def learn(executable: str, version: str, *, timeout: float = LEARN_TIMEOUT_S,
          environment: dict[str, str] | None = None) -> tuple[FlagTable, str]:
    """Walk the parser of the vLLM EXECUTABLE runs: (its table, the table's JSON text to keep).
    LearnError when it cannot be run, fails, or is another version than VERSION."""
    python = interpreter_of(executable)
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
    env |= {"VLLM_NO_USAGE_STATS": "1", "VLLM_CONFIGURE_LOGGING": "0",
            "PYTHONDONTWRITEBYTECODE": "1"} | (environment or {})
    with tempfile.TemporaryDirectory(prefix="gpud-vllm-flags-") as tmp:
        out = Path(tmp) / "table.json"
        try:
            done = subprocess.run([python, "-I", str(WALKER), str(out)], env=env, cwd=tmp,
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            raise LearnError(f"{python} did not walk vLLM's parser within {timeout:g} s") \
                from None
        except OSError as exc:
            raise LearnError(f"cannot run {python}: {exc.strerror or exc}") from None
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise LearnError(f"{python} could not walk vLLM's parser (exit "
                             f"{done.returncode}): {tail}")
        try:
            text = out.read_text()
            data = json.loads(text)
        except (OSError, ValueError) as exc:
            raise LearnError(f"{python} wrote no flag table: {exc}") from None
    found = data.get("vllm") if isinstance(data, dict) else None
    if found != version:
        raise LearnError(f"the vLLM that {executable!r} runs is {found}, while "
                         f"daemon.vllm_version says {version}: set it to {found}")
    try:
        table = checked_table(data, version, f"vLLM {version}'s own parser ({python})")
    except TableError as exc:
        raise LearnError(str(exc)) from None
    return table, text
