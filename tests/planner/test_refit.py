"""Refit of compute and bandwidths from measured windows, against hand-computed least squares."""

from __future__ import annotations

import json

import pytest

from lazytrain.planner.evaluate import build_plan, decisions_from_tiers
from lazytrain.planner.plan import SolveRecord
from lazytrain.planner.problem import PlanningProblem
from lazytrain.planner.refit import (
    design_rows, fit_bandwidths, fit_compute, load_windows, problem_with_rates, refit_profile,
)

L = 3


def _problem(**kw) -> PlanningProblem:
    base = dict(fwd_ms=(1.0,) * L, fwd_grad_ms=(1.2,) * L, bwd_ms=(2.0,) * L,
                weight_bytes=(100,) * L, grad_bytes=(100,) * L, internal_bytes=(10,) * L,
                boundary_bytes=(50,) * (L + 1), params_per_block=(25,) * L,
                h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9, duplex_bytes_per_s=1.5e9,
                nvme_read_bytes_per_s=1e9, nvme_write_bytes_per_s=1e9,
                copies_overlap_compute=False, hbm_bytes=10**12, dram_bytes=10**12,
                nvme_bytes=10**12)
    base.update(kw)
    return PlanningProblem(**base)


def _plan(tiers, keep=()):
    p = _problem()
    return build_plan(p, decisions_from_tiers(p, tiers, keep), solver=SolveRecord(backend="manual"))


def _w(name, compute_ms):
    return {"name": name, "compute_ms": compute_ms}


def test_design_rows_follow_the_execution_model_per_window():
    _, rows = design_rows(_plan(("hbm", "recompute", "hbm", "hbm"), keep=(2,)), ["dense"] * 3)
    assert rows["f2"] == {("fwd_grad_ms", "dense"): 1.0}       # kept block
    assert rows["b2"] == {("bwd_ms", "dense"): 1.0}            # no re-forward
    assert rows["b1"] == {("bwd_ms", "dense"): 1.0, ("fwd_grad_ms", "dense"): 1.0,
                          ("fwd_ms", "dense"): 1.0}            # segment (0, 2) recomputes block 0
    assert rows["turn"] == {("head_ms",): 1.0}


def test_a_fully_determined_design_recovers_the_times_exactly():
    plan = _plan(("hbm", "recompute", "hbm", "hbm"), keep=(2,))
    F, Fg, B, head = 1.0, 1.3, 2.0, 3.0
    ws = [_w("f0", F), _w("f1", F), _w("f2", Fg), _w("turn", head), _w("b2", B),
          _w("b1", B + Fg + F), _w("b0", B + Fg), _w("pre", 99.0)]
    fit = fit_compute(plan, ["dense"] * 3, ws, lam=0.0)
    assert fit.kinds["dense"] == pytest.approx({"fwd_ms": F, "fwd_grad_ms": Fg, "bwd_ms": B},
                                               abs=1e-9)
    assert fit.head_ms == pytest.approx(head) and fit.rows == 7 and fit.rms_ms < 1e-9


def test_overdetermined_compute_equals_the_hand_solved_normal_equations():
    # Rows: F = 1.0, 1.2, 1.1 (f0..f2); S = B + Fg = 5.0 (b2), 5.2 (b0); S + F = 6.4 (b1).
    # Normal equations: 4F + S = 9.7 and F + 3S = 16.6  =>  F = 12.5 / 11, S = 9.7 - 4F.
    plan = _plan(("hbm", "recompute", "hbm", "hbm"))
    ws = [_w("f0", 1.0), _w("f1", 1.2), _w("f2", 1.1), _w("turn", 3.0), _w("b2", 5.0),
          _w("b1", 6.4), _w("b0", 5.2)]
    prior = {"dense": {"fwd_ms": 1.0, "fwd_grad_ms": 1.0, "bwd_ms": 4.0}}
    fit = fit_compute(plan, ["dense"] * 3, ws, prior=prior, prior_head_ms=2.0)
    F = 12.5 / 11
    k = fit.kinds["dense"]
    assert k["fwd_ms"] == pytest.approx(F, rel=1e-3)
    assert k["fwd_grad_ms"] + k["bwd_ms"] == pytest.approx(9.7 - 4 * F, rel=1e-3)
    assert fit.head_ms == pytest.approx(3.0, rel=1e-3)
    # B and Fg are not separable here: the ridge keeps B / Fg near the prior's split (4 : 1)
    assert k["bwd_ms"] / k["fwd_grad_ms"] == pytest.approx(4.0, rel=0.05)


def test_cpu_bandwidth_is_the_through_origin_fit_of_wait_on_bytes():
    ws = [{"bytes": {"nvme_read": 1e6}, "wait_ms": {"nvme_read": 1.0}},
          {"bytes": {"nvme_read": 2e6}, "wait_ms": {"nvme_read": 3.0}},
          {"bytes": {"h2d": 0}, "wait_ms": {"h2d": 5.0}}]
    rates = fit_bandwidths(ws, copies_overlap_compute=False)
    # inv_bw = (1e6 * 1e-3 + 2e6 * 3e-3) / (1e12 + 4e12) s/B
    assert rates["nvme_read"] == pytest.approx(5e12 / 7e3)
    assert rates["h2d"] is None and rates["d2h"] is None


def test_gpu_bandwidth_uses_the_wall_time_of_windows_that_waited_for_the_channel():
    ws = [{"wall_ms": 4.0, "bytes": {"h2d": 4e6}, "wait_ms": {"h2d": 1.0}},
          {"wall_ms": 9.0, "bytes": {"h2d": 1e6}, "wait_ms": {"h2d": 0.0}}]   # compute-bound
    assert fit_bandwidths(ws, copies_overlap_compute=True)["h2d"] == pytest.approx(1e9)


def test_gpu_bandwidth_leaves_out_host_blocks_on_other_channels():
    # window 1: wall 7 of which 3 ms blocked on the optimizer -> t = 4 ms for 4 MB;
    # window 2: wall 8 of which 4 ms blocked on the h2d itself -> t = 8 ms for 8 MB.
    # inv_bw = (4e6 * 4e-3 + 8e6 * 8e-3) / (16e12 + 64e12) = 1e-9 s/B
    ws = [{"wall_ms": 7.0, "bytes": {"h2d": 4e6}, "wait_ms": {"h2d": 1.0, "optimizer": 3.0},
           "host_blocked_on_ms": {"optimizer": 3.0, "h2d": 0.0}},
          {"wall_ms": 8.0, "bytes": {"h2d": 8e6}, "wait_ms": {"h2d": 4.0},
           "host_blocked_on_ms": {"h2d": 4.0, "optimizer": 0.0}}]
    assert fit_bandwidths(ws, copies_overlap_compute=True)["h2d"] == pytest.approx(1e9)


def test_refit_profile_replaces_measured_entries_and_keeps_the_rest():
    plan = _plan(("hbm", "recompute", "hbm", "hbm"), keep=(2,))
    ws = [_w("f0", 1.0), _w("f1", 1.0), _w("f2", 1.3), _w("turn", 3.0), _w("b2", 2.0),
          _w("b1", 4.3), _w("b0", 3.3)]
    ws[0].update(bytes={"d2h": 2e6}, wait_ms={"d2h": 4.0})
    prof = {"version": 1, "seq_len": 8, "micro_batch": 1, "compute_dtype": "fp32",
            "block_kinds": {"dense": {"fwd_ms": 9, "fwd_grad_ms": 9, "bwd_ms": 9,
                                      "workspace_bytes": 7}},
            "bandwidths": {"h2d_gb_per_s": 3.0, "d2h_gb_per_s": 3.0}}
    out = refit_profile(prof, plan, ["dense"] * 3, ws, copies_overlap_compute=False)
    json.dumps(out)
    assert out["block_kinds"]["dense"]["fwd_ms"] == pytest.approx(1.0, rel=1e-3)
    assert out["block_kinds"]["dense"]["workspace_bytes"] == 7
    assert out["bandwidths"] == {"h2d_gb_per_s": 3.0, "d2h_gb_per_s": pytest.approx(0.5)}
    assert prof["block_kinds"]["dense"]["fwd_ms"] == 9  # input untouched


def test_problem_with_rates_replaces_only_measured_channels_and_keeps_duplex_consistent():
    p = _problem()
    q = problem_with_rates(p, {"nvme_read": 1e6, "h2d": 2e9, "d2h": None}, compute_scale=2.0)
    assert q.nvme_read_bytes_per_s == 1e6 and q.d2h_bytes_per_s == p.d2h_bytes_per_s
    assert q.h2d_bytes_per_s == 2e9 and q.duplex_bytes_per_s == 2e9
    assert q.fwd_ms == (2.0,) * L and q.nvme_write_bytes_per_s == p.nvme_write_bytes_per_s


def test_load_windows_skips_a_torn_last_line_left_by_a_crash_mid_append(tmp_path):
    records = [{"step": 0, "micro_batch": 0, "windows": [_w("f0", 1.0)]},
               {"step": 1, "micro_batch": 0, "windows": [_w("f0", 1.1)]}]
    path = tmp_path / "windows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 2, "windo')
    assert load_windows(path) == records


def test_load_windows_names_the_fix_when_the_run_has_no_windows(tmp_path):
    with pytest.raises(FileNotFoundError, match="instrumentation"):
        load_windows(tmp_path / "windows.jsonl")


def test_problem_with_rates_scales_the_truncated_reforward_with_the_other_compute():
    p = _problem().replace(reforward_ms=(0.75,) * L)
    q = problem_with_rates(p, {}, compute_scale=2.0)
    assert q.reforward == (1.5,) * L  # 2 x 0.75 ms, as fwd_ms 1 -> 2
