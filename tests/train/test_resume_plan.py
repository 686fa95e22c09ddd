"""Resuming reuses the run's plan.json only when it was planned for the same ranks per node."""

from __future__ import annotations

from train_helpers import tiny_config
from lazytrain.config import apply_overrides
from lazytrain.train.setup import make_plan, plan_for_run


def test_a_plan_for_another_ranks_per_node_is_made_again_on_resume(arithmetic_model_dir,
                                                                     tmp_path, capsys):
    one = tiny_config(arithmetic_model_dir, tmp_path)
    two = apply_overrides(one, ["dist.nproc_per_node=2", "hardware.gpus_per_node=2"])
    make_plan(two).save(tmp_path / "plan.json")  # a 2-rank job's per-rank plan

    same = plan_for_run(two, tmp_path, plan=None, resuming=True)
    assert same.provenance["dist"]["nproc_per_node"] == 2 and capsys.readouterr().err == ""

    again = plan_for_run(one, tmp_path, plan=None, resuming=True)
    assert "dist" not in again.provenance  # planned for the whole node
    assert "planned for 1 node(s) x 2 ranks; this job has 1 x 1" in capsys.readouterr().err
