"""GRPO's cut micro-batches (fewer rows, narrower than the plan's [micro_batch, seq_len]) and
its filler micro-batches (one row of 2 tokens, no label) under every plan feature: save levels
L1/L2 in the hbm and dram tiers with internal transfers split over windows, NVMe boundaries,
recompute segments, kept blocks, resident weights, 8-bit blocks, the pinned_copy / gpu_cast
weight paths, on `cpu`, `cpu-checked` and `cpu-threaded`.

Reference: plain HF autograd on an independent copy of the same tiny model
(`engine_helpers.reference_grads`, loss normalised by the step's label tokens), never the
engine's own output.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from engine_helpers import (SEQ, VOCAB, model_pair, reference_grads,  # noqa: E402
                            tiny_config)
from ledger_helpers import real_problem  # noqa: E402
from levels_helpers import engine_grads, levels_plan  # noqa: E402
from test_engine_grads import _assert_grads_match  # noqa: E402
from test_save_levels_adversarial import MIXED, _plan  # noqa: E402
from test_recalibrate import SLOW, cached, calibrated_plan, run_records  # noqa: E402,F401

from lazytrain.data import IGNORE_INDEX  # noqa: E402
from lazytrain.planner.evaluate import build_plan, decisions_from_tiers, evaluate  # noqa: E402
from lazytrain.planner.plan import SolveRecord  # noqa: E402
from lazytrain.runtime.backends import make_device  # noqa: E402
from lazytrain.runtime.build import make_engine  # noqa: E402

H, R, D, N = "hbm", "recompute", "dram", "nvme"
PLANS = {  # name -> (tiers, levels, saved tiers, other choices)
    **MIXED,
    "L1_hbm": ([H, R, H, D, H], ["L1"] * 4, [H] * 4, {}),
    "L1_dram": ([H, R, H, D, H], ["L1"] * 4, [D, D, D, H], {}),
    "L2_dram_kept": ([H, R, H, N, H], ["L2", "L1", "L0", "L2"], [D, D, "none", H],
                     dict(keep=(2,))),
}
BACKENDS = ["cpu", "cpu-checked", "cpu-threaded"]


def _rows(rows: int, width: int, *, seed: int, pad: int = 0) -> dict:
    """[rows, width] tokens, labels past a 3-token prompt, the last row right-padded by pad."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (rows, width), generator=g)
    labels = ids.clone()
    labels[:, :3] = IGNORE_INDEX
    mask = torch.ones(rows, width, dtype=torch.long)
    if pad:
        ids[-1, -pad:] = 0
        labels[-1, -pad:] = IGNORE_INDEX
        mask[-1, -pad:] = 0
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def _filler() -> dict:
    return {"input_ids": torch.zeros(1, 2, dtype=torch.long),
            "labels": torch.full((1, 2), IGNORE_INDEX, dtype=torch.long),
            "attention_mask": torch.ones(1, 2, dtype=torch.long)}


def cut_batches() -> list[dict]:
    """4 micro-batches under the plan's [2, SEQ]: full, 1 row x 7, a filler, 2 rows x 9 with
    the second padded."""
    return [_rows(2, SEQ, seed=1), _rows(1, 7, seed=2), _filler(), _rows(2, 9, seed=3, pad=3)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(PLANS))
def test_cut_rows_and_a_filler_equal_autograd(case, backend, tmp_path):
    ref, adapter = model_pair(tiny_config("llama"))
    tiers, levels, saved_tiers, other = PLANS[case]
    plan = _plan(adapter, tiers, levels, saved_tiers, grad_accum=4, **other)
    batches = cut_batches()
    loss, grads = engine_grads(adapter, plan, backend, tmp_path, batches)
    torch.manual_seed(123)
    ref_loss, ref_grads = reference_grads(ref, batches)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    _assert_grads_match(grads, ref_grads)


def _moe_pair():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from test_families import family_config
    config = family_config("qwen3_moe")
    config.output_router_logits, config.router_aux_loss_coef = True, 0.5
    return model_pair(config)


def _grpo_filler() -> dict:
    """`grpo._filler` on a pad id that is not the embedding's padding_idx (many tokenizers pad
    with eos): its hidden states are not 0, so a router aux loss of it would have a gradient."""
    from lazytrain.train.grpo import _filler as filler
    batch = filler(None, pad_id=5)
    return {k: v for k, v in batch.items() if k != "old_logp"}


@pytest.mark.parametrize("case", ["L1_dram", "L2_dram_kept"])
def test_moe_router_aux_of_a_filler_is_left_out(case, tmp_path):
    # HF adds coef * aux for every forward; GRPO's filler trains nothing, router included, so
    # the step equals HF autograd over the micro-batches that are not fillers (before: the
    # filler's aux of its 2 pad tokens, ~1.0 each with coef 0.5, added to loss and gradient)
    ref, adapter = _moe_pair()
    tiers, levels, saved_tiers, other = PLANS[case]
    plan = _plan(adapter, tiers, levels, saved_tiers, grad_accum=4, **other)
    batches = cut_batches()
    batches[2] = _grpo_filler()
    loss, grads = engine_grads(adapter, plan, "cpu-checked", tmp_path, batches)
    torch.manual_seed(123)
    ref_loss, ref_grads = reference_grads(ref, [b for i, b in enumerate(batches) if i != 2])
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    _assert_grads_match(grads, ref_grads)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_a_step_of_fillers_only_has_loss_and_gradient_zero(family, tmp_path):
    # every group flat: the trainer's step is grad_accum fillers; loss 0, gradient exactly 0,
    # nothing NaN (before: an MoE model's loss was 4 x coef x aux ~ 4.1 and its gradient not 0)
    _, adapter = _moe_pair() if family == "qwen3_moe" else model_pair(tiny_config("llama"))
    plan = _plan(adapter, *PLANS["L1_dram"][:3], grad_accum=4)
    loss, grads = engine_grads(adapter, plan, "cpu-checked", tmp_path,
                               [_grpo_filler() for _ in range(4)])
    assert loss == 0.0
    for name, g in grads.items():
        assert torch.equal(g, torch.zeros_like(g)), name


# --- budgets: micro-batch shapes that change from micro-batch to micro-batch -------------------

def _budget_plan(adapter, case):
    """A plan of the planner's real memory model (`ledger_helpers.real_problem`) and its
    problem: dram boundaries, or L2 save levels in the dram tier."""
    problem = real_problem(adapter, grad_accum=4)
    if case == "dram_boundaries":
        decisions = decisions_from_tiers(problem, (D, D, D, D, H), ())
        return build_plan(problem, decisions, solver=SolveRecord(backend="manual")), problem
    return levels_plan(problem, [H, R, H, D, H], ["L2"] * 4, [D, D, D, H]), problem


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["dram_boundaries", "L2_dram"])
def test_cut_shapes_stay_within_the_plans_pinned_and_hbm_bytes(case, backend, tmp_path):
    """Pinned budget = the plan's predicted pinned bytes (a plan that fills the DRAM row):
    GRPO steps whose micro-batches have other widths each time (each under the planned
    [2, SEQ]) run, the pinned peak within that budget and every window's HBM within the
    evaluator's. Before, the host pools kept the buffers of every earlier width: the first
    step failed with HostBudgetExceeded (a checkpoint host buffer) and, without the limit,
    the pinned peak grew step by step (to 2.3x the plan's after 5 steps at L2 in DRAM)."""
    _, adapter = model_pair(tiny_config("llama"))
    plan, problem = _budget_plan(adapter, case)
    limit = int(plan.predicted.pinned_bytes)
    hbm = dict(zip((w.name for w in plan.windows), evaluate(problem, plan).hbm_by_window))
    engine = make_engine(adapter, plan, device=make_device(backend, seed=3),
                         nvme_dir=tmp_path / "nvme", grad_accum=4, instrument=True,
                         budgets=True, model_config_sha256=plan.provenance["model_config_sha256"])
    engine.ledger.set_limits(hbm_limits=engine.ledger.hbm_limits, pinned_limit_bytes=limit)
    widths = [(12, 8, 5, 10), (7, 12, 3, 9), (11, 4, 12, 6)]
    try:
        for step, ws in enumerate(widths):
            batches = [_rows(2, w, seed=10 * step + i) for i, w in enumerate(ws)]
            for rec in engine.step(batches, lr=1e-3).windows:
                assert rec["ledger_peak"]["pinned_bytes"] <= limit
                for w in rec["windows"]:
                    if w["name"] in hbm:
                        assert w["ledger"]["hbm_bytes"] <= hbm[w["name"]], w["name"]
    finally:
        engine.close()


def test_flat_groups_are_left_out_whole_and_spread_groups_kept_whole():
    # n = 3; group 0: rewards 1, 0.5, 0 -> mean 0.5: the middle rollout's advantage is exactly
    # 0 but its group has a spread (config: only groups whose rewards are all equal are left
    # out); group 1 flat; group 2 spread. Before, every row with advantage 0 was dropped, so
    # row 1 left the step's completion-token normaliser
    from lazytrain.train.grpo import kept_rows
    from lazytrain.train.grpo_loss import group_advantages
    rewards = torch.tensor([1.0, 0.5, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0])
    assert group_advantages(rewards, n=3, eps=1e-4)[1] == 0
    assert kept_rows(rewards, n=3, skip_flat=True) == [0, 1, 2, 6, 7, 8]
    assert kept_rows(rewards, n=3, skip_flat=False) == list(range(9))


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_device_memory_held_between_steps_does_not_grow_with_new_widths(family, tmp_path):
    # unpadded micro-batches of a new width every step (a GRPO micro-batch of one rollout, or
    # of rollouts of one length): the HBM the ledger sees held after a step stays at most what
    # the first, widest step left. Before, the masks and rotary tables of every earlier shape
    # stayed on the device ("workspace": 6032 -> 17040 bytes over 5 steps on gemma2, whose
    # eager attention keeps a [B, 1, S, S] mask per shape)
    if family == "gemma2":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
        from test_families import family_config
        _, adapter = model_pair(family_config("gemma2"))
    else:
        _, adapter = model_pair(tiny_config("llama"))
    L = adapter.num_blocks
    plan = _plan(adapter, [H] * (L + 1), [], [], grad_accum=2)
    engine = make_engine(adapter, plan, device="cpu", nvme_dir=tmp_path / "nvme", grad_accum=2,
                         instrument=True)
    held = []
    try:
        for step in range(4):
            w = SEQ - 2 * step
            engine.step([_rows(1, w, seed=step), _rows(2, w - 1, seed=step + 50)], lr=1e-3)
            held.append(engine.ledger.held_bytes("hbm"))
    finally:
        engine.close()
    assert max(held) == held[0], held


def test_a_grpo_run_leaves_the_cached_calibration_alone(cached):
    # a GRPO run's windows are of cut micro-batches (here: 1/4 of the planned work), which an
    # SFT run's refit takes for a machine 4x faster and writes into the cache every later run
    # plans with. The same windows under train.method grpo leave the cache as it was
    import dataclasses
    import json
    from lazytrain.train.recalibrate import recalibrate_from_run
    cfg, path = cached
    plan, problem = calibrated_plan(cfg)
    records = run_records(plan, problem, 1 / SLOW)
    grpo = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, method="grpo"))
    before, log = path.read_text(), []
    assert recalibrate_from_run(grpo, plan, records, log=log.append) is None
    assert path.read_text() == before and "GRPO" in log[0]
    assert recalibrate_from_run(cfg, plan, records) is not None  # SFT: replaced
    assert json.loads(path.read_text()) != json.loads(before)
