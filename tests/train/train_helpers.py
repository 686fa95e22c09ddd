"""Builders for the training tests: the run config of a tiny CPU run (the tiny model directory is
`tiny_models.tiny_model_dir`)."""

from __future__ import annotations

from lazytrain.config import load_config


def tiny_config(model_dir, run_dir, *extra: str):
    """The run config for a tiny CPU run on the embedded arithmetic data."""
    return load_config(None, [f"model.config_path={model_dir}", f"train.run_dir={run_dir}",
                              "data.seq_len=160", "data.num_eval=4", "train.micro_batch=2",
                              "train.steps=4", "train.lr=3e-3", "train.warmup_steps=1",
                              "planner.policy=megatrain", "planner.megatrain_k=2",
                              "runtime.device=cpu", *extra])
