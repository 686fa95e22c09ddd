"""Sharded training checkpoints: every rank writes its optimizer shard, rank 0 the rest and the
marker, last, after a barrier.

Layout of `RUN_DIR/checkpoints/step-000012/` (the single-process layout of
`lazytrain.train.checkpoint`, plus one shard per rank):

    config.json, model.safetensors, tokenizer files    rank 0 (masters are equal on all ranks)
    trainer_state.pt                                  rank 0: data position, step, config,
                                                      world_size
    shard-rank00000.pt ... shard-rankNNNNN.pt         each rank: its AdamW moments (ZeRO-1
                                                      shard) and its RNG states
    COMPLETE                                          rank 0, last: every file with its size,
                                                      and world_size

Protocol: rank 0 creates `checkpoints/.tmp-step-000012-dist/`; barrier; every rank writes and
fsyncs its shard, rank 0 the common files; barrier (every shard is on disk); rank 0 fsyncs,
writes the marker, renames the directory and prunes older checkpoints; barrier. A rank that dies
anywhere before the marker leaves a directory without a marker, which
`lazytrain.train.checkpoint.latest_checkpoint` never picks up: the previous checkpoint stays the
newest valid one. The survivors' barrier fails (peer gone) or times out (`dist.timeout_s`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from lazytrain.dist.process_group import DistContext, barrier
from lazytrain.train.checkpoint import (MARKER, STATE_FILE, Checkpoint, _fsync, _prune,
                                        checkpoints_dir, load_torch_file,
                                        write_model_files)


def shard_name(rank: int) -> str:
    return f"shard-rank{rank:05d}.pt"


def save_sharded_checkpoint(run_dir: str | Path, ctx: DistContext, *, step: int,
                            weights: dict[str, torch.Tensor], hf_config: Any, tokenizer: Any,
                            state: dict[str, Any], shard: dict[str, Any],
                            before_marker: Callable[[Path], None] | None = None) -> Checkpoint:
    """Collective: write checkpoint `step` as the module docstring says (call on every rank).

    Args:
        run_dir: the run directory (shared by the ranks: one node, or a shared file system).
        ctx: the rank context.
        step: optimizer steps completed.
        weights: HF name -> fp32 master (written by rank 0).
        hf_config, tokenizer: written by rank 0 (the directory is an HF model).
        state: rank 0's trainer state (data, step, config).
        shard: this rank's engine state (optimizer shard, RNG).
        before_marker: test hook, rank 0, called before the marker is written.

    Returns:
        The checkpoint (on every rank).

    Raises:
        OSError: a write failed (rank 0 removes the temp directory); RuntimeError: a peer died.
    """
    root = checkpoints_dir(run_dir)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-{final.name}-dist"
    if ctx.is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    barrier(ctx)
    try:
        torch.save(shard, tmp / shard_name(ctx.rank))
        _fsync(tmp / shard_name(ctx.rank))
        if ctx.is_main:
            write_model_files(tmp, weights=weights, hf_config=hf_config, tokenizer=tokenizer)
            torch.save({**state, "world_size": ctx.world_size}, tmp / STATE_FILE)
        barrier(ctx)  # every shard is on disk
        if ctx.is_main:
            _commit(tmp, final, root, step=step, world_size=ctx.world_size,
                    before_marker=before_marker)
    except BaseException:
        if ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    barrier(ctx)  # nobody reads or writes the run directory before the rename
    return Checkpoint(path=final, step=step)


def _commit(tmp: Path, final: Path, root: Path, *, step: int, world_size: int,
            before_marker) -> None:
    """Rank 0: fsync every file, write the marker last, rename, prune."""
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
    for name in files:
        _fsync(tmp / name)
    if before_marker is not None:
        before_marker(tmp)
    (tmp / MARKER).write_text(json.dumps({"step": step, "files": files,
                                          "world_size": world_size}, indent=1))
    _fsync(tmp / MARKER)
    _fsync(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync(root)
    _prune(root, keep=final)


def load_shard(checkpoint: Checkpoint, ctx: DistContext) -> dict[str, Any]:
    """This rank's shard of a sharded checkpoint (its world size was checked against the job
    before planning: `lazytrain.train.loop.Trainer._check_world_size`), loaded with
    `weights_only=True`.

    Raises:
        CheckpointError: the shard is missing, damaged, or holds objects other than tensors
            and plain containers (nothing in it is executed).
    """
    return load_torch_file(checkpoint.path / shard_name(ctx.rank))
