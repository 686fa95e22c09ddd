"""The happens-before checker (`runtime.device: cpu-checked`) catches real ordering defects.

Each test removes one real wait, one `record_stream` or one host synchronize from the runtime by
monkeypatching (never by a flag in product code) and runs one engine step under `cpu-checked`:
the checker must raise `OrderingViolation` naming the buffer and both streams. The undamaged
runtime runs the same steps with zero violations (`test_ordering_matrix.py`).
"""

from __future__ import annotations

import pytest
import torch

from engine_helpers import micro_batches, model_pair, plan_for, tiny_config
from lazytrain.runtime import streams as streams_mod
from lazytrain.runtime.activations import ActivationStore
from lazytrain.runtime.device import Device
from lazytrain.runtime.build import make_engine
from lazytrain.runtime.engine import Engine
from lazytrain.runtime.hb_checker import CheckedDevice, OrderingViolation

R, H, D, N = "recompute", "hbm", "dram", "nvme"
KEEP_PLAN = ([N, R, R, D, H], (2, 3))  # keep-internals (resident weights), recompute, dram, nvme


def _step_checked(tmp_path, *, tiers=KEEP_PLAN[0], keep=KEEP_PLAN[1], steps=1, clip=None,
                  device=None):
    _, adapter = model_pair(tiny_config("llama"))
    plan = plan_for(adapter, tiers, keep, grad_accum=2)
    dev = device or CheckedDevice()
    engine = make_engine(adapter, plan, device=dev, nvme_dir=tmp_path / "nvme", grad_accum=2,
                         clip_grad_norm=clip)
    try:
        for s in range(steps):
            engine.step(micro_batches(2, seed=s), lr=1e-3)
        engine.optimizer.wait_all()
    finally:
        engine.close()
    return dev


def _violation(tmp_path, **kw) -> OrderingViolation:
    with pytest.raises(OrderingViolation) as info:
        _step_checked(tmp_path, **kw)
    return info.value


def test_the_undamaged_runtime_runs_the_defect_plan_with_zero_violations(tmp_path):
    dev = _step_checked(tmp_path, steps=2, clip=0.5)
    assert dev.violations == [] and dev.ops_logged > 1000


def test_resident_load_in_its_old_ordering_is_caught_naming_buffer_and_streams(tmp_path,
                                                                             monkeypatch):
    """The old `DeviceWeights.load(resident=True)`: allocate on compute, copy on h2d, no wait."""
    original_record = Device.record

    def load(self, group, block, *, resident=False):
        if not resident:
            return original_load(self, group, block, resident=False)
        dst = self.device.empty(group.numel, self.dtype, name=f"resident weights of block {block}")
        k, buf = self.staging.acquire()
        buf[:group.numel].copy_(group.master)
        event = self.device.copy(dst, buf[:group.numel], stream=self.h2d)  # no wait on compute
        self.staging.mark_in_flight(k, event)
        return streams_mod.WeightHandle(block=block, flat=dst, event=event, slot=None)

    original_load = streams_mod.DeviceWeights.load
    monkeypatch.setattr(streams_mod.DeviceWeights, "load", load)
    assert Device.record is original_record
    exc = _violation(tmp_path)
    assert "resident weights of block" in exc.buffer
    assert "compute" in exc.first and "h2d" in exc.second


def test_compute_reading_a_weight_slot_before_its_load_completed_is_caught(tmp_path, monkeypatch):
    monkeypatch.setattr(streams_mod.DeviceWeights, "ready", lambda self, handle: handle.flat)
    exc = _violation(tmp_path)
    # the conversion worker issues the load: it may run before or after the early read
    assert "weight" in exc.buffer
    assert sorted(["h2d" in exc.first, "h2d" in exc.second]) == [False, True]
    assert sorted(["compute" in exc.first, "compute" in exc.second]) == [False, True]


def test_a_slot_reloaded_without_waiting_for_its_last_consumer_is_caught(tmp_path, monkeypatch):
    def release(self, handle):  # hands the slot back but keeps its stale free event
        if handle.slot is not None:
            self.free.append(handle.slot)

    monkeypatch.setattr(streams_mod.DeviceWeights, "release", release)
    # all boundaries in HBM: no offload synchronizes the host with compute during the forward,
    # so nothing else happens to order the reload (with offloads the host learns compute's
    # progress through the d2h events it waits for, which orders a reuse four loads later)
    exc = _violation(tmp_path, tiers=[H] * 5, keep=())
    assert "weight slot" in exc.buffer and "compute" in exc.first and "h2d" in exc.second


def test_a_staging_buffer_rewritten_before_its_h2d_completed_is_caught(tmp_path, monkeypatch):

    def acquire(self):
        k = self._next
        self._next = (k + 1) % len(self.buffers)
        return k, self.buffers[k]  # no host wait for the previous copy

    monkeypatch.setattr(streams_mod.StagingPool, "acquire", acquire)
    exc = _violation(tmp_path, tiers=[H] * 5, keep=())  # no offload syncs the host (above)
    assert "weight staging buffer" in exc.buffer
    assert "h2d" in exc.first and "host:" in exc.second


def test_a_gradient_read_on_the_host_before_its_d2h_completed_is_caught(tmp_path, monkeypatch):
    def accumulate(self, event, buf, group, *, first, start):
        group.accumulate_grad(buf, first=first, start=start)  # no host wait for the copy

    monkeypatch.setattr(streams_mod.GradDrain, "_accumulate", accumulate)
    exc = _violation(tmp_path)
    assert "gradient drain buffer" in exc.buffer
    assert "d2h" in exc.first and "host:" in exc.second


def test_a_device_gradient_freed_under_its_d2h_without_record_stream_is_caught(tmp_path,
                                                                             monkeypatch):
    monkeypatch.setattr(CheckedDevice, "record_stream", lambda self, tensor, stream: None)
    exc = _violation(tmp_path)
    assert "d2h" in exc.first and "free" in exc.second


def test_a_boundary_offloaded_before_the_compute_that_produced_it_is_caught(tmp_path,
                                                                          monkeypatch):
    original = CheckedDevice.wait_event

    def wait_event(self, stream, event):
        if stream.name != "ckpt_d2h":  # the store's d2h no longer waits for the put's event
            original(self, stream, event)

    monkeypatch.setattr(CheckedDevice, "wait_event", wait_event)
    exc = _violation(tmp_path)
    assert "compute" in exc.first and "ckpt_d2h" in exc.second


def test_a_host_buffer_returned_to_its_pool_under_a_running_copy_is_caught(tmp_path, monkeypatch):
    def release_host(self, e):  # no host synchronize of the buffer's copies
        tier, nbytes = self._host_account(e)
        self._count(tier, -nbytes)
        self._pool.release(e.host)
        e.host = None

    monkeypatch.setattr(ActivationStore, "_release_host", release_host)
    exc = _violation(tmp_path)
    assert "checkpoint host buffer" in exc.buffer and "pool" in exc.second


def test_an_nvme_write_that_does_not_wait_for_its_d2h_is_caught(tmp_path, monkeypatch):
    original = ActivationStore._nvme_write

    def nvme_write(self, e, target, final):
        event, e.d2h_event = e.d2h_event, None  # the write no longer waits for the d2h event
        try:
            original(self, e, target, final)
        finally:
            e.d2h_event = event

    monkeypatch.setattr(ActivationStore, "_nvme_write", nvme_write)
    exc = _violation(tmp_path)
    assert "checkpoint host buffer" in exc.buffer
    assert "ckpt_d2h" in exc.first and "NVMe write" in exc.second


def test_a_weight_load_that_does_not_wait_for_the_blocks_update_is_caught(tmp_path, monkeypatch):
    def prefetch_weights(self, j):  # skips optimizer.wait(group)
        return self.weights.load(self.params.blocks[j], j, resident=j in self.resident)

    monkeypatch.setattr(Engine, "prefetch_weights", prefetch_weights)
    exc = _violation(tmp_path, steps=2, clip=0.5)
    # whichever the threads reach first: the load reading the master the update writes, or
    # the next step's gradient accumulation overwriting what the update still reads
    assert ("master" in exc.buffer or "gradient accumulator" in exc.buffer)
    assert "adamw" in exc.first + exc.second


def test_checker_numerics_equal_the_cpu_backend_bit_for_bit(tmp_path):
    def masters(device):
        _, adapter = model_pair(tiny_config("llama"))
        plan = plan_for(adapter, *KEEP_PLAN, grad_accum=2)
        engine = make_engine(adapter, plan, device=device, nvme_dir=tmp_path / str(device),
                             grad_accum=2, clip_grad_norm=0.5)
        try:
            for s in range(2):
                engine.step(micro_batches(2, seed=s), lr=1e-2)
            return {k: v.clone() for k, v in engine.named_masters().items()}
        finally:
            engine.close()

    a, b = masters("cpu"), masters(CheckedDevice())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_reused_block_first_used_by_a_stream_that_missed_the_frees_last_writer_is_caught():
    """T's last writer is h2d; compute waited for it and freed T; N may reuse T's memory, so
    stream y (which only knows compute up to before that wait) must not write N yet."""
    dev = CheckedDevice()
    h2d, y = dev.stream("h2d"), dev.stream("y")
    src = dev.host_tensor(torch.ones(1024), name="host source")
    with dev.compute_scope():
        t = dev.empty(1024, torch.float32, name="T")
        t.zero_()
        e0 = dev.record(dev.compute)
        dev.wait_event(h2d, e0)
        copied = dev.copy(t, src, stream=h2d)
        dev.wait_event(dev.compute, copied)
        del t  # back to compute's pool, ordered after h2d's write through the wait
        n = dev.empty(1024, torch.float32, name="N")
        dev.wait_event(y, e0)
        with pytest.raises(OrderingViolation) as info:
            dev.copy(n, src, stream=y)
    assert info.value.buffer == "N" and "y" in info.value.second
