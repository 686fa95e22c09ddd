"""The planner's choice of weight paths: which path vector a problem is planned with.

Owns `choose_weight_paths`: among `weight_paths.candidate_paths` (host-free vectors first), the
one whose heuristic plan fits and is predicted fastest; masters already in the compute dtype
take the pinned masters without a search (no memory, no host work, the same H2D bytes: never
slower). The activation plan is then made on the chosen problem by the policy: the heuristic
sees each block's path as constants (its H2D bytes, host bytes and the paths' HBM and DRAM in
the fixed pools) and compares only the candidates, not every per-block mix; the MILP starts
from the heuristic's plan and chooses every block's path (`planner/milp_paths.py`).

Pure Python; no solver, no torch. Source: docs/execution_model.md, "Weight paths".
"""

from __future__ import annotations

from lazytrain.planner.heuristics import heuristic_plan
from lazytrain.planner.problem import PlanningProblem
from lazytrain.planner.weight_paths import candidate_paths, with_weight_paths

CHOICE_STEPS = 200
"""Heuristic steps per candidate path vector (deterministic, like `planner.deterministic`)."""


def choose_weight_paths(problem: PlanningProblem) -> PlanningProblem:
    """`problem` with the weight paths the planner chooses (module docstring); unchanged when
    `problem.weight_path_choice` is False (a hand-made problem) or its paths are already set.

    Returns:
        The problem to plan (`weight_paths.with_weight_paths` applied). When no candidate's
        heuristic plan fits, every block host_convert (the caller's capacity errors follow).
    """
    if not problem.weight_path_choice or problem.weight_paths:
        return problem
    candidates = candidate_paths(problem)
    if problem.master_bytes_ratio == 1:
        return with_weight_paths(problem, candidates[0])
    best: tuple[float, PlanningProblem] | None = None
    for paths in candidates:
        cand = with_weight_paths(problem, paths)
        plan = heuristic_plan(cand, max_steps=CHOICE_STEPS)
        if plan.provenance.get("violations") or plan.predicted is None:
            continue
        if best is None or plan.predicted.step_ms < best[0] * (1 - 1e-9):
            best = (plan.predicted.step_ms, cand)
    return best[1] if best is not None else with_weight_paths(problem, ())
