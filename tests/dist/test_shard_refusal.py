"""A data-parallel resume whose shard is refused on one rank fails on every rank before any of
them evaluates or trains: the ranks agree on the shards while checking the checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from dist_helpers import launch, run_overrides
from lazytrain.train import checkpoint as ckpt

pytestmark = pytest.mark.slow


class _Payload:
    """Unpickling this would call Path.touch(target): the proof that code ran."""

    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        from pathlib import Path
        return (Path.touch, (Path(self.target),))


def test_a_refused_shard_on_rank_one_fails_rank_zero_before_any_work(dp_model_dir, tmp_path):
    run = tmp_path / "run"
    assert launch(run_overrides(dp_model_dir, run, "train.steps=1"),
                  error_dir=str(tmp_path)) == [0, 0]
    saved = ckpt.latest_checkpoint(run)
    shard = saved.path / ckpt.shard_name(1)
    proof = tmp_path / "code-ran"
    state = torch.load(shard, weights_only=True)
    torch.save({**state, "evil": _Payload(proof)}, shard)
    marker = json.loads((saved.path / ckpt.MARKER).read_text())  # as an attacker would
    marker["files"][shard.name] = shard.stat().st_size
    marker["xxh3"][shard.name] = ckpt.file_digest(shard)
    (saved.path / ckpt.MARKER).write_text(json.dumps(marker))
    metrics_before = (run / "metrics.jsonl").read_bytes()

    codes = launch(run_overrides(dp_model_dir, run, "train.steps=2", "data.num_eval=2"),
                   resume=True, error_dir=str(tmp_path), timeout_s=60)
    assert codes[0] not in (0, None) and codes[1] not in (0, None)
    rank1 = (tmp_path / "rank1.txt").read_text()
    assert rank1.startswith("CheckpointError") and shard.name in rank1
    rank0 = (tmp_path / "rank0.txt").read_text()
    assert rank0.startswith("CheckpointError: --resume: 1 other rank(s) refused their shard")
    assert (run / "metrics.jsonl").read_bytes() == metrics_before
    assert not proof.exists()
