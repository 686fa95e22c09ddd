"""What differs between decoder-only families: where the parts sit, what kind each layer is,
which attention mask each kind needs, and which checkpoint tensors belong to the text model.

Owns the family registry `LAYOUTS` (a plain dict from HF `model_type` to a `DecoderLayout`),
the generic path for any other decoder-only model with the standard parts
(`model.embed_tokens`, `model.layers`, `model.norm`, `model.rotary_emb`, `lm_head`), and the
per-layer reading of the layer kind (full, sliding-window or linear attention). Every
per-layer attribute is read from that layer's own module, never from a template layer.

Knows nothing about plans, tiers, streams or the host store.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn
from transformers.masking_utils import LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from lazytrain.spec.model import check_relative_positions


@dataclass(kw_only=True, frozen=True, slots=True)
class DecoderLayout:
    """Dotted attribute paths of the parts of an HF `*ForCausalLM` model, and how its
    checkpoint names map onto them."""

    embed: str = "model.embed_tokens"
    layers: str = "model.layers"
    norm: str = "model.norm"
    rotary: str = "model.rotary_emb"
    head: str = "lm_head"
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    """(checkpoint prefix, model prefix) pairs applied to safetensors names on load, e.g. a
    vision-language checkpoint's `model.language_model.` -> `model.`."""
    checkpoint_skips: tuple[str, ...] = ()
    """Checkpoint name prefixes that are not part of the causal LM (vision tower, MTP head);
    HF skips them too (`_keys_to_ignore_on_load_unexpected`)."""
    config_sliding_window: bool = False
    """Every layer attends within the config's `sliding_window` when it is set: Mistral,
    Mixtral and Phi3 build one model-wide banded mask (`create_sliding_window_causal_mask`) and
    record no kind on their layers."""
    rotary_per_layer_type: bool = False
    """The rotary module takes the layer kind (`rotary(x, position_ids, layer_type)`) and
    returns other frequencies per kind: Gemma3's local (sliding, theta 1e4) and global (full,
    theta 1e6) rotary embeddings."""
    full_reforward_reason: str | None = None
    """Why the family's re-forward cannot skip the MLP's last projection (its layer reads that
    projection's output: models/truncate.py), or None: truncated re-forward."""


_STANDARD = DecoderLayout()
_POST_FFN_NORM = ("post_feedforward_layernorm normalizes the MLP output, so its backward reads "
                  "the down projection's output; only the residual add (elementwise) is unread")
_VLM_TEXT = DecoderLayout(checkpoint_renames=(("model.language_model.", "model."),),
                          checkpoint_skips=("model.visual.", "mtp."))
"""Qwen3.5 / Qwen3.6 checkpoints are vision-language: the text model sits under
`model.language_model`, the vision tower under `model.visual`, multi-token prediction under
`mtp`. `AutoModelForCausalLM` on the nested config builds the text-only `*ForCausalLM`."""

_GEMMA3_TEXT = DecoderLayout(
    rotary_per_layer_type=True, full_reforward_reason=_POST_FFN_NORM,
    checkpoint_renames=(("model.language_model.", "model."), ("language_model.model.", "model."),
                        ("language_model.lm_head.", "lm_head.")),
    checkpoint_skips=("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
                      "multi_modal_projector."))
"""Gemma3: per-kind rotary; a vision-language checkpoint's text weights sit under
`model.language_model` (transformers 5) or `language_model.model` (older saves)."""

_MODEL_WIDE_WINDOW = DecoderLayout(config_sliding_window=True)
_GENERIC = DecoderLayout(full_reforward_reason="not a listed family: whether its layer reads the "
                                               "MLP output (a post-feedforward norm) is unknown")

LAYOUTS: dict[str, DecoderLayout] = {
    "llama": _STANDARD,
    "mistral": _MODEL_WIDE_WINDOW,
    "qwen2": _STANDARD,
    "qwen3": _STANDARD,
    "qwen3_moe": _STANDARD,
    "mixtral": _MODEL_WIDE_WINDOW,
    "gpt_oss": _STANDARD,
    "deepseek_v2": _STANDARD,
    "phi3": _MODEL_WIDE_WINDOW,
    "gemma2": DecoderLayout(full_reforward_reason=_POST_FFN_NORM),
    "gemma3_text": _GEMMA3_TEXT,
    "qwen3_next": DecoderLayout(checkpoint_skips=("mtp.",)),
    "qwen3_5_text": _VLM_TEXT,
    "qwen3_5": _VLM_TEXT,
    "qwen3_5_moe_text": _VLM_TEXT,
    "qwen3_5_moe": _VLM_TEXT,
}
"""HF `model_type` -> layout. The nested `qwen3_5`/`qwen3_5_moe` configs build the text model
(`model_type` `*_text`); both names are listed so a checkpoint directory of either loads.
Any other decoder-only model with the standard parts goes through `resolve_layout`'s generic
path."""


TEXT_MODEL_OF: dict[str, str] = {"gemma3": "gemma3_text"}
"""Vision-language `model_type` -> its text model's: `AutoModelForCausalLM` maps these to the
whole `*ForConditionalGeneration`, so the loader builds the text model from `text_config`
(the layout of the text type renames the checkpoint's `language_model` tensors)."""


def text_model_config(hf_config):
    """The config to build the causal LM from: `hf_config.text_config` for a vision-language
    type in `TEXT_MODEL_OF`, else `hf_config` itself."""
    if getattr(hf_config, "model_type", None) in TEXT_MODEL_OF:
        return hf_config.get_text_config()
    return hf_config


def _get(root: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        root = getattr(root, part)
    return root


def _has(root: nn.Module, path: str) -> bool:
    try:
        _get(root, path)
    except AttributeError:
        return False
    return True


def resolve_layout(model: nn.Module) -> DecoderLayout:
    """The layout of `model`: its family's entry in `LAYOUTS`, else the generic decoder path.

    The generic path accepts a model whose class is the one `transformers` registers as the
    causal LM of its `model_type` (so a relabelled model is refused) and which has the
    standard parts with `model.layers` a ModuleList.

    Raises:
        ValueError: an absolute-position model (gpt2-style), or not a supported family and not
            a standard decoder-only model; the message lists the supported families.
    """
    mtype = model.config.model_type
    check_relative_positions(model.config.to_dict())
    if mtype in LAYOUTS:
        return LAYOUTS[mtype]
    registered = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(mtype)
    parts = ("embed", "layers", "norm", "rotary", "head")
    standard = all(_has(model, getattr(_STANDARD, p)) for p in parts)
    if (registered == type(model).__name__ and standard
            and isinstance(_get(model, _STANDARD.layers), nn.ModuleList)):
        return _GENERIC
    raise ValueError(f"model_type {mtype!r} has no adapter layout and is not a standard "
                     f"decoder-only model (model.embed_tokens/layers/norm/rotary_emb + lm_head); "
                     f"supported: {sorted(LAYOUTS)}")


KIND_ATTRS = ("attention_type", "layer_type", "block_type")
"""Attributes under which HF layers record their kind: Gemma/GPT-OSS `attention_type`,
Qwen3 `self_attn.layer_type`, Qwen3-Next/Qwen3.5 `block_type` and `linear_attn.layer_type`."""


def layer_attention_type(layer: nn.Module) -> str:
    """The attention kind of one decoder layer ("full_attention", "sliding_attention",
    "linear_attention", ...), read from the layer itself and its mixer submodule; a layer
    that records none is full causal attention."""
    owners = (layer, getattr(layer, "self_attn", None), getattr(layer, "linear_attn", None))
    for owner in owners:
        if owner is None:
            continue
        for attr in KIND_ATTRS:
            value = getattr(owner, attr, None)
            if isinstance(value, str):
                return value
    return "full_attention"


def layer_sliding_window(layer: nn.Module, config) -> int | None:
    """The sliding window (tokens) of one layer, from its attention module (GPT-OSS and
    Mistral-style layers set `self_attn.sliding_window` only on sliding layers), falling back
    to the config's window for a "sliding_attention" layer that records none; None otherwise."""
    window = getattr(getattr(layer, "self_attn", None), "sliding_window", None)
    if isinstance(window, int):
        return window
    if layer_attention_type(layer) == "sliding_attention":
        return getattr(config, "sliding_window", None)
    return None


def layer_mask_key(layer: nn.Module, config, layout: DecoderLayout) -> tuple[str, int | None]:
    """(attention kind, sliding window in tokens or None) of one layer: what its mask depends
    on. A family with a model-wide window (`DecoderLayout.config_sliding_window`) makes every
    full-attention layer sliding when the config sets `sliding_window`."""
    kind = layer_attention_type(layer)
    window = getattr(config, "sliding_window", None)
    if layout.config_sliding_window and kind == "full_attention" and isinstance(window, int):
        return "sliding_attention", window
    return kind, layer_sliding_window(layer, config)


def mask_builder(kind: str, *, cache=None):
    """HF's mask function for a layer kind (`masking_utils.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING`:
    causal for full attention, the banded causal mask for sliding windows, the 2D padding mask
    or None for linear attention), called with the KV cache `cache` (None: training, no cache;
    a decode step's mask spans the cached tokens and the new ones).

    Raises:
        ValueError: a kind HF has no mask function for.
    """
    table = LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING
    fn = table.get(kind)
    if fn is None or isinstance(fn, dict):
        raise ValueError(f"layer kind {kind!r} has no attention mask builder; "
                         f"known: {sorted(k for k, v in table.items() if not isinstance(v, dict))}")
    return lambda **kwargs: fn(**kwargs, **{cache_keyword(fn): cache})


def accepts_causal_skip(kind: str) -> bool:
    """Whether HF's mask function for layer kind `kind` takes `allow_is_causal_skip` (the
    causal and sliding-window builders: False skips their "padding mask all ones?" test)."""
    fn = LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING.get(kind)
    return callable(fn) and "allow_is_causal_skip" in inspect.signature(fn).parameters


def cache_keyword(fn) -> str:
    """The name transformers gives the KV cache argument of `fn` (a mask function or a decoder
    layer's forward): `cache` (newer releases) or `past_key_values` (5.17, the oldest version
    we support)."""
    return "cache" if "cache" in inspect.signature(fn).parameters else "past_key_values"
