"""Save-level byte formulas: what autograd saves in one block's forward, per part and per token.

Owns the tensor sets behind a block's save levels (docs/execution_model.md, "Save levels" and
"Save-level tensor sets"): `SavedSet`, a count of saved elements per token by storage dtype, and
one function per block part (RMSNorm, softmax attention, multi-head latent attention,
Gated-DeltaNet linear attention, SwiGLU MLP, routed experts, shared expert). `spec/families.py`
composes them per family into a block's L1 set (input norm + token mixer + the mixer's output)
and L2 set (every tensor its backward reads). Knows nothing of HF config keys, hardware or torch.

Counting rules (what the runtime's saved-tensor hooks count):
- Each storage once (a tensor saved by the q, k and v projections counts once; a view counts
  its whole storage).
- Excluded: the block's input (boundary j), the block's weights and the per-micro-batch inputs
  the engine holds for the whole step (rotary tables, masks, position ids).
- Dtypes: compute-dtype tensors take b bytes (2 for bf16, 4 for fp32); HF upcasts some to fp32.
  An fp32 upcast of a compute-dtype tensor is a new storage only when the compute dtype is not
  fp32 (`upcast`); with fp32 compute the upcast is the tensor itself, so a tensor that only its
  upcast keeps alive is then counted at its own, sometimes wider, storage (`alias`).
- Attention follows the fused kernels (SDPA's flash / CPU flash path: q, k, v after rotary, the
  output and the fp32 log-sum-exp per head and query). Eager attention (HF's fallback, or a
  model with logit soft-capping or sinks) also keeps the [B, heads, S, S] probabilities (and
  their dropout mask with dropout on), which these sets do not count.

Source: the tensors the `transformers` modules save, read with
`torch.autograd.graph.saved_tensors_hooks` on tiny models (tests/spec/test_saved_bytes.py
checks the formulas against such hooks written in the test).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

FP32_BYTES = 4
INDEX_BYTES = 8
"""int64 indices (top-k experts, their sort order), bytes each."""
LINEAR_ATTN_CHUNK = 64
"""Chunk length of the chunked gated-delta-rule kernels (flash-linear-attention's default and
HF's torch fallback); sets the intra-chunk FLOPs and the per-chunk fp32 matrices autograd saves."""


@dataclass(kw_only=True, frozen=True, slots=True)
class SavedSet:
    """Saved tensors of a block part, per token of the micro-batch (plus a fixed part).

    `bytes(...)` = `B * S * (compute * b + 4 * fp32 + 4 * upcast [b != 4] + 4 * alias [b == 4]
    + index_bytes + b * masked_compute [masked]) + B * (S_pad * 4 * padded_fp32 + S_pad / C * 4 *
    chunk_fp32 + b * sequence_compute) + fixed_bytes`, with C = `LINEAR_ATTN_CHUNK` and S_pad =
    S rounded up to a multiple of C.
    """

    compute: int = 0
    """Elements per token saved in the compute dtype."""
    fp32: int = 0
    """Elements per token saved in fp32 whatever the compute dtype."""
    upcast: int = 0
    """fp32 copies per token of tensors that exist in the compute dtype anyway: a storage of
    their own only when the compute dtype is not fp32."""
    alias: int = 0
    """Elements per token counted (as fp32) only with fp32 compute: the rest of a wider storage
    a saved view keeps alive when no dtype cast copies it out."""
    index_bytes: int = 0
    """Bytes per token of integer tensors (expert indices and their order)."""
    masked_compute: int = 0
    """Further compute-dtype elements per token when the layer is given a mask (k and v
    expanded to every query head)."""
    padded_fp32: int = 0
    """fp32 elements per token of the sequence padded to a multiple of `LINEAR_ATTN_CHUNK`
    (the chunked linear attention's per-chunk matrices)."""
    chunk_fp32: int = 0
    """fp32 elements per chunk of `LINEAR_ATTN_CHUNK` tokens of each sequence (the recurrent
    state the chunk scan reads)."""
    sequence_compute: int = 0
    """Compute-dtype elements per sequence (the causal conv's left padding)."""
    fixed_bytes: int = 0
    """Bytes per micro-batch whatever its tokens (per-expert offsets, `1 + weight` of an
    offset-style norm)."""

    def __add__(self, other: "SavedSet") -> "SavedSet":
        return SavedSet(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                           for f in fields(SavedSet)})

    def __sub__(self, other: "SavedSet") -> "SavedSet":
        return SavedSet(**{f.name: getattr(self, f.name) - getattr(other, f.name)
                           for f in fields(SavedSet)})

    def bytes(self, *, micro_batch: int, seq_len: int, dtype_bytes: int,
              masked: bool = False) -> int:
        """Saved bytes of one micro-batch.

        Args:
            micro_batch, seq_len: B sequences of S tokens.
            dtype_bytes: bytes per element of the compute dtype (2: bf16, 4: fp32).
            masked: the layer is given a mask (a sliding window shorter than S).

        Raises:
            ValueError: B or S < 1, or a dtype size other than 2 or 4.
        """
        if micro_batch < 1 or seq_len < 1 or dtype_bytes not in (2, 4):
            raise ValueError(f"SavedSet.bytes needs micro_batch, seq_len >= 1 and dtype_bytes "
                             f"2 or 4; got {micro_batch}, {seq_len}, {dtype_bytes}")
        fp32_compute = dtype_bytes == FP32_BYTES
        per_token = (self.compute * dtype_bytes + FP32_BYTES * self.fp32
                     + FP32_BYTES * (self.alias if fp32_compute else self.upcast)
                     + self.index_bytes + dtype_bytes * self.masked_compute * masked)
        chunks = -(-seq_len // LINEAR_ATTN_CHUNK)
        per_sequence = (chunks * LINEAR_ATTN_CHUNK * FP32_BYTES * self.padded_fp32
                        + chunks * FP32_BYTES * self.chunk_fp32
                        + dtype_bytes * self.sequence_compute)
        return micro_batch * (seq_len * per_token + per_sequence) + self.fixed_bytes


# ---------------------------------------------------------------------------------------------
# Norms


def rms_norm(width: int, *, rows: int = 1, offset: bool = False, input_kept: bool = False,
             output_saved: bool = True, input_alias: int = 0) -> SavedSet:
    """An RMSNorm over `rows` vectors of `width` per token (rows > 1: per-head q/k norms).

    HF computes it in fp32: the fp32 input (pow and mul save it), the fp32 reciprocal RMS
    (rsqrt saves its output) and, for the weight's multiply, the normalized input cast back to
    the compute dtype (Llama style `w * x.to(dtype)`), or the fp32 normalized input and the fp32
    `1 + w` (`offset`: Qwen3-Next / Qwen3.5 / Gemma, `(x * (1 + w)).to(dtype)`).

    Args:
        width, rows: the normalized shape per token.
        offset: the `1 + w` form.
        input_kept: the input is the block's input (the input norm): its fp32 copy is the input
            itself with fp32 compute (excluded), so it counts as `upcast`.
        output_saved: the norm's output (compute dtype) is saved by the next layer (the
            projections after the input and post-attention norms).
        input_alias: fp32-compute only: further elements of the input's storage the fp32 view
            keeps alive (a q norm reading one half of the gated q projection).

    Returns:
        the SavedSet per token.
    """
    n = rows * width
    x32 = SavedSet(upcast=n) if input_kept else SavedSet(fp32=n, alias=input_alias)
    if offset:
        norm = SavedSet(fp32=rows + n, fixed_bytes=FP32_BYTES * width)
    else:
        norm = SavedSet(fp32=rows, compute=n)
    return x32 + norm + SavedSet(compute=n if output_saved else 0)


# ---------------------------------------------------------------------------------------------
# Token mixers (after the input norm; the norm's output is counted by the norm)


def softmax_attention(*, heads: int, kv_heads: int, head_dim: int, v_head_dim: int = 0,
                      qk_norm: str = "", gate: bool = False) -> SavedSet:
    """GQA softmax attention through a fused kernel (SDPA flash / CPU flash).

    Saved per token: q after rotary (heads x d), k after rotary and v (kv_heads x d each, or
    heads x d when a mask is passed: HF's `repeat_kv` expands them and the kernel keeps the
    copies: `masked_compute`), the attention output (heads x d_v) and the fp32 log-sum-exp
    (heads). Rotary saves
    nothing of q or k (it multiplies by the constant tables). `qk_norm` "llama" or "offset":
    the per-head q and k RMSNorms (`rms_norm`; their outputs go into rotary, unsaved); the
    offset-style q norm of a gated q projection keeps the whole projection alive with fp32
    compute. `gate` (Qwen3-Next / Qwen3.5 output gate): the sigmoid of the gate, the output the
    gate multiplies (a contiguous copy) and the gated output, heads x d_v each.

    Args:
        heads, kv_heads, head_dim: query heads, key/value heads, q/k width per head.
        v_head_dim: value width per head (default head_dim).
        qk_norm: "" (none), "llama" or "offset".
        gate: the sigmoid output gate.
    """
    d, dv = head_dim, v_head_dim or head_dim
    out = SavedSet(compute=heads * d + kv_heads * (d + dv) + heads * dv, fp32=heads,
                   masked_compute=(heads - kv_heads) * (d + dv))
    if qk_norm:
        offset = qk_norm == "offset"
        out += rms_norm(d, rows=heads, offset=offset, output_saved=False,
                        input_alias=heads * d if (offset and gate) else 0)
        out += rms_norm(d, rows=kv_heads, offset=offset, output_saved=False)
    if gate:
        out += SavedSet(compute=3 * heads * dv)
    return out


def mla_attention(*, heads: int, nope_dim: int, rope_dim: int, v_head_dim: int,
                  kv_lora_rank: int, q_lora_rank: int | None) -> SavedSet:
    """DeepSeek-V2 multi-head latent attention (not measured here: derived from the module).

    Saved per token: with a q LoRA its down projection's output (its norm's input: fp32 copy,
    rsqrt, cast) and the norm output; the compressed kv (kv_lora_rank + rope_dim), its norm
    (fp32 copy, rsqrt, cast) and the norm's output; the kv up projection's output (heads x
    (nope + v)); q and k after rotary (heads x (nope + rope)) and v (heads x v), the attention
    output (heads x v) and the fp32 log-sum-exp (heads).

    Source: arXiv 2405.04434 section 2.1; transformers DeepseekV2Attention.
    """
    qk = nope_dim + rope_dim
    out = SavedSet(compute=kv_lora_rank + rope_dim + heads * (nope_dim + v_head_dim))
    out += rms_norm(kv_lora_rank)
    if q_lora_rank:
        out += SavedSet(compute=q_lora_rank) + rms_norm(q_lora_rank)
    out += SavedSet(compute=2 * heads * qk + 2 * heads * v_head_dim, fp32=heads)
    return out


def gated_deltanet(*, key_heads: int, value_heads: int, key_dim: int, value_dim: int,
                   conv_kernel: int) -> SavedSet:
    """Gated-DeltaNet linear attention (Qwen3-Next / Qwen3.5) through HF's torch fallback
    (`torch_chunk_gated_delta_rule`, what runs without flash-linear-attention).

    With K = key_heads x d_k, V = value_heads x d_v, n = value_heads, conv = 2K + V, C the
    chunk and S_pad the sequence padded to a multiple of C, saved:
    - projections and conv (compute dtype): the conv's input (conv per token) and its output
      before the silu, left-padded by kernel - 1 (conv per token + (kernel - 1) conv per
      sequence); beta = sigmoid(b) (n);
    - decay (fp32): softplus's input and output (2n per token) and exp(A_log), -exp(A_log)
      (2n per micro-batch);
    - l2 norms (fp32, per token): q and k repeated to the value heads (n d_k each) and their
      inverse norms (n each);
    - the chunked rule (fp32, per padded token): padded k, v and beta (n (d_k + d_v + 1));
      5 n C of chunk matrices (pairwise decay, UT system and its product, intra-chunk
      attention and its use); 6 n d of chunked q, k, k x beta and decayed keys and values
      (taken as 3 n d_k + 3 n d_v: exact when d_k = d_v, every shipped config); the per-chunk
      new values (n d_v) and 3 n decay vectors; per chunk of each sequence the recurrent state
      read (n d_k d_v) and the chunk's decay (n); per micro-batch the C x C bool mask;
    - the gated RMSNorm: fp32 input, silu(z) input and output, reciprocal RMS (3V + n), and in
      the compute dtype its normalized cast, the product with the weight and the out
      projection's input (3V).

    Exact (against saved-tensor hooks) with bf16 compute for S > C, and with fp32 compute when
    S is not a multiple of C. Two known gaps: with fp32 compute and S a multiple of C the hooks
    see (4 x chunks - 1) more chunk slices of B x C x n x d fp32 (the unpadded fp32 path keeps
    views of distinct storages), +7% at S = 2C; with one chunk (S <= C) this counts one chunk's
    new values (B x C x n x d_v fp32) that the hooks do not see.

    Source: arXiv 2412.06464 section 3 (chunkwise form); the saved tensors of transformers'
    `Qwen3NextGatedDeltaNet` read with saved-tensor hooks (tests/spec/test_saved_bytes.py).
    flash-linear-attention's fused kernels save far less (q, k, v, g, beta and one chunk
    matrix, recomputing the rest); a measured profile then gives the real bytes.
    """
    K, V, n = key_heads * key_dim, value_heads * value_dim, value_heads
    dk, dv, C = key_dim, value_dim, LINEAR_ATTN_CHUNK
    conv = 2 * K + V
    return SavedSet(
        compute=2 * conv + n + 3 * V, sequence_compute=(conv_kernel - 1) * conv,
        fp32=2 * n + 2 * (n * dk + n) + 3 * V + n, fixed_bytes=FP32_BYTES * 2 * n + C * C,
        padded_fp32=n * (dk + dv + 1) + 5 * n * C + 3 * n * dk + 3 * n * dv + n * dv + 3 * n,
        chunk_fp32=n * dk * dv + n)


# ---------------------------------------------------------------------------------------------
# Channel mixers (after the post-attention norm; its output is counted by the norm)


def swiglu_mlp(intermediate: int) -> SavedSet:
    """SwiGLU / GeGLU MLP: gate and up outputs, the activation's output and the product (the
    down projection's input), `intermediate` each, compute dtype."""
    return SavedSet(compute=4 * intermediate)


def routed_experts(*, hidden: int, experts: int, top_k: int, intermediate: int,
                   norm_topk: bool = False) -> SavedSet:
    """Routed SwiGLU experts through HF's grouped-matmul experts (transformers' default).

    Saved per token: the router's fp32 softmax probabilities (E) and top-k indices (int64);
    with `norm_topk` the fp32 top-k values and their sum (k + 1); per routed copy of the token
    (k of them): the gathered input (H), the gate/up output (2 I), the activation and the
    product (I each), the routing weight (1) and the expert's output (H, which the weight
    multiplies), compute dtype; the sort order and token indices of the copies (3 x int64 per
    copy); per micro-batch the int32 per-expert offsets (E).
    """
    return SavedSet(compute=top_k * (2 * hidden + 4 * intermediate + 1),
                    fp32=experts + (top_k + 1) * norm_topk,
                    index_bytes=INDEX_BYTES * 4 * top_k, fixed_bytes=4 * experts)


def shared_expert(*, hidden: int, intermediate: int, gated: bool) -> SavedSet:
    """The shared expert beside routed ones: a SwiGLU MLP (its input is the routed experts'
    input, counted once); `gated` (Qwen3-Next): the sigmoid gate's output (1) and the expert's
    output it multiplies (H)."""
    return swiglu_mlp(intermediate) + SavedSet(compute=(1 + hidden) if gated else 0)


def mixer_output(hidden: int) -> SavedSet:
    """The token mixer's output (compute dtype, H per token): not saved by autograd, but an L1
    block keeps it for the stand-in that replaces the mixer in its re-forward."""
    return SavedSet(compute=hidden)
