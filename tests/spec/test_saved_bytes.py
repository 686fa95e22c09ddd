"""Save-level bytes (spec/saved_bytes.py through BlockSpec.saved_level_bytes) against the bytes
autograd's saved-tensor hooks see in the real HF decoder layers of tiny models.

The reference is the test's own (tests/saved_hooks.py): hooks record every saved tensor's
storage (once), attributed to the module running when it was saved; the block's input, its
parameters and the rotary tables are excluded. L1 = the storages saved inside the input norm
and the token mixer, plus the mixer's output; L2 = every storage.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lazytrain.spec.model import ModelSpec  # noqa: E402
from saved_hooks import hook_bytes, level_config as _config  # noqa: E402


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


@pytest.mark.parametrize("name,dtype,nbytes,seq_len", [
    ("llama", torch.float32, 4, 8), ("llama", torch.bfloat16, 2, 8),
    ("qwen3_moe", torch.float32, 4, 8), ("qwen3_moe", torch.bfloat16, 2, 8),
    # hybrid: block 0 Gated DeltaNet (torch chunked fallback, chunk 64), block 1 gated full
    # attention; both with a routed + gated shared expert MLP
    ("qwen3_next", torch.bfloat16, 2, 100), ("qwen3_next", torch.bfloat16, 2, 128),
    ("qwen3_next", torch.float32, 4, 100),
], ids=["llama-fp32", "llama-bf16", "qwen3_moe-fp32", "qwen3_moe-bf16",
        "qwen3_next-bf16-padded", "qwen3_next-bf16-two-chunks", "qwen3_next-fp32-padded"])
def test_save_level_bytes_equal_the_hooks_exactly(name, dtype, nbytes, seq_len):
    cfg, seen = measured(name, dtype, seq_len=seq_len)
    assert formula(cfg, nbytes, seq_len=seq_len) == seen


def test_linear_attention_fp32_without_padding_is_within_the_documented_gap():
    """fp32 compute, S = 2 chunks: the hooks see 4 x 2 - 1 = 7 more chunk slices of
    B x C x n x d fp32 than the formula (saved_bytes.gated_deltanet); the attention block is
    exact."""
    cfg, seen = measured("qwen3_next", torch.float32, seq_len=128)
    (lin_l1, lin_l2), attn = formula(cfg, 4, seq_len=128)
    slice_bytes = 2 * 64 * 4 * 16 * 4  # B x C x n x d x fp32
    assert seen[0] == (lin_l1 + 7 * slice_bytes, lin_l2 + 7 * slice_bytes)
    assert seen[1] == attn


def test_l1_keeps_less_than_l2_and_the_l1_reforward_runs_less_than_the_l0_one():
    spec = ModelSpec.from_hf_config(_config("qwen3_next").to_dict())
    for blk in spec.blocks:
        s1, s2 = blk.saved_level_bytes(micro_batch=2, seq_len=256, dtype_bytes=2)
        assert 0 < s1 < s2
        assert 0 < blk.reforward_l1_share(256) < 1 - blk.reforward_skip_share(256)


def test_dense_l1_reforward_share_by_hand():
    """Llama block, H = 64, I = 96, 4 heads x 16, 2 kv heads: the L1 re-forward runs the
    post-attention norm (H params) and the gate and up projections (2 H I), not the down
    projection (the truncated tail) nor the attention; FLOPs 2 x (2 x 64 x 96 + 64) = 24,704
    per token, of a forward of 2 x active + the attention core (S = 8: 2 x 4 x (16 + 16) x 4.5
    = 1,152)."""
    blk = ModelSpec.from_hf_config(_config("llama").to_dict()).blocks[0]
    attn = 64 * 64 + 2 * 64 * 32 + 64 * 64
    active = attn + 3 * 64 * 96 + 2 * 64
    assert blk.reforward_l1_share(8) == pytest.approx(
        2 * (2 * 64 * 96 + 64) / (2 * active + 2 * 4 * 32 * 4.5))
