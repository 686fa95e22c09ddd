"""The DPO gradient of the streaming engine equals plain PyTorch autograd on the same formula.

Reference: an independent copy of the tiny HF model (copied state_dict): full forward, [B, S, V]
logits, log-softmax, the targets' log-probs summed per row, the DPO loss of each pair written
out here (sigmoid: -logsigmoid(beta * z); ipo: (z' - 1/(2 beta))^2 on per-token means), the
mean over the step's pairs, autograd. The engine instead computes log-probs chunk by chunk and
back-propagates in two passes (`runtime.ends.objective_loss_chunks`), over every plan kind of
the engine's gradient matrix.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from engine_helpers import (PLAN_KINDS, micro_batches, model_pair, plan_for,  # noqa: E402
                            tiny_config)

from lazytrain.runtime.build import make_engine  # noqa: E402
from lazytrain.train.dpo import DPOObjective  # noqa: E402

PLANS = {k: PLAN_KINDS[k] for k in ("all_hbm_segments_of_1", "all_nvme", "mixed_tiers",
                                    "segments_of_3_and_1", "one_segment_of_4_reembedded",
                                    "keep_after_recomputed_segment")}


def _pair_batches(n_micro: int) -> list[dict]:
    """Each micro-batch: 1 pair = 2 rows (chosen, rejected) with a prompt prefix ignored, the
    rejected row right-padded, and a made-up reference log-prob per row."""
    g = torch.Generator().manual_seed(5)
    out = []
    for b in micro_batches(n_micro, seed=3):
        b["ref_logp"] = -torch.rand(b["input_ids"].shape[0], generator=g) * 20 - 20
        out.append(b)
    return out


def _reference(ref_model, batches, *, beta: float, loss: str):
    """Plain autograd: full logits, log-softmax, per-row sums, the DPO loss, mean over pairs."""
    pairs = sum(b["input_ids"].shape[0] // 2 for b in batches)
    ref_model.zero_grad(set_to_none=True)
    total = 0.0
    for b in batches:
        logits = ref_model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                           use_cache=False).logits.float()
        targets = b["labels"][:, 1:]
        mask = targets != -100
        lp = logits[:, :-1].log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
        pi = (lp * mask).sum(1)
        ratio = pi - b["ref_logp"]
        P = pi.shape[0] // 2
        if loss == "sigmoid":
            per_pair = -F.logsigmoid(beta * (ratio[:P] - ratio[P:]))
        else:
            mean = ratio / mask.sum(1)
            per_pair = (mean[:P] - mean[P:] - 1 / (2 * beta)) ** 2
        step_loss = per_pair.sum() / pairs
        step_loss.backward()
        total += float(step_loss.detach())
    return total, {n: p.grad for n, p in ref_model.named_parameters()}


def _engine(config, tiers, keep, tmp_path, batches, *, beta, loss, chunk_tokens=8,
            device="cpu", **engine_kw):
    ref_model, adapter = model_pair(config, seed=0)
    plan = plan_for(adapter, tiers, keep, grad_accum=len(batches))
    engine = make_engine(adapter, plan, device=device, nvme_dir=tmp_path / "nvme",
                         grad_accum=len(batches), head_chunk_tokens=chunk_tokens, **engine_kw)
    engine.ends.objective = DPOObjective(beta=beta, loss_type=loss)
    try:
        got = engine.compute_gradients(batches)
        grads = {k: v.clone() for k, v in engine.gradients().items()}
        metrics = engine.ends.objective.take_metrics()
    finally:
        engine.close()
    want, ref_grads = _reference(ref_model, batches, beta=beta, loss=loss)
    return got, want, grads, ref_grads, metrics


def _assert_close(grads, ref_grads):
    assert set(grads) == set(ref_grads)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    assert scale > 0
    for name, ref in ref_grads.items():
        assert ref is not None, name
        diff = float((grads[name] - ref).abs().max())
        assert diff <= 2e-5 * scale, f"{name}: max abs diff {diff:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("plan_kind", list(PLANS))
def test_dpo_sigmoid_gradient_equals_autograd_for_plan(plan_kind, tmp_path):
    tiers, keep = PLANS[plan_kind]
    got, want, grads, ref_grads, _ = _engine(tiny_config("llama"), tiers, keep, tmp_path,
                                             _pair_batches(1), beta=0.5, loss="sigmoid")
    assert got == pytest.approx(want, rel=1e-5)
    _assert_close(grads, ref_grads)


@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_dpo_gradient_with_grad_accum_2_and_tied_head_equals_autograd(loss, tmp_path):
    tiers, keep = PLANS["mixed_tiers"]
    got, want, grads, ref_grads, metrics = _engine(
        tiny_config("llama", tied=True), tiers, keep, tmp_path, _pair_batches(2), beta=0.2,
        loss=loss, chunk_tokens=6)  # 3 positions per chunk: 4 chunks of a 12-token row
    assert got == pytest.approx(want, rel=1e-5)
    _assert_close(grads, ref_grads)
    assert metrics["pairs"] == 2


@pytest.mark.parametrize("device", ["cpu-checked", "cpu-threaded"])
def test_dpo_gradient_under_the_ordering_checker_and_threads_equals_autograd(device, tmp_path):
    """The two-pass head under the happens-before checker and the threaded streams, with the
    plan's budgets enforced by the ledger."""
    tiers, keep = PLANS["mixed_tiers"]
    got, want, grads, ref_grads, _ = _engine(tiny_config("llama"), tiers, keep, tmp_path,
                                             _pair_batches(2), beta=0.3, loss="sigmoid",
                                             device=device, budgets=True, instrument=True)
    assert got == pytest.approx(want, rel=1e-5)
    _assert_close(grads, ref_grads)


def test_dpo_metrics_are_the_rewards_of_the_pairs(tmp_path):
    """rewards = beta * (pi - ref) per row, from an independent full forward."""
    tiers, keep = PLANS["all_hbm_segments_of_1"]
    batches = _pair_batches(1)
    ref_model, adapter = model_pair(tiny_config("llama"), seed=0)
    *_, metrics = _engine(tiny_config("llama"), tiers, keep, tmp_path, batches, beta=0.5,
                          loss="sigmoid")
    b = batches[0]
    with torch.no_grad():
        logits = ref_model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    targets = b["labels"][:, 1:]
    lp = logits[:, :-1].log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    rewards = 0.5 * ((lp * (targets != -100)).sum(1) - b["ref_logp"])
    assert metrics["rewards_chosen"] == pytest.approx(float(rewards[0]), rel=1e-4)
    assert metrics["rewards_rejected"] == pytest.approx(float(rewards[1]), rel=1e-4)
    assert metrics["margin"] == pytest.approx(float(rewards[0] - rewards[1]), rel=1e-4, abs=1e-5)
    assert metrics["accuracy"] == float(rewards[0] > rewards[1])
