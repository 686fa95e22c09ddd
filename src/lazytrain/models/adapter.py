"""Adapter from a Hugging Face decoder-only causal LM to the pieces the streaming engine runs.

Owns: finding the embedding, the block list, the final norm, the LM head (tied or not) and the
rotary module of an HF model; computing the per-block forward kwargs once per micro-batch
(position embeddings, position ids, the attention mask each layer needs, read from that layer's
own attributes); and running each piece *functionally* on weights the caller supplies
(`torch.func.functional_call`), so the module skeleton may live on the meta device while the
weights live in `runtime.params.HostParams`.

Knows nothing about plans, tiers or streams. Families plug in through `LAYOUTS`, a plain dict
from HF `model_type` to the attribute paths of the parts.

Legend: B = micro-batch size, S = sequence length, H = hidden size, V = vocabulary size.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from lazytrain.runtime.params import HostParams

IGNORE_INDEX = -100
"""Label value excluded from the loss (the HF convention)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class DecoderLayout:
    """Dotted attribute paths of the parts of an HF `*ForCausalLM` model."""

    embed: str = "model.embed_tokens"
    layers: str = "model.layers"
    norm: str = "model.norm"
    rotary: str = "model.rotary_emb"
    head: str = "lm_head"


LAYOUTS: dict[str, DecoderLayout] = {
    "llama": DecoderLayout(),
    "qwen3": DecoderLayout(),
    "qwen2": DecoderLayout(),
    "mistral": DecoderLayout(),
}
"""HF `model_type` -> layout. A family whose parts sit elsewhere adds an entry here."""


def _get(root: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        root = getattr(root, part)
    return root


def config_sha256(hf_config) -> str:
    """sha256 of the HF config as canonical JSON (sorted keys), the plan provenance key.

    Args:
        hf_config: a `transformers.PretrainedConfig`.
    """
    d = hf_config.to_diff_dict() if hasattr(hf_config, "to_diff_dict") else dict(hf_config)
    d = {k: v for k, v in d.items() if k not in ("transformers_version", "_name_or_path")}
    text = json.dumps(d, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def layer_attention_type(layer: nn.Module) -> str:
    """The attention kind of one decoder layer, read from the layer itself.

    HF layers record it as `attention_type` (Gemma/GPT-OSS style) or `self_attn.layer_type`
    (Qwen3); a layer with neither is full causal attention.
    """
    for owner in (layer, getattr(layer, "self_attn", None)):
        for attr in ("attention_type", "layer_type"):
            value = getattr(owner, attr, None) if owner is not None else None
            if isinstance(value, str):
                return value
    return "full_attention"


class ModelAdapter:
    """The parts of one HF causal LM plus its host parameter store.

    Args:
        model: an HF `*ForCausalLM` (parameters may be on the meta device).
        params: the host store holding this model's weights (fp32 master).

    Raises:
        ValueError: the model type has no entry in `LAYOUTS`.
    """

    def __init__(self, model: nn.Module, params: HostParams) -> None:
        mtype = model.config.model_type
        if mtype not in LAYOUTS:
            raise ValueError(f"model_type {mtype!r} has no adapter layout; "
                             f"supported: {sorted(LAYOUTS)}")
        layout = LAYOUTS[mtype]
        self.model = model
        self.config = model.config
        self.layout = layout
        self.embedding: nn.Embedding = _get(model, layout.embed)
        self.blocks: list[nn.Module] = list(_get(model, layout.layers))
        self.norm: nn.Module = _get(model, layout.norm)
        self.rotary: nn.Module = _get(model, layout.rotary)
        self.head: nn.Linear = _get(model, layout.head)
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        self.params = params
        self.config_sha256 = config_sha256(model.config)
        model.train()  # dropout active: the engine trains

    # --- names ---------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def block_prefix(self, j: int) -> str:
        """HF parameter-name prefix of block j, e.g. "model.layers.3."."""
        return f"{self.layout.layers}.{j}."

    @property
    def embed_name(self) -> str:
        return f"{self.layout.embed}.weight"

    @property
    def head_name(self) -> str:
        """Name of the head weight in the ends group (the embedding's name when tied)."""
        return self.embed_name if self.tied else f"{self.layout.head}.weight"

    # --- per micro-batch --------------------------------------------------------------------

    def block_kwargs(self, input_ids: torch.Tensor, hidden: torch.Tensor, *,
                     attention_mask: torch.Tensor | None = None,
                     position_ids: torch.Tensor | None = None) -> list[dict]:
        """Forward kwargs of every block for one micro-batch, computed once.

        Args:
            input_ids: [B, S] int64.
            hidden: [B, S, H] the embedding output (gives dtype and device of the masks).
            attention_mask: optional [B, S] 0/1 padding mask.
            position_ids: optional [B, S] int64; for packed batches positions restart at 0 per
                document and HF derives the block-diagonal mask from them.

        Returns:
            one dict per block: `position_embeddings` (cos, sin), `position_ids`,
            `attention_mask` for that layer's own attention type.
        """
        from transformers.masking_utils import (create_causal_mask,
                                                create_sliding_window_causal_mask)
        B, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S, device=hidden.device).unsqueeze(0)
        rotary_device = next(iter(self.rotary.buffers())).device
        cos, sin = self.rotary(hidden.to(rotary_device), position_ids.to(rotary_device))
        pos_emb = (cos.to(hidden.device), sin.to(hidden.device))
        mask_kwargs = dict(config=self.config, inputs_embeds=hidden,
                           attention_mask=attention_mask, cache=None, position_ids=position_ids)
        masks: dict[str, object] = {}
        out = []
        for layer in self.blocks:
            kind = layer_attention_type(layer)
            if kind not in masks:
                make = (create_sliding_window_causal_mask if kind == "sliding_attention"
                        else create_causal_mask)
                masks[kind] = make(**mask_kwargs)
            out.append({"position_embeddings": pos_emb, "position_ids": position_ids,
                        "attention_mask": masks[kind]})
        return out

    # --- functional pieces --------------------------------------------------------------------

    def embed(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Embedding lookup: [B, S] int64 -> [B, S, H] in `weight`'s dtype (padding_idx kept)."""
        return F.embedding(input_ids, weight, padding_idx=self.embedding.padding_idx)

    def forward_block(self, j: int, hidden: torch.Tensor, weights: dict[str, torch.Tensor],
                      kwargs: dict) -> torch.Tensor:
        """Block j on `weights` (local names, e.g. "mlp.up_proj.weight"): [B,S,H] -> [B,S,H]."""
        out = functional_call(self.blocks[j], weights, (hidden,), kwargs, strict=True)
        return out[0] if isinstance(out, tuple) else out

    def head_loss_sum(self, hidden: torch.Tensor, shift_labels: torch.Tensor, *,
                      norm_weight: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
        """Summed next-token cross entropy over one sequence chunk.

        Args:
            hidden: [B, C, H] chunk of the last boundary.
            shift_labels: [B, C] int64 target of each position (-100 ignored).
            norm_weight, head_weight: final-norm and LM-head weights.

        Returns:
            scalar fp32: the sum (not mean) of the losses of the chunk's label tokens; the
            caller divides by the label tokens of the whole optimizer step.
        """
        normed = functional_call(self.norm, {"weight": norm_weight}, (hidden,))
        logits = F.linear(normed, head_weight).float()  # [B, C, V], one chunk only
        return F.cross_entropy(logits.flatten(0, 1), shift_labels.flatten(),
                               ignore_index=IGNORE_INDEX, reduction="sum")


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """[B, S] labels -> [B, S] targets: position t predicts labels[t+1]; the last is ignored."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
