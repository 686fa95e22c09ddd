"""Save-level bytes (spec/saved_bytes.py through BlockSpec.saved_level_bytes) against the bytes
autograd's saved-tensor hooks see in the real HF decoder layers of tiny models.

The reference is written here: hooks record every saved tensor's storage (once), attributed
to the module running when it was saved; the block's input, its parameters and the rotary
tables are excluded. L1 = the storages saved inside the input norm and the token mixer, plus
the mixer's output; L2 = every storage.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lazytrain.spec.model import ModelSpec  # noqa: E402

MIXERS = ("self_attn", "linear_attn")
COMMON = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, num_hidden_layers=2, vocab_size=128)


def _config(name: str):
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


def hook_bytes(layer, x, kwargs, rotary) -> tuple[int, int]:
    """(L1, L2) bytes autograd saves in `layer(x, **kwargs)`, by storage, written independently
    of the code under test."""
    excluded = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    excluded |= {x.untyped_storage().data_ptr()} | {t.untyped_storage().data_ptr()
                                                     for t in rotary}
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

    def pack(t):
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


def measured(name: str, dtype, *, micro_batch: int = 2, seq_len: int = 8):
    torch.manual_seed(0)
    cfg = _config(name)
    cfg._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
    ids = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len))
    with torch.no_grad():
        h = model.model.embed_tokens(ids)
    pos = torch.arange(seq_len)[None]
    rotary = model.model.rotary_emb(h, pos)
    out = []
    for layer in model.model.layers:
        kwargs = dict(position_embeddings=rotary, position_ids=pos, attention_mask=None)
        out.append(hook_bytes(layer, h.clone().requires_grad_(), kwargs, rotary))
    return cfg, out


def formula(cfg, dtype_bytes, *, micro_batch=2, seq_len=8):
    spec = ModelSpec.from_hf_config(cfg.to_dict())
    return [b.saved_level_bytes(micro_batch=micro_batch, seq_len=seq_len,
                                dtype_bytes=dtype_bytes) for b in spec.blocks]


@pytest.mark.parametrize("name,dtype,nbytes", [
    ("llama", torch.float32, 4), ("llama", torch.bfloat16, 2),
    ("qwen3_moe", torch.float32, 4), ("qwen3_moe", torch.bfloat16, 2),
], ids=["llama-fp32", "llama-bf16", "qwen3_moe-fp32", "qwen3_moe-bf16"])
def test_save_level_bytes_equal_the_hooks_exactly(name, dtype, nbytes):
    cfg, seen = measured(name, dtype)
    assert formula(cfg, nbytes) == seen
