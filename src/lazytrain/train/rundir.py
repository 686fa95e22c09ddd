"""The run directory's previous run: refusing to mix with it, and removing it for `--overwrite`.

A fresh run (no `--resume`) into a directory that holds a run's state (`RUN_STATE`) is refused
unless `--overwrite` is given. With it, the old run is removed only after everything that can
reject the new job has been checked (config, data, chat template, model source, plan,
preflight): `check_run_dir` runs first and touches nothing, `clear_run_dir` runs when the new
run is about to write its first file, so a refused job leaves the old run byte for byte.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

RUN_STATE = ("checkpoints", "metrics.jsonl", "windows.jsonl", "summary.json", "tensorboard",
             "wandb")
"""What a run leaves in its directory that a new run must not mix with: the files a fresh run
refuses to write over without `--overwrite`, and exactly what `--overwrite` deletes (with
`RUN_FILES`)."""
RUN_FILES = ("plan.json", "config.yaml", "nvme")
"""Written by every run, deleted by `--overwrite` beside `RUN_STATE` (`nvme` is the default
NVMe scratch)."""


def check_run_dir(run_dir: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse what cannot go on in `run_dir`; deletes nothing (`clear_run_dir` does, later).

    Args:
        run_dir: the run directory (need not exist).
        resume: `--resume`: the directory's state is continued, nothing is checked here.
        overwrite: `--overwrite`: an earlier run is to be replaced, not refused.

    Raises:
        ValueError: a fresh run into a directory holding a run's state without `overwrite`
            (names what it holds and the two fixes), or both `resume` and `overwrite`.
    """
    if resume and overwrite:
        raise ValueError("--resume and --overwrite contradict each other: --resume continues "
                         "the run, --overwrite deletes it; pass one")
    if resume or overwrite or not run_dir.is_dir():
        return
    held = [name for name in RUN_STATE if (run_dir / name).exists()]
    if held:
        raise ValueError(f"train.run_dir: {run_dir} already holds a run ({', '.join(held)}); "
                         f"continue it with --resume {run_dir}, start it again with "
                         f"--overwrite, or pick another --run-dir")


def clear_run_dir(run_dir: Path) -> None:
    """Delete the previous run's files (`RUN_STATE`, `RUN_FILES`); other files stay. A symlink
    among them is removed itself, never followed.

    Raises:
        OSError: a file cannot be removed.
    """
    for name in (*RUN_STATE, *RUN_FILES):
        target = run_dir / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()


def run_state_bytes(run_dir: Path) -> int:
    """Bytes of the files `clear_run_dir` would delete (sizes as `lstat` reports them; links
    are not followed): what `--overwrite` frees in the run directory before the first save."""
    total = 0
    for name in (*RUN_STATE, *RUN_FILES):
        target = run_dir / name
        if target.is_dir() and not target.is_symlink():
            total += sum(os.lstat(os.path.join(root, f)).st_size
                         for root, _dirs, files in os.walk(target) for f in files)
        elif target.is_file() and not target.is_symlink():
            total += target.stat().st_size
    return total
