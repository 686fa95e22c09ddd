"""Training loop: resume bit for bit, SIGTERM, crash-safe checkpoints, NVMe faults, preflight."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from train_helpers import tiny_config
from lazytrain.train import checkpoint as ckpt
from lazytrain.train.loop import TrainHooks, train
from lazytrain.train.preflight import PreflightError, run_checks

pytestmark = pytest.mark.slow


def _weights(run_dir):
    return load_file(str(ckpt.latest_checkpoint(run_dir).path / "model.safetensors"))


def _losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(ln)["loss"] for ln in lines]


@pytest.mark.parametrize("master_dtype", ["fp32", "bf16"])
def test_two_steps_plus_sigterm_resume_equals_four_steps_bit_for_bit(arithmetic_model_dir,
                                                                     tiny_plan, tmp_path,
                                                                     master_dtype):
    # No evaluation here (it is the CLI test's subject); evaluation never touches the RNG.
    # bf16: the checkpoint holds fp32 upcasts of the masters, which round back exactly.
    dtype = f"train.master_dtype={master_dtype}"
    straight = train(tiny_config(arithmetic_model_dir, tmp_path / "a", "data.num_eval=0", dtype),
                     plan=tiny_plan, progress=False)
    assert straight["steps_completed"] == 4

    def stop_after_two(step, stats):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # the loop saves after this step and returns

    cfg = tiny_config(arithmetic_model_dir, tmp_path / "b", "data.num_eval=0", dtype)
    first = train(cfg, plan=tiny_plan, progress=False,
                  hooks=TrainHooks(on_step_end=stop_after_two))
    assert first["stopped_by"] == "SIGTERM" and first["steps_completed"] == 2
    resumed = train(cfg, resume=True, progress=False)  # reuses the run's plan.json
    assert resumed["resumed_from"].endswith("step-000002") and resumed["steps_this_run"] == 2

    assert _losses(tmp_path / "a") == _losses(tmp_path / "b")
    a, b = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    if master_dtype == "bf16":  # the run really kept bf16 masters
        assert all(torch.equal(t, t.bfloat16().float()) for t in a.values())


def test_a_checkpoint_without_marker_or_crashed_mid_save_is_never_picked_up(
        arithmetic_model_dir, tiny_plan, tmp_path):
    cfg = tiny_config(arithmetic_model_dir, tmp_path, "train.steps=2", "data.num_eval=0")

    def crash(tmp_dir):
        raise KeyboardInterrupt("killed mid-save")

    with pytest.raises(KeyboardInterrupt):
        train(cfg, plan=tiny_plan, progress=False, hooks=TrainHooks(before_marker=crash))
    assert ckpt.latest_checkpoint(tmp_path) is None
    assert not list((tmp_path / "checkpoints").iterdir())  # the temp dir was removed

    train(cfg, plan=tiny_plan, progress=False, overwrite=True)  # the crashed run left metrics
    good = ckpt.latest_checkpoint(tmp_path)
    assert good.step == 2
    # A later directory killed mid-write: files present, marker missing / a file cut short.
    partial = tmp_path / "checkpoints" / "step-000003"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"\0" * 10)
    assert ckpt.latest_checkpoint(tmp_path) == good
    cut = tmp_path / "checkpoints" / "step-000004"
    cut.mkdir()
    (cut / "model.safetensors").write_bytes(b"\0" * 10)
    (cut / ckpt.MARKER).write_text(json.dumps({"step": 4, "files": {"model.safetensors": 99}}))
    assert ckpt.latest_checkpoint(tmp_path) == good


def test_the_checkpoint_is_an_hf_model_directory(arithmetic_model_dir, tiny_plan, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train(tiny_config(arithmetic_model_dir, tmp_path, "train.steps=1", "data.num_eval=0"),
          plan=tiny_plan, progress=False)
    path = ckpt.latest_checkpoint(tmp_path).path
    model = AutoModelForCausalLM.from_pretrained(path)
    saved = load_file(str(path / "model.safetensors"))
    assert torch.equal(model.model.embed_tokens.weight, saved["model.embed_tokens.weight"])
    assert AutoTokenizer.from_pretrained(path).pad_token == "<|pad|>"


@pytest.mark.parametrize("device", ["cpu", "cpu-checked", "cpu-threaded"])
def test_nvme_fault_names_the_error_and_keeps_the_last_checkpoint(arithmetic_model_dir,
                                                                  tmp_path, device):
    from lazytrain.planner.build import problem_from_config
    from lazytrain.planner.evaluate import build_plan, decisions_from_tiers
    from lazytrain.planner.plan import SolveRecord
    from lazytrain.runtime.errors import NvmeIOError
    from lazytrain.runtime.nvme import FaultInjector

    cfg = tiny_config(arithmetic_model_dir, tmp_path, "data.num_eval=0", "train.save_every=1",
                      f"runtime.device={device}")  # the checkers: no violation on the way
    problem = problem_from_config(cfg)
    tiers = ("hbm", "nvme", "hbm", "hbm")  # boundary 1 lives on the NVMe tier
    plan = build_plan(problem, decisions_from_tiers(problem, tiers),
                      solver=SolveRecord(backend="manual"))
    faults = FaultInjector()

    def fail_in_step_two(step, stats):
        if step == 1:
            faults.fail_next_write(boundary=1)

    with pytest.raises(NvmeIOError) as info:
        train(cfg, plan=plan, progress=False,
              hooks=TrainHooks(on_step_end=fail_in_step_two, fault_hook=faults))
    assert info.value.boundary == 1 and str(tmp_path / "nvme") in str(info.value.path)
    last = ckpt.latest_checkpoint(tmp_path)
    assert last.step == 1
    assert set(load_file(str(last.path / "model.safetensors")))
    assert last.load_state()["step"] == 1
    assert not any((tmp_path / "nvme").glob("*")), "NVMe scratch files left behind"


def test_preflight_refuses_with_the_numbers(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 2048 kB\nMemAvailable: 1000 kB\n")
    checks = run_checks(device="cpu", host_bytes=2_000_000, hbm_bytes=0, pinned_bytes=0,
                        nvme_bytes=0, nvme_dir=tmp_path, checkpoint_bytes=1, run_dir=tmp_path,
                        meminfo=meminfo)
    assert [c.ok for c in checks] == [False, True]
    from lazytrain.train.preflight import preflight
    # under 10 MB in bytes, not "need 0.00 GB, have 0.00 GB" (meminfo's kB are 1024 bytes)
    with pytest.raises(PreflightError, match=r"host memory: need 2000000 bytes, have 1024000 "
                                             r"bytes \(MemAvailable\)"):
        preflight(device="cpu", host_bytes=2_000_000, hbm_bytes=0, pinned_bytes=0,
                  nvme_bytes=0, nvme_dir=tmp_path, checkpoint_bytes=1, run_dir=tmp_path,
                  meminfo=meminfo)
    with pytest.raises(PreflightError, match="nvme space"):
        preflight(device="cpu", host_bytes=0, hbm_bytes=0, pinned_bytes=0,
                  nvme_bytes=10**18, nvme_dir=tmp_path / "nvme", checkpoint_bytes=1,
                  run_dir=tmp_path)


def test_eval_every_evaluates_during_training_and_records_it(arithmetic_model_dir, tmp_path):
    from lazytrain.train.loop import train
    from train_helpers import tiny_config

    lines = []
    cfg = tiny_config(arithmetic_model_dir, tmp_path / "run", "train.steps=3",
                      "train.eval_every=1", "data.num_eval=2")
    train(cfg, progress=False, log=lines.append)
    records = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines()]
    evals = [r for r in records if r.get("event") == "eval"]
    assert [r["step"] for r in evals] == [1, 2]  # step 3 is the final "after" evaluation
    assert all(r["eval_loss"] is not None and r["num_scored"] >= 0 for r in evals)
    assert sum(1 for ln in lines if ln.startswith("eval at step")) == 2
