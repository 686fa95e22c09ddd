"""Save levels under adversarial plans and failures (docs/execution_model.md, "Save levels").

Reference: plain HF autograd on an independent copy of the same tiny model
(`engine_helpers.reference_grads`), never the engine's own output. Covered here, beyond
test_save_levels_engine.py:
- plans that mix levels with recompute segments, kept blocks, resident weights, 8-bit blocks,
  the pinned_copy / gpu_cast weight paths and an NVMe boundary read by a dram-tier block;
- a step that fails mid-way (an NVMe write fault, a KeyboardInterrupt in a saved-internals
  transfer, in the host pool, after `take`) and then a normal step;
- re-planning between steps: levels -> none -> other levels -> levels;
- padded batches, whose saved internals pass the analytic S2 (the mask keeps k and v expanded
  per query head): a clear `HostBudgetExceeded` where the pinned budget cannot hold them, and no
  failure from idle host buffers cached for another batch's sizes.
"""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path

import pytest
import torch

from engine_helpers import (BATCH, HIDDEN, SEQ, micro_batches, model_pair, problem_for,
                            reference_grads, tiny_config)
from ledger_helpers import real_problem
from levels_helpers import (assert_engine_equals_autograd, internal_moves,
                            levels_plan)
from lazytrain.planner.evaluate import build_plan, decisions_from_tiers
from lazytrain.planner.plan import SolveRecord
from lazytrain.runtime.activations import ActivationStore
from lazytrain.runtime.backends import make_device
from lazytrain.runtime.build import make_engine
from lazytrain.runtime.errors import HostBudgetExceeded, NvmeIOError
from lazytrain.runtime.nvme import FaultInjector
from test_engine_grads import _assert_grads_match

H, R, D, N = "hbm", "recompute", "dram", "nvme"
A = BATCH * SEQ * HIDDEN * 4
BACKENDS = ["cpu", "cpu-checked", "cpu-threaded"]


def _plan(adapter, tiers, levels, saved_tiers, *, keep=(), resident=None, q8=(), paths=None,
          grad_accum=2):
    """A validated plan with levels, the dram tier's internal transfers split over two windows
    per kind (`levels_helpers.internal_moves`), and the given resident / 8-bit / path choices."""
    L = adapter.num_blocks
    problem = problem_for(adapter, grad_accum=grad_accum, saved_bytes=((2 * A, 6 * A),) * L,
                          reforward_ms=(1.0,) * L, reforward_l1_ms=(0.6,) * L)
    decisions = decisions_from_tiers(
        problem, tuple(tiers), tuple(keep), resident_weights=resident, q8_blocks=q8,
        save_levels=tuple(levels), saved_tiers=tuple(t if t != D else H for t in saved_tiers))
    decisions = dataclasses.replace(
        decisions, saved_tiers=tuple(saved_tiers), weight_paths=paths,
        internal_transfers=internal_moves(problem, levels, saved_tiers))
    return build_plan(problem, decisions, solver=SolveRecord(backend="manual"))


MIXED = {  # boundary tiers, levels, saved tiers, other choices
    # boundary 1 on NVMe is block 1's input; blocks 0-2 dram-tier, block 2 recomputed for
    # boundary 3, block 3 kept
    "nvme_next_to_dram": ([H, N, H, R, H], ["L2", "L1", "L1", "L0"], [D, D, D, "none"],
                          dict(keep=(3,))),
    "resident_and_q8": ([H, N, H, R, H], ["L2", "L1", "L2", "L2"], [D, D, H, H],
                        dict(resident=(1, 3), q8=(0, 2))),
    "weight_paths": ([R, D, R, N, H], ["L1", "L2", "L2", "L1"], [D, D, D, H],
                     dict(paths=("pinned_copy", "gpu_cast", "pinned_copy", "gpu_cast"))),
    "one_segment_reembedded": ([R, R, R, R, H], ["L2", "L1", "L2", "L1"], [D, D, D, H], {}),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(MIXED))
def test_mixed_plans_equal_autograd(case, backend, tmp_path):
    ref, adapter = model_pair(tiny_config("llama"))
    tiers, levels, saved_tiers, other = MIXED[case]
    plan = _plan(adapter, tiers, levels, saved_tiers, **other)
    assert_engine_equals_autograd(ref, adapter, plan, backend, tmp_path, micro_batches(2))


# --- a failed step, then a normal one ----------------------------------------------------------

def _nvme_fault(engine, faults):
    faults.fail_next_write(boundary=1)
    return NvmeIOError


def _nvme_short_read(engine, faults):
    faults.truncate_next_read(boundary=1)  # in b-windows: blocks 2 and 3 already backed up
    return NvmeIOError


def _interrupt_transfer(kind, block, mb_index, nth):
    """KeyboardInterrupt at the `nth` `kind` transfer of (block, micro-batch `mb_index`), once."""
    def inject(engine, faults):
        transfer, seen = engine.saved.transfer, []

        def interrupted(b, k, fraction, *, micro_batch=0):
            if (b, k, micro_batch) == (block, kind, mb_index):
                seen.append(k)
                if len(seen) == nth:
                    raise KeyboardInterrupt
            return transfer(b, k, fraction, micro_batch=micro_batch)

        engine.saved.transfer = interrupted
        return KeyboardInterrupt
    return inject


def _interrupt_pool(engine, faults):
    """KeyboardInterrupt at the saved store's third host-buffer acquire, once."""
    acquire, calls = engine.saved._pool.acquire, []

    def interrupted(nbytes):
        calls.append(nbytes)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return acquire(nbytes)

    engine.saved._pool.acquire = interrupted
    return KeyboardInterrupt


def _interrupt_after_take(engine, faults):
    """KeyboardInterrupt right after micro-batch 1 took block 1's prefetched internals, once."""
    take, done = engine.saved.take, []

    def interrupted(block, *, micro_batch=0):
        saved = take(block, micro_batch=micro_batch)
        if (block, micro_batch) == (1, 1) and not done:
            done.append(block)
            raise KeyboardInterrupt
        return saved

    engine.saved.take = interrupted
    return KeyboardInterrupt


FAILURES = {
    "nvme_write_fault": _nvme_fault,
    "nvme_short_read": _nvme_short_read,
    "interrupt_in_second_d2h_fraction": _interrupt_transfer("d2h", 0, 0, 2),
    "interrupt_in_h2d_of_micro_batch_1": _interrupt_transfer("h2d", 1, 1, 1),
    "interrupt_in_host_pool": _interrupt_pool,
    "interrupt_after_take": _interrupt_after_take,
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("failure", list(FAILURES))
def test_a_step_that_fails_midway_then_a_normal_step_is_exact(failure, backend, tmp_path):
    ref, adapter = model_pair(tiny_config("llama"))
    plan = _plan(adapter, *MIXED["nvme_next_to_dram"][:3], keep=(3,))
    dev = make_device(backend, seed=5)
    faults = FaultInjector()
    engine = make_engine(adapter, plan, device=dev, grad_accum=2,
                         store=ActivationStore(device=dev, nvme_dir=tmp_path / "nvme",
                                               fault_hook=faults))
    batches = micro_batches(2)
    try:
        expected = FAILURES[failure](engine, faults)
        with pytest.raises(expected):
            engine.compute_gradients(batches)
        assert engine.saved.held() == [] and engine.saved.bytes_held() == {"hbm": 0, "dram": 0}
        assert engine.store.stored() == []
        torch.manual_seed(123)
        engine.compute_gradients(batches)
        grads = {k: v.clone() for k, v in engine.gradients().items()}
    finally:
        engine.close()
    assert not getattr(dev, "violations", None), dev.violations[:1]
    torch.manual_seed(123)
    _, ref_grads = reference_grads(ref, batches)
    _assert_grads_match(grads, ref_grads)


# --- re-planning between steps -----------------------------------------------------------------

REPLANS = [  # levels -> none (full re-forward) -> other levels and tiers -> the first again
    ([H, R, H, D, H], ["L2", "L1", "L0", "L2"], [D, D, "none", H], dict(keep=(2,))),
    ([H, R, H, D, H], (), (), {}),
    ([R, H, N, H, H], ["L1", "L2", "L1", "L2"], [D, H, D, H], {}),
    ([H, R, H, D, H], ["L2", "L1", "L0", "L2"], [D, D, "none", H], dict(keep=(2,))),
]


@pytest.mark.parametrize("backend", ["cpu", "cpu-threaded"])
def test_replanning_between_levels_and_none_keeps_gradients_exact(backend, tmp_path):
    """After each optimizer step under a new plan, the next plan's gradients equal HF autograd
    on the engine's current masters (loaded into the reference model)."""
    ref, adapter = model_pair(tiny_config("llama"))
    plans = [_plan(adapter, tiers, levels, saved, **other) if levels else
             levels_plan(problem_for(adapter, grad_accum=2), tiers, (), ())
             for tiers, levels, saved, other in REPLANS]
    assert [bool(p.save_levels) for p in plans] == [True, False, True, True]
    dev = make_device(backend, seed=3)
    engine = make_engine(adapter, plans[0], device=dev, nvme_dir=tmp_path / "nvme",
                         grad_accum=2, lr=1e-2, instrument=True)
    try:
        for s, plan in enumerate(plans):
            engine.set_plan(plan)
            batches = micro_batches(2, seed=30 + s)
            ref.load_state_dict(engine.named_masters(), strict=False)
            torch.manual_seed(s)
            engine.compute_gradients(batches)
            grads = {k: v.clone() for k, v in engine.gradients().items()}
            torch.manual_seed(s)
            _, ref_grads = reference_grads(ref, batches)
            _assert_grads_match(grads, ref_grads)
            engine.step(batches)
            assert engine.saved.held() == []
    finally:
        engine.close()


# --- padded batches: saved bytes past the analytic S2 ------------------------------------------

PADDED_PLAN = ([H, R, H, D, H], ["L2"] * 4, [D, D, D, H])


def _budget_engine(adapter, plan, backend, tmp_path):
    return make_engine(adapter, plan, device=make_device(backend, seed=3),
                       nvme_dir=tmp_path / "nvme", grad_accum=2, instrument=True, budgets=True,
                       model_config_sha256=plan.provenance["model_config_sha256"])


def _pinned_peak(engine, batches) -> int:
    """The ledger's pinned peak over one optimizer step of `batches`."""
    return max(r["ledger_peak"]["pinned_bytes"]
               for r in engine.step(batches, lr=1e-3).windows)


@pytest.fixture
def padded_setup(tmp_path):
    """(adapter, plan of the planner's real memory model, pinned peak of one padded step alone,
    pinned peak of one unpadded step alone), each peak measured on a fresh engine."""
    _, adapter = model_pair(tiny_config("llama"))
    plan = levels_plan(real_problem(adapter), *PADDED_PLAN)
    peaks = []
    for pad in (True, False):
        engine = _budget_engine(adapter, plan, "cpu", tmp_path / f"peak{pad}")
        try:
            peaks.append(_pinned_peak(engine, micro_batches(2, pad_last=pad)))
        finally:
            engine.close()
    padded, unpadded = peaks
    assert unpadded == plan.predicted.pinned_bytes < padded  # the mask's k, v copies: past S2
    return adapter, plan, padded, unpadded


@pytest.mark.parametrize("backend", ["cpu", "cpu-threaded"])
def test_padded_step_past_the_booked_pinned_bytes_fails_clearly_then_unpadded_steps_run(
        padded_setup, backend, tmp_path):
    """Pinned budget = what the plan booked (the unpadded step's need): the padded step's larger
    saved internals raise HostBudgetExceeded naming the saved-internals host buffer; the next
    unpadded steps run (no idle padded-size buffer held against the budget) and stay within it."""
    adapter, plan, _, unpadded = padded_setup
    engine = _budget_engine(adapter, plan, backend, tmp_path)
    engine.ledger.set_limits(hbm_limits=engine.ledger.hbm_limits, pinned_limit_bytes=unpadded)
    try:
        assert _pinned_peak(engine, micro_batches(2, seed=1, pad_last=False)) <= unpadded
        with pytest.raises(HostBudgetExceeded, match="saved internals host buffer"):
            engine.step(micro_batches(2, seed=2, pad_last=True), lr=1e-3)
        assert engine.saved.held() == []
        for seed in (3, 4):
            assert _pinned_peak(engine, micro_batches(2, seed=seed, pad_last=False)) <= unpadded
    finally:
        engine.close()


@pytest.mark.parametrize("backend", ["cpu", "cpu-threaded"])
def test_idle_host_buffers_of_another_batch_do_not_fail_a_step_that_fits(padded_setup, backend,
                                                                         tmp_path):
    """Pinned budget = the padded step's own need: unpadded, padded, unpadded, padded steps all
    run; host buffers cached for the other batch kind's sizes are idle and must not count
    against the step that needs the room."""
    adapter, plan, padded, _ = padded_setup
    engine = _budget_engine(adapter, plan, backend, tmp_path)
    engine.ledger.set_limits(hbm_limits=engine.ledger.hbm_limits, pinned_limit_bytes=padded)
    try:
        for seed, pad in enumerate((False, True, False, True)):
            assert _pinned_peak(engine, micro_batches(2, seed=seed, pad_last=pad)) <= padded
    finally:
        engine.close()


@pytest.mark.parametrize("tier", [H, D])
def test_a_failed_step_gives_back_the_saved_internals_memory_at_once(tier, tmp_path):
    """A forward that fails in f2 after blocks 0 and 1 saved their internals: once the step is
    abandoned the ledger holds no HBM byte of theirs (the dram tier's host buffers go back to
    the pool for reuse), without waiting for Python's cycle collector (their graphs refer back to them)."""
    _, adapter = model_pair(tiny_config("llama"))
    plan = _plan(adapter, [H, H, H, H, H], ["L2"] * 4, [tier, tier, H, H], grad_accum=1)
    engine = make_engine(adapter, plan, device="cpu", nvme_dir=tmp_path / "nvme",
                         instrument=True)
    forward = engine.levels.forward

    def fail_in_block_2(mb, j, *args):
        if j == 2:
            raise RuntimeError("injected forward failure")
        return forward(mb, j, *args)

    engine.levels.forward = fail_in_block_2
    gc_was_enabled = gc.isenabled()
    gc.disable()  # the cycle collector would hide a leak that only it frees
    try:
        with pytest.raises(RuntimeError, match="injected"):
            engine.compute_gradients(micro_batches(1))
        held = {owner: n for owner, n in engine.ledger.held_by_owner("hbm").items()
                if owner.startswith("saved internals") and n}
        assert held == {}
    finally:
        if gc_was_enabled:
            gc.enable()
        engine.close()


# --- the CLI: train with a hand plan with levels, resume in the middle, report -----------------

def test_train_resume_and_report_with_a_hand_plan_with_levels(tmp_path, monkeypatch, capsys):
    """`lazytrain train --plan` with L1/L2 blocks in the hbm and dram tiers, a recompute segment
    and an NVMe boundary (configs/tiny-llama-cpu.yaml): 2 steps, then `--resume` to 3, give the
    weights of 3 steps in one run bit for bit; `lazytrain report` prints the saved internals'
    bytes, predicted equal to measured."""
    from safetensors.torch import load_file

    from lazytrain.cli.main import main
    from lazytrain.config import load_config
    from lazytrain.profile.calibrate import costed_problem

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no shared calibration
    monkeypatch.setenv("LAZYTRAIN_CALIBRATE", "off")
    config = str(Path(__file__).resolve().parents[2] / "configs" / "tiny-llama-cpu.yaml")
    sets = ["train.schedule=constant", "train.checkpoint_every_steps=1", "train.eval_every=0",
            "data.num_eval=1"]
    problem = costed_problem(load_config(config, sets), log=lambda msg: None)
    plan = levels_plan(problem, [H, N, H, R, H], ["L2", "L1", "L2", "L1"], [D, D, D, H])
    plan.save(tmp_path / "plan.json")
    args = ["--config", config, "--plan", str(tmp_path / "plan.json"), "--no-progress",
            *(a for s in sets for a in ("--set", s))]
    assert main(["train", *args, "--run-dir", str(tmp_path / "one"), "--steps", "3"]) == 0
    assert main(["train", *args, "--run-dir", str(tmp_path / "two"), "--steps", "2"]) == 0
    assert main(["train", "--resume", str(tmp_path / "two"), "--steps", "3",
                 "--no-progress"]) == 0
    one, two = (load_file(tmp_path / run / "checkpoints" / "step-000003" / "model.safetensors")
                for run in ("one", "two"))
    assert one.keys() == two.keys()
    assert all(torch.equal(one[k], two[k]) for k in one)
    capsys.readouterr()
    assert main(["report", str(tmp_path / "two")]) == 0
    out = capsys.readouterr().out
    line = next(s for s in out.splitlines() if s.startswith("saved internals"))
    d2h, h2d = line.split("D2H ")[1].split(", H2D ")
    assert d2h.split(" / ")[0] == d2h.split(" / ")[1] != "0.000"
    assert h2d.split(" / ")[0] == h2d.split(" / ")[1]


@pytest.mark.parametrize("backend", ["cpu", "cpu-checked"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_packed_and_a_padded_micro_batch_in_one_step_equal_autograd(family, backend, tmp_path):
    """Micro-batch 0 packs two documents per row (position_ids restart, no mask), micro-batch 1
    right-pads its last row (attention mask): their saved internals differ in size and both
    equal HF autograd at L1 and L2, in the hbm and dram tiers."""
    ref, adapter = model_pair(tiny_config(family))
    plan = _plan(adapter, [H, R, H, D, H], ["L1", "L2", "L1", "L2"], [D, D, H, H])
    batches = micro_batches(2)
    positions = torch.cat([torch.arange(5), torch.arange(SEQ - 5)]).repeat(BATCH, 1)
    batches[0] = {"input_ids": batches[0]["input_ids"], "labels": batches[0]["labels"],
                  "position_ids": positions}
    dev = make_device(backend, seed=7)
    engine = make_engine(adapter, plan, device=dev, nvme_dir=tmp_path / "nvme", grad_accum=2)
    try:
        loss = engine.compute_gradients(batches)
        grads = {k: v.clone() for k, v in engine.gradients().items()}
    finally:
        engine.close()
    assert not getattr(dev, "violations", None), dev.violations[:1]
    ref_loss, ref_grads = reference_grads(ref, batches)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    _assert_grads_match(grads, ref_grads)


def test_set_plan_takes_the_new_plans_budgets(tmp_path):
    """The ledger's hard limits after `set_plan` are the new plan's (`plan_budgets`): a plan
    with 8-bit blocks keeps fewer host states pageable, so its pinned budget is larger."""
    from ledger_helpers import real_plan
    from lazytrain.planner.budgets import plan_budgets

    _, adapter = model_pair(tiny_config("llama"))
    first = levels_plan(real_problem(adapter), [H, R, H, D, H], ["L2"] * 4, [D, D, D, H])
    second = real_plan(adapter, [H] * 5, q8_blocks=(1, 2))
    assert plan_budgets(second) != plan_budgets(first)
    engine = _budget_engine(adapter, first, "cpu", tmp_path)
    try:
        engine.set_plan(second)
        hbm, pinned = plan_budgets(second)
        assert (engine.ledger.hbm_limits, engine.ledger.pinned_limit_bytes) == ({"*": hbm}, pinned)
    finally:
        engine.close()
