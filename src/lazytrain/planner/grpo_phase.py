"""A GRPO step as the planner sees it: a generation phase (the decode plan), a scoring phase
(the forward plan) and a training phase (the training Plan), one summary line each; and the
host DRAM the KL reference holds, which the training plan's DRAM budget leaves out.

Per step, with R = prompts x n rollouts, decode and forward plans of `batch` rows (R, or
fewer when R rows do not fit HBM: `inference_plans.make_inference_plans`) and T = max new
tokens:

    generation_ms = ceil(R / batch) * (T * decode.step_ms + forward.step_ms)
    scoring_ms    = ceil(R / batch) * forward.step_ms * (2 with a KL reference, else 1)
    training_ms   = plan.predicted.step_ms   (micro_batch x grad_accum = R rows)

The training phase is an upper bound: rows are cut to their longest rollout, and with
`grpo.skip_flat_groups` the rollouts of groups without a reward spread are not trained.

The prefill of a generation batch is charged as one forward pass of `batch` rows of
seq_len tokens (an upper bound: prompts are shorter), and each decode step at the decode
plan's time, whose memory floor reads the KV cache of the full context (an upper bound too).
Scoring is the old-policy log-probs (and the reference's) by a forward pass each.

Reference copy: the initial weights in the compute dtype, every parameter once,

    reference_bytes = total_params * b    (b = 2 for bf16, 4 for fp32)

held in host DRAM for the run when `grpo.kl_coef` > 0 (`train.grpo.ReferenceModel`).

Knows nothing of torch or a solver.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lazytrain.planner.inference_plans import InferencePlan, make_inference_plans
from lazytrain.planner.plan_checks import PlanValidationError
from lazytrain.planner.problem import PlanningProblem
from lazytrain.spec.model import ModelSpec
from lazytrain.units import GB

DTYPE_BYTES = {"fp32": 4, "bf16": 2}


def reference_bytes(total_params: int, *, method: str, kl_coef: float,
                    compute_dtype: str) -> int:
    """Host DRAM of the GRPO KL reference (module docstring), bytes; 0 unless
    `train.method` is grpo with `grpo.kl_coef` > 0."""
    if method != "grpo" or kl_coef <= 0:
        return 0
    return int(total_params) * DTYPE_BYTES[compute_dtype]


@dataclass(kw_only=True, frozen=True, slots=True)
class GrpoPhases:
    """The predicted phases of one GRPO step (module docstring), ms."""

    rollouts: int
    """Completions generated per step (prompts x n)."""
    batches: int
    """Generation (and scoring) batches of `decode.batch` rows per step."""
    generation_ms: float
    scoring_ms: float
    training_ms: float
    reference_bytes: int
    """Host DRAM of the KL reference, bytes (0: no KL term)."""

    @property
    def step_ms(self) -> float:
        return self.generation_ms + self.scoring_ms + self.training_ms


def grpo_phases(*, decode: InferencePlan, forward: InferencePlan, training_step_ms: float,
                prompts: int, n: int, max_new_tokens: int, reference_bytes: int) -> GrpoPhases:
    """The phases of one GRPO step from the run's plans (module docstring's formulas).

    Args:
        decode, forward: the run's inference plans (`inference_plans.make_inference_plans`).
        training_step_ms: the training plan's predicted step, ms.
        prompts, n, max_new_tokens: `grpo.prompts_per_step`, `grpo.n`,
            `grpo.max_new_tokens`.
        reference_bytes: `reference_bytes(...)`, bytes.
    """
    rollouts = prompts * n
    batches = math.ceil(rollouts / decode.batch)
    passes = 2 if reference_bytes else 1
    return GrpoPhases(rollouts=rollouts, batches=batches,
                      generation_ms=batches * (max_new_tokens * decode.step_ms + forward.step_ms),
                      scoring_ms=math.ceil(rollouts / forward.batch) * forward.step_ms * passes,
                      training_ms=training_step_ms, reference_bytes=reference_bytes)


def phase_lines(phases: GrpoPhases, *, decode: InferencePlan, prompts: int, n: int,
                max_new_tokens: int) -> list[str]:
    """Two lines for the plan summary: the generation phase (with scoring) and the training
    phase (with the step total and the reference's DRAM)."""
    ref = (f"; KL reference {phases.reference_bytes / GB:.3g} GB in DRAM (left out of the "
           f"plan's DRAM budget)" if phases.reference_bytes else "")
    scored = "old-policy and reference" if phases.reference_bytes else "old-policy"
    return [
        f"grpo generation: {phases.rollouts} rollouts ({prompts} prompts x {n}) of up to "
        f"{max_new_tokens} new tokens in {phases.batches} batch(es) of {decode.batch}, weights "
        f"{decode.weights}: predicted {phases.generation_ms / 1e3:.3g} s, {scored} log-probs "
        f"{phases.scoring_ms / 1e3:.3g} s",
        f"grpo training: {phases.rollouts} rows per step: predicted "
        f"{phases.training_ms / 1e3:.3g} s (the plan above); a GRPO step "
        f"{phases.step_ms / 1e3:.3g} s{ref}"]


def grpo_summary_lines(plans: dict[str, InferencePlan], *, training_step_ms: float, grpo,
                       total_params: int, compute_dtype: str) -> list[str]:
    """`phase_lines` of a run with `train.method: grpo` from its inference plans by kind
    (`make_inference_plans`; both needed, else one line saying why there is no estimate).

    Args:
        grpo: the `grpo:` config section (prompts_per_step, n, max_new_tokens, kl_coef).
        total_params: the model's parameters (the reference copy).
        compute_dtype: `train.compute_dtype`.
    """
    decode, forward = plans.get("decode"), plans.get("forward")
    if decode is None or forward is None:
        return ["grpo: no generation estimate (no decode or forward plan fits)"]
    ref = reference_bytes(total_params, method="grpo", kl_coef=grpo.kl_coef,
                          compute_dtype=compute_dtype)
    phases = grpo_phases(decode=decode, forward=forward, training_step_ms=training_step_ms,
                         prompts=grpo.prompts_per_step, n=grpo.n,
                         max_new_tokens=grpo.max_new_tokens, reference_bytes=ref)
    return phase_lines(phases, decode=decode, prompts=grpo.prompts_per_step, n=grpo.n,
                       max_new_tokens=grpo.max_new_tokens)


def grpo_plan_lines(problem: PlanningProblem, hf_config: dict, *, plan, grpo,
                    compute_dtype: str, hbm_bytes_per_s: float = 0.0) -> list[str]:
    """`grpo_summary_lines` for `lazytrain plan`: the inference plans of `problem` (as the run
    makes them) and the training `plan`'s predicted step.

    Args:
        hf_config: the model's HF config dict (`spec.model.read_hf_config`).
        plan: the training Plan (its `predicted.step_ms`).
        grpo, compute_dtype: as `grpo_summary_lines`.
        hbm_bytes_per_s: device memory bandwidth, bytes/s (the decode plan's floor).
    """
    model = ModelSpec.from_hf_config(hf_config)
    try:
        plans = make_inference_plans(problem, model=model, hf_config=hf_config,
                                     hbm_bytes_per_s=hbm_bytes_per_s,
                                     batch=grpo.prompts_per_step * grpo.n)
    except PlanValidationError:
        plans = {}
    step = plan.predicted.step_ms if plan.predicted else 0.0
    return grpo_summary_lines(plans, training_step_ms=step, grpo=grpo,
                              total_params=model.total_params, compute_dtype=compute_dtype)
