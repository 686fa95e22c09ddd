"""train.keep_checkpoints at its edges: the checkpoint-space preflight asks room only for the
checkpoints a run can write (a run of N steps saves at most N), so "keep them all" as a large
number is not refused on a disk that holds every checkpoint the run makes."""

from __future__ import annotations

import pytest

from lazytrain.train.preflight import PreflightError, free_bytes, preflight, run_checks


def _space(tmp_path, *, one: int, **kwargs):
    return [c for c in run_checks(device="cpu", host_bytes=0, hbm_bytes=0, pinned_bytes=0,
                                  nvme_bytes=0, nvme_dir=tmp_path, checkpoint_bytes=one,
                                  run_dir=tmp_path, **kwargs)
            if c.name == "checkpoint space"][0]


def test_a_run_needs_room_only_for_the_checkpoints_it_writes(tmp_path):
    one = int(free_bytes(tmp_path) * 0.4)  # 2 fit the disk, 3 do not (20% margins)
    # keep 10**9 over a 2-step run: at most 2 saves, so 2 on disk at once (hand count)
    capped = _space(tmp_path, one=one, checkpoints_kept=10**9, checkpoints_written=2)
    assert capped.need_bytes == 2 * one and capped.ok
    # keep 1 over a 5-step run: the kept one and the one being saved
    assert _space(tmp_path, one=one, checkpoints_kept=1, checkpoints_written=5).need_bytes == 2 * one
    # unknown number of saves (train.epochs): keep + 1
    assert _space(tmp_path, one=one, checkpoints_kept=4).need_bytes == 5 * one


def test_a_refusal_for_kept_checkpoints_names_train_keep_checkpoints(tmp_path):
    with pytest.raises(PreflightError, match="lower train.keep_checkpoints"):
        preflight(device="cpu", host_bytes=0, hbm_bytes=0, pinned_bytes=0, nvme_bytes=0,
                  nvme_dir=tmp_path, checkpoint_bytes=free_bytes(tmp_path), checkpoints_kept=3,
                  run_dir=tmp_path)


def test_keep_checkpoints_a_billion_trains_and_keeps_every_checkpoint(arithmetic_model_dir,
                                                                      tiny_plan, tmp_path):
    """Before, the preflight asked for 10**9 + 1 checkpoints (petabytes) and refused the run."""
    from lazytrain.train.checkpoint import list_checkpoints
    from lazytrain.train.loop import train
    from train_helpers import tiny_config

    run = tmp_path / "run"
    train(tiny_config(arithmetic_model_dir, run, "train.steps=2", "data.num_eval=0",
                      "train.keep_checkpoints=1000000000", "train.checkpoint_every_steps=1"),
          plan=tiny_plan, progress=False, log=lambda line: None)
    assert [c.step for c in list_checkpoints(run)] == [1, 2]
