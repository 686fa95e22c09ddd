"""GRPO's training phase leaves out flat groups and cuts padding, and the engine's gradient of
what is left equals plain autograd over the full-width rows that carry a gradient.

Reference: an independent copy of the tiny HF model; every rollout row at the full S = SEQ
width, the clipped-ratio loss of `grpo_loss` written out here, summed over the completion
tokens of the rows whose group has a reward spread and divided by those tokens. The engine
instead trains `grpo.micro_batches`: the kept rows sorted by length, cut to each
micro-batch's longest row, with filler micro-batches when rows run short.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from engine_helpers import (PLAN_KINDS, SEQ, VOCAB, model_pair, plan_for,  # noqa: E402
                            tiny_config)

from lazytrain.data import IGNORE_INDEX  # noqa: E402
from lazytrain.runtime.build import make_engine  # noqa: E402
from lazytrain.train.grpo import _row, micro_batches  # noqa: E402
from lazytrain.train.grpo_loss import GRPOObjective, group_advantages  # noqa: E402

EPS = 0.2
N = 3  # group size
REWARDS = [1.0, 0.0, 1.0,   0.0, 0.0, 0.0,   1.0, 0.0, 0.0]  # group 2 is flat
LENGTHS = [7, 12, 9,   10, 5, 12,   6, 8, 11]
PROMPT = 4


def _logp(model, ids, mask):
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
    return logits[:, :-1].log_softmax(-1)


def _rows(ref_model):
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]
    rows = []
    for s in seqs:
        with torch.no_grad():
            lp = _logp(ref_model, torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long))
        own = lp[0].gather(-1, torch.tensor(s[1:])[:, None])[:, 0]
        old = own + (torch.rand(own.shape, generator=g) - 0.5)  # the clip binds on some
        rows.append(_row(s, PROMPT, seq_len=SEQ, pad_id=0, old=old, ref=None))
    return rows


def _reference(ref_model, rows, adv):
    """Autograd over the full-width kept rows; returns (loss, grads)."""
    kept = [i for i in range(len(rows)) if adv[i] != 0]
    ids = torch.stack([rows[i]["input_ids"] for i in kept])
    labels = torch.stack([rows[i]["labels"] for i in kept])
    mask = torch.stack([rows[i]["attention_mask"] for i in kept])
    old = torch.stack([rows[i]["old_logp"] for i in kept])[:, :-1]
    a = adv[kept][:, None]
    ref_model.zero_grad(set_to_none=True)
    targets = labels[:, 1:]
    trained = targets != IGNORE_INDEX
    lp = _logp(ref_model, ids, mask).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    ratio = torch.exp(torch.where(trained, lp - old, 0.0))
    per_token = -torch.min(ratio * a, ratio.clamp(1 - EPS, 1 + EPS) * a)
    loss = (per_token * trained).sum() / trained.sum()
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in ref_model.named_parameters()}


def test_micro_batches_cut_padding_sort_by_length_and_fill():
    rows = [_row(list(range(1, n + 1)), 2, seq_len=SEQ, pad_id=0, old=torch.zeros(n),
                 ref=None) for n in (9, 4, 6)]
    out = micro_batches(rows, torch.tensor([1.0, -1.0, 0.5]), count=2, pad_id=0)
    assert [tuple(b["input_ids"].shape) for b in out] == [(2, 6), (1, 9)]
    assert out[0]["advantages"].tolist() == [-1.0, 0.5]  # lengths 4 and 6, shortest first
    few = micro_batches(rows[:1], torch.tensor([1.0]), count=3, pad_id=0)
    assert [tuple(b["input_ids"].shape) for b in few] == [(1, 9), (1, 2), (1, 2)]
    for filler in few[1:]:
        assert (filler["labels"] == IGNORE_INDEX).all() and filler["advantages"].tolist() == [0]
        assert set(filler) == set(few[0])


@pytest.mark.parametrize("plan_kind", ["all_hbm_segments_of_1", "mixed_tiers",
                                       "one_segment_of_4_reembedded"])
def test_engine_gradient_over_kept_cut_rows_equals_autograd(plan_kind, tmp_path):
    tiers, keep = PLAN_KINDS[plan_kind]
    ref_model, adapter = model_pair(tiny_config("llama"), seed=0)
    rows = _rows(ref_model)
    adv = group_advantages(torch.tensor(REWARDS), n=N, eps=1e-4)
    assert (adv[3:6] == 0).all() and (adv != 0).sum() == 6
    kept = [i for i in range(len(rows)) if adv[i] != 0]
    batches = micro_batches([rows[i] for i in kept], adv[kept], count=4, pad_id=0)
    assert max(b["input_ids"].shape[0] for b in batches) == 2  # 6 rows over 4 micro-batches
    assert min(b["input_ids"].shape[1] for b in batches) < SEQ  # padding cut
    plan = plan_for(adapter, tiers, keep, grad_accum=4)
    engine = make_engine(adapter, plan, device="cpu-checked", nvme_dir=tmp_path / "nvme",
                         grad_accum=4, head_chunk_tokens=8)
    engine.ends.objective = GRPOObjective(clip_eps=EPS)
    try:
        got = engine.compute_gradients(batches)
        grads = {k: v.clone() for k, v in engine.gradients().items()}
        clip = engine.ends.objective.take_metrics()["clip_fraction"]
    finally:
        engine.close()
    want, ref_grads = _reference(ref_model, rows, adv)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert 0 < clip < 1
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    for name, ref in ref_grads.items():
        assert float((grads[name] - ref).abs().max()) <= 2e-5 * scale, name


def test_a_micro_batch_wider_or_taller_than_the_plan_is_refused():
    from lazytrain.planner.plan_checks import PlanValidationError
    from lazytrain.runtime.micro_batch import check_planned_shape
    planned = {"micro_batch": 2, "seq_len": 12}
    check_planned_shape(0, {"input_ids": torch.zeros(1, 5)}, planned)  # under: fine
    for shape, key in (((3, 12), "micro_batch 3"), ((2, 13), "seq_len 13")):
        with pytest.raises(PlanValidationError, match=f"micro-batch 1: {key} exceeds"):
            check_planned_shape(1, {"input_ids": torch.zeros(shape)}, planned)
