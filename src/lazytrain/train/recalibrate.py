"""A run's measured windows against the cached calibration its plan was made with.

`lazytrain train` plans with this machine's cached calibration (`runtime.calibrate`). One
measured while other jobs loaded the machine holds block times several times too high (a
newcomer's first run: 201 ms per block forward against 20.8 ms quiet, 16.0 s per step
predicted against 4.15 s measured), and every later run would plan with it until `lazytrain
profile --calibrate`. So when a run ends, `recalibrate_from_run` compares the run's own
measured windows (after `SKIP_STEPS` warm-up step) with the problem the plan was made from,
as the online re-planner does (`train.replan.measure_drifts`: the compute of the plan's
windows and the fitted bandwidth per channel), plus the step itself (the median over steps
of the windows' wall time against the evaluator's step). When any of them is off by more than
`planner.drift_threshold`, the cache entry is replaced by the refit (`planner.refit.
refit_profile`: per-kind block times, head and embedding, bandwidths) whose `step_const_ms`
takes up what the refit windows still leave of the measured step (never below 0); the entry
keeps its key fields and records the run in `calibration.refit_from_run`. One line says so.

Left alone: a plan whose costs were not this machine's cache (an explicit
`hardware.profile_path` is the user's file), a cache entry measured again since the plan was
made (its `measured_at` differs), and windows of another plan (a re-plan switched plans).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Callable, Iterable

from lazytrain.atomic import write_json_atomic
from lazytrain.config import RunConfig
from lazytrain.planner.build import rank_problem_from_config
from lazytrain.planner.evaluate import evaluate
from lazytrain.planner.plan import Plan
from lazytrain.planner.refit import PROBLEM_FIELD, refit_profile
from lazytrain.profile.calibrate import config_for_plan
from lazytrain.spec.model import ModelSpec
from lazytrain.train.replan import Drift, measure_drifts

SKIP_STEPS = 1
"""Leading steps of the run left out (the first step's allocator and first-touch costs)."""


def measured_step_ms(records: Iterable[dict]) -> float | None:
    """The median over steps of the sum of every window's wall time (all micro-batches of
    the step, `pre` and `post` included), ms; None without records. The measure of
    `lazytrain report`'s predicted-vs-measured table."""
    per_step: dict[int, float] = {}
    for rec in records:
        step = int(rec.get("step", 0))
        per_step[step] = per_step.get(step, 0.0) + sum(float(w.get("wall_ms") or 0.0)
                                                       for w in rec.get("windows") or ())
    return statistics.median(per_step.values()) if per_step else None


def run_records(records: Iterable[dict], plan: Plan, *, skip_steps: int = SKIP_STEPS
                ) -> list[dict]:
    """The records of `plan` (its digest) after the first `skip_steps` steps."""
    digest = plan.digest()
    return [r for r in records if int(r.get("step", 0)) > skip_steps
            and r.get("plan_id") in (None, digest)]


def recalibrate_from_run(cfg: RunConfig, plan: Plan, records: list[dict], *,
                         run_dir: str | Path = "",
                         log: Callable[[str], None] = lambda msg: None) -> dict | None:
    """Replace the cached calibration `plan` was made with when the run's windows contradict
    it (module docstring).

    Args:
        cfg: the run config (`planner.drift_threshold`, the model and batch shape).
        plan: the plan the records were measured under.
        records: windows.jsonl records of the run (`runtime/instrument.py` schema).
        run_dir: the run's directory (recorded in the cache entry).
        log: the one line saying the cache was replaced.

    Returns:
        The `refit_from_run` record written to the cache entry (when, the run directory, the
        first and last step used, the threshold, every drift as `Drift.to_dict`), or None
        when nothing was replaced.

    Raises:
        OSError: the cache entry cannot be rewritten.
    """
    costs = plan.provenance.get("costs") or {}
    path = Path(costs.get("file") or "")
    if costs.get("source") != "calibrated" or cfg.hardware.profile_path or not path.is_file():
        return None
    try:
        cached = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None  # the next resolve measures it again, with its own warning
    if (cached.get("calibration") or {}).get("measured_at") != costs.get("measured_at"):
        return None  # measured again since this plan was made
    used = run_records(records, plan)
    measured = measured_step_ms(used)
    windows = [w for r in used for w in r.get("windows") or ()]
    if measured is None or not windows:
        return None
    cfg = config_for_plan(cfg, plan.provenance)
    problem = rank_problem_from_config(cfg)
    drifts = measure_drifts(problem, plan, windows)
    drifts.append(Drift(channel="step", planned=evaluate(problem, plan).step_ms,
                        measured=measured))
    threshold = cfg.planner.drift_threshold
    off = [d for d in drifts if abs(d.ratio - 1.0) > threshold]
    if not off:
        return None
    kinds = [b.kind for b in ModelSpec.from_hf_config(cfg.model.config_path,
                                                      name=cfg.model.name).blocks]
    refit = refit_profile(cached, plan, kinds, windows,
                          copies_overlap_compute=problem.copies_overlap_compute)
    write_json_atomic(path, refit)  # the windows' refit, then its step constant
    leftover = measured - evaluate(rank_problem_from_config(cfg), plan).step_ms
    refit["step_const_ms"] = max(0.0, float(refit.get("step_const_ms") or 0.0) + leftover)
    steps = sorted({int(r.get("step", 0)) for r in used})
    record = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "run_dir": str(run_dir), "steps": [steps[0], steps[-1]],
              "threshold": threshold, "drifts": [d.to_dict() for d in drifts]}
    refit["calibration"] = {**cached["calibration"], "refit_from_run": record}
    write_json_atomic(path, refit)
    log(f"calibration: this run's windows contradict the cached calibration ("
        + ", ".join(_drift_text(d) for d in off)
        + f", beyond planner.drift_threshold {threshold}); replaced {path} with their refit "
          f"(steps {steps[0]}-{steps[-1]}), which the next fresh run plans with (a --resume "
          f"keeps its run's plan.json)")
    return record


def _drift_text(d: Drift) -> str:
    """`compute 4210 ms (planned 1050)` or `h2d 1030.0 GB/s (planned 25.0)`: the measured and
    planned figures in their units (a ratio of two near-zero copy times says nothing)."""
    if d.channel in PROBLEM_FIELD:
        return f"{d.channel} {d.measured / 1e9:.1f} GB/s (planned {d.planned / 1e9:.1f})"
    return f"{d.channel} {d.measured:.0f} ms (planned {d.planned:.0f})"
