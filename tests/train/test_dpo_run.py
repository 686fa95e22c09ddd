"""A DPO run end to end on a tiny model: pairs from the embedded problems, reference log-probs
from the initial weights (cached in the run directory and read back on resume), dpo_* metrics
per step and held-out pair metrics, a plan made for 2 rows per pair."""

from __future__ import annotations

import json

import pytest
import torch

from train_helpers import tiny_config
from lazytrain.data.preference import arithmetic_pairs
from lazytrain.train.loop import train
from lazytrain.train.reference import CACHE_DIR

pytestmark = pytest.mark.slow  # whole runs: plan, reference pass, steps, evaluations


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    """10 preference records in TRL's explicit-prompt layout (text fields), from the embedded
    problems: the worked answer chosen, one with a wrong step rejected."""
    train_pairs, _ = arithmetic_pairs(num_train=10, num_eval=0, seed=3)
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": p.prompt[0].content,
                                        "chosen": p.chosen[0].content,
                                        "rejected": p.rejected[0].content}) + "\n"
                            for p in train_pairs))
    return path


def _dpo_config(model_dir, run_dir, data, *extra):
    return tiny_config(model_dir, run_dir, "train.method=dpo", "train.micro_batch=1",
                       f"data.path={data}", "data.num_eval=3", "train.steps=2",
                       "dpo.beta=0.5", *extra)


def test_dpo_run_logs_pair_metrics_and_caches_the_reference(arithmetic_model_dir, pairs_file,
                                                            tmp_path):
    lines = []
    summary = train(_dpo_config(arithmetic_model_dir, tmp_path, pairs_file), progress=False,
                    log=lines.append)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["provenance"]["micro_batch"] == 2  # 1 pair = chosen + rejected rows
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first = records[0]
    # before the first update the policy is the reference: every reward is 0, so the sigmoid
    # loss is log 2 and the margin 0
    assert first["loss"] == pytest.approx(float(torch.log(torch.tensor(2.0))), abs=1e-4)
    assert first["dpo_rewards_chosen"] == pytest.approx(0.0, abs=1e-4)
    assert first["dpo_margin"] == pytest.approx(0.0, abs=1e-4)
    assert first["dpo_pairs"] == 1
    evals = summary["dpo_eval"]
    assert [e["eval_dpo_pairs"] for e in evals] == [3, 3]  # before and after
    assert evals[0]["eval_dpo_margin"] == pytest.approx(0.0, abs=1e-4)
    assert any(line.startswith("eval pairs") for line in lines)
    cached = list((tmp_path / CACHE_DIR).glob("*.pt"))
    assert len(cached) == 1 and any("scored with the initial weights" in x for x in lines)


def test_dpo_resume_reads_the_cached_reference(arithmetic_model_dir, pairs_file, tmp_path):
    cfg = _dpo_config(arithmetic_model_dir, tmp_path, pairs_file, "data.num_eval=0",
                      "train.steps=1")
    train(cfg, progress=False)
    lines = []
    summary = train(_dpo_config(arithmetic_model_dir, tmp_path, pairs_file, "data.num_eval=0",
                                "train.steps=2"), resume=True, progress=False,
                    log=lines.append)
    assert summary["steps_completed"] == 2
    assert any(line.startswith("reference log-probs: read") for line in lines)


def test_dpo_refuses_packing_naming_the_key(arithmetic_model_dir, pairs_file, tmp_path):
    with pytest.raises(ValueError, match="data.packing"):
        train(_dpo_config(arithmetic_model_dir, tmp_path, pairs_file, "data.packing=true"),
              progress=False)
