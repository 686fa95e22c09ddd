"""Calibration measures on a model cut to one block of each kind, never the whole model: the
layers it keeps (by hand per family), the parameters it materializes (hand-counted from the
architecture), the per-kind times it returns, and a `step_const_ms` whose parameter-bound terms
are scaled to the whole model (hand-computed from the parameter counts)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig

from lazytrain.config import load_config
from lazytrain.models import hf_loader
from lazytrain.models.cut import profile_layers
from lazytrain.profile import overhead, profiler
from lazytrain.spec.model import ModelSpec
from lazytrain.train import setup

SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=256)
QWEN3_TYPES = ["full_attention"] * 5 + ["sliding_attention"] + ["full_attention"] * 10
"""A 16-layer Qwen3 with one sliding layer (layer 5): the cut keeps layers 0 and 5."""


@pytest.mark.parametrize("model_type,fields,want", [
    ("llama", dict(num_hidden_layers=64), (0,)),
    # layer_types restates each kind: exactly the first layer of each
    ("qwen3", dict(num_hidden_layers=16, layer_types=QWEN3_TYPES, sliding_window=32), (0, 5)),
    # transformers' Gemma3 default: every 6th layer full, the others sliding
    ("gemma3_text", dict(num_hidden_layers=12), (0, 5)),
    # dense layers 0-2 then MoE by index: cut to (0, 3), layer 1 would be dense, so the
    # leading layers up to the first MoE one are kept
    ("deepseek_v2", dict(num_hidden_layers=10, first_k_dense_replace=3, n_routed_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                         kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                         qk_nope_head_dim=8, v_head_dim=16), (0, 1, 2, 3)),
], ids=["llama", "qwen3-layer-types", "gemma3-pattern", "deepseek-index-rule"])
def test_the_profile_keeps_the_first_layer_of_each_kind(model_type, fields, want):
    assert profile_layers(AutoConfig.for_model(model_type, **{**SMALL, **fields})) == want


def test_a_twin_of_a_cut_model_repeats_its_layer_types():
    cut = hf_loader.load_adapter_from_config(AutoConfig.for_model(
        "qwen3", **SMALL, num_hidden_layers=2, sliding_window=32,
        layer_types=["full_attention", "sliding_attention"]), seed=0)
    twin = overhead.twin_adapter(cut, blocks=4)
    assert twin.num_blocks == 4
    assert twin.config.layer_types == ["full_attention", "sliding_attention"] * 2


# Hand counts. llama, hidden 256, 4 heads of 64, SwiGLU 512, untied vocab 512:
# q, k, v, o 4 x 256 x 256 + gate, up, down 3 x 256 x 512 + 2 norms of 256;
# ends: embedding 512 x 256 + head 512 x 256 + final norm 256.
LLAMA_BLOCK = 4 * 256 * 256 + 3 * 256 * 512 + 2 * 256
LLAMA_ENDS = 2 * 512 * 256 + 256
# qwen3, SMALL: q 64 x 64, k and v 64 x 32, o 64 x 64, q/k norms 16 each, SwiGLU 3 x 64 x 128,
# 2 norms of 64 (sliding layers hold the same); tied ends: embedding 256 x 64 + final norm 64.
QWEN3_BLOCK = 2 * 64 * 64 + 2 * 64 * 32 + 2 * 16 + 3 * 64 * 128 + 2 * 64
QWEN3_ENDS = 256 * 64 + 64

CASES = {
    "llama-64-layers": (
        dict(model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=64,
             num_attention_heads=4, num_key_value_heads=4, vocab_size=512,
             tie_word_embeddings=False),
        {"dense"}, LLAMA_BLOCK + LLAMA_ENDS, 64 * LLAMA_BLOCK + LLAMA_ENDS),
    "qwen3-hybrid": (
        dict(model_type="qwen3", **SMALL, num_hidden_layers=16, layer_types=QWEN3_TYPES,
             use_sliding_window=True, sliding_window=32, tie_word_embeddings=True),
        {"dense", "sliding_attention"}, 2 * QWEN3_BLOCK + QWEN3_ENDS,
        16 * QWEN3_BLOCK + QWEN3_ENDS),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_calibration_builds_one_block_per_kind_and_scales_step_const_to_the_whole_model(
        case, tmp_path, monkeypatch):
    hf_fields, kinds, cut_numel, model_numel = CASES[case]
    path = tmp_path / "model.json"
    path.write_text(json.dumps(hf_fields))
    cfg = load_config(None, [f"model.config_path={path}", f"train.run_dir={tmp_path}/run",
                             "data.seq_len=16", "train.micro_batch=1", "runtime.device=cpu"])
    built = []
    real_adapter_from_model = hf_loader.adapter_from_model

    def counting(model, **kwargs):
        built.append(sum(p.numel() for p in model.parameters()))
        return real_adapter_from_model(model, **kwargs)

    monkeypatch.setattr(hf_loader, "adapter_from_model", counting)
    # the parameter-bound step terms fixed (ms), the rest measured
    monkeypatch.setattr(profiler, "grad_norm_ms", lambda params, **kw: 2.0)
    monkeypatch.setattr(profiler, "optimizer_exposed_ms", lambda bench, **kw: {
        "exposed_ms": 3.0, "ends_load_ms": 0.5, "forward_chain_ms": 1.0})
    monkeypatch.setattr(profiler, "window_overhead_ms", lambda adapter, **kw: {
        "window_overhead_ms": 0.1, "step_overhead_ms": 0.25, "twins": {}})
    profile = setup.measure_config_profile(cfg, "cpu", repeats=1, warmup=0, run_dir=tmp_path)

    assert built == [cut_numel]  # the cut, and nothing else, was materialized
    assert set(profile["block_kinds"]) == kinds
    for entry in profile["block_kinds"].values():
        assert {"fwd_ms", "fwd_grad_ms", "bwd_ms"} <= set(entry)
    # exposed optimizer and gradient norm scaled by the whole model's parameters; the ends'
    # load and the twins' per-step overhead as measured
    assert profile["step_const_ms"] == pytest.approx(
        0.5 + 0.25 + (3.0 + 2.0) * model_numel / cut_numel)
    assert profile["measurements"]["whole_model_scale"]["model_numel"] == model_numel
    # the profile is the whole model's: the calibration key's architecture digest
    assert profile["model_config_sha256"] == ModelSpec.from_hf_config(path).config_sha256
