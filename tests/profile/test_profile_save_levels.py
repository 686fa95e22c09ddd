"""The profiler's save-level entries: the bytes it measures through the runtime's L1 / L2
forward (models/saved_tensors.py) equal the test's own saved-tensor hooks on the HF layer
(tests/saved_hooks.py), per block kind, and its L1 re-forward time is a non-negative
difference of the two backwards."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lazytrain.models import adapter_from_model  # noqa: E402
from lazytrain.profile.bench_blocks import BlockBench  # noqa: E402
from lazytrain.profile.save_levels import save_level_entries  # noqa: E402
from lazytrain.spec.model import ModelSpec  # noqa: E402
from saved_hooks import hook_bytes, level_config  # noqa: E402

BATCH, SEQ = 2, 100  # S past one chunk of the linear attention (64), not a multiple of it


def reference_bytes(cfg, j: int) -> tuple[int, int]:
    """(L1, L2) of layer j of a fresh fp32 HF model of `cfg` (the bytes do not depend on the
    weights' values: every token goes to top-k experts whatever the router says)."""
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    h = torch.randn(BATCH, SEQ, cfg.hidden_size, requires_grad=True)
    pos = torch.arange(SEQ)[None]
    rotary = model.model.rotary_emb(h, pos)
    kwargs = dict(position_embeddings=rotary, position_ids=pos, attention_mask=None)
    return hook_bytes(model.model.layers[j], h, kwargs, rotary)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "qwen3_next"])
def test_profiled_saved_bytes_equal_the_hooks_per_kind(family):
    cfg = level_config(family)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    adapter = adapter_from_model(transformers.AutoModelForCausalLM.from_config(
        cfg, dtype=torch.float32))
    kinds = [b.kind for b in ModelSpec.from_hf_config(cfg.to_dict()).blocks]
    bench = BlockBench(adapter, micro_batch=BATCH, seq_len=SEQ, dtype="fp32",
                       device=torch.device("cpu"))
    entries = save_level_entries(bench, kinds, repeats=1, warmup=0)
    assert list(entries) == list(dict.fromkeys(kinds))
    for kind, entry in entries.items():
        j = kinds.index(kind)
        assert (entry["saved_l1_bytes"], entry["saved_l2_bytes"]) == reference_bytes(cfg, j)
        assert entry["reforward_l1_ms"] == max(
            0.0, entry["backward_l1_ms"] - entry["backward_l2_ms"])
