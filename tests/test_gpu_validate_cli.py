"""benchmarks/gpu_validate.py: the CLI on a CPU-only machine, and its trace arithmetic.

The GPU sections themselves run only where CUDA is (`mark.gpu`); here: `--help`, the one-line
refusal without a GPU that still writes the environment section, bad `--only`, the per-window
busy/overlap figures on a hand-made profiler trace, every plan the script builds, and each
ordering micro-test judged by the happens-before checker (cpu-checked).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_validate.py"


def _run(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


def _module():
    """The script as a module (registered first: its dataclasses look themselves up)."""
    if "gpu_validate" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_validate", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_validate"] = module
        spec.loader.exec_module(module)
    return sys.modules["gpu_validate"]


def test_help_works_without_a_gpu_and_lists_every_section():
    proc = _run("--help")
    assert proc.returncode == 0, proc.stderr
    for section in ("environment", "ceilings", "ordering", "gradients", "trainer", "mfu",
                    "overlap"):
        assert section in proc.stdout
    assert "PYTHONPATH=src python benchmarks/gpu_validate.py --out gpu_validate.json" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_run_without_cuda_exits_nonzero_and_still_writes_the_environment(tmp_path):
    out = tmp_path / "result.json"
    proc = _run("--out", str(out))
    assert proc.returncode == 1
    assert "no CUDA device" in proc.stderr
    data = json.loads(out.read_text())
    assert data["ok"] is False and "no CUDA device" in data["error"]
    env = data["sections"]["environment"]
    assert env["ok"] is True and env["cuda_available"] is False
    assert env["torch"] == torch.__version__
    fresh = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                           capture_output=True, text=True, check=True)
    assert env["intra_op_threads"] == int(fresh.stdout)  # torch's default: not forced to one
    assert set(env["memlock_limit_bytes"]) == {"soft", "hard"}
    assert "mem_available_bytes" in env and "cgroup_memory_max" in env
    assert env["planner_without_solver"]["solver_modules_loaded"] == []
    for name in ("ceilings", "ordering", "gradients", "trainer", "mfu"):
        assert data["sections"][name] == {"ok": False, "status": "skipped",
                                          "error": "no CUDA device"}
    assert "overlap" not in data["sections"]  # only with --only overlap: 5 minutes in all
    answers = json.loads(proc.stdout)  # the one JSON on stdout: the three answers
    assert answers["out"] == str(out) and answers["ok"] is False
    assert answers["mfu"] == {"answer": None, "error": "no CUDA device"}
    assert data["answers"]["correct"]["answer"] is False
    assert not list(tmp_path.glob(".result.json.*"))  # the atomic write left no temp file


def test_only_with_an_unknown_section_is_a_usage_error_naming_it():
    proc = _run("--only", "ordering,bogus")
    assert proc.returncode == 2
    assert "--only: unknown section 'bogus'" in proc.stderr


def _x(cat: str, ts: float, dur: float, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": args.pop("name", cat), "ts": ts, "dur": dur,
            "args": args}


def test_window_overlap_on_a_hand_made_trace():
    gv = _module()
    trace = [
        _x("user_annotation", 0, 100, name="lt_window:f0"),
        _x("user_annotation", 100, 100, name="lt_window:f1"),
        _x("user_annotation", 0, 300, name="unrelated range"),
        _x("cuda_runtime", 10, 1, correlation=1),
        _x("cuda_runtime", 20, 1, correlation=2),
        _x("cuda_runtime", 50, 1, correlation=3),
        _x("cuda_runtime", 120, 1, correlation=4),
        _x("kernel", 1000, 100, correlation=1, stream=7),
        _x("kernel", 1200, 100, correlation=2, stream=7),
        _x("gpu_memcpy", 1050, 200, correlation=3, stream=8),
        _x("kernel", 1400, 100, correlation=4, stream=7),
        _x("gpu_memcpy", 2000, 1, correlation=9, stream=8, bytes=5),  # names stream 8
    ]
    got = gv.window_overlap(trace, markers={5: "h2d"})
    assert got["compute_stream"] == "7"  # 300 us of kernels against none elsewhere
    assert got["stream_names"] == {"7": "compute", "8": "h2d"}
    f0, f1 = got["windows"]
    # f0 spans its first to its last compute op: [1000, 1300] us; compute busy 100 + 100;
    # the copy [1050, 1250] coincides with compute on [1050, 1100] and [1200, 1250]
    assert f0["name"] == "f0"
    assert f0["span_ms"] == pytest.approx(0.3)
    assert f0["compute_busy_ms"] == pytest.approx(0.2)
    assert f0["copy_busy_ms"] == {"h2d": pytest.approx(0.2)}
    assert f0["overlapped_fraction"] == pytest.approx(100 / 200)
    assert f0["exposed_ms"] == pytest.approx(0.1)
    # f1 starts where f0's compute ended (1300) and ends at its kernel's end (1500)
    assert f1["span_ms"] == pytest.approx(0.2)
    assert f1["compute_busy_ms"] == pytest.approx(0.1)
    assert f1["copy_busy_ms"] == {} and f1["overlapped_fraction"] is None
    assert f1["exposed_ms"] == pytest.approx(0.1)


@pytest.mark.parametrize("layers", [4, 6, 8])
def test_every_plan_of_the_script_is_legal_without_a_solver(layers):
    gv = _module()
    adapter = SimpleNamespace(num_blocks=layers, config=SimpleNamespace(hidden_size=64),
                              params=SimpleNamespace(blocks=[SimpleNamespace(numel=1000)]),
                              hf_config_sha256="x")
    problem = gv.hand_problem(adapter, batch=1, seq=16, act_bytes=4, grad_accum=2)
    plans = {**gv.plan_matrix(layers), "overlap": gv.overlap_tiers(layers)}
    for name, (tiers, keep) in plans.items():
        plan = gv.plan_of(problem, tiers, keep)  # decisions_from_tiers + build_plan validate
        assert list(plan.tiers) == list(tiers) and tuple(plan.keep_internals) == tuple(keep), name
    mixed, keep = plans["mixed"]
    assert {"dram", "nvme", "hbm", "recompute"} <= set(mixed) and keep
    assert "recompute" in plans["overlap"][0] and "dram" in plans["overlap"][0]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_quick_ordering_section_passes_on_the_gpu(tmp_path):
    out = tmp_path / "result.json"
    proc = _run("--quick", "--only", "ordering", "--out", str(out), timeout=300)
    data = json.loads(out.read_text())
    assert proc.returncode == 0, json.dumps(data["sections"]["ordering"], indent=1)[:4000]


def test_window_totals_weight_the_overlap_by_copy_time():
    gv = _module()
    rows = [{"span_ms": 3.0, "compute_busy_ms": 2.0, "exposed_ms": 1.0, "overlapped_fraction": 0.5,
             "copy_busy_ms": {"h2d": 2.0}, "predicted": {"time_ms": 2.5, "exposed_ms": 0.5}},
            {"span_ms": 1.0, "compute_busy_ms": 1.0, "exposed_ms": 0.0, "overlapped_fraction": 1.0,
             "copy_busy_ms": {"h2d": 1.0, "d2h": 1.0}, "predicted": {"time_ms": 1.0,
                                                                    "exposed_ms": 0.0}},
            {"name": "pre", "span_ms": 9.0, "compute_busy_ms": 9.0, "exposed_ms": 0.0,
             "overlapped_fraction": None, "copy_busy_ms": {}}]  # no prediction: left out
    got = gv.window_totals(rows)
    assert got["span_ms"] == 4.0 and got["compute_busy_ms"] == 3.0 and got["exposed_ms"] == 1.0
    assert got["predicted_ms"] == 3.5 and got["predicted_exposed_ms"] == 0.5
    assert got["copy_busy_ms"] == 4.0
    assert got["overlapped_fraction"] == pytest.approx((2.0 * 0.5 + 2.0 * 1.0) / 4.0)


@pytest.mark.parametrize("rule", ["copy_waits_for_producer", "alloc_on_compute_then_copy_stream",
                                  "record_stream_keeps_memory", "host_write_after_h2d_sync",
                                  "host_read_after_d2h_event"])
def test_each_ordering_micro_test_is_judged_by_the_happens_before_checker(rule, monkeypatch):
    """The script's micro-tests, run on cpu-checked (the _sleep lag is a no-op there): as the
    runtime orders them there is no violation and the data is exact; without the rule the
    checker names the unordered access, so each micro-test really tests its rule."""
    from lazytrain.runtime.backends import make_device
    from lazytrain.runtime.hb_checker import OrderingViolation
    gv = _module()
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(gv, "_on", lambda stream: contextlib.nullcontext())
    assert gv.ORDERING_RULES[rule](make_device("cpu-checked"), 0, True, 1024)["exact"]
    with pytest.raises(OrderingViolation, match="is not ordered after"):
        gv.ORDERING_RULES[rule](make_device("cpu-checked"), 0, False, 1024)


def test_exposed_time_by_cause_by_hand():
    gv = _module()
    # idle [0, 100] and [200, 300] us; h2d busy [0, 60]; d2h [40, 100] and [250, 260]: copies
    # cover [0, 100] and [250, 260] of the idle time (110 us), h2d 60 us and d2h 70 us of it, so
    # h2d gets 60/130 and d2h 70/130 of 110 us; the other 90 us nothing ran: the host
    got = gv.exposed_by_cause([(0, 100), (200, 300)],
                              {"h2d": [(0, 60)], "d2h": [(40, 100), (250, 260)]})
    assert got == pytest.approx({"h2d": 0.110 * 60 / 130, "d2h": 0.110 * 70 / 130,
                                 "host": 0.090})
    assert gv.exposed_by_cause([(0, 50)], {}) == pytest.approx({"host": 0.05})
    assert gv.complement([(10, 20), (30, 40)], 0, 50) == [(0, 10), (20, 30), (40, 50)]


def test_the_hand_made_trace_attributes_each_windows_exposed_time():
    gv = _module()
    trace = [_x("user_annotation", 0, 100, name="lt_window:f0"),
             _x("user_annotation", 100, 100, name="lt_window:f1"),
             _x("cuda_runtime", 10, 1, correlation=1), _x("cuda_runtime", 20, 1, correlation=2),
             _x("cuda_runtime", 50, 1, correlation=3), _x("cuda_runtime", 120, 1, correlation=4),
             _x("kernel", 1000, 100, correlation=1, stream=7),
             _x("kernel", 1200, 100, correlation=2, stream=7),
             _x("gpu_memcpy", 1050, 200, correlation=3, stream=8),
             _x("kernel", 1400, 100, correlation=4, stream=7)]
    f0, f1 = gv.window_overlap(trace)["windows"]
    # f0: compute idle on [1100, 1200], all of it under the copy on stream 8
    assert f0["exposed_ms_by_cause"] == pytest.approx({"8": 0.1, "host": 0.0})
    # f1: idle on [1300, 1400] with no copy running: the GPU waited on the host
    assert f1["exposed_ms_by_cause"] == pytest.approx({"host": 0.1})
    totals = gv.window_totals([{**f0, "predicted": {"time_ms": 1.0, "exposed_ms": 0.0}},
                               {**f1, "predicted": {"time_ms": 1.0, "exposed_ms": 0.0}}])
    assert totals["exposed_ms_by_cause"] == pytest.approx({"8": 0.1, "host": 0.1})


def test_the_mfu_problem_is_llama3_8b_cut_to_8_layers_with_the_measured_host_rates():
    gv = _module()
    host = {"convert_gb_per_s": 3.0, "accumulate_gb_per_s": 2.0, "master_dtype": "fp32"}
    problem = gv.mfu_problem(gv.mfu_shape(False), host=host, hbm_gb=139, dram_gb=120)
    assert problem.num_blocks == 8 and problem.provenance["seq_len"] == 8192
    # q, o 4096^2 each; k, v 4096 x 1024 each; gate/up/down 3 x 4096 x 14336; two norms 4096
    assert problem.params_per_block == (2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336
                                        + 2 * 4096,) * 8
    # the rates measured in the run's dtypes reach the planner unchanged
    assert problem.host_convert_bytes_per_s == pytest.approx(3e9)
    assert problem.host_accumulate_bytes_per_s == pytest.approx(2e9)


def test_the_mfu_scenario_plans_without_a_solver(monkeypatch):
    gv = _module()
    for package in ("highspy", "pyscipopt"):
        monkeypatch.setitem(sys.modules, package, None)  # not installed, as on the GPU machine
    plan = gv.mfu_plan(gv.mfu_problem(gv.mfu_shape(True), hbm_gb=139, dram_gb=120),
                       time_limit_s=1.0)
    assert plan.provenance["milp_unavailable"].startswith("MILP unavailable")
    assert plan.solver.backend == "heuristic" and plan.bounds.lp_step_ms is None


def test_mfu_figures_by_hand():
    gv = _module()
    adapter = SimpleNamespace(num_blocks=2, config=SimpleNamespace(hidden_size=64),
                              params=SimpleNamespace(blocks=[SimpleNamespace(numel=1000)]),
                              hf_config_sha256="x")
    problem = gv.hand_problem(adapter, batch=1, seq=16, act_bytes=4, grad_accum=2)
    problem = dataclasses.replace(problem, model_flops_per_micro_batch=5e14)
    plan = gv.plan_of(problem, ["hbm"] * 3)
    f0 = plan.windows[0]
    got = gv.mfu_figures(problem, plan, step_s=2.0, gemm_peak_tflops=800.0,
                         rows=[{"name": "f0", "span_ms": 2 * f0.time_ms,
                                "exposed_ms_by_cause": {"host": 0.5}}])
    # 5e14 FLOPs x grad_accum 2 in 2 s: 500 TFLOPS
    assert got["model_tflops"] == pytest.approx(500.0)
    assert got["mfu_vs_h200_bf16_peak"] == pytest.approx(500 / 989.4)
    assert got["mfu_vs_measured_gemm_peak"] == pytest.approx(500 / 800)
    assert got["measured_over_predicted"] == pytest.approx(2000.0 / plan.predicted.step_ms)
    first = got["windows"][0]
    assert first["name"] == "f0" and first["measured_over_predicted"] == pytest.approx(2.0)
    assert first["exposed_ms_by_cause"] == {"host": 0.5}
    assert [w["measured_ms"] for w in got["windows"][1:]] == [None] * (len(plan.windows) - 1)


def test_the_three_answers_from_section_results():
    gv = _module()
    totals = {"span_ms": 100.0, "compute_busy_ms": 92.0, "copy_busy_ms": 80.0,
              "exposed_ms": 8.0, "exposed_ms_by_cause": {"h2d": 3.0, "host": 5.0}}
    sections = {"ordering": {"ok": True}, "gradients": {"ok": True},
                "trainer": {"ok": False, "checks": {"resume_matches_straight": False,
                                                    "failed_step_raises": True}},
                "mfu": {"ok": True, "totals": totals, "model_tflops": 400.0,
                        "mfu_vs_h200_bf16_peak": 0.40, "plan_predicts_step": True,
                        "planned_by": "heuristic"}}
    got = gv.answers(sections)
    assert got["correct"]["answer"] is False
    assert got["correct"]["failed_checks"] == {"trainer": ["resume_matches_straight"]}
    # 8 of 100 ms exposed: within the 10% the answer allows; 5 ms of it the host's
    assert got["overlapped"]["answer"] is True and got["overlapped"]["from"] == "mfu"
    assert got["overlapped"]["host_blocked_ms"] == 5.0
    assert got["mfu"]["answer"] == 0.40 and got["mfu"]["plan_predicts_it"] is True
    nothing = gv.answers({"mfu": {"ok": False, "status": "skipped", "error": "no CUDA device"}})
    assert nothing["correct"]["answer"] is None and nothing["overlapped"]["answer"] is None
    assert nothing["mfu"] == {"answer": None, "error": "no CUDA device"}


@pytest.mark.slow
def test_the_trainer_section_passes_on_the_cpu_backend(tmp_path, monkeypatch):
    """The section's runs (straight, resumed, a failed NVMe write in step 2 then a resume) on
    `cpu`: the flow the GPU run relies on works, and its checks pass where they must."""
    gv = _module()
    monkeypatch.setattr(gv, "TRAINER_DEVICE", "cpu")
    got = gv.trainer(SimpleNamespace(tmp=tmp_path))
    assert got["checks"] == {"straight_and_resumed_reach_4_steps": True,
                             "resume_matches_straight": True, "failed_step_raises": True,
                             "failed_run_resumes_to_4_steps": True}, got
    assert got["failed_step"]["raised"].startswith(("OSError", "NvmeIOError", "JobFailure")) \
        or "No space" in got["failed_step"]["raised"], got["failed_step"]
