"""Figure 1: `gpuctl status` wall time against `python3 -c pass`, against a real gpud.

Three commands (four where `gpuctl` on PATH is a shim) run in a shuffled order in every round, so
a noisy moment hits all of them alike. The ratio is median(gpuctl) / median(python -c pass);
the spread is that of the per-round ratios. Each process is started with posix_spawn and reaped
with waitpid: the parent adds the same few tens of microseconds to every command.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from pathlib import Path

from bench.common import PY, FigureResult, Row, median, pct, spread, start_gpud, temp_dir, verdict

TARGET_RATIO = 2.5
PASS = "python3 -c pass"
AS_IS = "gpuctl status (no bytecode cache)"
SHIM = "gpuctl status (PATH shim)"

CONFIG = """\
[daemon]
admission = "ledger"

[roles.dark-fast]
device = "0"
capacity_mib = 32607
reserve_mib = 4608

[serves.fast]
role = "dark-fast"
vram_mib = 14336
resident = false
port = 30001
command = ["/bin/true"]

[serves.ocr]
role = "dark-fast"
vram_mib = 5120
port = 30007
command = ["/bin/true"]
"""


def _spawn_time(argv: list[str], env: dict[str, str], devnull: int,
                ok: tuple[int, ...] = (0,)) -> float:
    """Wall seconds from spawn to reaped; raises when the command exits otherwise than OK."""
    start = time.perf_counter()
    pid = os.posix_spawn(argv[0], argv, env, file_actions=[
        (os.POSIX_SPAWN_DUP2, devnull, 1), (os.POSIX_SPAWN_DUP2, devnull, 2)])
    _, status = os.waitpid(pid, 0)
    elapsed = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code not in ok:
        raise RuntimeError(f"{' '.join(argv)} exited {code}")
    return elapsed


def console_script() -> Path:
    """The `gpuctl` console script installed beside this interpreter (pip's entry point)."""
    script = Path(PY).parent / "gpuctl"
    if not script.exists():
        found = shutil.which("gpuctl")
        if found is None:
            raise RuntimeError("no gpuctl console script installed (pip install -e .)")
        script = Path(found)
    return script


def environments(tmp: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(with bytecode, as is). With: a bytecode cache of our own (PYTHONPYCACHEPREFIX, written by
    the warm-up rounds) for every command alike, as an installed package has its .pyc files.
    As is: this process's environment, where PYTHONDONTWRITEBYTECODE may leave gpud without any."""
    as_is = {k: v for k, v in os.environ.items() if k not in ("GPUD_SOCKET", "PYTHONPYCACHEPREFIX")}
    cached = {k: v for k, v in as_is.items() if k != "PYTHONDONTWRITEBYTECODE"}
    cached["PYTHONPYCACHEPREFIX"] = str(tmp / "pycache")
    return cached, as_is


def run(quick: bool) -> FigureResult:
    fig = FigureResult("startup", "gpuctl status wall time vs python3 -c pass")
    rounds, warmup = (8, 2) if quick else (40, 3)
    tmp = temp_dir("startup")
    daemon = start_gpud(tmp, CONFIG)
    try:
        sock = str(daemon.socket)
        script = console_script()
        cached, as_is = environments(tmp)
        commands: dict[str, tuple[list[str], dict[str, str]]] = {
            PASS: ([PY, "-c", "pass"], cached),
            "gpuctl status (console script)": ([str(script), "--socket", sock, "status"], cached),
            "python3 -m gpud.ctl status": (
                [PY, "-m", "gpud.ctl", "--socket", sock, "status"], cached),
        }
        if os.environ.get("PYTHONDONTWRITEBYTECODE"):
            commands[AS_IS] = ([str(script), "--socket", sock, "status"], as_is)
            fig.note("PYTHONDONTWRITEBYTECODE is set here: gpuctl is also timed in this environment "
                     "as is (gpud's modules compiled from source at every start, unless a "
                     "__pycache__ exists), for information")
        shim = shutil.which("gpuctl")
        if shim is not None and Path(shim).resolve() != script.resolve():
            # what a user of this machine gets typing `gpuctl`: a pyenv-style shim in front of it
            commands[SHIM] = ([shim, "--socket", sock, "status"], cached)
            fig.note(f"`gpuctl` on PATH is {shim}, a shim in front of {script}; timed too, "
                     "for information (not the figure)")
        times: dict[str, list[float]] = {name: [] for name in commands}
        devnull = os.open(os.devnull, os.O_WRONLY)
        rng = random.Random(1)
        try:
            for i in range(warmup + rounds):
                order = list(commands)
                rng.shuffle(order)
                for name in order:
                    argv, env = commands[name]
                    elapsed = _spawn_time(argv, env, devnull)
                    if i >= warmup:
                        times[name].append(elapsed * 1000)
        finally:
            os.close(devnull)
    finally:
        daemon.stop()
        _cleanup(tmp)
    _gpud_start(fig, quick, median(times[PASS]))
    base = times[PASS]
    fig.note(f"{rounds} interleaved rounds (+{warmup} warm-up), interpreter {PY}, "
             f"console script {script}; bytecode cached (PYTHONPYCACHEPREFIX) unless said")
    for name, values in times.items():
        fig.note(f"{name:34s} ms: {spread(values)}")
    fig.raw = {"rounds": rounds, "ms": times}
    for name in commands:
        if name == PASS:
            continue
        ratio = median(times[name]) / median(base)
        per_round = [t / b for t, b in zip(times[name], base, strict=True)]
        fig.note(f"{name}: ratio of medians {ratio:.2f}x; per-round ratios p25-p75 "
                 f"{pct(per_round, 25):.2f}-{pct(per_round, 75):.2f}")
        info = name in (SHIM, AS_IS)
        fig.rows.append(Row(
            figure=f"1. {name} / python3 -c pass",
            measured=f"{ratio:.2f}x ({median(times[name]):.0f} ms / {median(base):.0f} ms)",
            target="(info)" if info else f"<= {TARGET_RATIO}x",
            verdict="info" if info else verdict(ratio, TARGET_RATIO),
        ))
    return fig


def _gpud_start(fig: FigureResult, quick: bool, bare_ms: float) -> None:
    """gpud's own start: spawn -> the first answer on its socket, and `gpud --check-config`,
    beside the bare interpreter measured in the same run."""
    first: list[float] = []
    check: list[float] = []
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for _ in range(3 if quick else 10):
            tmp = temp_dir("first-answer")
            try:
                t = time.perf_counter()
                daemon = start_gpud(tmp, CONFIG)
                first.append((time.perf_counter() - t) * 1000)
                daemon.stop()
                env, _ = environments(tmp)
                check.append(_spawn_time([PY, "-m", "gpud.daemon", "--check-config",
                                          str(tmp / "serves.toml")], env, devnull) * 1000)
            finally:
                _cleanup(tmp)
    finally:
        os.close(devnull)
    fig.note(f"gpud spawn -> first ready answer on its socket ms: {spread(first)}")
    fig.note(f"gpud --check-config ms: {spread(check)}")
    fig.raw.update({"first_answer_ms": first, "check_config_ms": check})
    fig.rows.append(Row("1. gpud spawn -> first answer / python3 -c pass",
                        f"{median(first) / bare_ms:.2f}x ({median(first):.0f} ms)", "(info)",
                        "info"))
    fig.rows.append(Row("1. gpud --check-config / python3 -c pass",
                        f"{median(check) / bare_ms:.2f}x ({median(check):.0f} ms)", "(info)",
                        "info"))


def _cleanup(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
