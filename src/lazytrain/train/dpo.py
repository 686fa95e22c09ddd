"""Direct preference optimisation: the DPO objective over the head's per-token log-probs, and
the DPO metrics (rewards, accuracy, margin) of training steps and held-out pairs.

A DPO micro-batch holds P preference pairs as 2P rows: rows [0, P) the chosen responses, rows
[P, 2P) the rejected ones, in the same pair order (`data.preference`); its labels mark the
response tokens only. Each row carries `ref_logp` [2P] fp32, the summed log-prob of its
response under the reference (the initial weights, `train.reference`), so no reference model
is held. With pi the policy's summed response log-prob of a row, ref its reference one and
z = (pi_c - ref_c) - (pi_r - ref_r) for a pair (chosen c, rejected r):

    sigmoid:  loss = -log sigmoid(beta * z)                    (Rafailov et al., arXiv 2305.18290, eq. 7)
    ipo:      loss = (z' - 1 / (2 * beta))^2, z' as z with per-token mean log-probs
                                                                (Azar et al., arXiv 2310.12036, eq. 17;
                                                                 the mean as TRL's DPOTrainer)

averaged over the step's pairs. Rewards as TRL reports them: beta * (pi - ref) per response;
accuracy = share of pairs whose chosen reward exceeds the rejected one; margin = mean of the
reward differences. Not chunk-local (nonlinear in per-row sums): the head runs it in two
passes (`runtime.objectives`).

Legend: P = pairs of a micro-batch, S = sequence length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lazytrain.runtime.objectives import ROW

DPO_LOSSES = ("sigmoid", "ipo")
"""`dpo.loss` choices (module docstring)."""
METRIC_NAMES = ("rewards_chosen", "rewards_rejected", "accuracy", "margin")
"""Per-pair means reported for training steps and held-out pairs (`dpo/` in metrics)."""


def pair_loss(pi: torch.Tensor, ref: torch.Tensor, counts: torch.Tensor, *, beta: float,
              loss: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair DPO losses and rewards from per-row sums (the module docstring's formulas).

    Args:
        pi: [2P] fp32 policy log-prob of each row's response (summed over its targets).
        ref: [2P] fp32 reference log-prob of the same rows.
        counts: [2P] response tokens of each row (IPO's per-token mean), >= 1.
        beta: `dpo.beta`, > 0.
        loss: "sigmoid" or "ipo".

    Returns:
        ([P] per-pair losses, {"rewards_chosen", "rewards_rejected": [P], "correct": [P]
        bool}), rewards detached.

    Raises:
        ValueError: an odd number of rows or an unknown loss.
    """
    if pi.shape[0] % 2:
        raise ValueError(f"DPO rows come in pairs (chosen, rejected); got {pi.shape[0]} rows")
    P = pi.shape[0] // 2
    ratio = pi - ref
    if loss == "sigmoid":
        z = ratio[:P] - ratio[P:]
        losses = -F.logsigmoid(beta * z)
    elif loss == "ipo":
        mean_ratio = ratio / counts.clamp(min=1)
        losses = (mean_ratio[:P] - mean_ratio[P:] - 1.0 / (2.0 * beta)) ** 2
    else:
        raise ValueError(f"dpo.loss: {loss!r}; use one of {', '.join(DPO_LOSSES)}")
    rewards = beta * ratio.detach()
    chosen, rejected = rewards[:P], rewards[P:]
    return losses, {"rewards_chosen": chosen, "rewards_rejected": rejected,
                    "correct": chosen > rejected}


def summarize(stats: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Per-pair means of `pair_loss` statistics gathered over micro-batches: rewards_chosen,
    rewards_rejected, accuracy (share of pairs with chosen > rejected), margin (mean reward
    difference) and pairs. One host read of each tensor."""
    if not stats:
        return {}
    chosen = torch.cat([s["rewards_chosen"] for s in stats]).double().cpu()
    rejected = torch.cat([s["rewards_rejected"] for s in stats]).double().cpu()
    correct = torch.cat([s["correct"] for s in stats]).cpu()
    return {"rewards_chosen": float(chosen.mean()), "rewards_rejected": float(rejected.mean()),
            "accuracy": float(correct.double().mean()),
            "margin": float((chosen - rejected).mean()), "pairs": int(chosen.numel())}


@dataclass
class DPOObjective:
    """The DPO objective for the head (`runtime.objectives.Objective`).

    Args:
        beta: `dpo.beta`, > 0 (the KL penalty's inverse temperature).
        loss: `dpo.loss`, "sigmoid" or "ipo".

    The statistics of every micro-batch since the last `take_metrics` are kept (device
    tensors, [P] each) and read once per step.

    Raises:
        ValueError: beta <= 0 or an unknown loss.
    """

    beta: float = 0.1
    loss_type: str = "sigmoid"
    name = "dpo"
    chunk_local = False
    extra_keys = {"ref_logp": ROW}

    def __post_init__(self) -> None:
        if not self.beta > 0:
            raise ValueError(f"dpo.beta must be > 0; got {self.beta}")
        if self.loss_type not in DPO_LOSSES:
            raise ValueError(f"dpo.loss: {self.loss_type!r}; use one of {', '.join(DPO_LOSSES)}")
        self._stats: list[dict[str, torch.Tensor]] = []

    def denominator(self, batch: dict) -> float:
        """Pairs of the host batch (its rows / 2): the loss is a mean over the step's pairs."""
        return batch["input_ids"].shape[0] // 2

    def loss(self, logp: torch.Tensor, mask: torch.Tensor, extras: dict[str, torch.Tensor], *,
             denominator: float) -> torch.Tensor:
        """Sum of the micro-batch's pair losses / the step's pairs; 0-dim fp32.

        Args:
            logp: [2P, S] fp32 target log-probs (0 off the response); mask: [2P, S] bool.
            extras: {"ref_logp": [2P] fp32}.
            denominator: pairs of the step.
        """
        counts = mask.sum(dim=1).float()
        losses, stats = pair_loss((logp * mask).sum(dim=1), extras["ref_logp"].float(), counts,
                                  beta=self.beta, loss=self.loss_type)
        self._stats.append(stats)
        return losses.sum() / max(denominator, 1)

    def take_metrics(self) -> dict[str, float]:
        """`summarize` of the statistics since the last call, then forgets them."""
        stats, self._stats = self._stats, []
        return summarize(stats)
