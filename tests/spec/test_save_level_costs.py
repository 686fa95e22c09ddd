"""Save-level costs per block: a profile's measured S1 / S2 / Fr1 are used as given (Fr1 capped
at the kind's Fr), and without them the analytic bytes and Fg x the L1 share."""

from __future__ import annotations

import json

import pytest

from lazytrain.config import load_config
from lazytrain.profile.calibrate import costed_problem
from lazytrain.spec.costs import profile_costs
from lazytrain.spec.hardware import PRESETS
from lazytrain.spec.model import ModelSpec

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 256}


def _costs(tmp_path, **dense):
    model = ModelSpec.from_hf_config(TINY)
    prof = {"version": 1, "seq_len": 8, "micro_batch": 2, "compute_dtype": "fp32",
            "block_kinds": {"dense": {"fwd_ms": 1.0, "fwd_grad_ms": 1.5, "reforward_ms": 1.2,
                                      "bwd_ms": 2.0, **dense}}}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(prof))
    return model, profile_costs(model, path, hw=PRESETS["cpu"], seq_len=8, micro_batch=2,
                                compute_dtype="fp32")


def test_measured_save_level_entries_are_used_as_given(tmp_path):
    _model, costs = _costs(tmp_path, saved_l1_bytes=1000, saved_l2_bytes=3000,
                           reforward_l1_ms=0.7)
    assert [(c.saved_bytes, c.reforward_l1_ms) for c in costs.blocks] == [((1000, 3000), 0.7)] * 2


def test_a_measured_fr1_above_the_measured_fr_is_capped_at_fr(tmp_path):
    _model, costs = _costs(tmp_path, saved_l1_bytes=1000, saved_l2_bytes=3000,
                           reforward_l1_ms=1.3)
    assert costs.blocks[0].reforward_l1_ms == 1.2


def test_without_measurements_the_analytic_bytes_and_share_are_used(tmp_path):
    model, costs = _costs(tmp_path)
    blk = model.blocks[0]
    assert costs.blocks[0].saved_bytes == blk.saved_level_bytes(micro_batch=2, seq_len=8,
                                                                dtype_bytes=4)
    assert costs.blocks[0].reforward_l1_ms == pytest.approx(1.5 * blk.reforward_l1_share(8))


def test_the_costed_problem_takes_a_profiles_measured_save_levels(tmp_path):
    base = load_config(None)
    model = ModelSpec.from_hf_config(base.model.config_path)
    kind = model.blocks[0].kind
    prof = {"version": 1, "seq_len": base.data.seq_len, "micro_batch": base.train.micro_batch,
            "compute_dtype": base.train.compute_dtype,
            "model_config_sha256": model.config_sha256,
            "block_kinds": {kind: {"fwd_ms": 1.0, "fwd_grad_ms": 1.5, "reforward_ms": 1.2,
                                   "bwd_ms": 2.0, "saved_l1_bytes": 1000,
                                   "saved_l2_bytes": 3000, "reforward_l1_ms": 0.7}}}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(prof))
    cfg = load_config(None, [f"hardware.profile_path={path}"])
    p = costed_problem(cfg)
    assert p.saved_bytes == ((1000, 3000),) * p.num_blocks
    assert p.reforward_l1_ms == (0.7,) * p.num_blocks
