"""`lazytrain` console entry point: one argparse subparser per verb, one module per verb.

Each verb module exposes `register(subparsers)` (adds its parser, sets `func=run`) and
`run(args) -> int`. Exit codes: 0 ok; 1 the job failed (infeasible budget, I/O error);
2 bad usage or config (STYLE.md section 5).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Verb -> module. Plain dict, read top to bottom (STYLE.md: no registration side effects).
COMMANDS = {
    "plan": "lazytrain.cli.plan",
    "simulate": "lazytrain.cli.simulate",
    "train": "lazytrain.cli.train",
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every verb in `COMMANDS` registered."""
    parser = argparse.ArgumentParser(
        prog="lazytrain",
        description="Plan and run CPU-master layer-streaming training of LLMs larger than HBM.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in COMMANDS.values():
        importlib.import_module(module_name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` and run the verb; user errors print one line `error: ...` and exit 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
