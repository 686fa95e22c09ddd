"""`BlockSpec`: the shape of one transformer block (decoder layer), and its forward FLOPs.

Owns the per-block fields the cost model and the planner read (kind, parameters streamed and
active, attention shape, autograd-saved activations per token) and the FLOPs of the
parameter-free attention core. Knows nothing of HF config keys (`spec/families.py` parses them)
nor of hardware, time or torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from lazytrain.spec.saved_bytes import LINEAR_ATTN_CHUNK, SavedSet

__all__ = ["LINEAR_ATTN_CHUNK", "BlockSpec", "avg_causal_keys"]


@dataclass(kw_only=True, frozen=True, slots=True)
class BlockSpec:
    """One transformer block (decoder layer).

    Token-level quantities are per token; multiply by `micro_batch * seq_len` for a micro-batch.
    """

    index: int
    """Layer index j (block j maps boundary j to j+1)."""
    kind: str
    """Cost class: `dense`, `moe`, `linear_attention`, `linear_attention_moe`,
    `sliding_attention`, `sliding_attention_moe`, `mla`, `mla_moe` (attention + "_moe" when the
    MLP is a mixture of experts). Profiles are measured per kind."""
    attention: str
    """full_attention | sliding_attention | linear_attention | mla."""
    mlp: str
    """dense | moe."""
    params: int
    """All parameters of the block (every expert): streamed H2D and held by the optimizer."""
    active_params: int
    """Parameters one token multiplies with (top-k routed experts only)."""
    num_heads: int = 0
    """Softmax-attention query heads (0 for linear attention)."""
    qk_head_dim: int = 0
    """Query/key width per head in the score product, elements."""
    v_head_dim: int = 0
    """Value width per head, elements."""
    sliding_window: int = 0
    """Keys visible to a query for sliding attention (0: unbounded causal)."""
    linear_heads: int = 0
    """Gated-DeltaNet value heads (linear attention only)."""
    linear_k_dim: int = 0
    """Gated-DeltaNet key head width."""
    linear_v_dim: int = 0
    """Gated-DeltaNet value head width."""
    conv_flops_per_token: int = 0
    """Depthwise causal conv of the linear-attention block, forward FLOPs per token."""
    saved_elems_per_token: int = 0
    """Autograd-saved activation elements per token in the compute dtype, excluding the block's
    input boundary (see `saved_activations`)."""
    saved_fp32_per_token: int = 0
    """Autograd-saved fp32 elements per token (softmax statistics, router probabilities,
    gating scalars, chunk matrices)."""
    reforward_skip_params: int = 0
    """Active parameters of the block's tail, which the truncated re-forward before its backward
    does not run: the MLP's down projection (dense), or top-k routed experts' down projections
    (MoE; the shared expert's runs). 0: the family keeps the full re-forward (Gemma 2/3)."""

    mixer_params: int = 0
    """Parameters of the input norm and the token mixer (attention or linear attention): what
    an L1 block's forward runs and its re-forward does not."""
    saved_l1: SavedSet = SavedSet()
    """Save level L1's tensors per token (`spec/saved_bytes.py`): the input norm's and the
    token mixer's saved tensors plus the mixer's output. Empty: levels not modelled."""
    saved_l2: SavedSet = SavedSet()
    """Save level L2's tensors per token: every tensor the block's backward reads."""

    def saved_level_bytes(self, *, micro_batch: int, seq_len: int, dtype_bytes: int
                          ) -> tuple[int, int]:
        """(S1, S2): the bytes block j keeps from f{j} for b{j} at levels L1 and L2 for one
        micro-batch of [micro_batch, seq_len] tokens (docs/execution_model.md, "Save-level
        tensor sets"); a sliding layer whose window is shorter than the sequence is given a
        mask (k and v expanded). (0, 0) where the family has no sets.

        Raises:
            ValueError: as `SavedSet.bytes`.
        """
        masked = self.attention == "sliding_attention" and 0 < self.sliding_window < seq_len
        shape = dict(micro_batch=micro_batch, seq_len=seq_len, dtype_bytes=dtype_bytes,
                     masked=masked)
        return self.saved_l1.bytes(**shape), self.saved_l2.bytes(**shape)

    def reforward_l1_share(self, seq_len: int) -> float:
        """The share of the forward's FLOPs the L1 re-forward runs (post-attention norm, MLP
        or experts, less the truncated tail): `2 * (active_params - mixer_params -
        reforward_skip_params) / fwd_flops_per_token`; the L1 re-forward then costs
        `Fr1 = Fg * share` (docs/execution_model.md, "Save levels")."""
        rest = self.active_params - self.mixer_params - self.reforward_skip_params
        return 2.0 * rest / self.fwd_flops_per_token(seq_len)

    def core_attention_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token of the parameter-free attention core.

        Softmax attention: QK^T and AV over the causal (or sliding) keys,
        `2 * heads * (d_qk + d_v) * avg_keys`. Linear attention (chunked gated delta rule):
        `heads * (6 * d_k * d_v + C * (d_k + d_v))` (state read, state update, delta residual,
        causal intra-chunk products) plus the depthwise conv.

        Args:
            seq_len: tokens per sequence.

        Returns:
            FLOPs per token, forward only.

        Source: arXiv 2412.06464 (Gated DeltaNet), section 3 chunkwise form; causal-mask
        halving as in FlashAttention-2 (arXiv 2307.08691).
        """
        if self.attention == "linear_attention":
            per_head = 6 * self.linear_k_dim * self.linear_v_dim + LINEAR_ATTN_CHUNK * (
                self.linear_k_dim + self.linear_v_dim)
            return float(self.linear_heads * per_head + self.conv_flops_per_token)
        return 2.0 * self.num_heads * (self.qk_head_dim + self.v_head_dim) * avg_causal_keys(
            seq_len, self.sliding_window)

    def fwd_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token: `2 * active_params` (matmuls) + the attention core."""
        return 2.0 * self.active_params + self.core_attention_flops_per_token(seq_len)

    def reforward_skip_share(self, seq_len: int) -> float:
        """s: the share of the forward's FLOPs the truncated re-forward skips,
        `2 * reforward_skip_params / fwd_flops_per_token` (0 for a full re-forward); the
        re-forward then costs `Fg * (1 - s)` (docs/execution_model.md, b{j})."""
        return 2.0 * self.reforward_skip_params / self.fwd_flops_per_token(seq_len)


def avg_causal_keys(seq_len: int, window: int) -> float:
    """Mean number of keys a causal query attends to (exact, over positions 1..seq_len)."""
    if window <= 0 or window >= seq_len:
        return (seq_len + 1) / 2
    return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len
