"""The `grpo:` config section: GRPO's rollouts, rewards and clipped objective (`train.method:
grpo`; `lazytrain.train.grpo` runs it).

Lives beside `sections.py` (which composes it into `RunConfig`) to keep that file short; the
same rules hold: a frozen dataclass, a docstring under every field, ranges checked in
`__post_init__`. Imports neither torch nor a solver.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lazytrain.config.checks import check, check_finite


@dataclass(kw_only=True, frozen=True, slots=True)
class GrpoConfig:
    """`grpo:` Group Relative Policy Optimization (read only with `train.method: grpo`)."""

    prompts_per_step: int = 4
    """Distinct prompts drawn per optimizer step, >= 1. The step trains on prompts_per_step x
    `n` rollouts, which must equal `train.micro_batch` x `train.grad_accum` (one micro-batch
    row per rollout). MegaTrain: grpo.num_prompts_per_batch."""
    n: int = 4
    """Rollouts (completions) per prompt: the group whose rewards normalize each other, >= 2
    (a group of one has no spread). MegaTrain: grpo.n_rollouts_per_prompt."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts, > 0 (1.0: the policy's own distribution, which
    the clipped ratio assumes)."""
    top_p: float = 1.0
    """Nucleus mass kept when sampling, in (0, 1] (1.0: no truncation)."""
    max_new_tokens: int = 48
    """Tokens generated at most per rollout, >= 1 (48: the embedded arithmetic answers are at
    most 37 tokens plus the end of turn). A prompt plus its completion is cut at
    `data.seq_len`; tokens past it are not trained. MegaTrain: dataset.max_response_len."""
    seed: int = 0
    """Seed of the rollouts' sampling; step k samples with seed + k, so a run repeats."""
    clip_eps: float = 0.2
    """epsilon of the clipped ratio min(r A, clip(r, 1 - eps, 1 + eps) A), in (0, 1) (0.2:
    the PPO and GRPO papers' value). MegaTrain: grpo.clip_range."""
    kl_coef: float = 0.0
    """Weight of the per-token KL penalty to the initial weights, >= 0; 0: off, and no
    reference copy is held. On: a frozen copy of the initial weights in the compute dtype
    stays in host DRAM and a streamed forward pass gives the reference log-probs of every
    rollout. MegaTrain: grpo.kl_loss_coef."""
    std_eps: float = 1e-4
    """eps of the advantage (reward - group mean) / (group std + eps), > 0: a group whose
    rewards are all equal gets advantage 0, not a division by zero."""
    scale_by_std: bool = True
    """Divide the centred rewards by the group's std (GRPO); False: reward - group mean only
    (Dr. GRPO). MegaTrain: grpo.advantage_norm."""
    updates_per_rollout: int = 1
    """Optimizer steps over one batch of rollouts, >= 1 (GRPO's mu). 1: the ratio r is 1 at
    the update (on-policy) and the clip never binds; > 1 reuses the rollouts with the
    rollout policy's log-probs as logp_old."""
    skip_flat_groups: bool = True
    """Leave out of the training phase the rollouts of a group whose rewards are all equal
    (advantage 0, so gradient 0 when `kl_coef` is 0; with a KL term they are kept). The
    step's token mean then runs over the rollouts that carry a gradient, as with DAPO's
    dynamic sampling (Yu et al., arXiv:2503.14476, section 3.2), which also draws more
    prompts to refill the batch; this does not. False: train every rollout."""
    rewards: tuple[str, ...] = ("exact_match",)
    """Reward functions, summed: built-ins `exact_match`, `format`, `math_verify`, or a user's
    function as `module:function` (`lazytrain.train.rewards`; signature fn(completion, *,
    prompt, answer) -> float)."""

    def __post_init__(self) -> None:
        check_finite(self, "grpo")
        for key in ("prompts_per_step", "max_new_tokens", "updates_per_rollout"):
            check(getattr(self, key) >= 1, f"grpo.{key}", ">= 1", getattr(self, key))
        check(self.n >= 2, "grpo.n", ">= 2 (a group needs two rollouts to compare)", self.n)
        check(self.temperature > 0, "grpo.temperature", "> 0", self.temperature)
        check(0 < self.top_p <= 1, "grpo.top_p", "in (0, 1]", self.top_p)
        check(0 < self.clip_eps < 1, "grpo.clip_eps", "in (0, 1)", self.clip_eps)
        check(self.kl_coef >= 0, "grpo.kl_coef", ">= 0 (0 = off)", self.kl_coef)
        check(math.isfinite(self.std_eps) and self.std_eps > 0, "grpo.std_eps", "> 0",
              self.std_eps)
        check(len(self.rewards) >= 1 and all(self.rewards), "grpo.rewards",
              "a non-empty list of reward names", list(self.rewards))


def check_grpo_rows(cfg) -> None:
    """With `train.method: grpo`, the step's rollouts must fill its micro-batches exactly;
    `lazytrain plan` and the trainer check it before planning.

    Raises:
        ValueError: grpo.prompts_per_step x grpo.n != train.micro_batch x train.grad_accum,
            naming the keys and the grad_accum that fits.
    """
    if cfg.train.method != "grpo":
        return
    g, tc = cfg.grpo, cfg.train
    if g.prompts_per_step * g.n != tc.micro_batch * tc.grad_accum:
        raise ValueError(f"grpo.prompts_per_step x grpo.n = {g.prompts_per_step * g.n} "
                         f"rollouts per step must equal train.micro_batch x train.grad_accum "
                         f"= {tc.micro_batch * tc.grad_accum} rows; set train.grad_accum to "
                         f"{g.prompts_per_step * g.n} / train.micro_batch")
