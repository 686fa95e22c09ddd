"""The activation store under `runtime.device: cpu-threaded` (copies land 100-200 ms late unless
waited for): since the window barrier no longer blocks the host on copies and NVMe writes, host
buffers go back to the pool pending and writes finish behind later windows. Over several steps
of plans that move every boundary through DRAM or NVMe, the pinned host bytes must stay within
the plan's `Predicted.pinned_bytes` (the planner's memory model, not the runtime's output), the
store's accounting must return to zero after every step, the pool must not grow from one step
to the next, and no file may be left behind."""

from __future__ import annotations

import pytest

from engine_helpers import micro_batches, model_pair, tiny_config
from ledger_helpers import real_plan
from lazytrain.runtime.build import make_engine

R, H, D, N = "recompute", "hbm", "dram", "nvme"
PLANS = {
    "all_nvme": [N, N, N, N, H],
    "all_dram": [D, D, D, D, H],
    "mixed_tiers": [R, D, H, N, H],
}
STEPS = 3


@pytest.mark.parametrize("plan_kind", list(PLANS))
def test_pinned_bytes_and_accounting_hold_over_steps_with_late_copies(plan_kind, tmp_path):
    _, adapter = model_pair(tiny_config("llama"))
    plan = real_plan(adapter, PLANS[plan_kind], ())
    nvme = tmp_path / "nvme"
    engine = make_engine(adapter, plan, device="cpu-threaded", nvme_dir=nvme, grad_accum=2,
                         instrument=True, budgets=True,
                         model_config_sha256=plan.provenance["model_config_sha256"])
    pool_bytes = []
    try:
        for step in range(STEPS):
            records = engine.step(micro_batches(2, seed=step), lr=1e-3).windows
            pinned = max(r["ledger_peak"]["pinned_bytes"] for r in records)
            assert pinned <= plan.predicted.pinned_bytes, (step, pinned)
            assert engine.store.bytes_by_tier() == dict.fromkeys(
                ("hbm", "dram", "dram_staging", "nvme"), 0)
            assert engine.store.stored() == []
            pool_bytes.append(engine.store._pool.allocated_bytes)
    finally:
        engine.close()
    assert pool_bytes == [pool_bytes[0]] * STEPS  # steady state allocates nothing
    assert not nvme.exists() or list(nvme.iterdir()) == []
