"""The ends over a step: their fp32 gradient accumulates on the device over the step's
micro-batches and drains once per step; their weights load once per step into one device buffer.

References: plain HF autograd (`reference_grads`), a count of the D2H copies that read the ends
gradient (the device's own copy calls, counted by a spy), and the plan's predicted peak HBM (the
planner's memory model, `ledger_helpers.real_plan`).
"""

from __future__ import annotations

import math

import pytest

from engine_helpers import micro_batches, model_pair, plan_for, reference_grads, tiny_config
from ledger_helpers import real_plan
from lazytrain.runtime.backends import make_device
from lazytrain.runtime.build import make_engine
from test_bf16_masters import bf16_pair
from test_engine_grads import _assert_grads_match

R, H, D, N = "recompute", "hbm", "dram", "nvme"
TIERS = (D, R, H, N, H)
WIDE_VOCAB = 800
"""Ends (2 x 800 x 64 parameters) spanning 3 staging and drain buffers of a block's size."""


def _config(vocab: int | None):
    config = tiny_config("llama")
    if vocab is not None:
        config.vocab_size = vocab
    return config


def _batches(n: int, *, seed: int, vocab: int | None) -> list[dict]:
    """`n` micro-batches; with a wider vocabulary the tokens spread over all of it (every ends
    chunk is read and gets a gradient)."""
    batches = micro_batches(n, seed=seed)
    if vocab is not None:
        for b in batches:  # 1..95 -> 8..760; padding (0) and ignored labels (-100) stay
            b["input_ids"] = b["input_ids"] * 8
            b["labels"] = b["labels"].where(b["labels"] < 0, b["labels"] * 8)
    return batches


def _close(engine) -> None:
    dev = engine.dev
    engine.close()
    if getattr(dev, "violations", None):
        raise dev.violations[0]


def _count_ends_d2h(monkeypatch, engine) -> list:
    """Spy on the device's copies: the D2H copies whose source is the ends gradient."""
    seen = []
    original = type(engine.dev).copy

    def copy(self, dst, src, *, stream):
        grad = engine.ends.grad
        if (grad is not None and stream.name == "d2h"
                and src.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr()):
            seen.append(src.numel())
        return original(self, dst, src, stream=stream)
    monkeypatch.setattr(type(engine.dev), "copy", copy)
    return seen


@pytest.mark.parametrize("vocab", [None, WIDE_VOCAB], ids=["vocab_96", "vocab_800"])
@pytest.mark.parametrize("grad_accum", [1, 3])
@pytest.mark.parametrize("backend", ["cpu", "cpu-checked", "cpu-threaded"])
def test_gradients_equal_autograd_with_the_ends_accumulated_on_the_device(
        backend, grad_accum, vocab, tmp_path):
    ref, adapter = model_pair(_config(vocab))
    plan = plan_for(adapter, TIERS, grad_accum=grad_accum)
    batches = _batches(grad_accum, seed=4, vocab=vocab)
    engine = make_engine(adapter, plan, device=make_device(backend, seed=3),
                         nvme_dir=tmp_path / "nvme", grad_accum=grad_accum)
    try:
        loss = engine.compute_gradients(batches)
        grads = {k: v.clone() for k, v in engine.gradients().items()}
    finally:
        _close(engine)
    ref_loss, ref_grads = reference_grads(ref, batches)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    _assert_grads_match(grads, ref_grads)


@pytest.mark.parametrize("backend", ["cpu", "cpu-checked"])
def test_the_ends_gradient_leaves_the_device_once_per_step(backend, tmp_path, monkeypatch):
    """fp32 masters: one D2H per step straight into the accumulator (3 micro-batches, 2 steps:
    2 copies, not 6)."""
    _, adapter = model_pair(_config(None))
    plan = plan_for(adapter, TIERS, grad_accum=3)
    engine = make_engine(adapter, plan, device=make_device(backend, seed=3),
                         nvme_dir=tmp_path / "nvme", grad_accum=3, lr=1e-3)
    seen = _count_ends_d2h(monkeypatch, engine)
    try:
        for s in range(2):
            engine.step(_batches(3, seed=20 + s, vocab=None))
            assert seen == [adapter.params.ends.numel] * (s + 1)
    finally:
        _close(engine)


def test_a_bf16_accumulator_gets_the_ends_gradient_in_fp32_chunks_once_per_step(
        tmp_path, monkeypatch):
    """bf16 masters, vocabulary 800: the step's one drain copies fp32 into the pinned drain
    buffers viewed as fp32 (a block's fp32 elements each: ceil(ends / block) chunks), and
    never converts on the link."""
    _, adapter = bf16_pair(_config(WIDE_VOCAB))
    plan = plan_for(adapter, TIERS, grad_accum=3)
    engine = make_engine(adapter, plan, device=make_device("cpu-checked", seed=3),
                         nvme_dir=tmp_path / "nvme", grad_accum=3, lr=1e-3)
    seen = _count_ends_d2h(monkeypatch, engine)
    ends, block = adapter.params.ends.numel, adapter.params.max_block_numel()
    chunks = math.ceil(ends / block)
    assert chunks == 3
    try:
        for s in range(2):
            engine.step(_batches(3, seed=20 + s, vocab=WIDE_VOCAB))
            assert len(seen) == chunks * (s + 1) and sum(seen) == ends * (s + 1)
    finally:
        _close(engine)


def test_the_ends_weights_take_one_device_buffer_for_the_run(tmp_path, monkeypatch):
    """The plan counts one ends copy: a later step reloads into the same buffer instead of
    allocating a second one while the first is still held."""
    _, adapter = model_pair(_config(WIDE_VOCAB))
    plan = plan_for(adapter, TIERS, grad_accum=1)
    engine = make_engine(adapter, plan, device=make_device("cpu-checked", seed=3),
                         nvme_dir=tmp_path / "nvme", grad_accum=1, lr=1e-3)
    allocated = []
    original = type(engine.dev).empty

    def empty(self, shape, dtype, *, name=None):
        allocated.append(name)
        return original(self, shape, dtype, name=name)
    monkeypatch.setattr(type(engine.dev), "empty", empty)
    try:
        for s in range(3):
            engine.step(_batches(1, seed=50 + s, vocab=WIDE_VOCAB))
    finally:
        _close(engine)
    assert allocated.count("ends weights") == 1


@pytest.mark.parametrize("vocab", [None, WIDE_VOCAB], ids=["vocab_96", "vocab_800"])
def test_the_ledger_peak_stays_within_the_plans_hbm_over_steps(vocab, tmp_path):
    """Two steps of 3 micro-batches: every allocation (the second step's ends load included,
    which once held the previous step's ends weights beside the new ones) within the plan's
    predicted peak HBM."""
    _, adapter = model_pair(_config(vocab))
    plan = real_plan(adapter, TIERS, grad_accum=3)
    engine = make_engine(adapter, plan, device="cpu", nvme_dir=tmp_path / "nvme", grad_accum=3,
                         instrument=True, lr=1e-3,
                         model_config_sha256=plan.provenance["model_config_sha256"])
    try:
        for s in range(2):
            engine.step(_batches(3, seed=40 + s, vocab=vocab))
            peak = engine.ledger.peak_bytes("hbm")
            assert peak <= plan.predicted.peak_hbm_bytes, (
                s, peak, plan.predicted.peak_hbm_bytes, engine.ledger.peak_owners("hbm"))
    finally:
        engine.close()
