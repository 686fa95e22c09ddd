"""No implicit host-device sync per micro-batch: loss, label tokens, router statistics, masks
and rotary tables stay on the device (or are read on the host batch before its H2D), and the
instrument resolves its events at the step's end.

`cpu-checked` counts every `item` / `float` / `int` / `bool` / `tolist` / `.cpu()` of a device
tensor on the engine's thread (`runtime/sync_audit.py`) per phase: "micro_batch" (forward,
head, backward of one micro-batch) must stay empty on every plan kind; "step_end" holds the one
explicit read of the step's loss. The reference for the numbers is plain HF autograd.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_helpers import micro_batches, model_pair, plan_for, reference_grads, tiny_config
from lazytrain.models import adapter_from_model
from lazytrain.runtime.backends import make_device
from lazytrain.runtime.build import make_engine
from lazytrain.runtime.sync_audit import SyncAudit
from test_engine_grads import _assert_grads_match
from test_ordering_matrix import MATRIX, _plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from test_families import family_config  # noqa: E402

STEPS = 2


def _implicit_syncs(adapter, plan, tmp_path, *, batches) -> dict[str, list[str]]:
    """STEPS instrumented, clipped optimizer steps under cpu-checked; its sync record."""
    dev = make_device("cpu-checked", seed=5)
    engine = make_engine(adapter, plan, device=dev, nvme_dir=tmp_path / "nvme", grad_accum=2,
                         lr=1e-2, clip_grad_norm=0.5, instrument=True)
    try:
        for _ in range(STEPS):
            assert len(engine.step(batches).windows) == 2  # resolved at the step's end
    finally:
        engine.close()
    assert not dev.violations
    return dev.implicit_syncs


@pytest.mark.parametrize("plan_kind", list(MATRIX))
def test_no_implicit_sync_per_micro_batch_on_the_plan_kind_matrix(plan_kind, tmp_path):
    _, adapter = model_pair(tiny_config("llama"))
    syncs = _implicit_syncs(adapter, _plan(adapter, plan_kind), tmp_path,
                            batches=micro_batches(2))  # padded last row: HF's mask path
    assert syncs.get("micro_batch", []) == []
    # the step's explicit read of its loss, once per step (2 micro-batches each)
    assert syncs.get("step_end") == ["__float__ of () torch.float32"] * STEPS


def _moe_run(tmp_path, *, aux: bool):
    """Mixtral (aux loss on or off) under cpu-checked: (syncs per phase, loss, grads, HF's)."""
    config = family_config("mixtral")
    config.output_router_logits, config.router_aux_loss_coef = aux, 0.5
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    twin = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    twin.load_state_dict(copy.deepcopy(ref.state_dict()))
    ref.train()
    adapter = adapter_from_model(twin)
    assert adapter.router_aux_enabled == aux
    batches = micro_batches(2)
    dev = make_device("cpu-checked", seed=5)
    plan = plan_for(adapter, ["dram", "recompute", "hbm", "nvme", "hbm"], (3,), grad_accum=2)
    engine = make_engine(adapter, plan, device=dev, nvme_dir=tmp_path / "nvme", grad_accum=2)
    try:
        loss = engine.compute_gradients(batches)
        grads = {k: v.clone() for k, v in engine.gradients().items()}
    finally:
        engine.close()
    return dev.implicit_syncs, loss, grads, reference_grads(ref, batches)


def test_router_statistics_stay_on_the_device_and_the_aux_loss_is_hf_s(tmp_path):
    """HF's eager expert loop reads which experts got tokens (`tolist`, its own sync, the same
    with the aux loss off); the router statistics and the aux loss add none."""
    syncs, loss, grads, (ref_loss, ref_grads) = _moe_run(tmp_path / "aux", aux=True)
    without, *_ = _moe_run(tmp_path / "plain", aux=False)
    assert syncs.get("micro_batch", []) == without.get("micro_batch", [])
    assert all(s.startswith("tolist") for s in syncs.get("micro_batch", []))
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    _assert_grads_match(grads, ref_grads)


def test_masks_and_rotary_tables_are_built_once_per_shape_and_match_hf():
    _, adapter = model_pair(tiny_config("llama"))
    ids, h = torch.ones(2, 12, dtype=torch.long), torch.zeros(2, 12, 64)
    first = adapter.block_kwargs(ids, h, padded=False, packed=False)
    again = adapter.block_kwargs(ids, h, padded=False, packed=False)
    assert again[0]["position_embeddings"] is first[0]["position_embeddings"]
    # HF's own rotary on explicit positions 0..11 (independent of the cache)
    cos, sin = adapter.rotary(h, torch.arange(12).unsqueeze(0))
    torch.testing.assert_close(first[0]["position_embeddings"][0], cos)
    torch.testing.assert_close(first[0]["position_embeddings"][1], sin)
    longer = adapter.block_kwargs(torch.ones(2, 16, dtype=torch.long), torch.zeros(2, 16, 64),
                                  padded=False, packed=False)
    assert longer[0]["position_embeddings"][0].shape[-2] == 16


def test_an_all_ones_mask_and_default_positions_are_read_on_the_host(tmp_path):
    """A batch whose mask pads nothing and whose positions are 0..S-1 gives the gradients of
    the same batch without them, with no sync (HF would test both on the device)."""
    ref, adapter = model_pair(tiny_config("llama"))
    batches = micro_batches(2, pad_last=False)
    for b in batches:
        b["position_ids"] = torch.arange(b["input_ids"].shape[1]).expand_as(b["input_ids"])
    dev = make_device("cpu-checked", seed=5)
    engine = make_engine(adapter, _plan(adapter, "mixed_tiers"), device=dev,
                         nvme_dir=tmp_path / "nvme", grad_accum=2)
    try:
        loss = engine.compute_gradients(batches)
        grads = {k: v.clone() for k, v in engine.gradients().items()}
    finally:
        engine.close()
    assert dev.implicit_syncs.get("micro_batch", []) == []
    ref_loss, ref_grads = reference_grads(ref, batches)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    _assert_grads_match(grads, ref_grads)


def test_the_audit_flags_each_kind_of_implicit_sync():
    record: dict[str, list[str]] = {}
    t = torch.arange(3.0)
    host = torch.arange(2.0)
    with SyncAudit(lambda x: x is not host, phase="micro_batch", record=record):
        float(t.sum()), t.sum().item(), bool(t.any()), t.tolist(), int(t[0]), t.cpu()
        float(host.sum())  # a host tensor's sum is a fresh "device" tensor here: flagged
        host.tolist()  # the host tensor itself: not flagged
    assert [r.split(" of ")[0] for r in record["micro_batch"]] == \
        ["__float__", "item", "__bool__", "tolist", "__int__", "cpu", "__float__"]
