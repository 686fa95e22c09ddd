"""The run's forward-only and decode plans: made at run start beside plan.json, and the
`StreamedLM` the trainer's evaluation runs on.

Owns the glue between the run config and `planner.inference_plans`: the costed problem the
training plan was made from (the same costs: `profile.calibrate.costed_problem`, never
measuring here: the training plan's calibration is cached by then), the model's parsed spec
and its HF config for the KV heads; and the evaluation model over the engine's own device,
compute dtype and host masters in the weight mode the decode plan chose.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from lazytrain.config import RunConfig
from lazytrain.data import stop_token_ids
from lazytrain.evaluation.streamed_lm import StreamedLM
from lazytrain.planner.build import hardware_from_config, rank_problem_of
from lazytrain.planner.inference_plans import (EVAL_ROWS, FILES, KINDS, InferencePlan,
                                               make_inference_plans)
from lazytrain.planner.plan_checks import PlanValidationError
from lazytrain.profile.calibrate import costed_problem
from lazytrain.spec.model import ModelSpec, read_hf_config


def make_eval_plans(cfg: RunConfig, *, config_source=None,
                    log: Callable[[str], None] = lambda msg: None) -> dict[str, InferencePlan]:
    """The forward and decode plans of the run, by kind (`save_eval_plans` writes them).

    Args:
        cfg: the run config (model, batch shape, dtypes, hardware).
        config_source: the HF config to read (a resumed checkpoint's config.json); default
            `model.config_path`.
        log: calibration notes (a cache miss plans analytic; nothing is measured).

    Raises:
        PlanValidationError: a plan does not fit the HBM budget even with streamed weights
            (names the shortfall and the fix).
    """
    source = config_source or cfg.model.config_path
    hf_config = read_hf_config(source)
    problem = rank_problem_of(cfg, costed_problem(cfg, measure=None, log=log))
    return make_inference_plans(
        problem, model=ModelSpec.from_hf_config(hf_config), hf_config=hf_config,
        hbm_bytes_per_s=hardware_from_config(cfg).hbm_bandwidth_bytes_per_s,
        batch=eval_rows(cfg))


def eval_rows(cfg: RunConfig) -> int | None:
    """Rows of the run's forward and decode plans: a GRPO step's rollouts (prompts_per_step x
    n: all of a step's generation in one batch, as far as HBM allows; `make_inference_plans`
    halves them until they fit), else None (the default, `inference_plans.EVAL_ROWS`)."""
    if cfg.train.method == "grpo":
        return cfg.grpo.prompts_per_step * cfg.grpo.n
    return None


def start_eval_plans(cfg: RunConfig, *, config_source=None, show: bool,
                     log: Callable[[str], None]) -> dict[str, InferencePlan]:
    """The run's plans at start (`make_eval_plans`), their lines on stdout under the plan
    table when `show`. A plan that does not fit even streamed stops a run with held-out
    examples (before a file is written: the caller saves them later) and is one line of
    `log` otherwise (no plans).

    Raises:
        PlanValidationError: with `data.num_eval` > 0, as `make_eval_plans`.
    """
    try:
        plans = make_eval_plans(cfg, config_source=config_source, log=log)
    except PlanValidationError as exc:
        if cfg.data.num_eval:
            raise
        log(f"note: no evaluation plans: {exc}")
        return {}
    if show:
        print("\n".join(p.summary_line() for p in plans.values()), flush=True)
    return plans


def save_eval_plans(plans: dict[str, InferencePlan], run_dir: str | Path) -> None:
    """Write each plan atomically beside plan.json (`inference_plans.FILES`)."""
    for kind, plan in plans.items():
        plan.save(Path(run_dir) / FILES[kind])


def load_eval_plans(run_dir: str | Path) -> dict[str, InferencePlan]:
    """The plans `make_eval_plans` wrote, validated; a kind without its file is left out.

    Raises:
        PlanValidationError: a file that is not a valid plan (names the file and the fix).
    """
    out = {}
    for kind in KINDS:
        path = Path(run_dir) / FILES[kind]
        if path.is_file():
            out[kind] = InferencePlan.load(path)
    return out


def eval_weights_mode(plans: dict[str, InferencePlan], *, is_cuda: bool,
                      same_dtype: bool) -> str:
    """The `StreamedLM` weight mode of the trainer's evaluation: on the cpu backends `host`
    when the masters are in the compute dtype (the blocks run on the masters, nothing is
    copied), else `streamed` (the cpu's "device" memory is host memory: resident blocks would
    be a second copy of the model there); on CUDA the decode plan's choice (`resident` or
    `streamed`), `streamed` without a plan."""
    if not is_cuda:
        return "host" if same_dtype else "streamed"
    decode = plans.get("decode")
    return "resident" if decode is not None and decode.weights == "resident" else "streamed"


def heldout_lm(adapter, tokenizer, engine, plans: dict[str, InferencePlan]) -> StreamedLM:
    """The trainer's evaluation model: `adapter`'s host masters on the engine's device API and
    weight slots (idle between steps), in its compute dtype, stopping at eos and the chat
    template's end-of-turn token (`data.stop_token_ids`), in batches of the decode plan's rows
    (EVAL_ROWS without one). No second copy of the model.

    The weight mode is `eval_weights_mode`'s, except that resident weights on CUDA need the
    decode plan's peak beside what the engine holds between steps (the ledger's HBM bytes
    now); the ledger checks the window "eval" against the decode plan's HBM budget.
    """
    dev = engine.dev
    same = adapter.params.ends.master.dtype == engine.dtype
    mode = eval_weights_mode(plans, is_cuda=dev.is_cuda, same_dtype=same)
    decode = plans.get("decode")
    if mode == "resident" and (decode.peak_hbm_bytes + dev.ledger.held_bytes("hbm")
                               > decode.hbm_budget_bytes):
        mode = "streamed"
    return StreamedLM(adapter, tokenizer, device=dev, compute_dtype=engine.dtype, weights=mode,
                      batch_size=decode.batch if decode else EVAL_ROWS,
                      eos_token_ids=set(stop_token_ids(tokenizer)), slots=engine.weights,
                      hbm_limit_bytes=decode.hbm_budget_bytes if decode else None)
