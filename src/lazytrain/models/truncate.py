"""Truncated re-forward: the re-forward that feeds a block's own backward skips the block's
last projection, whose output only its backward would read and nothing does.

Owns which module of a decoder layer is its *tail* (the MLP's down projection, or a MoE layer's
routed experts: their down projections and the weighted combine) and the two autograd
functions that stand in for a tail during the re-forward. A stand-in returns zeros of the
tail's output shape (no compute) and, in the backward, turns the incoming gradient `g` of the
tail's output into the gradients of its input and weights, from the input the re-forward
recomputed:

    dense  y = a W^T + b          da = g W,  dW = g^T a,  db = sum_t g
    MoE    y_t = sum_e w_te (h_te Wd_e^T + b_e)   per expert e and routed token t:
           u = g_t Wd_e,  dh_te = w_te u,  dWd_e = sum_t w_te g_t^T h_te,
           db_e = sum_t w_te g_t,  dw_te = <u, h_te> + <g_t, b_e>

(the combine-weight gradient by linearity: <g_t, h Wd^T> = <g_t Wd, h>, so the expert outputs
are never formed). Expert layouts: Qwen3-MoE/Qwen3-Next/Qwen3.5-MoE/Mixtral/DeepSeek-V2
(gate_up_proj [E, 2I, H], down_proj [E, H, I], no biases) and GPT-OSS (transposed, biased,
clamped SwiGLU); the h_te are recomputed as HF's eager experts loop computes them.

The zeros reach the block's output only through the residual add (and, in Phi3, a dropout on
it), both linear, so the block's output value is wrong (it is not read) while every gradient is
exact. The add itself still runs (one elementwise [B, S, H] op against a zero-stride tensor).
Which families may do this is their adapter entry's decision
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
    def forward(ctx, a, weight, bias):
        ctx.save_for_backward(a, weight)
        ctx.has_bias = bias is not None
        return a.new_zeros(()).expand(*a.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, g):
        a, weight = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        grad_a = (g2 @ weight).view(a.shape) if ctx.needs_input_grad[0] else None
        grad_w = g2.t() @ a.reshape(-1, a.shape[-1]) if ctx.needs_input_grad[1] else None
        grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_a, grad_w, grad_b


def _deferred_down_proj(self: nn.Linear, a: torch.Tensor) -> torch.Tensor:
    return _DeferredLinear.apply(a, self.weight, self.bias)


class _DeferredCombine(torch.autograd.Function):
    """out[t] = sum over (e, k) routed to t of w[t, k] * (h_e[t] Wd_e^T + b_e), never formed:
    forward returns zeros [T, H]; backward gives dh_e, dWd, db and dw by the module docstring's
    formulas (dw gains <g_t, b_e> with a bias).

    Inputs: routes (per hit expert: (e, top-k slot [n], token index [n])), T, `transposed`
    (down is [E, I, H], GPT-OSS, instead of [E, H, I]), weights [T, k], down, bias [E, H] or
    None, then h_e [n, I] per route."""

    @staticmethod
    def forward(ctx, routes, tokens, transposed, weights, down, bias, *hs):
        ctx.routes, ctx.transposed, ctx.has_bias = routes, transposed, bias is not None
        ctx.save_for_backward(weights, down, bias, *hs)
        return down.new_zeros(()).expand(tokens, down.shape[2 if transposed else 1])

    @staticmethod
    def backward(ctx, g):
        weights, down, bias, *hs = ctx.saved_tensors
        grad_w, grad_down = torch.zeros_like(weights), torch.zeros_like(down)
        grad_bias = torch.zeros_like(bias) if ctx.has_bias else None
        grad_hs = []
        for (e, slot, token), h in zip(ctx.routes, hs):
            g_t = g[token]  # [n, H]
            w = weights[token, slot].unsqueeze(-1)  # [n, 1]; fp32 beside bf16 experts in HF
            wd = down[e].t() if ctx.transposed else down[e]  # [H, I]
            u = g_t @ wd  # [n, I]
            gw = (g_t * w).to(h.dtype)
            grad_hs.append((w * u).to(h.dtype))
            grad_down[e] = h.t() @ gw if ctx.transposed else gw.t() @ h
            dw = (u * h).sum(-1)
            if ctx.has_bias:
                grad_bias[e] = gw.sum(0)
                dw = dw + (g_t * bias[e]).sum(-1)
            grad_w[token, slot] = dw.to(weights.dtype)
        return (None, None, None, grad_w, grad_down, grad_bias, *grad_hs)


def _routes(top_k_index: torch.Tensor, num_experts: int):
    """(expert, token index [n], top-k slot [n]) of every expert that receives a token, as HF's
    loop visits them (slots past `num_experts` are HF's masked ones)."""
    with torch.no_grad():
        hit = torch.unique(top_k_index).tolist()
    for e in hit:
        if e < num_experts:
            yield (e, *torch.where(top_k_index == e))


def _deferred_experts(self: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor) -> torch.Tensor:
    """HF's eager Qwen-style experts loop (gate_up_proj [E, 2I, H], down_proj [E, H, I],
    `act_fn(gate) * up`) up to each expert's down-projection input, then the deferred combine.
    hidden [T, H], top_k_index / top_k_weights [T, k] -> zeros [T, H] (see _DeferredCombine)."""
    routes, hs = [], []
    for e, token, slot in _routes(top_k_index, self.num_experts):
        gate, up = nn.functional.linear(hidden[token], self.gate_up_proj[e]).chunk(2, dim=-1)
        routes.append((e, slot, token))
        hs.append(self.act_fn(gate) * up)
    return _DeferredCombine.apply(tuple(routes), hidden.shape[0], False, top_k_weights,
                                  self.down_proj, None, *hs)


def _deferred_transposed_experts(self: nn.Module, hidden: torch.Tensor, router_indices,
                                 routing_weights) -> torch.Tensor:
    """GPT-OSS's eager experts loop (gate_up_proj [E, H, 2I] + bias, `_apply_gate`, down_proj
    [E, I, H] + bias) up to each expert's down-projection input, then the deferred combine."""
    routes, hs = [], []
    for e, token, slot in _routes(router_indices, self.num_experts):
        gate_up = hidden[token] @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
        routes.append((e, slot, token))
        hs.append(self._apply_gate(gate_up))  # HF's own gate
    return _DeferredCombine.apply(tuple(routes), hidden.shape[0], True, routing_weights,
                                  self.down_proj, self.down_proj_bias, *hs)


def _experts_kind(module: nn.Module) -> str | None:
    """"qwen" for experts stored as Qwen3-MoE/Mixtral do (3D gate_up_proj [E, 2I, H] and
    down_proj [E, H, I], no biases, an `act_fn`), "transposed" for GPT-OSS's ([E, H, 2I] and
    [E, I, H] with biases and `_apply_gate`), else None."""
    up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(up, nn.Parameter) and isinstance(down, nn.Parameter)
            and up.dim() == 3 and down.dim() == 3):
        return None
    biased = (getattr(module, "gate_up_proj_bias", None) is not None
              and getattr(module, "down_proj_bias", None) is not None)
    if (not biased and hasattr(module, "act_fn") and up.shape[1] == 2 * down.shape[2]
            and up.shape[2] == down.shape[1]):
        return "qwen"
    if (biased and hasattr(module, "_apply_gate") and up.shape[2] == 2 * down.shape[1]
            and up.shape[1] == down.shape[2]):
        return "transposed"
    return None


EXPERT_STAND_INS = {"qwen": _deferred_experts, "transposed": _deferred_transposed_experts}


def tail_stand_ins(layer: nn.Module) -> tuple[tuple[nn.Module, object], ...]:
    """(module, stand-in forward) for the tails of one decoder layer of a family whose entry
    allows truncation: `mlp.experts` when they are routed experts of a known layout, plus
    DeepSeek's `mlp.shared_experts.down_proj` (added to them as it is); else `mlp.down_proj`
    when it is an nn.Linear; () when the layer has neither (nothing skipped). Qwen3-Next's and
    Qwen3.5-MoE's `shared_expert` keeps its full forward: a sigmoid gate multiplies its output,
    so the gate's backward reads it."""
    mlp = getattr(layer, "mlp", None)
    experts = getattr(mlp, "experts", None)
    kind = _experts_kind(experts) if isinstance(experts, nn.Module) else None
    if kind is not None:
        shared = getattr(getattr(mlp, "shared_experts", None), "down_proj", None)
        extra = ((shared, _deferred_down_proj),) if isinstance(shared, nn.Linear) else ()
        return ((experts, EXPERT_STAND_INS[kind]), *extra)
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
