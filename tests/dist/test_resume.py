"""Data-parallel training runs: resume with the same world size continues exactly; a killed rank
makes every other rank fail with a clear error in time and never corrupts the last checkpoint;
torchrun with two localhost "nodes" runs `lazytrain train`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from dist_helpers import free_port, launch, run_overrides
from lazytrain.train import checkpoint as ckpt

pytestmark = pytest.mark.slow


def _weights(run_dir):
    return load_file(str(ckpt.latest_checkpoint(run_dir).path / "model.safetensors"))


def _losses(run_dir):
    return [json.loads(ln)["loss"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_ranks_stopped_at_step_two_and_resumed_equal_four_straight_steps(dp_model_dir,
                                                                           tmp_path):
    assert launch(run_overrides(dp_model_dir, tmp_path / "a"), error_dir=str(tmp_path)) == [0, 0]
    # SIGTERM reaches rank 1 only: both ranks stop after step 2 and save a sharded checkpoint
    b = run_overrides(dp_model_dir, tmp_path / "b")
    assert launch(b, sigterm_at=2, error_dir=str(tmp_path)) == [0, 0]
    first = ckpt.latest_checkpoint(tmp_path / "b")
    assert first.step == 2
    assert {"shard-rank00000.pt", "shard-rank00001.pt"} <= {p.name for p in first.path.iterdir()}
    assert launch(b, resume=True, error_dir=str(tmp_path)) == [0, 0]

    assert _losses(tmp_path / "a") == _losses(tmp_path / "b")
    wa, wb = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    for run in ("a", "b"):  # per-rank plans and windows
        for r in (0, 1):
            assert (tmp_path / run / f"rank-{r}" / "plan.json").is_file()
            assert (tmp_path / run / f"rank-{r}" / "windows.jsonl").stat().st_size > 0


def test_a_killed_rank_makes_the_other_fail_with_a_clear_error_and_keeps_the_checkpoint(
        dp_model_dir, tmp_path):
    overrides = run_overrides(dp_model_dir, tmp_path / "run", "train.save_every=1")
    codes = launch(overrides, sigkill_at=2, error_dir=str(tmp_path), timeout_s=60)
    assert codes[1] == -9 and codes[0] not in (0, None)  # None: rank 0 hung
    message = (tmp_path / "rank0.txt").read_text()
    assert message.startswith("RankFailureError: rank 0 of 2: a collective failed")
    assert "step-000001" in message
    last = ckpt.latest_checkpoint(tmp_path / "run")
    assert last.step == 1 and ckpt.is_valid(last.path)
    assert load_file(str(last.path / "model.safetensors"))  # loads


def test_torchrun_with_two_localhost_nodes_runs_lazytrain_train(dp_model_dir, tmp_path):
    port = free_port()
    sets = [x for o in run_overrides(dp_model_dir, tmp_path / "run", "train.steps=2")
            for x in ("--set", o)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
         "--node_rank", str(n), "--master_addr", "127.0.0.1", "--master_port", str(port),
         "-m", "lazytrain.cli.main", "train", "--no-progress", *sets],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for n in (0, 1)]
    outs = [p.communicate(timeout=120) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert "done: 2 steps" in outs[0][0]
    metrics = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and metrics[0]["world_size"] == 2
    assert ckpt.latest_checkpoint(tmp_path / "run").step == 2
