"""The engine's test matrix under both CPU ordering checkers (`cpu-checked`, `cpu-threaded`).

Every plan kind (tiers hbm/dram/nvme/recompute, mixed, keep-internals, resident weights) runs
with grad_accum 2 under each checker: zero ordering violations, gradients equal plain HF
autograd as on the `cpu` backend, and whole optimizer steps (clipping, bf16 masters, 8-bit
moments, instrumentation) equal the `cpu` backend bit for bit. The run-level parts of the
matrix (online re-planning, 2-rank data parallel, the CLI) are in tests/train and tests/dist.
"""

from __future__ import annotations

import pytest
import torch

from engine_helpers import (micro_batches, model_pair, problem_for, reference_grads,
                            tiny_config)
from lazytrain.planner.evaluate import build_plan, decisions_from_tiers
from lazytrain.planner.plan import SolveRecord
from lazytrain.runtime.backends import make_device
from lazytrain.runtime.build import make_engine
from test_engine_grads import PLANS, _assert_grads_match

BACKENDS = ["cpu-checked", "cpu-threaded"]
R, H, D, N = "recompute", "hbm", "dram", "nvme"
MATRIX = {**PLANS, "resident_weights": ([H, D, H, N, H], ())}
RESIDENT = {"resident_weights": (0, 2)}


def _plan(adapter, name, *, grad_accum=2, q8_blocks=()):
    tiers, keep = MATRIX[name]
    problem = problem_for(adapter, grad_accum=grad_accum)
    decisions = decisions_from_tiers(problem, tuple(tiers), tuple(keep),
                                     resident_weights=RESIDENT.get(name), q8_blocks=q8_blocks)
    return build_plan(problem, decisions, solver=SolveRecord(backend="manual"))


def _close(engine) -> None:
    """Close the engine; a violation raised inside the step propagates as it is, one recorded
    off the main thread (a storage freed by a worker) fails here."""
    dev = engine.dev
    engine.close()
    if getattr(dev, "violations", None):
        raise dev.violations[0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("plan_kind", list(MATRIX))
def test_engine_grads_equal_autograd_under_checker(backend, plan_kind, tmp_path):
    config = tiny_config("llama", dropout=0.2 if "reembedded" in plan_kind else 0.0)
    ref, adapter = model_pair(config)
    plan = _plan(adapter, plan_kind)
    if plan_kind == "resident_weights":
        assert plan.resident_weights
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


def _three_steps(device, tmp_path, *, plan_kind, master_dtype="fp32", q8_blocks=(),
                 instrument=False):
    _, adapter = model_pair(tiny_config("llama"))
    if master_dtype != "fp32":
        from lazytrain.models import adapter_from_model
        from transformers import AutoModelForCausalLM
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32)
        adapter = adapter_from_model(model, master_dtype=master_dtype)
    plan = _plan(adapter, plan_kind, q8_blocks=q8_blocks)
    engine = make_engine(adapter, plan, device=device, nvme_dir=tmp_path / "nvme", grad_accum=2,
                         lr=1e-2, clip_grad_norm=0.5, instrument=instrument)
    try:
        records = []
        for s in range(3):
            stats = engine.step(micro_batches(2, seed=20 + s))
            records.append(stats.windows)
        masters = {k: v.clone() for k, v in engine.named_masters().items()}
    finally:
        _close(engine)
    return masters, records


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["fp32_keep_nvme", "bf16_masters", "q8_moments",
                                     "instrumented_resident"])
def test_three_steps_under_checker_equal_the_cpu_backend_bit_for_bit(backend, variant, tmp_path):
    kw = {"fp32_keep_nvme": dict(plan_kind="keep_after_recomputed_segment"),
          "bf16_masters": dict(plan_kind="mixed_tiers", master_dtype="bf16"),
          "q8_moments": dict(plan_kind="mixed_tiers", q8_blocks=(1, 2)),
          "instrumented_resident": dict(plan_kind="resident_weights", instrument=True)}[variant]
    if variant == "q8_moments":
        pytest.importorskip("bitsandbytes")
    want, want_records = _three_steps("cpu", tmp_path / "cpu", **kw)
    got, got_records = _three_steps(make_device(backend, seed=3), tmp_path / backend, **kw)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), f"{name} differs from the cpu backend"
    if kw.get("instrument"):  # same windows and bytes moved per window as on cpu
        for a, b in zip(want_records, got_records):
            assert [[w["bytes"] for w in r["windows"]] for r in a] == \
                   [[w["bytes"] for w in r["windows"]] for r in b]


def _threaded_grads_error(tmp_path, tiers) -> float:
    """Max relative gradient error of one step under cpu-threaded against HF autograd (inf when
    the corruption made the backward itself fail)."""
    ref, adapter = model_pair(tiny_config("llama"))
    problem = problem_for(adapter, grad_accum=2)
    plan = build_plan(problem, decisions_from_tiers(problem, tuple(tiers), ()),
                      solver=SolveRecord(backend="manual"))
    batches = micro_batches(2)
    engine = make_engine(adapter, plan, device=make_device("cpu-threaded", seed=1),
                         nvme_dir=tmp_path / "nvme", grad_accum=2)
    try:
        engine.compute_gradients(batches)
        grads = {k: v.clone() for k, v in engine.gradients().items()}
    except RuntimeError as exc:
        # the late copy overwrote weights autograd had saved: torch's version counter saw it
        # (the race is visible, as a failed backward instead of a wrong gradient)
        if "modified by an inplace operation" not in str(exc):
            raise
        return float("inf")
    finally:
        engine.close()
    _, ref_grads = reference_grads(ref, batches)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    errs = [float((grads[k] - g).abs().max()) / scale for k, g in ref_grads.items()]
    return float("inf") if any(e != e for e in errs) else max(errs)


def test_cpu_threaded_turns_a_missing_weight_wait_into_wrong_gradients(tmp_path, monkeypatch):
    from lazytrain.runtime import streams as streams_mod

    assert _threaded_grads_error(tmp_path / "ok", [H] * 5) <= 1e-5
    monkeypatch.setattr(streams_mod.DeviceWeights, "ready", lambda self, handle: handle.flat)
    assert _threaded_grads_error(tmp_path / "bad", [H] * 5) > 1e-3


def test_cpu_threaded_turns_an_early_gradient_read_into_wrong_gradients(tmp_path, monkeypatch):
    from lazytrain.runtime import streams as streams_mod

    def accumulate(self, event, buf, group, *, first, start):  # no wait for the D2H
        group.accumulate_grad(buf, first=first, start=start)

    assert _threaded_grads_error(tmp_path / "ok", [D] * 4 + [H]) <= 1e-5
    monkeypatch.setattr(streams_mod.GradDrain, "_accumulate", accumulate)
    assert _threaded_grads_error(tmp_path / "bad", [D] * 4 + [H]) > 1e-3


def test_an_engine_leaves_a_device_it_was_given_open_for_the_next_engine(tmp_path):
    dev = make_device("cpu-threaded", seed=2)
    try:
        for run in range(2):  # the second engine would hang on a closed device
            _, adapter = model_pair(tiny_config("llama"))
            engine = make_engine(adapter, _plan(adapter, "mixed_tiers"), device=dev,
                                 nvme_dir=tmp_path / f"nvme{run}", grad_accum=2)
            try:
                engine.step(micro_batches(2))
            finally:
                engine.close()
    finally:
        dev.close()
    with pytest.raises(RuntimeError, match="closed"):
        dev.copy(torch.empty(2), torch.ones(2), stream=dev.stream("h2d"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_ends_spanning_three_staging_buffers_under_checker(backend, tmp_path):
    """The multi-chunk ends paths: with vocabulary 800 the ends (2 x 800 x 64 parameters) span
    3 staging buffers and 3 gradient drain buffers of a block's size; their load and drain run
    chunk by chunk, with gradients equal plain HF autograd."""
    config = tiny_config("llama")
    config.vocab_size = 800
    ref, adapter = model_pair(config)
    ends, block = adapter.params.ends.numel, adapter.params.max_block_numel()
    assert 2 * block < ends <= 3 * block
    problem = problem_for(adapter, grad_accum=2)
    plan = build_plan(problem, decisions_from_tiers(problem, (D, D, H, D, H), ()),
                      solver=SolveRecord(backend="manual"))
    batches = micro_batches(2)
    engine = make_engine(adapter, plan, device=make_device(backend, seed=11),
                         nvme_dir=tmp_path / "nvme", grad_accum=2)
    try:
        loss = engine.compute_gradients(batches)
        grads = {k: v.clone() for k, v in engine.gradients().items()}
    finally:
        _close(engine)
    ref_loss, ref_grads = reference_grads(ref, batches)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    _assert_grads_match(grads, ref_grads)
