"""Online re-planning under data parallelism: rank 0 re-plans, every rank switches at the same
step to the same plan, and the run finishes on both ranks."""

from __future__ import annotations

import json

import pytest

from dist_helpers import launch, run_overrides
from lazytrain.config import load_config
from lazytrain.planner.build import problem_from_config
from lazytrain.planner.evaluate import build_plan, decisions_from_tiers
from lazytrain.planner.plan import Plan, SolveRecord

pytestmark = pytest.mark.slow


def _lines(path):
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def test_throttled_nvme_reads_make_both_ranks_switch_to_rank_zeros_new_plan_at_one_step(
        dp_model_dir, tmp_path):
    run = tmp_path / "run"
    overrides = run_overrides(dp_model_dir, run, "train.steps=7", "planner.policy=heuristic",
                              "planner.time_limit_s=1", "planner.replan_every_steps=1",
                              "planner.drift_patience_steps=2")
    cfg = load_config(None, overrides)
    problem = problem_from_config(cfg)
    start = build_plan(problem, decisions_from_tiers(problem, ("nvme", "nvme", "hbm")),
                       solver=SolveRecord(backend="manual"))  # both block inputs on NVMe
    start.save(tmp_path / "start.json")
    codes = launch(overrides, plan_path=str(tmp_path / "start.json"), read_delay_ms=30.0,
                   error_dir=str(tmp_path), timeout_s=120)
    assert codes == [0, 0], [p.read_text() for p in tmp_path.glob("rank*.txt")]

    events = [r for r in _lines(run / "metrics.jsonl") if r.get("event") == "replan"]
    assert events and events[0]["switched"]
    final = [Plan.load(run / f"rank-{r}" / "plan.json") for r in (0, 1)]
    assert final[0].to_dict() == final[1].to_dict() == Plan.load(run / "plan.json").to_dict()
    assert final[0].tiers.count("nvme") < start.tiers.count("nvme")
    # the windows each rank measured name the plan it ran: the same plan, step by step, and
    # the plan changes once during the run
    per_rank = [{(w["step"], w["plan_id"]) for w in _lines(run / f"rank-{r}" / "windows.jsonl")}
                for r in (0, 1)]
    assert per_rank[0] == per_rank[1]
    assert len({pid for _, pid in per_rank[0]}) == 2
