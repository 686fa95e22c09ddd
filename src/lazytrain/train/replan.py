"""Online re-planning: detect bandwidth / compute drift from measured windows and switch plans.

Every `planner.replan_every_steps` steps the measured windows of the steps since the last check
(`StepStats.windows`, schema in `runtime/instrument.py`) are compared with what the plan assumed:
- per channel (h2d, d2h, nvme_read, nvme_write): the effective bytes/s fitted from bytes and
  waits (`planner.refit.fit_bandwidths`) against the problem's bandwidth;
- compute: the measured compute of the plan's windows against the problem's compute for them.
A quantity drifts when |measured / planned - 1| > `planner.drift_threshold`; when the same
quantity drifts in `planner.drift_patience_steps` consecutive checks, the problem is updated with
the measured values (`planner.refit.problem_with_rates`) and re-solved off the training thread.
When the solve is done, at the next step boundary, the new plan replaces the old one if it is
predicted faster *under the measured problem* (`Engine.set_plan`; weights, optimizer, RNG and
data position are untouched), and one `{"event": "replan", ...}` line goes to metrics.jsonl.

Where the solve runs: a worker thread (`ThreadPoolExecutor`, one worker). HiGHS's solve runs in
C++ without the GIL (highspy runs it on its own thread for `startSolve`; the compiled `run`
releases the interpreter), so the training thread keeps running; only the MILP's Python build
and the heuristic warm start hold the GIL, for a fraction of the solve. A spawned process would
isolate even those, but costs an interpreter start and the planner's imports (seconds on a
2-core machine) per re-plan and a pickled problem each way; for one solve per drift event the
thread is the cheaper choice. (SCIP through PySCIPOpt also solves in C.)

Warm start: the better (by predicted step under the new problem) of the heuristic plan and the
current plan's own decisions re-evaluated under the new problem; the MILP starts from it and the
better of solver and warm start is kept: `planner.policy.plan(problem, options,
warm_start=current)`, the entry every caller plans through.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from lazytrain.planner import policy
from lazytrain.planner.evaluate import evaluate
from lazytrain.planner.plan import Plan
from lazytrain.planner.policy import PlannerOptions
from lazytrain.planner.problem import PlanningProblem
from lazytrain.planner.refit import CHANNELS, PROBLEM_FIELD, fit_bandwidths, problem_with_rates

MIN_GAIN = 0.01
"""A new plan replaces the running one only if predicted at least 1% faster (under the measured
problem): a switch costs nothing in state, but flapping between equal plans helps no one."""


@dataclass(kw_only=True, frozen=True, slots=True)
class Drift:
    """One quantity off the plan's assumption."""

    channel: str
    """h2d | d2h | nvme_read | nvme_write | compute."""
    planned: float
    """Assumed value: bytes/s for a channel, ms of compute over the measured windows."""
    measured: float
    """Measured value, same unit."""

    @property
    def ratio(self) -> float:
        """measured / planned (a channel at 0.5 runs at half the assumed bandwidth)."""
        return self.measured / self.planned if self.planned > 0 else float("inf")

    def to_dict(self) -> dict:
        return {"channel": self.channel, "planned": self.planned, "measured": self.measured,
                "ratio": self.ratio}


def measure_drifts(problem: PlanningProblem, plan: Plan, windows: list[dict]) -> list[Drift]:
    """Measured vs assumed per channel and for compute (every quantity with samples).

    Args:
        problem: the assumptions (bandwidths, per-block times).
        plan: the running plan (what each window computes).
        windows: window records of one or more steps (pre/post are ignored for compute).
    """
    rates = fit_bandwidths(windows, copies_overlap_compute=problem.copies_overlap_compute)
    out = [Drift(channel=ch, planned=getattr(problem, PROBLEM_FIELD[ch]), measured=r)
           for ch, r in rates.items() if r is not None]
    planned_w = {w.name: w.compute_ms for w in evaluate(problem, plan).windows}
    meas = [(float(w["compute_ms"]), planned_w[w["name"]]) for w in windows
            if w.get("name") in planned_w and w.get("compute_ms") is not None]
    if meas:
        out.append(Drift(channel="compute", planned=sum(p for _, p in meas),
                         measured=sum(m for m, _ in meas)))
    return out


class DriftMonitor:
    """Counts consecutive drifting checks per quantity.

    Args:
        threshold: relative drift, |measured / planned - 1| > threshold (0.15 = 15%).
        patience: consecutive drifting checks before a re-plan is due, >= 1.
    """

    def __init__(self, *, threshold: float, patience: int) -> None:
        if threshold <= 0 or patience < 1:
            raise ValueError(f"drift threshold must be > 0 and patience >= 1; got {threshold}, "
                             f"{patience}")
        self.threshold, self.patience = threshold, patience
        self.streak: dict[str, int] = {}

    def check(self, drifts: list[Drift]) -> list[Drift]:
        """Update the streaks; returns the drifts whose streak reached `patience` (else [])."""
        seen = set()
        due = []
        for d in drifts:
            seen.add(d.channel)
            if abs(d.ratio - 1.0) > self.threshold:
                self.streak[d.channel] = self.streak.get(d.channel, 0) + 1
                if self.streak[d.channel] >= self.patience:
                    due.append(d)
            else:
                self.streak[d.channel] = 0
        for ch in set(self.streak) - seen:
            self.streak[ch] = 0
        return due

    def reset(self) -> None:
        self.streak.clear()


def measured_problem(problem: PlanningProblem, drifts: list[Drift]) -> PlanningProblem:
    """`problem` with every drifted quantity replaced by its measurement."""
    rates = {d.channel: d.measured for d in drifts if d.channel in CHANNELS}
    scale = next((d.ratio for d in drifts if d.channel == "compute"), 1.0)
    return problem_with_rates(problem, rates, compute_scale=scale)


def resolve(problem: PlanningProblem, current: Plan,
            options: PlannerOptions | None = None) -> Plan:
    """A plan for the (measured) problem, warm-started from the current plan (module docstring):
    `planner.policy.plan` with `warm_start=current` and no LP bound.

    Args:
        problem: the measured problem.
        current: the running plan.
        options: the run's planner options (`planner.policy.planner_options`; None: the
            config's defaults). Policies other than milp/heuristic re-run their rule (they
            ignore measurements).

    Raises:
        PlanInfeasibleError: (milp) no plan fits the measured problem's budgets.
    """
    opts = (options or PlannerOptions()).replace(lp_bound=False)
    return policy.plan(problem, opts, warm_start=current)


@dataclass(kw_only=True, frozen=True, slots=True)
class Switch:
    """A re-plan ready to run: the new plan and the metrics.jsonl event describing it."""

    plan: Plan
    event: dict


class OnlineReplanner:
    """Checks drift every `every` steps, re-solves in a worker thread, hands back switches.

    Args:
        problem: the assumptions the running plan was made under.
        plan: the running plan.
        every: check every N steps (>= 1).
        threshold, patience: `DriftMonitor`.
        solve: `(problem, current_plan) -> Plan` (default: `resolve` with the config's
            default options, `PlannerOptions()`).
        log: one-line messages.
    """

    def __init__(self, problem: PlanningProblem, plan: Plan, *, every: int, threshold: float,
                 patience: int, solve: Callable[[PlanningProblem, Plan], Plan] | None = None,
                 log: Callable[[str], None] = lambda msg: None) -> None:
        if every < 1:
            raise ValueError(f"planner.replan_every_steps must be >= 1 here; got {every}")
        self.problem, self.plan, self.every = problem, plan, every
        self.monitor = DriftMonitor(threshold=threshold, patience=patience)
        self.solve = solve or (lambda p, cur: resolve(p, cur))
        self.log = log
        self.windows: list[dict] = []
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lazytrain-replan")
        self.pending: tuple[Future, PlanningProblem, list[Drift], int, float] | None = None

    def after_step(self, step: int, records) -> Switch | None:
        """Feed one step's window records (per micro-batch); returns a switch when one is ready.

        Called at a step boundary on the training thread; never blocks on the solver.
        """
        for rec in records or ():
            self.windows.extend(rec.get("windows") or [])
        switch = self._collect(step)
        if switch is not None or self.pending is not None or step % self.every:
            return switch
        windows, self.windows = self.windows, []
        due = self.monitor.check(measure_drifts(self.problem, self.plan, windows))
        if due:
            target = measured_problem(self.problem, due)
            self.log("re-plan: " + ", ".join(f"{d.channel} at {d.ratio:.2f}x of plan"
                                             for d in due))
            fut = self.pool.submit(self.solve, target, self.plan)
            self.pending = (fut, target, due, step, time.perf_counter())
        return None

    def _collect(self, step: int) -> Switch | None:
        if self.pending is None or not self.pending[0].done():
            return None
        fut, target, due, asked_at, t0 = self.pending
        self.pending = None
        self.monitor.reset()
        new = fut.result()
        old_now = evaluate(target, self.plan).step_ms  # the running plan under the measurements
        event = {"event": "replan", "step": step, "checked_at_step": asked_at,
                 "reason": [d.to_dict() for d in due],
                 "old_predicted_step_ms": self.plan.predicted.step_ms if self.plan.predicted
                 else None,
                 "old_predicted_step_ms_measured": old_now,
                 "new_predicted_step_ms": new.predicted.step_ms,
                 "solve_s": time.perf_counter() - t0,
                 "backend": new.solver.backend if new.solver else None,
                 "tiers_before": _tier_counts(self.plan), "tiers_after": _tier_counts(new)}
        self.problem = target
        if new.predicted.step_ms > old_now * (1 - MIN_GAIN):
            event["switched"] = False
            self.log(f"re-plan at step {step}: kept the running plan (new {new.predicted.step_ms:.1f}"
                     f" ms vs {old_now:.1f} ms predicted)")
            return Switch(plan=self.plan, event=event)
        event["switched"] = True
        new = dataclasses.replace(new, provenance={**new.provenance, "replanned_at_step": step})
        self.plan = new
        self.log(f"re-plan at step {step}: switched ({old_now:.1f} -> "
                 f"{new.predicted.step_ms:.1f} ms predicted)")
        return Switch(plan=new, event=event)

    def close(self) -> None:
        """Stop the worker (a running solve finishes within its time limit, unused)."""
        self.pool.shutdown(wait=False, cancel_futures=True)


def _tier_counts(plan: Plan) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in plan.tiers:
        out[t] = out.get(t, 0) + 1
    return out
