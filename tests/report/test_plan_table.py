"""The plan texts in report/: throughput arithmetic, the comparison with the fixed-K rules, the
trainer's summary and the capacity tables, against numbers worked out by hand."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from lazytrain.planner.capacity import BatchRow, BatchSearch
from lazytrain.planner.evaluate import build_plan, decisions_from_tiers, evaluate
from lazytrain.planner.heuristics import megatrain_plan
from lazytrain.planner.plan import SolveRecord
from lazytrain.planner.policy import PlannerOptions
from lazytrain.planner.problem import PlanningProblem
from lazytrain.planner.topology import ScalingRow, Topology
from lazytrain.report.capacity import format_batch_table, format_scaling_table, over_dram_hint
from lazytrain.report.plan_table import (format_plan_table, plan_comparison, plan_summary,
                                         recomputed_blocks, throughput)

GB = 10**9


def four_blocks(**kw) -> PlanningProblem:
    """Four equal blocks with room in every budget (1 GB boundaries, 80 GB HBM)."""
    args = dict(fwd_ms=(10.0,) * 4, fwd_grad_ms=(12.0,) * 4, bwd_ms=(20.0,) * 4,
                weight_bytes=(GB,) * 4, grad_bytes=(GB,) * 4, internal_bytes=(GB,) * 4,
                boundary_bytes=(GB,) * 5, params_per_block=(10**9,) * 4, ends_params=0,
                h2d_bytes_per_s=40e9, d2h_bytes_per_s=40e9, duplex_bytes_per_s=80e9,
                nvme_read_bytes_per_s=6e9, nvme_write_bytes_per_s=8e9, hbm_bytes=80 * GB,
                dram_bytes=1000 * GB, nvme_bytes=14_000 * GB, host_bytes_per_param=12.0,
                host_bytes_per_param_q8=6.0, tokens_per_micro_batch=1000,
                model_flops_per_micro_batch=3e12, grad_accum=2)
    args.update(kw)
    return PlanningProblem(**args)


def test_throughput_of_a_step_time_by_hand():
    # 2 micro-batches of 3e12 FLOP and 1000 tokens in 500 ms: 6e12 / 0.5 s = 12 TFLOPS,
    # 2000 tokens / 0.5 s = 4000 tokens/s
    row = throughput(four_blocks(), 500.0)
    assert row == {"step_ms": 500.0, "model_tflops": pytest.approx(12.0),
                   "tokens_per_s": pytest.approx(4000.0)}
    assert throughput(four_blocks(), None) == {"step_ms": None, "model_tflops": None,
                                               "tokens_per_s": None}


def test_recomputed_blocks_are_all_but_the_last_block_of_each_segment():
    plan = SimpleNamespace(segments=lambda: [(0, 3), (3, 4)])  # blocks 0, 1 re-run; 2, 3 not
    assert recomputed_blocks(plan) == [0, 1]


def test_the_comparison_measures_the_speedup_against_the_faster_fixed_k_rule():
    problem = four_blocks()
    plan = megatrain_plan(problem, k=1)  # every boundary stored: no recompute
    report = plan_comparison(problem, plan, PlannerOptions(policy="heuristic", megatrain_k=2))
    rule = evaluate(problem, megatrain_plan(problem, k=2)).step_ms
    fixed = min(evaluate(problem, megatrain_plan(problem, k=k)).step_ms for k in range(1, 5))
    ours = evaluate(problem, plan).step_ms
    assert report["rows"]["megatrain as published (K=2)"]["step_ms"] == pytest.approx(rule)
    assert report["speedup_vs_megatrain"] == pytest.approx(min(rule, fixed) / ours)
    assert report["simulator"]["disagreements"] == []


def test_a_k_max_below_the_rule_s_k_compares_with_the_rule_at_k_max():
    """planner.k_max 1 with the default megatrain_k 4 is a valid milp/heuristic job: the
    MegaTrain row is the rule at the longest segment the job allows (here every boundary
    stored), not a refusal of the whole command."""
    problem = four_blocks(k_max=1)
    plan = megatrain_plan(problem, k=1)
    report = plan_comparison(problem, plan, PlannerOptions(policy="heuristic", megatrain_k=4))
    ours = evaluate(problem, plan).step_ms
    assert report["rows"]["megatrain as published (K=1)"]["step_ms"] == pytest.approx(ours)
    assert report["speedup_vs_megatrain"] == pytest.approx(1.0)


def test_the_summary_prints_the_costs_line_it_is_given_and_none_without_one():
    plan = megatrain_plan(four_blocks(), k=2)
    with_line = plan_summary(plan, source="tiny.json", costs_line="costs: analytic (x)")
    assert with_line.splitlines()[-1] == "  costs: analytic (x)"
    assert "costs:" not in plan_summary(plan)
    assert "3 hbm" in with_line and "2 recompute" in with_line  # boundaries 0, 2, 4 in HBM


def test_the_scaling_table_shows_the_speedup_over_one_rank_and_why_a_count_does_not_fit():
    rows = [ScalingRow(ranks=1, step_ms=2000.0, tokens_per_s=1000.0),
            ScalingRow(ranks=2, step_ms=2500.0, tokens_per_s=1600.0),  # 1600 / 1000 = 1.60x
            ScalingRow(ranks=4, step_ms=None, tokens_per_s=None, dram_budget_bytes=125 * GB,
                       note="DRAM short by 3 GB")]
    lines = format_scaling_table(rows).splitlines()
    assert lines[2].split()[:4] == ["2", "2.50", "1600", "1.60x"]
    assert lines[3] == "    4  no plan fits (DRAM/rank budget 125 GB): DRAM short by 3 GB"


def test_the_hint_offers_shared_masters_only_when_they_are_off():
    on = over_dram_hint(Topology(nproc_per_node=4, gpus_per_node=4))
    off = over_dram_hint(Topology(nproc_per_node=4, gpus_per_node=4, shared_masters=False))
    assert "1/4 of the node's DRAM" in on and "shared_masters" not in on
    assert off.endswith("or dist.shared_masters: true (one master copy per node)")


def test_the_batch_table_names_the_largest_batch_and_an_infeasible_row_its_violation():
    rows = (BatchRow(micro_batch=2, grad_accum=4, global_batch=8, feasible=True, step_ms=100.0,
                     tokens_per_s=50.0, model_tflops=1.5, peak_hbm_bytes=2 * GB,
                     dram_bytes=30 * GB, q8_param_fraction=0.0),
            BatchRow(micro_batch=3, grad_accum=4, global_batch=12, feasible=False,
                     violation="HBM short by 1 GB"))
    search = BatchSearch(max_micro_batch=2, grad_accums=(4,), max_global_batch=8,
                         policy="heuristic", rows=rows, probes=(1, 2, 3))
    lines = format_batch_table(search).splitlines()
    assert lines[0] == ("largest micro-batch that fits: 2 (policy heuristic); largest global "
                        "batch 8 = 2 x 4")
    assert lines[2].split() == ["2", "4", "8", "yes", "100.0", "50.0", "1.5", "2.00", "30.0",
                                "0.00"]
    assert lines[3].split()[:4] == ["3", "4", "12", "no"] and lines[3].endswith("HBM short by 1 GB")


def test_the_summary_and_the_table_print_nvme_bytes_written_per_step_and_per_1000_steps():
    """Boundary 1 (1 GB) on NVMe, 2 micro-batches per step: 2 GB written a step, 2e12 bytes
    (2.00 TB) per 1,000 steps."""
    problem = four_blocks(grad_accum=2)
    plan = build_plan(problem, decisions_from_tiers(problem, ("hbm", "nvme", "hbm", "hbm", "hbm")),
                      solver=SolveRecord(backend="manual"))
    plan = dataclasses.replace(plan, provenance={**plan.provenance, "grad_accum": 2})
    line = "NVMe writes: 2.00 GB per step, 2.00 TB per 1,000 steps"
    assert line in plan_summary(plan)
    report = plan_comparison(problem, plan, PlannerOptions(policy="heuristic"))
    assert report["nvme_write_bytes_per_step"] == 2 * GB
    assert line in format_plan_table(problem, plan, report, costs_line="costs: analytic")
