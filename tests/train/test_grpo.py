"""GRPO's parts by hand (advantages, a rollout row's masks and alignment, the config rules) and a
2-step GRPO run on a tiny model end to end."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lazytrain.config import load_config
from lazytrain.train.grpo import _row, check_grpo_config
from lazytrain.train.grpo_loss import group_advantages
from lazytrain.train.loop import train
from train_helpers import tiny_config


def test_group_advantages_by_hand():
    # group 1: rewards 1, 0, 0, 1 -> mean 0.5, sample std sqrt(4 * 0.25 / 3) = 0.57735
    # group 2: all 1 -> every advantage 0 (no division by zero)
    adv = group_advantages(torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1]), n=4, eps=1e-4)
    s = math.sqrt(1 / 3) + 1e-4
    assert adv.tolist() == pytest.approx([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0, 0, 0, 0])
    centred = group_advantages(torch.tensor([3.0, 1.0]), n=2, eps=1e-4, scale_by_std=False)
    assert centred.tolist() == [1.0, -1.0]


def test_group_advantages_refuse_a_partial_group():
    with pytest.raises(ValueError, match="grpo.n"):
        group_advantages(torch.ones(5), n=2, eps=1e-4)


def test_a_rollout_row_trains_the_completion_only_with_old_logprobs_aligned():
    # prompt 10 11 12, completion 20 21; seq_len 8 -> pad 0 0 0
    old = torch.tensor([-1.0, -2.0, -3.0, -4.0])  # log p(x_t | x_<t), t = 1..4
    row = _row([10, 11, 12, 20, 21], 3, seq_len=8, pad_id=0, old=old, ref=old * 2)
    assert row["input_ids"].tolist() == [10, 11, 12, 20, 21, 0, 0, 0]
    assert row["labels"].tolist() == [-100, -100, -100, 20, 21, -100, -100, -100]
    assert row["attention_mask"].tolist() == [1, 1, 1, 1, 1, 0, 0, 0]
    # shifted position t predicts token t+1: positions 2 (-> 20) and 3 (-> 21) only
    assert row["old_logp"].tolist() == [0, 0, -3.0, -4.0, 0, 0, 0, 0]
    assert row["ref_logp"].tolist() == [0, 0, -6.0, -8.0, 0, 0, 0, 0]


def test_rollouts_per_step_must_fill_the_micro_batches():
    cfg = load_config(None, ["train.method=grpo", "grpo.prompts_per_step=3", "grpo.n=2",
                             "train.micro_batch=4"])
    with pytest.raises(ValueError, match="train.micro_batch x train.grad_accum"):
        check_grpo_config(cfg)


@pytest.mark.parametrize("kl_coef", [0.0, 0.1], ids=["no_kl", "kl"])
def test_two_grpo_steps_on_a_tiny_model_write_metrics(arithmetic_model_dir, tmp_path, tiny_plan,
                                                      kl_coef, monkeypatch, capsys):
    # a random tiny model never answers right: a length reward gives the group a spread
    (tmp_path / "grpo_test_rewards.py").write_text(
        "def length(completion, *, prompt, answer):\n    return len(completion) / 10\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = tiny_config(arithmetic_model_dir, tmp_path / "run", "train.method=grpo",
                      "train.steps=2", "grpo.prompts_per_step=1", "grpo.n=2",
                      "grpo.max_new_tokens=6", "grpo.rewards=[exact_match, grpo_test_rewards:length]",
                      f"grpo.kl_coef={kl_coef}", "grpo.updates_per_rollout=2",
                      "data.num_eval=0")
    logs: list[str] = []
    summary = train(cfg, plan=tiny_plan, progress=False, log=logs.append)
    assert summary["steps_completed"] == 2
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        for key in ("reward_mean", "reward_std", "rollout_exact_match", "clip_fraction", "kl",
                    "completion_tokens"):
            assert math.isfinite(r[f"grpo/{key}"]), key
        assert math.isfinite(r["loss"])
    # two updates over one rollout batch: the same rollouts, so the same rewards
    assert records[0]["grpo/reward_mean"] == records[1]["grpo/reward_mean"]
    # step 1 trains the initial weights, which are the reference: KL 0; step 2 has moved
    assert records[0]["grpo/kl"] == pytest.approx(0.0, abs=1e-6)
    assert (records[1]["grpo/kl"] > 0) == (kl_coef > 0)
    assert any(line.startswith("grpo: 1 prompts x 2 rollouts") for line in logs)
    out = capsys.readouterr().out.splitlines()  # the start-up summary: one line per phase
    assert sum(line.startswith("grpo generation: 2 rollouts") for line in out) == 1
    assert sum(line.startswith("grpo training: 2 rows per step") for line in out) == 1


@pytest.mark.parametrize("bad", [["grpo.prompts_per_step=3"], ["grpo.rewards=[exact]"]],
                         ids=["rows_do_not_fill_the_batch", "unknown_reward"])
def test_a_bad_grpo_config_is_refused_before_a_file_is_written(arithmetic_model_dir, tmp_path,
                                                                tiny_plan, bad):
    cfg = tiny_config(arithmetic_model_dir, tmp_path / "run", "train.method=grpo",
                      "grpo.prompts_per_step=1", "grpo.n=2", *bad)
    with pytest.raises(ValueError, match="grpo"):
        train(cfg, plan=tiny_plan, progress=False, log=lambda msg: None)
    assert not (tmp_path / "run" / "config.yaml").exists()
    assert not (tmp_path / "run" / "plan.json").exists()
