"""Fluid window evaluator against windows computed by hand (docs/execution_model.md)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from lazytrain.planner.evaluate import (
    Decisions, build_plan, checkpoint_bytes, decisions_from_tiers, evaluate,
)
from lazytrain.planner.schedule import schedule_transfers
from lazytrain.planner.plan import Plan, PlanValidationError, SolveRecord, Transfer
from lazytrain.planner.windows import legal_ords, window_names, window_ord
from lazytrain.planner.problem import PlanningProblem

U = 10**7  # byte unit: 1 "u" = 1e7 bytes; bandwidth 1e4 u/s, so 100 u = 10 ms on H2D/D2H
MANUAL = SolveRecord(backend="manual")


def _problem(**kw) -> PlanningProblem:
    """3 blocks. F=10, Fg=12, B=20 ms; P=200u (20 ms H2D), G=100u (10 ms D2H), A=50u (5 ms),
    I=30u; duplex 2e4 u/s (the cap does not bind: `test_duplex_cap_shares_fairly_by_hand`
    binds it); embed 1 ms, head 4 ms, const 3 ms; fixed HBM 1000u; grad_accum 2."""
    base = dict(
        fwd_ms=(10.0,) * 3, fwd_grad_ms=(12.0,) * 3, bwd_ms=(20.0,) * 3,
        weight_bytes=(200 * U,) * 3, grad_bytes=(100 * U,) * 3, internal_bytes=(30 * U,) * 3,
        boundary_bytes=(50 * U,) * 4, params_per_block=(10**8,) * 3, ends_params=10**7,
        embed_ms=1.0, head_ms=4.0, const_ms=3.0,
        h2d_bytes_per_s=1e4 * U, d2h_bytes_per_s=1e4 * U, duplex_bytes_per_s=2e4 * U,
        nvme_read_bytes_per_s=5e3 * U, nvme_write_bytes_per_s=5e3 * U,
        hbm_bytes=2000 * U, fixed_hbm_bytes=1000 * U, dram_bytes=10**11, nvme_bytes=10**11,
        nvme_staging_bytes=10 * U, host_bytes_per_param=12.0, host_bytes_per_param_q8=10.0,
        drain_windows=2, prefetch_windows=2, nvme_lead_windows=1, grad_accum=2,
        tokens_per_micro_batch=447, model_flops_per_micro_batch=447e9,
        hardware_flops_per_micro_batch_base=1e12, block_fwd_flops=(1e11,) * 3,
    )
    base.update(kw)
    return PlanningProblem(**base)


def _t(boundary, kind, window, fraction=1.0):
    return Transfer(boundary=boundary, kind=kind, window=window, fraction=fraction)


# Boundary 0 recompute (re-embedded), boundary 1 dram (d2h in f1, h2d in turn), boundary 2
# recomputed inside segment (1, 3) of length 2, boundary 3 hbm; block 2 keeps its internals.
HAND = Decisions(tiers=("recompute", "dram", "recompute", "hbm"), keep_internals=(2,),
                 transfers=(_t(1, "d2h", "f1"), _t(1, "h2d", "turn")))

# Work per window (compute ms, H2D u, D2H u):
#   f0:   F0 = 10;                 H2D P1 = 200
#   f1:   F1 = 10;                 H2D P2 = 200;  D2H A1 = 50 (d2h)
#   f2:   Fg2 = 12 (kept);         H2D none (j+1 = L)
#   turn: head 4;                  H2D P2 skipped (resident) + A1 = 50 (h2d)
#   b2:   B2 + recompute F1 = 30 (no Fg2: kept); H2D P1 + re-stream P1 = 400; D2H none
#   b1:   B1 + Fg1 = 32;           H2D P0 = 200;  D2H G2 = 100
#   b0:   B0 + Fg0 + embed = 33;   H2D none;      D2H G1 = 100
COMPUTE = [10, 10, 12, 4, 30, 32, 33]
H2D = [200, 200, 0, 50, 400, 200, 0]
D2H = [0, 50, 0, 0, 0, 100, 100]
# GPU: max(comp, h2d/10, d2h/10, in-window order) (the duplex cap 20 u/ms does not bind):
#   f0 max(10, 20, 0) = 20;  f1 max(10, 20, 5) = 20;  f2 12;  turn max(4, 5) = 5
#   b2: the recompute of block 1 waits on H2D for P1 (next block, 20 ms) and its own P1
#       (20 ms), then F1 10 and B2 20 (kept: no Fg2): 70 > max(30, 40, 0)
#   b1 max(32, 20, 10) = 32;   b0 max(33, 0, 10) = 33
GPU_TIMES = [20, 20, 12, 5, 70, 32, 33]  # sum 192
# CPU: comp + h2d/10 + d2h/10: 30, 35, 12, 9, 70, 62, 43 (sum 261)
CPU_TIMES = [30, 35, 12, 9, 70, 62, 43]
# grad_accum 2: micro-batch 0's pre loads P0, its post drains G0 and prefetches P0 for
# micro-batch 1, whose pre is the embedding alone and whose post drains G0.
# pre (load): GPU max(embed 1, P0/10 = 20) = 20 (the load runs beside the embedding), CPU 21;
# pre (next): 1; post: G0/10 = 10; post (prefetch): GPU max(P0 20, G0 10, duplex 20) = 20
# (own rates 10 + 10 within the cap 20), CPU 20 + 10 = 30.
# ends: GPU 20 + 20 + 1 + 10 = 51, CPU 21 + 30 + 1 + 10 = 62.


def test_gpu_windows_match_hand_computation():
    ev = evaluate(_problem(), HAND)
    assert [w.name for w in ev.windows] == window_names(3)
    assert [w.compute_ms for w in ev.windows] == pytest.approx(COMPUTE)
    assert [w.h2d_bytes / U for w in ev.windows] == pytest.approx(H2D)
    assert [w.d2h_bytes / U for w in ev.windows] == pytest.approx(D2H)
    assert [w.time_ms for w in ev.windows] == pytest.approx(GPU_TIMES)
    assert [w.exposed_ms for w in ev.windows] == pytest.approx(
        [g - c for g, c in zip(GPU_TIMES, COMPUTE)])
    assert ev.micro_step_ms == pytest.approx(192 + 51 / 2)       # 217.5
    assert ev.step_ms == pytest.approx(2 * 192 + 51 + 3)         # 438


def test_duplex_cap_shares_fairly_by_hand():
    # cap 15 u/ms under 10 + 10 of own rates: while both copy each gets 7.5 u/ms.
    # f1: A1 50u ends at 50/7.5 = 6.67 ms, P2 then has 150u left alone at 10 u/ms: 21.67 ms
    #     (the fluid (200 + 50)/15 = 16.7 and P2 alone 20 ms were short of it);
    # b1: G2 100u ends at 13.3 ms, P0's last 100u take 10 ms more: 23.3 < compute 32;
    # f0, turn: one direction only (20 and 5 ms).
    ev = evaluate(_problem(duplex_bytes_per_s=1.5e4 * U), HAND)
    w = {x.name: x for x in ev.windows}
    assert w["f1"].time_ms == pytest.approx(50 / 7.5 + 15)
    assert [w[n].time_ms for n in ("f0", "turn", "b1")] == pytest.approx([20, 5, 32])
    assert ev.binding_by_window[1] == "duplex"
    # post (prefetch): P0 200u and G0 100u share 7.5 u/ms each until G0 ends (13.3 ms), then
    # P0's last 100u alone at 10 u/ms: 23.3 ms; ends 20 + 23.3 + 1 + 10
    ends = 20 + (100 / 7.5 + 10) + 1 + 10
    assert ev.micro_step_ms == pytest.approx(192 + (50 / 7.5 + 15 - 20) + ends / 2)


def test_cpu_windows_add_channel_times_to_compute():
    ev = evaluate(_problem(copies_overlap_compute=False), HAND)
    assert [w.time_ms for w in ev.windows] == pytest.approx(CPU_TIMES)
    assert ev.step_ms == pytest.approx(2 * 261 + 62 + 3)  # 587


def test_checkpoint_bytes_follow_the_holding_intervals():
    # boundary 0 recompute in (0,1): [use=6, 6]; boundary 1 dram: [1, 1] and [3, 5];
    # boundary 2 recompute in (1,3): [use=4, 4]; boundary 3: [3, 3].
    ev = evaluate(_problem(), HAND)
    held = [w.hbm_checkpoint_bytes / U for w in ev.windows]
    assert held == pytest.approx([0, 50, 0, 100, 100, 50, 50])
    # peak = fixed 1000 + held + keep term (I2 + P2 = 230 over ords 2..4)
    assert [b / U for b in ev.hbm_by_window] == pytest.approx(
        [1000, 1050, 1230, 1330, 1330, 1050, 1050])
    assert ev.peak_hbm_bytes == pytest.approx(1330 * U)


def test_predicted_throughput_and_host_bytes():
    # block 0's 8-bit states for the DRAM count; their update time (tests/planner/test_q8_update
    # _time.py) is switched off and const_ms is 12 so that the step is 2 x 192 + 51 + 12 = 447 ms
    ev = evaluate(_problem(q8_update_ms_per_gparam=0.0, const_ms=12.0),
                  dataclasses.replace(HAND, q8_blocks=(0,)))
    # step 0.447 s: model 447e9 * 2 / 0.447 s = 2 TFLOPS; tokens 447 * 2 / 0.447 = 2000/s;
    # hardware: base 1e12 + re-forward of blocks 0, 1 (2e11) + segment recompute of block 1
    # (1e11) = 1.3e12 per micro-batch, 2.6e12 per step -> 2.6 / 0.447 TFLOPS.
    assert ev.model_tflops == pytest.approx(2.0)
    assert ev.tokens_per_s == pytest.approx(2000.0)
    assert ev.hardware_flops == pytest.approx(2.6e12)
    assert ev.hardware_tflops == pytest.approx(2.6 / 0.447)
    # DRAM: A1 50u + staging 10u + states 1e8 * (10 + 12 + 12) + 1e7 * 12 = 3.52e9
    assert ev.dram_bytes == pytest.approx(60 * U + 3.4e9 + 1.2e8)
    assert ev.nvme_bytes == 0


def test_capacity_violations_name_budget_window_and_shortfall():
    ev = evaluate(_problem(hbm_bytes=1300 * U, dram_bytes=3 * 10**9), HAND)
    assert not ev.feasible
    assert ev.violations[0].startswith("HBM short by 0.30 GB in window turn")
    # DRAM need: 0.5 + 0.1 + 3.6 + 0.12 = 4.32 GB vs 3 GB
    assert ev.violations[1].startswith("DRAM short by 1.32 GB")


def test_nvme_boundary_loads_the_nvme_channels_and_chains_serially_in_one_window():
    # boundary 0 nvme in segment (0, 3): use = 2*3 - 3 + 1 = 4 (b2). NVMe at 500 u/s.
    # f0: d2h A0 50u = 5 ms, then (same window: no pipelining) its NVMe write 100 ms -> 105.
    # turn: NVMe read 50u = 100 ms, then its h2d 5 ms, then the load of P2 20 ms -> 125.
    d = Decisions(tiers=("nvme", "recompute", "recompute", "hbm"),
                  transfers=(_t(0, "d2h", "f0"), _t(0, "nvme_write", "f0"),
                             _t(0, "nvme_read", "turn"), _t(0, "h2d", "turn")))
    ev = evaluate(_problem(nvme_read_bytes_per_s=500 * U, nvme_write_bytes_per_s=500 * U), d)
    w = {x.name: x for x in ev.windows}
    assert w["f0"].nvme_write_bytes == 50 * U and w["turn"].nvme_read_bytes == 50 * U
    assert w["f0"].time_ms == pytest.approx(105.0)
    assert w["turn"].time_ms == pytest.approx(125.0)
    assert ev.nvme_bytes == 50 * U
    # b2 recomputes blocks 0 and 1 (F0 + F1 = 20) and re-streams P0 + P1 (400u) plus the usual
    # P1 (200u): compute 20 + B2 + Fg2 = 52, H2D 600u = 60 ms. In order: P1 20 ms, then
    # max(P0 20 + F0 10 + F1 10, P0 + P1 40 + F1 10) = 50, then Fg2 + B2 32 -> 102.
    assert w["b2"].compute_ms == pytest.approx(52.0)
    assert w["b2"].time_ms == pytest.approx(102.0)


def test_build_plan_round_trips_and_keeps_the_evaluation(tmp_path):
    plan = build_plan(_problem(), HAND, solver=MANUAL)
    assert plan.predicted.step_ms == pytest.approx(438.0)
    assert plan.provenance["horizons"] == {"drain_windows": 2, "prefetch_windows": 2,
                                           "nvme_lead_windows": 1}
    again = Plan.load(plan.save(tmp_path / "plan.json"))
    assert again == plan
    assert evaluate(_problem(), again).step_ms == pytest.approx(438.0)


def test_build_plan_rejects_a_plan_reading_an_unwritten_checkpoint():
    # nvme_read in turn (ord 3) but the NVMe write runs in b2 (ord 4): nothing written by turn.
    d = Decisions(tiers=("nvme", "recompute", "recompute", "hbm"),
                  transfers=(_t(0, "d2h", "f0"), _t(0, "nvme_write", "f2"),
                             _t(0, "nvme_read", "f1"), _t(0, "h2d", "turn")))
    with pytest.raises(PlanValidationError, match=r"boundary 0: nvme_read in window f1 reads "
                                                  r"1.00 of the checkpoint but only 0.00"):
        build_plan(_problem(), d, solver=MANUAL)


ALL_TIER_CASES = {
    "all-hbm": ("hbm", "hbm", "hbm", "hbm"),
    "all-dram": ("dram", "dram", "dram", "hbm"),
    "all-nvme": ("nvme", "nvme", "nvme", "hbm"),
    "one-segment": ("recompute", "recompute", "recompute", "hbm"),
    "mixed": ("nvme", "dram", "recompute", "hbm"),
    "mixed-2": ("dram", "recompute", "nvme", "hbm"),
}


@pytest.mark.parametrize("gpu", [True, False], ids=["gpu", "cpu"])
@pytest.mark.parametrize("horizon", [1, 3], ids=["h1", "h3"])
@pytest.mark.parametrize("case", sorted(ALL_TIER_CASES))
def test_scheduled_plans_validate_for_every_tier_mix(case, horizon, gpu):
    p = _problem(drain_windows=horizon, prefetch_windows=horizon, nvme_lead_windows=horizon - 1,
                 copies_overlap_compute=gpu)
    tiers = ALL_TIER_CASES[case]
    keep = (2,) if tiers[3] != "recompute" else ()
    plan = build_plan(p, decisions_from_tiers(p, tiers, keep), solver=MANUAL)
    assert plan.tiers == tiers and plan.keep_internals == keep == plan.resident_weights


def test_every_tier_assignment_of_four_blocks_schedules_legally():
    p = _problem(fwd_ms=(10.0,) * 4, fwd_grad_ms=(12.0,) * 4, bwd_ms=(20.0,) * 4,
                 weight_bytes=(200 * U,) * 4, grad_bytes=(100 * U,) * 4,
                 internal_bytes=(30 * U,) * 4, boundary_bytes=(50 * U,) * 5,
                 params_per_block=(10**8,) * 4, block_fwd_flops=(1e11,) * 4,
                 drain_windows=1, prefetch_windows=1, nvme_lead_windows=0)
    for head in itertools.product(("hbm", "dram", "nvme", "recompute"), repeat=4):
        build_plan(p, decisions_from_tiers(p, head + ("hbm",)), solver=MANUAL)


def test_cpu_schedule_drains_at_production_and_prefetches_just_before_use():
    p = _problem(copies_overlap_compute=False)
    tr = schedule_transfers(p, ("dram", "nvme", "recompute", "hbm"))
    # boundary 0: segment (0,1), use = 6 (b0); boundary 1: segment (1,3), use = 4 (b2).
    # Boundary 1's NVMe write goes to the window after its d2h (f2); its read is legal in
    # ords 1..3 and must follow the write: turn; no h2d window after turn is legal (use - 1
    # = 3), so the h2d shares turn with the read (the fallback of a short model).
    got = {(t.boundary, t.kind): (t.window, t.fraction) for t in tr}
    assert got == {(0, "d2h"): ("f0", 1.0), (0, "h2d"): ("b1", 1.0),
                   (1, "d2h"): ("f1", 1.0), (1, "nvme_write"): ("f2", 1.0),
                   (1, "nvme_read"): ("turn", 1.0), (1, "h2d"): ("turn", 1.0)}


def test_gpu_schedule_spreads_a_slow_nvme_read_over_window_slack():
    # 5 blocks; boundary 0 nvme in segment (0, 5), use = 2*5 - 5 + 1 = 6 (b4). H_p = 2, H_n = 3:
    # d2h in f0, NVMe write from f1 on, h2d in f4 (turn's H2D is full with P4), reads after
    # the write and before the h2d (no same-window chain): f2, f3. At 500 u/s a 50u read takes
    # 100 ms, far more than any window's slack (20 ms x 500 u/s = 10u), so the scheduler
    # spreads it over both.
    L = 5
    p = _problem(fwd_ms=(10.0,) * L, fwd_grad_ms=(12.0,) * L, bwd_ms=(20.0,) * L,
                 weight_bytes=(200 * U,) * L, grad_bytes=(100 * U,) * L,
                 internal_bytes=(30 * U,) * L, boundary_bytes=(50 * U,) * (L + 1),
                 params_per_block=(10**8,) * L, block_fwd_flops=(1e11,) * L,
                 nvme_read_bytes_per_s=500 * U, prefetch_windows=2, nvme_lead_windows=3)
    tiers = ("nvme",) + ("recompute",) * (L - 1) + ("hbm",)
    tr = schedule_transfers(p, tiers)
    build_plan(p, Decisions(tiers=tiers, transfers=tr), solver=MANUAL)
    reads = [t for t in tr if t.kind == "nvme_read"]
    assert sorted(t.window for t in reads) == ["f2", "f3"]
    assert sum(t.fraction for t in reads) == pytest.approx(1.0)
    ords = {k: [window_ord(t.window, L) for t in tr if t.kind == k]
            for k in ("d2h", "nvme_write", "nvme_read", "h2d")}
    assert max(ords["d2h"]) < min(ords["nvme_write"])
    assert max(ords["nvme_write"]) < min(ords["nvme_read"])
    assert max(ords["nvme_read"]) < min(ords["h2d"])
    hz = dict(drain_windows=2, prefetch_windows=2, nvme_lead_windows=3)
    for t in tr:
        assert window_ord(t.window, L) in legal_ords(t.kind, t.boundary, L, L, **hz)


@pytest.mark.parametrize("horizon", [1, 3], ids=["h1", "h3"])
def test_no_scheduled_chain_shares_its_sources_window_when_a_later_one_is_legal(horizon):
    # 4 blocks, every tier mix: a dram h2d after its d2h's window (the runtime would adopt the
    # HBM copy there and move nothing); NVMe: write after d2h, read after write, h2d after read
    L = 4
    p = _problem(fwd_ms=(10.0,) * L, fwd_grad_ms=(12.0,) * L, bwd_ms=(20.0,) * L,
                 weight_bytes=(200 * U,) * L, grad_bytes=(100 * U,) * L,
                 internal_bytes=(30 * U,) * L, boundary_bytes=(50 * U,) * (L + 1),
                 params_per_block=(10**8,) * L, block_fwd_flops=(1e11,) * L,
                 drain_windows=horizon, prefetch_windows=horizon, nvme_lead_windows=horizon)
    chain = {"nvme_write": "d2h", "nvme_read": "nvme_write"}
    for head in itertools.product(("hbm", "dram", "nvme", "recompute"), repeat=L):
        tiers = head + ("hbm",)
        ords: dict = {}
        for t in schedule_transfers(p, tiers):
            ords.setdefault((t.boundary, t.kind), []).append(window_ord(t.window, L))
        for (i, kind), got in ords.items():
            src = chain.get(kind) or ({"dram": "d2h", "nvme": "nvme_read"}[tiers[i]]
                                      if kind == "h2d" else None)
            if src is None:
                continue
            later = [o for o in legal_ords(kind, i, Plan(tiers=tiers).segment_end_of(i), L,
                                           drain_windows=horizon, prefetch_windows=horizon,
                                           nvme_lead_windows=horizon)
                     if o > max(ords[i, src])]
            if tiers[i] == "dram" or later:
                assert min(got) > max(ords[i, src]), (tiers, i, kind)
