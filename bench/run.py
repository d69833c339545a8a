#!/usr/bin/env python3
"""gpud's benchmark suite: every figure, measured in one run, side by side with its target.

    python3 bench/run.py                # everything; writes bench/RESULTS.md
    python3 bench/run.py --quick        # a short smoke run (< 1 min)
    python3 bench/run.py --only boot    # one figure (repeatable; names or numbers 1-8)

See bench/README.md for what each figure means and how it is measured. Benchmarks are not
tests: nothing here runs under pytest, and a missed target is reported, not failed on.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import (  # noqa: E402
    fig_admissions,
    fig_flood,
    fig_idle,
    fig_parallel,
    fig_plan,
    fig_sleep,
    fig_startup,
    fig_systemd,
)
from bench.common import FigureResult, Row, loadavg, machine  # noqa: E402

FIGURES = ("startup", "admissions", "idle", "boot", "detection", "plan", "preempt", "flood",
           "parallel")
RESULTS = REPO / "bench" / "RESULTS.md"
FIGURES_DOC = REPO / "docs" / "development.md"
# The figures' page (docs/development.md, "Figures"; the README links to it). Its table of
# figures lies between these lines, written from RESULTS.md by a full run
# (tests/test_bench_results.py fails when it says anything else).
README_BEGIN = "<!-- figures: written by bench/run.py from bench/RESULTS.md; do not edit -->"
README_END = "<!-- /figures -->"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/run.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a short smoke run (< 1 min), fewer repeats")
    p.add_argument("--only", action="append", metavar="NAME",
                   help=f"only this figure: {', '.join(FIGURES)} or 1-{len(FIGURES)} (may be repeated)")
    p.add_argument("--results", type=Path, default=None,
                   help="write the results here (default: bench/RESULTS.md, written only by a "
                        "full run of every figure)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help="also write every raw number as JSON")
    args = p.parse_args(argv)
    only: set[str] = set()
    for name in args.only or []:
        key = FIGURES[int(name) - 1] if name.isdigit() and 1 <= int(name) <= len(FIGURES) else name
        if key not in FIGURES:
            p.error(f"--only {name}: one of {', '.join(FIGURES)} or 1-{len(FIGURES)}")
        only.add(key)
    args.only_set = only or set(FIGURES)
    return args


def table(rows: list[Row]) -> str:
    head = Row("figure", "measured", "target", "ratio / verdict")
    widths = [max(len(getattr(r, f)) for r in [head, *rows])
              for f in ("figure", "measured", "target", "verdict")]
    lines = []
    for i, r in enumerate([head, *rows]):
        lines.append("  ".join(v.ljust(w) for v, w in
                               zip((r.figure, r.measured, r.target, r.verdict), widths, strict=True)))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown(info: dict[str, str], figs: list[FigureResult], args: argparse.Namespace,
             elapsed: float) -> str:
    out = ["# gpud benchmark results", "",
           "Written by `python3 bench/run.py` (`make bench`); see bench/README.md for what each "
           "figure means. Numbers from one run on one machine: compare ratios, not milliseconds.",
           "", "## Machine", ""]
    for key in ("nproc", "cpu", "memory", "kernel", "python", "date", "commit", "load_before",
                "load_after"):
        out.append(f"- {key.replace('_', ' ')}: {info.get(key, '?')}")
    mode = "quick" if args.quick else "full"
    out += [f"- run: {mode}, figures {', '.join(f.name for f in figs)}, {elapsed:.0f} s", "",
            "## Figures", "", "| figure | measured | target | ratio / verdict |",
            "| --- | --- | --- | --- |"]
    for fig in figs:
        for r in fig.rows:
            out.append(f"| {r.figure} | {r.measured} | {r.target} | {r.verdict} |")
    out += ["", "## Details", ""]
    for fig in figs:
        out += [f"### {fig.name}: {fig.title}", ""]
        out += [f"- {n}" for n in fig.notes]
        out += [f"- PROBLEM: {p}" for p in fig.problems]
        out.append("")
    return "\n".join(out)


def readme_figures(results: str) -> str:
    """The block of figures of docs/development.md: RESULTS.md's table (figure, measured,
    target) and the commit and machine it was measured on."""
    info = dict(re.findall(r"^- (nproc|cpu|python|commit|date|run): (.*)$", results, flags=re.M))
    section = results.split("\n## Figures\n", 1)[1].split("\n## ", 1)[0]
    rows = [line[2:-2].split(" | ") for line in section.splitlines()
            if line.startswith("| ") and line.endswith(" |")
            and not line.startswith(("| figure |", "| --- |"))]
    python = info.get("python", "?").split(" (", 1)[0]
    out = [README_BEGIN,
           f"Measured at commit {info.get('commit', '?')} ({info.get('date', '?')}), "
           f"{info.get('nproc', '?')} x {info.get('cpu', '?')}, Python {python}; "
           "every line and its spread are in `bench/RESULTS.md`.", "",
           "| figure | measured | target | verdict |", "| --- | --- | --- | --- |"]
    out += [f"| {' | '.join(cells)} |" for cells in rows]
    out.append(README_END)
    return "\n".join(out)


def write_readme(results: str, readme: Path = FIGURES_DOC) -> None:
    text = readme.read_text()
    if README_BEGIN not in text or README_END not in text:
        raise SystemExit(f"{readme}: no {README_BEGIN!r} ... {README_END!r} block to write into")
    head, rest = text.split(README_BEGIN, 1)
    tail = rest.split(README_END, 1)[1]
    readme.write_text(head + readme_figures(results) + tail)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    info = machine()
    print(f"gpud benchmarks ({'quick' if args.quick else 'full'}) on {info['nproc']} x "
          f"{info['cpu']}, {info['kernel']}, Python {info['python']}, {info['date']}, "
          f"load {info['load_before']}", flush=True)
    runners: list[tuple[str, Callable[[], list[FigureResult]]]] = [
        ("startup", lambda: [fig_startup.run(args.quick)]),
        ("admissions", lambda: [fig_admissions.run(args.quick)]),
        ("idle", lambda: [fig_idle.run(args.quick)]),
        ("boot+detection", lambda: fig_systemd.run(args.quick, args.only_set)),
        ("plan", lambda: [fig_plan.run(args.quick)]),
        ("preempt", lambda: [fig_sleep.run(args.quick)]),
        ("flood", lambda: [fig_flood.run(args.quick)]),
        ("parallel", lambda: [fig_parallel.run(args.quick)]),
    ]
    figs: list[FigureResult] = []
    failed = False
    for key, runner in runners:
        names = {"boot", "detection"} if key == "boot+detection" else {key}
        if not names & args.only_set:
            continue
        print(f"\n== {key}", flush=True)
        t = time.monotonic()
        try:
            figs += runner()
        except Exception as exc:
            failed = True
            traceback.print_exc()
            for name in sorted(names & args.only_set):
                fig = FigureResult(name, "failed")
                fig.problem(f"{type(exc).__name__}: {exc}"[:2000])
                fig.rows.append(Row(f"{name}", "FAILED", "-", f"{type(exc).__name__}"))
                figs.append(fig)
        print(f"   ({time.monotonic() - t:.1f} s)", flush=True)
    info["load_after"] = loadavg()
    elapsed = time.monotonic() - started
    order = {name: i for i, name in enumerate(FIGURES)}
    figs.sort(key=lambda f: order.get(f.name, 99))
    rows = [r for f in figs for r in f.rows]
    print(f"\n== results ({elapsed:.0f} s, load {info['load_before']} -> {info['load_after']})")
    print(table(rows))
    problems = [f"{f.name}: {p}" for f in figs for p in f.problems]
    if problems:
        print("\nsuspicious:")
        for p in problems:
            print(f"  - {p}")
    full = not args.quick and args.only_set == set(FIGURES)
    target = args.results or (RESULTS if full else None)
    if target is not None:
        target.write_text(markdown(info, figs, args, elapsed) + "\n")
        print(f"\nwritten to {target}")
        if target == RESULTS:
            write_readme(target.read_text())
            print(f"and its figures to {FIGURES_DOC}")
    else:
        print("\n(not written to bench/RESULTS.md: a --quick or --only run; --results PATH writes it)")
    if args.json is not None:
        args.json.write_text(json.dumps({"machine": info, "elapsed_s": elapsed, "figures": {
            f.name: {"rows": [vars(r) for r in f.rows], "notes": f.notes, "problems": f.problems,
                     "raw": f.raw} for f in figs}}, indent=1, default=str) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
