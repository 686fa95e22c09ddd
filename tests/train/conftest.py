"""Fixtures for the training tests: a tiny random Llama with a tokenizer trained on the data."""

from __future__ import annotations

import pytest

from lazytrain.data.synthetic import arithmetic_dataset
from tiny_models import tiny_model_dir
from train_helpers import tiny_config


@pytest.fixture(scope="session")
def arithmetic_model_dir(tmp_path_factory):
    """A 3-block tied-embedding Llama whose tokenizer was trained on the arithmetic problems."""
    train, _ = arithmetic_dataset(num_train=300, num_eval=0, seed=7)
    texts = [m.content for ex in train for m in ex.messages] + ["Question: Answer: ####"]
    return tiny_model_dir(tmp_path_factory.mktemp("tiny_llama"), texts)


@pytest.fixture(scope="session")
def tiny_plan(arithmetic_model_dir, tmp_path_factory):
    """The MegaTrain K=2 plan for `tiny_config` (made once; no LP bound, to keep tests fast)."""
    from lazytrain.planner.build import problem_from_config
    from lazytrain.planner.policy import PlannerOptions, plan

    cfg = tiny_config(arithmetic_model_dir, tmp_path_factory.mktemp("plan_run"))
    return plan(problem_from_config(cfg),
                PlannerOptions(policy="megatrain", megatrain_k=2, lp_bound=False))
