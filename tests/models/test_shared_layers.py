"""A model that reuses one layer module (or one parameter) at two depths is refused before any
weight is copied: the host store keeps one copy per depth and would stream zeros."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from lazytrain.models import adapter_from_model


def _tiny(layers: int = 3):
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=32)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def test_one_layer_module_at_two_depths_is_refused_naming_both():
    model = _tiny()
    model.model.layers[1] = model.model.layers[0]
    with pytest.raises(ValueError, match=r"model\.layers\[1\] is the same module as "
                                         r"model\.layers\[0\]"):
        adapter_from_model(model)
    assert model.model.layers[0].mlp.down_proj.weight.abs().sum() > 0  # nothing was moved


def test_one_parameter_shared_by_two_depths_is_refused():
    model = _tiny()
    model.model.layers[2].mlp.up_proj.weight = model.model.layers[0].mlp.up_proj.weight
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.up_proj\.weight is the same "
                                         r"parameter as model\.layers\.0\.mlp\.up_proj\.weight"):
        adapter_from_model(model)


def test_distinct_layers_load_every_depth_with_its_own_weights():
    model = _tiny()
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    adapter = adapter_from_model(model)
    stored = adapter.params.named_master()
    assert all(torch.equal(stored[n], t) for n, t in expected.items() if n in stored)
    assert stored["model.layers.2.mlp.up_proj.weight"].abs().sum() > 0
