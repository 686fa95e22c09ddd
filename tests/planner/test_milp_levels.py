"""Save levels in the placement MILP: brute force, pricing like the evaluator, both backends.

The brute force is independent of the model: it lists every plan of three blocks (each boundary
hbm, recompute or dram with every legal pair of whole d2h / h2d windows; each block L0, or L1 /
L2 in HBM, or L1 / L2 in DRAM with every legal pair of internal d2h / h2d windows), prices each
with the fluid evaluator and keeps the fastest that fits. The MILP's plan, priced by the same
evaluator, must match it. Random plans with levels, written into the model's columns by
`start_from_plan`, must give the evaluator's step as the model's objective.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest

from lazytrain.planner.evaluate import Decisions, build_plan, decisions_from_tiers, evaluate
from lazytrain.planner.extract import start_from_plan
from lazytrain.planner.milp import build_milp
from lazytrain.planner.milp_solve import solve_milp
from lazytrain.planner.plan import InternalTransfer, SolveRecord, Transfer
from lazytrain.planner.problem import PlanningProblem
from lazytrain.planner.windows import internal_legal_ords, legal_ords, window_name

U = 10**7
"""Byte unit of the fixtures: 1 u = 1e7 bytes; at 1e4 u/s, 100 u moves in 10 ms."""
MANUAL = SolveRecord(backend="manual")


def level_problem(L: int = 3, **kw) -> PlanningProblem:
    """Heterogeneous blocks with a re-forward worth removing (Fr = 0.8 Fg, Fr1 = 0.4 Fg) and
    saved internals S1 / S2 of 30-50 u / 90-130 u; HBM room 330 u beside 1000 u fixed (all
    four boundaries, 390 u, do not fit); DRAM room 300 u beside 12 B/param states; links of
    1e4 u/s (100 u: 10 ms, a forward is 8-14 ms); horizons H_d = 2, H_p = 1."""
    F = (10.0, 14.0, 8.0, 12.0)[:L]
    Fg = tuple(f + 2 for f in F)
    states = 12 * (10**8 * L + 10**7)
    base = dict(
        fwd_ms=F, fwd_grad_ms=Fg, bwd_ms=tuple(2 * f for f in F),
        reforward_ms=tuple(0.8 * g for g in Fg), reforward_l1_ms=tuple(0.4 * g for g in Fg),
        saved_bytes=((50 * U, 130 * U), (40 * U, 110 * U), (30 * U, 90 * U),
                     (45 * U, 100 * U))[:L],
        weight_bytes=(50 * U, 60 * U, 40 * U, 55 * U)[:L], grad_bytes=(50 * U,) * L,
        internal_bytes=(150 * U, 120 * U, 60 * U, 30 * U)[:L],
        boundary_bytes=(100 * U, 80 * U, 120 * U, 90 * U, 100 * U)[:L] + (90 * U,),
        params_per_block=(10**8,) * L, ends_params=10**7, embed_ms=1.0, head_ms=4.0,
        const_ms=3.0, h2d_bytes_per_s=1e4 * U, d2h_bytes_per_s=1e4 * U,
        duplex_bytes_per_s=1.5e4 * U, nvme_read_bytes_per_s=5e3 * U,
        nvme_write_bytes_per_s=5e3 * U, hbm_bytes=1330 * U, fixed_hbm_bytes=1000 * U,
        dram_bytes=states + 310 * U, nvme_bytes=0, nvme_staging_bytes=10 * U,
        host_bytes_per_param=12.0, drain_windows=2, prefetch_windows=1, nvme_lead_windows=1,
        grad_accum=2, allow_keep=False,
    )
    base.update(kw)
    return PlanningProblem(**base)


STATES = 12 * (10**8 * 3 + 10**7)
SCENARIOS = {
    # HBM for some boundaries and one block's L2 internals or a few L1s; DRAM for three
    # checkpoints: levels, offload and recompute compete for HBM.
    "hbm_tight": level_problem(),
    # DRAM for one L1 block's internals beside no checkpoint: the dram tier is rationed.
    "dram_tight": level_problem(dram_bytes=STATES + 10 * U + 60 * U, hbm_bytes=1300 * U),
    # a slow link: a dram-tier block's transfers cost time beside the weight loads.
    "slow_link": level_problem(h2d_bytes_per_s=4e3 * U, d2h_bytes_per_s=4e3 * U,
                               duplex_bytes_per_s=6e3 * U, hbm_bytes=1450 * U),
    # CPU: copies add to compute, so saving internals in DRAM is paid in full.
    "cpu_contention": level_problem(copies_overlap_compute=False, hbm_bytes=1400 * U),
    # keep and resident weights offered beside the levels (a kept block is L0, tier none).
    "with_keep": level_problem(allow_keep=True, hbm_bytes=1400 * U),
}


def _pairs(d2h, h2d) -> list[tuple[int, int]]:
    """Whole d2h / h2d window pairs with the h2d strictly later."""
    return [(a, b) for a in d2h for b in h2d if b > a]


def _boundary_options(problem, tiers) -> list[list[tuple]]:
    """Per boundary 0..L-1 of a tier vector: the transfers of each legal window pair (one
    empty option for hbm / recompute)."""
    L, hz = problem.num_blocks, dict(drain_windows=problem.drain_windows,
                                     prefetch_windows=problem.prefetch_windows,
                                     nvme_lead_windows=problem.nvme_lead_windows)
    starts = [0] + [i for i in range(1, L + 1) if tiers[i] != "recompute"]
    end = {s: e for s, e in zip(starts, starts[1:])}
    out = []
    for i in range(L):
        if tiers[i] != "dram":
            out.append([()])
            continue
        pairs = _pairs(legal_ords("d2h", i, end[i], L, **hz), legal_ords("h2d", i, end[i], L, **hz))
        out.append([(Transfer(boundary=i, kind="d2h", window=window_name(a, L), fraction=1.0),
                     Transfer(boundary=i, kind="h2d", window=window_name(b, L), fraction=1.0))
                    for a, b in pairs])
    return out


def _level_options(problem, j: int) -> list[tuple]:
    """Block j's (level, saved tier, internal transfers) options."""
    L = problem.num_blocks
    hz = dict(drain_windows=problem.drain_windows, prefetch_windows=problem.prefetch_windows)
    out = [("L0", "none", ())]
    for level in ("L1", "L2"):
        out.append((level, "hbm", ()))
        for a, b in _pairs(internal_legal_ords("d2h", j, L, **hz),
                           internal_legal_ords("h2d", j, L, **hz)):
            out.append((level, "dram", (
                InternalTransfer(block=j, kind="d2h", window=window_name(a, L), fraction=1.0),
                InternalTransfer(block=j, kind="h2d", window=window_name(b, L), fraction=1.0))))
    return out


def brute_force(problem) -> tuple[float, Decisions | None]:
    """The fastest fitting plan over every enumerated choice (module docstring), by the
    evaluator; with keep offered, every kept subset (kept blocks L0, resident) too."""
    L = problem.num_blocks
    best, arg = math.inf, None
    levels = list(itertools.product(*(_level_options(problem, j) for j in range(L))))
    for head in itertools.product(("hbm", "dram", "recompute"), repeat=L):
        tiers = head + ("hbm",)
        keepable = [j for j in range(L) if tiers[j + 1] != "recompute"] \
            if problem.allow_keep else []
        keeps = [k for n in range(len(keepable) + 1) for k in itertools.combinations(keepable, n)]
        for moves in itertools.product(*_boundary_options(problem, tiers)):
            transfers = tuple(t for pair in moves for t in pair)
            for keep in keeps:
                for choice in levels:
                    if any(choice[j][0] != "L0" for j in keep):
                        continue
                    d = Decisions(tiers=tiers, keep_internals=keep, transfers=transfers,
                                  save_levels=tuple(c[0] for c in choice),
                                  saved_tiers=tuple(c[1] for c in choice),
                                  internal_transfers=tuple(t for c in choice for t in c[2]))
                    ev = evaluate(problem, d)
                    if ev.feasible and ev.step_ms < best - 1e-9:
                        best, arg = ev.step_ms, d
    return best, arg


_OPTIMA: dict[str, tuple[float, Decisions | None]] = {}


def optimum(name: str) -> tuple[float, Decisions | None]:
    if name not in _OPTIMA:
        _OPTIMA[name] = brute_force(SCENARIOS[name])
    return _OPTIMA[name]


@pytest.mark.parametrize("backend", ["highs", "scip"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_milp_with_levels_matches_brute_force_on_three_blocks(scenario, backend):
    pytest.importorskip("pyscipopt" if backend == "scip" else "highspy")
    problem = SCENARIOS[scenario]
    best, arg = optimum(scenario)
    assert math.isfinite(best), "no enumerated plan fits; the fixture is wrong"
    plan = solve_milp(problem, backend=backend, gap=1e-9, time_limit_s=60)
    step = evaluate(problem, plan).step_ms
    assert not plan.provenance.get("violations")
    assert step == pytest.approx(best, rel=1e-6), (plan.tiers, plan.save_levels,
                                                   plan.saved_tiers, arg)


def test_brute_force_optima_use_the_levels_and_tiers_they_are_meant_to_test():
    """The fixtures are not degenerate: their optima save internals, in DRAM somewhere."""
    pytest.importorskip("highspy")
    used = {name: optimum(name)[1] for name in SCENARIOS}
    for name, d in used.items():
        assert set(d.save_levels) - {"L0"}, (name, d)
    assert any("dram" in d.saved_tiers for d in used.values()), used
    assert "L1" in used["dram_tight"].save_levels or "hbm" in used["dram_tight"].saved_tiers


def _random_level_plan(problem, rng: random.Random):
    """Random tiers and keep (scheduled transfers), then random levels and saved tiers on the
    blocks not kept, with a random legal internal window pair for the dram tier."""
    L = problem.num_blocks
    tiers = tuple(rng.choice(("recompute", "hbm", "dram")) for _ in range(L)) + ("hbm",)
    keep = tuple(j for j in range(L) if tiers[j + 1] != "recompute" and rng.random() < 0.3)
    try:
        d = decisions_from_tiers(problem, tiers, keep)
    except ValueError:
        return None
    levels, saved, internal = [], [], []
    for j in range(L):
        options = _level_options(problem, j) if j not in keep else [("L0", "none", ())]
        level, tier, moves = rng.choice(options)
        levels.append(level)
        saved.append(tier)
        internal += moves
    return build_plan(problem, Decisions(
        tiers=tiers, keep_internals=keep, transfers=d.transfers, save_levels=tuple(levels),
        saved_tiers=tuple(saved), internal_transfers=tuple(internal)), solver=MANUAL)


@pytest.mark.parametrize("gpu", [True, False], ids=["overlap", "serial"])
@pytest.mark.parametrize("seed", range(6))
def test_milp_objective_of_a_plan_with_levels_equals_the_evaluators_step(seed, gpu):
    """Six blocks, H_d = H_p = 2, roomy budgets: every row a level touches (f_j and b_j
    compute, internal D2H/H2D bytes, the recompute order) prices as the evaluator."""
    rng = random.Random(seed)
    problem = level_problem(L=4, copies_overlap_compute=gpu, allow_keep=True,
                            hbm_bytes=10**13, dram_bytes=10**13, prefetch_windows=2,
                            h2d_bytes_per_s=(1e4 if seed % 2 else 2e3) * U)
    milp = build_milp(problem, tie_breakers=False, q8_penalty=False)
    priced = 0
    for _ in range(12):
        plan = _random_level_plan(problem, rng)
        if plan is None or start_from_plan(milp, dataclasses.replace(
                plan, save_levels=("L0",) * 4, saved_tiers=("none",) * 4,
                internal_transfers=())) is None:
            continue  # the scheduler's boundary transfers share a window: outside the model
        x = start_from_plan(milp, plan)
        assert x is not None, (plan.tiers, plan.save_levels, plan.saved_tiers)
        assert milp.step_ms(x) == pytest.approx(plan.predicted.step_ms, rel=1e-9)
        priced += 1
    assert priced >= 6


def test_levels_no_budget_can_hold_get_no_column():
    """HBM room 330 u beside 1000 u fixed, boundary L 90 u: S2 = 300 u fits f_j (300 <= 330)
    but not the turn beside boundary L (390 > 330), so L2 is offered only in DRAM; S2 = 340 u
    fits nowhere in HBM, so not at all. DRAM room 310 - 10 (staging) = 300 u: S1 = 200 u fits
    there, S2 = 300 u just fits, 340 u not. Block 2 has no legal d2h/h2d pair (H_p = 1)."""
    problem = level_problem(saved_bytes=((200 * U, 300 * U), (200 * U, 340 * U),
                                         (200 * U, 300 * U)))
    v = build_milp(problem).v
    assert sorted(v.lvl) == [(0, 1, "dram"), (0, 1, "hbm"), (0, 2, "dram"),
                             (1, 1, "dram"), (1, 1, "hbm"), (2, 1, "hbm")]
    assert {(j, lv) for j, lv, _ in v.id2h} == {(0, 1), (0, 2), (1, 1)}


@pytest.mark.parametrize("gpu", [True, False], ids=["overlap", "serial"])
@pytest.mark.parametrize("scenario", ["hbm_tight", "slow_link"])
def test_milp_objective_equals_the_evaluator_on_the_plan_it_extracts(scenario, gpu):
    """Levels and saved tiers fixed to the brute-force optimum's (the rest free, the solver
    choosing every transfer window): the model's objective must be the evaluator's step of the
    plan `extract_plan` reads back, internal transfers included."""
    pytest.importorskip("highspy")
    from lazytrain.planner.extract import extract_plan
    from lazytrain.planner.solvers import solve

    problem = SCENARIOS[scenario].replace(copies_overlap_compute=gpu)
    _, best = optimum(scenario)
    milp = build_milp(problem, tie_breakers=False, q8_penalty=False)
    fixed = {c: 0.0 for c in milp.v.lvl.values()}
    for j, (level, tier) in enumerate(zip(best.save_levels, best.saved_tiers)):
        if level != "L0":
            fixed[milp.v.lvl[j, int(level[1:]), tier]] = 1.0
    res = solve(milp.model, backend="highs", fixed=fixed, gap=1e-9, time_limit_s=60)
    assert res.status == "optimal", res.status
    plan = extract_plan(milp, res.values, solver=MANUAL)
    assert (plan.save_levels, plan.saved_tiers) == (best.save_levels, best.saved_tiers)
    assert len(plan.internal_transfers) == 2 * plan.saved_tiers.count("dram")
    assert milp.step_ms(res.values) == pytest.approx(evaluate(problem, plan).step_ms, rel=1e-7)
