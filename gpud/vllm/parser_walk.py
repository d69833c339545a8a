"""Walk the `vllm serve` argument parser of the vLLM this interpreter imports, and write its flag
table as JSON to the file named by the first argument.

Run by path, by that vLLM's own interpreter (`python -I parser_walk.py OUT`): it imports only the
standard library and vLLM, never gpud (which that interpreter lacks). gpud runs it to learn the
serve flags of a vLLM it ships no table for (gpud.vllm.learn), and scripts/vllm-flags to write
the tables it ships (gpud/data), so both are the same walk.

The parser is the one `vllm serve` itself builds: vLLM's own ServeSubcommand.subparser_init
(vllm/entrypoints/cli/serve.py) on a sub-parser of its FlexibleArgumentParser, which fills it
with make_arg_parser from wherever that release keeps it (vllm/entrypoints/common/cli_args.py in
0.33, vllm/entrypoints/launchers/cli_args.py in 0.32), walked action by action.
The JSON goes to a file, not stdout: vLLM's logger writes to stdout (vllm/logger.py's handler
on envs.VLLM_LOGGING_STREAM, whose default is ext://sys.stdout in vllm/envs.py of 0.32.0).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

# Options `vllm serve` no longer has, with what to do instead. Only written for options the
# parser really lacks (checked below). Sources: vllm/utils/argparse_utils.py
# FlexibleArgumentParser.error (the --task hint), vllm/config/model.py (RunnerOption,
# ConvertType), vllm/config/cache.py (no swap space), vllm/v1/engine (EngineCore always runs
# in its own process).
REMOVED = {
    "--task": "use --runner pooling for embedding, reranking or reward models (add --convert "
              "embed or --convert classify to adapt a generative model); native embedding and "
              "reranker architectures need neither",
    "--swap-space": "the engine has no CPU swap space any more: drop it (KV offloading to CPU "
                    "is --kv-offloading-size)",
    "--disable-frontend-multiprocessing": "the engine always runs in its own process "
                                          "(VLLM::EngineCore): drop it",
}


def walk() -> dict[str, Any]:
    """The `vllm serve` parser, option by option."""
    import vllm
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    top = FlexibleArgumentParser(prog="vllm")
    sub = top.add_subparsers(dest="subparser")
    serve = ServeSubcommand().subparser_init(sub)
    deprecated: set[Any] = getattr(serve, "_deprecated", set())
    options = []
    for action in serve._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        takes_value = action.nargs != 0
        nargs = action.nargs if action.nargs not in (None, 0) else None
        choices = None
        if action.choices is not None:
            choices = sorted(str(c) for c in action.choices)
        takes_json = False
        if takes_value and action.type is not None:
            try:
                takes_json = isinstance(action.type("{}"), dict) or hasattr(
                    action.type("{}"), "__dataclass_fields__")
            except Exception:
                takes_json = False
        options.append({
            "names": sorted(action.option_strings),
            "dest": action.dest,
            "takes_value": takes_value,
            "nargs": nargs,
            "choices": choices,
            "json": takes_json,
            "deprecated": (action in deprecated or bool(getattr(action, "deprecated", False))
                           or "Deprecated" in type(action).__name__),
        })
    # --quantization takes any string in the parser; vLLM checks it against
    # QUANTIZATION_METHODS when it builds its ModelConfig (vllm/config/model.py:
    # _verify_quantization), before the engine starts: the table lists those as its choices.
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    for option in options:
        if option["dest"] == "quantization" and option["choices"] is None:
            option["choices"] = sorted(QUANTIZATION_METHODS)
            option["choices_from"] = "vllm.model_executor.layers.quantization.QUANTIZATION_METHODS"
    options.sort(key=lambda o: o["names"][0])
    known = {n for o in options for n in o["names"]}
    return {
        "vllm": vllm.__version__,
        "generated_by": "gpud/vllm/parser_walk.py",
        "parser": "vllm.entrypoints.cli.serve.ServeSubcommand.subparser_init on a sub-parser "
                  "of vllm.utils.argparse_utils.FlexibleArgumentParser",
        "allow_abbrev": serve.allow_abbrev,
        "options": options,
        # what is gone with what to use instead, for the options this vLLM really lacks
        "removed": {k: v for k, v in sorted(REMOVED.items()) if k not in known},
        "removed_still_there": sorted(set(REMOVED) & known),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: parser_walk.py OUT.json", file=sys.stderr)
        return 2
    table = walk()
    with open(argv[0], "w", encoding="utf-8") as out:
        json.dump(table, out, indent=1)
        out.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
