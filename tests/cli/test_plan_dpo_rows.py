"""`lazytrain plan` with `train.method: dpo` plans 2 rows per pair, as the trainer does."""

from __future__ import annotations

import argparse

import pytest

from lazytrain.cli.plan import load_problem, register


def _problem(*sets: str):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["plan", "--micro-batch", "3", "--hardware", "cpu",
                              *[a for s in sets for a in ("--set", s)]])
    return load_problem(args)


def test_dpo_pairs_are_planned_as_two_rows_each():
    sft_cfg, sft = _problem()
    dpo_cfg, dpo = _problem("train.method=dpo")
    assert sft_cfg.train.micro_batch == 3 and dpo_cfg.train.micro_batch == 6
    assert dpo.tokens_per_micro_batch == 2 * sft.tokens_per_micro_batch


def test_grpo_rollouts_that_do_not_fill_the_micro_batches_are_refused_by_plan():
    with pytest.raises(ValueError, match="grpo.prompts_per_step x grpo.n"):
        _problem("train.method=grpo", "grpo.n=7")
