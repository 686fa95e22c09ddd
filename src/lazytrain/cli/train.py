"""`lazytrain train`: plan, preflight, train with the streaming engine, evaluate, checkpoint.

Without `--config` it runs the embedded default job (SmolLM2-135M-Instruct on the built-in
arithmetic problems, CPU fp32). Results (the plan summary, the final line) go to stdout; the
progress bar and logs go to stderr. Exit codes: 0 done; 1 the job failed (preflight refused,
infeasible plan, I/O error, disk full while saving); 2 bad usage, config or input (a used run
directory without --resume/--overwrite, a missing or damaged checkpoint, another model on
--resume); 143 / 130 stopped by SIGTERM / Ctrl-C after saving a checkpoint (one line says so).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lazytrain.config import load_config
from lazytrain.planner.plan import Plan
from lazytrain.train.checkpoint import resume_checkpoint
from lazytrain.train import loop  # loop.train read at the call: tests wrap it with hooks
from lazytrain.train.rank import launched_rank

EPILOG = """examples:
  lazytrain train --run-dir runs/default
  lazytrain train --config configs/tiny-llama-cpu.yaml --steps 4 --set train.lr=3e-4
  lazytrain train --resume runs/default --steps 24
"""

STOP_EXIT = {"SIGTERM": 143, "SIGINT": 130}
"""128 + the signal number: the conventional status of a process ended by that signal."""


def register(subparsers) -> None:
    p = subparsers.add_parser("train", epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="run config YAML (default: the embedded default job)")
    p.add_argument("--run-dir", help="run directory (overrides train.run_dir)")
    p.add_argument("--steps", type=int, help="total optimizer steps (overrides train.steps)")
    p.add_argument("--plan", help="use this plan.json instead of planning")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its newest valid checkpoint (its "
                        "config.yaml is used unless --config is given)")
    p.add_argument("--no-verify-checkpoint", action="store_true",
                   help="with --resume: check the checkpoint's file sizes only, not their xxh3 "
                        "digests (the check reads the whole checkpoint once, at the disk's read rate)")
    p.add_argument("--overwrite", action="store_true",
                   help="start fresh in a run directory that holds an earlier run: delete its "
                        "checkpoints, metrics, windows, summary, plan and config first")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override section.key=value (repeatable)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def resolve_config(args: argparse.Namespace):
    """The run config: --config (or the resumed run's config.yaml, or the default) + overrides."""
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    run_dir = args.run_dir or args.resume
    if run_dir:
        overrides.append(f"train.run_dir={run_dir}")
    path = args.config
    if path is None and args.resume:
        resume_checkpoint(args.resume)  # names a missing run dir / checkpoint first
        path = Path(args.resume) / "config.yaml"
        if not path.is_file():
            raise FileNotFoundError(f"--resume: {path} is missing, so the run's config is "
                                    f"unknown; pass the config it was started with: --config "
                                    f"FILE --resume {args.resume}")
    return load_config(path, overrides)


def run(args: argparse.Namespace) -> int:
    """Train as the arguments say; errors go to `lazytrain.cli.main` (exit codes 1 and 2)."""
    cfg = resolve_config(args)
    plan = Plan.load(args.plan) if args.plan else None
    summary = loop.train(cfg, plan=plan, resume=bool(args.resume), overwrite=args.overwrite,
                         progress=not args.no_progress,
                         verify_checkpoint=not args.no_verify_checkpoint)
    if launched_rank() == 0:  # torchrun: rank 0 alone reports
        print(_final_line(summary))
        if summary["stopped_by"]:
            print(f"stopped by {summary['stopped_by']} after step {summary['steps_completed']};"
                  f" checkpoint {summary['checkpoint']}; continue with: lazytrain train "
                  f"--resume {summary['run_dir']}", file=sys.stderr)
    return STOP_EXIT.get(summary["stopped_by"], 0)


def _fmt(value, spec: str = ".4f") -> str:
    return "n/a" if value is None else format(value, spec)


def _final_line(summary: dict) -> str:
    before, after = summary["eval_before"] or {}, summary["eval_after"] or {}
    return (f"done: {summary['steps_completed']} steps (this run {summary['steps_this_run']}), "
            f"train loss {_fmt(summary['loss_first'])} -> {_fmt(summary['loss_last'])}, "
            f"eval loss {_fmt(before.get('loss'))} -> {_fmt(after.get('loss'))}, "
            f"exact match {_fmt(before.get('exact_match'), '.3f')} -> "
            f"{_fmt(after.get('exact_match'), '.3f')}, "
            f"{_fmt(summary['mean_step_s'], '.2f')} s/step, checkpoint {summary['checkpoint']}, "
            f"summary {summary['run_dir']}/summary.json")
