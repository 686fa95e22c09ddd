"""The activation store's HBM bytes never exceed the plan's `hbm_checkpoint_bytes`, per window.

The engine is built with a store *without* HBM limits, so a violation shows up here as a
number, not as an exception from the store's own check.
"""

from __future__ import annotations

import pytest
import torch

from engine_helpers import micro_batches, model_pair, plan_for, tiny_config
from test_engine_grads import PLANS
from lazytrain.planner.windows import window_names
from lazytrain.runtime.activations import ActivationStore
from lazytrain.runtime.build import make_engine


@pytest.mark.parametrize("n_micro", [1, 2], ids=["one_micro_batch", "grad_accum_2"])
@pytest.mark.parametrize("plan_kind", list(PLANS))
def test_store_hbm_peak_stays_within_plan_in_every_window(plan_kind, n_micro, tmp_path):
    tiers, keep = PLANS[plan_kind]
    _, adapter = model_pair(tiny_config("llama"))
    plan = plan_for(adapter, tiers, keep, grad_accum=n_micro)
    store = ActivationStore(device=torch.device("cpu"), nvme_dir=tmp_path / "nvme")
    engine = make_engine(adapter, plan, device="cpu", grad_accum=n_micro, store=store)
    try:
        engine.compute_gradients(micro_batches(n_micro))
        peaks = store.peak_by_window()
        assert set(window_names(plan.num_blocks)) <= set(peaks)
        for name in window_names(plan.num_blocks):
            allowed = plan.window(name).hbm_checkpoint_bytes
            assert peaks[name]["hbm"] <= allowed, (
                f"window {name}: store held {peaks[name]['hbm']} HBM bytes, plan allows {allowed}")
        assert store.stored() == []  # every boundary released by the end of the step
    finally:
        engine.close()
