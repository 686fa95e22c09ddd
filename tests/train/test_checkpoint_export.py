"""What a checkpoint exports and keeps, and what a resume may not change: `model.dtype` is the
dtype of the HF weights (the masters untouched, resumed bit-exact), `train.keep_checkpoints`
checkpoints stay, and a resume that changes the job's dtypes, global batch or model label is
refused in one line that says what may change."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from lazytrain.train import checkpoint as ckpt
from lazytrain.train.loop import train
from train_helpers import tiny_config

pytestmark = pytest.mark.slow


def test_model_dtype_bf16_exports_bf16_weights_and_a_resume_keeps_the_fp32_masters(
        arithmetic_model_dir, tiny_plan, tmp_path):
    sets = ("data.num_eval=0", "model.dtype=bf16", "train.master_dtype=fp32")
    train(tiny_config(arithmetic_model_dir, tmp_path / "a", "train.steps=2", *sets),
          plan=tiny_plan, progress=False)
    train(tiny_config(arithmetic_model_dir, tmp_path / "b", "train.steps=1", *sets),
          plan=tiny_plan, progress=False)
    train(tiny_config(arithmetic_model_dir, tmp_path / "b", "train.steps=2", *sets),
          resume=True, progress=False)
    path = ckpt.latest_checkpoint(tmp_path / "a").path
    exported = load_file(str(path / "model.safetensors"))
    assert {t.dtype for t in exported.values()} == {torch.bfloat16}
    hf = json.loads((path / "config.json").read_text())
    assert hf.get("dtype", hf.get("torch_dtype")) == "bfloat16"
    masters_a = load_file(str(path / "masters.safetensors"))
    assert {t.dtype for t in masters_a.values()} == {torch.float32}
    assert all(torch.equal(exported[k], masters_a[k].bfloat16()) for k in exported)
    # the fp32 masters of a straight 2-step run equal those of 1 + resumed 1: had the resume
    # started from the bf16 export, the first update's low bits would be gone
    masters_b = load_file(str(ckpt.latest_checkpoint(tmp_path / "b").path /
                              "masters.safetensors"))
    assert masters_a.keys() == masters_b.keys()
    assert all(torch.equal(masters_a[k], masters_b[k]) for k in masters_a)
    assert any(not torch.equal(t, t.bfloat16().float()) for t in masters_a.values())


def test_keep_checkpoints_keeps_the_newest_n(arithmetic_model_dir, tiny_plan, tmp_path):
    run = tmp_path / "run"
    train(tiny_config(arithmetic_model_dir, run, "train.steps=3", "data.num_eval=0",
                      "train.checkpoint_every_steps=1", "train.keep_checkpoints=2"),
          plan=tiny_plan, progress=False)
    assert sorted(p.name for p in ckpt.checkpoints_dir(run).iterdir()) == \
        ["step-000002", "step-000003"]


@pytest.fixture(scope="module")
def finished_run(arithmetic_model_dir, tmp_path_factory):
    """A 1-step run with the test's defaults (fp32 masters, compute and export)."""
    run = tmp_path_factory.mktemp("finished") / "run"
    train(tiny_config(arithmetic_model_dir, run, "train.steps=1", "data.num_eval=0"),
          progress=False)
    return run


@pytest.mark.parametrize("override", ["train.master_dtype=bf16", "train.compute_dtype=bf16",
                                      "train.grad_accum=2", "model.dtype=bf16",
                                      "model.name=other"])
def test_a_resume_that_changes_the_job_is_refused_naming_what_may_change(
        override, arithmetic_model_dir, finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    cfg = tiny_config(arithmetic_model_dir, run, "train.steps=2", "data.num_eval=0", override)
    key = override.split("=")[0]
    with pytest.raises(ValueError) as info:
        train(cfg, resume=True, progress=False)
    message = str(info.value)
    assert message.startswith(key) and "\n" not in message
    assert "a resume may change train.steps" in message
