"""Running lm-eval tasks on a `StreamedLM`: task lookup, `simple_evaluate`, the table and JSON.

Needs lm-eval (the `eval` extra); `lazytrain eval` imports this module only when it runs, so
every other command works without it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
from lm_eval.utils import handle_non_serializable, make_table

from lazytrain.evaluation.lm_eval_model import DEFAULT_SEED, StreamedEvalLM

if TYPE_CHECKING:
    from lazytrain.evaluation.streamed_lm import StreamedLM


def task_manager(include_path: str | Path | None) -> TaskManager:
    """lm-eval's task index: its own tasks plus the YAML tasks under `include_path`.

    Raises:
        FileNotFoundError: `include_path` is not a directory.
    """
    if include_path is not None and not Path(include_path).is_dir():
        raise FileNotFoundError(f"--include-path: {include_path} is not a directory; pass the "
                                "folder that holds the task YAML files")
    return TaskManager(include_path=None if include_path is None else str(include_path))


def check_tasks(names: list[str], manager: TaskManager) -> None:
    """Refuse task names lm-eval does not know, all of them in one line.

    Raises:
        ValueError: an unknown name (named, with the fix).
    """
    if not names:
        raise ValueError("--tasks: no task named; pass e.g. --tasks hellaswag,arc_easy")
    unknown = [name for name in names if not manager.match_tasks([name])]
    if unknown:
        raise ValueError(f"--tasks: unknown task(s) {', '.join(unknown)}; `lm-eval ls tasks` "
                         "lists lm-eval's own, and --include-path DIR adds local YAML tasks")


def evaluate_tasks(lm: "StreamedLM", *, tasks: list[str], manager: TaskManager,
                   limit: float | None = None, num_fewshot: int | None = None,
                   batch_size: int = 1, apply_chat_template: bool = False,
                   seed: int = DEFAULT_SEED) -> dict:
    """lm-eval's `simple_evaluate` of `tasks` on `lm` through `StreamedEvalLM`.

    Args:
        lm: the streamed model.
        tasks: lm-eval task or group names (checked by `check_tasks` first).
        manager: the task index (`task_manager`).
        limit: documents per task (an int), or a fraction of them (a float below 1); None: all.
        num_fewshot: few-shot examples per prompt; None: each task's own.
        batch_size: sequences per forward and prompts per generation call.
        apply_chat_template: render prompts with the checkpoint's chat template.
        seed: the first sampled generation's seed (lm-eval's own seeds keep its defaults, so
            few-shot examples are the ones its CLI picks).

    Returns:
        lm-eval's results dict ("results", "configs", "versions", ...).

    Raises:
        ValueError: an unknown task (`check_tasks`).
    """
    check_tasks(tasks, manager)
    return simple_evaluate(model=StreamedEvalLM(lm, batch_size=batch_size, seed=seed),
                           tasks=tasks, task_manager=manager, limit=limit,
                           num_fewshot=num_fewshot, log_samples=False,
                           apply_chat_template=apply_chat_template)


def results_table(results: dict) -> str:
    """lm-eval's Markdown table of the task scores (and of the groups', when there are any)."""
    table = make_table(results)
    if results.get("groups"):
        table += "\n" + make_table(results, "groups")
    return table


def results_json(results: dict) -> str:
    """`results` as JSON text (numpy numbers and other non-JSON values as lm-eval writes them)."""
    return json.dumps(results, indent=2, default=handle_non_serializable) + "\n"
