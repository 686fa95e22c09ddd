"""The MoE router load-balancing (aux) loss, split block by block for a streaming engine.

HF's `*ForCausalLM` adds `coef * aux` to the loss when `output_router_logits` is true (off by
default in the HF MoE configs), with
(Switch Transformer eqs. 4-6, HF `load_balancing_loss_func`):

    p[l,t]  = softmax(router_logits[l,t])                 [E], l over MoE layers, t over tokens
    sel[l,t]= top_k(p[l,t])                               k expert ids (no gradient)
    rows    = sum_l sum_t m[t]                            m = 2D attention mask (1 when absent)
    f[e]    = sum_{l,t} m[t] * [e in sel[l,t]] / rows     fraction of routed tokens (no gradient)
    P[e]    = sum_{l,t} m[t] * p[l,t,e] / rows            mean router probability
    aux     = E * sum_e f[e] * P[e]

`f` couples all layers, but it carries no gradient. So once every block has run forward (the
engine's forward pass precedes any backward), `f` and `rows` are constants and

    aux_l = E * sum_e f[e] * sum_t m[t] * p[l,t,e] / rows        with sum_l aux_l = aux

gives block l's exact share of d aux / d weights: the engine adds `coef * aux_l` as a second
output of block l's re-forward. Counts are taken in the first forward only (recompute and
re-forward do not observe), so each layer counts once per micro-batch.

Knows nothing about plans, tiers or streams.
Source: arXiv 2101.03961 eqs. (4)-(6); transformers' `load_balancing_loss_func`.
"""

from __future__ import annotations

import torch
from torch import nn


def router_class(model: nn.Module) -> type[nn.Module] | None:
    """The router module class HF records `router_logits` from (output index 0), or None."""
    recorder = getattr(model, "_can_record_outputs", None) or {}
    rec = recorder.get("router_logits")
    if rec is None:
        return None
    if getattr(rec, "index", 0) != 0:
        raise ValueError(f"{type(model).__name__}: router logits at output index {rec.index}; "
                         f"only index 0 is supported")
    return rec.target_class


class RouterAux:
    """Per micro-batch accumulator of the router statistics and the aux loss terms.

    Args:
        num_experts: E.
        top_k: experts per token.
        coef: `router_aux_loss_coef`.
        attention_mask: [B, S] 0/1 mask of the micro-batch, or None (every token counts).
    """

    def __init__(self, *, num_experts: int, top_k: int, coef: float,
                 attention_mask: torch.Tensor | None) -> None:
        self.E, self.k, self.coef = num_experts, top_k, coef
        self.mask = None if attention_mask is None else attention_mask.reshape(-1).float()
        self.counts: torch.Tensor | None = None  # [E] fp32, masked top-k assignments
        self.prob_sum: torch.Tensor | None = None  # [E] fp32, masked router probabilities
        self.rows: torch.Tensor | float = 0.0  # 0-dim fp32 on the device once counted

    def _weights(self, logits: torch.Tensor) -> torch.Tensor:
        if self.mask is None:
            return torch.ones(logits.shape[0], device=logits.device)
        return self.mask.to(logits.device)

    def observe(self, logits: list[torch.Tensor]) -> None:
        """Count one block's routers (first forward only): logits [B*S, E] each."""
        for lg in logits:
            lg = lg.detach().float()
            m = self._weights(lg)
            probs = torch.softmax(lg, dim=-1)
            sel = torch.topk(probs, self.k, dim=-1).indices  # [T, k]
            counts = torch.zeros(self.E, device=lg.device).scatter_add_(
                0, sel.reshape(-1), m.repeat_interleave(self.k))
            self.counts = counts if self.counts is None else self.counts + counts
            psum = (probs * m.unsqueeze(-1)).sum(0)
            self.prob_sum = psum if self.prob_sum is None else self.prob_sum + psum
            self.rows = self.rows + m.sum()  # stays on the device: no sync per block

    def loss(self) -> torch.Tensor | float:
        """coef * aux for the micro-batch (after every block's forward): a 0-dim fp32 device
        tensor (read on the host only at the step's end), 0.0 without routers."""
        if self.counts is None:
            return 0.0
        f, P = self.counts / self.rows, self.prob_sum / self.rows
        return self.coef * self.E * (f * P).sum().detach()

    def block_term(self, logits: list[torch.Tensor]) -> torch.Tensor | None:
        """coef * aux_l of one block from its re-forward's router logits (with autograd);
        None for a block without routers."""
        if not logits or self.counts is None:
            return None
        f = self.counts / self.rows
        total = 0.0
        for lg in logits:
            probs = torch.softmax(lg.float(), dim=-1)
            m = self._weights(lg)
            total = total + (probs * m.unsqueeze(-1)).sum(0).mul(f).sum()
        return self.coef * self.E * total / self.rows
