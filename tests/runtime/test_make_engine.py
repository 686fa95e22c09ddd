"""The engine is built from its parts: `Engine(adapter, plan, store=, optimizer=, grad_sync=,
settings=)` over a store and an optimizer made by the caller, and `make_engine` makes them.

Reference: plain HF autograd on an identical copy of the model (`engine_helpers`).
"""

from __future__ import annotations

import pytest

from engine_helpers import micro_batches, model_pair, plan_for, reference_grads, tiny_config
from lazytrain.runtime.activations import ActivationStore
from lazytrain.runtime.backends import make_device
from lazytrain.runtime.build import make_engine
from lazytrain.runtime.engine import Engine
from lazytrain.runtime.engine_config import EngineSettings
from lazytrain.runtime.optim import BlockOptimizer

R, H, D, N = "recompute", "hbm", "dram", "nvme"


def test_an_engine_over_parts_made_by_the_caller_equals_autograd(tmp_path):
    ref, adapter = model_pair(tiny_config("llama"))
    plan = plan_for(adapter, [R, D, H, N, H], grad_accum=2)
    store = ActivationStore(device=make_device("cpu-checked"), nvme_dir=tmp_path / "nvme",
                            io_threads=1)
    engine = Engine(adapter, plan, store=store, optimizer=BlockOptimizer(adapter.params, lr=1e-4),
                    settings=EngineSettings(grad_accum=2))
    batches = micro_batches(2)
    try:
        assert engine.dev is store.dev and engine.store is store
        loss = engine.compute_gradients(batches)
        grads = {k: v.clone() for k, v in engine.gradients().items()}
    finally:
        engine.close()
        store.dev.close()
    ref_loss, ref_grads = reference_grads(ref, batches)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    for name, want in ref_grads.items():
        assert float((grads[name] - want).abs().max()) <= 1e-5 * scale, name


@pytest.mark.parametrize(("field", "value", "message"), [
    ("compute_dtype", "fp16", "train.compute_dtype: 'fp16'; use fp32 or bf16"),
    ("head_chunk_tokens", 0, "runtime.head_chunk_tokens must be >= 1; got 0"),
])
def test_settings_refuse_a_bad_value_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        EngineSettings(**{field: value})


def test_the_factory_closes_the_store_it_made_when_the_plan_is_refused(tmp_path, monkeypatch):
    _, adapter = model_pair(tiny_config("llama", layers=2))
    _, other = model_pair(tiny_config("llama", layers=3))
    closed = []
    monkeypatch.setattr(ActivationStore, "close", lambda self: closed.append(self))
    want = f"plan has {other.num_blocks} blocks, model has {adapter.num_blocks}"
    with pytest.raises(ValueError, match=want):
        make_engine(adapter, plan_for(other, [H] * (other.num_blocks + 1)), device="cpu",
                    nvme_dir=tmp_path / "nvme")
    assert len(closed) == 1
