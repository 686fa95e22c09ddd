"""The truncated re-forward: b{j} charges B[j] + Fr[j] (not Fg[j]) unless block j is kept, while
a segment's recompute of its earlier blocks stays F in full; the MILP, the evaluator and the
simulator agree on it; the skipped share s comes from the model's shapes."""

from __future__ import annotations

import pytest

from lazytrain.planner.evaluate import build_plan, decisions_from_tiers, evaluate
from lazytrain.planner.plan import SolveRecord
from lazytrain.sim import disagreements, simulate
from lazytrain.spec.model import ModelSpec
from test_milp import U, small_problem
from test_milp_prices_plans import ROOMY, _assert_milp_prices_like_the_evaluator

R, H, D = "recompute", "hbm", "dram"


def _serial_problem(**kw):
    """Three blocks on a CPU (window = compute + channel times) with no transfers costing
    anything measurable: one block's bytes are 1, the links 1e15 B/s."""
    return small_problem(L=3, copies_overlap_compute=False, weight_bytes=(1,) * 3,
                         grad_bytes=(1,) * 3, boundary_bytes=(1,) * 4, h2d_bytes_per_s=1e15,
                         d2h_bytes_per_s=1e15, duplex_bytes_per_s=1e15,
                         nvme_read_bytes_per_s=1e15, nvme_write_bytes_per_s=1e15,
                         reforward_ms=(3.0, 4.0, 5.0), **ROOMY, **kw)


def test_b_window_charges_the_truncated_reforward_and_the_full_segment_recompute():
    # small_problem(L=3): F = (8, 11, 14), Fg = F + 2, B = 2 F; Fr given as (3, 4, 5).
    # tiers R R H H: one segment (0, 2) ending at block 1 (recompute of block 0: F[0] = 8 in
    # full, plus the re-embedding 1.0), block 2 alone. b1 = B[1] + Fr[1] + F[0] + embed
    # = 22 + 4 + 8 + 1 = 35; b0 = B[0] + Fr[0] = 16 + 3 = 19; b2 = 28 + 5 = 33.
    p = _serial_problem()
    ev = evaluate(p, decisions_from_tiers(p, (R, R, H, H)))
    comp = {w.name: w.compute_ms for w in ev.windows}
    assert comp["b0"] == pytest.approx(19.0)
    assert comp["b1"] == pytest.approx(35.0)
    assert comp["b2"] == pytest.approx(33.0)
    # kept block 2: Fg[2] = 16 in f2, no re-forward in b2 (28)
    kept = evaluate(p, decisions_from_tiers(p, (R, R, H, H), keep_internals=(2,)))
    comp = {w.name: w.compute_ms for w in kept.windows}
    assert (comp["f2"], comp["b2"]) == (pytest.approx(16.0), pytest.approx(28.0))


def test_a_problem_without_reforward_ms_charges_fg_as_before():
    p = small_problem(L=3, **ROOMY)
    comp = {w.name: w.compute_ms for w in evaluate(p, decisions_from_tiers(p, (H,) * 4)).windows}
    assert comp["b2"] == pytest.approx(28.0 + 16.0)  # B[2] + Fg[2]


def test_reforward_ms_of_the_wrong_length_names_the_field():
    with pytest.raises(ValueError, match="reforward_ms must have 3 entries"):
        small_problem(L=3, reforward_ms=(1.0, 2.0))


@pytest.mark.parametrize("gpu", [True, False], ids=["overlap", "serial"])
@pytest.mark.parametrize("tiers, keep", [((R, D, H, R, H, H, H), ()),
                                         ((R, R, R, D, H, H, H), (3, 4)),
                                         ((H, R, H, R, D, H, H), (5,))])
def test_milp_and_simulator_price_the_truncated_reforward_as_the_evaluator(tiers, keep, gpu):
    """A duplex cap of h2d + d2h: no link sharing, which the fluid model does not price."""
    pytest.importorskip("highspy")
    p = small_problem(L=6, copies_overlap_compute=gpu, duplex_bytes_per_s=2e4 * U,
                      reforward_ms=tuple(0.5 + 0.7 * j for j in range(6)), **ROOMY)
    decisions = decisions_from_tiers(p, tiers, keep)
    assert _assert_milp_prices_like_the_evaluator(p, decisions)
    plan = build_plan(p, decisions, solver=SolveRecord(backend="manual"))
    assert simulate(p, plan).step_ms == pytest.approx(evaluate(p, plan).step_ms, rel=1e-9)
    assert disagreements(p, plan) == []
    # and truncation matters here: the same plan with a full re-forward is slower
    full = p.replace(reforward_ms=())
    assert evaluate(full, decisions).step_ms > evaluate(p, decisions).step_ms


COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
              num_hidden_layers=2, max_position_embeddings=64)
"""Head width 64 / 4 = 16: q and o are 64 x 64, k and v 64 x 32 (GQA, 2 KV heads)."""
ATTN = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64  # 12288 parameters
CORE_64 = 2 * 4 * (16 + 16) * (64 + 1) / 2  # causal attention core at seq 64: 8320 FLOPs/token


def test_skip_share_of_a_tiny_llama_by_hand():
    spec = ModelSpec.from_hf_config(dict(COMMON, model_type="llama", intermediate_size=96))
    # active = attention 12288 + MLP 3 * 64 * 96 = 18432 + 2 norms 128 = 30848; the tail is
    # the down projection 96 x 64 = 6144: s = 2 * 6144 / (2 * 30848 + 8320)
    assert spec.blocks[0].reforward_skip_share(64) == pytest.approx(12288 / 70016)


def test_skip_share_of_a_tiny_moe_by_hand():
    spec = ModelSpec.from_hf_config(dict(COMMON, model_type="mixtral", intermediate_size=48,
                                         num_local_experts=4, num_experts_per_tok=2))
    # active = attention 12288 + router 4 * 64 + top-2 experts 2 * 3 * 64 * 48 = 18432
    # + norms 128 = 31104; tail = the 2 experts' down projections 2 * 48 * 64 = 6144
    assert spec.blocks[0].reforward_skip_share(64) == pytest.approx(12288 / (2 * 31104 + CORE_64))


def test_gemma_keeps_the_full_reforward():
    spec = ModelSpec.from_hf_config(dict(COMMON, model_type="gemma2", intermediate_size=96,
                                         head_dim=16, sliding_window=8))
    assert spec.blocks[0].reforward_skip_share(64) == 0.0
