"""The heuristic's greedy save levels (`heuristics.greedy_levels`): where HBM has room for one
block's S2 it goes to the block that saves most, the DRAM tier only where its copies hide, the
step never gets slower, and the plan validates; checked against a brute force over every level
and tier of a 3-block problem."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from lazytrain.planner.evaluate import build_plan, decisions_from_tiers, evaluate
from lazytrain.planner import heuristics
from lazytrain.planner.heuristics import greedy_levels, heuristic_plan, megatrain_plan
from lazytrain.planner.plan import InternalTransfer, SolveRecord
from lazytrain.planner.policy import PlannerOptions, plan
from lazytrain.planner.problem import PlanningProblem
from lazytrain.planner.windows import window_name

S2 = 10_000
"""Each block's L2 bytes: 10 ms over a 1000 B/ms link, far longer than any window's compute."""


def _problem(L: int = 3, **changes) -> PlanningProblem:
    """F 1, Fg 1.5, B 2 ms; Fr 1.2 ms except block 1's 3.0 ms; L1 saves nothing (Fr1 = Fr);
    P = G = A = 1000 B at 1000 B/ms; no keep or resident weights (they would take the HBM)."""
    base = dict(
        fwd_ms=(1.0,) * L, fwd_grad_ms=(1.5,) * L, bwd_ms=(2.0,) * L,
        reforward_ms=tuple(3.0 if j == 1 else 1.2 for j in range(L)),
        reforward_l1_ms=tuple(3.0 if j == 1 else 1.2 for j in range(L)),
        saved_bytes=((S2 // 2, S2),) * L,
        weight_bytes=(1000,) * L, grad_bytes=(1000,) * L, internal_bytes=(10**6,) * L,
        boundary_bytes=(1000,) * (L + 1), params_per_block=(10,) * L, embed_ms=0.5,
        head_ms=1.0, h2d_bytes_per_s=1e6, d2h_bytes_per_s=1e6, duplex_bytes_per_s=2e6,
        nvme_read_bytes_per_s=1e6, nvme_write_bytes_per_s=1e6, hbm_bytes=10**12,
        dram_bytes=10**12, nvme_bytes=10**12, allow_keep=False)
    base.update(changes)
    return PlanningProblem(**base)


def _room_for_one_s2(p: PlanningProblem, tiers) -> PlanningProblem:
    """`p` whose HBM budget is the L0 plan's peak plus 1.5 x S2: one block's internals fit in
    HBM over the turn (every hbm-tier block holds them there), two do not."""
    peak = evaluate(p, decisions_from_tiers(p, tiers)).peak_hbm_bytes
    return p.replace(hbm_bytes=int(peak + 1.5 * S2))


def _every_level_choice(p: PlanningProblem, d):
    """Every assignment of (L0 | L1 | L2) x (hbm | dram) per block, dram moving whole in the
    first legal d2h window (j + 1) and the last legal h2d window (2L - j - 1)."""
    L = p.num_blocks
    options = [("L0", "none")] + [(lv, t) for lv in ("L1", "L2") for t in ("hbm", "dram")]
    for combo in itertools.product(options, repeat=L):
        moves = []
        for j, (_lv, tier) in enumerate(combo):
            if tier == "dram":
                if j + 1 >= 2 * L - j - 1:
                    break  # no legal pair for this block
                moves += [InternalTransfer(block=j, kind="d2h", window=window_name(j + 1, L),
                                           fraction=1.0),
                          InternalTransfer(block=j, kind="h2d",
                                           window=window_name(2 * L - j - 1, L), fraction=1.0)]
        else:
            yield dataclasses.replace(d, save_levels=tuple(c[0] for c in combo),
                                      saved_tiers=tuple(c[1] for c in combo),
                                      internal_transfers=tuple(moves))


def test_room_for_one_block_s2_goes_to_the_block_that_saves_most():
    tiers = ("hbm",) * 4
    p = _room_for_one_s2(_problem(), tiers)
    start = decisions_from_tiers(p, tiers)
    d = greedy_levels(p, start)
    # block 1 at L2 saves Fr 3.0 less the autograd forward's 0.5; the others' 0.7 ms do not fit
    # in HBM, their DRAM copies (10 ms) would be exposed, block 2 has no legal dram pair
    assert d.save_levels == ("L0", "L2", "L0")
    assert d.saved_tiers == ("none", "hbm", "none") and d.internal_transfers == ()
    before, after = evaluate(p, start), evaluate(p, d)
    assert after.feasible
    assert after.step_ms == pytest.approx(before.step_ms - 2.5)  # b1 -3.0, f1 +0.5 (by hand)
    # the brute force over all 5^3 level/tier choices finds nothing faster that fits
    best = min(evaluate(p, c).step_ms for c in _every_level_choice(p, start)
               if evaluate(p, c).feasible)
    assert after.step_ms == pytest.approx(best)
    build_plan(p, d, solver=SolveRecord(backend="heuristic"))  # validates


def test_dram_takes_the_internals_when_hbm_is_full_and_the_link_hides_them():
    # 4 blocks, block 2 the best saver (Fr 3.0); links 100x faster: a 10 kB copy takes 0.1 ms,
    # hidden under the window's compute. HBM holds block 2's S2 over ords 2..6; block 0 in
    # dram holds its S2 in HBM only over ords 0..1 (until its d2h in f1) and 7..8 (from its
    # h2d in b1), beside nothing: it fits. Block 1 in dram would hold it over 1..2 and 6..7,
    # beside block 2's: it does not; block 3 (j = L - 1) has no legal dram pair.
    L = 4
    tiers = ("hbm",) * (L + 1)
    fr = (1.2, 1.2, 3.0, 1.2)
    p = _room_for_one_s2(_problem(L=L, reforward_ms=fr, reforward_l1_ms=fr,
                                  h2d_bytes_per_s=1e8, d2h_bytes_per_s=1e8,
                                  duplex_bytes_per_s=2e8), tiers)
    start = decisions_from_tiers(p, tiers)
    d = greedy_levels(p, start)
    assert d.save_levels == ("L2", "L0", "L2", "L0")
    assert d.saved_tiers == ("dram", "none", "hbm", "none")
    assert [(t.block, t.kind, t.window) for t in d.internal_transfers] == [
        (0, "d2h", "f1"), (0, "h2d", "b1")]
    # block 2 saves 3.0 - 0.5, block 0 1.2 - 0.5 (its copies hidden), by hand
    assert evaluate(p, d).step_ms == pytest.approx(evaluate(p, start).step_ms - 2.5 - 0.7)
    plan = build_plan(p, d, solver=SolveRecord(backend="heuristic"))
    assert plan.internal_transfers_of(0) and not plan.provenance.get("violations")


def _seeded(seed: int):
    """A 4-block problem with random costs, saved sizes, link rate and HBM room, and its
    start (boundaries hbm, recompute, hbm, dram, hbm)."""
    rng = random.Random(seed)
    L = 4
    fg = tuple(rng.uniform(1.0, 2.0) for _ in range(L))
    fr = tuple(f * rng.uniform(0.6, 1.0) for f in fg)
    s1 = tuple(rng.randrange(500, 5000) for _ in range(L))
    link = rng.choice((1e6, 1e7, 1e8))
    p = _problem(L=L, fwd_ms=tuple(f / 1.4 for f in fg), fwd_grad_ms=fg, reforward_ms=fr,
                 reforward_l1_ms=tuple(r * rng.uniform(0.2, 1.0) for r in fr),
                 saved_bytes=tuple((a, a + rng.randrange(0, 8000)) for a in s1),
                 h2d_bytes_per_s=link, d2h_bytes_per_s=link, duplex_bytes_per_s=1.5 * link)
    tiers = ("hbm", "recompute", "hbm", "dram", "hbm")
    peak = evaluate(p, decisions_from_tiers(p, tiers)).peak_hbm_bytes
    p = p.replace(hbm_bytes=int(peak + rng.uniform(0, 3) * 5000))
    return p, decisions_from_tiers(p, tiers)


@pytest.mark.parametrize("seed", range(6))
def test_greedy_levels_never_make_the_step_slower_and_the_plan_validates(seed):
    p, start = _seeded(seed)
    d = greedy_levels(p, start)
    assert evaluate(p, d).step_ms <= evaluate(p, start).step_ms
    assert evaluate(p, d).feasible
    build_plan(p, d, solver=SolveRecord(backend="heuristic"))  # validates


def test_a_problem_without_saved_bytes_gets_no_levels():
    p = _problem(saved_bytes=(), reforward_l1_ms=())
    start = decisions_from_tiers(p, ("hbm",) * 4)
    assert greedy_levels(p, start) is start


def test_the_heuristic_policy_plans_the_levels_and_the_megatrain_rule_does_not():
    tiers = ("hbm",) * 4
    p = _room_for_one_s2(_problem(), tiers)
    plan = heuristic_plan(p, max_steps=200).validate()
    assert plan.save_levels[1] == "L2" and plan.saved_tiers[1] == "hbm"
    assert not plan.provenance.get("violations")
    rule = megatrain_plan(p, k=1)
    assert set(rule.save_levels) <= {"L0"}  # the fixed-K rule keeps every block L0
    assert plan.predicted.step_ms < rule.predicted.step_ms


def test_a_warm_start_with_levels_is_planned_without_them_where_the_problem_has_none():
    # the running plan kept block 1 at L2; the re-plan's problem offers no levels
    # (planner.save_levels off): the warm start is re-priced with every block at L0, never
    # with free internals
    tiers = ("hbm",) * 4
    p = _room_for_one_s2(_problem(), tiers)
    running = heuristic_plan(p, max_steps=200)
    assert running.save_levels[1] == "L2"
    bare = p.replace(saved_bytes=(), reforward_l1_ms=())
    again = plan(bare, PlannerOptions(policy="heuristic", lp_bound=False, deterministic=True),
                 warm_start=running).validate()
    assert set(again.save_levels) <= {"L0"} and not again.internal_transfers
    assert again.predicted.step_ms == pytest.approx(evaluate(bare, again).step_ms)


@pytest.mark.parametrize("seed", range(6))
def test_skipping_trials_that_cannot_fit_hbm_changes_no_choice(seed, monkeypatch):
    p, start = _seeded(seed)
    pruned = greedy_levels(p, start)
    monkeypatch.setattr(heuristics, "_may_fit", lambda *args: True)  # evaluate every trial
    assert greedy_levels(p, start) == pruned
