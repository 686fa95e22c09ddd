"""The tests' own reference for save-level bytes: what autograd saves in one HF decoder layer,
read with `torch.autograd.graph.saved_tensors_hooks` (independent of spec/saved_bytes.py and of
models/saved_tensors.py)."""

from __future__ import annotations

import torch

MIXERS = ("self_attn", "linear_attn")
"""A decoder layer's token mixer attribute (softmax or Gated-DeltaNet linear attention)."""
COMMON = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, num_hidden_layers=2, vocab_size=128)


def level_config(name: str):
    """A tiny 2-layer HF config: "llama" (dense), "qwen3_moe" (4 experts, top 2) or
    "qwen3_next" (block 0 Gated DeltaNet, block 1 gated full attention, both MoE with a gated
    shared expert)."""
    import transformers  # lazy: the tests that use it importorskip transformers first

    if name == "llama":
        return transformers.LlamaConfig(**COMMON)
    if name == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32)
    if name == "qwen3_next":
        return transformers.Qwen3NextConfig(
            **COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            layer_types=["linear_attention", "full_attention"])
    raise KeyError(name)


def hook_bytes(layer, x, kwargs, excluded_tensors=()) -> tuple[int, int]:
    """(L1, L2) bytes autograd saves in `layer(x, **kwargs)`: every saved storage once, less
    the input `x`, the layer's parameters and `excluded_tensors` (rotary tables, masks).

    L1: the storages saved while the input norm or the token mixer runs, plus the mixer's
    output (compute dtype); L2: every storage. Saved tensors are held until the end, as the
    runtime's hooks hold them: a branch the forward drops (the chunk scan's unused final state)
    would otherwise free a storage whose address a later tensor could reuse.
    """
    excluded = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    excluded |= {t.untyped_storage().data_ptr() for t in (x, *excluded_tensors)}
    stack: list[str] = []
    handles = []
    for name, mod in layer.named_modules():
        top = name.split(".")[0]
        handles.append(mod.register_forward_pre_hook(lambda *_a, n=top: stack.append(n)))
        handles.append(mod.register_forward_hook(lambda *_a: stack.pop() and None))
    mixer_out = []
    for name in MIXERS:
        if hasattr(layer, name):
            handles.append(getattr(layer, name).register_forward_hook(
                lambda _m, _i, out: mixer_out.append(out[0] if isinstance(out, tuple) else out)
                and None))
    seen: dict[int, tuple[int, bool]] = {}
    held = []

    def pack(t):
        held.append(t)
        ptr = t.untyped_storage().data_ptr()
        if ptr not in excluded and ptr not in seen:
            seen[ptr] = (t.untyped_storage().nbytes(), stack[-1] in ("input_layernorm",) + MIXERS)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(x, **kwargs)
    finally:
        for h in handles:
            h.remove()
    l2 = sum(n for n, _ in seen.values())
    l1 = sum(n for n, mixer in seen.values() if mixer) + mixer_out[0].numel() * x.element_size()
    return l1, l2
