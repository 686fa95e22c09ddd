"""Online re-planning: drift detection, and a run whose NVMe reads are throttled re-plans off
NVMe at a step boundary and ends with the same weights as a run that never switched."""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors.torch import load_file

from train_helpers import tiny_config
from lazytrain.planner.build import problem_from_config
from lazytrain.planner.evaluate import build_plan, decisions_from_tiers
from lazytrain.planner.plan import Plan, SolveRecord
from lazytrain.runtime.nvme import FaultInjector
from lazytrain.train import checkpoint as ckpt
from lazytrain.train.loop import TrainHooks, train
from lazytrain.train.replan import Drift, DriftMonitor, measure_drifts, measured_problem


def _nvme_plan(cfg) -> tuple:
    problem = problem_from_config(cfg)
    tiers = ("nvme", "nvme", "nvme", "hbm")  # every checkpoint of the 3 blocks on NVMe
    plan = build_plan(problem, decisions_from_tiers(problem, tiers),
                      solver=SolveRecord(backend="manual"))
    return problem, plan


def test_a_channel_must_drift_in_consecutive_checks_before_a_replan_is_due():
    mon = DriftMonitor(threshold=0.15, patience=2)
    slow = Drift(channel="nvme_read", planned=1e9, measured=1e8)
    ok = Drift(channel="h2d", planned=1e9, measured=1.1e9)
    assert mon.check([slow, ok]) == []
    assert mon.check([ok]) == []                 # the streak broke
    assert mon.check([slow]) == []
    assert mon.check([slow, ok]) == [slow]       # two in a row
    assert Drift(channel="compute", planned=2.0, measured=3.0).ratio == 1.5


def test_measured_drifts_compare_fitted_rates_and_compute_with_the_problem(
        arithmetic_model_dir, tmp_path):
    cfg = tiny_config(arithmetic_model_dir, tmp_path)
    problem, plan = _nvme_plan(cfg)
    planned = {w.name: w for w in plan.windows}
    windows = [{"name": n, "compute_ms": 2 * planned[n].compute_ms,
                "bytes": {"nvme_read": 1e6}, "wait_ms": {"nvme_read": 100.0}}
               for n in ("f0", "b1")] + [{"name": "pre", "compute_ms": 50.0}]
    drifts = {d.channel: d for d in measure_drifts(problem, plan, windows)}
    assert set(drifts) == {"nvme_read", "compute"}
    assert drifts["nvme_read"].measured == pytest.approx(1e7)   # 2e6 B in 0.2 s
    assert drifts["compute"].ratio == pytest.approx(2.0)       # pre is not a plan window
    target = measured_problem(problem, list(drifts.values()))
    assert target.nvme_read_bytes_per_s == pytest.approx(1e7)
    assert target.fwd_ms == pytest.approx(tuple(2 * t for t in problem.fwd_ms))


def _weights(run_dir):
    return load_file(str(ckpt.latest_checkpoint(run_dir).path / "model.safetensors"))


@pytest.mark.slow
def test_throttled_nvme_reads_trigger_a_replan_off_nvme_and_the_weights_match_a_fixed_plan(
        arithmetic_model_dir, tmp_path):
    extra = ("data.num_eval=0", "train.steps=8", "planner.policy=heuristic",
             "planner.time_limit_s=1")
    cfg = tiny_config(arithmetic_model_dir, tmp_path / "replan", *extra,
                      "planner.replan_every_steps=1", "planner.drift_patience_steps=2")
    _, plan = _nvme_plan(cfg)
    faults = FaultInjector()
    faults.delay_reads(30.0)  # each checkpoint read sleeps 30 ms: ~3 MB/s vs 1 GB/s planned

    def give_the_solver_time(step, stats):
        if step == 3:
            time.sleep(1.0)  # the solve runs in its thread; no effect on the math

    replanned = train(cfg, plan=plan, progress=False,
                      hooks=TrainHooks(fault_hook=faults, on_step_end=give_the_solver_time))
    lines = [json.loads(ln) for ln in (tmp_path / "replan" / "metrics.jsonl").read_text()
             .splitlines()]
    events = [r for r in lines if r.get("event") == "replan"]
    assert events and events[0]["switched"]
    reasons = {r["channel"]: r for r in events[0]["reason"]}
    assert reasons["nvme_read"]["ratio"] < 0.5  # attributed to the throttled channel
    assert events[0]["new_predicted_step_ms"] < events[0]["old_predicted_step_ms_measured"]
    new_plan = Plan.load(tmp_path / "replan" / "plan.json")
    assert new_plan.tiers.count("nvme") < plan.tiers.count("nvme")
    assert sum(1 for r in lines if "loss" in r) == 8 and replanned["steps_completed"] == 8

    fixed = train(tiny_config(arithmetic_model_dir, tmp_path / "fixed", *extra), plan=plan,
                  progress=False)
    assert fixed["steps_completed"] == 8
    a, b = _weights(tmp_path / "replan"), _weights(tmp_path / "fixed")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
