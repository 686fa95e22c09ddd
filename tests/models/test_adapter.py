"""The HF adapter: functional forward equals HF's, per-layer masks come from each layer, and a
model directory round-trips through the host store (meta-device skeleton)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from engine_helpers import model_pair, tiny_config  # noqa: E402
from lazytrain.models import (load_adapter_from_dir, save_hf_dir, shift_labels)  # noqa: E402
from lazytrain.models.adapter import ModelAdapter, layer_attention_type  # noqa: E402


def _adapter_loss(adapter, ids, mask=None):
    ends = adapter.params.ends.master_views
    with torch.no_grad():
        h = adapter.embed(ids, ends[adapter.embed_name])
        kwargs = adapter.block_kwargs(ids, h, attention_mask=mask)
        for j in range(adapter.num_blocks):
            h = adapter.forward_block(j, h, adapter.params.blocks[j].master_views, kwargs[j])
        targets = shift_labels(ids)
        total = adapter.head_loss_sum(h, targets, norm_weight=ends["model.norm.weight"],
                                      head_weight=ends[adapter.head_name])
    return float(total) / int((targets != -100).sum())


def test_sliding_window_layers_get_their_own_mask_and_match_hf():
    config = Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, use_sliding_window=True, sliding_window=3,
                         max_window_layers=1, layer_types=["full_attention", "sliding_attention"])
    ref, adapter = model_pair(config)
    assert [layer_attention_type(b) for b in adapter.blocks] == config.layer_types
    ids = torch.randint(1, 96, (2, 10))
    ref.eval()
    with torch.no_grad():
        want = float(ref(input_ids=ids, labels=ids, use_cache=False).loss)
    assert _adapter_loss(adapter, ids) == pytest.approx(want, rel=1e-5)


def test_model_dir_round_trips_through_sharded_safetensors_on_a_meta_skeleton(tmp_path):
    ref, adapter = model_pair(tiny_config("llama", layers=2, tied=True))
    save_hf_dir(adapter, tmp_path, shard_bytes=40_000)  # forces several shards + index
    assert (tmp_path / "model.safetensors.index.json").exists()
    loaded = load_adapter_from_dir(tmp_path)
    assert all(p.device.type == "meta" for p in loaded.blocks[0].parameters())
    for name, t in adapter.params.named_master().items():
        assert torch.equal(loaded.params.named_master()[name], t), name
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    for name, p in ref.named_parameters():
        assert torch.equal(again.state_dict()[name], p.detach()), name
    ids = torch.randint(1, 96, (2, 8))
    ref.eval()
    with torch.no_grad():
        want = float(ref(input_ids=ids, labels=ids, use_cache=False).loss)
    assert _adapter_loss(loaded, ids) == pytest.approx(want, rel=1e-5)


def test_unknown_model_family_is_refused_with_the_supported_list():
    ref, adapter = model_pair(tiny_config("llama", layers=2))
    adapter.model.config.model_type = "mamba"
    with pytest.raises(ValueError, match="supported"):
        ModelAdapter(adapter.model, adapter.params)
