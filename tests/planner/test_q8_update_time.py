"""The 8-bit AdamW update's extra time (docs/execution_model.md, "Host work"): measured by the
profiler, carried by the planning problem, charged once per step on the optimizer tail for every
block in `q8_blocks`, identically by the evaluator, the MILP and the simulator.

References: hand-computed step differences; the MILP and the simulator against the evaluator.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from lazytrain.planner.evaluate import build_plan, decisions_from_tiers, evaluate
from lazytrain.planner.plan import SolveRecord
from lazytrain.sim import simulate
from test_milp import small_problem

MANUAL = SolveRecord(backend="manual")
TIERS = ("hbm", "recompute", "dram", "hbm", "recompute", "hbm", "hbm")


def _problem(**kw):
    # 6 blocks of 1e8 parameters (test_milp.small_problem), grad_accum 2
    return small_problem(L=6, allow_q8=True, q8_update_ms_per_gparam=400.0, **kw)


def test_each_8_bit_block_adds_its_update_time_once_per_step_by_hand():
    p = _problem()
    plain = decisions_from_tiers(p, TIERS)
    q8 = dataclasses.replace(plain, q8_blocks=(1, 4))
    # 2 blocks x 1e8 params x 400 ms per 1e9 = 80 ms, once per step (not per micro-batch)
    assert evaluate(p, q8).step_ms - evaluate(p, plain).step_ms == pytest.approx(80.0)
    assert evaluate(p, q8).q8_update_ms == pytest.approx(80.0)
    assert [w.time_ms for w in evaluate(p, q8).windows] == [
        w.time_ms for w in evaluate(p, plain).windows]  # no window changes
    assert evaluate(p.replace(q8_update_ms_per_gparam=0.0), q8).step_ms == pytest.approx(
        evaluate(p, plain).step_ms)


def test_the_default_is_the_reference_server_figure():
    # (10 - 1) x 28 B / 230.4 GB/s per parameter = 1.09375 ms per 1e6 parameters
    assert small_problem(L=2).q8_update_ms_per_gparam == pytest.approx(1093.75)
    with pytest.raises(ValueError, match="q8_update_ms_per_gparam must be >= 0"):
        small_problem(L=2, q8_update_ms_per_gparam=-1.0)


def test_the_simulator_charges_the_same_tail():
    p = _problem()
    plan = build_plan(p, dataclasses.replace(decisions_from_tiers(p, TIERS), q8_blocks=(0, 5)),
                      solver=MANUAL)
    sim, plain = simulate(p, plan), simulate(p, dataclasses.replace(plan, q8_blocks=()))
    assert sim.step_ms - plain.step_ms == pytest.approx(80.0)
    assert sim.q8_tail_ms == pytest.approx(80.0)
    assert sim.q8_tail_ms == pytest.approx(evaluate(p, plan).q8_update_ms)


def test_milp_objective_is_the_evaluator_step_with_8_bit_blocks():
    """DRAM too small for the fp32 states of every block: the plan needs 8-bit moments, and the
    model's objective (less its penalties) must be the evaluator's step of the plan it returns,
    the update time included; a costlier update makes it pick no more 8-bit blocks than needed."""
    pytest.importorskip("highspy")
    from lazytrain.planner.extract import extract_plan
    from lazytrain.planner.milp import build_milp
    from lazytrain.planner.solvers import solve

    # states 12 B x (6e8 + 1e7) = 7.32e9 B; 8-bit blocks save 2 B/param = 0.2e9 B each; the
    # budget leaves 0.3e9 B short of fp32 everywhere: two 8-bit blocks are the fewest that fit
    p = _problem(q8_penalty_ms_per_gparam=0.0, host_bytes_per_param_q8=10.0,
                 dram_bytes=int(12 * (6e8 + 1e7)) + 10 * 10**7 - 3 * 10**8)
    milp = build_milp(p, tie_breakers=False)
    res = solve(milp.model, backend="highs", gap=1e-9, time_limit_s=60)
    assert res.status == "optimal"
    plan = extract_plan(milp, res.values, solver=MANUAL)
    assert len(plan.q8_blocks) == 2 and evaluate(p, plan).q8_update_ms == pytest.approx(80.0)
    assert milp.step_ms(res.values) == pytest.approx(evaluate(p, plan).step_ms, rel=1e-7)
    assert res.objective == pytest.approx(milp.step_ms(res.values), rel=1e-9)


def test_profile_rates_become_the_problem_figure(tmp_path, repo_root):
    from lazytrain.planner.build import build_problem
    from lazytrain.config import load_config
    from lazytrain.spec.costs import profile_costs, q8_update_ms_per_gparam
    from lazytrain.spec.hardware import PRESETS
    from lazytrain.spec.model import ModelSpec

    # 8-bit 35 ms, fp32 3 ms per 1e6 parameters: 32 ms per 1e6 = 32000 ms per 1e9
    host = {"master_dtype": "fp32", "optimizer_ms_per_mparam": 3.0,
            "optimizer_q8_ms_per_mparam": 35.0}
    assert q8_update_ms_per_gparam(host) == pytest.approx(32000.0)
    assert q8_update_ms_per_gparam({"optimizer_ms_per_mparam": 3.0}) is None
    assert q8_update_ms_per_gparam({"optimizer_ms_per_mparam": 3.0,
                                    "optimizer_q8_ms_per_mparam": 2.0}) == 0.0
    model = ModelSpec.from_hf_config(TINY)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({
        "version": 1, "seq_len": 8, "micro_batch": 2, "compute_dtype": "fp32",
        "model_config_sha256": model.config_sha256, "host": host,
        "block_kinds": {"dense": {"fwd_ms": 1.0, "fwd_grad_ms": 1.5, "bwd_ms": 2.0}}}))
    costs = profile_costs(model, path, hw=PRESETS["cpu"], seq_len=8, micro_batch=2,
                          compute_dtype="fp32")
    assert costs.q8_update_ms_per_gparam == pytest.approx(32000.0)
    cfg = load_config(repo_root / "configs/tiny-llama-cpu.yaml",
                      ["data.seq_len=8", "train.micro_batch=2", "train.compute_dtype=fp32",
                       "train.master_dtype=fp32"])
    problem = build_problem(model, PRESETS["cpu"], cfg, costs=costs)
    assert problem.q8_update_ms_per_gparam == pytest.approx(32000.0)


TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "vocab_size": 256}


@pytest.mark.parametrize("update_ms", [1.0, 1e4], ids=["cheap_update", "costly_update"])
def test_the_heuristic_weighs_the_update_time_like_the_evaluator(update_ms):
    """DRAM holds the fp32 states exactly: a DRAM-tier checkpoint needs 8-bit blocks, NVMe at
    25 GB/s holds every boundary and hides under the windows. With the penalty at 1 ms per 1e9
    parameters, the update time alone decides: a cheap update frees DRAM (8-bit blocks), a
    costly one (1e4 ms per 1e9 = 1 s per block of 1e8) takes none (NVMe or recompute instead)."""
    from lazytrain.planner.heuristics import heuristic_plan
    from test_q8_planning import offload_problem

    problem = offload_problem(q8_ms_per_gparam=1.0, nvme_bytes_per_s=25e9,
                              q8_update_ms_per_gparam=update_ms)
    plan = heuristic_plan(problem, time_budget_s=2.0)
    if update_ms > 1e3:
        assert not plan.q8_blocks, (plan.tiers, plan.q8_blocks)
    else:
        assert plan.q8_blocks, (plan.tiers, plan.q8_blocks)
