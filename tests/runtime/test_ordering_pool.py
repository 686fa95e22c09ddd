"""The happens-before checker (`cpu-checked`) catches defects in the host buffer pool's deferred
reuse: a checkpoint host buffer goes back to the pool with its last copy events and NVMe
futures and is handed out again only after them (`HostBufferPool`). Each test removes one of
those waits by monkeypatching and runs engine steps under `cpu-checked` on a plan whose nvme
and dram boundaries recycle buffers across micro-batches; the undamaged runtime runs the same
steps with zero violations (`test_ordering_checker.py`)."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import micro_batches, model_pair, plan_for, tiny_config
from lazytrain.runtime.activations import CheckpointStore
from lazytrain.runtime.host_pool import HostBufferPool
from lazytrain.runtime.engine import Engine
from lazytrain.runtime.hb_checker import CheckedDevice, OrderingViolation

R, H, D, N = "recompute", "hbm", "dram", "nvme"
POOL_PLAN = [N, N, D, N, H]  # three staging buffers and a dram copy per micro-batch


def _steps_checked(tmp_path, *, steps: int = 2) -> CheckedDevice:
    _, adapter = model_pair(tiny_config("llama"))
    plan = plan_for(adapter, POOL_PLAN, (), grad_accum=2)
    dev = CheckedDevice()
    engine = Engine(adapter, plan, device=dev, nvme_dir=tmp_path / "nvme", grad_accum=2)
    try:
        for s in range(steps):
            engine.step(micro_batches(2, seed=s), lr=1e-3)
        engine.optimizer.wait_all()
    finally:
        engine.close()
    return dev


def test_the_undamaged_pool_recycles_buffers_with_zero_violations(tmp_path):
    dev = _steps_checked(tmp_path)
    assert dev.violations == [] and dev.ops_logged > 1000


def _release_while_writing(tmp_path) -> CheckedDevice:
    """Store level: boundary 1 goes to nvme and is released while its write may still run (the
    window end does not wait for writes), then boundary 2 of the same size takes the pooled
    staging buffer. The engine never releases before the read-back (which waits for the
    write), so only `release` relies on the pool's own wait for the futures."""
    dev = CheckedDevice()
    with CheckpointStore(device=dev, nvme_dir=tmp_path / "nvme", direct=False) as store:
        for boundary in (1, 2):
            store.begin_window(f"f{boundary}")
            store.put(boundary, dev.empty(5001, torch.float32).fill_(boundary), "nvme")
            store.transfer(boundary, "d2h", 1.0)
            store.transfer(boundary, "nvme_write", 1.0)
            store.end_window()
            store.release(boundary)
    return dev


def test_a_boundary_released_while_its_write_runs_recycles_its_buffer_with_zero_violations(
        tmp_path):
    assert _release_while_writing(tmp_path).violations == []


def test_a_pool_buffer_handed_out_before_its_nvme_requests_finished_is_caught(tmp_path,
                                                                            monkeypatch):
    original = HostBufferPool.release

    def release(self, buffer, *, after=(), futures=(), owner=None):  # forgets the futures
        original(self, buffer, after=after, futures=(), owner=owner)

    monkeypatch.setattr(HostBufferPool, "release", release)
    with pytest.raises(OrderingViolation) as info:
        _release_while_writing(tmp_path)
    assert "checkpoint host buffer" in info.value.buffer
    assert "NVMe write" in info.value.first + info.value.second


def test_a_pool_buffer_handed_out_before_its_copies_completed_is_caught(tmp_path, monkeypatch):
    original = HostBufferPool.release

    def release(self, buffer, *, after=(), futures=(), owner=None):  # forgets the events
        original(self, buffer, after=(), futures=futures, owner=owner)

    monkeypatch.setattr(HostBufferPool, "release", release)
    with pytest.raises(OrderingViolation) as info:
        _steps_checked(tmp_path)
    assert "checkpoint host buffer" in info.value.buffer
