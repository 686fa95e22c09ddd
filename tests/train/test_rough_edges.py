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
