"""data.seq_len past the model's max_position_embeddings is refused in one line before planning
(its calibration timed blocks at that length: seq_len 100000 on the 256-position tiny config
calibrated for minutes, and could exhaust host memory on attention scores)."""

from __future__ import annotations

import json

import pytest

from lazytrain.train import checks, setup


def test_seq_len_past_the_model_s_positions_is_refused_before_planning(arithmetic_model_dir,
                                                                      tmp_path, monkeypatch):
    from lazytrain.train.loop import train
    from train_helpers import tiny_config

    limit = json.loads((arithmetic_model_dir / "config.json").read_text())[
        "max_position_embeddings"]

    def no_planning(*args, **kwargs):
        raise AssertionError("planned (and calibrated) before refusing")

    monkeypatch.setattr(setup, "make_plan", no_planning)
    with pytest.raises(ValueError, match=rf"data.seq_len: {limit + 1} is more than the model's "
                                         rf"max_position_embeddings {limit}") as info:
        train(tiny_config(arithmetic_model_dir, tmp_path / "run", f"data.seq_len={limit + 1}"),
              progress=False, log=lambda line: None)
    assert "\n" not in str(info.value)


def test_a_multimodal_config_is_checked_on_its_text_config():
    checks.check_seq_len(4096, {"text_config": {"max_position_embeddings": 4096}})
    with pytest.raises(ValueError, match="max_position_embeddings 4096"):
        checks.check_seq_len(4097, {"text_config": {"max_position_embeddings": 4096},
                                   "max_position_embeddings": 10**6})
