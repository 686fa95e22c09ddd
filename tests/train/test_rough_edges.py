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
