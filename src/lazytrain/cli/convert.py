"""`lazytrain convert megatrain IN.yaml [--out OUT.yaml]`: a MegaTrain run config as ours.

Reads the MegaTrain YAML, maps each key (`lazytrain.megatrain`), validates the result as a
LazyTrain run config, and writes it (atomically) with a header saying where it came from, the
command that plans it, the hardware it assumes, and every key mapped or dropped and why.
Without `--out` the YAML goes to stdout and the report to stderr. Exit codes: 0 ok; 2 bad
input (not a mapping, no model name, a value our config refuses).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from lazytrain.atomic import write_text_atomic
from lazytrain.config import SECTIONS, TrainConfig, config_from_dict
from lazytrain.megatrain import DEFAULT_HARDWARE, convert_megatrain, with_train_keys

EPILOG = """\
examples:
  lazytrain convert megatrain path/to/megatrain/qwen3_8b.yaml --out qwen3-8b.yaml
  lazytrain plan --config qwen3-8b.yaml --model path/to/Qwen3-8B/config.json
"""


def register(subparsers) -> None:
    """Add the `convert` subcommand (one source format for now: `megatrain`)."""
    p = subparsers.add_parser(
        "convert", description=__doc__.split("\n\n")[1], epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    kinds = p.add_subparsers(dest="source", metavar="SOURCE", required=True)
    m = kinds.add_parser("megatrain", help="a MegaTrain YAML (model/dataset/training/optimizer/"
                                           "memory sections)", epilog=EPILOG,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    m.add_argument("input", metavar="IN.yaml", help="the MegaTrain config")
    m.add_argument("--out", metavar="OUT.yaml", help="write our config here (default: stdout)")
    m.add_argument("--hardware", metavar="PRESET", default=None,
                   help="hardware.preset of the result (default: h100-sxm, the GPU MegaTrain's "
                        "examples target)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Convert, validate, write; print the mapped/dropped report."""
    source = Path(args.input)
    if not source.is_file():
        raise FileNotFoundError(f"MegaTrain config not found: {source}")
    try:
        raw = yaml.safe_load(source.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{source}: not valid YAML ({exc}); fix the syntax") from None
    conversion = convert_megatrain(raw, hardware=args.hardware or DEFAULT_HARDWARE,
                                   run_dir=f"runs/{source.stem}",
                                   train_keys=with_train_keys(TrainConfig))
    config_from_dict(conversion.config)  # refuses what our config would refuse, key named
    ordered = {s: conversion.config[s] for s in SECTIONS if s in conversion.config}
    out_name = args.out or f"{source.stem}-lazytrain.yaml"
    text = header(source, out_name, conversion) + yaml.safe_dump(ordered, sort_keys=False)
    if args.out is None:
        sys.stdout.write(text)
        print(conversion.summary(), file=sys.stderr)
        return 0
    path = write_text_atomic(args.out, text)
    print(conversion.summary())
    print(f"wrote {path}")
    print(f"plan it: lazytrain plan --config {path} --model PATH/TO/"
          f"{conversion.model_id.rsplit('/', 1)[-1]}/config.json")
    return 0


def header(source: Path, out_name: str, conversion) -> str:
    """The comment block opening the converted YAML (what it runs, the command, the hardware
    it assumes, and the conversion report)."""
    lines = [f"Converted from the MegaTrain config {source.name} by "
             f"`lazytrain convert megatrain`.",
             f"Model: {conversion.model_id} (`lazytrain plan` needs its config.json: the "
             f"HF cache's, fetched once, or a local file):",
             f"  lazytrain plan --config {out_name} [--model PATH/TO/config.json]",
             f"Hardware assumed: {conversion.config['hardware']['preset']} (MegaTrain configs "
             f"name none).", ""]
    lines += conversion.summary().splitlines()
    return "".join(f"# {line}".rstrip() + "\n" for line in lines) + "\n"
