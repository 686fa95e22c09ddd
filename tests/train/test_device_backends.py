"""Whole training runs under the CPU ordering checkers (`runtime.device`).

A run under `cpu-checked` or `cpu-threaded` must finish with zero ordering violations and end
with the same weights as the `cpu` backend, bit for bit: the checkers change how ordering is
carried out or checked, never the numerics. Online re-planning (a plan switch between steps,
NVMe reads throttled) runs under both too.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from train_helpers import tiny_config
from lazytrain.planner.build import problem_from_config
from lazytrain.planner.evaluate import build_plan, decisions_from_tiers
from lazytrain.planner.plan import SolveRecord
from lazytrain.runtime.nvme import FaultInjector
from lazytrain.train import checkpoint as ckpt
from lazytrain.train.loop import TrainHooks, train


def _weights(run_dir):
    return load_file(str(ckpt.latest_checkpoint(run_dir).path / "model.safetensors"))


def _mixed_plan(cfg):
    """Boundaries in nvme, dram and hbm (3 blocks), block 2 kept: every transfer kind."""
    problem = problem_from_config(cfg)
    tiers = ("nvme", "dram", "hbm", "hbm")
    return build_plan(problem, decisions_from_tiers(problem, tiers, (2,)),
                      solver=SolveRecord(backend="manual"))


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu-checked", "cpu-threaded"])
def test_a_run_under_a_checker_ends_with_the_cpu_backends_weights_bit_for_bit(
        device, arithmetic_model_dir, tmp_path):
    extra = ("data.num_eval=0", "train.steps=2", "train.grad_accum=2")
    cpu_cfg = tiny_config(arithmetic_model_dir, tmp_path / "cpu", *extra)
    plan = _mixed_plan(cpu_cfg)
    train(cpu_cfg, plan=plan, progress=False)
    checked = tiny_config(arithmetic_model_dir, tmp_path / device, *extra,
                          f"runtime.device={device}")
    summary = train(checked, plan=plan, progress=False)
    assert summary["steps_completed"] == 2
    a, b = _weights(tmp_path / "cpu"), _weights(tmp_path / device)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu-checked", "cpu-threaded"])
def test_online_replanning_runs_under_a_checker(device, arithmetic_model_dir, tmp_path):
    cfg = tiny_config(arithmetic_model_dir, tmp_path / "run", "data.num_eval=0",
                      "train.steps=4", "planner.policy=heuristic", "planner.time_limit_s=1",
                      "planner.replan_every_steps=1", "planner.drift_patience_steps=1",
                      f"runtime.device={device}")
    faults = FaultInjector()
    faults.delay_reads(20.0)  # NVMe reads far slower than planned: a re-plan off NVMe is due
    summary = train(cfg, plan=_mixed_plan(cfg), progress=False,
                    hooks=TrainHooks(fault_hook=faults))
    assert summary["steps_completed"] == 4


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_trainers_evaluation_runs_under_cpu_checked_before_and_after_engine_steps(
        dtype, arithmetic_model_dir, tmp_path):
    """The held-out evaluation (StreamedLM on the engine's adapter: fp32 compute runs the
    `host` weight mode on the masters, bf16 the `streamed` one through the engine's weight
    slots) before the first step and after an engine step on the same adapter, under the
    checker: no ordering violation, and the cpu backend's eval losses and generations."""
    extra = ("data.num_eval=1", "train.steps=1", f"train.compute_dtype={dtype}")
    cpu = train(tiny_config(arithmetic_model_dir, tmp_path / "cpu", *extra), progress=False)
    checked = train(tiny_config(arithmetic_model_dir, tmp_path / "checked", *extra,
                                "runtime.device=cpu-checked"), progress=False)
    assert checked["steps_completed"] == 1
    for key in ("eval_before", "eval_after"):
        assert checked[key]["loss"] == cpu[key]["loss"]
        assert checked[key]["samples"] == cpu[key]["samples"]


def test_cuda_preflight_compares_pinned_bytes_with_memory_and_the_cgroup_not_ulimit(tmp_path):
    from lazytrain.train.preflight import PreflightError, preflight, run_checks

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100000000 kB\nMemAvailable: 50000000 kB\n")  # 51.2 GB
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text(str(20 * 10**9) + "\n")
    (cgroup / "memory.current").write_text(str(5 * 10**9) + "\n")  # 15 GB left in the cgroup
    kw = dict(device="cuda", host_bytes=10**9, hbm_bytes=0, nvme_bytes=0, nvme_dir=tmp_path,
              checkpoint_bytes=0, run_dir=tmp_path, meminfo=meminfo, cgroup_dir=cgroup)
    (pinned,) = [c for c in run_checks(pinned_bytes=14 * 10**9, **kw)
                 if c.name == "pinned memory"]
    assert pinned.ok and pinned.have_bytes == 15 * 10**9
    with pytest.raises(PreflightError, match="pinned memory: need 16.00 GB, have 15.00 GB"):
        preflight(pinned_bytes=16 * 10**9, **kw)
    (cgroup / "memory.max").write_text("max\n")  # no cgroup limit: MemAvailable bounds it
    (pinned,) = [c for c in run_checks(pinned_bytes=16 * 10**9, **kw)
                 if c.name == "pinned memory"]
    assert pinned.ok and pinned.have_bytes == 50000000 * 1024
