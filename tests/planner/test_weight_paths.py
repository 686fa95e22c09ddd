"""The weight paths (docs/execution_model.md, "Weight paths"): each block's H2D bytes, host
bytes and memory under host_convert, pinned_copy and gpu_cast, in the evaluator, the MILP and
the simulator, checked against windows computed by hand; the planner's choice."""

from __future__ import annotations

import dataclasses

import pytest

from lazytrain.planner.evaluate import Decisions, build_plan, evaluate
from lazytrain.planner.plan import Plan, PlanValidationError, SolveRecord
from lazytrain.planner.path_choice import choose_weight_paths
from lazytrain.planner.weight_paths import with_weight_paths
from lazytrain.planner.window_time import pre_ms

from tests.planner.test_host_term import ALL_HBM, GPU_STEP, U, _problem

# The host-term problem (2 blocks, P = 200 u, G = 100 u, H2D 1e4 u/s, conversion 2e3 u/s,
# accumulation 1e3 u/s, masters twice the compute bytes). Per window, GPU:
#   host_convert everywhere: 100, 10, 100, 100, 100 (+ pre 100 + post 100) = 610 (host-bound).
#   pinned_copy everywhere: no conversion; host only accumulates G1 in b0 (100 ms):
#     f0 max(F0 10, P1 20) = 20; f1 10; turn max(4, 20) = 20; b1 max(32, 20) = 32;
#     b0 max(32, D2H 10, accumulation 100) = 100; pre max(1, 20) = 20; post 100: step 302.
#   gpu_cast everywhere: loads move 2P = 400 u (40 ms): f0 40, f1 10, turn 40, b1 40, b0 100;
#     pre 40, post 100: step 370.
PINNED_TIMES, PINNED_STEP = [20, 10, 20, 32, 100], 302.0
CAST_TIMES, CAST_STEP = [40, 10, 40, 40, 100], 370.0


@pytest.mark.parametrize("paths,times,step", [
    (("pinned_copy",) * 2, PINNED_TIMES, PINNED_STEP),
    (("gpu_cast",) * 2, CAST_TIMES, CAST_STEP),
], ids=["pinned_copy", "gpu_cast"])
def test_evaluator_windows_by_hand(paths, times, step):
    ev = evaluate(_problem(), dataclasses.replace(ALL_HBM, weight_paths=paths))
    assert [w.time_ms for w in ev.windows] == pytest.approx(times)
    assert ev.step_ms == pytest.approx(step)
    assert ev.host_ms_by_window[0] == 0.0  # nothing converted on the host


def test_mixed_paths_convert_only_the_host_convert_blocks():
    # block 0 host_convert, block 1 pinned: f0 loads P1 (pinned: 20 ms H2D, no host);
    # turn loads P1 again (20 ms); b1 loads P0 (converted: 100 ms host); pre converts P0
    # (100 ms). Times: 20, 10, 20, 100, 100; pre 100, post 100: step 450.
    ev = evaluate(_problem(), dataclasses.replace(ALL_HBM,
                                                  weight_paths=("host_convert", "pinned_copy")))
    assert list(ev.host_ms_by_window) == pytest.approx([0, 0, 0, 100, 100])
    assert ev.step_ms == pytest.approx(450.0)
    assert pre_ms(with_weight_paths(_problem(), ("host_convert", "pinned_copy"))) == 100.0


def test_memory_of_each_path_by_hand():
    base = evaluate(_problem(), ALL_HBM)
    pinned = evaluate(_problem(), dataclasses.replace(ALL_HBM, weight_paths=("pinned_copy",) * 2))
    cast = evaluate(_problem(), dataclasses.replace(ALL_HBM, weight_paths=("gpu_cast",) * 2))
    # pinned copies: 2 x P = 400 u more DRAM, all of it pinned; no HBM
    assert pinned.dram_bytes - base.dram_bytes == 400 * U
    assert pinned.pinned_bytes - base.pinned_bytes == 400 * U
    assert pinned.peak_hbm_bytes == base.peak_hbm_bytes
    # gpu_cast: 4 landing slots (one per weight slot) of the master's bytes (4 x 400 u) in
    # HBM; no DRAM
    assert cast.peak_hbm_bytes - base.peak_hbm_bytes == 1600 * U
    assert cast.dram_bytes == base.dram_bytes


def test_masters_in_the_compute_dtype_pin_themselves_for_free():
    p = _problem(master_bytes_ratio=1.0)
    base = evaluate(p, ALL_HBM)
    pinned = evaluate(p, dataclasses.replace(ALL_HBM, weight_paths=("pinned_copy",) * 2))
    assert pinned.dram_bytes == base.dram_bytes
    assert pinned.pinned_bytes == base.pinned_bytes


def test_with_weight_paths_applies_again_without_double_counting():
    p = with_weight_paths(_problem(), ("gpu_cast", "pinned_copy"))
    again = with_weight_paths(with_weight_paths(p, ("pinned_copy",) * 2), ("gpu_cast",
                                                                           "pinned_copy"))
    assert again == p
    assert with_weight_paths(p, ()).fixed_hbm_bytes == _problem().fixed_hbm_bytes


def test_plan_json_round_trip_and_absent_means_host_convert():
    p = _problem()
    plan = build_plan(p, dataclasses.replace(ALL_HBM, weight_paths=("pinned_copy", "gpu_cast")),
                      solver=SolveRecord(backend="manual"))
    back = Plan.from_dict(plan.to_dict())
    assert back.weight_paths == ("pinned_copy", "gpu_cast")
    assert evaluate(p, back).step_ms == pytest.approx(plan.predicted.step_ms)
    old = build_plan(p, ALL_HBM, solver=SolveRecord(backend="manual"))
    assert "weight_paths" not in old.to_dict() and old.predicted.step_ms == GPU_STEP
    bad = dict(plan.to_dict(), weight_paths=["pinned", "gpu_cast"])
    with pytest.raises(PlanValidationError, match="weight_paths"):
        Plan.from_dict(bad).validate()


def test_8bit_blocks_keep_host_conversion_of_fp32_masters():
    plan = build_plan(_problem(), dataclasses.replace(
        ALL_HBM, q8_blocks=(1,), weight_paths=("pinned_copy",) * 2),
        solver=SolveRecord(backend="manual"))
    assert plan.weight_paths == ("pinned_copy", "host_convert")


@pytest.mark.parametrize("paths,step", [(("pinned_copy",) * 2, PINNED_STEP),
                                        (("gpu_cast",) * 2, CAST_STEP)])
def test_milp_predicts_the_same_step(paths, step):
    pytest.importorskip("highspy")
    from lazytrain.planner.extract import start_from_plan
    from lazytrain.planner.milp import build_milp

    problem = with_weight_paths(_problem(), paths)
    milp = build_milp(problem, tie_breakers=False)
    plan = build_plan(problem, ALL_HBM, solver=SolveRecord(backend="manual"))
    assert milp.step_ms(start_from_plan(milp, plan)) == pytest.approx(step)


def test_simulator_agrees_on_a_pinned_plan():
    from lazytrain.sim.simulate import simulate

    problem = _problem()
    plan = build_plan(problem, dataclasses.replace(ALL_HBM, weight_paths=("pinned_copy",) * 2),
                      solver=SolveRecord(backend="manual"))
    sim = simulate(problem, plan)
    assert not [e for e in sim.events if e.kind == "convert"]
    assert sim.step_ms == pytest.approx(PINNED_STEP, rel=0.05)


def test_choice_takes_a_host_free_path_when_the_host_binds():
    chosen = choose_weight_paths(_problem(weight_path_choice=True))
    assert chosen.weight_paths == ("pinned_copy",) * 2
    # DRAM holds the states (16 B x 2e8 params = 320 u) and 100 u more, not a 200 u copy:
    # gpu_cast (HBM room, and the link is faster than the host)
    tight = _problem(weight_path_choice=True, dram_bytes=420 * U)
    assert choose_weight_paths(tight).weight_paths == ("gpu_cast",) * 2
    # hand-made problems keep their paths
    assert choose_weight_paths(_problem()).weight_paths == ()


def test_8b_at_8k_takes_a_host_free_path_even_with_a_slow_host(repo_root):
    from lazytrain.config import load_config
    from lazytrain.planner.build import problem_from_config
    from lazytrain.planner.weight_paths import host_free_paths

    problem = problem_from_config(load_config(repo_root / "configs/llama-3-8b-8k-h200.yaml"))
    assert problem.master_bytes_ratio == 2.0 and problem.weight_path_choice
    assert host_free_paths(choose_weight_paths(problem).paths)
    # a host converting 2.75 GB/s (one thread of this machine, benchmarks/weight_paths.py)
    # binds a host_convert plan; the choice is still host-free
    slow = problem.replace(host_convert_bytes_per_s=2.75e9)
    assert host_free_paths(choose_weight_paths(slow).paths)


def test_seed_scenario_pins_its_bf16_masters(repo_root):
    from lazytrain.config import load_config
    from lazytrain.planner.build import problem_from_config

    problem = problem_from_config(load_config(repo_root / "configs/qwen3.6-27b-h800.yaml"))
    chosen = choose_weight_paths(problem)
    assert chosen.paths == ("pinned_copy",) * 64
    assert chosen.nvme_staging_bytes == problem.nvme_staging_bytes  # no copy, no extra DRAM


def test_gradients_that_land_in_the_accumulator_cost_no_host_time():
    # masters in the compute dtype and one micro-batch per step: every drain is the step's
    # first and lands in the accumulator, so pinned paths leave no host work at all: the
    # windows of the problem without host rates (20, 10, 20, 32, 32; pre 20, post 10: 144)
    p = _problem(master_bytes_ratio=1.0)
    ev = evaluate(p, dataclasses.replace(ALL_HBM, weight_paths=("pinned_copy",) * 2))
    assert ev.host_ms_by_window == (0.0,) * 5
    assert ev.step_ms == pytest.approx(144.0)
    # two micro-batches: the second adds on the host (b0: G1 100 u / 1e3 u/s = 100 ms)
    p2 = _problem(master_bytes_ratio=1.0, grad_accum=2)
    ev2 = evaluate(p2, dataclasses.replace(ALL_HBM, weight_paths=("pinned_copy",) * 2))
    assert ev2.host_ms_by_window[4] == pytest.approx(100.0)


def test_one_micro_batch_casts_gradients_on_the_device_by_hand():
    # cast_gradients, masters twice the compute bytes, grad_accum 1: each drain moves 2 G =
    # 200 u (20 ms) and nothing is added on the host. Pinned paths: f0 20, f1 10, turn 20,
    # b1 32, b0 max(32, D2H 20) = 32; pre 20; post: G0 cast, 20 ms: step 154
    p = _problem(cast_gradients=True)
    assert p.drain_bytes == (200 * U, 200 * U)
    ev = evaluate(p, dataclasses.replace(ALL_HBM, weight_paths=("pinned_copy",) * 2))
    assert ev.host_ms_by_window == (0.0,) * 5
    assert ev.windows[4].d2h_bytes == 200 * U
    assert ev.step_ms == pytest.approx(154.0)
    # with two micro-batches the drains stay in the compute dtype and are added on the host
    assert _problem(cast_gradients=True, grad_accum=2).drain_bytes == (100 * U, 100 * U)
