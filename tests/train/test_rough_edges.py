"""The rough edges a fine-tuner hits in the first hour, each said in one line that names the
key and the fix: the refusal of a crafted pickle, errors that point at flags `train` has, a
read-only `runtime.nvme_dir`, a nearly full disk in bytes, a resume that extends the LR
schedule, and hub look-ups without network."""

from __future__ import annotations

import os

import pytest
import torch

from lazytrain.train import checkpoint as ckpt


class _Payload:
    def __reduce__(self):
        return (os.getcwd, ())


def test_a_crafted_pickle_is_refused_without_torchs_advice_to_load_it_unsafely(tmp_path):
    path = tmp_path / ckpt.STATE_FILE
    torch.save({"step": 1, "evil": _Payload()}, path)
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.load_torch_file(path)
    message = str(info.value)
    assert "weights_only" not in message and "\n" not in message
    assert "getcwd" in message and str(path) in message


def test_errors_about_the_model_point_at_model_config_path_not_a_flag_train_lacks(tmp_path,
                                                                                   monkeypatch):
    from lazytrain.spec import hub
    from lazytrain.spec.model import ModelSpec

    with pytest.raises(FileNotFoundError) as info:
        ModelSpec.from_hf_config(str(tmp_path / "missing" / "config.json"))
    assert "--model" not in str(info.value) and "model.config_path" in str(info.value)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    message = str(hub._error("org/model", "config.json", OSError("offline")))
    assert "--model" not in message and "set model.config_path to" in message


def test_an_unwritable_nvme_dir_is_one_line_naming_runtime_nvme_dir(arithmetic_model_dir,
                                                                     tiny_plan, tmp_path, capsys):
    from lazytrain.cli.main import main

    blocker = tmp_path / "a-file"  # as a read-only mount: nothing can be created below it
    blocker.write_text("")
    tiny_plan.save(tmp_path / "plan.json")
    code = main(["train", "--run-dir", str(tmp_path / "run"), "--no-progress",
                 "--plan", str(tmp_path / "plan.json"),
                 "--set", f"model.config_path={arithmetic_model_dir}",
                 "--set", "data.seq_len=160", "--set", "train.micro_batch=2",
                 "--set", "runtime.device=cpu", "--set", f"runtime.nvme_dir={blocker}/nvme"])
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error")]
    assert code == 1 and len(errors) == 1
    assert errors[0].startswith(f"error: runtime.nvme_dir: cannot write to {blocker}/nvme")


def test_resume_with_more_steps_says_the_cosine_schedule_is_refitted(arithmetic_model_dir,
                                                                     tiny_plan, tmp_path):
    from lazytrain.train.loop import train
    from train_helpers import tiny_config

    run = tmp_path / "run"
    train(tiny_config(arithmetic_model_dir, run, "train.steps=2", "data.num_eval=0"),
          plan=tiny_plan, progress=False)
    lines = []
    train(tiny_config(arithmetic_model_dir, run, "train.steps=4", "data.num_eval=0"),
          resume=True, progress=False, log=lines.append)
    # lr 3e-3, 1 warmup step, min_lr_ratio 0.1 (min lr 3e-4), 0-based step 2:
    # 2 steps: p = (2 - 1) / 1 = 1 -> 3e-4;  4 steps: p = 1/3 -> 3e-4 + 2.7e-3 * 0.5 *
    # (1 + cos(pi / 3)) = 3e-4 + 2.7e-3 * 0.75 = 2.325e-3
    notes = [ln for ln in lines if ln.startswith("train.steps: 4")]
    assert notes == ["train.steps: 4, the checkpoint's run had 2: the cosine LR schedule is "
                     "re-fitted to 4 steps, so step 3 trains at lr 0.002325 instead of 0.0003 "
                     "(the original schedule ended at step 2 at lr 0.0003; to go on at that "
                     "rate, set train.schedule=constant and train.lr=0.0003)"]


def test_an_unreachable_hub_is_asked_from_the_cache_only(tmp_path, monkeypatch):
    """huggingface_hub retries a failed request for about 23 s; with no connection to the hub
    the look-up goes to the cache at once and ends in the one-line "cannot be reached"."""
    import socket

    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    from lazytrain.spec import hub

    with socket.socket() as s:  # a port nothing listens on: the connection is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for var in hub.PROXY_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_download(repo_id, filename, *, cache_dir=None, local_files_only=False):
        calls.append(local_files_only)
        raise LocalEntryNotFoundError("not cached")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    with pytest.raises(OSError, match="the hub cannot be reached") as info:
        hub.hub_config_file("org/model")
    assert calls == [True] and "\n" not in str(info.value)


def test_the_run_log_says_how_many_samples_were_truncated(arithmetic_model_dir, tmp_path):
    """seq_len 64 is below every rendered arithmetic sample (the shipped tiny config's length):
    the one 2-row step trains on 2 cut samples; a sample whose prompt fills the 64 tokens keeps
    no answer token and is skipped (drawn again). The log says both counts, with the fix."""
    import re

    from transformers import AutoTokenizer

    from lazytrain.data import render
    from lazytrain.data.synthetic import arithmetic_dataset
    from lazytrain.data.templates import use_template
    from lazytrain.train.loop import train
    from train_helpers import tiny_config

    tokenizer = AutoTokenizer.from_pretrained(arithmetic_model_dir)
    use_template(tokenizer, "")
    examples, _ = arithmetic_dataset(num_train=2048, num_eval=4, seed=0)
    shortest = min(len(tokenizer(render(tokenizer, ex.messages, add_generation_prompt=False),
                                 add_special_tokens=False)["input_ids"]) for ex in examples)
    assert shortest > 64  # no sample fits uncut
    lines = []
    train(tiny_config(arithmetic_model_dir, tmp_path / "run", "train.steps=1",
                      "data.num_eval=0", "data.seq_len=64"),
          progress=False, log=lines.append)
    counts = [re.fullmatch(r"data: (\d+) samples drawn, (\d+) truncated to data.seq_len=64, "
                           r"(\d+) skipped; the truncated samples lost their tail: raise "
                           r"data.seq_len, or set data.overlong=skip to drop them", ln)
              for ln in lines if ln.startswith("data: ") and "drawn" in ln]
    assert len(counts) == 1 and counts[0] is not None
    drawn, truncated, skipped = map(int, counts[0].groups())
    assert truncated == 2 and drawn == truncated + skipped


@pytest.mark.parametrize("export, master, want", [(4, 4, 12), (2, 4, 14), (2, 2, 10), (4, 2, 12)])
def test_checkpoint_size_counts_the_masters_a_narrower_export_adds(export, master, want):
    # weights as exported + the masters when wider than the export + two fp32 Adam moments
    assert ckpt.checkpoint_bytes_per_param(export_bytes=export, master_bytes=master) == want


def test_checkpoint_space_makes_room_for_the_kept_checkpoints_and_the_next(tmp_path):
    from lazytrain.train.preflight import free_bytes, run_checks

    one = int(free_bytes(tmp_path) * 0.4)  # 2 fit the disk, 3 do not (20% margins)
    space = {keep: [c for c in run_checks(device="cpu", host_bytes=0, hbm_bytes=0,
                                          pinned_bytes=0, nvme_bytes=0, nvme_dir=tmp_path,
                                          checkpoint_bytes=one, checkpoints_kept=keep,
                                          run_dir=tmp_path)
                    if c.name == "checkpoint space"][0] for keep in (1, 2)}
    assert space[1].need_bytes == 2 * one and space[1].ok  # the kept one + the one being saved
    assert space[2].need_bytes == 3 * one and not space[2].ok
