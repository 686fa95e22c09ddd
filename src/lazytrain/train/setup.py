"""Run set-up: the plan a job trains with, and the calibration it measures on a cache miss.

`plan_for_run` is the plan a run trains with (given, its own plan.json on resume, or new);
`make_plan` plans through the one planning entry with the costs of
`profile.calibrate.costed_problem`; `measure_config_profile` measures the configured model's
profile on a cut of it (the calibration's `Measure`, and `lazytrain profile`); `plan_summary`
is the start-up summary with its costs line. Where the model comes from is `train.model_source`,
the checks before planning `train.checks`, the job's locks `train.locks`. Knows nothing about
the training loop.
"""

from __future__ import annotations

import functools
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from lazytrain.models import load_adapter_from_config
from lazytrain.models.cut import cut_config, profile_layers
from lazytrain.models.families import text_model_config
from lazytrain.planner import policy
from lazytrain.planner.build import rank_problem_of
from lazytrain.planner.plan import Plan
from lazytrain.profile.calibrate import costed_problem, costs_line_of
from lazytrain.profile.profiler import measure_profile
from lazytrain.report.plan_table import plan_summary as summary_of
from lazytrain.spec.model import ModelSpec
from lazytrain.train.model_source import load_hf_config, resolve_model_source


def make_plan(cfg: Any, *, calibrate: bool = True, run_dir: Path | None = None,
              log: Callable[[str], None] | None = None) -> Plan:
    """Plan from the config through the one planning entry (`planner.policy.plan` with
    `planner_options(cfg.planner)`, as `lazytrain plan` and a re-plan do): with
    `dist.nproc_per_node` > 1, one rank's share of the node, with the costs of
    `profile.calibrate.costed_problem` (recorded as the plan's provenance `costs`).

    Args:
        cfg: the run config.
        calibrate: measure this machine's calibration on a cache miss (`runtime.calibrate:
            auto`; `measure_calibration`). False: a miss plans analytic.
        run_dir: the job's run directory (default `train.run_dir`), where a calibration times
            NVMe unless `runtime.nvme_dir` is set.
        log: calibration progress and warnings (default: stderr).

    Raises:
        PlanInfeasibleError: (milp) no plan fits the budgets.
    """
    measure = functools.partial(measure_calibration, run_dir=run_dir) if calibrate else None
    problem = rank_problem_of(cfg, costed_problem(cfg, measure=measure, log=log or to_stderr))
    return policy.plan(problem, policy.planner_options(cfg.planner))


def plan_for_run(cfg: Any, run_dir: Path, *, plan: Plan | None, resuming: bool,
                 log: Callable[[str], None] | None = None) -> Plan:
    """The plan a run trains with: `plan` when given, the run's own plan.json when resuming
    (unless it was planned for another number of nodes or ranks per node: then planned again,
    said through `log`), else `make_plan(cfg, run_dir=run_dir)`.

    Args:
        cfg: the run config (`dpo_run.planning_config` of it).
        run_dir: the run directory (its plan.json; where a calibration times NVMe).
        plan: a plan to use instead (`--plan`), or None.
        resuming: the run continues from a checkpoint.
        log: the line saying why a resume plans again (default: stderr).

    Raises:
        PlanInfeasibleError: as `make_plan`.
        PlanValidationError: the plan was made for another data.seq_len or train.micro_batch
            (`Plan.check_matches`).
    """
    if plan is None and resuming and (run_dir / "plan.json").is_file():
        plan = Plan.load(run_dir / "plan.json")
        dist = plan.provenance.get("dist") or {}
        planned = (dist.get("nproc_per_node", 1), dist.get("nnodes", 1))
        if planned != (cfg.dist.nproc_per_node, cfg.dist.nnodes):  # another share of a node
            (log or to_stderr)(f"note: {run_dir / 'plan.json'} was planned for {planned[1]} "
                               f"node(s) x {planned[0]} ranks; this job has {cfg.dist.nnodes} "
                               f"x {cfg.dist.nproc_per_node}: planning again")
            plan = None
    if plan is None:
        plan = make_plan(cfg, run_dir=run_dir)
    plan.check_matches(seq_len=cfg.data.seq_len, micro_batch=cfg.train.micro_batch)
    return plan


def measure_config_profile(cfg: Any, device: str, *, quick: bool = False, repeats: int = 5,
                           warmup: int = 2, run_dir: Path | None = None,
                           log: Callable[[str], None] = lambda msg: None) -> dict:
    """The configured model's profile on `device` (`profile.profiler.measure_profile`).

    The model is measured cut to one block of each kind (`models.cut.profile_layers`: a
    llama, one block; the ends whole), built from its architecture (`model.config_path`) with
    a seeded random init: times do not depend on the values, a hub id downloads no weights for
    it, and host memory holds that cut, never the whole model (which the run streams and the
    host preflight sized). The whole model's parameter count scales the profile's
    parameter-bound step terms (`measure_profile`'s `model_numel`). NVMe is timed in a
    temporary directory under `runtime.nvme_dir` (else the run directory), removed
    afterwards. The model copy is freed on return.

    Args:
        cfg: the run config (batch shape, dtypes, io and torch threads).
        device: "cpu" or "cuda".
        quick: the calibration mode (a few timed runs per figure).
        repeats, warmup: timed and untimed runs per measurement (ignored when quick).
        run_dir: the run directory (default `train.run_dir`).
        log: progress lines.

    Raises:
        FileNotFoundError, ValueError: the model cannot be resolved or cut.
        OSError: the NVMe scratch directory cannot be created.
    """
    if cfg.runtime.threads:
        torch.set_num_threads(cfg.runtime.threads)
    hf_config = load_hf_config(resolve_model_source(cfg.model.config_path, weights=False))
    spec = ModelSpec.from_hf_config(text_model_config(hf_config).to_dict())
    layers = profile_layers(hf_config)
    adapter = load_adapter_from_config(cut_config(hf_config, layers),
                                       dtype=cfg.train.compute_dtype,
                                       master_dtype=cfg.train.master_dtype, seed=cfg.train.seed)
    root = Path(cfg.runtime.nvme_dir or run_dir or cfg.train.run_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix="profile-nvme-") as nvme_dir:
        return measure_profile(
            adapter, [spec.blocks[j].kind for j in layers], micro_batch=cfg.train.micro_batch,
            seq_len=cfg.data.seq_len, compute_dtype=cfg.train.compute_dtype, device=device,
            nvme_dir=nvme_dir, io_threads=cfg.runtime.io_threads, repeats=repeats,
            warmup=warmup, model_config_sha256=spec.config_sha256, log=log, quick=quick,
            model_numel=spec.total_params)


def to_stderr(msg: str) -> None:
    """Print one progress or warning line on stderr (stdout carries the command's output)."""
    print(msg, file=sys.stderr, flush=True)


def measure_calibration(cfg: Any, device: str, *, run_dir: Path | None = None) -> dict:
    """The calibration measurement (`profile.calibrate.Measure`): `measure_config_profile` in
    its quick mode, progress on stderr."""
    return measure_config_profile(cfg, device, quick=True, run_dir=run_dir,
                                  log=to_stderr)


def plan_summary(plan: Plan, *, source: str | None = None) -> str:
    """The start-up summary of `plan` (`report.plan_table.plan_summary`) with its costs line.

    Args:
        plan: the plan.
        source: `model.config_path`, printed after the model's name.
    """
    return summary_of(plan, source=source, costs_line=costs_line_of(plan.provenance))
