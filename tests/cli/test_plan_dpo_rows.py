"""`lazytrain plan` with `train.method: dpo` plans 2 rows per pair, as the trainer does."""

from __future__ import annotations

import argparse

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
