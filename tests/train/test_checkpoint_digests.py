"""A checkpoint's COMPLETE marker records an xxh3-128 digest per file, and `--resume` checks
them: a corruption that keeps every size is named, not resumed from; `--no-verify-checkpoint`
skips the check and says so in one line."""

from __future__ import annotations

import json

import pytest
import xxhash

from lazytrain.cli.main import main
from lazytrain.train import checkpoint as ckpt
from lazytrain.train.loop import train
from train_helpers import tiny_config

pytestmark = pytest.mark.slow


@pytest.fixture()
def finished(arithmetic_model_dir, tiny_plan, tmp_path):
    run = tmp_path / "run"
    train(tiny_config(arithmetic_model_dir, run, "train.steps=1", "data.num_eval=0"),
          plan=tiny_plan, progress=False)
    return run


def _flip_one_byte(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_the_marker_records_each_file_s_xxh3_digest(finished):
    step = ckpt.latest_checkpoint(finished).path
    marker = json.loads((step / ckpt.MARKER).read_text())
    assert set(marker["xxh3"]) == set(marker["files"]) >= {"model.safetensors", ckpt.STATE_FILE}
    for name, digest in marker["xxh3"].items():  # the xxhash library itself, whole file at once
        assert digest == xxhash.xxh3_128((step / name).read_bytes()).hexdigest()


def test_a_same_size_corruption_is_named_and_not_resumed(finished, capsys):
    step = ckpt.latest_checkpoint(finished).path
    weights = step / "model.safetensors"
    size = weights.stat().st_size
    _flip_one_byte(weights, size - 3)  # inside the last tensor's data
    assert weights.stat().st_size == size and ckpt.is_valid(step)  # sizes cannot see it
    capsys.readouterr()
    code = main(["train", "--resume", str(finished), "--steps", "2", "--no-progress"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error")]
    assert code == 2 and len(err) == 1
    assert f"checkpoint {step} is damaged: model.safetensors does not match its xxh3" in err[0]


def test_no_verify_checkpoint_resumes_on_sizes_and_says_so(finished, capsys):
    step = ckpt.latest_checkpoint(finished).path
    marker = json.loads((step / ckpt.MARKER).read_text())
    marker["xxh3"]["config.json"] = "0" * 32  # a digest that no longer matches
    (step / ckpt.MARKER).write_text(json.dumps(marker))
    capsys.readouterr()
    assert main(["train", "--resume", str(finished), "--steps", "2", "--no-progress",
                 "--no-verify-checkpoint"]) == 0
    err = capsys.readouterr().err.splitlines()
    said = [ln for ln in err if "digests not checked" in ln]
    assert len(said) == 1 and "--no-verify-checkpoint" in said[0]
