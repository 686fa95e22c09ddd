"""The weight paths in the engine (docs/execution_model.md, "Weight paths"): every plan kind
with every block on pinned_copy or gpu_cast gives the gradients of plain HF autograd under
`cpu`, `cpu-checked` and `cpu-threaded`; whole optimizer steps whose masters are in another
dtype than the compute dtype (a real pinned copy, refreshed by the AdamW worker; a real cast
on the device) equal today's host conversion bit for bit; no block weight is converted on the
host on those paths."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_helpers import micro_batches, model_pair, problem_for, reference_grads, tiny_config
from lazytrain.planner.evaluate import build_plan, decisions_from_tiers
from lazytrain.planner.plan import SolveRecord
from lazytrain.runtime import streams as streams_mod
from lazytrain.runtime.backends import make_device
from lazytrain.runtime.build import make_engine
from test_engine_grads import _assert_grads_match
from test_ordering_matrix import MATRIX, RESIDENT, _close

BACKENDS = ["cpu", "cpu-checked", "cpu-threaded"]
PATHS = ["pinned_copy", "gpu_cast"]


def _plan(adapter, name, path, *, grad_accum=2):
    tiers, keep = MATRIX[name]
    problem = problem_for(adapter, grad_accum=grad_accum)
    decisions = decisions_from_tiers(problem, tuple(tiers), tuple(keep),
                                     resident_weights=RESIDENT.get(name))
    paths = (path,) * adapter.num_blocks
    return build_plan(problem, dataclasses.replace(decisions, weight_paths=paths),
                      solver=SolveRecord(backend="manual"))


@pytest.fixture
def converted(monkeypatch):
    """Elements of every host conversion into a weight staging buffer, in call order."""
    sizes: list[int] = []
    convert = streams_mod.DeviceWeights.convert

    def counting(self, staging, master):
        sizes.append(master.numel())
        convert(self, staging, master)

    monkeypatch.setattr(streams_mod.DeviceWeights, "convert", counting)
    return sizes


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("plan_kind", list(MATRIX))
def test_grads_equal_autograd_on_each_path(backend, plan_kind, path, tmp_path, converted):
    ref, adapter = model_pair(tiny_config("llama"))
    plan = _plan(adapter, plan_kind, path)
    assert plan.weight_paths == (path,) * adapter.num_blocks
    batches = micro_batches(2)
    engine = make_engine(adapter, plan, device=make_device(backend, seed=7),
                         nvme_dir=tmp_path / "nvme", grad_accum=2)
    try:
        torch.manual_seed(123)
        loss = engine.compute_gradients(batches)
        grads = {k: v.clone() for k, v in engine.gradients().items()}
    finally:
        _close(engine)
    torch.manual_seed(123)
    ref_loss, ref_grads = reference_grads(ref, batches)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    _assert_grads_match(grads, ref_grads)
    block = adapter.params.blocks[0].numel
    assert block not in converted  # only the ends go through the host conversion


def _three_steps(device, tmp_path, path, *, master_dtype):
    from lazytrain.models import adapter_from_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32)
    adapter = adapter_from_model(model, master_dtype=master_dtype)
    plan = _plan(adapter, "mixed_tiers", path)
    engine = make_engine(adapter, plan, device=device, nvme_dir=tmp_path / "nvme", grad_accum=2,
                         lr=1e-2, clip_grad_norm=0.5)
    try:
        for s in range(3):
            engine.step(micro_batches(2, seed=20 + s))
        return {k: v.clone() for k, v in engine.named_masters().items()}
    finally:
        _close(engine)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_three_steps_with_bf16_masters_equal_host_conversion(backend, path, tmp_path):
    # bf16 masters, fp32 compute: pinned_copy holds an fp32 copy the AdamW job refreshes (a
    # stale copy would load step 1's weights in step 2), gpu_cast lands bf16 and casts on the
    # device; both give the fp32 weights the host conversion gives
    want = _three_steps("cpu", tmp_path / "want", "host_convert", master_dtype="bf16")
    got = _three_steps(make_device(backend, seed=3), tmp_path / "got", path, master_dtype="bf16")
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), f"{name} differs from host conversion"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_first_gradients_land_in_the_accumulator(backend, grad_accum, tmp_path, monkeypatch):
    # fp32 masters and compute: the step's first drain of each block copies into the
    # accumulator itself; only later micro-batches add on the host
    from lazytrain.models.host_params import ParamGroup

    added: list[str] = []
    accumulate = ParamGroup.accumulate_grad

    def counting(self, flat_grad, *, first, start=0):
        if flat_grad is not None:
            added.append(self.name)
        accumulate(self, flat_grad, first=first, start=start)

    monkeypatch.setattr(ParamGroup, "accumulate_grad", counting)
    ref, adapter = model_pair(tiny_config("llama"))
    plan = _plan(adapter, "mixed_tiers", "pinned_copy", grad_accum=grad_accum)
    batches = micro_batches(grad_accum)
    engine = make_engine(adapter, plan, device=make_device(backend, seed=5),
                         nvme_dir=tmp_path / "nvme", grad_accum=grad_accum)
    try:
        engine.compute_gradients(batches)
        grads = {k: v.clone() for k, v in engine.gradients().items()}
    finally:
        _close(engine)
    blocks = {g.name for g in adapter.params.blocks}
    assert sum(name in blocks for name in added) == (grad_accum - 1) * len(blocks)
    _, ref_grads = reference_grads(ref, batches)
    _assert_grads_match(grads, ref_grads)


@pytest.mark.parametrize("backend", ["cpu-checked", "cpu-threaded"])
def test_replanning_between_paths_equals_host_conversion(backend, tmp_path):
    # bf16 masters, fp32 compute: step 0 converts on the host, step 1 loads a pinned copy
    # filled at set_plan (after step 0's queued updates), step 2 casts on the device
    from lazytrain.models import adapter_from_model
    from transformers import AutoModelForCausalLM

    want = _three_steps("cpu", tmp_path / "want", "host_convert", master_dtype="bf16")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32)
    adapter = adapter_from_model(model, master_dtype="bf16")
    plans = [_plan(adapter, "mixed_tiers", p) for p in ("host_convert", "pinned_copy",
                                                        "gpu_cast")]
    engine = make_engine(adapter, plans[0], device=make_device(backend, seed=4),
                         nvme_dir=tmp_path / "nvme", grad_accum=2, lr=1e-2, clip_grad_norm=0.5)
    try:
        for s in range(3):
            engine.set_plan(plans[s])
            engine.step(micro_batches(2, seed=20 + s))
        got = {k: v.clone() for k, v in engine.named_masters().items()}
    finally:
        _close(engine)
    for name in want:
        assert torch.equal(want[name], got[name]), f"{name} differs from host conversion"


def _bf16_master_grads(device, tmp_path, *, land_all: bool, added: list):
    from lazytrain.models import adapter_from_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32)
    adapter = adapter_from_model(model, master_dtype="bf16")
    plan = _plan(adapter, "mixed_tiers", "pinned_copy", grad_accum=1)
    engine = make_engine(adapter, plan, device=device, nvme_dir=tmp_path / "nvme", grad_accum=1)
    assert engine.drain.land_all  # one micro-batch per step
    engine.drain.land_all = land_all
    try:
        added.clear()
        engine.compute_gradients(micro_batches(1))
        return {k: v.clone() for k, v in engine.gradients().items()}
    finally:
        _close(engine)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_micro_batch_casts_gradients_on_the_device(backend, tmp_path, monkeypatch):
    # bf16 masters, fp32 compute, grad_accum 1: each block's fp32 gradient is cast to bf16 on
    # the device and lands in the bf16 accumulator (no host add), rounding exactly as the
    # host's add into the accumulator did (round to nearest even, once)
    from lazytrain.models.host_params import ParamGroup

    added: list[str] = []
    accumulate = ParamGroup.accumulate_grad

    def counting(self, flat_grad, *, first, start=0):
        if flat_grad is not None:
            added.append(self.name)
        accumulate(self, flat_grad, first=first, start=start)

    monkeypatch.setattr(ParamGroup, "accumulate_grad", counting)
    want = _bf16_master_grads("cpu", tmp_path / "host", land_all=False, added=added)
    assert len(added) >= 4  # the host added every block's gradient
    got = _bf16_master_grads(make_device(backend, seed=6), tmp_path / "dev", land_all=True,
                             added=added)
    assert not [n for n in added if n.startswith("block")]
    for name in want:
        assert torch.equal(want[name], got[name]), f"{name} differs from the host add"
