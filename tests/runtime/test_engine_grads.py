"""Gradient equivalence of the streaming engine with plain HF autograd, for every plan kind.

Reference: an independent copy of the same tiny HF model (copied state_dict), run with plain
autograd; gradient accumulation uses HF's `num_items_in_batch` so the loss is normalised by the
label tokens of the whole step, as the engine does.

Dropout: the engine saves the RNG state before each block's forward and replays it in a forked
RNG on recompute/re-forward, so the global RNG advances exactly as in one plain forward. Seeding
torch identically before the engine step and before the reference forward therefore gives the
reference the same dropout masks: the comparison with HF is exact, not statistical.
"""

from __future__ import annotations

import pytest
import torch

from engine_helpers import (PLAN_KINDS, micro_batches, model_pair, plan_for, reference_grads,
                            tiny_config)
from lazytrain.runtime.build import make_engine
from lazytrain.runtime.optim import lr_at

R, H, D, N = "recompute", "hbm", "dram", "nvme"

PLANS = PLAN_KINDS


def _assert_grads_match(engine_grads: dict, ref_grads: dict) -> None:
    assert set(engine_grads) == set(ref_grads)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    for name, ref in ref_grads.items():
        assert ref is not None, f"reference has no gradient for {name}"
        diff = float((engine_grads[name] - ref).abs().max())
        assert diff <= 1e-5 * scale, f"{name}: max abs diff {diff:.3g} (grad scale {scale:.3g})"


def _engine_grads(config, tiers, keep, tmp_path, *, n_micro=1, family_seed=0, batches=None,
                  **engine_kw):
    ref, adapter = model_pair(config, seed=family_seed)
    plan = plan_for(adapter, tiers, keep, grad_accum=n_micro)
    batches = batches or micro_batches(n_micro)
    engine = make_engine(adapter, plan, device="cpu", nvme_dir=tmp_path / "nvme",
                         grad_accum=n_micro, **engine_kw)
    try:
        torch.manual_seed(123)
        loss = engine.compute_gradients(batches)
        grads = {k: v.clone() for k, v in engine.gradients().items()}
    finally:
        engine.close()
    torch.manual_seed(123)
    ref_loss, ref_grads = reference_grads(ref, batches)
    return loss, ref_loss, grads, ref_grads


@pytest.mark.parametrize("plan_kind", list(PLANS))
def test_engine_grads_equal_autograd_for_plan(plan_kind, tmp_path):
    tiers, keep = PLANS[plan_kind]
    loss, ref_loss, grads, ref_grads = _engine_grads(tiny_config("llama"), tiers, keep, tmp_path)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    _assert_grads_match(grads, ref_grads)


@pytest.mark.parametrize("plan_kind", ["mixed_tiers", "segments_of_3_and_1"])
def test_engine_grads_equal_autograd_on_qwen3(plan_kind, tmp_path):
    tiers, keep = PLANS[plan_kind]
    _, _, grads, ref_grads = _engine_grads(tiny_config("qwen3"), tiers, keep, tmp_path)
    _assert_grads_match(grads, ref_grads)


def test_engine_grads_equal_big_batch_with_grad_accumulation_2(tmp_path):
    tiers, keep = PLANS["mixed_tiers"]
    loss, ref_loss, grads, ref_grads = _engine_grads(tiny_config("llama"), tiers, keep, tmp_path,
                                                     n_micro=2)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    _assert_grads_match(grads, ref_grads)


def test_engine_grads_with_tied_embeddings_sum_head_and_embedding(tmp_path):
    tiers, keep = PLANS["keep_after_recomputed_segment"]
    _, _, grads, ref_grads = _engine_grads(tiny_config("llama", tied=True), tiers, keep, tmp_path)
    assert "lm_head.weight" not in grads
    _assert_grads_match(grads, ref_grads)


@pytest.mark.parametrize("plan_kind", ["one_segment_of_4_reembedded", "keep_after_recomputed_segment"])
def test_engine_grads_with_dropout_replay_the_forward_masks(plan_kind, tmp_path):
    tiers, keep = PLANS[plan_kind]
    config = tiny_config("llama", dropout=0.3)
    loss, ref_loss, grads, ref_grads = _engine_grads(config, tiers, keep, tmp_path)
    _, no_dropout_loss, _, _ = _engine_grads(tiny_config("llama"), [H] * 5, (), tmp_path)
    assert loss != pytest.approx(no_dropout_loss, rel=1e-4)  # dropout really is active
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    _assert_grads_match(grads, ref_grads)


def test_engine_grads_with_packed_sequences_use_position_ids(tmp_path):
    batches = micro_batches(1, pad_last=False)
    pos = torch.cat([torch.arange(5), torch.arange(7)]).repeat(2, 1)  # two documents per row
    batches[0] = {"input_ids": batches[0]["input_ids"], "labels": batches[0]["labels"],
                  "position_ids": pos}
    tiers, keep = PLANS["mixed_tiers"]
    _, _, grads, ref_grads = _engine_grads(tiny_config("qwen3"), tiers, keep, tmp_path,
                                           batches=batches)
    _assert_grads_match(grads, ref_grads)


@pytest.mark.parametrize("clip", [None, 0.5], ids=["no_clip", "clip_0.5"])
def test_three_engine_steps_match_fused_adamw_on_plain_model(clip, tmp_path):
    config = tiny_config("llama")
    ref, adapter = model_pair(config)
    tiers, keep = PLANS["keep_after_recomputed_segment"]
    plan = plan_for(adapter, tiers, keep, grad_accum=2)
    lrs = [lr_at(s, base_lr=1e-2, warmup_steps=1, total_steps=3) for s in range(3)]
    engine = make_engine(adapter, plan, device="cpu", nvme_dir=tmp_path / "nvme", grad_accum=2,
                         lr=1e-2, weight_decay=0.01, clip_grad_norm=clip)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    try:
        for step, lr in enumerate(lrs):
            batches = micro_batches(2, seed=10 + step)
            engine.step(batches, lr=lr)
            reference_grads(ref, batches)
            if clip:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            for g in opt.param_groups:
                g["lr"] = lr
            opt.step()
        mine = engine.named_parameters_fp32()
        for name, p in ref.named_parameters():
            torch.testing.assert_close(mine[name], p.detach(), rtol=1e-5, atol=1e-6)
    finally:
        engine.close()


def test_engine_refuses_rows_longer_than_planned(tmp_path):
    # shorter rows are fine (tests/train/test_grpo_flat_groups.py); longer break the budgets
    from lazytrain.planner.plan import PlanValidationError
    _, adapter = model_pair(tiny_config("llama", layers=2))
    engine = make_engine(adapter, plan_for(adapter, [H, H, H]), device="cpu",
                         nvme_dir=tmp_path / "nvme")
    batch = micro_batches(1)[0]
    batch = {k: torch.cat([v, v[:, :4]], dim=1) for k, v in batch.items()}
    try:
        with pytest.raises(PlanValidationError, match="seq_len"):
            engine.compute_gradients([batch])
    finally:
        engine.close()


@pytest.mark.parametrize("extra", [{"nvme_dir": "elsewhere"}, {"io_threads": 4}],
                         ids=["nvme_dir", "io_threads"])
def test_engine_refuses_store_settings_beside_a_given_store(tmp_path, extra):
    from lazytrain.runtime.activations import ActivationStore
    _, adapter = model_pair(tiny_config("llama", layers=2))
    store = ActivationStore(device=torch.device("cpu"), nvme_dir=tmp_path / "nvme", io_threads=1)
    try:
        with pytest.raises(ValueError, match="pass them to ActivationStore"):
            make_engine(adapter, plan_for(adapter, [H, H, H]), device="cpu", store=store, **extra)
    finally:
        store.close()
