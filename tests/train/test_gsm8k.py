"""A few steps on the real GSM8K train split (../shared) with a tiny model: the loss falls.

The data is the GSM8K folder (train.jsonl, test.jsonl) read through `datasets`, with the
training split sliced (`train[:400]`) and the held-out prompts from the test split."""

from __future__ import annotations

import json

import pytest

from tiny_models import tiny_model_dir
from lazytrain.config import load_config
from lazytrain.data.formats import load_examples
from lazytrain.train.loop import train

pytestmark = pytest.mark.slow


def test_training_on_shared_gsm8k_lowers_the_loss(shared_dir, tmp_path):
    path = shared_dir / "data" / "gsm8k" / "train.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} is absent (../shared/data/gsm8k not beside this checkout)")
    texts = [m.content for ex in load_examples(path)[:400] for m in ex.messages]
    model_dir = tiny_model_dir(tmp_path / "model", texts, layers=2)
    cfg = load_config(None, [f"model.config_path={model_dir}", f"train.run_dir={tmp_path / 'run'}",
                             f"data.path={path.parent}", "data.split=train[:400]",
                             "data.eval_split=test", "data.seq_len=192", "data.num_eval=2",
                             "train.micro_batch=4", "train.steps=8", "train.lr=5e-3",
                             "train.warmup_steps=1", "train.schedule=constant",
                             "planner.policy=megatrain", "planner.megatrain_k=1",
                             "runtime.device=cpu"])
    summary = train(cfg, progress=False)
    losses = [json.loads(ln)["loss"]
              for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["data"]["format"] == "gsm8k" and len(losses) == 8
    test_rows = [json.loads(ln) for ln in (path.parent / "test.jsonl").read_text().splitlines()]
    assert summary["eval_before"]["num_examples"] == 2
    assert [s["prompt"] for s in summary["eval_before"]["samples"]] == [
        r["question"] for r in test_rows[:2]]
    # Random init starts near ln(vocab) ~ 5.9; a few steps learn the unigram statistics.
    assert sum(losses[-2:]) / 2 < losses[0] - 0.5, losses
