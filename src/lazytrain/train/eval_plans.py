"""The run's forward-only and decode plans: made at run start beside plan.json, and the weight
mode the trainer's evaluation runs in.

Owns the glue between the run config and `planner.inference_plans`: the costed problem the
training plan was made from (the same costs: `profile.calibrate.costed_problem`, never
measuring here: the training plan's calibration is cached by then), the model's parsed spec
and its HF config for the KV heads. Knows nothing of torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from lazytrain.config import RunConfig
from lazytrain.planner.build import rank_problem_of
from lazytrain.planner.inference_plans import FILES, KINDS, InferencePlan, write_inference_plans
from lazytrain.profile.calibrate import costed_problem
from lazytrain.spec.model import ModelSpec, read_hf_config


def make_eval_plans(cfg: RunConfig, run_dir: str | Path, *, config_source=None,
                    log: Callable[[str], None] = lambda msg: None) -> dict[str, InferencePlan]:
    """Write forward_plan.json and decode_plan.json into `run_dir` and return them by kind.

    Args:
        cfg: the run config (model, batch shape, dtypes, hardware).
        run_dir: where plan.json is (a data-parallel rank's own directory).
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
    return write_inference_plans(run_dir, problem, model=ModelSpec.from_hf_config(hf_config),
                                 hf_config=hf_config)


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
    """The `StreamedLM` weight mode of the trainer's evaluation: `host` on the cpu backend
    when the masters are in the compute dtype (the blocks run on the masters, nothing is
    copied), else the decode plan's choice (`resident` or `streamed`), `streamed` without a
    plan."""
    if not is_cuda and same_dtype:
        return "host"
    decode = plans.get("decode")
    return "resident" if decode is not None and decode.weights == "resident" else "streamed"
