"""Heuristic plans: MegaTrain rule shape, ideal bound, heuristic <= MegaTrain, determinism."""

from __future__ import annotations

import itertools

import pytest

from lazytrain.planner.evaluate import Decisions, decisions_from_tiers, evaluate
from lazytrain.planner.heuristics import (
    heuristic_plan, ideal_plan, megatrain_plan, uniform_plan,
)
from lazytrain.planner.windows import TIERS
from lazytrain.planner.search import Search

GB = 10**9


def _problem(L=8, *, hbm_gb=40.0, dram_gb=400.0, nvme_gb=1000.0, gpu=True, **kw):
    from lazytrain.planner.problem import PlanningProblem
    base = dict(
        fwd_ms=(55.0,) * L, fwd_grad_ms=(57.0,) * L, bwd_ms=(110.0,) * L,
        weight_bytes=(int(0.8 * GB),) * L, grad_bytes=(int(0.8 * GB),) * L,
        internal_bytes=(6 * GB,) * L, boundary_bytes=(int(0.75 * GB),) * (L + 1),
        params_per_block=(4 * 10**8,) * L, embed_ms=1.0, head_ms=30.0,
        h2d_bytes_per_s=12e9, d2h_bytes_per_s=12e9, duplex_bytes_per_s=20e9,
        nvme_read_bytes_per_s=2.83e9, nvme_write_bytes_per_s=3.35e9,
        hbm_bytes=int(hbm_gb * GB), fixed_hbm_bytes=20 * GB, dram_bytes=int(dram_gb * GB),
        nvme_bytes=int(nvme_gb * GB), host_bytes_per_param=12.0, copies_overlap_compute=gpu,
        drain_windows=3, prefetch_windows=3, nvme_lead_windows=2,
    )
    base.update(kw)
    return PlanningProblem(**base)


CASES = {
    "roomy-gpu": dict(hbm_gb=80.0),
    "tight-hbm": dict(hbm_gb=23.0),
    # host states 8 x 4e8 x 12 B = 38.4 GB, so DRAM holds two 0.75 GB checkpoints
    "tight-hbm-and-dram": dict(hbm_gb=23.0, dram_gb=40.0),
    "slow-link": dict(hbm_gb=23.0, h2d_bytes_per_s=5e9, d2h_bytes_per_s=5e9,
                      duplex_bytes_per_s=8e9),
    "cpu": dict(hbm_gb=26.0, gpu=False),
    "six-blocks-no-nvme": dict(L=6, hbm_gb=24.0, nvme_gb=0.0),
}


def test_megatrain_rule_keeps_every_kth_boundary_in_hbm_and_recomputes_the_rest():
    plan = megatrain_plan(_problem(L=8), k=4)
    assert plan.tiers == ("hbm", "recompute", "recompute", "recompute", "hbm",
                          "recompute", "recompute", "recompute", "hbm")
    assert plan.keep_internals == () and plan.transfers == ()
    assert plan.solver.backend == "megatrain"
    # every block is re-forwarded: b{j} computes B + Fg, plus F of the recomputed blocks
    assert plan.window("b7").compute_ms == pytest.approx(110 + 57 + 3 * 55)
    assert plan.window("b5").compute_ms == pytest.approx(110 + 57)


def test_ideal_plan_is_flagged_and_keeps_every_block():
    plan = ideal_plan(_problem(L=4, hbm_gb=10.0))
    assert plan.solver.backend == "ideal"
    assert plan.tiers == ("hbm",) * 5 and plan.keep_internals == (0, 1, 2, 3)
    assert plan.resident_weights == (0, 1, 2, 3)


def test_uniform_plan_puts_latest_boundaries_in_hbm():
    plan = uniform_plan(_problem(L=8, hbm_gb=26.0), 2)
    mats = [i for i in range(9) if plan.tiers[i] != "recompute"]
    assert mats == [0, 2, 4, 6, 8]
    hbm = [i for i in mats if plan.tiers[i] == "hbm"]
    assert hbm == mats[len(mats) - len(hbm):]  # a suffix: lifetime order


@pytest.mark.parametrize("case", sorted(CASES))
def test_heuristic_is_no_worse_than_megatrain_on_the_same_evaluator(case):
    p = _problem(**CASES[case])
    mega = megatrain_plan(p)
    heur = heuristic_plan(p, time_budget_s=30.0)
    ev_h, ev_m = evaluate(p, heur), evaluate(p, mega)
    if ev_m.feasible:
        assert ev_h.feasible, ev_h.violations
        assert ev_h.step_ms <= ev_m.step_ms + 1e-9
    assert heur.predicted.step_ms == pytest.approx(ev_h.step_ms)
    assert heur.solver.backend == "heuristic"
    assert heur.solver.status == ("ok" if ev_h.feasible else "infeasible")


def test_heuristic_beats_megatrain_when_memory_is_roomy():
    p = _problem(hbm_gb=80.0)
    assert heuristic_plan(p).predicted.step_ms < 0.95 * megatrain_plan(p).predicted.step_ms


def test_heuristic_is_deterministic():
    p = _problem(L=10, hbm_gb=27.0, dram_gb=41.0)
    a, b = heuristic_plan(p, time_budget_s=30.0), heuristic_plan(p, time_budget_s=30.0)
    assert (a.tiers, a.keep_internals, a.transfers) == (b.tiers, b.keep_internals, b.transfers)


def test_heuristic_returns_a_best_effort_plan_with_violations_when_nothing_fits():
    p = _problem(L=4, hbm_gb=5.0)  # fixed HBM alone is 20 GB
    plan = heuristic_plan(p)
    assert plan.solver.status == "infeasible"
    assert plan.provenance["violations"][0].startswith("HBM short by")


def test_heuristic_matches_brute_force_on_three_blocks_without_transfers_choice():
    # Enumerate every tier assignment and keep set of 3 blocks with the default schedule;
    # the heuristic (which searches the same space) must reach the best feasible one.
    p = _problem(L=3, hbm_gb=23.5, dram_gb=40.0)
    best = None
    for head in itertools.product(TIERS, repeat=3):
        tiers = head + ("hbm",)
        for keep in ((), (2,)):
            ev = evaluate(p, decisions_from_tiers(p, tiers, keep))
            if ev.feasible and (best is None or ev.step_ms < best):
                best = ev.step_ms
    got = evaluate(p, heuristic_plan(p, time_budget_s=30.0))
    assert got.feasible
    assert got.step_ms <= best * 1.02  # local search may stop within 2% of the enumeration


@pytest.mark.parametrize("gpu", [False], ids=["cpu"])
def test_incremental_scoring_equals_full_evaluation(gpu):
    # On a CPU the schedule does not depend on other boundaries' loads, so the incremental
    # score of every neighbour must equal its full evaluation exactly.
    p = _problem(L=6, hbm_gb=26.0, gpu=gpu)
    search = Search(p, deadline=float("inf"))
    for tiers in [("hbm", "dram", "recompute", "nvme", "recompute", "dram", "hbm"),
                  ("recompute", "nvme", "nvme", "hbm", "recompute", "hbm", "hbm")]:
        cur = search.build(tiers, (5,))
        for edit in search.edits():
            move = search.apply(cur, edit)
            if move is not None:
                assert search.delta(cur, *move) == pytest.approx(search.build(*move).score)


def test_incremental_scoring_tracks_the_host_term_of_segments_and_keeps():
    # Host work on a CPU adds to every window: a move that recomputes or keeps a block changes
    # the weight bytes converted in the window that reloads it, which the incremental score
    # must follow exactly (slow host rates, so the host term is large).
    p = _problem(L=6, hbm_gb=26.0, gpu=False)
    p = p.replace(host_convert_bytes_per_s=p.h2d_bytes_per_s / 3,
                  host_accumulate_bytes_per_s=p.d2h_bytes_per_s / 2)
    search = Search(p, deadline=float("inf"))
    cur = search.build(("hbm", "dram", "recompute", "nvme", "recompute", "dram", "hbm"), (5,))
    assert sum(cur.loads.host) > 0
    for edit in search.edits():
        move = search.apply(cur, edit)
        if move is not None:
            assert search.delta(cur, *move) == pytest.approx(search.build(*move).score)


@pytest.mark.parametrize("hbm_gb", [62.0, 70.0], ids=["five-of-six-fit", "all-six-fit"])
def test_heuristic_keeps_as_many_blocks_as_the_best_keep_set_by_brute_force(hbm_gb):
    # Every block kept costs I + P = 6.8 GB from f{j} to b{j}; with all 7 boundaries in HBM
    # (5.25 GB) and 20 GB fixed, 62 GB holds five kept blocks and 70 GB all six. Keeping block
    # j saves its re-forward Fg = 57 ms in b{j}, so the best plan keeps blocks far from the
    # end, which a search that only tries the last four blocks misses. Reference: every keep
    # set (2^6) over all-hbm tiers; the heuristic searches a superset of those plans.
    p = _problem(L=6, hbm_gb=hbm_gb)
    best = min(ev.step_ms for r in range(7) for keep in itertools.combinations(range(6), r)
               if (ev := evaluate(p, decisions_from_tiers(p, ("hbm",) * 7, keep))).feasible)
    got = evaluate(p, heuristic_plan(p, time_budget_s=30.0))
    assert got.feasible, got.violations
    assert got.step_ms <= best * (1 + 1e-9)


@pytest.mark.parametrize("dram_gb", [38.9, 40.0], ids=["no-room-without-q8", "two-boundaries"])
def test_heuristic_buys_dram_for_boundaries_with_8bit_states_when_that_is_faster(dram_gb):
    # Host states are 8 x 4e8 x 12 B = 38.4 GB, so DRAM holds at most two 0.75 GB boundaries;
    # HBM (23 GB, 20 fixed) holds few and there is no NVMe: without 8-bit states most segments
    # are recomputed. 8-bit moments free 4e8 x 2 B = 0.8 GB per block, enough for a boundary
    # each. Reference: the hand-built plan with every block 8-bit and every boundary in DRAM.
    p = _problem(L=8, hbm_gb=23.0, dram_gb=dram_gb, nvme_gb=0.0, allow_q8=True)
    ref = evaluate(p, decisions_from_tiers(p, ("dram",) * 8 + ("hbm",), (),
                                           q8_blocks=tuple(range(8))))
    assert ref.feasible, ref.violations
    plan = heuristic_plan(p, time_budget_s=30.0)
    got = evaluate(p, plan)
    assert got.feasible, got.violations
    assert got.step_ms <= ref.step_ms * (1 + 1e-9)
    for j in plan.q8_blocks:  # 8-bit only where DRAM needs it: each one dropped breaks DRAM
        fewer = tuple(b for b in plan.q8_blocks if b != j)
        d = Decisions(tiers=plan.tiers, keep_internals=plan.keep_internals, q8_blocks=fewer,
                      transfers=plan.transfers)
        assert evaluate(p, d).dram_short_bytes > 0, f"block {j} is 8-bit without need"


@pytest.mark.parametrize("hbm_gb", [31.0, 29.0], ids=["all-six-resident-fit", "four-fit"])
def test_heuristic_makes_weights_resident_without_kept_graphs_on_a_slow_h2d_link(hbm_gb):
    # At 2 GB/s a block's 0.8 GB weight reload in backward takes 400 ms against 167 ms of
    # compute (B + Fg); resident weights (0.8 GB of HBM each) skip it, a kept graph (6.8 GB)
    # does not fit beside 20 GB fixed and 5.25 GB of boundaries. 31 GB holds all six blocks'
    # weights with every boundary in HBM, 29 GB four (more with boundaries offloaded).
    # Reference: every (keep, resident) choice per block (3^6) over all-hbm tiers.
    p = _problem(L=6, hbm_gb=hbm_gb, h2d_bytes_per_s=2e9)
    best = min(
        ev.step_ms for code in itertools.product(("none", "resident", "keep"), repeat=6)
        if (ev := evaluate(p, decisions_from_tiers(
            p, ("hbm",) * 7, [j for j, c in enumerate(code) if c == "keep"],
            resident_weights=[j for j, c in enumerate(code) if c != "none"]))).feasible)
    got = evaluate(p, heuristic_plan(p, time_budget_s=30.0))
    assert got.feasible, got.violations
    assert got.step_ms <= best * (1 + 1e-9)


def test_heuristic_makes_weights_resident_where_the_reload_is_exposed():
    # 8 blocks at 2 GB/s H2D: block j's 0.8 GB weight reload in backward (400 ms) runs in
    # b{j+1} (the turn for the last block), where B = 400 ms hides it except in b2 and b5
    # (B = 50 ms) and the turn (head 30 ms): resident weights pay on blocks 1, 4 and 7 only,
    # not on a suffix. 29.2 GB holds three resident blocks (0.8 GB each) beside 20 GB fixed
    # and nine 0.75 GB boundaries in HBM. Reference: every resident set (2^8), all-hbm tiers.
    bwd = tuple(50.0 if j in (2, 5) else 400.0 for j in range(8))
    p = _problem(L=8, hbm_gb=29.2, h2d_bytes_per_s=2e9, bwd_ms=bwd)
    best = min(ev.step_ms for r in range(9) for res in itertools.combinations(range(8), r)
               if (ev := evaluate(p, decisions_from_tiers(p, ("hbm",) * 9, (),
                                                          resident_weights=res))).feasible)
    got = evaluate(p, heuristic_plan(p, time_budget_s=30.0))
    assert got.feasible, got.violations
    assert got.step_ms <= best * (1 + 1e-9)
