"""The state one micro-batch carries through a step, and how it is made from a batch.

Owns `MicroBatch`: the micro-batch's tokens and shifted labels on the device, the per-block
inputs the adapter derives once (masks, positions), and what the forward leaves for the
backward of the same micro-batch (RNG states, kept graphs, weight handles, the router
statistics, the gradient waiting to drain). The engine fills and empties it; this module
knows nothing about plans, tiers or windows.

Legend: B = micro-batch, S = sequence length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lazytrain.models.adapter import ModelAdapter, shift_labels
from lazytrain.models.router_aux import RouterAux


@dataclass(slots=True)
class MicroBatch:
    """Per-micro-batch state computed once and reused by forward, recompute and backward."""

    index: int
    """Position in the step's micro-batches (0 is the first; the last makes gradients final)."""
    input_ids: torch.Tensor
    """[B, S] token ids on the device."""
    targets: torch.Tensor
    """[B, S] next-token labels (`shift_labels`), IGNORE_INDEX where no loss."""
    mask_inputs: dict = field(default_factory=dict)
    """`attention_mask` [B, S] and `position_ids` [B, S] as given (None: absent)."""
    kwargs: list[dict] = field(default_factory=list)
    """Per block j, its inputs besides the hidden state (`adapter.block_kwargs`), set in pre."""
    rng: dict[int, tuple] = field(default_factory=dict)
    """Block j -> RNG state before its forward (`block_autograd.rng_state`)."""
    kept: dict[int, tuple] = field(default_factory=dict)
    """Kept block j -> (input leaf, output, parameter leaves, router logits) until b{j}."""
    weights: dict[int, object] = field(default_factory=dict)
    """Block j -> its device weight handle (`DeviceWeights.load`) while it is held."""
    aux: RouterAux | None = None
    """MoE router aux-loss statistics (None when the model adds no aux loss)."""
    pending_drain: tuple | None = None
    """(group, device gradient, on_done) of the block whose backward just ran: drained at the
    start of the next window."""


def prepare_micro_batch(index: int, batch: dict, *, adapter: ModelAdapter,
                        device: torch.device) -> MicroBatch:
    """`batch` ("input_ids" and "labels" [B, S], optional "attention_mask" / "position_ids"
    [B, S]) moved to `device`, with shifted labels and the adapter's router statistics."""
    masks = {k: (None if batch.get(k) is None else batch[k].to(device))
             for k in ("attention_mask", "position_ids")}
    return MicroBatch(index=index, input_ids=batch["input_ids"].to(device), mask_inputs=masks,
                      targets=shift_labels(batch["labels"]).to(device),
                      aux=adapter.new_router_aux(masks["attention_mask"]))
