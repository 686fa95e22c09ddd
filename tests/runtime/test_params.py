"""Host parameter store: flat per-block layout, zero gradients for unused parameters, the
master-dtype choices, and the LR schedule."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from engine_helpers import micro_batches, plan_for, reference_grads, tiny_config
from lazytrain.models import adapter_from_model
from lazytrain.runtime.build import make_engine
from lazytrain.runtime.optim import lr_at
from lazytrain.models.host_params import HostParams, check_master_dtype


def test_unknown_master_dtype_is_refused_with_the_key_and_the_choices():
    with pytest.raises(ValueError, match=r"train.master_dtype: unknown value 'fp16'.*bf16"):
        check_master_dtype("fp16")
    with pytest.raises(ValueError, match="master_dtype"):
        HostParams([], [], {"w": (2,)}, master_dtype="fp16")


def test_bf16_master_dtype_gives_bf16_masters_and_gradients():
    store = HostParams([{"a": (2, 3)}], ["layers.0."], {"emb": (5, 2)}, master_dtype="bf16")
    for g in store.groups:
        assert g.master.dtype == g.grad.dtype == torch.bfloat16


def test_parameters_are_views_into_one_contiguous_region_per_block():
    store = HostParams([{"a": (2, 3), "b": (4,)}], ["layers.0."], {"emb": (5, 2)})
    views = store.blocks[0].master_views
    views["b"].fill_(7.0)
    assert store.blocks[0].master[6:].tolist() == [7.0] * 4
    assert views["a"].data_ptr() == store.blocks[0].master.data_ptr()
    assert set(store.named_master()) == {"layers.0.a", "layers.0.b", "emb"}


def test_unused_parameter_gets_zero_gradient_and_the_others_are_not_shifted(tmp_path):
    config = tiny_config("llama", layers=2)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # registered on the layer itself, so it comes *first* in the block's flat layout
    ref.model.layers[1].unused_gate = nn.Parameter(torch.randn(7))
    twin = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    twin.model.layers[1].unused_gate = nn.Parameter(torch.zeros(7))
    twin.load_state_dict(ref.state_dict())
    adapter = adapter_from_model(twin)
    assert adapter.params.blocks[1].slots[0].name == "unused_gate"
    engine = make_engine(adapter, plan_for(adapter, ["hbm", "recompute", "hbm"]), device="cpu",
                         nvme_dir=tmp_path)
    try:
        adapter.params.blocks[1].grad.fill_(123.0)  # stale values must not survive
        batches = micro_batches(1)
        engine.compute_gradients(batches)
        grads = engine.gradients()
    finally:
        engine.close()
    _, ref_grads = reference_grads(ref, batches)
    assert ref_grads["model.layers.1.unused_gate"] is None
    assert torch.equal(grads["model.layers.1.unused_gate"], torch.zeros(7))
    for name, g in ref_grads.items():
        if g is not None:
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7)


def test_lr_schedule_warms_up_linearly_then_decays_by_cosine_to_min():
    kw = dict(base_lr=1.0, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    assert [lr_at(s, **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, **kw) == pytest.approx(1.0)
    # halfway through the decay: cos(pi/2) = 0 -> min + (1 - min) / 2
    assert lr_at(9, **kw) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(14, **kw) == pytest.approx(0.1)
    assert lr_at(20, **kw) == pytest.approx(0.1)
    assert lr_at(7, **kw, schedule="constant") == 1.0
