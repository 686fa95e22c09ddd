"""The state one micro-batch carries through a step, and how it is made from a batch.

Owns `MicroBatch`: the micro-batch's tokens and shifted labels on the device, the per-block
inputs the adapter derives once (masks, positions), and what the forward leaves for the
backward of the same micro-batch (RNG states, kept graphs, weight handles, the router
statistics, the gradient waiting to drain). The engine fills and empties it; this module
knows nothing about plans, tiers or windows.

Everything the step needs to know about a batch's values (its label tokens, whether it pads or
packs) is read here on the host batch, before its H2D: read on the device it would be a host
sync per micro-batch.

Legend: B = micro-batch, S = sequence length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lazytrain.models.adapter import IGNORE_INDEX, ModelAdapter, shift_labels
from lazytrain.models.router_aux import RouterAux
from lazytrain.planner.plan_checks import PlanValidationError
from lazytrain.runtime.device import Device


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
    """`attention_mask` [B, S] and `position_ids` [B, S] as given (None: absent), and the host
    facts `padded` / `packed` (`ModelAdapter.block_kwargs`)."""
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
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    """The objective's extra tensors on the device (`runtime.objectives.Objective.extra_keys`:
    reference log-probs, advantages, ...); empty for SFT."""
    pending_drain: tuple | None = None
    """(group, device gradient, on_done) of the block whose backward just ran: drained at the
    start of the next window."""


FILLER = "filler"
"""Batch key, a host bool: True marks a micro-batch that only fills `train.grad_accum` (GRPO's
filler, all labels IGNORE_INDEX). It adds no loss term at all: not even the MoE router aux
loss, which HF adds for every forward (its pad tokens would otherwise train the routers)."""


def label_tokens(batch: dict) -> int:
    """Label tokens of a host batch (next-token targets that are not IGNORE_INDEX), counted
    on the host before its H2D (on the device the count would be a sync per micro-batch)."""
    return int((shift_labels(batch["labels"]) != IGNORE_INDEX).sum())


def check_planned_shape(m: int, batch: dict, provenance: dict) -> None:
    """Micro-batch m's [B, S] against the plan's provenance `micro_batch` and `seq_len`: fewer
    or shorter rows need less memory and time than planned (GRPO cuts its rollouts' padding);
    more would break the plan's budgets.

    Raises:
        PlanValidationError: more rows or tokens per row than planned (names the key).
    """
    rows, width = batch["input_ids"].shape
    for key, have in (("micro_batch", rows), ("seq_len", width)):
        if provenance.get(key) is not None and have > provenance[key]:
            raise PlanValidationError(
                f"micro-batch {m}: {key} {have} exceeds the plan's {key}={provenance[key]}; "
                f"re-plan with `lazytrain plan` for this shape")


def prepare_micro_batch(index: int, batch: dict, *, adapter: ModelAdapter,
                        dev: Device, extra_keys=()) -> MicroBatch:
    """`batch` ("input_ids" and "labels" [B, S], optional "attention_mask" / "position_ids"
    [B, S], host tensors) moved to `dev` (`Device.batch_to_device`), with shifted labels and
    the adapter's router statistics (none for a `FILLER` batch: no router aux loss); whether it
    pads and packs is read on the host first. `extra_keys`: batch keys of the objective's extra
    tensors, moved with it (`MicroBatch.extras`).

    Raises:
        ValueError: packed rows on a model with linear-attention layers
            (`ModelAdapter.check_packing`).
    """
    mask, positions = batch.get("attention_mask"), batch.get("position_ids")
    padded = mask is not None and not bool(mask.all())
    if positions is not None and torch.equal(
            positions, torch.arange(positions.shape[-1]).expand_as(positions)):
        positions = None  # the default positions: masks and rotary tables once per shape
    packed = positions is not None and bool((positions.diff(dim=-1) != 1).any())
    if positions is not None:
        adapter.check_packing(positions)  # refused on linear-attention layers
    moved = {"attention_mask": dev.batch_to_device(mask) if padded else None,
             "position_ids": dev.batch_to_device(positions)}
    return MicroBatch(index=index, input_ids=dev.batch_to_device(batch["input_ids"]),
                      mask_inputs={**moved, "padded": padded, "packed": packed},
                      targets=dev.batch_to_device(shift_labels(batch["labels"])),
                      aux=(None if batch.get(FILLER)
                           else adapter.new_router_aux(moved["attention_mask"])),
                      extras={k: dev.batch_to_device(batch[k]) for k in extra_keys})

