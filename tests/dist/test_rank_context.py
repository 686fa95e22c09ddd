"""The rank context the one `Trainer` runs under (one process and a data-parallel rank), the one
checkpoint commit protocol with per-rank shards, and the engine built from a config for both."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from dist_helpers import PLANS, tiny_adapter, tiny_plan
from lazytrain.dist.process_group import DistContext
from lazytrain.dist.rank import DataParallelRank, RankFailureError
from lazytrain.train import checkpoint as ckpt
from lazytrain.train.rank import ONE_PROCESS

SRC = Path(__file__).resolve().parents[2] / "src" / "lazytrain"


def test_one_process_is_the_trivial_context():
    obj = {"plan": [1, 2]}
    assert ONE_PROCESS.world_size == 1 and ONE_PROCESS.rank == 0 and ONE_PROCESS.is_main
    assert ONE_PROCESS.all_sum(2.5) == 2.5 and ONE_PROCESS.broadcast_object(obj) is obj
    assert ONE_PROCESS.barrier() is None and ONE_PROCESS.seed(7) == 7
    assert ONE_PROCESS.local_share(["a", "b"], grad_accum=2) == ["a", "b"]
    with pytest.raises(ValueError, match="a step needs 2 micro-batches; got 3"):
        ONE_PROCESS.local_share(["a", "b", "c"], grad_accum=2)
    assert ONE_PROCESS.subdir == "" and ONE_PROCESS.device_index is None
    assert ONE_PROCESS.master_store(shared=True, shm_dir="/dev/shm") == {}
    assert ONE_PROCESS.failure(RuntimeError("x"), step=3, last_checkpoint=None) is None


def test_a_data_parallel_rank_takes_its_share_seed_directory_and_names_a_failure():
    rank = DataParallelRank(DistContext(rank=1, world_size=2, local_rank=1, local_world_size=2),
                            timeout_s=30.0)
    assert not rank.is_main and rank.subdir == "rank-1" and rank.device_index is None
    assert rank.seed(5) == 5 + 1_000_003  # rank 0 keeps the seed, the others differ
    assert rank.local_share(list("abcd"), grad_accum=2) == ["c", "d"]
    assert DataParallelRank(DistContext(rank=1, world_size=2, local_rank=1),
                            timeout_s=1.0, device="cuda").device_index == 1
    failure = rank.failure(RuntimeError("Connection closed by peer\nmore"), step=4,
                           last_checkpoint=Path("/r/checkpoints/step-000002"))
    assert isinstance(failure, RankFailureError)
    assert str(failure) == ("rank 1 of 2: a collective failed (a peer rank died, or waited "
                            "longer than dist.timeout_s=30 s) at step 4; the last complete "
                            "checkpoint is /r/checkpoints/step-000002: RuntimeError: "
                            "Connection closed by peer")


class _Rank0Of2:
    """Rank 0 of a two-rank job whose peer has nothing to add: barriers are counted."""

    rank, world_size, is_main = 0, 2, True

    def __init__(self) -> None:
        self.barriers = 0

    def barrier(self) -> None:
        self.barriers += 1


class _Tokenizer:
    def save_pretrained(self, directory) -> None:
        (Path(directory) / "tokenizer.json").write_text("{}")


def _save(run_dir, ranks, *, step, before_marker=None):
    from transformers import LlamaConfig

    weights = {"model.norm.weight": torch.arange(4, dtype=torch.float32)}
    shard = {"engine": {"moments": torch.full((3,), float(step))}}
    return ckpt.save_checkpoint(run_dir, step=step, weights=weights,
                                hf_config=LlamaConfig(hidden_size=4, num_attention_heads=1,
                                                         num_key_value_heads=1), tokenizer=_Tokenizer(),
                                state={"step": step, "data": {"pos": 9}}, shard=shard,
                                ranks=ranks, before_marker=before_marker)


def test_one_protocol_writes_per_rank_shards_for_several_ranks_and_none_for_one(tmp_path):
    ranks = _Rank0Of2()
    saved = _save(tmp_path / "dp", ranks, step=2)
    assert ranks.barriers == 3  # directory made; shards on disk; renamed
    marker = json.loads((saved.path / ckpt.MARKER).read_text())
    assert marker["world_size"] == 2 and ckpt.shard_name(0) in marker["files"]
    state = saved.load_state()
    assert "engine" not in state and state["world_size"] == 2 and state["data"] == {"pos": 9}
    own = ckpt.load_shard(saved, ranks, state=state)
    assert torch.equal(own["engine"]["moments"], torch.full((3,), 2.0))
    with pytest.raises(ValueError, match=r"written by 2 rank\(s\); this job has 1"):
        ckpt.check_world_size(saved, world_size=1)

    alone = _save(tmp_path / "one", ONE_PROCESS, step=2)
    assert sorted(p.name for p in alone.path.glob("shard-*")) == []
    state = alone.load_state()
    assert state["world_size"] == 1 and torch.equal(
        ckpt.load_shard(alone, ONE_PROCESS, state=state)["engine"]["moments"],
        torch.full((3,), 2.0))
    ckpt.check_world_size(alone, world_size=1)


def test_a_sharded_save_that_dies_before_the_marker_keeps_the_previous_checkpoint(tmp_path):
    first = _save(tmp_path, _Rank0Of2(), step=1)

    def crash(directory):
        assert (directory / ckpt.shard_name(0)).is_file()  # the shard was written first
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        _save(tmp_path, _Rank0Of2(), step=2, before_marker=crash)
    assert ckpt.latest_checkpoint(tmp_path) == first
    assert [p.name for p in ckpt.checkpoints_dir(tmp_path).iterdir()] == ["step-000001"]


def test_the_engine_of_a_rank_is_built_from_the_config_with_its_parts(tmp_path):
    from lazytrain.config import load_config
    from lazytrain.dist.reducer import GradReducer
    from lazytrain.dist.sharding import ShardedOptimizer
    from lazytrain.runtime.build import engine_from_config

    cfg = load_config(None, ["runtime.nvme_timeout_s=7.5", "train.lr=0.002",
                             "runtime.io_threads=1"])
    adapter = tiny_adapter()
    rank = DataParallelRank(DistContext(), timeout_s=1.0)
    parts = rank.engine_parts(adapter, lr=cfg.train.lr, betas=(0.9, 0.95), eps=1e-8,
                              weight_decay=0.0, shared_masters=False)
    engine = engine_from_config(cfg, adapter, tiny_plan(adapter, *PLANS["all_hbm"]),
                                device_kind="cpu", nvme_dir=tmp_path / "nvme",
                                seed=rank.seed(0), model_config_sha256=adapter.hf_config_sha256,
                                **parts)
    try:
        assert isinstance(engine.optimizer, ShardedOptimizer)
        assert isinstance(engine.grad_sync, GradReducer)
        assert engine.store.io.timeout_s == 7.5  # runtime.nvme_timeout_s on every rank
        assert engine.lr == 0.002 and engine.store.io.directory == tmp_path / "nvme"
    finally:
        engine.close()
        engine.dev.close()


def test_the_trainer_exists_once_and_nothing_subclasses_it():
    """One `Trainer` (train/trainer.py); no class anywhere in src/ derives from it."""
    defined, subclasses = [], []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                if node.name.endswith("Trainer"):
                    defined.append(f"{path.relative_to(SRC)}:{node.name}")
                bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
                if "Trainer" in bases:
                    subclasses.append(f"{path.relative_to(SRC)}:{node.name}")
    assert defined == ["train/trainer.py:Trainer"] and subclasses == []
