"""The engine under save levels: every level x saved tier, on a dense, a hybrid linear-attention
and a MoE model, under `cpu`, `cpu-checked` and `cpu-threaded`.

Reference: plain HF autograd on an independent copy of the same tiny model
(`engine_helpers.reference_grads`), never the engine's own output. Plans are the planner's
(`build_plan`) with the dram tier's internal transfers split over two legal windows per kind
(`levels_helpers.internal_moves`), grad_accum 2 (each micro-batch saves and moves its own
internals), and a recompute segment whose first block is recomputed for the boundary after it
and then backs up from its own saved internals. The MoE model adds HF's router aux loss
(coefficient 0.5), whose gradient enters L2 through the saved router logits and L1 through the
re-forward's.

Also: a plan without `save_levels` (written before the field) re-forwards in full, one with
them re-forwards L0 blocks truncated (observed through the adapter's `truncated` argument),
and the bytes the runtime moves and holds for saved internals are the plan's.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from engine_helpers import (BATCH, HIDDEN, SEQ, micro_batches, model_pair, problem_for,
                            reference_grads, tiny_config)
from ledger_helpers import real_problem
from levels_helpers import assert_engine_equals_autograd, engine_grads, levels_plan
from lazytrain.planner.evaluate import evaluate
from lazytrain.runtime.backends import make_device
from lazytrain.runtime.build import make_engine
from test_engine_grads import _assert_grads_match

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from test_families import family_config  # noqa: E402

R, H, D = "recompute", "hbm", "dram"
TIERS = [H, R, H, D, H]  # segments (0,1), (1,3), (3,4): block 1 recomputed for boundary 2
A = BATCH * SEQ * HIDDEN * 4
LEVELS = {  # name -> (levels, saved tiers, kept blocks); block 3 = L-1 has no dram pair
    "L1_hbm": (["L1"] * 4, [H] * 4, ()),
    "L1_dram": (["L1"] * 4, [D, D, D, H], ()),
    "L2_hbm": (["L2"] * 4, [H] * 4, ()),
    "L2_dram": (["L2"] * 4, [D, D, D, H], ()),
    "mixed_with_kept": (["L2", "L1", "L0", "L2"], [D, D, "none", H], (2,)),
}
BACKENDS = ["cpu", "cpu-checked", "cpu-threaded"]


def _config(family: str):
    if family == "llama":
        return tiny_config("llama")
    config = family_config(family)
    if family == "qwen3_moe":
        config.output_router_logits, config.router_aux_loss_coef = True, 0.5
    return config


def _problem(adapter, *, grad_accum: int = 2):
    L = adapter.num_blocks
    return problem_for(adapter, grad_accum=grad_accum, saved_bytes=((2 * A, 6 * A),) * L,
                       reforward_ms=(1.0,) * L, reforward_l1_ms=(0.6,) * L)




def _check(family, case, backend, tmp_path):
    ref, adapter = model_pair(_config(family))
    levels, saved_tiers, keep = LEVELS[case]
    plan = levels_plan(_problem(adapter), TIERS, levels, saved_tiers, keep)
    assert plan.save_levels == tuple(levels)
    assert_engine_equals_autograd(ref, adapter, plan, backend, tmp_path, micro_batches(2))


@pytest.mark.parametrize("case", list(LEVELS))
def test_every_level_and_tier_equals_autograd_on_llama(case, tmp_path):
    _check("llama", case, "cpu", tmp_path)


@pytest.mark.parametrize("backend", ["cpu-checked", "cpu-threaded"])
@pytest.mark.parametrize("family", ["llama", "qwen3_5_text", "qwen3_moe"])
def test_mixed_levels_equal_autograd_under_checker(family, backend, tmp_path):
    _check(family, "mixed_with_kept", backend, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(LEVELS))
@pytest.mark.parametrize("family", ["llama", "qwen3_5_text", "qwen3_moe"])
def test_level_matrix_equals_autograd(family, case, backend, tmp_path):
    _check(family, case, backend, tmp_path)


def test_dropout_under_levels_draws_the_forwards_masks(tmp_path):
    ref, adapter = model_pair(tiny_config("llama", dropout=0.3))
    plan = levels_plan(_problem(adapter), TIERS, *LEVELS["mixed_with_kept"])
    batches = micro_batches(2)
    loss, grads = engine_grads(adapter, plan, "cpu-threaded", tmp_path, batches)
    torch.manual_seed(123)
    ref_loss, ref_grads = reference_grads(ref, batches)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    _assert_grads_match(grads, ref_grads)


def _spy_truncated(adapter) -> list[bool]:
    """Record the `truncated` argument of every `forward_block` call."""
    calls, forward = [], adapter.forward_block

    def spy(*args, **kwargs):
        calls.append(kwargs.get("truncated", False))
        return forward(*args, **kwargs)

    adapter.forward_block = spy
    return calls


@pytest.mark.parametrize("levels", [(), ("L0",) * 4], ids=["no_save_levels", "all_L0"])
def test_a_plan_without_levels_reforwards_in_full_and_L0_truncated(levels, tmp_path):
    ref, adapter = model_pair(tiny_config("llama"))
    plan = levels_plan(_problem(adapter, grad_accum=1), [H] * 5, levels,
                       ("none",) * len(levels))
    assert plan.reforwards_in_full == (not levels)
    calls = _spy_truncated(adapter)
    batches = micro_batches(1)
    loss, grads = engine_grads(adapter, plan, "cpu", tmp_path, batches)
    # 4 forwards (no grad, never truncated), then 4 re-forwards in b3..b0
    assert calls == [False] * 4 + [bool(levels)] * 4
    torch.manual_seed(123)
    _, ref_grads = reference_grads(ref, batches)
    _assert_grads_match(grads, ref_grads)


def test_windows_record_the_saved_bytes_the_plan_moves(tmp_path):
    """windows.jsonl's saved_d2h_bytes / saved_h2d_bytes per window equal the plan's internal
    transfers times the block's measured saved bytes (its `SavedInternals.nbytes`, read at
    `put`), and HBM holds no saved bytes once each block's backward ends."""
    _, adapter = model_pair(tiny_config("llama"))
    plan = levels_plan(_problem(adapter), TIERS, *LEVELS["L2_dram"])
    engine = make_engine(adapter, plan, device="cpu", nvme_dir=tmp_path / "nvme", grad_accum=2,
                         instrument=True)
    sizes: dict[int, int] = {}
    put = engine.saved.put

    def record(block, saved, tier, *, micro_batch=0):
        sizes[block] = saved.nbytes
        put(block, saved, tier, micro_batch=micro_batch)

    engine.saved.put = record
    try:
        records = engine.step(micro_batches(2), lr=1e-3).windows
    finally:
        engine.close()
    for rec in records:
        got = {w["name"]: (w["saved_d2h_bytes"], w["saved_h2d_bytes"]) for w in rec["windows"]}
        want = {name: [0, 0] for name in got}
        for t in plan.internal_transfers:
            want[t.window][t.kind == "h2d"] += t.fraction * sizes[t.block]
        for name, (d2h, h2d) in got.items():
            assert (d2h, h2d) == pytest.approx(tuple(want[name]), abs=1), name
    assert all(sizes[j] > 0 for j in range(3))


@pytest.mark.parametrize("backend", ["cpu", "cpu-threaded"])
@pytest.mark.parametrize("case", ["L2_hbm", "L2_dram", "mixed_with_kept"])
def test_ledger_peaks_stay_within_the_plans(case, backend, tmp_path):
    """The allocation ledger's HBM peak of every window (saved internals booked to their own
    owners) stays within the evaluator's HBM of that window, and the step's pinned peak within
    the plan's predicted pinned bytes, for a plan of the planner's real memory model
    (`build_problem`, whose saved bytes are the analytic S1/S2). Unpadded rows: with a padding
    mask the attention saves a [B, 1, S, S] mask and one more [B, S, H] tensor per block that
    the analytic S2 does not count (7296 bytes per block here)."""
    _, adapter = model_pair(tiny_config("llama"))
    problem = real_problem(adapter)
    assert problem.saved_bytes
    plan = levels_plan(problem, TIERS, *LEVELS[case])
    predicted = dict(zip((w.name for w in plan.windows), evaluate(problem, plan).hbm_by_window))
    engine = make_engine(adapter, plan, device=make_device(backend, seed=3),
                         nvme_dir=tmp_path / "nvme", grad_accum=2, instrument=True,
                         budgets=True, model_config_sha256=plan.provenance["model_config_sha256"])
    try:
        records = engine.step(micro_batches(2, pad_last=False), lr=1e-3).windows
        records += engine.step(micro_batches(2, seed=5, pad_last=False), lr=1e-3).windows
    finally:
        engine.close()
    for rec in records:
        assert rec["ledger_peak"]["pinned_bytes"] <= plan.predicted.pinned_bytes
        for w in rec["windows"]:
            if w["name"] in predicted:
                assert w["ledger"]["hbm_bytes"] <= predicted[w["name"]], w["name"]


def test_gpu_validate_levels_plan_builds_and_runs_on_the_checker(tmp_path, monkeypatch):
    """benchmarks/gpu_validate.py's save-levels case (it needs a GPU to run as a whole): its
    plan builds without a solver, and its gradients equal HF autograd under `cpu-checked`."""
    if "gpu_validate" not in sys.modules:
        script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_validate.py"
        spec = importlib.util.spec_from_file_location("gpu_validate", script)
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_validate"] = module
        spec.loader.exec_module(module)
    gv = sys.modules["gpu_validate"]
    monkeypatch.setattr(gv, "REF_DEVICE", "cpu")
    config = gv.llama_config(hidden=64, layers=4, seq=24, intermediate=128, heads=2, kv_heads=2,
                             vocab=256)
    ref, adapter = gv.model_pair(config, seed=3)
    plan = gv.levels_plan_of(gv.hand_problem(adapter, batch=1, seq=24, act_bytes=4,
                                             grad_accum=2), 4)
    assert set(plan.save_levels) == {"L1", "L2"} and "dram" in plan.saved_tiers
    batches = gv.make_batches(2, batch=1, seq=24, vocab=256, seed=4)
    ctx = type("Ctx", (), {"dev": "cpu-checked", "tmp": tmp_path})()
    err = gv.grad_error(gv.engine_grads(adapter, plan, ctx, batches), gv.hf_grads(ref, batches))
    assert err["max_rel"] <= 1e-5, err


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failed_step_releases_the_saved_internals_and_the_next_step_is_exact(backend,
                                                                               tmp_path):
    """A backward that fails in b1 (blocks 0 and 1 in the dram tier: block 0's internals in
    DRAM, block 1's prefetched, blocks 2 and 3 already released) abandons the step: nothing is
    held, no ordering violation, and the next step's gradients equal HF autograd."""
    ref, adapter = model_pair(tiny_config("llama"))
    plan = levels_plan(_problem(adapter, grad_accum=1), TIERS, *LEVELS["L2_dram"])
    dev = make_device(backend, seed=5)
    engine = make_engine(adapter, plan, device=dev, nvme_dir=tmp_path / "nvme")
    backward, failed = engine.levels.backward, []

    def fail_once(mb, j, grad):
        if j == 1 and not failed:
            failed.append(j)
            raise RuntimeError("injected backward failure")
        return backward(mb, j, grad)

    engine.levels.backward = fail_once
    batches = micro_batches(1)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            engine.compute_gradients(batches)
        assert engine.saved.held() == [] and engine.saved.bytes_held() == {"hbm": 0, "dram": 0}
        torch.manual_seed(123)
        engine.compute_gradients(batches)
        grads = {k: v.clone() for k, v in engine.gradients().items()}
    finally:
        engine.close()
    if getattr(dev, "violations", None):
        raise dev.violations[0]
    torch.manual_seed(123)
    _, ref_grads = reference_grads(ref, batches)
    _assert_grads_match(grads, ref_grads)
