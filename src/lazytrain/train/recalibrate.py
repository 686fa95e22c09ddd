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
takes up what the refit windows still leave of the measured step (never below 0; a step
shorter still lowers the fixed window cost `window_overhead_ms`, `fit_step_terms`); the entry
keeps its key fields and records the run in `calibration.refit_from_run`; its `measured_at`
becomes the refit's time (the date the costs line prints follows the file's content; the
replaced measurement's date stays in the record as `replaced_measured_at`). One line says so.

Every figure of that line is per step, as the step's: compute is the median over steps of the
step's measured compute (its windows' `compute_ms`, each never above its window's wall time,
`runtime/instrument.py`), so it never exceeds the median step's wall time; the planned
compute is the plan's per step.

A copy channel's fitted rate is refused (not compared, not written; the cache keeps its rate,
one `note:` line says so) when the run moved fewer than `MIN_REFIT_BYTES` on it (a few
kilobytes of a tiny model's weights time per-copy overheads and scheduler noise, not the
link: 0.0 GB/s was fitted on a loaded 2-core box) or the rate is below the channel's
`MIN_PLAUSIBLE_GB_PER_S` (far below any real link or drive), so a disturbed run cannot write
a rate of ~0 GB/s that every later run would plan with.

Left alone: a plan whose costs were not this machine's cache (an explicit
`hardware.profile_path` is the user's file), a cache entry measured again since the plan was
made (its `measured_at` differs), windows of another plan (a re-plan switched plans), and a
GRPO run (`train.method: grpo`: its micro-batches hold fewer rows and tokens than the plan's
shape, so its windows would refit the cache too fast; one `note:` line says so).
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
from lazytrain.planner.problem import PlanningProblem
from lazytrain.planner.refit import PROBLEM_FIELD, PROFILE_KEY, refit_profile
from lazytrain.profile.calibrate import config_for_plan
from lazytrain.spec.model import ModelSpec
from lazytrain.train.replan import Drift, measure_drifts

SKIP_STEPS = 1
"""Leading steps of the run left out (the first step's allocator and first-touch costs)."""
MIN_REFIT_BYTES = 64 * 2**20
"""Bytes a copy channel must have moved over the measured windows (all steps used) for its
fitted rate to replace the cached one: 64 MiB take >= 5 ms even at 12 GB/s, well above a
timer's and a copy call's overheads."""
MIN_PLAUSIBLE_GB_PER_S = {"h2d": 0.5, "d2h": 0.5, "nvme_read": 0.05, "nvme_write": 0.05}
"""Per copy channel, the least fitted rate (GB/s) taken as a measurement of the link: a host
memcpy or the slowest PCIe link moves several GB/s and a spinning disk ~0.1 GB/s, so anything
below is a stalled run, not the machine."""


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


def step_compute_ms(records: Iterable[dict], names: set[str]) -> float | None:
    """The median over steps of the step's measured compute, ms: the sum of `compute_ms` of
    its windows named in `names` (the plan's, `pre` and `post` not among them), all
    micro-batches; None without any. Each window's compute is at most its wall time, so this is
    at most `measured_step_ms` of the same records."""
    per_step: dict[int, float] = {}
    for rec in records:
        for w in rec.get("windows") or ():
            if w.get("name") in names and w.get("compute_ms") is not None:
                step = int(rec.get("step", 0))
                per_step[step] = per_step.get(step, 0.0) + float(w["compute_ms"])
    return statistics.median(per_step.values()) if per_step else None


def refused_rates(drifts: Iterable[Drift], windows: Iterable[dict]) -> dict[str, str]:
    """The copy channels whose fitted rate is no measurement of the link (module docstring):
    channel -> why ("fitted from 1.2 MB, under the 67.1 MB needed" or "0.01 GB/s is below
    the plausible 0.5 GB/s")."""
    moved = dict.fromkeys(PROBLEM_FIELD, 0.0)
    for w in windows:
        for ch in moved:
            moved[ch] += float((w.get("bytes") or {}).get(ch) or 0.0)
    out = {}
    for d in drifts:
        if d.channel not in PROBLEM_FIELD:
            continue
        if moved[d.channel] < MIN_REFIT_BYTES:
            out[d.channel] = (f"fitted from {moved[d.channel] / 1e6:.1f} MB, under the "
                              f"{MIN_REFIT_BYTES / 1e6:.1f} MB needed")
        elif d.measured / 1e9 < MIN_PLAUSIBLE_GB_PER_S[d.channel]:
            out[d.channel] = (f"{d.measured / 1e9:.3g} GB/s is below the plausible "
                              f"{MIN_PLAUSIBLE_GB_PER_S[d.channel]} GB/s")
    return out


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
        first and last step used, the threshold, every drift used as `Drift.to_dict`, the
        refused channels with why, the replaced `measured_at`), or None when nothing was
        replaced.

    Raises:
        OSError: the cache entry cannot be rewritten.
    """
    costs = plan.provenance.get("costs") or {}
    path = Path(costs.get("file") or "")
    if costs.get("source") != "calibrated" or cfg.hardware.profile_path or not path.is_file():
        return None
    if cfg.train.method == "grpo":
        log("note: calibration: a GRPO run's micro-batches are cut to their rollouts (fewer "
            "rows, shorter than data.seq_len), so its windows measure less work than planned; "
            "the cached calibration is left as it is")
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
    steps = sorted({int(r.get("step", 0)) for r in used})
    predicted = evaluate(problem, plan)
    drifts = []
    for d in measure_drifts(problem, plan, windows):
        if d.channel == "compute":  # per step, as the step's (module docstring)
            d = Drift(channel="compute", planned=d.planned / len(steps),
                      measured=step_compute_ms(used, {w.name for w in predicted.windows}))
        drifts.append(d)
    drifts.append(Drift(channel="step", planned=predicted.step_ms, measured=measured))
    threshold = cfg.planner.drift_threshold
    refused = refused_rates(drifts, windows)
    off = [d for d in drifts if abs(d.ratio - 1.0) > threshold]
    if any(d.channel in refused for d in off):
        log("note: calibration: this run's " + "; ".join(
            f"{_drift_text(d)} ({refused[d.channel]})" for d in off if d.channel in refused)
            + " not used: the cache keeps its rate")
    drifts = [d for d in drifts if d.channel not in refused]
    off = [d for d in off if d.channel not in refused]
    if not off:
        return None
    kinds = [b.kind for b in ModelSpec.from_hf_config(cfg.model.config_path,
                                                      name=cfg.model.name).blocks]
    refit = refit_profile(cached, plan, kinds, windows,
                          copies_overlap_compute=problem.copies_overlap_compute)
    _keep_cached_rates(refit, cached, refused)
    write_json_atomic(path, refit)  # the windows' refit, then its step terms
    fit_step_terms(refit, rank_problem_from_config(cfg), plan, measured)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    record = {"at": now, "run_dir": str(run_dir), "steps": [steps[0], steps[-1]],
              "threshold": threshold, "drifts": [d.to_dict() for d in drifts],
              "refused": refused,
              "replaced_measured_at": cached["calibration"].get("measured_at")}
    refit["calibration"] = {**cached["calibration"], "measured_at": now,
                            "refit_from_run": record}
    write_json_atomic(path, refit)
    log(f"calibration: this run's windows contradict the cached calibration ("
        + ", ".join(_drift_text(d) for d in off)
        + f", beyond planner.drift_threshold {threshold}); replaced {path} with their refit "
          f"(steps {steps[0]}-{steps[-1]}), which the next fresh run plans with (a --resume "
          f"keeps its run's plan.json)")
    return record


def fit_step_terms(refit: dict, problem: PlanningProblem, plan: Plan, measured: float) -> None:
    """Set `refit`'s `step_const_ms` (and, where needed, `window_overhead_ms`) so that `plan`
    under `problem` (the refit's problem) predicts the `measured` step, ms.

    The constant takes up what the refit windows leave of the measured step. A step shorter
    than the prediction with a constant of 0 means the engine's fixed window cost was measured
    high (under load: 37 ms per window on a busy 2-core box against ~1 ms idle, which alone
    predicted 874 ms for a 65 ms step, so every run replaced the entry again): it shrinks by
    the rest over the times a step pays it (the evaluator's slope in it), never below 0.
    """
    predicted = evaluate(problem, plan).step_ms
    const = float(refit.get("step_const_ms") or 0.0) + measured - predicted
    refit["step_const_ms"] = max(0.0, const)
    overhead = problem.window_overhead_ms
    if const < 0 < overhead:
        bare = evaluate(problem.replace(window_overhead_ms=0.0), plan).step_ms
        paid = (predicted - bare) / overhead  # windows per step paying it
        if paid > 0:
            refit["window_overhead_ms"] = max(0.0, overhead + const / paid)


def _keep_cached_rates(refit: dict, cached: dict, refused: Iterable[str]) -> None:
    """Put the cached rate (GB/s) of every refused channel back into `refit` (none cached:
    none written, the preset's stays)."""
    bandwidths, old = refit.setdefault("bandwidths", {}), cached.get("bandwidths") or {}
    for ch in refused:
        key = PROFILE_KEY[ch]
        if key in old:
            bandwidths[key] = old[key]
        else:
            bandwidths.pop(key, None)


def _drift_text(d: Drift) -> str:
    """`compute 4210 ms (planned 1050)` or `h2d 1030.0 GB/s (planned 25.0)`: the measured and
    planned figures in their units (a ratio of two near-zero copy times says nothing)."""
    if d.channel in PROBLEM_FIELD:
        return f"{d.channel} {d.measured / 1e9:.1f} GB/s (planned {d.planned / 1e9:.1f})"
    return f"{d.channel} {d.measured:.0f} ms (planned {d.planned:.0f})"
