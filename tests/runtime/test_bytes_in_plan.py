"""Every byte the runtime holds or moves is in the plan (the ledger against the prediction).

For every plan kind of the engine test matrix, on plans made with the planner's own memory
model (`planner/build.py`: fixed HBM working set, staging pools, host states), one
instrumented step must:
- hold at most the plan's predicted peak HBM (the ledger over all owners: weights, boundaries,
  kept graphs, gradients, head, workspace);
- pin at most the plan's predicted pinned bytes (DRAM-tier checkpoints + staging pools);
- move, in every window and on every channel, the plan's bytes within 4096 B per transfer
  (NVMe transfers are padded to the 4 KiB block).
The reference is the plan (the evaluator's arithmetic), not the runtime's own earlier output.
"""

from __future__ import annotations

import pytest
import torch

from engine_helpers import micro_batches, model_pair, tiny_config
from ledger_helpers import real_plan
from lazytrain.planner.budgets import predicted_pinned_bytes
from lazytrain.runtime.build import make_engine

R, H, D, N = "recompute", "hbm", "dram", "nvme"
PLANS = {
    "all_hbm": ([H] * 5, (), None),
    "all_dram": ([D, D, D, D, H], (), None),
    "all_nvme": ([N, N, N, N, H], (), None),
    "mixed_tiers": ([R, D, H, N, H], (), None),
    "segments_of_2": ([H, R, H, R, H], (), None),
    "segments_of_3_and_1": ([D, R, R, H, H], (), None),
    "one_segment_reembedded": ([R, R, R, R, H], (), None),
    "keep_internals": ([H, R, H, H, H], (2, 3), None),
    "keep_after_recompute_nvme_input": ([N, R, R, D, H], (2, 3), None),
    # block 3 kept while its input boundary 3 goes to NVMe: the kept graph still holds it
    "keep_with_its_input_on_nvme": ([H, H, H, N, H], (3,), None),
    "resident_weights": ([H, D, H, N, H], (), (0, 2)),
}
BYTE_CHANNELS = ("h2d", "d2h", "nvme_read", "nvme_write")


def _step(plan, adapter, tmp_path, **engine_kw):
    engine = make_engine(adapter, plan, device="cpu", nvme_dir=tmp_path / "nvme", grad_accum=2,
                         instrument=True, budgets=True,
                         model_config_sha256=plan.provenance["model_config_sha256"], **engine_kw)
    try:
        return engine.step(micro_batches(2), lr=1e-3).windows
    finally:
        engine.close()


def _check(plan, records) -> None:
    peak = max(r["ledger_peak"]["hbm_bytes"] for r in records)
    assert peak <= plan.predicted.peak_hbm_bytes, (
        f"measured {peak} B > predicted {plan.predicted.peak_hbm_bytes:.0f} B; at the peak: "
        f"{records[-1]['ledger_peak']}")
    pinned = max(r["ledger_peak"]["pinned_bytes"] for r in records)
    assert pinned <= predicted_pinned_bytes(plan)
    planned = {w.name: w for w in plan.windows}
    per_window = {}
    for t in plan.transfers:
        per_window[(t.window, t.kind)] = per_window.get((t.window, t.kind), 0) + 1
    for rec in records:  # every micro-batch moves one micro-batch's plan
        for w in rec["windows"]:
            if w["name"] not in planned:
                continue  # pre / post: constant terms, not plan windows
            for c in BYTE_CHANNELS:
                want = getattr(planned[w["name"]], f"{c}_bytes")
                slack = 4096 * per_window.get((w["name"], c), 0)
                got = w["ledger"]["moved"][c]
                assert abs(got - want) <= slack, (w["name"], c, got, want)


@pytest.mark.parametrize("plan_kind", list(PLANS))
def test_the_ledger_stays_within_the_plan_for(plan_kind, tmp_path):
    tiers, keep, resident = PLANS[plan_kind]
    _, adapter = model_pair(tiny_config("llama"))
    plan = real_plan(adapter, tiers, keep, resident=resident)
    _check(plan, _step(plan, adapter, tmp_path))


def test_the_ledger_stays_within_the_plan_with_bf16_masters(tmp_path):
    from transformers import AutoModelForCausalLM

    from lazytrain.models import adapter_from_model

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32)
    adapter = adapter_from_model(model, master_dtype="bf16")
    plan = real_plan(adapter, [R, D, H, N, H], (), master_dtype="bf16")
    _check(plan, _step(plan, adapter, tmp_path))


def test_the_ledger_stays_within_the_plan_with_8bit_moments(tmp_path):
    pytest.importorskip("bitsandbytes")
    _, adapter = model_pair(tiny_config("llama"))
    plan = real_plan(adapter, [R, D, H, N, H], (), q8_blocks=(1, 2))
    _check(plan, _step(plan, adapter, tmp_path))
