"""The happens-before checker (`cpu-checked`) catches defects in the host buffer pool's deferred
reuse: a checkpoint host buffer goes back to the pool with its last copy events and NVMe
futures and is handed out again only after them (`HostBufferPool`). Each test removes one of
those waits by monkeypatching and runs under `cpu-checked` either engine steps on a plan whose
nvme and dram boundaries recycle buffers across micro-batches, or (the futures, which only
`release` relies on) a store-level script; the undamaged runtime runs both with zero
violations."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest
import torch

from engine_helpers import micro_batches, model_pair, plan_for, tiny_config
from lazytrain.runtime.activations import ActivationStore
from lazytrain.runtime.host_pool import HostBufferPool
from lazytrain.runtime.build import make_engine
from lazytrain.runtime.hb_checker import CheckedDevice, OrderingViolation

R, H, D, N = "recompute", "hbm", "dram", "nvme"
POOL_PLAN = [N, N, D, N, H]  # three staging buffers and a dram copy per micro-batch


def _steps_checked(tmp_path, *, steps: int = 2) -> CheckedDevice:
    _, adapter = model_pair(tiny_config("llama"))
    plan = plan_for(adapter, POOL_PLAN, (), grad_accum=2)
    dev = CheckedDevice()
    engine = make_engine(adapter, plan, device=dev, nvme_dir=tmp_path / "nvme", grad_accum=2)
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


class _HeldWrites:
    """Fault hook: each chunk write, its buffer read already declared to the checker, waits
    until `go` is set; so the window end surely finds the write running."""

    def __init__(self) -> None:
        self.go = threading.Event()

    def __call__(self, event) -> None:
        if event.op == "write":
            self.go.wait(10.0)


def _release_after_an_unsettled_write(tmp_path) -> CheckedDevice:
    """Store level: boundary 1's write is still running at its window end (the barrier does not
    wait for writes), finishes, and only then is the boundary released: no window end or
    read-back joined the write, so the pool's own wait for the futures is what orders the
    buffer's reuse (boundary 2, same size, takes it). The engine releases only after the
    read-back (which joins the write), so this path is the store's `release` alone."""
    dev = CheckedDevice()
    hook = _HeldWrites()
    with ActivationStore(device=dev, nvme_dir=tmp_path / "nvme", direct=False,
                         fault_hook=hook) as store:
        try:
            for boundary in (1, 2):
                store.begin_window(f"f{boundary}")
                store.put(boundary, dev.empty(5001, torch.float32).fill_(boundary), "nvme")
                store.transfer(boundary, "d2h", 1.0)
                store.transfer(boundary, "nvme_write", 1.0)
                writes = list(store._entries[(boundary, 0)].write_futures)
                store.end_window()
                hook.go.set()
                concurrent.futures.wait(writes)  # finished, but joined by nobody
                hook.go.clear()
                store.release(boundary)
        finally:
            hook.go.set()
    return dev


def test_a_boundary_released_after_an_unsettled_write_recycles_its_buffer_with_zero_violations(
        tmp_path):
    assert _release_after_an_unsettled_write(tmp_path).violations == []


def test_a_pool_buffer_handed_out_before_its_nvme_requests_finished_is_caught(tmp_path,
                                                                            monkeypatch):
    original = HostBufferPool.release

    def release(self, buffer, *, after=(), futures=(), owner=None):  # forgets the futures
        original(self, buffer, after=after, futures=(), owner=owner)

    monkeypatch.setattr(HostBufferPool, "release", release)
    with pytest.raises(OrderingViolation) as info:
        _release_after_an_unsettled_write(tmp_path)
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
