"""GRPO's math over tensors: group-normalized advantages and the clipped-ratio objective the
head runs per token (`runtime.objectives.Objective`).

A GRPO micro-batch holds rollouts as rows: prompt + completion, labels on the completion
tokens only (the prompt masked), right-padded. Each row carries its advantage `advantages`
[B] and, per target position (aligned with the shifted targets, 0 off the completion), the
rollout policy's log-prob `old_logp` [B, S] and, with a KL term, the reference's `ref_logp`
[B, S]. With logp the policy's log-prob of a completion token, A its row's advantage and
r = exp(logp - logp_old):

    loss_t = -min(r A, clip(r, 1 - eps, 1 + eps) A) + beta * KL_t
    KL_t   = exp(ref - logp) - (ref - logp) - 1            (>= 0, unbiased for KL(pi || ref))
    loss   = sum over the step's completion tokens of loss_t / (completion tokens of the step)

Sources: the clipped surrogate, Schulman et al., arXiv:1707.06347, eq. 7; GRPO's group
advantage and the KL estimator, Shao et al. (DeepSeekMath), arXiv:2402.03300, section 4.1,
eqs. 3-4. The mean is over all completion tokens of the step (token level, as DAPO,
arXiv:2503.14476, eq. 8), so gradient accumulation equals one big batch. Chunk-local: each
term depends on its own position only.

Legend: B = rows (rollouts) of a micro-batch, S = sequence length, P = prompts, n = group size.
"""

from __future__ import annotations

import torch

from lazytrain.runtime.micro_batch import label_tokens
from lazytrain.runtime.objectives import ROW, TOKEN


def group_advantages(rewards: torch.Tensor, *, n: int, eps: float,
                     scale_by_std: bool = True) -> torch.Tensor:
    """(reward - group mean) / (group std + eps) of each rollout; rows [g*n, (g+1)*n) are the
    rollouts of prompt g.

    Args:
        rewards: [P * n] fp32 rewards, grouped by prompt.
        n: group size (`grpo.n`), >= 2.
        eps: `grpo.std_eps`, > 0.
        scale_by_std: divide by the std (GRPO); False: centred only (Dr. GRPO).

    Returns:
        [P * n] fp32 advantages. The std is the sample std (n - 1 in the denominator, torch's
        default and TRL's GRPOTrainer's).

    Raises:
        ValueError: the rewards do not split into groups of n.
    """
    if rewards.ndim != 1 or n < 2 or rewards.numel() % n:
        raise ValueError(f"grpo.n: {rewards.numel()} rewards do not form groups of n={n}")
    groups = rewards.double().view(-1, n)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale_by_std:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.view(-1).float()


class GRPOObjective:
    """The clipped-ratio GRPO objective for the head (module docstring's formula).

    Args:
        clip_eps: `grpo.clip_eps`, in (0, 1).
        kl_coef: `grpo.kl_coef`, >= 0; > 0 adds `ref_logp` to the extra keys.

    Per micro-batch chunk it keeps device statistics (completion tokens, tokens where the clip
    binds, the summed KL estimate) that `take_metrics` reads once per step.

    Raises:
        ValueError: clip_eps outside (0, 1) or kl_coef < 0.
    """

    name = "grpo"
    chunk_local = True

    def __init__(self, *, clip_eps: float = 0.2, kl_coef: float = 0.0) -> None:
        if not 0 < clip_eps < 1 or not kl_coef >= 0:
            raise ValueError(f"grpo.clip_eps must be in (0, 1) and grpo.kl_coef >= 0; got "
                             f"{clip_eps}, {kl_coef}")
        self.clip_eps, self.kl_coef = clip_eps, kl_coef
        self.extra_keys: dict[str, str] = {"advantages": ROW, "old_logp": TOKEN}
        if kl_coef > 0:
            self.extra_keys["ref_logp"] = TOKEN
        self._stats: list[torch.Tensor] = []  # per chunk: [tokens, clipped, kl sum], fp64

    def denominator(self, batch: dict) -> float:
        """Completion tokens of the host batch (its label tokens)."""
        return float(label_tokens(batch))

    def loss(self, logp: torch.Tensor, mask: torch.Tensor, extras: dict[str, torch.Tensor], *,
             denominator: float) -> torch.Tensor:
        """The chunk's summed per-token loss / the step's completion tokens; 0-dim fp32.

        Args:
            logp: [B, C] fp32 target log-probs (0 off the completion); mask: [B, C] bool.
            extras: {"advantages": [B], "old_logp": [B, C], "ref_logp": [B, C] with a KL}.
            denominator: completion tokens of the step.
        """
        adv = extras["advantages"].float()[:, None]
        # off the completion the ratio is 1 and the KL 0: an exp of a masked position's
        # arbitrary value would be inf, and inf x 0 a NaN in the sum and the gradient
        ratio = torch.exp(torch.where(mask, logp - extras["old_logp"].float(), 0.0))
        unclipped = ratio * adv
        clipped = ratio.clamp(1 - self.clip_eps, 1 + self.clip_eps) * adv
        per_token = -torch.minimum(unclipped, clipped)
        kl = torch.zeros_like(logp)
        if self.kl_coef > 0:
            d = torch.where(mask, extras["ref_logp"].float() - logp, 0.0)
            kl = torch.exp(d) - d - 1
            per_token = per_token + self.kl_coef * kl
        with torch.no_grad():
            self._stats.append(torch.stack([mask.sum(), (mask & (clipped < unclipped)).sum(),
                                            (kl * mask).sum()]).double())
        return (per_token * mask).sum() / max(denominator, 1.0)

    def take_metrics(self) -> dict[str, float]:
        """clip_fraction (completion tokens where the clip binds / completion tokens) and kl
        (mean per-token KL estimate; 0 without a KL term) since the last call, one host read;
        forgets them."""
        stats, self._stats = self._stats, []
        if not stats:
            return {}
        tokens, clipped, kl = (float(x) for x in torch.stack(stats).sum(dim=0).cpu())
        return {"clip_fraction": clipped / max(tokens, 1.0), "kl": kl / max(tokens, 1.0)}
