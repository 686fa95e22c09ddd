"""Start-up checks of data-parallel jobs: leftover shared-master files, a run directory that
some rank cannot see, a checkpoint of another world size, a data-parallel run given to report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from dist_helpers import free_port
from lazytrain.dist.shared_masters import master_file, remove_stale_files
from lazytrain.train.checkpoint import check_world_size


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_only_files_of_dead_creators_are_removed(tmp_path):
    dead = master_file(tmp_path, "abc123", 0, pid=_dead_pid())
    live = master_file(tmp_path, "abc123", 1, pid=os.getpid())
    other = tmp_path / "lazytrain-notes.txt"
    for p in (dead, live, other):
        p.write_bytes(b"x")
    assert remove_stale_files(tmp_path) == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])
    assert remove_stale_files(tmp_path / "missing") == []


def _run_dir_worker(rank: int, world: int, port: int, root: str, out: str) -> None:
    torch.set_num_threads(1)  # a forked child must not use the parent's intra-op pool
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      GROUP_RANK=str(rank))
    from pathlib import Path

    from lazytrain.dist.process_group import init_from_env, shutdown
    from lazytrain.dist.rank import check_shared_run_dir

    ctx = init_from_env(backend="gloo", device="cpu", timeout_s=30)
    # rank 1 is a second "host" whose path names another directory (no shared file system)
    run_dir = Path(root) / ("run" if rank == 0 else "elsewhere/run")
    try:
        check_shared_run_dir(ctx, run_dir)
        message = "ok"
    except RuntimeError as exc:
        message = str(exc)
    Path(out, f"rank{rank}.txt").write_text(message)
    shutdown(ctx)


@pytest.mark.slow
def test_a_run_dir_that_a_rank_cannot_see_fails_on_every_rank_naming_it(tmp_path):
    mp.start_processes(_run_dir_worker, args=(2, free_port(), str(tmp_path), str(tmp_path)),
                       nprocs=2, join=True, start_method="fork")
    messages = [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)]
    assert all("is not shared: rank 1 (node 1)" in m and "shared file system" in m
               for m in messages), messages
    assert list((tmp_path / "run").iterdir()) == []  # the probe is removed


def test_a_data_parallel_checkpoint_is_refused_by_one_process_naming_torchrun(tmp_path):
    (tmp_path / "COMPLETE").write_text(json.dumps({"step": 3, "files": {}, "world_size": 2}))
    with pytest.raises(ValueError, match=r"written by 2 rank\(s\); this job has 1.*"
                                         r"torchrun --nproc_per_node 2"):
        check_world_size(SimpleNamespace(path=tmp_path), world_size=1)
    (tmp_path / "COMPLETE").write_text(json.dumps({"step": 3, "files": {}}))  # one process
    check_world_size(SimpleNamespace(path=tmp_path), world_size=1)


def test_report_on_a_data_parallel_run_points_at_a_rank_directory(tmp_path):
    from lazytrain.cli.main import main

    (tmp_path / "rank-0").mkdir()
    (tmp_path / "plan.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="data-parallel run.*rank-0"):
        main(["--debug", "report", str(tmp_path)])


def _failing_owner_worker(rank: int, world: int, port: int, out: str, shared: bool) -> None:
    import time
    from pathlib import Path

    from dist_helpers import PLANS, engine_kwargs, global_batches, tiny_adapter, tiny_plan
    from lazytrain.dist import shared_masters
    from lazytrain.dist.parallel import build_engine, local_share
    from lazytrain.dist.process_group import barrier, init_from_env
    from lazytrain.runtime import optim

    torch.set_num_threads(1)  # a forked child must not use the parent's intra-op pool
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    ctx = init_from_env(backend="gloo", device="cpu", timeout_s=60)
    adapter = tiny_adapter(**(shared_masters.node_store(ctx, shm_dir=out) if shared else {}))
    barrier(ctx)
    if rank == 0:  # rank 0's AdamW breaks on every group it owns
        def broken(self, group, lr, grad_scale):
            raise ValueError("injected optimizer failure")
        optim.BlockOptimizer._update = broken
    kw = engine_kwargs(os.path.join(out, f"nvme{rank}"), clip=0.0, grad_accum=1)
    engine = build_engine(adapter, tiny_plan(adapter, *PLANS["all_hbm"]), ctx=ctx,
                          lr=kw.pop("lr"), shared_masters=shared, **kw)
    t0 = time.perf_counter()
    try:
        for batches in global_batches(2, world):
            engine.step(local_share(batches, ctx=ctx, grad_accum=1))
        engine.optimizer.wait_all()
        message = "no error"
    except Exception as exc:
        message = f"{type(exc).__name__}: {exc}"
    Path(out, f"rank{rank}.txt").write_text(f"{time.perf_counter() - t0:.1f}|{message}")
    os._exit(0)  # the job is broken: leave without the collectives of a clean shutdown


@pytest.mark.slow
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "private"])
def test_an_owner_whose_update_fails_makes_the_others_fail_at_once_naming_it(shared, tmp_path):
    mp.start_processes(_failing_owner_worker, args=(2, free_port(), str(tmp_path), shared),
                       nprocs=2, join=True, start_method="fork")
    results = [(tmp_path / f"rank{r}.txt").read_text().split("|", 1) for r in (0, 1)]
    assert "injected optimizer failure" in results[0][1]
    assert "OwnerUpdateError: rank 0 failed to update" in results[1][1], results
    assert all(float(t) < 30 for t, _ in results)  # not the 60 s collective timeout
