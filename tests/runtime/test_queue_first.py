"""Queue first, wait later: the engine's thread queues a window's compute before any host wait
the plan does not charge to that window (docs/execution_model.md, "Host waits of the engine's
thread").

`cpu-checked` records every host wait of the engine's thread (an event synchronize, a wait for
a worker's job) made in a window before that window's first compute op
(`runtime/queue_audit.py`). The only one allowed is the one the execution model keeps,
derived here from the plan alone: the first recompute load of a segment of two or more blocks
(its conversion job, in `b{e-1}`: the `R[s,e]` order term). The window's d2h (which may wait
for a pool buffer) and NVMe transfers (a read waits for its write, an nvme boundary's h2d for
its read) are issued after the window's compute.
"""

from __future__ import annotations

import pytest
import torch

from engine_helpers import micro_batches, model_pair, reference_grads, tiny_config
from lazytrain.contract import backward_window
from lazytrain.runtime.backends import make_device
from lazytrain.runtime.build import make_engine
from lazytrain.runtime.engine import Engine
from test_engine_grads import _assert_grads_match
from test_ordering_matrix import MATRIX, _plan

HOST_FREE = ["all_hbm_segments_of_1", "all_dram", "all_nvme", "mixed_tiers", "resident_weights"]
"""Plan kinds without a segment of two or more blocks: no early wait at all."""


def allowed_early_waits(plan) -> set[str]:
    """The early waits the execution model charges to their window, from the plan alone."""
    allowed = set()
    for s, e in plan.segments():
        if e - s >= 2:  # the segment's first recompute load, in b{e-1}
            allowed.add(f"{backward_window(e - 1)}: wait for jobs on host")
    return allowed


def _early_waits(plan_kind, tmp_path, *, clip: float) -> tuple[list[str], set[str]]:
    """Two optimizer steps of grad_accum 2 under cpu-checked: (early waits, allowed ones)."""
    _, adapter = model_pair(tiny_config("llama"))
    plan = _plan(adapter, plan_kind)
    dev = make_device("cpu-checked", seed=4)
    engine = make_engine(adapter, plan, device=dev, nvme_dir=tmp_path / "nvme", grad_accum=2,
                         lr=1e-2, clip_grad_norm=clip)
    try:
        for step in range(2):
            engine.step(micro_batches(2, seed=10 + step))
    finally:
        engine.close()
    assert not dev.violations
    return dev.queue_audit.early_waits, allowed_early_waits(plan)


@pytest.mark.parametrize("clip", [0.5, 0.0], ids=["clipped", "early_updates"])
@pytest.mark.parametrize("plan_kind", list(MATRIX))
def test_windows_queue_their_compute_before_host_waits(plan_kind, clip, tmp_path):
    early, allowed = _early_waits(plan_kind, tmp_path, clip=clip)
    assert set(early) <= allowed, sorted(set(early) - allowed)
    if plan_kind in HOST_FREE:
        assert early == []


def test_the_audit_sees_a_load_collected_in_the_window_that_uses_it(tmp_path, monkeypatch):
    """Without the end-of-window collection, each block's conversion job is waited for in the
    window that computes on it, before its kernels: the audit reports every f{j}."""
    monkeypatch.setattr(Engine, "collect_load", lambda self, mb, j: None)
    early, _ = _early_waits("all_hbm_segments_of_1", tmp_path, clip=0.5)
    assert {w.split(":")[0] for w in early} >= {"f0", "f1", "f2", "f3"}


def test_reordered_windows_keep_gradients_equal_to_autograd(tmp_path):
    ref, adapter = model_pair(tiny_config("llama"))
    batches = micro_batches(2)
    engine = make_engine(adapter, _plan(adapter, "segments_of_3_and_1"),
                         device=make_device("cpu-threaded", seed=2), nvme_dir=tmp_path / "nvme",
                         grad_accum=2)
    try:
        torch.manual_seed(123)
        loss = engine.compute_gradients(batches)
        grads = {k: v.clone() for k, v in engine.gradients().items()}
    finally:
        engine.close()
    torch.manual_seed(123)
    ref_loss, ref_grads = reference_grads(ref, batches)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    _assert_grads_match(grads, ref_grads)


def test_an_nvme_h2d_issued_after_compute_waits_for_its_buffer_s_allocation(tmp_path,
                                                                            monkeypatch):
    """The h2d of an nvme boundary is issued after the window's compute into a buffer
    allocated before it: without the wait for that allocation's event, the copy may write
    memory the compute stream still uses (cpu-checked: first use on another stream)."""
    from lazytrain.runtime.hb_checker import OrderingViolation

    original = type(make_device("cpu-checked")).wait_event

    def wait_event(self, stream, event):  # drops the h2d stream's wait for the allocation
        if stream.name == "ckpt_h2d" and event is not None and event.stream.name == "compute":
            return
        original(self, stream, event)

    monkeypatch.setattr(type(make_device("cpu-checked")), "wait_event", wait_event)
    with pytest.raises(OrderingViolation, match="first use on another stream"):
        _early_waits("all_nvme", tmp_path, clip=0.5)
