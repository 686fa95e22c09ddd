"""Adapter from a Hugging Face decoder-only causal LM to the pieces the streaming engine runs.

Owns: finding the embedding, the block list, the final norm, the LM head (tied or not) and the
rotary module of an HF model; computing the per-block forward kwargs once per micro-batch
(position embeddings, position ids, the attention mask each layer needs, read from that layer's
own attributes); and running each piece *functionally* on weights the caller supplies
(`torch.func.functional_call`), so the module skeleton may live on the meta device while the
weights live in `host_params.HostParams`.

Knows nothing about plans, tiers or streams. Families plug in through `families.LAYOUTS`, a
plain dict from HF `model_type` to the attribute paths of the parts, with a generic path for
other standard decoder-only models (`families.resolve_layout`).

Legend: B = micro-batch size, S = sequence length, H = hidden size, V = vocabulary size.
"""

from __future__ import annotations

import copy
import hashlib
import json

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from lazytrain.contract import IGNORE_INDEX
from lazytrain.models.families import (LAYOUTS, DecoderLayout, _get, accepts_causal_skip,
                                       cache_keyword, layer_attention_type, layer_mask_key,
                                       mask_builder, resolve_layout)
from lazytrain.models.host_params import HostParams
from lazytrain.models.router_aux import RouterAux, router_class
from lazytrain.models.truncate import stand_in_tails, tail_stand_ins

__all__ = ["IGNORE_INDEX", "LAYOUTS", "DecoderLayout", "ModelAdapter", "hf_config_sha256",
           "layer_attention_type", "shift_labels"]


def check_distinct_layers(layers, *, path: str) -> None:
    """Refuse a model that reuses one layer module, or one parameter, at two depths.

    The host store keeps one flat weight copy per depth and names each by its first HF path;
    a module (or parameter) shared by depths i < j would be stored at depth i only and stream
    zeros into depth j. Shared blocks are not supported; the model must be refused, not
    silently trained wrong.

    Args:
        layers: the decoder layers in depth order (`model.model.layers`).
        path: their HF path, for the message ("model.layers").

    Raises:
        ValueError: names both depths and the fix.
    """
    first_module: dict[int, int] = {}
    first_param: dict[int, tuple[int, str]] = {}
    for j, layer in enumerate(layers):
        i = first_module.setdefault(id(layer), j)
        if i != j:
            raise ValueError(f"{path}[{j}] is the same module as {path}[{i}] (one layer reused "
                             f"at two depths): streaming keeps one weight copy per depth and "
                             f"would run depth {j} on zeros; give every depth its own module "
                             f"(copy.deepcopy) or train it another way")
        for name, p in layer.named_parameters(remove_duplicate=False):
            i, first = first_param.setdefault(id(p), (j, name))
            if i != j:
                raise ValueError(f"{path}.{j}.{name} is the same parameter as {path}.{i}."
                                 f"{first} (weights shared across depths): streaming keeps one "
                                 f"copy per depth and would run depth {j} on zeros; untie them "
                                 f"or train the model another way")


def hf_config_sha256(hf_config) -> str:
    """sha256 of the HF config as written: its non-default entries as canonical JSON (sorted
    keys), without `transformers_version` and `_name_or_path`.

    Not the planner's `spec.model.ModelSpec.config_sha256`, which hashes the architecture parsed
    from the config (so two spellings of the same shapes agree) and is what planner-made plans
    record as `model_config_sha256`. This one works for every model the adapter loads, also
    those the planner cannot parse; plans built by hand for such a model record it.

    Args:
        hf_config: a `transformers.PretrainedConfig` (or a plain dict).
    """
    d = hf_config.to_diff_dict() if hasattr(hf_config, "to_diff_dict") else dict(hf_config)
    d = {k: v for k, v in d.items() if k not in ("transformers_version", "_name_or_path")}
    text = json.dumps(d, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class ModelAdapter:
    """The parts of one HF causal LM plus its host parameter store.

    Args:
        model: an HF `*ForCausalLM` (parameters may be on the meta device).
        params: the host store holding this model's weights (fp32 master).

    Raises:
        ValueError: the model is neither a family in `LAYOUTS` nor a standard decoder-only
            model.
    """

    def __init__(self, model: nn.Module, params: HostParams) -> None:
        layout = resolve_layout(model)
        self.model = model
        self.config = model.config
        self.layout = layout
        self.embedding: nn.Embedding = _get(model, layout.embed)
        self.blocks: list[nn.Module] = list(_get(model, layout.layers))
        self.norm: nn.Module = _get(model, layout.norm)
        self.rotary: nn.Module = _get(model, layout.rotary)
        self.head: nn.Linear = _get(model, layout.head)
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        # Gemma-style `*ScaledWordEmbedding` multiplies its output by sqrt(H) in the weight's
        # dtype; a plain nn.Embedding has no such attribute
        self.embed_scale: float | None = getattr(self.embedding, "scalar_embed_scale", None)
        self.logit_softcap: float | None = getattr(model.config, "final_logit_softcapping",
                                                   None)
        self.params = params
        self.hf_config_sha256 = hf_config_sha256(model.config)
        self.router_cls = router_class(model)
        # the re-forward skips each block's last projection (models/truncate.py) where the
        # family allows it; benchmarks turn it off to measure the full re-forward beside it
        self.truncated_reforward = layout.full_reforward_reason is None
        self._tails = [tail_stand_ins(b) for b in self.blocks]
        self._per_shape: dict[tuple, dict] = {}  # (B, S, dtype, device) -> masks, ropes
        # of the last unpadded shape only (`block_kwargs`)
        self._rotaries: dict[torch.device, nn.Module] = {}  # device -> rotary copy there
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
                     position_ids: torch.Tensor | None = None, cache=None,
                     padded: bool | None = None, packed: bool | None = None) -> list[dict]:
        """Forward kwargs of every block for one micro-batch, computed once.

        Args:
            input_ids: [B, S] int64.
            hidden: [B, S, H] the embedding output (gives dtype and device of the masks).
            attention_mask: optional [B, S] 0/1 padding mask.
            position_ids: optional [B, S] int64; for packed batches positions restart at 0 per
                document and HF derives the block-diagonal mask from them.
            cache: an HF KV cache (`transformers.DynamicCache`) for decoding, or None
                (training). With a cache, `attention_mask` spans the cached and the new tokens,
                position ids come from left padding (not packing), and every dict also holds
                the cache, which each block's attention appends its keys and values to.
            padded, packed: facts the caller read on the host batch before its H2D (`None`:
                unknown, HF reads the device tensors, a device sync each): whether
                `attention_mask` masks any token, and whether `position_ids` step by other than
                1 inside a row (HF's packed-sequence test; the caller ran `check_packing`).
                Without padding, position ids and cache, the masks and the rotary tables depend
                on the shape only: built on the device once and reused while the shape stays
                (those of the last shape only are kept); with padding, the masks skip HF's
                "all ones?" test.

        Returns:
            one dict per block: `position_embeddings` (the rotary module's output: (cos, sin),
            or DeepSeek-V2's complex freqs_cis; Gemma3: the one for the layer's kind),
            `position_ids`, `attention_mask` built for that layer's own kind and sliding window
            (read from the layer, `families.layer_mask_key`): a 4D causal or
            banded mask (or None where SDPA's causal shortcut applies) for softmax attention,
            the [B, S] padding mask or None for linear attention. Layers that share
            (kind, window) share one mask object.
        """
        B, S = input_ids.shape
        if padded is False:
            attention_mask = None  # all ones: HF would find that on the device
        shape_only = cache is None and attention_mask is None and position_ids is None
        if position_ids is None:
            position_ids = torch.arange(S, device=hidden.device).unsqueeze(0)
            mask_positions = None  # HF's packing test would find none
        else:
            if cache is None and packed is None:
                self.check_packing(position_ids)
            mask_positions = None if packed is False else position_ids
        shape = (B, S, hidden.dtype, hidden.device)
        if shape_only and shape not in self._per_shape:
            # one shape's tables only: a GRPO micro-batch is cut to its longest row, so the
            # shapes change all run long and a cache of each would grow in device memory past
            # the plan's one micro-batch of block inputs (a micro-batch in flight keeps its own)
            self._per_shape.clear()
        shared = self._per_shape.setdefault(shape, {}) if shape_only else {}
        masks = shared.setdefault("masks", {})
        ropes = shared.setdefault("ropes", {})
        out = []
        for layer in self.blocks:
            key = layer_mask_key(layer, self.config, self.layout)
            if key not in masks:
                masks[key] = self._mask(key, hidden, attention_mask, mask_positions, cache,
                                        skip_test=not padded)
            rope_kind = layer_attention_type(layer) if self.layout.rotary_per_layer_type else None
            if rope_kind not in ropes:
                ropes[rope_kind] = self._rope(hidden, position_ids, rope_kind)
            out.append({"position_embeddings": ropes[rope_kind], "position_ids": position_ids,
                        "attention_mask": masks[key]})
            if cache is not None:
                out[-1].update({cache_keyword(type(layer).forward): cache, "use_cache": True})
        return out

    def _rope(self, hidden: torch.Tensor, position_ids: torch.Tensor, kind: str | None):
        """The rotary module's output on `hidden`'s device: (cos, sin) [B or 1, S, head_dim]
        for most families, one complex freqs_cis tensor for DeepSeek-V2; `kind` is the layer
        kind for a per-kind rotary (Gemma3), None otherwise."""
        rotary = self._rotary_on(hidden.device)
        # HF's rotary reads only the dtype and device of its first argument: an empty tensor,
        # not [B, S, H]; it runs on the device (no D2H of the positions, no pageable H2D back)
        probe = torch.empty(0, dtype=hidden.dtype, device=hidden.device)
        args = (probe, position_ids)
        return rotary(*args) if kind is None else rotary(*args, kind)

    def _rotary_on(self, device: torch.device) -> nn.Module:
        """The rotary module with its buffers (inverse frequencies, a few KB) on `device`: the
        model's own where they live, else a copy made once per device."""
        if next(iter(self.rotary.buffers())).device == device:
            return self.rotary
        if device not in self._rotaries:
            self._rotaries[device] = copy.deepcopy(self.rotary).to(device)
        return self._rotaries[device]

    def check_packing(self, position_ids: torch.Tensor) -> bool:
        """Whether rows are packed (positions restart inside a row: read on the tensor's
        device, so a caller avoids a device sync by passing the host batch's); refused on
        linear-attention layers.

        The Gated-DeltaNet torch fallback that HF runs without flash-linear-attention ignores
        `cu_seqlens` and its causal conv1d spans the whole row, so a packed document would read
        the recurrent state of the previous one (HF itself does this silently).

        Raises:
            ValueError: packed position_ids and a linear-attention layer.
        """
        restarts = position_ids[..., 1:] <= position_ids[..., :-1]
        if not bool(restarts.any()):
            return False
        linear = [j for j, b in enumerate(self.blocks)
                  if layer_attention_type(b) == "linear_attention"]
        if linear:
            raise ValueError(f"data.packing: packed sequences are not isolated in the "
                             f"linear-attention layers {linear[:4]} (torch fallback of the gated "
                             f"delta rule has no cu_seqlens); disable packing for this model")
        return True

    def _mask(self, key: tuple[str, int | None], hidden: torch.Tensor,
              attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, cache=None,
              *, skip_test: bool = True):
        """HF's mask for one (kind, sliding window); the window is the layer's own, so a
        config copy carries it when it differs from the config's. `skip_test` False: the mask
        is known to pad some token, so HF's "all ones, use is_causal?" test (a device sync) is
        not run where the builder takes `allow_is_causal_skip` (its answer would be no)."""
        kind, window = key
        config = self.config
        if window is not None and window != getattr(config, "sliding_window", None):
            config = copy.copy(config)
            config.sliding_window = window
        build = mask_builder(kind, cache=cache)
        extra = {} if skip_test or not accepts_causal_skip(kind) else \
            {"allow_is_causal_skip": False}
        return build(config=config, inputs_embeds=hidden, attention_mask=attention_mask,
                     position_ids=position_ids, **extra)

    @property
    def router_aux_enabled(self) -> bool:
        """HF adds the router aux loss: a MoE model with `output_router_logits` and a nonzero
        `router_aux_loss_coef` (HF's `*ForCausalLM` reads both from the config)."""
        return bool(self.router_cls is not None
                    and getattr(self.config, "output_router_logits", False)
                    and getattr(self.model, "router_aux_loss_coef", 0))

    def new_router_aux(self, attention_mask: torch.Tensor | None) -> RouterAux | None:
        """A fresh per-micro-batch aux-loss accumulator, or None when the loss is off.

        Args:
            attention_mask: [B, S] 0/1 padding mask of the micro-batch, or None.
        """
        if not self.router_aux_enabled:
            return None
        return RouterAux(num_experts=self.model.num_experts, top_k=self.model.num_experts_per_tok,
                         coef=float(self.model.router_aux_loss_coef),
                         attention_mask=attention_mask)

    # --- functional pieces --------------------------------------------------------------------

    def embed(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Embedding lookup: [B, S] int64 -> [B, S, H] in `weight`'s dtype (padding_idx kept),
        times the family's embedding scale (Gemma: sqrt(H), rounded to `weight`'s dtype first,
        as HF does)."""
        out = F.embedding(input_ids, weight, padding_idx=self.embedding.padding_idx)
        if self.embed_scale is None:
            return out
        return out * torch.tensor(self.embed_scale, dtype=weight.dtype, device=weight.device)

    def forward_block(self, j: int, hidden: torch.Tensor, weights: dict[str, torch.Tensor],
                      kwargs: dict, *, router_logits: list | None = None,
                      truncated: bool = False) -> torch.Tensor:
        """Block j on `weights` (local names, e.g. "mlp.up_proj.weight"): [B,S,H] -> [B,S,H].

        Args:
            router_logits: when a list, the [B*S, E] logits of each router in the block are
                appended to it (forward hooks on HF's recorded router class, output 0).
            truncated: the re-forward of block j's own backward: when `truncated_reforward`
                is on, the block's last projection is not run and the output *value* is wrong
                (not to be read); its autograd gradients, given the output's gradient, are
                exact (models/truncate.py).
        """
        hooks = []
        if router_logits is not None and self.router_cls is not None:
            hooks = [m.register_forward_hook(lambda _m, _i, out: router_logits.append(out[0]))
                     for m in self.blocks[j].modules() if isinstance(m, self.router_cls)]
        tails = self._tails[j] if truncated and self.truncated_reforward else ()
        try:
            with stand_in_tails(tails):
                out = functional_call(self.blocks[j], weights, (hidden,), kwargs, strict=True)
        finally:
            for h in hooks:
                h.remove()
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
            caller divides by the label tokens of the whole optimizer step. Logits are
            soft-capped first when the config sets `final_logit_softcapping` (Gemma2).
        """
        logits = self.head_logits(hidden, norm_weight=norm_weight, head_weight=head_weight)
        return F.cross_entropy(logits.flatten(0, 1), shift_labels.flatten(),
                               ignore_index=IGNORE_INDEX, reduction="sum")

    def head_logits(self, hidden: torch.Tensor, *, norm_weight: torch.Tensor,
                    head_weight: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head of one chunk: [B, C, H] -> [B, C, V] fp32 logits, soft-capped
        first when the config sets `final_logit_softcapping` (Gemma2: cap * tanh(logits /
        cap), as HF). The caller bounds C: the logits of a whole sequence can be gigabytes."""
        normed = functional_call(self.norm, {"weight": norm_weight}, (hidden,))
        logits = F.linear(normed, head_weight)  # [B, C, V], one chunk only
        if self.logit_softcap is not None:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits.float()


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """[B, S] labels -> [B, S] targets: position t predicts labels[t+1]; the last is ignored."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
