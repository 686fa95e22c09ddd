"""A data-parallel evaluation is shared across ranks and equals one process's: two ranks each
evaluate half of the held-out set through their own StreamedLM and combine the sums; the
summary's evaluations before training (the same initial weights) equal a one-process run's."""

from __future__ import annotations

import json

import pytest

from dist_helpers import launch, run_overrides
from lazytrain.config import load_config
from lazytrain.train.loop import train

pytestmark = pytest.mark.slow


def test_two_ranks_share_the_evaluation_and_equal_one_process(dp_model_dir, tmp_path):
    extra = ("train.steps=1", "data.num_eval=5")  # 5 problems: shares of 2 and 3
    run = tmp_path / "dp"
    assert launch(run_overrides(dp_model_dir, run, *extra), error_dir=str(tmp_path)) == [0, 0]
    one = tmp_path / "one"
    train(load_config(None, run_overrides(dp_model_dir, one, *extra)), progress=False)
    got = json.loads((run / "summary.json").read_text())["eval_before"]
    want = json.loads((one / "summary.json").read_text())["eval_before"]
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    assert (got["num_examples"], got["num_scored"], got["num_correct"], got["loss_tokens"]) == (
        want["num_examples"], want["num_scored"], want["num_correct"], want["loss_tokens"])
    assert got["samples"] == want["samples"][:len(got["samples"])]  # rank 0's: the first ones
