"""Jobs sharing one runtime.nvme_dir: each gets its own subdirectory with a lock, a second job
on the same lock is refused, and the run files say whether O_DIRECT or buffered I/O ran."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lazytrain.runtime.nvme import supports_o_direct
from lazytrain.train import locks
from lazytrain.train.loop import train
from train_helpers import tiny_config

pytestmark = pytest.mark.slow


def test_two_runs_on_one_nvme_dir_get_separate_job_directories(tmp_path):
    shared = str(tmp_path / "nvme")
    a = locks.job_nvme_dir(shared, run_dir=tmp_path / "run_a")
    b = locks.job_nvme_dir(shared, run_dir=tmp_path / "run_b")
    assert a != b and a.parent == b.parent == tmp_path / "nvme"
    assert a.name.startswith("job-run_a-") and b.name.startswith("job-run_b-")
    # the ranks of one job (one run directory, however spelled) share theirs
    assert locks.job_nvme_dir(shared, run_dir=tmp_path / "x" / ".." / "run_a") == a
    assert locks.job_nvme_dir("", run_dir=tmp_path / "run_a") == tmp_path / "run_a" / "nvme"


def test_a_second_job_on_a_locked_nvme_directory_is_refused_naming_the_holder(
        arithmetic_model_dir, tiny_plan, tmp_path):
    run = tmp_path / "run"
    cfg = tiny_config(arithmetic_model_dir, run, "train.steps=1", "data.num_eval=0",
                      f"runtime.nvme_dir={tmp_path / 'nvme'}")
    job_dir = locks.job_nvme_dir(str(tmp_path / "nvme"), run_dir=run)
    holder = subprocess.Popen(  # another job: holds the lock until its stdin closes
        [sys.executable, "-c", "import sys; from pathlib import Path; "
         "from lazytrain.train.locks import lock_nvme_dir; "
         f"h = lock_nvme_dir(Path({str(job_dir)!r})); print('locked', flush=True); "
         "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(locks.NvmeDirInUseError, match=rf"in use by another job \(pid "
                                                          rf"{holder.pid} holds"):
            train(cfg, plan=tiny_plan, progress=False)
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    summary = train(cfg, plan=tiny_plan, progress=False, overwrite=True)  # the lock is free now
    assert summary["steps_completed"] == 1
    locks.lock_nvme_dir(job_dir).close()  # and released again when the job ended


def test_the_summary_records_whether_o_direct_or_buffered_io_ran(arithmetic_model_dir,
                                                                 tiny_plan, tmp_path):
    run = tmp_path / "run"
    train(tiny_config(arithmetic_model_dir, run, "train.steps=1", "data.num_eval=0"),
          plan=tiny_plan, progress=False)
    nvme = json.loads((run / "summary.json").read_text())["nvme"]
    assert nvme["dir"] == str(run / "nvme")
    assert nvme["io"] == ("O_DIRECT" if supports_o_direct(run / "nvme") else "buffered")


@pytest.mark.parametrize("timeout_s,expected", [(7.5, 7.5), (0, None)])
def test_runtime_nvme_timeout_s_reaches_the_nvme_waits(arithmetic_model_dir, tiny_plan,
                                                       tmp_path, monkeypatch, timeout_s,
                                                       expected):
    from lazytrain.runtime.nvme import NvmeIO

    seen, real_wait = set(), NvmeIO.wait

    def wait(self, futures):
        seen.add(self.timeout_s)
        return real_wait(self, futures)

    monkeypatch.setattr(NvmeIO, "wait", wait)
    train(tiny_config(arithmetic_model_dir, tmp_path / "run", "train.steps=1", "data.num_eval=0",
                      f"runtime.nvme_timeout_s={timeout_s}"), plan=tiny_plan, progress=False)
    assert seen == {expected}  # every window barrier waited with the configured limit
