"""Where a plan is host-bound: the host rates it assumed and the windows its host work sets.

Owns `host_record`, the plan provenance `host` entry that `planner/evaluate.build_plan`
stores and the plan summary and table print (`report/plan_table.py`): the two host rates the
plan was priced at, in the run's dtypes, and the windows whose host work (weight conversion into
staging plus gradient accumulation, `window_time.host_ms`) is their largest term. A GPU run of
such a window waits on the host threads with the GPU idle; only more tokens per micro-batch
(or a weight path without host work) hides it. Knows no torch.
"""

from __future__ import annotations

from lazytrain.planner.plan import WindowRecord
from lazytrain.planner.problem import PlanningProblem
from lazytrain.planner.window_time import window_terms_ms

HOST_TIE = 1e-9
"""Relative tolerance of "host is the largest term" (the evaluator's `binding_term` ties)."""


def host_bound_windows(problem: PlanningProblem, windows: tuple[WindowRecord, ...],
                       host_ms_by_window, binding_by_window) -> list[str]:
    """Names of the windows whose host time is their largest term, in window order.

    On a GPU the window time is the max of its terms, so these are the windows whose binding
    term (`window_time.binding_term`) is "host". On a CPU the terms add up (binding "sum"); a
    window counts when its host time is at least each other term (compute, each channel), i.e.
    the one a GPU would wait on. Source: docs/execution_model.md, "Window time", "Host work".

    Args:
        problem: the problem the windows were evaluated for.
        windows: the evaluator's window records (compute ms, channel bytes).
        host_ms_by_window: host time of each window, ms (`Evaluation.host_ms_by_window`).
        binding_by_window: the binding term of each window (`Evaluation.binding_by_window`).
    """
    out = []
    for w, host, binding in zip(windows, host_ms_by_window, binding_by_window):
        if host <= 0:
            continue
        if binding == "sum":
            terms = window_terms_ms(problem, w.compute_ms, w.h2d_bytes, w.d2h_bytes,
                                    w.nvme_read_bytes, w.nvme_write_bytes, host)
            if host >= max(terms.values()) * (1 - HOST_TIE):
                out.append(w.name)
        elif binding == "host":
            out.append(w.name)
    return out


def host_record(problem: PlanningProblem, windows: tuple[WindowRecord, ...],
                host_ms_by_window, binding_by_window) -> dict:
    """Plan provenance `host`: {"convert_bytes_per_s", "accumulate_bytes_per_s" (the assumed
    host rates, bytes/s, 0: not modelled), "host_ms" (host time per micro-batch summed over
    the windows, ms), "bound_windows" (`host_bound_windows`)}."""
    return {"convert_bytes_per_s": problem.host_convert_bytes_per_s,
            "accumulate_bytes_per_s": problem.host_accumulate_bytes_per_s,
            "host_ms": float(sum(host_ms_by_window)),
            "bound_windows": host_bound_windows(problem, windows, host_ms_by_window,
                                                binding_by_window)}
