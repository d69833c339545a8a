"""gpuctl's commands: one ``Command`` row in ``COMMANDS`` each, with its help texts, how it reads
its arguments (``configure``) and what it does (``run``).

The parser (gpud.ctl.main), the man page (scripts/manpage.py) and the shell completion
(scripts/completion.py) are all built from ``COMMANDS``: a new command is a new row with its
``configure`` and ``run`` functions, and ``make docs``. The values of their arguments are read
by gpud.ctl.arguments (``parse_since``, ``parse_mib``: pure).
"""

from __future__ import annotations

import os

from gpud.ctl.arguments import (
    duration,
    epoch_text,
    parse_mib,
    parse_since,
    positive_float,
    positive_int,
    serve_path,
)
from gpud.ctl.client import LIFECYCLE_TIMEOUT, MUTATION_TIMEOUT, query_string
from gpud.ctl.errors import EXIT_OK, EXIT_REFUSED, EXIT_UNREACHABLE, CtlError, usage_error
from gpud.ctl.format import (
    dump_json,
    format_admit,
    format_calibration,
    format_event,
    format_events,
    format_ledger,
    format_lifecycle,
    format_models,
    format_peers,
    format_plan,
    format_preemption,
    format_release,
    format_reload,
    format_serve,
    format_serves,
    format_sleep,
    format_status,
    format_usage,
    local_time,
)

# Not ``typing.TYPE_CHECKING``: importing typing costs startup time. mypy treats any name
# TYPE_CHECKING as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable
    from typing import Any, TextIO

    from gpud.ctl.client import Client

    Doc = dict[str, Any]

from gpud.core.vocab import (  # noqa: E402 - defined once
    EVENT_KINDS,
    STATES,
    ApplyOutcome,
    Phase,
    ServeState,
    serve_unit,
)

# ---- commands ---------------------------------------------------------------------------------


class Ctl:
    """What a command runs with: the client, the output mode and the streams."""

    def __init__(self, client: Client, as_json: bool, out: TextIO, err: TextIO) -> None:
        self.client = client
        self.as_json = as_json
        self.out = out
        self.err = err
        # follow and watch print one compact JSON document per line (NDJSON), errors included
        self.ndjson = False

    def emit(self, doc: Any, human: Callable[[Any], str]) -> None:
        text = dump_json(doc) if self.as_json else human(doc)
        if text:
            print(text, file=self.out, flush=True)


class Command:
    """One subcommand: its help texts, how it reads its arguments and what it does."""

    def __init__(self, name: str, summary: str, description: str, examples: str,
                 configure: Callable[[argparse.ArgumentParser], None],
                 run: Callable[[Ctl, argparse.Namespace], int]) -> None:
        self.name = name
        self.summary = summary
        self.description = description
        self.examples = examples
        self.configure = configure
        self.run = run


def _no_args(p: argparse.ArgumentParser) -> None:
    pass


def _name_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", metavar="NAME", help="the serve, as named in serves.toml")


def run_status(ctl: Ctl, args: argparse.Namespace) -> int:
    ctl.emit(ctl.client.call("GET", "/v1/status"), format_status)
    return EXIT_OK


def configure_ledger(p: argparse.ArgumentParser) -> None:
    p.add_argument("--watch", action="store_true",
                   help="redraw the ledger every --interval seconds until Ctrl-C (exit 0); "
                        "exit 3 when gpud goes away. When output is not a terminal, print only "
                        "when the ledger changed (with --json: one compact JSON line each)")
    p.add_argument("--interval", type=positive_float, default=2.0, metavar="S",
                   help="seconds between reads with --watch (default: 2)")


def run_ledger(ctl: Ctl, args: argparse.Namespace) -> int:
    if args.watch:
        return watch_ledger(ctl, args.interval)
    ctl.emit(ctl.client.call("GET", "/v1/ledger"), format_ledger)
    return EXIT_OK


def watch_ledger(ctl: Ctl, interval: float) -> int:
    import time

    tty = ctl.out.isatty()
    ctl.ndjson = True
    last = None
    try:
        while True:
            doc = ctl.client.call("GET", "/v1/ledger")
            text = dump_json(doc, compact=True) if ctl.as_json else format_ledger(doc)
            if tty:
                stamp = local_time(time.time())
                # gpuctl's own control sequence, past the escaping of peer text
                getattr(ctl.out, "unescaped", ctl.out).write("\x1b[H\x1b[2J")
                ctl.out.write(f"{stamp}  gpuctl ledger --watch "
                              f"(every {interval:g} s, Ctrl-C to stop)\n\n{text}\n")
                ctl.out.flush()
            elif text != last:
                if not ctl.as_json and last is not None:
                    print(f"\n-- {local_time(time.time())}", file=ctl.out)
                print(text, file=ctl.out, flush=True)
            last = text
            time.sleep(interval)
    except KeyboardInterrupt:
        return EXIT_OK


def configure_serves(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", metavar="NAME", nargs="?",
                   help="show this serve alone, one field per line")
    p.add_argument("--names", action="store_true",
                   help="print only the serve names, one per line (for scripts and completion)")


def run_serves(ctl: Ctl, args: argparse.Namespace) -> int:
    if args.name is not None:
        ctl.emit(ctl.client.call("GET", serve_path(args.name)), format_serve)
        return EXIT_OK
    doc = ctl.client.call("GET", "/v1/serves")
    if args.names and not ctl.as_json:
        ctl.emit(doc, lambda d: "\n".join(str(s.get("name")) for s in d.get("serves") or []))
    else:
        ctl.emit(doc, format_serves)
    return EXIT_OK


def configure_models(p: argparse.ArgumentParser) -> None:
    del p  # no arguments


def run_models(ctl: Ctl, args: argparse.Namespace) -> int:
    serves = ctl.client.call("GET", "/v1/serves")
    if ctl.as_json:
        ctl.emit(serves, format_models)
        return EXIT_OK
    peers = ctl.client.call("GET", "/v1/peers")
    ctl.emit(serves, lambda doc: format_models(doc, peers))
    return EXIT_OK


def configure_usage(p: argparse.ArgumentParser) -> None:
    p.add_argument("--since", metavar="T",
                   help="from the hour of T on: ISO 8601 (2026-07-13T03:00, local time unless "
                        "an offset is given), epoch seconds, or an age such as 90m, 2h, 3d "
                        "(default: all kept)")
    p.add_argument("--key", metavar="K", help="only key K (its name in the keys file)")


def run_usage(ctl: Ctl, args: argparse.Namespace) -> int:
    import time

    params: list[tuple[str, str]] = []
    if args.since is not None:
        params.append(("since", epoch_text(parse_since(args.since, time.time()))))
    if args.key is not None:
        params.append(("key", args.key))
    target = "/v1/usage" + ("?" + query_string(params) if params else "")
    ctl.emit(ctl.client.call("GET", target), format_usage)
    return EXIT_OK


def run_peers(ctl: Ctl, args: argparse.Namespace) -> int:
    ctl.emit(ctl.client.call("GET", "/v1/peers"), format_peers)
    return EXIT_OK


def configure_admit(p: argparse.ArgumentParser) -> None:
    _name_arg(p)
    p.add_argument("mib", metavar="MIB",
                   help="the reservation in MiB, a positive integer; replaces the serve's own "
                        "reservation, it is not added to it")
    p.add_argument("--role", metavar="ROLE",
                   help="the role to reserve on: required for a serve serves.toml does not "
                        "declare (an external reservation), must match the configured role "
                        "otherwise")
    _preempt_args(p)


def _preempt_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preempt", action="store_true",
                   help="when it does not fit, put serves of lower priority on its role to sleep "
                        "(or stop those with preemptible = \"stop\"); the plan is printed first")
    p.add_argument("--dry-run", action="store_true",
                   help="with --preempt: print the plan and change nothing (exit 1 when no "
                        "preemption can make room)")


def _preempt_body(args: argparse.Namespace) -> Doc:
    if args.dry_run and not args.preempt:
        raise usage_error("--dry-run goes with --preempt")
    return {"preempt": True, "dry_run": bool(args.dry_run)} if args.preempt else {}


def run_admit(ctl: Ctl, args: argparse.Namespace) -> int:
    mib = parse_mib(args.mib)
    path = serve_path(args.name, "admit")
    body: Doc = {"mib": mib, **_preempt_body(args)}
    if args.role is not None:
        body["role"] = args.role
    doc = ctl.client.call("POST", path, body, LIFECYCLE_TIMEOUT if args.preempt else
                          MUTATION_TIMEOUT)
    if args.dry_run:
        ctl.emit(doc, format_preemption)
        return EXIT_OK if doc.get("fits") else EXIT_REFUSED
    ctl.emit(doc, lambda d: "\n".join(filter(None, [format_preemption(d), format_admit(d)])))
    return EXIT_OK


def configure_release(p: argparse.ArgumentParser) -> None:
    _name_arg(p)
    p.add_argument("--stop", action="store_true",
                   help="stop the serve's unit first; without it, releasing a serve whose unit "
                        "is live is refused (exit 1), since its memory is still held")


def run_release(ctl: Ctl, args: argparse.Namespace) -> int:
    doc = ctl.client.call("POST", serve_path(args.name, "release"), {"stop": bool(args.stop)},
                          LIFECYCLE_TIMEOUT if args.stop else MUTATION_TIMEOUT)
    ctl.emit(doc, lambda d: format_release(d, stopped=bool(args.stop)))
    return EXIT_OK


def configure_start(p: argparse.ArgumentParser) -> None:
    _name_arg(p)
    p.add_argument("--no-wait", action="store_true",
                   help="return once launched instead of waiting until the serve's health "
                        "endpoint answers 200 (or it fails)")


def configure_start_preempt(p: argparse.ArgumentParser) -> None:
    configure_start(p)
    _preempt_args(p)


def configure_sleep(p: argparse.ArgumentParser) -> None:
    _name_arg(p)
    p.add_argument("--level", type=int, choices=(1, 2), metavar="N",
                   help="1 parks the weights in host RAM, 2 drops them (default: the serve's "
                        "sleep_level)")


def run_sleep(ctl: Ctl, args: argparse.Namespace) -> int:
    body: Doc = {} if args.level is None else {"level": args.level}
    ctl.emit(ctl.client.call("POST", serve_path(args.name, "sleep"), body, LIFECYCLE_TIMEOUT),
             format_sleep)
    return EXIT_OK


def run_wake(ctl: Ctl, args: argparse.Namespace) -> int:
    ctl.emit(ctl.client.call("POST", serve_path(args.name, "wake"), {}, LIFECYCLE_TIMEOUT),
             format_sleep)
    return EXIT_OK


def settled(doc: Doc) -> bool:
    """The start (or restart) gpuctl began is over: nothing of gpud's is under way on the serve
    (its answer comes while the launch runs, its state still the one from before: a failed
    serve's old reason, say) and its state is not on its way somewhere."""
    return (doc.get("phase", Phase.IDLE) == Phase.IDLE
            and doc.get("state") not in (ServeState.STARTING, ServeState.STOPPING))


def _lifecycle(action: str) -> Callable[[Ctl, argparse.Namespace], int]:
    def run(ctl: Ctl, args: argparse.Namespace) -> int:
        import time

        body = _preempt_body(args) if action == "start" else {}
        doc = ctl.client.call("POST", serve_path(args.name, action), body, LIFECYCLE_TIMEOUT)
        if body.get("dry_run"):
            ctl.emit(doc, format_preemption)
            return EXIT_OK if doc.get("fits") else EXIT_REFUSED
        plan = format_preemption(doc) if body else ""
        if plan and not ctl.as_json:
            print(plan, file=ctl.out, flush=True)
        carried = doc.get("preemption")
        waiting = action != "stop" and not getattr(args, "no_wait", True)
        if waiting:
            # Stop, sleep and wake answer once theirs is over; a start answers once its launch
            # has begun, and is waited on until that launch is over.
            limit = ctl.client.timeout or LIFECYCLE_TIMEOUT
            deadline = time.monotonic() + limit
            while not settled(doc) and time.monotonic() < deadline:
                time.sleep(0.25)
                doc = ctl.client.call("GET", serve_path(args.name))
        if body and ctl.as_json:
            doc = {**doc, "preemption": carried}  # the plan carried out, with the final view
        ctl.emit(doc, format_lifecycle)
        if waiting and not settled(doc):
            print(f"gpuctl: {args.name} is still {doc.get('phase')} after {limit:g} s; "
                  f"gpuctl serves {args.name} shows how it ends", file=ctl.err, flush=True)
            return EXIT_REFUSED
        failed = doc.get("state") == ServeState.FAILED and settled(doc)
        return EXIT_REFUSED if action != "stop" and failed else EXIT_OK

    return run


def configure_events(p: argparse.ArgumentParser) -> None:
    p.add_argument("--serve", action="append", metavar="S",
                   help="only events of this serve (may be repeated)")
    p.add_argument("--role", action="append", metavar="R",
                   help="only events on this role (may be repeated)")
    p.add_argument("--kind", action="extend", nargs="+", metavar="K",
                   help="only events of these kinds (repeat, list, or comma-separate): "
                        + ", ".join(EVENT_KINDS))
    p.add_argument("--since", metavar="T",
                   help="only events at or after T: ISO 8601 (2026-07-13T03:00, local time "
                        "unless an offset is given), epoch seconds, or an age such as 90s, 10m, "
                        "2h, 3d or 1h30m")
    p.add_argument("--limit", type=positive_int, metavar="N",
                   help="at most the N newest matching events (daemon default 100, max 10000)")
    p.add_argument("-f", "--follow", action="store_true",
                   help="after the matching events, print each new one as it happens, until "
                        "Ctrl-C (exit 0); exit 3 when gpud goes away. With --json: one compact "
                        "JSON object per line (NDJSON)")


def events_query(args: argparse.Namespace, now: float) -> list[tuple[str, str]]:
    params: list[tuple[str, str]] = []
    params += [("serve", s) for s in args.serve or []]
    params += [("role", r) for r in args.role or []]
    for group in args.kind or []:
        params += [("kind", k) for k in group.split(",") if k]
    if args.since is not None:
        params.append(("since", epoch_text(parse_since(args.since, now))))
    if args.limit is not None:
        params.append(("limit", str(args.limit)))
    return params


def run_events(ctl: Ctl, args: argparse.Namespace) -> int:
    import time

    params = events_query(args, time.time())
    if args.follow:
        return follow_events(ctl, params)
    target = "/v1/events" + ("?" + query_string(params) if params else "")
    ctl.emit(ctl.client.call("GET", target), format_events)
    return EXIT_OK


def follow_events(ctl: Ctl, params: list[tuple[str, str]]) -> int:
    target = "/v1/events?" + query_string([*params, ("follow", "1")])
    ctl.ndjson = True
    try:
        for ev in ctl.client.stream(target):
            text = dump_json(ev, compact=True) if ctl.as_json else format_event(ev)
            print(text, file=ctl.out, flush=True)
    except KeyboardInterrupt:
        return EXIT_OK
    raise CtlError("unreachable", f"gpud at {ctl.client.address} ended the event stream "
                   "(stopped or restarting?)", EXIT_UNREACHABLE,
                   {"socket": ctl.client.address})


def run_reload(ctl: Ctl, args: argparse.Namespace) -> int:
    ctl.emit(ctl.client.call("POST", "/v1/reload", {}, MUTATION_TIMEOUT), format_reload)
    return EXIT_OK


def configure_config_file(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="NEW.toml", help="the serves.toml to plan or apply")


def _config_body(path: str) -> Doc:
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read(2 * 1024 * 1024)
    except OSError as exc:
        raise usage_error(f"cannot read {path}: {exc.strerror or exc}", file=path) from exc
    except UnicodeDecodeError as exc:
        raise usage_error(f"{path} is not UTF-8 text", file=path) from exc
    return {"config": text, "source": os.path.abspath(path)}



def run_plan(ctl: Ctl, args: argparse.Namespace) -> int:
    doc = ctl.client.call("POST", "/v1/plan", _config_body(args.file), MUTATION_TIMEOUT)
    ctl.emit(doc, format_plan)
    return EXIT_OK if doc.get("resident_fits") and not doc.get("blocked") else EXIT_REFUSED


def run_apply(ctl: Ctl, args: argparse.Namespace) -> int:
    final: Doc = {}
    for line in ctl.client.stream("/v1/apply", "POST", _config_body(args.file)):
        if "result" in line:
            final = line
            break
        if ctl.as_json:
            print(dump_json(line, compact=True), file=ctl.out, flush=True)
        else:
            mark = "ok  " if line.get("ok") else "FAIL"
            print(f"[{mark}] {line.get('step')}: {line.get('message')}", file=ctl.out, flush=True)
    if not final:
        raise CtlError("unreachable", "gpud ended the apply stream without a result: check "
                       "`gpuctl events --kind apply`", EXIT_UNREACHABLE)
    if ctl.as_json:
        print(dump_json(final, compact=True), file=ctl.out, flush=True)
    elif final.get("result") == ApplyOutcome.APPLIED:
        print(f"applied: {final.get('summary')}", file=ctl.out)
    elif final.get("result") == ApplyOutcome.ROLLED_BACK:
        print(f"rolled back: {final.get('error')}; {final.get('summary')}", file=ctl.err)
    else:
        err = final.get("error") or {}
        print(f"gpuctl: {err.get('message', final)}", file=ctl.err)
    return EXIT_OK if final.get("result") == ApplyOutcome.APPLIED else EXIT_REFUSED


def configure_calibrate(p: argparse.ArgumentParser) -> None:
    _name_arg(p)
    p.add_argument("--window", default="10m", metavar="T",
                   help="how long to sample the serve's draw: 90s, 10m, 1h (default 10m)")
    p.add_argument("--no-wait", action="store_true",
                   help="start the calibration and return; see `gpuctl calibrate NAME --status`")
    p.add_argument("--status", action="store_true", help="show the serve's calibration only")


def run_calibrate(ctl: Ctl, args: argparse.Namespace) -> int:
    import time

    path = serve_path(args.name, "calibration")
    if not args.status:
        ctl.client.call("POST", serve_path(args.name, "calibrate"),
                        {"window_s": duration(args.window)}, MUTATION_TIMEOUT)
        if not args.no_wait:
            while (doc := ctl.client.call("GET", path)).get("running"):
                if not ctl.as_json:
                    print(format_calibration(doc).splitlines()[-1], file=ctl.err, flush=True)
                time.sleep(min(5.0, max(0.5, duration(args.window) / 10)))
    ctl.emit(ctl.client.call("GET", path), format_calibration)
    return EXIT_OK


def configure_size(p: argparse.ArgumentParser) -> None:
    from gpud.ctl import size

    size.configure(p)


def run_size(ctl: Ctl, args: argparse.Namespace) -> int:
    from gpud.ctl import size

    return size.run(ctl, args)


def configure_logs(p: argparse.ArgumentParser) -> None:
    from gpud.ctl import logs

    logs.configure(p)


def run_logs(ctl: Ctl, args: argparse.Namespace) -> int:
    import time

    from gpud.ctl import logs

    since = parse_since(args.since, time.time()) if args.since is not None else None
    return logs.run(ctl, args, since)


def configure_keys(p: argparse.ArgumentParser) -> None:
    from gpud.ctl import keys

    keys.configure(p)


def run_keys(ctl: Ctl, args: argparse.Namespace) -> int:
    from gpud.ctl import keys

    return keys.run(ctl, args)


COMMANDS: tuple[Command, ...] = (
    Command(
        "status", "the daemon in a few lines",
        "Show gpud's version, host, config file, admission mode, whether launching (the system "
        "bus) and observation (NVML, or the simulated backend) are available and why not, how "
        "many serves are in each state, which roles are over-committed, the router (whether it "
        "listens on its address, and why it is degraded: its keys refused, its module missing, "
        "its address held by another process), what else of the front is dark, and the ledger "
        "summary. The same, live and with every serve, device and key: the status page "
        "(GET /ui on the socket; docs/status-page.md).\n\n"
        "Readable by anyone who can open the socket (group gpud).",
        "  gpuctl status\n  gpuctl status --json | jq .observation",
        _no_args, run_status),
    Command(
        "ledger", "the GPU-memory ledger of every role",
        "Show each role as the operator's record writes it: capacity, reserve, committed and "
        "free MiB (free = capacity - reserve - committed), then one line per reservation, then, "
        "when observation is available, what the device really draws: used, the draw the ledger "
        "does not manage (display, sidecars) against the reserve, physical free and the "
        "effective free that strict admission uses. A role whose non-ledger draw exceeds its "
        "reserve is flagged (its ledger free figure is optimistic); an over-committed role "
        "(free below zero after a config change) is flagged loudly. Figures from the simulated "
        "backend are marked (simulated).",
        "  gpuctl ledger\n"
        "      gpu_role 'dark-fast': capacity 32607 MiB, reserve 4608 MiB, committed 26112 MiB,"
        " free 1887 MiB\n"
        "        fast 14336 MiB (resident, running)\n"
        "        ...\n"
        "  gpuctl ledger --watch --interval 5",
        configure_ledger, run_ledger),
    Command(
        "serves", "the serves and their states",
        "Without NAME, a table of every serve gpud knows (configured or holding an external "
        "reservation), sorted by role, priority and name: state, configured vram_mib, "
        "reserved MiB, resident, priority, port, main PID and calibration; then the reason of "
        "each denied or failed serve. With NAME, every field of that serve.\n\n"
        "States: " + ", ".join(STATES) + ".",
        "  gpuctl serves\n  gpuctl serves ocr\n  gpuctl serves --names",
        configure_serves, run_serves),
    Command(
        "models", "the names the router routes, and their serves",
        "With a [router] table (docs/router.md): every name a request's model may give, with "
        "the host that serves it (local, or the peer's name: docs/peers.md), the serve it goes "
        "to, that serve's state, its port and whether it is fronted. The names come from "
        "serves.NAME.models (unset: what the serve answers to by default) and from each "
        "peer's own /v1/models, its state and queue as the peer reported them; a peer whose "
        "circuit is open is named below the table. --json is GET /v1/serves (the peers: "
        "gpuctl --json peers).",
        "  gpuctl models\n"
        "      MODEL      HOST   SERVE  STATE     PORT  FRONT\n"
        "      chat       local  chat   running  30001  yes\n"
        "      chat-fast  local  chat   running  30001  yes\n"
        "      ocr        node2  -      sleeping     -  -\n"
        "  gpuctl models --json",
        configure_models, run_models),
    Command(
        "usage", "requests and tokens per key and model through the router",
        "Usage per key (docs/router.md, \"Who is asking\"), from gpud's store (hourly rows, "
        "kept across restarts, pruned to daemon.events_keep rows as events are): for each key "
        "and model, the requests by status, and the prompt and completion tokens of the "
        "serve's own usage object. An answer without one (a stream without "
        "stream_options.include_usage) is counted in REQUESTS and UNMETERED, its tokens in "
        "neither sum; one whose client hung up before the whole answer was sent in HUNG UP "
        "too. Requests through a serve's own fronted port are counted alike. KEY \"\" "
        "(shown -): requests without a key (keys off). The newest requests appear within "
        "5 s; those answered while gpud was down once it is back. Then each key's token "
        "budgets (keys.NAME.tokens_per_day, tokens_per_month: prompt + completion tokens, the "
        "day and the month in UTC, docs/router.md \"Budgets\"): used, left, and when the "
        "period resets; a key with none left is answered 429 insufficient_quota until then.",
        "  gpuctl usage --since 24h\n"
        "      KEY    MODEL  REQUESTS  PROMPT  COMPLETION  TOTAL  UNMETERED  HUNG UP  STATUSES\n"
        "      alice  chat        120   48211       20113  68324          2        1  "
        "200:118 429:2\n"
        "  gpuctl --json usage --key alice",
        configure_usage, run_usage),
    Command(
        "peers", "the other gpud hosts whose models are offered here",
        "Each [peers.NAME] of serves.toml (docs/peers.md): its router's URL, whether it "
        "answered its /v1/models when last asked and since when, its circuit (closed: "
        "requests may go to it; open: none do, only its /v1/models is probed; half-open: a "
        "probe in flight), how many of its models are offered here, the round trip of its "
        "last answer; then each peer's models, its last error and why its circuit is open. "
        "gpud asks every 5 s, and at once after a failure.\n\n"
        "Readable by anyone who can open the socket (group gpud).",
        "  gpuctl peers\n"
        "      PEER   URL                         REACHABLE                                "
        "CIRCUIT  MODELS  RTT\n"
        "      node2  http://node2.tailnet:8000   reachable since 2026-07-13T03:00:12+02:00  "
        "closed        2  1.9 ms\n"
        "  gpuctl --json peers",
        _no_args, run_peers),
    Command(
        "admit", "reserve MiB for a serve on its role",
        "Ask the ledger for MIB MiB for serve NAME. The serve's own current reservation is "
        "replaced, not added to. It is admitted iff MIB fits the role's free figure (ledger "
        "mode) or the smaller of that and the observed free memory (strict mode, the default); "
        "a denial says which bound failed, the need, the free figure and the shortfall, and "
        "exits 1. Admitting does not start the serve (see start).\n\n"
        "Needs root or the admin group.",
        "  gpuctl admit ocr 5120\n"
        "  gpuctl admit fast 14336\n"
        "      admitted fast: 14336 MiB on dark-fast (was 18432); dark-fast free 1887 MiB\n"
        "  gpuctl admit sidecar 2048 --role dark-fast      # a process gpud does not launch",
        configure_admit, run_admit),
    Command(
        "release", "give a serve's reservation back",
        "Drop serve NAME's reservation. gpud never releases memory a live process still "
        "holds: releasing a serve whose unit is live is refused (exit 1) unless --stop stops "
        "it in the same request.\n\nNeeds root or the admin group.",
        "  gpuctl release ocr\n  gpuctl release ocr --stop",
        configure_release, run_release),
    Command(
        "start", "admit (if needed) and launch a serve",
        "Admit serve NAME at its configured vram_mib if it holds no reservation (a denial exits "
        f"1 with the reason), then launch its transient unit {serve_unit('NAME')} and wait "
        "until its health endpoint answers 200 (--no-wait: return once launched). Exits 1 when "
        "the serve fails to become healthy, or when launching is unavailable (no system bus)."
        "\n\nWith --preempt, a serve that does not fit puts the fewest serves of lower priority "
        "(a larger priority number) on its role to sleep, or stops those with preemptible = "
        "\"stop\"; equal or higher priority is never touched. The plan is printed first "
        "(--dry-run: only the plan), carried out in order, each step an event; if the serve "
        "still does not fit, every step is undone and the denial says why. Without --preempt "
        "a denial names what a preemption would do.\n\nNeeds root or the admin group.",
        "  gpuctl start ocr\n  gpuctl start ocr --no-wait\n"
        "  gpuctl start hi --preempt --dry-run\n  gpuctl start hi --preempt",
        configure_start_preempt, _lifecycle("start")),
    Command(
        "sleep", "put a running serve to sleep (vLLM sleep mode)",
        "Ask serve NAME (a vllm serve with sleep_level, or a command that speaks vLLM's sleep "
        "endpoints) to sleep: POST /sleep?level=N, confirmed with GET /is_sleeping, then its "
        "reservation shrinks to its sleep_mib in the same transaction as its state. Level 1 "
        "parks the weights in host RAM and is refused when MemAvailable cannot hold them plus "
        "daemon.sleep_host_margin_mib; level 2 drops them.\n\nNeeds root or the admin group.",
        "  gpuctl sleep lo\n  gpuctl sleep lo --level 2",
        configure_sleep, run_sleep),
    Command(
        "wake", "wake a sleeping serve",
        "Admit serve NAME at its vram_mib again (strict admission: the physical bound counts), "
        "then POST /wake_up and wait until it says it is awake. A wake that does not fit is "
        "denied with the usual reason (exit 1) and the serve stays asleep.\n\nNeeds root or "
        "the admin group.",
        "  gpuctl wake lo",
        _name_arg, run_wake),
    Command(
        "stop", "stop a serve's unit and release its reservation",
        "Stop serve NAME's unit (SIGTERM to its main process, SIGKILL to what is left after its "
        "stop timeout) and release its reservation. The next start on that device waits until "
        "the device shows the memory back.\n\nNeeds root or the admin group.",
        "  gpuctl stop ocr",
        _name_arg, _lifecycle("stop")),
    Command(
        "restart", "restart a serve's unit",
        "Restart serve NAME's unit under its current reservation and wait until it is healthy "
        "again (--no-wait: return once launched).\n\nNeeds root or the admin group.",
        "  gpuctl restart fast",
        configure_start, _lifecycle("restart")),
    Command(
        "events", "what happened: admissions, denials, starts, exits, overdraws",
        "Show stored events, oldest first: the newest --limit that match. Each line: local "
        "time (ISO 8601), kind, serve, role, MiB, message. --json gives each event's details "
        "too.\n\nKinds: " + ", ".join(EVENT_KINDS) + ".",
        "  gpuctl events --serve ocr --kind deny --since 2h\n"
        "  gpuctl events --since 2026-07-13T03:00 --limit 20\n"
        "  gpuctl events --follow --kind overdraw,reserve-exceeded",
        configure_events, run_events),
    Command(
        "logs", "a serve's own journal: what it wrote, why it failed",
        f"Show serve NAME's journal: what its processes wrote to stdout and stderr, which "
        f"systemd keeps under its unit {serve_unit('NAME')} (the same as `journalctl -u "
        f"{serve_unit('NAME')}`), oldest first; -f follows it, --since and --lines bound it, "
        "--json gives journalctl's JSON, one entry a line. A failed serve's reason (gpuctl "
        "serves NAME) already names the exception it ended on and where it was raised (else "
        "its last ERROR line, else its last three lines); this is the whole story.\n\n"
        "gpuctl runs journalctl as you, not through gpud: you see what you may read. Root and "
        "the members of group systemd-journal (or adm) may read the system journal; anyone "
        "else is told so (exit 1). Works while gpud is down.",
        "  gpuctl logs ocr\n  gpuctl logs ocr -f\n  gpuctl logs ocr --since 1h --lines 50\n"
        f"  journalctl -u {serve_unit('ocr')} -b        # the same, by hand",
        configure_logs, run_logs),
    Command(
        "plan", "what a new serves.toml would do to the ledger",
        "Ask gpud to compute the ledger NEW.toml would give, without changing anything: per "
        "role capacity, reserve, committed and free before -> after; per serve its reservation, "
        "--gpu-memory-utilization and state before -> after, what changed and whether it must "
        "restart; and whether the full resident set is admitted, by every bound apply checks: "
        "the ledger's, and under strict admission what each device has free at each step of "
        "the apply (stops and shrinks first give memory back). Exits 1 when it does not fit, "
        "naming the bound that blocks and the shortfall.\n\nReadable by anyone who can open the socket.",
        "  gpuctl plan /etc/gpud/serves.new.toml",
        configure_config_file, run_plan),
    Command(
        "apply", "rebalance to a new serves.toml, rolling back on failure",
        "Validate NEW.toml (refused, nothing changed, when the resident set does not fit), back "
        "up the current config (timestamped, the last daemon.backups_keep kept, under "
        "backups/ beside it), stop the live serves that leave the config or their role and "
        "release the reservations of admitted ones that do, write NEW.toml over it "
        "atomically, reload, then restart changed serves and resize the reservations of "
        "admitted ones whose vram_mib changes, shrinking ones before growing ones, start "
        "resident serves that now fit, and wait for their health: the steps gpuctl plan "
        "shows. If a step fails the old config is written back and the touched serves get "
        "their state and reservation back (a re-admission that no longer fits is said so, "
        "never over-committed); a gpud that dies during an apply does the same at its next "
        "start. Each step is printed as it happens and logged as an `apply` event. Exit 1 "
        "when refused or rolled back.\n\n"
        "Needs root or the admin group.",
        "  gpuctl plan new.toml && gpuctl apply new.toml",
        configure_config_file, run_apply),
    Command(
        "calibrate", "measure a serve's real draw and recommend a reservation",
        "Sample the draw of running serve NAME over --window (default 10m) and store its steady "
        "(median) and peak MiB and a recommended vram_mib (peak plus max(256 MiB, 5%), rounded "
        "up to 256 MiB), bound to the serve's fingerprint (model, revision, quantization, "
        "max_model_len, command): when any of those change the calibration shows as stale.\n\n"
        "Starting one needs root or the admin group; --status is readable by anyone.",
        "  gpuctl calibrate fast --window 10m\n  gpuctl calibrate fast --status",
        configure_calibrate, run_calibrate),
    Command(
        "size", "what a model needs, from its checkpoint on disk",
        "Read MODEL's checkpoint on this host without loading it (the safetensors headers of "
        "every shard, config.json) and print what a vllm serve of it needs: the weights as "
        "vLLM holds them (a pre-quantized checkpoint as stored; an online --quantization "
        "estimated, embeddings, LM head and norms left in the model's dtype), the KV cache per "
        "token and for one sequence of --max-model-len, and the minimum reservation (weights + "
        "that KV cache + context), with the serves.toml lines to write. Then what a "
        "reservation (--vram-mib, else the smallest for --concurrency sequences) leaves for "
        "the KV cache after each named deduction (weights, context, activation peak and CUDA "
        "graphs, the last two estimated): in MiB, in tokens and sequences at once as vLLM "
        "--vllm-version counts them. With --vram-mib, exit 1 and say what fits instead when "
        "that reservation cannot hold it. MODEL is a directory, or a repository id found in the "
        "serves' model cache at --revision. gpud is not asked; a model not on disk, a "
        "--vram-mib below the weights, a --max-model-len over the model's window or a "
        "--quantization that does not apply exits 2. With --serve NAME instead of MODEL, gpud "
        "sizes a configured serve, with the overheads its calibration measured once it has one "
        "(gpuctl calibrate).",
        "  gpuctl size /srv/models/gemma-4-E4B-it --max-model-len 32768\n"
        "  gpuctl size leon-se/gemma-4-E4B-it-FP8-Dynamic --revision COMMIT --vram-mib 10240\n"
        "  gpuctl size /srv/models/qwen3-8b --max-model-len 32768 --concurrency 4\n"
        "  gpuctl size --serve fast\n"
        "  gpuctl size /srv/models/llama --quantization fp8_per_tensor --kv-cache-dtype fp8",
        configure_size, run_size),
    Command(
        "keys", "the router's keys: list, add, rotate, revoke",
        "Edit the router's keys file (router.api_keys_file of the config in force; "
        "docs/router.md). list shows each key's models, limits and whether the file holds "
        "its token or only the token's SHA-256, never a token. add NAME makes a key with a "
        "new random token (Python's secrets), prints the token once and writes only its "
        "SHA-256; rotate NAME gives it a new token the same way (the old one is refused from "
        "then on), keeping its models and limits; revoke NAME removes it. Each change is made "
        "on the file's own lines (the rest, comments included, kept), checked whole as gpud's "
        "reload checks it (models no serve answers to, limits out of range: exit 2, nothing "
        "changed), written atomically (0600) under a lock, and then gpud reloads, which gives "
        "the router the new keys; when gpud refuses that reload the old file is put back. "
        "Refused while the config file on disk is not the config in force (the reload would "
        "put it in force too).\n\n"
        "Needs root: the edit is gpuctl's, with its user's own rights, and the config and the "
        "keys file are root's.",
        "  gpuctl keys list\n"
        "  gpuctl keys add alice --models chat ocr --requests-per-minute 60\n"
        "      key alice added in /etc/gpud/keys.toml; gpud reloaded\n"
        "      token: sk-gpud-...\n"
        "  gpuctl keys rotate alice\n"
        "  gpuctl keys revoke alice",
        configure_keys, run_keys),
    Command(
        "reload", "re-read serves.toml",
        "Make gpud re-read its config file. Reservations are never dropped silently: a role the "
        "new config leaves over-committed is reported as such.\n\nNeeds root or the admin group.",
        "  gpuctl reload",
        _no_args, run_reload),
)
