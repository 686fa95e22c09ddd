"""The duplex rule (docs/execution_model.md, "Duplex sharing"): the evaluator's closed form, the
MILP's linear pieces and the event simulator give one time when H2D and D2H share the cap.

References: hand timelines, and the event simulator's own task-by-task fair sharing
(`sim.events.run` on one H2D and one D2H task), which shares no code with `planner/duplex.py`.
"""

from __future__ import annotations

import random

import pytest

from lazytrain.planner.duplex import duplex_ms, duplex_pieces
from lazytrain.planner.evaluate import build_plan, decisions_from_tiers, evaluate
from lazytrain.sim.events import TaskSpec, run
from test_milp import small_problem
from test_milp_prices_plans import ENGINE_MATRIX, H, _assert_milp_prices_like_the_evaluator

GB = 1e9
SEED = "configs/qwen3.6-27b-h800.yaml"
DUPLEX_BOUND = ["hardware.h2d_gb_per_s=12", "hardware.d2h_gb_per_s=12",
                "hardware.duplex_gb_per_s=16", "train.micro_batch=16"]
"""The shared cap binds: 12 + 12 GB/s of own rates under a 16 GB/s cap."""


def _events_ms(h: float, d: float, rh: float, rd: float, cap: float) -> float:
    """Both copies started at once in the event engine (bytes, bytes/s -> ms)."""
    tasks = [TaskSpec(id=0, name="h", stream="h2d", window=0, work=h),
             TaskSpec(id=1, name="d", stream="d2h", window=0, work=d)]
    runs = run([t for t in tasks if t.work > 0], num_windows=1,
               rates={"compute": 1.0, "host": 1.0, "h2d": rh / 1e3, "d2h": rd / 1e3,
                      "nvme_read": 1.0, "nvme_write": 1.0},
               duplex=max(cap, rh, rd) / 1e3, overlap=True, pools={})
    return max((r.end_ms for r in runs.values()), default=0.0)


def test_hand_timelines():
    # 12/12 GB/s under 16: both at 8 GB/s until the 0.1678 GB offload ends (20.97 ms), then
    # the rest of the 0.7665 GB load alone at 12 GB/s (49.89 ms); the fluid (h + d)/16 = 58.4
    # and h/12 = 63.9 ms are both short of it
    rates = dict(h2d_bytes_per_s=12 * GB, d2h_bytes_per_s=12 * GB, duplex_bytes_per_s=16 * GB)
    assert duplex_ms(0.7665 * GB, 0.1678 * GB, **rates) == pytest.approx(
        0.1678 / 8 * 1e3 + (0.7665 - 0.1678) / 12 * 1e3)
    # 4 GB/s H2D keeps its rate under a 16 GB/s cap; D2H (14 alone) gets 12 while both run:
    # 1 GB of H2D ends at 250 ms, when D2H has moved 3 of its 5 GB; 2 GB left at 14 GB/s
    assert duplex_ms(1 * GB, 5 * GB, h2d_bytes_per_s=4 * GB, d2h_bytes_per_s=14 * GB,
                     duplex_bytes_per_s=16 * GB) == pytest.approx(250.0 + 2 / 14 * 1e3)
    # a cap that does not bind: each direction at its own rate
    assert duplex_ms(1 * GB, 2 * GB, h2d_bytes_per_s=10 * GB, d2h_bytes_per_s=10 * GB,
                     duplex_bytes_per_s=20 * GB) == pytest.approx(200.0)
    # a cap below one direction (a measurement under load) counts as that direction's rate
    assert duplex_ms(1 * GB, 1 * GB, h2d_bytes_per_s=10 * GB, d2h_bytes_per_s=10 * GB,
                     duplex_bytes_per_s=5 * GB) == pytest.approx(200.0)


def test_closed_form_and_linear_pieces_match_the_event_engine():
    rng = random.Random(0)
    for _ in range(400):
        rh, rd = rng.uniform(1, 30) * GB, rng.uniform(1, 30) * GB
        cap = rng.uniform(0.5, 70) * GB
        h, d = rng.choice((0.0, rng.uniform(0, 3))) * GB, rng.choice((0.0, rng.uniform(0, 3))) * GB
        want = _events_ms(h, d, rh, rd, cap)
        got = duplex_ms(h, d, h2d_bytes_per_s=rh, d2h_bytes_per_s=rd, duplex_bytes_per_s=cap)
        assert got == pytest.approx(want, rel=1e-9, abs=1e-9)
        pieces = ((1 / rh, 0.0), (0.0, 1 / rd), *duplex_pieces(rh, rd, cap))
        assert max(a * h + b * d for a, b in pieces) * 1e3 == pytest.approx(want, rel=1e-9,
                                                                            abs=1e-9)


@pytest.mark.parametrize("rates", [(1e4, 1e4, 1.5e4), (4e3, 1.4e4, 1.6e4), (1e4, 1e4, 8e3)],
                         ids=["both_above_half", "one_below_half", "cap_below_one"])
@pytest.mark.parametrize("kind", ["all_dram", "mixed_tiers", "keep_after_recomputed_segment"])
def test_milp_rows_price_duplex_bound_plans_as_the_evaluator(kind, rates):
    pytest.importorskip("highspy")
    rh, rd, cap = (r * 10**7 for r in rates)
    problem = small_problem(L=6, h2d_bytes_per_s=rh, d2h_bytes_per_s=rd, duplex_bytes_per_s=cap,
                            hbm_bytes=10**13, dram_bytes=10**13, nvme_bytes=10**13)
    tiers, keep = ENGINE_MATRIX[kind]
    assert _assert_milp_prices_like_the_evaluator(
        problem, decisions_from_tiers(problem, (*tiers, H, H), keep))


@pytest.mark.slow
def test_duplex_bound_seed_milp_equals_evaluator_equals_simulator(repo_root, shared_dir):
    """The seed model where the cap binds: the MILP's rows price the plan it returns at the
    evaluator's step, and the simulator agrees within 1% in every window and the step (it put
    the MILP plan 3.3% above the evaluator, 64 windows apart, under the fluid duplex term)."""
    pytest.importorskip("highspy")
    from lazytrain.config import load_config
    from lazytrain.planner.build import problem_from_config
    from lazytrain.planner.extract import extract_plan, start_from_plan
    from lazytrain.planner.milp import build_milp
    from lazytrain.planner.plan import SolveRecord
    from lazytrain.planner.solvers import solve
    from lazytrain.sim import disagreements, simulate

    problem = problem_from_config(load_config(repo_root / SEED, DUPLEX_BOUND))
    milp = build_milp(problem, tie_breakers=False)
    res = solve(milp.model, backend="highs", gap=0.005, time_limit_s=60)
    plan = extract_plan(milp, res.values, solver=SolveRecord(backend="highs"))
    ev = evaluate(problem, plan)
    x = start_from_plan(milp, plan)  # the plan in the model's columns, each t[o] at its least
    assert x is not None and milp.step_ms(x) == pytest.approx(ev.step_ms, rel=1e-9)
    assert milp.step_ms(res.values) >= ev.step_ms * (1 - 1e-9)  # the solver's t[o] only add
    assert disagreements(problem, plan, rel_tol=0.01) == []
    assert simulate(problem, plan).step_ms == pytest.approx(ev.step_ms, rel=0.01)
    # the cap binds where a weight load meets an offload: every boundary in DRAM
    L = problem.num_blocks
    offload = build_plan(problem, decisions_from_tiers(problem, ("dram",) * L + ("hbm",)),
                         solver=SolveRecord(backend="manual"))
    assert evaluate(problem, offload).binding_by_window.count("duplex") >= L // 2
    assert disagreements(problem, offload, rel_tol=0.01) == []
