"""DPO's second head pass is priced in `turn`: its head runs a forward without gradient for the
log-probs, then each chunk's forward and backward, so the turn computes head_ms (one forward and
backward) plus the forward's third of it. SFT and GRPO run one pass. The evaluator, the event
simulator and the MILP charge the same; the plan records it; a refit divides it out again; and
`lazytrain plan` of a DPO config predicts a step longer than the same SFT config by grad_accum x
head_ms / 3.

Hand numbers of the tiny problem: 2 blocks, F = 10, Fg = 12, B = 20 ms; P = 200 u, G = 100 u at
1e4 u/s (20 and 10 ms); embed 1 ms, head 30 ms; nothing kept.
    GPU (a window is the max of compute and channels), all-HBM:
      f0 max(10, P1 20) = 20;  f1 10;  turn max(head, P1 reload 20);  b1 max(32, P0 20) = 32;
      b0 max(32, G1 10) = 32;  pre max(1, P0 20) = 20;  post G0 10
      SFT: turn 30, step 20 + 20 + 10 + 30 + 32 + 32 + 10 = 154
      DPO: turn 30 + 30 / 3 = 40 (the head is on the critical path: 40 > 20), step 164
    CPU (compute + channels): turn 30 + 20 = 50 (SFT) and 60 (DPO); the other windows as
      above summed: f0 30, f1 10, b1 52, b0 42, pre 21, post 10: step 215 (SFT), 225 (DPO).
"""

from __future__ import annotations

import pytest

from lazytrain.cli.main import main
from lazytrain.config import load_config
from lazytrain.config.dpo import planning_config
from lazytrain.planner.build import head_turn_factor, problem_from_config
from lazytrain.planner.evaluate import Decisions, build_plan, evaluate
from lazytrain.planner.plan import Plan, SolveRecord
from lazytrain.planner.problem import PlanningProblem
from lazytrain.planner.refit import fit_compute
from lazytrain.sim import simulate
from milp_steps import all_hbm_and_optimum

U = 10**7  # byte unit: 1 u = 1e7 bytes
ALL_HBM = ("hbm", "hbm", "hbm")
HEAD_MS = 30.0
DPO_FACTOR = 4 / 3  # one forward more, backward ~ 2 x forward: 1 + 1/3
# case -> (copies overlap compute, turn SFT, turn DPO, step SFT, step DPO), ms (docstring)
CASES = {"gpu": (True, 30.0, 40.0, 154.0, 164.0), "cpu": (False, 50.0, 60.0, 215.0, 225.0)}


def _problem(*, dpo: bool, gpu: bool, **kw) -> PlanningProblem:
    base = dict(
        fwd_ms=(10.0, 10.0), fwd_grad_ms=(12.0, 12.0), bwd_ms=(20.0, 20.0),
        weight_bytes=(200 * U,) * 2, grad_bytes=(100 * U,) * 2, internal_bytes=(30 * U,) * 2,
        boundary_bytes=(50 * U,) * 3, params_per_block=(10**8,) * 2,
        embed_ms=1.0, head_ms=HEAD_MS, head_turn_factor=DPO_FACTOR if dpo else 1.0,
        h2d_bytes_per_s=1e4 * U, d2h_bytes_per_s=1e4 * U, duplex_bytes_per_s=2e4 * U,
        nvme_read_bytes_per_s=5e3 * U, nvme_write_bytes_per_s=5e3 * U,
        hbm_bytes=10**13, fixed_hbm_bytes=0, dram_bytes=10**13, nvme_bytes=0,
        allow_keep=False, copies_overlap_compute=gpu,
    )
    base.update(kw)
    return PlanningProblem(**base)


def _turn(ev):
    (turn,) = [w for w in ev.windows if w.name == "turn"]
    return turn


def test_the_turn_factor_by_method():
    assert head_turn_factor("sft") == 1.0 and head_turn_factor("grpo") == 1.0
    assert head_turn_factor("dpo") == pytest.approx(4 / 3)
    with pytest.raises(ValueError, match="train.method"):
        head_turn_factor("ppo")


def test_a_turn_factor_below_one_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="head_turn_factor must be >= 1"):
        _problem(dpo=False, gpu=True, head_turn_factor=0.5)


@pytest.mark.parametrize("case", list(CASES))
def test_the_evaluator_charges_dpo_one_head_forward_more_in_turn(case):
    gpu, turn_sft, turn_dpo, step_sft, step_dpo = CASES[case]
    sft = evaluate(_problem(dpo=False, gpu=gpu), Decisions(tiers=ALL_HBM))
    dpo = evaluate(_problem(dpo=True, gpu=gpu), Decisions(tiers=ALL_HBM))
    assert _turn(sft).compute_ms == pytest.approx(HEAD_MS)
    assert _turn(dpo).compute_ms == pytest.approx(HEAD_MS + 10.0)
    assert _turn(sft).time_ms == pytest.approx(turn_sft)
    assert _turn(dpo).time_ms == pytest.approx(turn_dpo)
    assert sft.step_ms == pytest.approx(step_sft) and dpo.step_ms == pytest.approx(step_dpo)
    # every other window is the same
    others = lambda ev: [w.time_ms for w in ev.windows if w.name != "turn"]  # noqa: E731
    assert others(dpo) == pytest.approx(others(sft))


@pytest.mark.parametrize("case", list(CASES))
def test_grad_accum_micro_batches_each_pay_the_extra_forward(case):
    gpu, *_ = CASES[case]
    sft = evaluate(_problem(dpo=False, gpu=gpu, grad_accum=3), Decisions(tiers=ALL_HBM))
    dpo = evaluate(_problem(dpo=True, gpu=gpu, grad_accum=3), Decisions(tiers=ALL_HBM))
    assert dpo.step_ms - sft.step_ms == pytest.approx(3 * 10.0)


@pytest.mark.parametrize("case", list(CASES))
def test_the_event_simulator_charges_the_same(case):
    gpu, _ts, _td, step_sft, step_dpo = CASES[case]
    for dpo, step in ((False, step_sft), (True, step_dpo)):
        r = simulate(_problem(dpo=dpo, gpu=gpu), Plan(tiers=ALL_HBM))
        assert r.step_ms == pytest.approx(step)
        (head,) = [e for e in r.events if e.kind == "head"]
        assert head.end_ms - head.start_ms == pytest.approx(40.0 if dpo else 30.0)


@pytest.mark.parametrize("case", list(CASES))
def test_the_milp_prices_the_same_step(case):
    pytest.importorskip("highspy")
    gpu, _ts, _td, _ss, step = CASES[case]
    milp, start, best = all_hbm_and_optimum(_problem(dpo=True, gpu=gpu), ALL_HBM)
    assert start == pytest.approx(step)
    assert milp.step_ms(best) == pytest.approx(step, rel=1e-6)  # all-HBM is optimal here


def test_the_plan_records_what_turn_priced_only_for_dpo():
    rec = SolveRecord(backend="manual")
    dpo = build_plan(_problem(dpo=True, gpu=True), Decisions(tiers=ALL_HBM), solver=rec)
    assert dpo.provenance["head"] == pytest.approx(
        {"head_ms": 30.0, "turn_factor": 4 / 3, "turn_head_ms": 40.0})
    sft = build_plan(_problem(dpo=False, gpu=True), Decisions(tiers=ALL_HBM), solver=rec)
    assert "head" not in sft.provenance  # a one-pass head's plan JSON as before
    # the optional field survives the JSON round trip
    assert Plan.from_dict(dpo.to_dict()).provenance["head"]["turn_factor"] == pytest.approx(4 / 3)


def test_a_refit_of_a_dpo_run_gives_the_one_pass_head_back():
    # measured windows of the tiny problem's all-HBM plan: compute as the hand numbers say;
    # a DPO turn of 40 ms is 4/3 of a 30 ms head, an SFT turn of 40 ms a 40 ms head
    measured = [{"name": n, "compute_ms": c} for n, c in
                (("f0", 10.0), ("f1", 10.0), ("turn", 40.0), ("b1", 32.0), ("b0", 32.0))]
    rec = SolveRecord(backend="manual")
    kinds = ["block", "block"]
    for dpo, head in ((True, 30.0), (False, 40.0)):
        plan = build_plan(_problem(dpo=dpo, gpu=True), Decisions(tiers=ALL_HBM), solver=rec)
        fit = fit_compute(plan, kinds, measured, lam=0.0)
        assert fit.head_ms == pytest.approx(head)


def test_a_dpo_config_builds_the_factor_sft_and_grpo_do_not():
    # same rows: 4 SFT rows, 2 DPO pairs (2 x 2 rows); the one-pass head is the same
    sft = problem_from_config(planning_config(load_config(None, ["train.micro_batch=4"])))
    dpo = problem_from_config(planning_config(load_config(
        None, ["train.method=dpo", "train.micro_batch=2"])))
    grpo = problem_from_config(planning_config(load_config(
        None, ["train.method=grpo", "grpo.prompts_per_step=2", "grpo.n=2",
               "train.micro_batch=4"])))
    assert dpo.head_ms == sft.head_ms == grpo.head_ms
    assert sft.head_turn_factor == grpo.head_turn_factor == 1.0
    assert dpo.turn_head_ms == pytest.approx(sft.head_ms * 4 / 3)


def _heuristic_step_ms(capsys, *sets: str) -> float:
    args = ["plan", "--policy", "heuristic", "--hardware", "cpu",
            "--set", "data.seq_len=128", "--set", "train.grad_accum=2",
            "--set", "hardware.peak_tflops=0.1", "--set", "hardware.matmul_efficiency=1"]
    assert main([*args, *(x for s in sets for x in ("--set", s))]) == 0
    out = capsys.readouterr().out
    (row,) = [ln for ln in out.splitlines() if ln.startswith("heuristic ")]
    assert "event simulator" in out and "agrees with the evaluator" in out
    return float(row.split()[1])


def test_plan_of_a_dpo_config_predicts_the_extra_head_forwards(capsys):
    # SmolLM2-135M (the default model): head V x H = 49,152 x 576; 4 rows x 128 tokens = 512
    # tokens; analytic head = 6 x 512 x 49,152 x 576 FLOP at 0.1 TFLOP/s x 1 = 869.73 ms.
    # DPO (2 pairs = the same 4 rows) adds its forward, 869.73 / 3 = 289.91 ms, per
    # micro-batch; on the cpu preset every window sums compute and copies, so the head is on
    # the critical path: 2 micro-batches, 579.82 ms more
    sft = _heuristic_step_ms(capsys, "train.micro_batch=4")
    dpo = _heuristic_step_ms(capsys, "train.method=dpo", "train.micro_batch=2")
    assert dpo - sft == pytest.approx(579.82, abs=0.15)  # the table prints 0.1 ms
