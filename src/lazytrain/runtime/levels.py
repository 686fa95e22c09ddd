"""Per-block forward and backward by save level: what f{j} keeps and how b{j} gets its graph.

Owns the dispatch the plan's `keep_internals` and `save_levels` ask for (docs/execution_model.md,
"Save levels"), one block at a time:

| block j            | f{j}                                  | b{j}                                   |
|--------------------|---------------------------------------|----------------------------------------|
| kept               | autograd, the whole graph kept        | back-propagates the kept graph         |
| L0, no save levels | no grad                               | re-forward in full, then backward      |
| L0                 | no grad                               | truncated re-forward, then backward    |
| L1 / L2            | `forward_saving`: saved internals go  | `backward_saved` on the weights loaded |
|                    | to the `SavedStore` (tier hbm / dram) | for b{j} and the stored boundary j     |

and issuing the plan's `internal_transfers` of a window (d2h then h2d, after the window's
compute). The weights, the activation store, the RNG
replay and the gradient drain are the engine's (`runtime/engine.py`); the saved tensors' hooks
are `models/saved_tensors.py`'s. Knows nothing about windows beyond the names the plan gives.

Legend: B = micro-batch, S = sequence length, H = hidden size.
"""

from __future__ import annotations

import torch

from lazytrain.models.saved_tensors import backward_saved, forward_saving
from lazytrain.planner.plan import Plan
from lazytrain.runtime.block_autograd import grad_leaves, replay_rng
from lazytrain.runtime.micro_batch import MicroBatch
from lazytrain.runtime.saved_store import saved_owner

SAVING_LEVELS = ("L1", "L2")
"""Levels whose f{j} runs with autograd and keeps internals for b{j}."""


class BlockLevels:
    """The engine's per-block forward/backward, by the plan's keep and save levels.

    Args:
        engine: the `Engine` it serves (its adapter, params, weights, activation store,
            saved-internals store `engine.saved`, device and ledger owner scope).
    """

    def __init__(self, engine) -> None:
        self.e = engine
        self.set_plan(engine.plan)

    def set_plan(self, plan: Plan) -> None:
        """Follow `plan` from the next step on (`Engine.set_plan`)."""
        self.plan = plan
        self.truncated = not plan.reforwards_in_full
        """L0's re-forward: truncated when the plan gives save levels, else in full."""

    def saves(self, j: int) -> bool:
        """Whether block j is at L1/L2 (a kept block is L0 by the contract)."""
        return self.plan.level_of(j) in SAVING_LEVELS and j not in self.e.keep

    # --- forward (f{j}) ------------------------------------------------------------------------

    def forward(self, mb: MicroBatch, j: int, h: torch.Tensor, flat: torch.Tensor,
                logits: list | None) -> torch.Tensor:
        """Block j's forward with autograd, for a kept or an L1/L2 block: [B, S, H] -> the
        output [B, S, H], detached. A kept block's graph goes to `mb.kept`; an L1/L2 block's
        saved internals to the saved-internals store in the plan's saved tier (its weights
        are not kept: they stream again for b{j})."""
        e = self.e
        leaves = grad_leaves(e.params.blocks[j], flat)
        if j in e.keep:
            x = h.detach().requires_grad_()
            with torch.enable_grad(), e._owner(f"kept graph of block {j}"):
                out = e.adapter.forward_block(j, x, leaves, mb.kwargs[j], router_logits=logits)
            mb.kept[j] = (x, out, leaves, logits)
            return out.detach()
        with torch.enable_grad(), e._owner(saved_owner(j)):  # the graph holds neither h nor flat
            out, saved = forward_saving(e.adapter, j, h, leaves, flat, mb.kwargs[j],
                                        level=self.plan.level_of(j), router_logits=logits)
        e.saved.put(j, saved, self.plan.saved_tier_of(j), micro_batch=mb.index)
        return out

    # --- backward (b{j}) -----------------------------------------------------------------------

    def backward(self, mb: MicroBatch, j: int, grad: torch.Tensor
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor], list]:
        """Block j's backward given d loss / d boundary j+1 `grad` [B, S, H].

        Returns:
            (d loss / d boundary j [B, S, H], the parameter leaves over the flat device weights
            {local name: tensor}, their gradients in that order (None: unused)).
        """
        e = self.e
        if self.saves(j):
            return self._backward_saved(mb, j, grad)
        if j in mb.kept:
            x, out, leaves, logits = mb.kept.pop(j)
        else:
            x = e.store.get(j, micro_batch=mb.index).detach().requires_grad_()
            leaves = grad_leaves(e.params.blocks[j], e.weights.ready(mb.weights[j]))
            logits = None if mb.aux is None else []
            with torch.enable_grad(), replay_rng(mb.rng[j], e.device, is_cuda=e.dev.is_cuda):
                out = e.adapter.forward_block(j, x, leaves, mb.kwargs[j], router_logits=logits,
                                              truncated=self.truncated)
        outs, grads = [out], [grad]
        aux = None if mb.aux is None else mb.aux.block_term(logits)
        if aux is not None:  # block j's exact share of d(coef * aux) (models/router_aux.py)
            outs.append(aux)
            grads.append(torch.ones_like(aux))
        grad_x, *leaf_grads = torch.autograd.grad(outs, (x, *leaves.values()), grads,
                                                  allow_unused=True)
        return grad_x, leaves, leaf_grads

    def _backward_saved(self, mb: MicroBatch, j: int, grad: torch.Tensor):
        """L1/L2: the saved graph, on the weights loaded for b{j} and the stored boundary j
        (`backward_saved`; L1's re-run of the block's rest draws the forward's dropout masks
        by itself); the internals are released at its end."""
        e = self.e
        saved = e.saved.take(j, micro_batch=mb.index)
        x = e.store.get(j, micro_batch=mb.index)
        flat = e.weights.ready(mb.weights[j])
        leaves = grad_leaves(e.params.blocks[j], flat)
        with torch.enable_grad():
            grad_x, named = backward_saved(e.adapter, j, saved, x, leaves, flat, mb.kwargs[j],
                                           grad, aux=mb.aux)
        del saved
        e.saved.release(j, micro_batch=mb.index)
        return grad_x, leaves, [named.get(name) for name in leaves]

    def abandon(self) -> None:
        """A failed step: release every saved entry it left."""
        self.e.saved.abandon()

    # --- internal transfers ------------------------------------------------------------------

    def issue(self, window: str, mb: MicroBatch, *, after_compute: bool) -> None:
        """The plan's internal transfers of `window`, all queued after the window's compute:
        the d2h (they may wait for a pool buffer) behind the boundary d2h, then the h2d, last
        on the H2D stream, behind the weight and recompute loads (docs/execution_model.md,
        "In-window order"). An h2d is never used in its own window, so queuing it late costs
        nothing and leaves the recompute chain as the planner prices it."""
        if not after_compute:
            return
        transfers = self.plan.internal_transfers_in(window)
        for kind in ("d2h", "h2d"):
            for t in transfers:
                if t.kind == kind:
                    self.e.saved.transfer(t.block, t.kind, t.fraction, micro_batch=mb.index)
