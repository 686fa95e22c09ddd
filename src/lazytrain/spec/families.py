"""One parser per supported HF model family: (config dict, layer index j) -> `BlockSpec`.

Owns how a HF `config.json` of each family maps onto a block's parameters, attention shape and
saved activations: the attention parts (softmax GQA with optional biases, q/k norms, output
gate, sinks and sliding windows; multi-head latent attention; Gated-DeltaNet linear attention),
the MLP parts (SwiGLU, routed experts with a shared expert) and the per-family rules choosing
them layer by layer, mirroring the `transformers` module structure so the counts equal
`sum(p.numel())` of the real modules. `BLOCK_PARSERS` is the registry `spec/model.py` reads;
knows nothing of hardware, time or torch.
"""

from __future__ import annotations

from lazytrain.spec import saved_bytes as sb
from lazytrain.spec.block import LINEAR_ATTN_CHUNK, BlockSpec


def require_key(c: dict, key: str):
    """`c[key]`; a missing or null key raises ValueError naming it and the model_type."""
    if c.get(key) is None:
        raise ValueError(f"model config lacks required key {key!r} "
                         f"(model_type {c.get('model_type')!r})")
    return c[key]


# ---------------------------------------------------------------------------------------------
# Attention parts: (params, attention fields for BlockSpec, saved elems, saved fp32) per token.


def _head_dim(c: dict) -> int:
    return c.get("head_dim") or require_key(c, "hidden_size") // require_key(c, "num_attention_heads")


def _softmax_attention(c: dict, *, bias_qkv: bool, bias_o: bool, qk_norm: bool, gate: bool,
                       sinks: bool, window: int, fp32_norms: bool = False
                       ) -> tuple[int, dict, int, int]:
    """GQA attention (Llama/Qwen3/Mixtral/GPT-OSS; Qwen3.5/Next with the output gate).

    Saved per token: norm output H; the rope output q (x2 with gate); k and v as SDPA saves
    them, at the query heads' count: HF's `repeat_kv` expands them to every query head whenever
    an attention mask is passed (a padded batch, on every device) and the kernel keeps the
    expanded copies (without a mask they are smaller: this is the bound); with q/k norms their
    fp32 normalized inputs and reciprocal RMS and the compute-dtype casts (`fp32_norms`: the
    weight's multiply in fp32, Gemma / Qwen3.5 style, saves a second fp32 tensor instead of
    the cast); attention output O;
    with the gate its sigmoid and the gated O; fp32 softmax log-sum-exp per head. (The q/k
    projections and rope's inputs are not saved: rope multiplies by constant tables.)
    """
    H, nh = c["hidden_size"], c["num_attention_heads"]
    nkv = c.get("num_key_value_heads") or nh
    d = _head_dim(c)
    q_out = nh * d * (2 if gate else 1)
    params = H * q_out + 2 * H * nkv * d + nh * d * H
    params += (q_out + 2 * nkv * d) * bias_qkv + H * bias_o + 2 * d * qk_norm + nh * sinks
    saved = H + q_out + 2 * nh * d + (nh * d + nkv * d) * qk_norm * (not fp32_norms) + nh * d
    saved += 2 * nh * d * gate
    fp32 = nh + ((nh * d + nkv * d) * (1 + fp32_norms) + nh + nkv) * qk_norm
    fields = dict(num_heads=nh, qk_head_dim=d, v_head_dim=d, sliding_window=window,
                  saved_l1=sb.softmax_attention(
                      heads=nh, kv_heads=nkv, head_dim=d, gate=gate,
                      qk_norm=("offset" if fp32_norms else "llama") if qk_norm else ""))
    return params, fields, saved, fp32


def _mla_attention(c: dict) -> tuple[int, dict, int, int]:
    """DeepSeek-V2 multi-head latent attention (optional q LoRA, compressed KV).

    Saved per token: norm output; q (or q_a, its norm, q_b); kv_a output and its norm; kv_b
    output; rope parts; assembled q, k; v; attention output.
    Source: arXiv 2405.04434 section 2.1; transformers DeepseekV2Attention.
    """
    H, nh = c["hidden_size"], c["num_attention_heads"]
    nope, rope, dv = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    r_kv, r_q = c["kv_lora_rank"], c.get("q_lora_rank", 1536)
    qk = nope + rope
    bias = bool(c.get("attention_bias", False))
    if r_q is None:
        params, saved = H * nh * qk, nh * qk
    else:
        params = H * r_q + r_q * bias + r_q + r_q * nh * qk
        saved = 2 * r_q + nh * qk
    params += H * (r_kv + rope) + (r_kv + rope) * bias + r_kv + r_kv * nh * (nope + dv)
    params += nh * dv * H + H * bias
    saved += H + (r_kv + rope) + r_kv + nh * (nope + dv) + rope + nh * rope + 2 * nh * qk
    saved += 2 * nh * dv
    fields = dict(num_heads=nh, qk_head_dim=qk, v_head_dim=dv,
                  saved_l1=sb.mla_attention(heads=nh, nope_dim=nope, rope_dim=rope,
                                            v_head_dim=dv, kv_lora_rank=r_kv, q_lora_rank=r_q))
    return params, fields, saved, nh


def _gated_deltanet(c: dict) -> tuple[int, dict, int, int]:
    """Gated-DeltaNet linear attention (Qwen3.5 / Qwen3-Next; same parameter count for the
    fused `in_proj_qkvz`/`in_proj_ba` and the split `in_proj_qkv`/`_z`/`_b`/`_a` layouts).

    Saved per token: norm output; qkv projection, conv output, silu output; l2-normed q, k; z;
    b, a; core output, gated-norm output and its product with silu(z); fp32 g and beta per
    head and the chunk-local matrix (C per head).
    """
    H = c["hidden_size"]
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    kernel = c.get("linear_conv_kernel_dim", 4)
    K, Vd = nk * dk, nv * dv
    conv = 2 * K + Vd
    params = H * (conv + Vd + 2 * nv) + conv * kernel + 2 * nv + dv + Vd * H
    saved = H + 3 * conv + 2 * K + Vd + 2 * nv + 3 * Vd
    fields = dict(linear_heads=nv, linear_k_dim=dk, linear_v_dim=dv,
                  conv_flops_per_token=2 * kernel * conv,
                  saved_l1=sb.gated_deltanet(key_heads=nk, value_heads=nv, key_dim=dk,
                                             value_dim=dv, conv_kernel=kernel))
    return params, fields, saved, nv * (2 + LINEAR_ATTN_CHUNK)


# ---------------------------------------------------------------------------------------------
# MLP parts: (params, active params, saved elems, saved fp32, tail active params, save-level
# set) per token; the tail is what the truncated re-forward skips (the down projections).


def _dense_mlp(H: int, inter: int, *, bias: bool = False) -> tuple:
    """SwiGLU MLP: gate, up (H x I), down (I x H). Saved: gate, silu(gate), up, product.
    Tail: the down projection."""
    p = 3 * H * inter + (2 * inter + H) * bias
    return p, p, 4 * inter, 0, H * inter + H * bias, sb.swiglu_mlp(inter)


def _moe_mlp(H: int, *, experts: int, top_k: int, inter: int, router_bias: bool = False,
             expert_bias: bool = False, shared_inter: int = 0, shared_gate: bool = False,
             norm_topk: bool = False) -> tuple:
    """Routed SwiGLU experts (+ optional shared expert). Every expert's weights are streamed;
    a token multiplies with top-k of them. Saved per token: per selected expert the gathered
    input and the SwiGLU intermediates and output; the shared expert's; fp32 router
    probabilities over all experts. Tail: the top-k experts' down projections, and an ungated
    shared expert's (DeepSeek; a gated one, Qwen3-Next, runs in full)."""
    per_expert = 3 * H * inter + (2 * inter + H) * expert_bias
    router = experts * H + experts * router_bias
    shared = 3 * H * shared_inter + H * shared_gate
    params = experts * per_expert + router + shared
    active = top_k * per_expert + router + shared
    saved = top_k * (2 * H + 4 * inter) + (4 * shared_inter + H if shared_inter else 0)
    tail = top_k * (H * inter + H * expert_bias) + (0 if shared_gate else H * shared_inter)
    levels = sb.routed_experts(hidden=H, experts=experts, top_k=top_k, intermediate=inter,
                               norm_topk=norm_topk)
    if shared_inter:
        levels += sb.shared_expert(hidden=H, intermediate=shared_inter, gated=shared_gate)
    return params, active, saved, experts, tail, levels


def _block(j: int, attention: str, attn: tuple, mlp_kind: str, mlp: tuple, H: int, *,
           norms: int = 2, fp32_norms: bool = False, truncated: bool = True) -> BlockSpec:
    """Assemble a block: attention + MLP + `norms` RMSNorms of width H (2: input and
    post-attention; Gemma2/3: 4, adding pre- and post-feedforward).

    Saved per token besides the parts: the post-attention residual sum and the output of each
    norm after the first (which the attention part counts); per norm (HF's RMSNorm computes in
    fp32) its fp32 normalized input and fp32 reciprocal RMS, and that input cast back to the
    compute dtype for the weight's multiply (with fp32 compute the cast is the fp32 tensor
    itself, counted twice); `fp32_norms` (Gemma / Qwen3.5 style, `x * (1 + weight)` in fp32):
    a second fp32 tensor instead of that cast. `truncated`: the runtime's re-forward skips the
    MLP's tail (False where a post-feedforward norm reads it)."""
    a_params, a_fields, a_saved, a_fp32 = attn
    m_params, m_active, m_saved, m_fp32, m_tail, m_levels = mlp
    l1, l2 = _save_levels(a_fields.pop("saved_l1"), m_levels, H, norms=norms,
                          offset=fp32_norms)
    base = {"full_attention": "", "sliding_attention": "sliding_attention",
            "linear_attention": "linear_attention", "mla": "mla"}[attention]
    kind = (base + "_moe" if base else "moe") if mlp_kind == "moe" else (base or "dense")
    return BlockSpec(index=j, kind=kind, attention=attention, mlp=mlp_kind,
                     params=a_params + m_params + norms * H,
                     active_params=a_params + m_active + norms * H,
                     saved_elems_per_token=a_saved + m_saved + norms * H * (2 - fp32_norms),
                     saved_fp32_per_token=a_fp32 + m_fp32 + norms * (H * (1 + fp32_norms) + 1),
                     reforward_skip_params=m_tail if truncated else 0,
                     mixer_params=a_params + H, saved_l1=l1, saved_l2=l2, **a_fields)


def _save_levels(mixer: sb.SavedSet, mlp: sb.SavedSet, H: int, *, norms: int, offset: bool
                 ) -> tuple[sb.SavedSet, sb.SavedSet]:
    """(L1, L2) sets of a block: L1 = input norm (its input is the block's) + token mixer +
    the mixer's output; L2 = L1 without that output + the norms after the mixer + the MLP.
    Two norms: the post-attention norm (fp32 copy of the residual sum; output saved by the
    MLP). Four (Gemma 2/3): post-attention (on the mixer's output, output unsaved),
    pre-feedforward (output saved by the MLP) and post-feedforward (on the MLP's output)."""
    l1 = sb.rms_norm(H, offset=offset, input_kept=True) + mixer + sb.mixer_output(H)
    if norms == 4:
        after = (sb.rms_norm(H, offset=offset, output_saved=False) + sb.rms_norm(H, offset=offset)
                 + sb.rms_norm(H, offset=offset, output_saved=False))
    else:
        after = sb.rms_norm(H, offset=offset)
    return l1, l1 - sb.mixer_output(H) + after + mlp


LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention", "mla")
"""The `layer_types` entries a block parser understands (transformers' names)."""


def check_layer_types(c: dict) -> None:
    """A `layer_types` list, when given, names one known type per layer.

    Raises:
        ValueError: one line naming the field, the lengths or the unknown entry, and the fix.
    """
    types, layers = c.get("layer_types"), c.get("num_hidden_layers")
    if not types:
        return
    if not isinstance(types, list) or (isinstance(layers, int) and len(types) != layers):
        count = len(types) if isinstance(types, list) else type(types).__name__
        raise ValueError(f"model config: layer_types has {count} entries but "
                         f"num_hidden_layers is {layers}; give one entry per layer (or drop "
                         f"layer_types)")
    unknown = sorted({t for t in types if t not in LAYER_TYPES}, key=str)
    if unknown:
        raise ValueError(f"model config: layer_types entry {unknown[0]!r} is not one of "
                         f"{', '.join(LAYER_TYPES)}")


def _layer_type(c: dict, j: int, default: str) -> str:
    types = c.get("layer_types")
    return types[j] if types else default


# ---------------------------------------------------------------------------------------------
# One parser per model family: (config, layer index) -> BlockSpec.


def _llama_like(c: dict, j: int) -> BlockSpec:
    """llama / mistral / qwen2 / qwen3 / phi3: GQA (qwen3: q/k norms) + SwiGLU. Phi3's fused
    `qkv_proj` and `gate_up_proj` hold the same parameters as the split projections; Mistral
    and Phi3 apply a set `sliding_window` to every layer."""
    mt = c.get("model_type")
    window = c.get("sliding_window") or 0
    model_wide = mt in ("mistral", "phi3") and window
    default_type = "sliding_attention" if model_wide else "full_attention"
    attention = _layer_type(c, j, default_type)
    bias = bool(c.get("attention_bias", mt == "qwen2"))
    attn = _softmax_attention(c, bias_qkv=bias, bias_o=bias and mt != "qwen2",
                              qk_norm=mt == "qwen3", gate=False, sinks=False,
                              window=window if attention == "sliding_attention" else 0)
    mlp = _dense_mlp(c["hidden_size"], c["intermediate_size"], bias=bool(c.get("mlp_bias")))
    return _block(j, attention, attn, "dense", mlp, c["hidden_size"])


def _num_experts(c: dict) -> int:
    """Routed experts: `num_experts` in hub configs, `num_local_experts` in transformers 5's
    `to_dict()` of the same config."""
    return c.get("num_experts") or c.get("num_local_experts") or 0


def _qwen_moe_layer(c: dict, j: int) -> bool:
    """Qwen3-MoE / Qwen3-Next rule for which layers are sparse."""
    step = c.get("decoder_sparse_step", 1) or 1
    return (j not in (c.get("mlp_only_layers") or [])
            and _num_experts(c) > 0 and (j + 1) % step == 0)


def _qwen_mlp(c: dict, j: int, *, shared: bool) -> tuple[str, tuple]:
    H = c["hidden_size"]
    if _qwen_moe_layer(c, j):
        return "moe", _moe_mlp(H, experts=_num_experts(c), top_k=c["num_experts_per_tok"],
                               inter=c["moe_intermediate_size"],
                               shared_inter=c.get("shared_expert_intermediate_size", 0)
                               if shared else 0, shared_gate=shared,
                               norm_topk=bool(c.get("norm_topk_prob", False)))
    return "dense", _dense_mlp(H, c["intermediate_size"])


def _qwen3_moe(c: dict, j: int) -> BlockSpec:
    attention = _layer_type(c, j, "full_attention")
    window = c.get("sliding_window") or 0
    attn = _softmax_attention(c, bias_qkv=bool(c.get("attention_bias")),
                              bias_o=bool(c.get("attention_bias")), qk_norm=True, gate=False,
                              sinks=False,
                              window=window if attention == "sliding_attention" else 0)
    mlp_kind, mlp = _qwen_mlp(c, j, shared=False)
    return _block(j, attention, attn, mlp_kind, mlp, c["hidden_size"])


def _qwen_hybrid(c: dict, j: int) -> BlockSpec:
    """qwen3_5(_text), qwen3_5_moe(_text), qwen3_next: linear/full attention by layer_types
    (default: every `full_attention_interval`-th layer full)."""
    interval = c.get("full_attention_interval", 4)
    default = "full_attention" if (j + 1) % interval == 0 else "linear_attention"
    attention = _layer_type(c, j, default)
    if attention == "linear_attention":
        attn = _gated_deltanet(c)
    else:
        bias = bool(c.get("attention_bias"))
        attn = _softmax_attention(c, bias_qkv=bias, bias_o=bias, qk_norm=True, gate=True,
                                  sinks=False, window=0, fp32_norms=True)
    if c.get("model_type") in ("qwen3_5", "qwen3_5_text"):
        mlp_kind, mlp = "dense", _dense_mlp(c["hidden_size"], c["intermediate_size"])
    else:
        mlp_kind, mlp = _qwen_mlp(c, j, shared=True)
    return _block(j, attention, attn, mlp_kind, mlp, c["hidden_size"], fp32_norms=True)


def _mixtral(c: dict, j: int) -> BlockSpec:
    window = c.get("sliding_window") or 0
    attention = "sliding_attention" if window else "full_attention"
    attn = _softmax_attention(c, bias_qkv=False, bias_o=False, qk_norm=False, gate=False,
                              sinks=False, window=window)
    mlp = _moe_mlp(c["hidden_size"], experts=c["num_local_experts"],
                   top_k=c["num_experts_per_tok"], inter=c["intermediate_size"],
                   norm_topk=True)
    return _block(j, attention, attn, "moe", mlp, c["hidden_size"])


def _gpt_oss(c: dict, j: int) -> BlockSpec:
    """GPT-OSS: attention with biases and per-head sinks; sliding (even j) / full (odd j)."""
    default = "sliding_attention" if (j + 1) % 2 else "full_attention"
    attention = _layer_type(c, j, default)
    bias = bool(c.get("attention_bias", True))
    window = c.get("sliding_window") or 0
    attn = _softmax_attention(c, bias_qkv=bias, bias_o=bias, qk_norm=False, gate=False,
                              sinks=True, window=window if attention == "sliding_attention" else 0)
    top_k = c.get("num_experts_per_tok") or c.get("experts_per_token")
    mlp = _moe_mlp(c["hidden_size"], experts=c["num_local_experts"], top_k=top_k,
                   inter=c["intermediate_size"], router_bias=True, expert_bias=True)
    return _block(j, attention, attn, "moe", mlp, c["hidden_size"])


GEMMA_SLIDING_PATTERN = {"gemma2": 2, "gemma3_text": 6}
"""Every n-th layer is full attention, the others sliding, when the config lists no
`layer_types` (transformers' Gemma2Config / Gemma3TextConfig default; Gemma3 hub configs
spell it `sliding_window_pattern`)."""


def _gemma(c: dict, j: int) -> BlockSpec:
    """gemma2 / gemma3_text: GQA (gemma3: q/k norms) + GeGLU MLP (same parameter count as
    SwiGLU), four RMSNorms per layer, sliding/full attention by `layer_types`.

    Saved-activation figures assume a fused attention kernel (FlashAttention with soft-capping);
    HF's eager path on CPU also keeps the [heads, S, S] probabilities, which this does not count.
    """
    mt = c["model_type"]
    pattern = c.get("sliding_window_pattern") or GEMMA_SLIDING_PATTERN[mt]
    default = "sliding_attention" if (j + 1) % pattern else "full_attention"
    attention = _layer_type(c, j, default)
    window = c.get("sliding_window") or 0
    bias = bool(c.get("attention_bias"))
    attn = _softmax_attention(c, bias_qkv=bias, bias_o=bias, qk_norm=mt == "gemma3_text",
                              gate=False, sinks=False,
                              window=window if attention == "sliding_attention" else 0,
                              fp32_norms=True)
    mlp = _dense_mlp(c["hidden_size"], c["intermediate_size"])
    return _block(j, attention, attn, "dense", mlp, c["hidden_size"], norms=4, fp32_norms=True,
                  truncated=False)


def _deepseek_v2(c: dict, j: int) -> BlockSpec:
    """DeepSeek-V2: MLA; layers j < first_k_dense_replace dense, the rest routed + shared."""
    H = c["hidden_size"]
    if j < c.get("first_k_dense_replace", 0):
        mlp_kind, mlp = "dense", _dense_mlp(H, c["intermediate_size"],
                                            bias=bool(c.get("mlp_bias")))
    else:
        inter = c["moe_intermediate_size"]
        mlp_kind, mlp = "moe", _moe_mlp(H, experts=c["n_routed_experts"],
                                        top_k=c["num_experts_per_tok"], inter=inter,
                                        shared_inter=inter * c.get("n_shared_experts", 0))
    return _block(j, "mla", _mla_attention(c), mlp_kind, mlp, H)


BLOCK_PARSERS = {
    "llama": _llama_like,
    "mistral": _llama_like,
    "qwen2": _llama_like,
    "qwen3": _llama_like,
    "qwen3_moe": _qwen3_moe,
    "qwen3_5": _qwen_hybrid,
    "qwen3_5_text": _qwen_hybrid,
    "qwen3_5_moe": _qwen_hybrid,
    "qwen3_5_moe_text": _qwen_hybrid,
    "qwen3_next": _qwen_hybrid,
    "mixtral": _mixtral,
    "gpt_oss": _gpt_oss,
    "deepseek_v2": _deepseek_v2,
    "phi3": _llama_like,
    "gemma2": _gemma,
    "gemma3_text": _gemma,
}
"""model_type -> per-layer parser (plain dict registry)."""
