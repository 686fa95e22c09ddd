"""The engine loads block 0 for micro-batch m + 1 in `post` of micro-batch m, not in `pre` of
m + 1 (docs/execution_model.md, "Step time"), with gradients still equal to autograd under the
ordering checkers and no host wait before a window's first compute op."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import micro_batches, model_pair, reference_grads, tiny_config
from lazytrain.runtime.backends import make_device
from lazytrain.runtime.build import make_engine
from lazytrain.runtime.engine import Engine
from test_engine_grads import _assert_grads_match
from test_ordering_matrix import _plan


def _block0_load_windows(monkeypatch, engine, batches) -> list[str]:
    """The windows (the ledger's current one) in which one step issues block 0's loads."""
    seen = []
    real = Engine.prefetch_weights

    def spy(self, j):
        if j == 0:
            seen.append(self.ledger.window)
        return real(self, j)

    monkeypatch.setattr(Engine, "prefetch_weights", spy)
    engine.compute_gradients(batches)
    return seen


@pytest.mark.parametrize("grad_accum,expected", [(1, ["pre"]), (2, ["pre", "post"]),
                                                  (3, ["pre", "post", "post"])])
def test_block_0_loads_in_pre_once_then_in_each_post_that_a_micro_batch_follows(
        grad_accum, expected, monkeypatch, tmp_path):
    _, adapter = model_pair(tiny_config("llama"))
    # all_hbm: block 0 streams (no resident weights), its backward reload is in b1
    engine = make_engine(adapter, _plan(adapter, "all_hbm_segments_of_1", grad_accum=grad_accum),
                         device=make_device("cpu"), nvme_dir=tmp_path / "nvme",
                         grad_accum=grad_accum)
    try:
        seen = _block0_load_windows(monkeypatch, engine, micro_batches(grad_accum))
    finally:
        engine.close()
    # the forward loads of block 0 (one per micro-batch) and its backward reloads (in b1)
    assert [w for w in seen if w != "b1"] == expected
    assert seen.count("b1") == grad_accum


@pytest.mark.parametrize("backend", ["cpu-checked", "cpu-threaded"])
@pytest.mark.parametrize("plan_kind", ["all_hbm_segments_of_1", "resident_weights", "mixed_tiers", "segments_of_3_and_1"])
def test_prefetched_block_0_keeps_gradients_equal_to_autograd(backend, plan_kind, tmp_path):
    ref, adapter = model_pair(tiny_config("llama"))
    batches = micro_batches(3)
    dev = make_device(backend, seed=5)
    engine = make_engine(adapter, _plan(adapter, plan_kind, grad_accum=3), device=dev,
                         nvme_dir=tmp_path / "nvme", grad_accum=3)
    try:
        torch.manual_seed(123)
        loss = engine.compute_gradients(batches)
        grads = {k: v.clone() for k, v in engine.gradients().items()}
    finally:
        engine.close()
    assert not getattr(dev, "violations", None)
    torch.manual_seed(123)
    ref_loss, ref_grads = reference_grads(ref, batches)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    _assert_grads_match(grads, ref_grads)
