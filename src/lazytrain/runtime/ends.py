"""The resident ends: embedding, final norm and LM head on the device for a step, their fp32
gradient, and the head/loss loop in sequence chunks.

Owns what the engine does with the model's two ends: load the ends' weights once per step (they
stay on the device for the whole step, as the plan counts them), embed the tokens (boundary 0),
run final norm + head + loss chunk by chunk with its backward (SFT's fused cross entropy, or
a `runtime.objectives` objective over the targets' log-probs, in one pass when it is
chunk-local and in two otherwise), run the embedding backward,
accumulate the ends gradient on the device over the step's micro-batches and hand it to the
gradient drain once per step. Knows nothing about blocks, tiers or windows: the
engine decides when each of these runs (`pre`, `turn`, `post`).

Legend: B = micro-batch, S = sequence length, H = hidden size, V = vocabulary size.
"""

from __future__ import annotations

import torch

from lazytrain.models.adapter import IGNORE_INDEX, ModelAdapter
from lazytrain.models.host_params import ParamGroup
from lazytrain.runtime.device import Device, Event
from lazytrain.runtime.objectives import Objective, SFTObjective, chunk_extras, target_logprobs
from lazytrain.runtime.streams import DeviceWeights, GradDrain


def head_loss_chunks(adapter: ModelAdapter, ends: ParamGroup, *, weights: torch.Tensor,
                     grad: torch.Tensor, h: torch.Tensor, targets: torch.Tensor, tokens: int,
                     chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Final norm + LM head + loss and their backward, chunk by chunk along the sequence; never
    materialises [B, S, V] logits.

    Each weight is its own autograd leaf (a view of `weights`, no copy: no ends-sized zero
    gradient per chunk) and its gradient is accumulated in place into `grad`.

    Args:
        adapter: the model (`head_loss_sum`, `head_name`, `layout.norm`).
        ends: the ends' parameter group (its layout gives the views).
        weights: the ends' device weights [ends.numel], compute dtype.
        grad: the ends' fp32 gradient [ends.numel], accumulated into (not zeroed here).
        h: boundary L [B, S, H], the head's input.
        targets: shifted labels [B, S] (IGNORE_INDEX where no loss).
        tokens: label tokens the loss is divided by (the whole step's; at least 1 is used).
        chunk_tokens: flattened tokens per chunk; a chunk covers max(1, chunk_tokens // B)
            positions.

    Returns:
        (the summed loss of the chunks as a 0-dim fp32 device tensor, d loss / d h [B, S, H]).
    """
    norm_name = f"{adapter.layout.norm}.weight"
    names = list(dict.fromkeys((norm_name, adapter.head_name)))  # tied head: one leaf
    weight_views, grad_views = ends.views(weights), ends.views(grad)
    grad_h = torch.empty_like(h)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    chunk = max(1, chunk_tokens // h.shape[0])  # positions of [B, chunk] tokens
    for a in range(0, h.shape[1], chunk):
        b = min(h.shape[1], a + chunk)
        # one chunk per call: its logits and the head weight's [V, H] gradient are freed when
        # it returns, before the next chunk allocates (the planner's head workspace,
        # `spec/costs.py`, counts one chunk's tensors)
        total += _head_loss_chunk(adapter, h[:, a:b], targets[:, a:b], grad_h[:, a:b],
                                  weights={n: weight_views[n] for n in names},
                                  grads={n: grad_views[n] for n in names}, norm_name=norm_name,
                                  tokens=tokens)
    return total, grad_h


def _head_loss_chunk(adapter: ModelAdapter, h: torch.Tensor, targets: torch.Tensor,
                     grad_h: torch.Tensor, *, weights: dict[str, torch.Tensor],
                     grads: dict[str, torch.Tensor], norm_name: str, tokens: int
                     ) -> torch.Tensor:
    """One chunk of `head_loss_chunks`: its loss (0-dim fp32, detached); d loss / d h written
    into `grad_h` [B, C, H] and each weight's gradient added in place into `grads` (fp32)."""
    x = h.detach().requires_grad_()
    leaves = {n: w.detach().requires_grad_() for n, w in weights.items()}
    with torch.enable_grad():
        loss = adapter.head_loss_sum(x, targets, norm_weight=leaves[norm_name],
                                     head_weight=leaves[adapter.head_name]) / max(tokens, 1)
    gx, *gw = torch.autograd.grad(loss, (x, *leaves.values()))
    grad_h.copy_(gx)
    for n, g in zip(leaves, gw):
        grads[n].add_(g)  # accumulated in place, fp32
    return loss.detach()  # on the device: no host sync per chunk


def objective_loss_chunks(adapter: ModelAdapter, ends: ParamGroup, objective: Objective, *,
                          weights: torch.Tensor, grad: torch.Tensor, h: torch.Tensor,
                          targets: torch.Tensor, extras: dict[str, torch.Tensor],
                          denominator: float, chunk_tokens: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """`head_loss_chunks` for an objective over the targets' log-probs (`runtime.objectives`):
    final norm + LM head chunk by chunk, never [B, S, V] logits.

    Chunk-local objectives: each chunk's loss from its logp [B, C], back-propagated at once.
    Others, two passes: logp [B, S] fp32 without gradient; g = d loss / d logp by autograd on
    that [B, S] graph; then each chunk recomputed and back-propagated with g[:, a:b]
    (d loss / d h[:, a:b] = sum_t g[b, t] d logp[b, t] / d h: the chain rule, exact). The second
    pass costs one more head forward per chunk; memory stays one chunk's logits.

    Args:
        adapter, ends, weights, grad, h, targets, chunk_tokens: as `head_loss_chunks`.
        objective: the objective (`chunk_local`, `loss`, `extra_keys`).
        extras: the micro-batch's extra tensors on the device (`Objective.extra_keys`).
        denominator: the step's normaliser (sum of `objective.denominator` over the step).

    Returns:
        (the loss, a 0-dim fp32 device tensor, d loss / d h [B, S, H]).
    """
    norm_name = f"{adapter.layout.norm}.weight"
    names = list(dict.fromkeys((norm_name, adapter.head_name)))  # tied head: one leaf
    weight_views, grad_views = ends.views(weights), ends.views(grad)
    chunk_weights = {n: weight_views[n] for n in names}
    grad_h = torch.empty_like(h)
    mask = targets != IGNORE_INDEX
    chunk = max(1, chunk_tokens // h.shape[0])
    spans = [(a, min(h.shape[1], a + chunk)) for a in range(0, h.shape[1], chunk)]

    def chunk_logp(a: int, b: int, leaves: dict[str, torch.Tensor], x: torch.Tensor):
        logits = adapter.head_logits(x, norm_weight=leaves[norm_name],
                                     head_weight=leaves[adapter.head_name])
        return target_logprobs(logits, targets[:, a:b])

    def backward(a: int, b: int, out_fn) -> torch.Tensor:
        """One chunk's graph: out_fn(logp_chunk) -> (scalar to differentiate, loss to report)."""
        x = h[:, a:b].detach().requires_grad_()
        leaves = {n: w.detach().requires_grad_() for n, w in chunk_weights.items()}
        with torch.enable_grad():
            target, reported = out_fn(chunk_logp(a, b, leaves, x))
        gx, *gw = torch.autograd.grad(target, (x, *leaves.values()))
        grad_h[:, a:b].copy_(gx)
        for n, g in zip(leaves, gw):
            grad_views[n].add_(g)  # accumulated in place, fp32
        return reported.detach()

    if objective.chunk_local:
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for a, b in spans:
            def local(lp, a=a, b=b):
                loss = objective.loss(lp, mask[:, a:b], chunk_extras(objective, extras, a, b),
                                      denominator=denominator)
                return loss, loss
            total += backward(a, b, local)
        return total, grad_h
    logp = torch.empty(targets.shape, dtype=torch.float32, device=h.device)
    with torch.no_grad():  # pass 1: logp [B, S]
        for a, b in spans:
            logp[:, a:b] = chunk_logp(a, b, chunk_weights, h[:, a:b])
    lp = logp.requires_grad_()
    with torch.enable_grad():
        loss = objective.loss(lp, mask, extras, denominator=denominator)
    (g_logp,) = torch.autograd.grad(loss, (lp,))
    for a, b in spans:  # pass 2: each chunk again, back-propagating g
        backward(a, b, lambda chunk_lp, a=a, b=b: ((chunk_lp * g_logp[:, a:b]).sum(), loss))
    return loss.detach(), grad_h


class ResidentEnds:
    """The ends' device weights and fp32 gradient for one engine, and what runs on them.

    Args:
        adapter: the model; its `params.ends` group holds the host masters and gradient.
        dev: the device API (allocations, events).
        dtype: the compute dtype of the device weights.
        head_chunk_tokens: flattened tokens per head/loss chunk (`head_loss_chunks`; default
            of the engine and the config: `lazytrain.contract.HEAD_CHUNK_TOKENS`).

    `objective` (attribute, default `SFTObjective`): the training objective the head runs
    (`runtime.objectives`); the trainer sets it from `train.method` before the first step.
    """

    def __init__(self, adapter: ModelAdapter, dev: Device, *, dtype: torch.dtype,
                 head_chunk_tokens: int) -> None:
        self.adapter, self.dev, self.dtype = adapter, dev, dtype
        self.group = adapter.params.ends
        self.head_chunk_tokens = head_chunk_tokens
        self.weights: torch.Tensor | None = None
        """[ends numel] in the compute dtype, on the device for the step (after `load`)."""
        self.grad: torch.Tensor | None = None
        """[ends numel] fp32 gradient of the step, accumulated over its micro-batches (after
        `reset_gradient`): the planner counts `lazytrain.contract.ENDS_GRAD_BYTES_PER_PARAM` bytes per parameter."""
        self._drained: Event | None = None  # the event of the gradient's last D2H (per step)
        self.objective: Objective = SFTObjective()

    def load(self, weights: DeviceWeights) -> None:
        """Copy the ends' masters to the device for the step, into the one device buffer the
        ends keep for the whole run (allocated by the first load): the plan counts one copy
        (`ends_bytes`), so a step never holds the previous step's weights beside the new ones.
        The caller waits for their pending optimizer update first.

        Through the pinned staging ring, converted on the host: no fp32 device copy, no
        pageable (blocking) source; the H2D waits for the compute queued before it (the
        previous step's reads of the buffer) and compute waits for the last chunk.
        """
        if self.weights is None:
            self.weights = self.dev.empty(self.group.numel, self.dtype, name="ends weights")
        self.dev.wait_event(self.dev.compute, weights.load_flat(self.weights, self.group.master))

    def reset_gradient(self, *, first: bool = True) -> None:
        """The fp32 ends gradient, zeroed at the step's first micro-batch (`first`) and
        accumulated on the device across the step's micro-batches: one buffer for the whole
        run (the plan counts one, `ends_bytes`), zeroed in place only after the previous
        step's drain of it ran (the compute stream waits for that copy's event)."""
        if not first:
            return
        if self.grad is None:
            self.grad = self.dev.empty(self.group.numel, torch.float32, name="ends gradient")
        else:
            self.dev.wait_event(self.dev.compute, self._drained)
        self.grad.zero_()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Boundary 0: [B, S, H] embedding of `input_ids` [B, S] (no autograd)."""
        with torch.no_grad():
            return self.adapter.embed(input_ids, self._view(self.adapter.embed_name))

    def head_and_loss(self, h: torch.Tensor, targets: torch.Tensor, tokens: float, *,
                      extras: dict[str, torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The objective's head on the resident weights, into the ends gradient: SFT through
        `head_loss_chunks` (its fused cross entropy, numbers as ever), any other objective
        through `objective_loss_chunks`.

        Args:
            h: boundary L [B, S, H]; targets: shifted labels [B, S].
            tokens: the step's normaliser (label tokens for SFT; `Objective.denominator`).
            extras: the micro-batch's extra tensors on the device (`Objective.extra_keys`).

        Returns:
            (the loss summed over the chunks: a 0-dim fp32 device tensor, left there so that
            the host does not wait for the device each micro-batch, d loss / d h [B, S, H]).
        """
        if not isinstance(self.objective, SFTObjective):
            return objective_loss_chunks(
                self.adapter, self.group, self.objective, weights=self.weights, grad=self.grad,
                h=h, targets=targets, extras=extras or {}, denominator=tokens,
                chunk_tokens=self.head_chunk_tokens)
        return head_loss_chunks(self.adapter, self.group, weights=self.weights, grad=self.grad,
                                h=h, targets=targets, tokens=tokens,
                                chunk_tokens=self.head_chunk_tokens)

    def embed_backward(self, input_ids: torch.Tensor, grad: torch.Tensor) -> None:
        """d loss / d embedding weight from `grad` = d loss / d boundary 0 [B, S, H], added in
        place into the fp32 ends gradient."""
        name = self.adapter.embed_name
        w = self._view(name).detach().requires_grad_()
        with torch.enable_grad():
            out = self.adapter.embed(input_ids, w)
        (gw,) = torch.autograd.grad(out, (w,), grad)
        self.group.views(self.grad)[name].add_(gw)  # in place, fp32

    def drain_gradient(self, drain: GradDrain, *, on_done=None) -> None:
        """Start the step's one D2H of the ends gradient (after the last micro-batch's
        embedding backward) into the host accumulator (`GradDrain.drain_fp32`: a same-dtype
        copy, no converting D2H and no device temporary); `reset_gradient` waits for it before
        the next step zeroes the buffer."""
        self._drained = drain.drain_fp32(self.group, self.grad, on_done=on_done)

    def _view(self, name: str) -> torch.Tensor:
        return self.group.views(self.weights)[name]
