"""One job per run directory and per NVMe directory: where a job's NVMe-tier files go, the
check that the directory is writable, and the flock'ed lock files that refuse a second job.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

from lazytrain.atomic import open_nofollow, private_dir
from lazytrain.errors import JobFailure


class NvmeDirInUseError(JobFailure, RuntimeError):
    """Another job holds the lock of this job's NVMe directory (the CLI exits 1)."""


NVME_LOCK_SUFFIX = ".lock"
"""A job's NVMe directory `D` is locked through the file `D.lock` beside it (flock'ed by the
job, holding the owner's pid; beside, so the directory holds only checkpoint files)."""


def check_nvme_dir(nvme_dir: str) -> None:
    """Check, before planning (a calibration times NVMe there), that `runtime.nvme_dir` can be
    created and written: a unique probe file is created and removed. Empty: the run
    directory is used, which `loop.make_run_dir` checks.

    Raises:
        OSError: one line naming runtime.nvme_dir, the path, the cause (a read-only mount, a
            file in the way, permissions) and the fix.
    """
    if not nvme_dir:
        return
    path = Path(nvme_dir).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".lazytrain-write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OSError(f"runtime.nvme_dir: cannot write to {path} ({exc.strerror or exc}); "
                      f"set runtime.nvme_dir to a writable directory, or leave it empty to use "
                      f"the run directory") from None


def job_nvme_dir(nvme_dir: str, *, run_dir: Path) -> Path:
    """Where this job's NVMe-tier files go: `RUN_DIR/nvme` by default, else a subdirectory of
    `runtime.nvme_dir` named after the run directory and a hash of its absolute path, so that
    jobs sharing one `runtime.nvme_dir` never read each other's files, while the ranks of one
    job (one run directory) share theirs."""
    if not nvme_dir:
        return run_dir / "nvme"
    digest = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:12]
    return Path(nvme_dir).expanduser() / f"job-{run_dir.resolve().name}-{digest}"


def _take_lock(lock_path: Path) -> tuple[Any, str | None]:
    """flock `lock_path` exclusively without waiting: (the open file holding this pid, None),
    or (None, the holder's pid as written in the file) when a live process holds it."""
    handle = os.fdopen(open_nofollow(lock_path, os.O_RDWR | os.O_CREAT, 0o600), "r+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().strip() or "?"
        handle.close()
        return None, owner
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle, None


def lock_nvme_dir(directory: Path, *, node: str = "") -> Any:
    """Take the job's lock on `directory` (created mode 0700, with its lock file
    `directory.lock`, or `directory.<node>.lock` for one node of a multi-node job); returns the
    open lock file, to be closed when the job ends (closing releases the lock; the lock also
    dies with the process). The names are predictable (the ranks of a job find them), so a
    directory that is a symlink or another user's, or a lock file that is a symlink, is
    refused rather than followed (`atomic.private_dir`, `atomic.open_nofollow`).

    Raises:
        NvmeDirInUseError: another live job holds it (its pid named).
        OSError: the directory cannot be created or written; it or its lock file is a
            symlink, or the directory is another user's (one line naming the path).
    """
    private_dir(directory, key="runtime.nvme_dir")
    lock_path = directory.with_name(directory.name + (f".{node}" if node else "")
                                    + NVME_LOCK_SUFFIX)
    handle, owner = _take_lock(lock_path)
    if handle is None:
        raise NvmeDirInUseError(
            f"runtime.nvme_dir: {directory} is in use by another job (pid {owner} holds "
            f"{lock_path}); two jobs on one NVMe directory would read each "
            f"other's files: wait for it, or run this one with another --run-dir or "
            f"runtime.nvme_dir")
    return handle


class RunDirInUseError(JobFailure, RuntimeError):
    """Another live job trains in this run directory (the CLI exits 1)."""


RUN_LOCK_NAME = ".lazytrain.lock"
"""The run directory's lock file (inside it, outside what --overwrite deletes)."""


def lock_run_dir(run_dir: Path) -> Any:
    """Take the run directory's lock before anything in it is checked, deleted or written;
    returns the open lock file (closing it, or the process ending, releases it).

    One job per run directory: a second `train` there, `--overwrite` included, is refused
    before it deletes or writes a file of the running one.

    Raises:
        RunDirInUseError: another live job holds it (its pid named).
        OSError: the directory cannot be created or written.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    lock_path = run_dir / RUN_LOCK_NAME
    handle, owner = _take_lock(lock_path)  # the caller checked the directory is writable
    if handle is None:
        raise RunDirInUseError(
            f"train.run_dir: {run_dir} is in use by another job (pid {owner} holds "
            f"{lock_path}); wait for it to end, stop it, or pick another --run-dir")
    return handle
