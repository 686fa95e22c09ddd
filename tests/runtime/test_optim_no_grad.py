"""Weight decay and moments of parameters that got no gradient: as torch.optim.AdamW, which
skips a parameter whose .grad is None, the engine leaves them exactly as they were.
Reference: a plain HF model with the same extra parameter, stepped by torch's fused AdamW."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_helpers import micro_batches, plan_for, reference_grads, tiny_config
from lazytrain.models import adapter_from_model
from lazytrain.runtime.build import make_engine

H, R = "hbm", "recompute"


def _pair_with_an_unused_parameter(master_dtype: str):
    """(reference, adapter): a 2-block Llama whose block 1 carries a parameter no forward uses
    (as an expert no token is routed to); identical weights in both."""
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(tiny_config("llama", layers=2), dtype=torch.float32)
    ref.model.layers[1].register_parameter("unused", torch.nn.Parameter(torch.ones(8)))
    twin = copy.deepcopy(ref)
    ref.train()
    return ref, adapter_from_model(twin, master_dtype=master_dtype)


@pytest.mark.parametrize("master_dtype", ["fp32", "bf16"])
def test_a_parameter_without_gradient_is_not_decayed_as_in_torch_adamw(tmp_path, master_dtype):
    ref, adapter = _pair_with_an_unused_parameter(master_dtype)
    plan = plan_for(adapter, [H, R, H])
    engine = make_engine(adapter, plan, device="cpu", nvme_dir=tmp_path / "nvme", lr=0.1,
                         weight_decay=0.1)
    opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.1, fused=True)
    try:
        for step in range(3):
            batches = micro_batches(1, seed=20 + step)
            engine.step(batches, lr=0.1)
            reference_grads(ref, batches)
            opt.step()
        mine = engine.named_parameters_fp32()
    finally:
        engine.close()
    assert ref.model.layers[1].unused.grad is None  # torch skipped it ...
    assert torch.equal(mine["model.layers.1.unused"], torch.ones(8))  # ... and so did we
    if master_dtype == "fp32":
        for name, p in ref.named_parameters():
            torch.testing.assert_close(mine[name], p.detach(), rtol=1e-5, atol=1e-6)
    # the moments of the skipped parameter stay zero (torch keeps no state for it at all)
    group = adapter.params.blocks[1]
    state = engine.optimizer.optims[group.name].state[engine.optimizer.stepped[group.name]]
    assert not group.views(state["exp_avg"])["unused"].any()
    assert not group.views(state["exp_avg_sq"])["unused"].any()
