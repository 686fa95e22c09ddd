"""The profile's host section and window overhead: profile -> `profile_costs` -> HardwareSpec
fields -> the planning problem's rates, against rates converted by hand."""

from __future__ import annotations

import json

import pytest

from lazytrain.planner.build import host_rates
from lazytrain.spec.costs import profile_costs, reference_host_rates
from lazytrain.spec.hardware import PRESETS
from lazytrain.spec.model import ModelSpec

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "vocab_size": 256}
HOST = {"master_dtype": "fp32", "convert_gb_per_s": 6.0, "accumulate_gb_per_s": 4.0,
        "accumulate_first_gb_per_s": 5.0, "staging_copy_gb_per_s": 7.0,
        "optimizer_ms_per_mparam": 1.5}


def _profile(tmp_path, model, *, compute_dtype: str = "fp32", **extra):
    d = {"version": 1, "seq_len": 8, "micro_batch": 2, "compute_dtype": compute_dtype,
         "model_config_sha256": model.config_sha256,
         "block_kinds": {"dense": {"fwd_ms": 1.0, "fwd_grad_ms": 1.5, "bwd_ms": 2.0}}} | extra
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(d))
    return path


def _costs(tmp_path, *, compute_dtype: str = "fp32", **extra):
    model = ModelSpec.from_hf_config(TINY)
    return profile_costs(model, _profile(tmp_path, model, compute_dtype=compute_dtype, **extra),
                         hw=PRESETS["cpu"], seq_len=8, micro_batch=2, compute_dtype=compute_dtype)


def test_measured_host_rates_land_in_the_hardware_spec_in_reference_dtypes(tmp_path):
    hw = _costs(tmp_path, host=HOST).hardware
    # fp32 master -> fp32 compute: (4 + 4) / 4 = 2 B of traffic per converted byte against the
    # reference 3, so 6 GB/s measured is 6 x 2 / 3 = 4 GB/s in the spec; accumulation
    # (4 + 2 x 4) / 4 = 3 B per gradient byte against 5: 4 x 3 / 5 = 2.4 GB/s
    assert hw.host_convert_bytes_per_s == pytest.approx(4.0e9)
    assert hw.host_accumulate_bytes_per_s == pytest.approx(2.4e9)


@pytest.mark.parametrize("master,compute", [("fp32", "fp32"), ("fp32", "bf16"),
                                            ("bf16", "bf16")])
def test_the_problem_gets_exactly_the_measured_host_rates(tmp_path, master, compute):
    hw = _costs(tmp_path, compute_dtype=compute, host=HOST | {"master_dtype": master}).hardware
    rates = host_rates(hw, master_dtype=master, compute_dtype=compute)
    assert rates["host_convert_bytes_per_s"] == pytest.approx(6.0e9)
    assert rates["host_accumulate_bytes_per_s"] == pytest.approx(4.0e9)


def test_fp32_to_bf16_is_the_reference_case_and_converts_one_to_one():
    assert reference_host_rates(6e9, 4e9, master_dtype="fp32", compute_dtype="bf16") == (
        pytest.approx(6e9), pytest.approx(4e9))


def test_a_profile_without_host_rates_keeps_the_preset_ones(tmp_path):
    hw = _costs(tmp_path).hardware
    assert hw.host_convert_bytes_per_s == PRESETS["cpu"].host_convert_bytes_per_s
    assert hw.host_accumulate_bytes_per_s == PRESETS["cpu"].host_accumulate_bytes_per_s


def test_a_host_section_without_its_master_dtype_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match="host.master_dtype"):
        _costs(tmp_path, host={"convert_gb_per_s": 6.0})


def test_window_overhead_and_step_const_are_read_from_the_profile(tmp_path):
    costs = _costs(tmp_path, window_overhead_ms=2.5, step_const_ms=7.0)
    assert costs.window_overhead_ms == 2.5 and costs.step_const_ms == 7.0
    assert _costs(tmp_path).window_overhead_ms == 0.0  # absent: not modelled
