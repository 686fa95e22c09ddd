"""`lazytrain data`: show what a run config's training data looks like to the model.

Reads the data as `lazytrain train` does (source, format, chat template, `data.seq_len`,
`data.overlong`), prints a few training samples as rendered text with the trained tokens between
[[ and ]], then the counts: samples, held-out examples, and how many samples fit whole, are
truncated or skipped at `data.seq_len`, and the trained tokens they keep. With
`train.method: dpo`, preference pairs as the DPO trainer reads them: the rendered prompt, the
chosen and the rejected response (trained tokens between [[ and ]]) with their token counts
against `data.seq_len`, and the pairs dropped. Loads the model's tokenizer, never its weights.
Exit codes: 0 ok; 2 bad config or data.
"""

from __future__ import annotations

import argparse

from lazytrain.config import load_config
from lazytrain.train.preview import preview_lines

EPILOG = """examples:
  lazytrain data configs/tiny-llama-cpu.yaml
  lazytrain data configs/qwen3-8b.yaml --samples 5 --set data.seq_len=2048
"""

COUNT_LIMIT = 10_000
"""Training samples encoded for the counts by default (a few seconds on one core); `--count`
changes it, 0 counts them all."""


def register(subparsers) -> None:
    """Add the `data` subcommand."""
    p = subparsers.add_parser("data", description=__doc__.split("\n\n")[1], epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="run config YAML (default: the embedded job)")
    p.add_argument("--samples", type=int, default=3, help="samples shown (default 3)")
    p.add_argument("--count", type=int, default=COUNT_LIMIT,
                   help=f"training samples counted (default {COUNT_LIMIT}; 0: all)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override section.key=value (repeatable)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the samples and the counts to stdout (`train.preview.preview_lines`)."""
    if args.samples < 0 or args.count < 0:
        raise ValueError(f"--samples and --count must be >= 0; got {args.samples} and "
                         f"{args.count}")
    for line in preview_lines(load_config(args.config, args.overrides), samples=args.samples,
                              count=args.count):
        print(line)
    return 0
