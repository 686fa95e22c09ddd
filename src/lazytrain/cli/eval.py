"""`lazytrain eval RUN_DIR --tasks T1,T2`: lm-eval tasks on a run's checkpoint, through the engine.

Runs lm-eval's `simple_evaluate` with a model backed by the streaming engine's forward-only and
decode passes (`evaluation.lm_eval_model`: log-likelihood, rolling log-likelihood and
generate-until requests), so a model larger than the GPU is evaluated without a second copy of
it, in the run's `train.compute_dtype`. Tasks are lm-eval's own or YAML tasks under
--include-path. Prints lm-eval's table to stdout and, with --output, writes lm-eval's results
JSON atomically. Needs the `eval` extra (lm-eval). Exit codes: 0 ok; 2 bad usage, an unknown
task, a run without a checkpoint, lm-eval not installed.
"""

from __future__ import annotations

import argparse
import sys

from lazytrain.atomic import write_text_atomic
from lazytrain.cli.generate import add_model_flags, open_model
from lazytrain.errors import UserError

EPILOG = """examples:
  lazytrain eval runs/default --tasks arc_easy,hellaswag --limit 100 --output eval.json
  lazytrain eval runs/default --tasks my_task --include-path tasks/ --apply-chat-template
"""


def register(subparsers) -> None:
    """Add the `eval` subcommand."""
    p = subparsers.add_parser("eval", description=__doc__.split("\n\n")[1], epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory with a checkpoint")
    p.add_argument("--tasks", required=True, metavar="T1,T2",
                   help="lm-eval task or group names, comma-separated")
    p.add_argument("--include-path", metavar="DIR", help="a folder of local task YAML files")
    p.add_argument("--limit", type=float, metavar="N",
                   help="documents per task (N >= 1), or a fraction of them (N < 1)")
    p.add_argument("--num-fewshot", type=int, metavar="K",
                   help="few-shot examples per prompt (default: each task's own)")
    p.add_argument("--apply-chat-template", action="store_true",
                   help="render prompts with the checkpoint's chat template")
    p.add_argument("--seed", type=int, default=1234, metavar="N",
                   help="seed of the first sampled generation (default 1234)")
    p.add_argument("--output", metavar="FILE", help="write lm-eval's results JSON here")
    add_model_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Check the tasks, load the model, evaluate, print the table; returns the exit code."""
    lm_eval_run = load_lm_eval_run()
    tasks = [name.strip() for name in args.tasks.split(",") if name.strip()]
    manager = lm_eval_run.task_manager(args.include_path)
    lm_eval_run.check_tasks(tasks, manager)
    if args.limit is not None and args.limit <= 0:
        raise ValueError(f"--limit must be > 0; got {args.limit}")
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    results = lm_eval_run.evaluate_tasks(
        open_model(args), tasks=tasks, manager=manager, limit=limit,
        num_fewshot=args.num_fewshot, batch_size=args.batch_size,
        apply_chat_template=args.apply_chat_template, seed=args.seed)
    print(lm_eval_run.results_table(results))
    if args.output:
        path = write_text_atomic(args.output, lm_eval_run.results_json(results))
        print(f"wrote {path}", file=sys.stderr)
    return 0


def load_lm_eval_run():
    """`lazytrain.evaluation.lm_eval_run`, which needs lm-eval (the `eval` extra).

    Raises:
        UserError: lm-eval is not installed (one line naming the install command).
    """
    try:
        from lazytrain.evaluation import lm_eval_run  # lazy: optional dependency (the [eval] extra)
    except ModuleNotFoundError as exc:
        if exc.name is None or not exc.name.startswith("lm_eval"):
            raise
        raise UserError("lazytrain eval needs lm-eval (the eval extra): "
                        "pip install -e '.[eval]'") from exc
    return lm_eval_run
