"""GRPO runs end to end on the tiny model at the edges of the training phase: every group flat
(nothing trained: loss and gradient 0, nothing NaN), a KL term (nothing skipped), and a run
stopped and resumed mid-way against an uninterrupted one (bit for bit)."""

from __future__ import annotations

import json
import math
import os
import signal

import pytest
import torch

from lazytrain.train.loop import TrainHooks, train
from train_helpers import tiny_config

REWARD = "def length(completion, *, prompt, answer):\n    return len(completion) / 10\n"


def _records(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _grpo(model_dir, run_dir, *extra):
    return tiny_config(model_dir, run_dir, "train.method=grpo", "grpo.prompts_per_step=2",
                       "grpo.n=2", "train.grad_accum=2", "grpo.max_new_tokens=6",
                       "data.num_eval=0", *extra)


@pytest.mark.parametrize("kl_coef", [0.0, 0.1], ids=["no_kl", "kl"])
def test_every_group_flat(arithmetic_model_dir, tiny_plan, tmp_path, kl_coef):
    # a random tiny model never answers right: exact_match is 0 for every rollout, every group
    # is flat. Without a KL term every rollout is left out (fillers only): loss and gradient 0;
    # with one, every rollout is trained (its KL term) and nothing is NaN
    cfg = _grpo(arithmetic_model_dir, tmp_path / "run", "train.steps=2",
                f"grpo.kl_coef={kl_coef}")
    summary = train(cfg, plan=tiny_plan, progress=False, log=lambda msg: None)
    assert summary["steps_completed"] == 2
    records = _records(tmp_path / "run")
    for r in records:
        assert r["grpo/reward_std"] == 0.0
        for key, value in r.items():
            if isinstance(value, float):
                assert math.isfinite(value), key
        if kl_coef == 0:
            assert r["grpo/trained_rows"] == 0 and r["label_tokens"] == 0
            assert r["loss"] == 0.0 and r["grad_norm"] in (0.0, None)
        else:
            assert r["grpo/trained_rows"] == 4 and r["label_tokens"] > 0
    if kl_coef > 0:  # step 1 is at the reference: KL 0, loss 0; step 2 moved (weight decay)
        assert records[0]["grpo/kl"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("stop_at,mu,kl", [(2, 1, 0.0), (1, 2, 0.0), (2, 1, 0.1)],
                         ids=["between_rollouts", "mid_rollouts", "kl_reference"])
def test_resume_mid_run_equals_an_uninterrupted_run(arithmetic_model_dir, tiny_plan, tmp_path,
                                                    monkeypatch, stop_at, mu, kl):
    (tmp_path / "grpo_break_rewards.py").write_text(REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    extra = ("train.steps=4", f"grpo.updates_per_rollout={mu}", f"grpo.kl_coef={kl}",
             "grpo.rewards=[exact_match, grpo_break_rewards:length]")
    train(_grpo(arithmetic_model_dir, tmp_path / "a", *extra), plan=tiny_plan, progress=False,
          log=lambda msg: None)

    def stop(step, stats):
        if step == stop_at:
            os.kill(os.getpid(), signal.SIGTERM)  # the loop saves after this step and returns

    cfg = _grpo(arithmetic_model_dir, tmp_path / "b", *extra)
    first = train(cfg, plan=tiny_plan, progress=False, log=lambda msg: None,
                  hooks=TrainHooks(on_step_end=stop))
    assert first["stopped_by"] == "SIGTERM" and first["steps_completed"] == stop_at
    train(cfg, resume=True, progress=False, log=lambda msg: None)
    a, b = _records(tmp_path / "a"), _records(tmp_path / "b")
    keys = ("loss", "grpo/reward_mean", "grpo/trained_rows", "grpo/clip_fraction", "grpo/kl")
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]
    wa, wb = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _weights(run_dir) -> dict:
    from test_loop import _weights as weights
    return weights(run_dir)


@pytest.mark.parametrize("backend", ["cpu-checked", "cpu-threaded"])
def test_rollouts_wait_for_the_queued_updates_under_the_checker(arithmetic_model_dir,
                                                                tiny_plan, tmp_path, backend):
    # the ordering checker: the rollouts of step 2 read the masters that step 1's updates
    # (queued on the optimizer worker during its backward) write; cpu-threaded: the same run
    # with the device's copies on their own threads
    cfg = _grpo(arithmetic_model_dir, tmp_path / "run", "train.steps=2",
                f"runtime.device={backend}", "grpo.rewards=[format]")
    summary = train(cfg, plan=tiny_plan, progress=False, log=lambda msg: None)
    assert summary["steps_completed"] == 2


def test_online_replanning_is_refused_for_grpo():
    # the re-planner compares measured windows with the plan's full [micro_batch, seq_len];
    # a GRPO run's are of cut micro-batches, so it would re-plan for a faster machine
    from lazytrain.config import load_config
    from lazytrain.train.grpo import check_grpo_config
    cfg = load_config(None, ["train.method=grpo", "grpo.prompts_per_step=1", "grpo.n=2",
                             "train.micro_batch=2", "planner.replan_every_steps=5"])
    with pytest.raises(ValueError, match="set planner.replan_every_steps: 0"):
        check_grpo_config(cfg)
    check_grpo_config(load_config(None, ["train.method=grpo", "grpo.prompts_per_step=1",
                                         "grpo.n=2", "train.micro_batch=2"]))
