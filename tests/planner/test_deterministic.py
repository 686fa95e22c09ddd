"""`planner.deterministic`: node and step limits instead of wall-clock limits, so the same input
gives the same plan JSON however busy the machine is; and the step terms every plan records."""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys

import pytest

from lazytrain.config import PlannerConfig
from lazytrain.planner.evaluate import build_plan, decisions_from_tiers
from lazytrain.planner.plan import SolveRecord
from lazytrain.planner.policy import PlannerOptions, plan, planner_options, solver_limits
from test_milp import small_problem

pytest.importorskip("highspy")

BUSY_PROCESSES = 2
"""Busy loops started beside the second solve: one per core of the 2-core CI machine."""


@contextlib.contextmanager
def busy_cpu(n: int = BUSY_PROCESSES):
    """`n` processes spinning on the CPU while the block runs (killed after it)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_deterministic_options_replace_the_time_limit_by_a_node_limit():
    """The config key reaches the options, and the solver limits become 50 nodes per second of
    time_limit_s with no time limit: 0.2 s -> 10 nodes, inf s."""
    opts = planner_options(PlannerConfig(deterministic=True, time_limit_s=0.2))
    assert opts.deterministic is True
    assert solver_limits(opts) == {"time_limit_s": math.inf, "node_limit": 10}
    assert solver_limits(opts.replace(deterministic=False)) == {"time_limit_s": 0.2,
                                                               "node_limit": None}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["highs", "scip"])
def test_deterministic_plan_json_is_byte_identical_on_a_busy_machine(backend):
    """Two plans of one 8-block problem, the second with both cores busy, write the same bytes.
    The node limit (0.02 s -> 1 node, at gap 0) stops the search before it proves optimality,
    so the answer is where the limit stopped it (with a wall-clock limit that point moves with
    the load)."""
    if backend == "scip":
        pytest.importorskip("pyscipopt")
    problem = small_problem(L=8)
    opts = PlannerOptions(backend=backend, time_limit_s=0.02, gap=0.0, deterministic=True)
    quiet = plan(problem, opts)
    with busy_cpu():
        loaded = plan(problem, opts)
    assert "node_limit" in quiet.solver.status
    assert quiet.solver.solve_s == 0.0
    assert loaded.to_json() == quiet.to_json()


def test_highs_node_limit_is_reported_as_node_limit():
    """HiGHS says "solution limit reached" when mip_max_nodes stops it; that is our node_limit
    (it was "error"), with the incumbent kept."""
    from lazytrain.planner.milp import build_milp
    from lazytrain.planner.solvers import solve

    milp = build_milp(small_problem(L=8))
    res = solve(milp.model, backend="highs", time_limit_s=math.inf, gap=0.0, node_limit=1)
    assert res.status == "node_limit"
    assert res.values is not None


@pytest.mark.parametrize("overhead_ms", [0.0, 0.5])
def test_plan_records_the_step_terms_of_its_problem(overhead_ms):
    """provenance["step_terms"] holds the problem's window overhead, step constant and embedding
    time as given (small_problem: const 3 ms, embed 1 ms), so a plan can be re-summed without
    its profile file."""
    problem = small_problem(window_overhead_ms=overhead_ms)
    tiers = ("hbm",) * (problem.num_blocks + 1)
    p = build_plan(problem, decisions_from_tiers(problem, tiers),
                   solver=SolveRecord(backend="manual"))
    assert p.provenance["step_terms"] == {"window_overhead_ms": overhead_ms,
                                          "step_const_ms": 3.0, "embed_ms": 1.0}
