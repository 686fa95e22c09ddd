"""Truncated re-forward: the re-forward that feeds a block's own backward skips the block's
last projection, whose output only its backward would read and nothing does.

Owns which module of a decoder layer is its *tail* (the MLP's down projection, or a MoE layer's
routed experts: their down projections and the weighted combine) and the two autograd
functions that stand in for a tail during the re-forward. A stand-in returns zeros of the
tail's output shape (no compute) and, in the backward, turns the incoming gradient `g` of the
tail's output into the gradients of its input and weights, from the input the re-forward
recomputed:

    dense  y = a W^T + b          da = g W,  dW = g^T a,  db = sum_t g
    MoE    y_t = sum_e w_te (h_te Wd_e^T)   per expert e and routed token t:
           u = g_t Wd_e,  dh_te = w_te u,  dWd_e = sum_t w_te g_t^T h_te,  dw_te = <u, h_te>

(the combine-weight gradient by linearity: <g_t, h Wd^T> = <g_t Wd, h>, so the expert outputs
are never formed). The zeros reach the block's output only through the residual add (and, in
Phi3, a dropout on it), both linear, so the block's output value is wrong (it is not read) while
every gradient is exact. Which families may do this is their adapter entry's decision
(`families.DecoderLayout.full_reforward_reason`); a family whose layer reads the tail's output
(a post-feedforward norm) keeps the full re-forward.

Knows nothing about plans, tiers or the engine: `tail_stand_ins` finds the tails of one layer,
`stand_in_tails` swaps them in for the body of a `with`.
"""

from __future__ import annotations

import types
from contextlib import contextmanager

import torch
from torch import nn


class _DeferredLinear(torch.autograd.Function):
    """y = a W^T + b with y never formed: forward returns zeros [..., out_features]; backward
    gives da = g W, dW = g^T a, db = sum over tokens of g (torch.nn.Linear's gradients)."""

    @staticmethod
    def forward(ctx, a, weight, bias):  # pylint: disable=arguments-differ
        ctx.save_for_backward(a, weight)
        ctx.has_bias = bias is not None
        return a.new_zeros(()).expand(*a.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, g):  # pylint: disable=arguments-differ
        a, weight = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        grad_a = (g2 @ weight).view(a.shape) if ctx.needs_input_grad[0] else None
        grad_w = g2.t() @ a.reshape(-1, a.shape[-1]) if ctx.needs_input_grad[1] else None
        grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_a, grad_w, grad_b


def _deferred_down_proj(self: nn.Linear, a: torch.Tensor) -> torch.Tensor:
    return _DeferredLinear.apply(a, self.weight, self.bias)


class _DeferredCombine(torch.autograd.Function):
    """out[t] = sum over (e, k) routed to t of w[t, k] * h_e[t] Wd_e^T, never formed: forward
    returns zeros [T, H]; backward gives dh_e, dWd and dw by the module docstring's formulas.

    Inputs: routes (per hit expert: (e, top-k slot [n], token index [n])), T, weights [T, k],
    down [E, H, I], then h_e [n, I] per route."""

    @staticmethod
    def forward(ctx, routes, tokens, weights, down, *hs):  # pylint: disable=arguments-differ
        ctx.routes = routes
        ctx.save_for_backward(weights, down, *hs)
        return down.new_zeros(()).expand(tokens, down.shape[1])

    @staticmethod
    def backward(ctx, g):  # pylint: disable=arguments-differ
        weights, down, *hs = ctx.saved_tensors
        grad_w = torch.zeros_like(weights)
        grad_down = torch.zeros_like(down)
        grad_hs = []
        for (e, slot, token), h in zip(ctx.routes, hs):
            g_t = g[token]  # [n, H]
            w = weights[token, slot].unsqueeze(-1)  # [n, 1]; fp32 beside bf16 experts in HF
            u = g_t @ down[e]  # [n, I]
            grad_hs.append((w * u).to(h.dtype))
            grad_down[e] = (g_t * w).to(h.dtype).t() @ h
            grad_w[token, slot] = (u * h).sum(-1).to(weights.dtype)
        return (None, None, grad_w, grad_down, *grad_hs)


def _deferred_experts(self: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor) -> torch.Tensor:
    """HF's eager Qwen-style experts loop (gate_up_proj [E, 2I, H], down_proj [E, H, I],
    `act_fn(gate) * up`) up to each expert's down-projection input, then the deferred combine.
    hidden [T, H], top_k_index / top_k_weights [T, k] -> zeros [T, H] (see _DeferredCombine)."""
    routes, hs = [], []
    with torch.no_grad():
        hit = torch.unique(top_k_index).tolist()
    for e in hit:
        if e >= self.num_experts:  # HF's masked slot
            continue
        token, slot = torch.where(top_k_index == e)
        gate, up = nn.functional.linear(hidden[token], self.gate_up_proj[e]).chunk(2, dim=-1)
        routes.append((e, slot, token))
        hs.append(self.act_fn(gate) * up)
    return _DeferredCombine.apply(tuple(routes), hidden.shape[0], top_k_weights,
                                  self.down_proj, *hs)


def _is_qwen_experts(module: nn.Module) -> bool:
    """Experts stored as Qwen3-MoE/Mixtral do: 3D gate_up_proj [E, 2I, H] and down_proj
    [E, H, I] without biases, and an `act_fn`."""
    up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(up, nn.Parameter) and isinstance(down, nn.Parameter)
            and up.dim() == 3 and down.dim() == 3 and hasattr(module, "act_fn")
            and up.shape[1] == 2 * down.shape[2] and up.shape[2] == down.shape[1]
            and getattr(module, "gate_up_proj_bias", None) is None)


def tail_stand_ins(layer: nn.Module) -> tuple[tuple[nn.Module, object], ...]:
    """(module, stand-in forward) for the tail of one decoder layer of a family whose entry
    allows truncation: `mlp.experts` when they are Qwen-style routed experts (a shared expert
    keeps its full forward: Qwen3-Next gates its output, so its backward reads it), else
    `mlp.down_proj` when it is an nn.Linear; () when the layer has neither (nothing skipped)."""
    mlp = getattr(layer, "mlp", None)
    experts = getattr(mlp, "experts", None)
    if isinstance(experts, nn.Module) and _is_qwen_experts(experts):
        return ((experts, _deferred_experts),)
    down = getattr(mlp, "down_proj", None)
    if isinstance(down, nn.Linear):
        return ((down, _deferred_down_proj),)
    return ()


@contextmanager
def stand_in_tails(tails: tuple[tuple[nn.Module, object], ...]):
    """Inside the body, each tail module runs its stand-in forward (an instance attribute over
    the class's forward, HF's experts-implementation dispatch included); restored after."""
    for module, forward in tails:
        module.forward = types.MethodType(forward, module)
    try:
        yield
    finally:
        for module, _ in tails:
            del module.forward
