"""The GRPO gradient of the streaming engine equals plain PyTorch autograd on the same formula.

Reference: an independent copy of the tiny HF model (copied state_dict): full forward, [B, S, V]
logits, log-softmax, gather of the targets, the clipped ratio with given old log-probs and
advantages written out here, the prompt and padding masked, the mean over the step's completion
tokens, autograd. The engine instead runs `GRPOObjective` chunk by chunk in the head
(`runtime.ends.objective_loss_chunks`), over every plan kind of the engine's gradient matrix.
The old log-probs are the reference model's own log-probs moved by up to +-0.5 nats, so the
clip binds on some tokens (of both signs of advantage) and not on others.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from engine_helpers import (PLAN_KINDS, micro_batches, model_pair, plan_for,  # noqa: E402
                            tiny_config)

from lazytrain.runtime.build import make_engine  # noqa: E402
from lazytrain.train.grpo_loss import GRPOObjective  # noqa: E402

PLANS = {k: PLAN_KINDS[k] for k in ("all_hbm_segments_of_1", "all_nvme", "mixed_tiers",
                                    "segments_of_3_and_1", "one_segment_of_4_reembedded",
                                    "keep_after_recomputed_segment")}
EPS = 0.2


def _target_logp(model, b):
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                   use_cache=False).logits.float()
    targets = b["labels"][:, 1:]
    lp = logits[:, :-1].log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    return lp, targets != -100


def _rollout_batches(ref_model, n_micro: int, *, kl: bool) -> list[dict]:
    """micro_batches with advantages of both signs, old log-probs near the model's own
    (aligned with the shifted targets, 0 off them) and, with `kl`, reference log-probs."""
    g = torch.Generator().manual_seed(11)
    out = []
    for b in micro_batches(n_micro, seed=3):
        with torch.no_grad():
            lp, mask = _target_logp(ref_model, b)
        rows, seq = b["input_ids"].shape
        shifted = lambda t: torch.cat([t, torch.zeros(rows, 1)], dim=1) * \
            torch.cat([mask, torch.zeros(rows, 1, dtype=torch.bool)], dim=1)  # noqa: E731
        b["advantages"] = torch.tensor([1.3, -0.7])[:rows]
        b["old_logp"] = shifted(lp + (torch.rand(lp.shape, generator=g) - 0.5))
        if kl:
            b["ref_logp"] = shifted(lp + (torch.rand(lp.shape, generator=g) - 0.5) * 0.4)
        out.append(b)
    return out


def _reference(ref_model, batches, *, kl_coef: float):
    """Plain autograd of the module docstring's formula."""
    tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    ref_model.zero_grad(set_to_none=True)
    total, clipped = 0.0, 0
    for b in batches:
        lp, mask = _target_logp(ref_model, b)
        ratio = torch.exp(lp - b["old_logp"][:, :-1])
        adv = b["advantages"][:, None]
        surrogate = torch.min(ratio * adv, ratio.clamp(1 - EPS, 1 + EPS) * adv)
        per_token = -surrogate
        if kl_coef:
            d = b["ref_logp"][:, :-1] - lp
            per_token = per_token + kl_coef * (torch.exp(d) - d - 1)
        loss = (per_token * mask).sum() / tokens
        loss.backward()
        total += float(loss.detach())
        outside = ((ratio > 1 + EPS) & (adv > 0)) | ((ratio < 1 - EPS) & (adv < 0))
        clipped += int((outside & mask).sum())
    return total, {n: p.grad for n, p in ref_model.named_parameters()}, clipped / tokens


def _run(config, tiers, keep, tmp_path, *, n_micro=1, kl_coef=0.0, chunk_tokens=8):
    ref_model, adapter = model_pair(config, seed=0)
    batches = _rollout_batches(ref_model, n_micro, kl=kl_coef > 0)
    plan = plan_for(adapter, tiers, keep, grad_accum=n_micro)
    engine = make_engine(adapter, plan, device="cpu", nvme_dir=tmp_path / "nvme",
                         grad_accum=n_micro, head_chunk_tokens=chunk_tokens)
    engine.ends.objective = GRPOObjective(clip_eps=EPS, kl_coef=kl_coef)
    try:
        got = engine.compute_gradients(batches)
        grads = {k: v.clone() for k, v in engine.gradients().items()}
        metrics = engine.ends.objective.take_metrics()
    finally:
        engine.close()
    want, ref_grads, clip_fraction = _reference(ref_model, batches, kl_coef=kl_coef)
    return got, want, grads, ref_grads, metrics, clip_fraction


def _assert_close(grads, ref_grads):
    assert set(grads) == set(ref_grads)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    assert scale > 0
    for name, ref in ref_grads.items():
        assert ref is not None, name
        diff = float((grads[name] - ref).abs().max())
        assert diff <= 2e-5 * scale, f"{name}: max abs diff {diff:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("plan_kind", list(PLANS))
def test_grpo_gradient_equals_autograd_for_plan(plan_kind, tmp_path):
    tiers, keep = PLANS[plan_kind]
    got, want, grads, ref_grads, metrics, clip_fraction = _run(tiny_config("llama"), tiers,
                                                               keep, tmp_path)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-7)
    _assert_close(grads, ref_grads)
    assert 0 < clip_fraction < 1  # the clip binds on some tokens only: both branches tested
    assert metrics["clip_fraction"] == pytest.approx(clip_fraction)


def test_grpo_gradient_with_kl_grad_accum_2_and_tied_head_equals_autograd(tmp_path):
    tiers, keep = PLANS["mixed_tiers"]
    got, want, grads, ref_grads, metrics, _ = _run(
        tiny_config("llama", tied=True), tiers, keep, tmp_path, n_micro=2, kl_coef=0.3,
        chunk_tokens=6)  # 3 positions per chunk: 4 chunks of a 12-token row
    assert got == pytest.approx(want, rel=1e-5, abs=1e-7)
    _assert_close(grads, ref_grads)
    assert metrics["kl"] > 0
