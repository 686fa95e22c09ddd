"""Forward-only and decode plans against numbers computed by hand: the KV cache bytes of
full, sliding and linear-attention layers, the resident-vs-streamed choice at the budget's
edge, predicted tokens/s on a GPU-like and a CPU-like problem, the shortfall error, and the
JSON file's round trip and refusals."""

from __future__ import annotations

import json

import pytest

from lazytrain.planner.inference_plans import (InferencePlan, KvLayout, kv_layout,
                                               make_inference_plan, make_inference_plans)
from lazytrain.planner.plan_checks import PlanValidationError
from lazytrain.planner.problem import PlanningProblem
from lazytrain.spec.model import ModelSpec

L, P, H, V = 4, 1_000_000, 64, 100  # blocks; weight bytes per block; hidden; vocabulary
PARAMS = P // 4  # fp32: 4 bytes per parameter
TOKENS = 2 * 10  # training micro-batch 2 x seq 10


def _problem(*, hbm_bytes: int, overlap: bool = True) -> PlanningProblem:
    """Every block: forward 2 ms per 20 tokens, 1 MB of fp32 weights, 40,000 B saved
    internals; h2d 1 GB/s (1 ms per block load); ends 1,000 params; embed 0.5 ms, head 3 ms."""
    return PlanningProblem(
        fwd_ms=(2.0,) * L, fwd_grad_ms=(2.4,) * L, bwd_ms=(4.0,) * L, weight_bytes=(P,) * L,
        grad_bytes=(P,) * L, internal_bytes=(40_000,) * L, boundary_bytes=(5120,) * (L + 1),
        params_per_block=(PARAMS,) * L, ends_params=1000, embed_ms=0.5, head_ms=3.0,
        h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9, duplex_bytes_per_s=1.5e9,
        nvme_read_bytes_per_s=1e9, nvme_write_bytes_per_s=1e9, hbm_bytes=hbm_bytes,
        dram_bytes=10**12, tokens_per_micro_batch=TOKENS, copies_overlap_compute=overlap,
        provenance={"seq_len": 10, "micro_batch": 2, "model_config_sha256": "abc",
                    "dtype": "fp32"})


KV = KvLayout(kv_bytes_per_token=(2 * 2 * 16 * 4,) * L, windows=(0,) * L, state_bytes_per_row=0)


def _plan(kind: str, hbm_bytes: int, **kw) -> InferencePlan:
    return make_inference_plan(_problem(hbm_bytes=hbm_bytes, **kw.pop("problem", {})),
                               kind=kind, kv=KV, vocab_size=V, hidden_size=H, **kw)


def test_kv_cache_bytes_of_full_sliding_and_linear_layers_by_hand():
    hybrid = ModelSpec.from_hf_config(dict(
        model_type="qwen3_5_text", vocab_size=96, hidden_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=64,
        layer_types=["linear_attention", "full_attention"] * 2))
    kv = kv_layout(hybrid, {"num_key_value_heads": 2, "head_dim": 16}, dtype_bytes=2)
    # 2 full layers x 2 (k, v) x 2 kv heads x 16 dims x 2 B x (8 rows x 100 tokens)
    # + 8 rows x 2 linear layers x (4 heads x 16 x 16 recurrent state + conv inputs: channels
    # 2 x 2 x 16 (q, k) + 4 x 16 (v) = 128 x kernel 4) x 2 B
    assert kv.cache_bytes(batch=8, context_tokens=100) == (2 * 2 * 2 * 16 * 2 * 800
                                                          + 8 * 2 * (4 * 16 * 16 + 128 * 4) * 2)
    sliding = ModelSpec.from_hf_config(dict(
        model_type="mistral", vocab_size=96, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
        sliding_window=4, max_position_embeddings=64))
    kv = kv_layout(sliding, {"num_key_value_heads": 2, "head_dim": 16}, dtype_bytes=4)
    # a 4-token window keeps 4 of the 100 tokens per row: 2 layers x 2 x 2 x 16 x 4 B x 8 x 4
    assert kv.cache_bytes(batch=8, context_tokens=100) == 2 * 2 * 2 * 16 * 4 * 8 * 4


# activations of a forward pass of 2 x 10-token batches (fp32): the pass's hidden states
# (65,536 tokens) and one block output (20 tokens) x 64 x 4 B = 16,782,336; workspace 40,000
# (20 tokens, as trained); head chunk 8 x 20 x 100 = 16,000
FORWARD_ACT = (65_536 + 20) * 64 * 4 + 40_000 + 16_000
ENDS = 4_000  # 1,000 params x 4 B
STREAMED = 3 * P + ENDS + FORWARD_ACT  # a forward budget under resident's, over two slots'


def test_forward_plan_is_resident_exactly_when_everything_fits():
    need = 4 * P + ENDS + FORWARD_ACT
    fits = _plan("forward", need, batch=2)
    assert (fits.weights, fits.weight_bytes, fits.peak_hbm_bytes) == ("resident", 4 * P, need)
    one_short = _plan("forward", need - 1, batch=2)
    assert (one_short.weights, one_short.weight_bytes) == ("streamed", 2 * P)  # two slots


def test_predicted_tokens_per_s_by_hand():
    # resident: 0.5 embed + 4 x 2 ms + 3 / 3 head = 9.5 ms for 20 tokens
    assert _plan("forward", 10**9, batch=2).tokens_per_s == pytest.approx(20 * 1000 / 9.5)
    # streamed on a GPU: each block max(2 ms compute, 1 ms load) -> the same 9.5 ms
    gpu = _plan("forward", STREAMED, batch=2)
    assert gpu.weights == "streamed" and gpu.step_ms == pytest.approx(9.5)
    # streamed on a CPU: compute + load = 3 ms per block -> 0.5 + 12 + 1 = 13.5 ms
    cpu = _plan("forward", STREAMED, batch=2, problem={"overlap": False})
    assert cpu.step_ms == pytest.approx(13.5)
    # decode, 8 rows: compute scales by 8 / 20 tokens: 0.5 x 0.4 + 4 x 0.8 + 1 x 0.4 = 3.8 ms
    # resident; 8 tokens per step
    dec = _plan("decode", 10**9, batch=8, context_tokens=50)
    assert dec.step_ms == pytest.approx(3.8) and dec.tokens_per_s == pytest.approx(8000 / 3.8)
    # streamed on a GPU: each block max(0.8, 1.0 load) = 1 ms: 0.2 + 4 + 0.4 = 4.6 ms
    dec = _plan("decode", 4 * P, batch=8, context_tokens=50)  # 4 MB < 5.7 MB resident
    assert dec.weights == "streamed" and dec.step_ms == pytest.approx(4.6)


def test_the_engines_window_overhead_is_paid_once_per_block_call():
    # o = 0.25 ms per window: 4 blocks add 1 ms to the resident decode step's 3.8 ms
    problem = _problem(hbm_bytes=10**9).replace(window_overhead_ms=0.25)
    dec = make_inference_plan(problem, kind="decode", kv=KV, vocab_size=V, hidden_size=H,
                              batch=8, context_tokens=50)
    assert dec.step_ms == pytest.approx(4.8)


def test_a_decode_step_reads_every_blocks_weights_and_cache_from_hbm():
    # HBM 1 GB/s: a block reads its 1,000,000 B of weights and a quarter of the 409,600 B
    # cache (8 rows x 50 tokens x 4 layers x 256 B): 1.1024 ms, over its 0.8 ms of compute;
    # the head reads 100 x 64 x 4 = 25,600 B (0.0256 ms), under its 0.4 ms of compute:
    # 0.2 embed + 0.4 head + 4 x 1.1024 = 5.0096 ms per 8 tokens
    dec = _plan("decode", 10**9, batch=8, context_tokens=50, hbm_bytes_per_s=1e9)
    assert dec.step_ms == pytest.approx(5.0096)
    assert dec.tokens_per_s == pytest.approx(8000 / 5.0096)  # 1,597 tokens/s
    # streamed on a CPU the 1 ms load adds to each block: 5.0096 + 4 = 9.0096 ms
    cpu = _plan("decode", 4 * P, batch=8, context_tokens=50, hbm_bytes_per_s=1e9,
                problem={"overlap": False})
    assert cpu.weights == "streamed" and cpu.step_ms == pytest.approx(9.0096)
    # a forward pass of 2 x 10 tokens stays compute-bound (2 ms per block over the 1 ms
    # weight read; no cache): 9.5 ms for 20 tokens, 2,105 tokens/s against decode's 1,597
    fwd = _plan("forward", 10**9, batch=2, hbm_bytes_per_s=1e9)
    assert fwd.step_ms == pytest.approx(9.5)


def test_decode_plan_counts_the_kv_cache_in_the_budget():
    dec = _plan("decode", 10**9, batch=8, context_tokens=50)
    assert dec.cache_bytes == L * 2 * 2 * 16 * 4 * 8 * 50  # 409,600
    # prefill of 8 x 50 = 400 tokens: boundaries 2 x 400 x 64 x 4, workspace 2,000 x 400,
    # head chunk 8 x 400 x 100
    act = 2 * 400 * 64 * 4 + 2_000 * 400 + 8 * 400 * 100
    assert dec.activation_bytes == act
    assert dec.peak_hbm_bytes == 4 * P + ENDS + act + 409_600


def test_a_budget_too_small_even_streamed_names_the_shortfall_and_the_fix():
    with pytest.raises(PlanValidationError, match=r"over the HBM budget.*hardware\.hbm_gb"):
        _plan("decode", 2 * P, batch=8, context_tokens=50)


def test_plans_round_trip_through_their_files_and_bad_files_are_refused(tmp_path):
    spec = ModelSpec.from_hf_config(dict(
        model_type="llama", vocab_size=V, hidden_size=H, num_hidden_layers=L,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        max_position_embeddings=64))
    plans = make_inference_plans(_problem(hbm_bytes=10**9), model=spec,
                                 hf_config={"num_key_value_heads": 2})
    for kind, name in (("forward", "forward_plan.json"), ("decode", "decode_plan.json")):
        plans[kind].save(tmp_path / name)
        assert InferencePlan.load(tmp_path / name) == plans[kind]
        assert plans[kind].summary_line().startswith(f"{kind} plan: weights resident in HBM")
    raw = json.loads((tmp_path / "decode_plan.json").read_text())
    (tmp_path / "bad.json").write_text(json.dumps({**raw, "surprise": 1}))
    with pytest.raises(PlanValidationError, match="surprise"):
        InferencePlan.load(tmp_path / "bad.json")
    (tmp_path / "bad.json").write_text(json.dumps({**raw, "kind": "forward"}))
    with pytest.raises(PlanValidationError, match="forward plan: cache_bytes"):
        InferencePlan.load(tmp_path / "bad.json")


def test_rows_asked_halve_until_both_plans_fit_down_to_eval_rows():
    # a GRPO run asks for its 64 rollouts per step; the budget below holds both plans of 16
    # rows with streamed weights, not of 32, so 64 -> 32 -> 16
    from lazytrain.planner.inference_plans import EVAL_ROWS
    spec = ModelSpec.from_hf_config(dict(
        model_type="llama", vocab_size=V, hidden_size=H, num_hidden_layers=L,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        max_position_embeddings=64))
    kv = kv_layout(spec, {"num_key_value_heads": 2}, dtype_bytes=4)

    def peak(kind, batch):  # streamed: two blocks' weights (2 P) instead of all four
        plan = make_inference_plan(_problem(hbm_bytes=10**12), kind=kind, kv=kv,
                                   vocab_size=V, hidden_size=H, batch=batch)
        return plan.peak_hbm_bytes - L * P + 2 * P
    budget = max(peak("forward", 16), peak("decode", 16))
    assert max(peak("forward", 32), peak("decode", 32)) > budget
    plans = make_inference_plans(_problem(hbm_bytes=budget), model=spec,
                                 hf_config={"num_key_value_heads": 2}, batch=64)
    assert {p.batch for p in plans.values()} == {16}
    assert plans["forward"].weights == "streamed"  # the forward plan binds
    wide = make_inference_plans(_problem(hbm_bytes=10**12), model=spec,
                                hf_config={"num_key_value_heads": 2}, batch=64)
    assert {p.batch for p in wide.values()} == {64}
    with pytest.raises(PlanValidationError, match="over the HBM budget"):
        make_inference_plans(_problem(hbm_bytes=peak("forward", EVAL_ROWS) - 1), model=spec,
                             hf_config={"num_key_value_heads": 2}, batch=64)
