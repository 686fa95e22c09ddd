"""The GRPO step's phases by hand: generation and scoring from the inference plans' step
times, training from the plan, the KL reference's DRAM (and the plan's DRAM budget without it),
and `lazytrain plan` printing one line per phase."""

from __future__ import annotations

import pytest

from lazytrain.cli.main import main
from lazytrain.config import load_config
from lazytrain.planner.build import problem_from_config
from lazytrain.planner.grpo_phase import grpo_phases, phase_lines, reference_bytes
from lazytrain.planner.inference_plans import InferencePlan


def _plan(kind: str, step_ms: float) -> InferencePlan:
    return InferencePlan(kind=kind, weights="resident", batch=8, context_tokens=128,
                         hbm_budget_bytes=10**10, weight_bytes=10**6, ends_bytes=10**5,
                         activation_bytes=10**5, cache_bytes=10**4 if kind == "decode" else 0,
                         model_weight_bytes=10**6, step_ms=step_ms, tokens_per_s=1.0)


def test_phases_by_hand():
    # 3 prompts x 4 = 12 rollouts -> 2 batches of 8; decode 5 ms/step, forward 40 ms/batch
    # generation: 2 x (10 x 5 + 40) = 180 ms; scoring: 2 batches x 40 ms x 2 (with KL) = 160
    phases = grpo_phases(decode=_plan("decode", 5.0), forward=_plan("forward", 40.0),
                         training_step_ms=300.0, prompts=3, n=4, max_new_tokens=10,
                         reference_bytes=7)
    assert (phases.rollouts, phases.batches) == (12, 2)
    assert phases.generation_ms == pytest.approx(180.0)
    assert phases.scoring_ms == pytest.approx(160.0)
    assert phases.step_ms == pytest.approx(640.0)
    no_kl = grpo_phases(decode=_plan("decode", 5.0), forward=_plan("forward", 40.0),
                        training_step_ms=300.0, prompts=3, n=4, max_new_tokens=10,
                        reference_bytes=0)
    assert no_kl.scoring_ms == pytest.approx(80.0)
    gen, training = phase_lines(phases, decode=_plan("decode", 5.0), prompts=3, n=4,
                                max_new_tokens=10)
    assert gen.startswith("grpo generation: 12 rollouts (3 prompts x 4)") and "0.18 s" in gen
    assert training.startswith("grpo training: 12 rows") and "0.64 s" in training


def test_reference_bytes_by_hand():
    assert reference_bytes(1000, method="grpo", kl_coef=0.1, compute_dtype="bf16") == 2000
    assert reference_bytes(1000, method="grpo", kl_coef=0.1, compute_dtype="fp32") == 4000
    assert reference_bytes(1000, method="grpo", kl_coef=0.0, compute_dtype="fp32") == 0
    assert reference_bytes(1000, method="sft", kl_coef=0.1, compute_dtype="fp32") == 0


def test_the_kl_reference_leaves_the_plan_s_dram_budget():
    base = problem_from_config(load_config(None, ["train.method=grpo"]))
    with_kl = problem_from_config(load_config(None, ["train.method=grpo", "grpo.kl_coef=0.1"]))
    # SmolLM2-135M: 134,515,008 parameters x 4 B (fp32 compute)
    assert base.dram_bytes - with_kl.dram_bytes == 134_515_008 * 4


def test_plan_prints_the_generation_and_the_training_phase(capsys):
    assert main(["plan", "--policy", "heuristic", "--set", "train.method=grpo",
                 "--set", "grpo.prompts_per_step=2", "--set", "grpo.n=2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("grpo generation: 4 rollouts (2 prompts x 2)") for line in out) == 1
    assert sum(line.startswith("grpo training: 4 rows per step") for line in out) == 1
