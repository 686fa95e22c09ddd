"""The evaluator prices save levels as docs/execution_model.md "Save levels" says, checked
against windows computed by hand: f{j} runs Fg at L1/L2; b{j} re-forwards Fg with no levels, Fr
at L0, Fr1 at L1, nothing at L2; a dram-tier block's internals move in the windows its
transfers name, HBM holds them until the last d2h and from the first h2d, DRAM from the first
d2h to the last h2d."""

from __future__ import annotations

import pytest

from lazytrain.planner.evaluate import Decisions, build_plan, decisions_from_tiers, evaluate
from lazytrain.planner.heuristics import best_fixed_k_plan, megatrain_plan
from lazytrain.planner.plan import InternalTransfer, SolveRecord
from lazytrain.planner.problem import PlanningProblem

H = "hbm"
NAMES = ("f0", "f1", "f2", "turn", "b2", "b1", "b0")  # ords 0..6 of L = 3


def _problem(**kw) -> PlanningProblem:
    """Three blocks on a GPU, every link 10 GB/s (1e8 bytes: 10 ms), the duplex cap 20 GB/s
    (both directions at their own rate), no host work, no window overhead.

    F = 10, Fg = 12, Fr = 9, Fr1 = 5, B = 20 ms per block; head 15 ms, embed 0;
    P = G = 1e8 bytes; A = 1e7 bytes per boundary; S1 = 2e8, S2 = 3e8 bytes;
    fixed HBM 1e9 bytes; 5e7 parameters per block at 16 host bytes each."""
    fields = dict(
        fwd_ms=(10.0,) * 3, fwd_grad_ms=(12.0,) * 3, bwd_ms=(20.0,) * 3,
        reforward_ms=(9.0,) * 3, reforward_l1_ms=(5.0,) * 3,
        saved_bytes=((200_000_000, 300_000_000),) * 3,
        weight_bytes=(100_000_000,) * 3, grad_bytes=(100_000_000,) * 3,
        internal_bytes=(400_000_000,) * 3, boundary_bytes=(10_000_000,) * 4,
        params_per_block=(50_000_000,) * 3, head_ms=15.0,
        h2d_bytes_per_s=10e9, d2h_bytes_per_s=10e9, duplex_bytes_per_s=20e9,
        nvme_read_bytes_per_s=10e9, nvme_write_bytes_per_s=10e9,
        hbm_bytes=2_000_000_000, fixed_hbm_bytes=1_000_000_000, dram_bytes=10_000_000_000,
        drain_windows=4, prefetch_windows=4, block_fwd_flops=(1e12,) * 3)
    fields.update(kw)
    return PlanningProblem(**fields)


def _mixed(d2h=(("f2", 1.0),), h2d=(("b2", 1.0),)) -> Decisions:
    """Every boundary hbm (no recompute); block 0 L1 hbm, block 1 L2 dram, block 2 L0."""
    moves = [InternalTransfer(block=1, kind="d2h", window=w, fraction=x) for w, x in d2h]
    moves += [InternalTransfer(block=1, kind="h2d", window=w, fraction=x) for w, x in h2d]
    return Decisions(tiers=(H,) * 4, save_levels=("L1", "L2", "L0"),
                     saved_tiers=("hbm", "dram", "none"), internal_transfers=tuple(moves))


def _by_name(ev, field):
    return {w.name: getattr(w, field) for w in ev.windows}


def test_every_window_of_an_l1_hbm_and_an_l2_dram_block_by_hand():
    ev = evaluate(_problem(), _mixed())
    # compute: f0 Fg (L1) 12; f1 Fg (L2) 12; f2 F (L0) 10; turn 15;
    # b2 B + Fr = 29; b1 B + 0 (L2) = 20; b0 B + Fr1 = 25
    assert _by_name(ev, "compute_ms") == pytest.approx(
        dict(zip(NAMES, (12.0, 12.0, 10.0, 15.0, 29.0, 20.0, 25.0))))
    # H2D: f0 P1, f1 P2, f2 none (block 3 does not exist), turn P2, b2 P1 + S2 (h2d of block
    # 1's internals) = 4e8, b1 P0, b0 none
    assert _by_name(ev, "h2d_bytes") == pytest.approx(
        dict(zip(NAMES, (1e8, 1e8, 0.0, 1e8, 4e8, 1e8, 0.0))))
    # D2H: f2 S2 = 3e8 (block 1's d2h); b1 G2, b0 G1 (b2 drains G3: no such block)
    assert _by_name(ev, "d2h_bytes") == pytest.approx(
        dict(zip(NAMES, (0.0, 0.0, 3e8, 0.0, 0.0, 1e8, 1e8))))
    # time = max(compute, bytes / 10 GB/s): f2 max(10, 30) = 30; b2 max(29, 40) = 40
    assert _by_name(ev, "time_ms") == pytest.approx(
        dict(zip(NAMES, (12.0, 12.0, 30.0, 15.0, 40.0, 20.0, 25.0))))
    # saved internals in HBM: S1 of block 0 (2e8) in [0, 6]; S2 of block 1 (3e8) in [1, 2]
    # (until its d2h in f2) and [4, 5] (from its h2d in b2 to b1); turn holds block 0's only
    assert _by_name(ev, "hbm_saved_bytes") == pytest.approx(
        dict(zip(NAMES, (2e8, 5e8, 5e8, 2e8, 5e8, 5e8, 2e8))))
    # boundaries (all hbm, 1e7 each): i held in [i, 6 - i], boundary 3 in turn only
    assert _by_name(ev, "hbm_checkpoint_bytes") == pytest.approx(
        dict(zip(NAMES, (1e7, 2e7, 3e7, 4e7, 3e7, 2e7, 1e7))))
    # peak = fixed 1e9 + boundaries + internals, highest in f2 and b2: 1e9 + 3e7 + 5e8
    assert ev.peak_hbm_bytes == pytest.approx(1.53e9)
    assert ev.hbm_by_window == pytest.approx((1.21e9, 1.52e9, 1.53e9, 1.24e9, 1.53e9, 1.52e9,
                                              1.21e9))
    # DRAM: states 3 x 5e7 x 16 = 2.4e9 + block 1's S2 page-locked from f2 to b2 = 3e8
    assert ev.dram_bytes == pytest.approx(2.7e9)
    assert ev.pinned_bytes == pytest.approx(3e8)
    # step: windows 12 + 12 + 30 + 15 + 40 + 20 + 25 = 154; pre = P0 / 10 GB/s = 10;
    # post = G0 / 10 GB/s = 10
    assert ev.step_ms == pytest.approx(174.0)
    assert ev.feasible
    # re-forward FLOPs: block 0 at L1 runs Fr1 / Fg = 5/12 of its forward again, block 1 none,
    # block 2 (L0) its whole forward as counted before levels
    assert ev.hardware_flops == pytest.approx(1e12 * (5 / 12 + 1))


def test_a_split_drain_holds_the_internals_through_the_turn():
    # block 1's d2h half in f2, half in turn: f2 and turn each move 1.5e8 (15 ms); its HBM copy
    # is held until the turn's end and again from b2: [1, 3] and [4, 5] touch, so [1, 5]
    ev = evaluate(_problem(), _mixed(d2h=(("f2", 0.5), ("turn", 0.5))))
    assert _by_name(ev, "d2h_bytes")["turn"] == pytest.approx(1.5e8)
    assert _by_name(ev, "time_ms")["f2"] == pytest.approx(15.0)  # max(10, 15)
    assert _by_name(ev, "time_ms")["turn"] == pytest.approx(15.0)  # max(15, 10, 15)
    assert _by_name(ev, "hbm_saved_bytes")["turn"] == pytest.approx(5e8)
    # windows 12 + 12 + 15 + 15 + 40 + 20 + 25 = 139, plus pre and post 20
    assert ev.step_ms == pytest.approx(159.0)


def test_an_h2d_two_windows_ahead_holds_hbm_and_dram_longer():
    # h2d of block 1 in turn (ord 3) after its d2h in f2 (ord 2): HBM [1, 2] and [3, 5], so
    # no window frees it; DRAM holds S2 in f2 and turn only
    ev = evaluate(_problem(), _mixed(h2d=(("turn", 1.0),)))
    assert _by_name(ev, "hbm_saved_bytes") == pytest.approx(
        dict(zip(NAMES, (2e8, 5e8, 5e8, 5e8, 5e8, 5e8, 2e8))))
    # turn: H2D P2 + S2 = 4e8, 40 ms; b2: P1 alone, max(29, 10) = 29
    assert _by_name(ev, "time_ms")["turn"] == pytest.approx(40.0)
    assert _by_name(ev, "time_ms")["b2"] == pytest.approx(29.0)
    assert ev.pinned_bytes == pytest.approx(3e8)


def test_without_levels_every_block_re_forwards_in_full_and_l0_truncates():
    p = _problem()
    full = evaluate(p, Decisions(tiers=(H,) * 4, save_levels=()))
    # f windows F = 10 (P of the next block: 10 ms too); b windows B + Fg = 32
    assert _by_name(full, "compute_ms") == pytest.approx(
        dict(zip(NAMES, (10.0, 10.0, 10.0, 15.0, 32.0, 32.0, 32.0))))
    assert full.step_ms == pytest.approx(10 + 10 + 10 + 15 + 3 * 32 + 20)
    # decisions without levels given (None) take every block L0 on a problem with Fr
    l0 = evaluate(p, Decisions(tiers=(H,) * 4))
    assert _by_name(l0, "compute_ms")["b1"] == pytest.approx(29.0)
    assert l0.step_ms == pytest.approx(10 + 10 + 10 + 15 + 3 * 29 + 20)
    assert _by_name(l0, "hbm_saved_bytes") == pytest.approx(dict.fromkeys(NAMES, 0.0))


def test_an_l2_hbm_block_holds_its_internals_from_forward_to_backward():
    # block 2 at L2 hbm: f2 Fg = 12, b2 = B = 20, S2 = 3e8 held in [2, 4] (f2, turn, b2)
    p = _problem()
    ev = evaluate(p, Decisions(tiers=(H,) * 4, save_levels=("L0", "L0", "L2"),
                               saved_tiers=("none", "none", "hbm")))
    assert _by_name(ev, "compute_ms")["f2"] == pytest.approx(12.0)
    assert _by_name(ev, "compute_ms")["b2"] == pytest.approx(20.0)
    assert _by_name(ev, "hbm_saved_bytes") == pytest.approx(
        dict(zip(NAMES, (0.0, 0.0, 3e8, 3e8, 3e8, 0.0, 0.0))))
    assert ev.pinned_bytes == pytest.approx(0.0)


def test_build_plan_writes_the_levels_and_prices_the_plan_as_its_decisions():
    p = _problem()
    plan = build_plan(p, _mixed(), solver=SolveRecord(backend="manual"))
    assert plan.save_levels == ("L1", "L2", "L0")
    assert plan.saved_tiers == ("hbm", "dram", "none")
    assert [(t.window, t.kind) for t in plan.internal_transfers] == [("f2", "d2h"),
                                                                      ("b2", "h2d")]
    assert plan.predicted.step_ms == pytest.approx(174.0)
    assert plan.window("b2").hbm_saved_bytes == pytest.approx(5e8)
    # re-evaluating the plan itself gives the same step
    assert evaluate(p, plan).step_ms == pytest.approx(174.0)


def test_decisions_from_tiers_default_every_block_to_l0_only_with_reforward_data():
    with_fr = decisions_from_tiers(_problem(), (H,) * 4)
    assert (with_fr.save_levels, with_fr.saved_tiers) == (("L0",) * 3, ("none",) * 3)
    bare = _problem(reforward_ms=(), reforward_l1_ms=(), saved_bytes=())
    plain = decisions_from_tiers(bare, (H,) * 4)
    assert plain.save_levels == () and plain.saved_tiers == ()
    published = decisions_from_tiers(_problem(), (H,) * 4, save_levels=())
    assert published.save_levels == ()


def test_a_level_the_problem_cannot_price_names_the_field():
    bare = _problem(reforward_l1_ms=(), saved_bytes=())
    with pytest.raises(ValueError, match="reforward_l1_ms"):
        evaluate(bare, _mixed())
    with pytest.raises(ValueError, match="saved_bytes"):
        evaluate(bare, Decisions(tiers=(H,) * 4, save_levels=("L2", "L0", "L0"),
                                 saved_tiers=("hbm", "none", "none")))
    with pytest.raises(ValueError, match="saved_tiers: block 1 is 'dram'"):
        decisions_from_tiers(_problem(), (H,) * 4, save_levels=("L0", "L2", "L0"),
                             saved_tiers=("none", "dram", "none"))


def test_the_megatrain_rule_as_published_is_a_plan_without_levels():
    p = _problem()
    published = megatrain_plan(p, 1, as_published=True)
    assert published.save_levels == () and published.reforwards_in_full
    # K = 1 stores every boundary: b{j} = B + Fg = 32; step as the no-levels case by hand
    assert published.predicted.step_ms == pytest.approx(10 + 10 + 10 + 15 + 3 * 32 + 20)
    truncated = megatrain_plan(p, 1)
    assert truncated.save_levels == ("L0",) * 3
    assert truncated.predicted.step_ms == pytest.approx(10 + 10 + 10 + 15 + 3 * 29 + 20)
    best = best_fixed_k_plan(p, as_published=True)
    assert best.save_levels == () and best.predicted.step_ms >= truncated.predicted.step_ms
