"""Nothing a job opens is followed through a symlink someone else planted: a shared
runtime.nvme_dir's job folder that is a link or another user's is refused, the NVMe-tier files
and the run directory's logs and lock are opened with O_NOFOLLOW, and a new job folder is
private (mode 0700)."""

from __future__ import annotations

import os

import pytest

from lazytrain.train import locks
from lazytrain.train.loop import train
from train_helpers import tiny_config

pytestmark = pytest.mark.slow

VICTIM = b"precious data the job must not overwrite\n"


@pytest.fixture(scope="module")
def nvme_plan(arithmetic_model_dir, tmp_path_factory):
    """A plan that keeps boundary 1 on NVMe, so the job writes NVMe-tier files."""
    from lazytrain.planner.build import problem_from_config
    from lazytrain.planner.evaluate import build_plan, decisions_from_tiers
    from lazytrain.planner.plan import SolveRecord

    cfg = tiny_config(arithmetic_model_dir, tmp_path_factory.mktemp("nvme_plan_run"))
    problem = problem_from_config(cfg)
    return build_plan(problem, decisions_from_tiers(problem, ("hbm", "nvme", "hbm", "hbm")),
                      solver=SolveRecord(backend="manual"))


def _cfg(model_dir, run, shared):
    return tiny_config(model_dir, run, "train.steps=1", "data.num_eval=0",
                       f"runtime.nvme_dir={shared}")


def test_a_job_folder_planted_as_a_symlink_is_refused(arithmetic_model_dir, nvme_plan,
                                                      tmp_path):
    shared, theirs, run = tmp_path / "shared", tmp_path / "theirs", tmp_path / "run"
    theirs.mkdir()
    job = locks.job_nvme_dir(str(shared), run_dir=run)
    shared.mkdir()
    job.symlink_to(theirs)
    with pytest.raises(OSError, match=r"runtime\.nvme_dir: .* is a symbolic link"):
        train(_cfg(arithmetic_model_dir, run, shared), plan=nvme_plan, progress=False)
    assert list(theirs.iterdir()) == []


def test_a_job_folder_of_another_user_is_refused(arithmetic_model_dir, nvme_plan, tmp_path,
                                                 monkeypatch):
    shared, run = tmp_path / "shared", tmp_path / "run"
    job = locks.job_nvme_dir(str(shared), run_dir=run)
    job.mkdir(parents=True)
    real_uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: real_uid + 4242)  # the folder is not "ours"
    with pytest.raises(OSError, match=r"belongs to another user"):
        train(_cfg(arithmetic_model_dir, run, shared), plan=nvme_plan, progress=False)
    assert list(job.iterdir()) == []


def test_nvme_files_planted_as_symlinks_are_not_followed(arithmetic_model_dir, nvme_plan,
                                                         tmp_path):
    shared, run, victim = tmp_path / "shared", tmp_path / "run", tmp_path / "victim.bin"
    victim.write_bytes(VICTIM)
    job = locks.job_nvme_dir(str(shared), run_dir=run)
    job.mkdir(parents=True, mode=0o700)
    for boundary in range(5):
        for micro_batch in range(2):
            (job / f"ckpt_b{boundary}_m{micro_batch}.bin").symlink_to(victim)
    with pytest.raises(OSError, match="is a symbolic link"):
        train(_cfg(arithmetic_model_dir, run, shared), plan=nvme_plan, progress=False)
    assert victim.read_bytes() == VICTIM


def test_a_new_job_folder_is_private_and_the_job_runs(arithmetic_model_dir, nvme_plan,
                                                      tmp_path):
    shared, run = tmp_path / "shared", tmp_path / "run"
    summary = train(_cfg(arithmetic_model_dir, run, shared), plan=nvme_plan, progress=False)
    assert summary["steps_completed"] == 1 and "nvme" in summary["plan"]["tiers"]
    job = locks.job_nvme_dir(str(shared), run_dir=run)
    assert os.stat(job).st_mode & 0o777 == 0o700


@pytest.mark.parametrize("name", ["metrics.jsonl", "windows.jsonl", ".lazytrain.lock"])
def test_the_run_directory_s_own_files_are_not_followed(arithmetic_model_dir, nvme_plan,
                                                        tmp_path, name):
    run, victim, absent = tmp_path / "run", tmp_path / "victim.txt", tmp_path / "absent.txt"
    victim.write_bytes(VICTIM)
    run.mkdir()
    # a dangling link is no run state a fresh run refuses; the lock file's link has a target
    (run / name).symlink_to(victim if name.endswith(".lock") else absent)
    with pytest.raises(OSError, match="is a symbolic link"):
        train(tiny_config(arithmetic_model_dir, run, "train.steps=1", "data.num_eval=0"),
              plan=nvme_plan, progress=False)
    assert victim.read_bytes() == VICTIM and not absent.exists()
