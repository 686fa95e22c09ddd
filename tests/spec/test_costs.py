"""Analytic block costs, the profile path, and the one-time h800-paper calibration."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lazytrain.spec.costs import (FWD_GRAD_FACTOR, analytic_costs, calibrate_matmul_efficiency,
                                  megatrain_step_ms, megatrain_windows, profile_costs)
from lazytrain.spec.hardware import H800_PAPER_MATMUL_EFFICIENCY, PRESETS
from lazytrain.spec.model import ModelSpec

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "vocab_size": 256}


@pytest.fixture(scope="module")
def seed_model(shared_dir):
    return ModelSpec.from_hf_config(shared_dir / "models" / "qwen3.5-27b.json")


def _seed_costs(model, hw):
    return analytic_costs(model, hw, seq_len=1024, micro_batch=72, compute_dtype="bf16")


def test_dense_block_costs_by_hand():
    model = ModelSpec.from_hf_config(TINY)
    hw = dataclasses.replace(PRESETS["cpu"], peak_flops=1e9, matmul_efficiency=1.0)
    c = analytic_costs(model, hw, seq_len=8, micro_batch=2, compute_dtype="fp32").blocks[0]
    # params: q 64*64 + k,v 2*64*32 + o 64*64 + mlp 3*64*128 + norms 2*64 = 36,992
    assert model.blocks[0].params == 4096 + 4096 + 4096 + 24576 + 128
    # fwd per token: 2*36992 + attention core 2*4*(16+16)*(8+1)/2 = 73984 + 1152; x 16 tokens
    assert c.fwd_flops == pytest.approx(16 * (73984 + 1152))
    assert c.fwd_ms == pytest.approx(16 * 75136 / 1e9 * 1e3)  # at 1 GFLOP/s
    assert c.bwd_flops == pytest.approx(16 * (2 * 73984 + 2.5 * 1152))
    assert c.fwd_grad_ms == pytest.approx(FWD_GRAD_FACTOR * c.fwd_ms)
    assert c.weight_bytes == c.grad_bytes == 36992 * 4
    assert c.boundary_bytes == 2 * 8 * 64 * 4


def test_seed_boundary_is_micro_batch_x_seq_x_hidden_bf16(seed_model):
    costs = _seed_costs(seed_model, PRESETS["h800-paper"])
    assert costs.boundary_bytes == (72 * 1024 * 5120 * 2,) * 65


def test_h800_paper_efficiency_is_the_megatrain_calibration(seed_model):
    eff = calibrate_matmul_efficiency(seed_model, PRESETS["h800-paper"], seq_len=1024,
                                      micro_batch=72, compute_dtype="bf16",
                                      target_model_tflops=176.9, k=4)
    assert H800_PAPER_MATMUL_EFFICIENCY == pytest.approx(eff, abs=5e-5)


def test_megatrain_rule_predicts_176_9_model_tflops_on_the_seed_scenario(seed_model):
    costs = _seed_costs(seed_model, PRESETS["h800-paper"])
    tflops = seed_model.model_flops_per_token * costs.tokens / megatrain_step_ms(costs) / 1e9
    assert tflops == pytest.approx(176.9, abs=0.1)


def test_seed_scenario_is_compute_bound_in_every_window_under_the_megatrain_rule(seed_model):
    windows = megatrain_windows(_seed_costs(seed_model, PRESETS["h800-paper"]), k=4)
    assert len(windows) == 2 * 64 + 1
    assert all(link <= comp for _, comp, link in windows), [
        w for w, comp, link in windows if link > comp]


def test_model_flops_use_all_params_including_embeddings(seed_model):
    # The paper's 219.95 TFLOPS at 1,361 tokens/s imply N = 26.93e9 = the total incl. embeddings.
    implied_n = 219.95e12 / (6 * 1361)
    assert seed_model.model_flops_params == seed_model.total_params
    assert seed_model.model_flops_params == pytest.approx(implied_n, rel=0.002)


def _profile(tmp_path, model, **extra):
    d = {"version": 1, "seq_len": 8, "micro_batch": 2, "compute_dtype": "fp32",
         "model_config_sha256": model.config_sha256,
         "block_kinds": {"dense": {"fwd_ms": 1.0, "fwd_grad_ms": 1.5, "bwd_ms": 2.0,
                                   "internal_bytes": 1234}},
         "ends": {"head_ms": 3.0}, "bandwidths": {"h2d_gb_per_s": 7.5}} | extra
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(d))
    return path


def test_profile_times_expand_to_every_block_of_the_kind(tmp_path):
    model = ModelSpec.from_hf_config(TINY)
    costs = profile_costs(model, _profile(tmp_path, model), hw=PRESETS["cpu"], seq_len=8,
                          micro_batch=2, compute_dtype="fp32")
    assert [(c.fwd_ms, c.fwd_grad_ms, c.bwd_ms, c.internal_bytes) for c in costs.blocks] == [
        (1.0, 1.5, 2.0, 1234)] * 2
    assert costs.head_ms == 3.0 and costs.hardware.h2d_bytes_per_s == 7.5e9
    assert costs.source.startswith("profile:")


def test_profile_reforward_is_the_measured_one_else_fg_less_the_analytic_tail(tmp_path):
    model = ModelSpec.from_hf_config(TINY)
    share = model.blocks[0].reforward_skip_share(8)
    assert 0 < share < 1
    costs = profile_costs(model, _profile(tmp_path, model), hw=PRESETS["cpu"], seq_len=8,
                          micro_batch=2, compute_dtype="fp32")
    assert costs.blocks[0].reforward_ms == pytest.approx(1.5 * (1 - share))  # Fg 1.5 ms
    prof = _profile(tmp_path, model, block_kinds={"dense": {
        "fwd_ms": 1.0, "fwd_grad_ms": 1.5, "reforward_ms": 1.2, "bwd_ms": 2.0}})
    costs = profile_costs(model, prof, hw=PRESETS["cpu"], seq_len=8, micro_batch=2,
                          compute_dtype="fp32")
    assert [c.reforward_ms for c in costs.blocks] == [1.2, 1.2]


def test_profile_for_another_seq_len_is_refused(tmp_path):
    model = ModelSpec.from_hf_config(TINY)
    with pytest.raises(ValueError, match="seq_len=8.*uses 16"):
        profile_costs(model, _profile(tmp_path, model), hw=PRESETS["cpu"], seq_len=16,
                      micro_batch=2, compute_dtype="fp32")


def test_profile_missing_a_block_kind_names_it(tmp_path):
    model = ModelSpec.from_hf_config(TINY)
    path = _profile(tmp_path, model, block_kinds={"moe": {"fwd_ms": 1, "fwd_grad_ms": 1,
                                                          "bwd_ms": 1}})
    with pytest.raises(ValueError, match="block kind 'dense'"):
        profile_costs(model, path, hw=PRESETS["cpu"], seq_len=8, micro_batch=2,
                      compute_dtype="fp32")
