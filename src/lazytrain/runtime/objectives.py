"""Training objectives over the per-token log-probabilities of the targets: the loss API that the
head (`runtime.ends`) runs for SFT, DPO and GRPO.

An objective sees only `logp` [B, S] fp32, the log-probability the model gives each target
(position t predicts token t+1, as `models.adapter.shift_labels`; 0 where the target is
IGNORE_INDEX), the mask of those targets [B, S] bool, and the extra tensors its micro-batch
carries (reference log-probs, advantages, old log-probs: `extra_keys`), already on the device.
It never sees logits: the head computes them chunk by chunk along the sequence ([B, C, V],
never [B, S, V]) and hands the objective their target log-probs.

How the head back-propagates depends on `chunk_local`:

- chunk-local (the loss is a sum of per-chunk terms: SFT, GRPO's per-token clipped term): each
  chunk's loss is computed from its own logp and back-propagated at once, one pass.
- not chunk-local (DPO: nonlinear in per-sequence sums): pass 1 computes logp [B, S] without
  gradient, chunk by chunk; the objective's gradient g = d loss / d logp [B, S] comes from
  autograd on that small graph; pass 2 recomputes each chunk's logp and back-propagates g
  through it (d loss / d h = sum_t g[b, t] * d logp[b, t] / d h, exact by the chain rule).

Knows nothing about blocks, plans or devices; the engine and the head call it.

Legend: B = rows of the micro-batch, S = sequence length, C = chunk positions, V = vocabulary.
"""

from __future__ import annotations

from typing import Protocol

import torch

from lazytrain.models.adapter import IGNORE_INDEX
from lazytrain.runtime.micro_batch import label_tokens

ROW, TOKEN = "row", "token"
"""Kinds of extra tensors: per row [B] or per target position [B, S] (aligned with logp)."""


class Objective(Protocol):
    """What the head needs from a training objective.

    Attributes:
        name: the `train.method` it implements.
        chunk_local: True when `loss` over a whole micro-batch equals the sum of `loss` over
            its sequence chunks (one pass); False: the two-pass head (module docstring).
        extra_keys: batch key -> ROW ([B] per row) or TOKEN ([B, S], aligned with the shifted
            targets): host tensors of the batch moved to the device with it
            (`runtime.micro_batch.prepare_micro_batch`) and handed to `loss`, TOKEN ones sliced
            to the chunk for a chunk-local objective.
    """

    name: str
    chunk_local: bool
    extra_keys: dict[str, str]

    def denominator(self, batch: dict) -> float:
        """What a host batch adds to the step's normaliser (label tokens, pairs, rows); the
        engine sums it over the step's micro-batches (and ranks) and passes the sum to
        `loss`, so that gradient accumulation equals the big-batch gradient."""
        ...

    def loss(self, logp: torch.Tensor, mask: torch.Tensor, extras: dict[str, torch.Tensor], *,
             denominator: float) -> torch.Tensor:
        """The micro-batch's (or chunk's) share of the step loss: a 0-dim fp32 tensor
        differentiable in `logp` [B, S or C] fp32; `mask` [B, S or C] bool marks targets."""
        ...


class SFTObjective:
    """Next-token cross entropy: loss = -sum_{b,t: mask} logp[b, t] / (label tokens of the
    step). Chunk-local.

    The head keeps its fused path for SFT (`models.adapter.ModelAdapter.head_loss_sum`:
    `F.cross_entropy(reduction="sum")` on the chunk's logits), which equals this formula; `loss`
    states it for references and for objectives built on it.
    """

    name = "sft"
    chunk_local = True
    extra_keys: dict[str, str] = {}

    def denominator(self, batch: dict) -> float:
        """Label tokens of the host batch (targets that are not IGNORE_INDEX)."""
        return label_tokens(batch)  # an int: SFT's numbers exactly as before the API

    def loss(self, logp, mask, extras, *, denominator):
        """-sum(logp over targets) / max(denominator, 1); 0-dim fp32."""
        return -(logp * mask).sum() / max(denominator, 1.0)


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) of each position: [B, C, V] fp32 logits, [B, C] int64 targets ->
    [B, C] fp32, 0 where the target is IGNORE_INDEX.

    -cross_entropy(reduction="none"): the same kernel (and memory: one chunk's log-softmax) as
    the SFT path, differentiable in the logits.
    """
    B, C, V = logits.shape
    return -torch.nn.functional.cross_entropy(logits.reshape(B * C, V), targets.reshape(-1),
                                              ignore_index=IGNORE_INDEX,
                                              reduction="none").view(B, C)


def chunk_extras(objective: Objective, extras: dict[str, torch.Tensor], a: int, b: int
                 ) -> dict[str, torch.Tensor]:
    """`extras` for positions [a, b): TOKEN tensors sliced along the sequence, ROW ones whole."""
    return {k: v[:, a:b] if objective.extra_keys.get(k) == TOKEN else v
            for k, v in extras.items()}

