"""The event simulator's host stream: weight conversion and gradient accumulation, against
timelines computed by hand and the evaluator's host-bound windows (docs/execution_model.md,
"Host work")."""

from __future__ import annotations

import pytest

from lazytrain.planner.plan import Plan
from lazytrain.planner.problem import PlanningProblem
from lazytrain.sim import disagreements, simulate

KB_PER_MS = 1e6
"""1e6 bytes/s = 1000 bytes per ms: a 1000-byte weight load takes exactly 1 ms on H2D."""


def _problem(**changes) -> PlanningProblem:
    """2 blocks: F = 1 ms, Fg = 1.5 ms, B = 2 ms, P = G = 1000 B (1 ms on H2D/D2H); host
    conversion 2e5 B/s (P: 5 ms), accumulation 2.5e5 B/s (G: 4 ms); embed 0.5 ms, head 1 ms."""
    base = dict(
        fwd_ms=(1.0,) * 2, fwd_grad_ms=(1.5,) * 2, bwd_ms=(2.0,) * 2,
        weight_bytes=(1000,) * 2, grad_bytes=(1000,) * 2, internal_bytes=(0,) * 2,
        boundary_bytes=(1000,) * 3, params_per_block=(10,) * 2,
        embed_ms=0.5, head_ms=1.0,
        h2d_bytes_per_s=KB_PER_MS, d2h_bytes_per_s=KB_PER_MS, duplex_bytes_per_s=2 * KB_PER_MS,
        nvme_read_bytes_per_s=KB_PER_MS, nvme_write_bytes_per_s=KB_PER_MS,
        host_convert_bytes_per_s=2e5, host_accumulate_bytes_per_s=2.5e5,
        hbm_bytes=10**12, dram_bytes=10**12, nvme_bytes=10**12)
    base.update(changes)
    return PlanningProblem(**base)


ALL_HBM = Plan(tiers=("hbm", "hbm", "hbm"))


def test_host_work_longer_than_compute_ends_the_gpu_windows():
    r = simulate(_problem(), ALL_HBM)
    # pre:  embed 0.5 || W0 1 ms || convert W0 1000 B / 2e5 B/s = 5 ms        -> [0, 5]
    # f0:   F0 1 ms || W1 1 ms || convert W1 5 ms                             -> [5, 10]
    # f1:   F1 1 ms (nothing to load or convert)                              -> [10, 11]
    # turn: head 1 || W1 for backward 1 || convert it 5 ms                    -> [11, 16]
    # b1:   Fg1 + B1 = 3.5 || W0 1 || convert W0 5 ms                         -> [16, 21]
    # b0:   Fg0 + B0 = 3.5 || drain G1 1 || accumulate G1 1000 / 2.5e5 = 4 ms -> [21, 25]
    # post: drain G0 1 ms || accumulate G0 4 ms                               -> [25, 29]
    ends = {w.name: w.end_ms for w in r.windows}
    assert ends == pytest.approx({"pre": 5.0, "f0": 10.0, "f1": 11.0, "turn": 16.0,
                                  "b1": 21.0, "b0": 25.0, "post": 29.0})
    assert r.window("b1").exposed_by_channel["host"] == pytest.approx(1.5)  # 5 - 3.5
    assert r.window("b0").exposed_by_channel["host"] == pytest.approx(0.5)  # 4 - 3.5
    assert "on host" in r.explain("f0")


def test_simulator_and_evaluator_agree_on_the_host_bound_windows():
    from lazytrain.planner.evaluate import evaluate

    p = _problem()
    ev = evaluate(p, ALL_HBM)
    assert ev.binding_by_window == ("host", "compute", "host", "host", "host")
    assert [w.time_ms for w in ev.windows] == pytest.approx([5.0, 1.0, 5.0, 5.0, 4.0])
    assert disagreements(p, ALL_HBM) == []


def test_on_a_cpu_the_host_work_shares_the_one_resource():
    r = simulate(_problem(copies_overlap_compute=False), ALL_HBM)
    # everything runs one after the other: pre 0.5 + 1 + 5 = 6.5; f0 1 + 1 + 5 = 7; f1 1;
    # turn 1 + 1 + 5 = 7; b1 3.5 + 1 + 5 = 9.5; b0 3.5 + 1 + 4 = 8.5; post 1 + 4 = 5
    times = {w.name: w.time_ms for w in r.windows}
    assert times == pytest.approx({"pre": 6.5, "f0": 7.0, "f1": 1.0, "turn": 7.0, "b1": 9.5,
                                   "b0": 8.5, "post": 5.0})
    assert r.step_ms == pytest.approx(44.5)
    assert disagreements(_problem(copies_overlap_compute=False), ALL_HBM) == []


def test_without_host_rates_there_is_no_host_task():
    p = _problem(host_convert_bytes_per_s=0.0, host_accumulate_bytes_per_s=0.0)
    r = simulate(p, ALL_HBM)
    assert not [e for e in r.events if e.stream == "host"]
    assert r.step_ms == pytest.approx(12.0)  # the hand timeline of tests/sim/test_simulate.py
