"""The event simulator against the fluid evaluator on real-scale plans (the seed scenario):
NVMe-heavy MILP and heuristic plans and the MegaTrain rule at every K agree within 1% per
window and per step (docs/execution_model.md, "In-window order")."""

from __future__ import annotations

import pytest

from lazytrain.config import load_config
from lazytrain.planner.build import problem_from_config
from lazytrain.planner.evaluate import evaluate
from lazytrain.sim import disagreements, simulate

SEED = "configs/qwen3.6-27b-h800.yaml"
NVME_HEAVY = ["hardware.hbm_gb=42", "hardware.dram_gb=225", "hardware.nvme_gb=1000",
              "hardware.nvme_read_gb_per_s=1.5", "hardware.nvme_write_gb_per_s=1.0",
              "planner.allow_q8=true", "train.micro_batch=40"]
"""Small HBM and DRAM, a slow NVMe: many checkpoints go to NVMe (the issue's trigger had DRAM
200 GB and micro-batch 58; since the DRAM row also holds the bf16 masters' fp32 optimizer
scratch and HBM the ends' fp32 gradient accumulator, 225 GB and micro-batch 40 are the tight
budgets that still fit; HBM 42 GB, not 40, since the fixed working set counts the head's
softmax and weight gradient, the drain's second gradient and the norms' fp32 activations:
2.8 GB more)."""


@pytest.fixture(scope="module")
def nvme_problem(repo_root, shared_dir):
    return problem_from_config(load_config(repo_root / SEED, NVME_HEAVY))


@pytest.fixture(scope="module")
def seed_problem(repo_root, shared_dir):
    return problem_from_config(load_config(repo_root / SEED))


def _assert_agree(problem, plan) -> None:
    ev, sim = evaluate(problem, plan), simulate(problem, plan)
    assert disagreements(problem, plan, rel_tol=0.01) == []
    assert sim.step_ms == pytest.approx(ev.step_ms, rel=0.01)


@pytest.mark.slow
def test_nvme_heavy_milp_plan_simulates_within_one_percent_of_the_evaluator(nvme_problem):
    pytest.importorskip("highspy")
    from lazytrain.planner.policy import PlannerOptions, plan as plan_problem

    plan = plan_problem(nvme_problem, PlannerOptions(policy="milp", backend="highs",
                                                     time_limit_s=20, lp_bound=False))
    assert plan.tiers.count("nvme") >= 10  # the trigger: an NVMe-heavy plan
    _assert_agree(nvme_problem, plan)
    by_window: dict = {}
    for t in plan.transfers:  # the MILP never reads a boundary in a window that writes it
        by_window.setdefault((t.boundary, t.window), set()).add(t.kind)
    assert not any({"nvme_write", "nvme_read"} <= kinds for kinds in by_window.values())


def test_nvme_heavy_heuristic_plan_simulates_within_one_percent(nvme_problem):
    from lazytrain.planner.heuristics import heuristic_plan

    plan = heuristic_plan(nvme_problem, time_budget_s=2.0)
    assert plan.tiers.count("nvme") >= 5
    assert not plan.provenance.get("violations")  # 8-bit states close the DRAM gap in one move
    _assert_agree(nvme_problem, plan)


def test_planned_nvme_transfers_never_share_a_window_with_their_source(nvme_problem):
    from lazytrain.planner.heuristics import heuristic_plan
    from lazytrain.planner.windows import window_ord

    plan = heuristic_plan(nvme_problem, time_budget_s=2.0)
    L = plan.num_blocks
    ords: dict = {}
    for t in plan.transfers:
        ords.setdefault((t.boundary, t.kind), []).append(window_ord(t.window, L))
    checked = 0
    for (i, kind), got in ords.items():
        src = {"nvme_write": "d2h", "nvme_read": "nvme_write", "h2d": "nvme_read"}.get(kind)
        # four distinct windows in [i, use - 1] (use = 2L - e + 1) make room for the chain;
        # only a boundary at the very end of the model may lack them (then it may share)
        if src and plan.tiers[i] == "nvme" and 2 * L - plan.segment_end_of(i) - i >= 3:
            assert min(got) > max(ords[i, src]), (i, kind)
            checked += 1
    assert checked >= 15


@pytest.mark.parametrize("k", [2, 3, 4, 8])
def test_megatrain_rule_simulates_within_one_percent_of_the_evaluator(seed_problem, k):
    from lazytrain.planner.heuristics import megatrain_plan

    _assert_agree(seed_problem, megatrain_plan(seed_problem, k))
