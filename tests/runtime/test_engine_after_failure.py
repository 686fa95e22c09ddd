"""After a failed step (an NVMe write error inside a window) the engine runs the next step, and
that step's gradients equal plain HF autograd (independent reference, copied state_dict).

Every failure path runs on `cpu` and under both ordering checkers: `cpu-checked` must record no
violation (a failed step frees nothing under a running copy), `cpu-threaded` must give the same
gradients (its copies really run late)."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import (micro_batches, model_pair, plan_for, problem_for, reference_grads,
                            tiny_config)
from lazytrain.planner.evaluate import build_plan, decisions_from_tiers
from lazytrain.planner.plan import SolveRecord
from lazytrain.runtime.activations import ActivationStore
from lazytrain.runtime.backends import make_device
from lazytrain.runtime.build import make_engine
from lazytrain.runtime.errors import NvmeIOError
from lazytrain.runtime.nvme import FaultInjector
from lazytrain.runtime.streams import DeviceWeights

H, R, N = "hbm", "recompute", "nvme"
BACKENDS = ["cpu", "cpu-checked", "cpu-threaded"]


@pytest.fixture(params=BACKENDS)
def device(request):
    """Each backend's device; a violation the checker recorded off the main thread fails the
    test at teardown."""
    dev = make_device(request.param, seed=4)
    yield dev
    dev.close()
    assert not getattr(dev, "violations", None), dev.violations[:1]


def test_a_step_after_a_failed_step_runs_and_its_gradients_equal_autograd(tmp_path, device):
    ref, adapter = model_pair(tiny_config("llama", layers=3))
    plan = plan_for(adapter, [H, N, R, H])  # boundary 1 on the NVMe tier
    faults = FaultInjector()
    engine = make_engine(adapter, plan, device=device,
                         store=ActivationStore(device=device,
                                               nvme_dir=tmp_path / "nvme", fault_hook=faults))
    batches = micro_batches(1)
    try:
        faults.fail_next_write(boundary=1)
        with pytest.raises(NvmeIOError):
            engine.compute_gradients(batches)
        assert engine.store.stored() == []  # the failed step's boundaries were released
        engine.compute_gradients(batches)  # before the fix: begin_window('f0') while f0 open
        grads = {k: v.clone() for k, v in engine.gradients().items()}
    finally:
        engine.close()
    _, ref_grads = reference_grads(ref, batches)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    for name, g in ref_grads.items():
        assert float((grads[name] - g).abs().max()) <= 1e-5 * scale, name


def test_a_flipped_bit_in_an_nvme_checkpoint_stops_the_step_instead_of_wrong_gradients(tmp_path,
                                                                                      device):
    def flip(event):
        if event.op == "open_read" and event.boundary == 1:
            with open(event.path, "r+b") as fh:
                fh.seek(100)
                byte = fh.read(1)[0]
                fh.seek(100)
                fh.write(bytes([byte ^ 0x01]))

    _, adapter = model_pair(tiny_config("llama", layers=3))
    plan = plan_for(adapter, [H, N, R, H])
    engine = make_engine(adapter, plan, device=device,
                         store=ActivationStore(device=device,
                                               nvme_dir=tmp_path / "nvme", fault_hook=flip))
    try:
        with pytest.raises(NvmeIOError, match="checksum mismatch") as info:
            engine.compute_gradients(micro_batches(1))
        assert info.value.boundary == 1
    finally:
        engine.close()


def test_a_step_failing_in_the_weight_conversion_gives_its_slots_back(tmp_path, monkeypatch,
                                                                      device):
    ref, adapter = model_pair(tiny_config("llama", layers=3))
    engine = make_engine(adapter, plan_for(adapter, [H, H, H, H]), device=device,
                         nvme_dir=tmp_path / "nvme")
    convert, calls = DeviceWeights.convert, []

    def failing_convert(self, staging, master):  # the second conversion of a step fails
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected conversion failure")
        convert(self, staging, master)

    batches = micro_batches(1)
    try:
        monkeypatch.setattr(DeviceWeights, "convert", failing_convert)
        for _ in range(3):  # every failed step would have kept two slots: 4 are gone by now
            calls.clear()
            with pytest.raises(RuntimeError, match="injected"):
                engine.compute_gradients(batches)
        assert len(engine.weights.free) == len(engine.weights.slots)
        monkeypatch.setattr(DeviceWeights, "convert", convert)
        engine.compute_gradients(batches)
        grads = {k: v.clone() for k, v in engine.gradients().items()}
    finally:
        engine.close()
    _, ref_grads = reference_grads(ref, batches)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6)


def test_a_step_failing_before_a_resident_load_was_used_frees_it_only_after_its_copy(
        tmp_path, monkeypatch, device):
    """Block 1's resident load is queued in f0 (after block 0's forward); f1 fails before its
    compute waited for that H2D: the failed step drops the resident buffer while its H2D may
    still run (`cpu-checked`: a free under a copy); the next step's gradients equal autograd."""
    ref, adapter = model_pair(tiny_config("llama", layers=3))
    problem = problem_for(adapter)
    plan = build_plan(problem, decisions_from_tiers(problem, (H, H, H, H), (),
                                                    resident_weights=(1,)),
                      solver=SolveRecord(backend="manual"))
    assert plan.resident_weights == (1,)
    engine = make_engine(adapter, plan, device=device, nvme_dir=tmp_path / "nvme")
    ready, calls = DeviceWeights.ready, []

    def failing_ready(self, handle):  # block 1's resident weights are never waited for
        calls.append(handle.block)
        if handle.block == 1:
            raise RuntimeError("injected failure before block 1's compute")
        return ready(self, handle)

    batches = micro_batches(1)
    try:
        monkeypatch.setattr(DeviceWeights, "ready", failing_ready)
        with pytest.raises(RuntimeError, match="injected"):
            engine.compute_gradients(batches)
        assert calls == [0, 1], "block 1's resident load was queued before the failure"
        monkeypatch.setattr(DeviceWeights, "ready", ready)
        engine.compute_gradients(batches)
        grads = {k: v.clone() for k, v in engine.gradients().items()}
    finally:
        engine.close()
    _, ref_grads = reference_grads(ref, batches)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6)
