"""Save levels in the event simulator: f{j} runs Fg at L1/L2, b{j} re-forwards by level, the
dram tier's internals move on the D2H/H2D streams in their windows; hand-computed windows and
agreement with the fluid evaluator on plans with levels in both tiers."""

from __future__ import annotations

import dataclasses

import pytest

from lazytrain.planner.evaluate import build_plan, decisions_from_tiers, evaluate
from lazytrain.planner.plan import InternalTransfer, Plan, SolveRecord
from lazytrain.sim import disagreements, simulate
from test_simulate import KB_PER_MS, T, tiny_problem

# Fr (truncated, L0) 1.2 ms, Fr1 (L1) 0.5 ms; S1 = 400 B, S2 = 1500 B (1000 B per ms)
LEVEL_COSTS = dict(reforward_ms=(1.2, 1.2, 1.2), reforward_l1_ms=(0.5, 0.5, 0.5),
                   saved_bytes=((400, 1500),) * 3)


def I(j: int, kind: str, window: str, fraction: float = 1.0) -> InternalTransfer:
    return InternalTransfer(block=j, kind=kind, window=window, fraction=fraction)


def _levels_plan(problem, tiers, levels, saved_tiers, moves, keep=()) -> Plan:
    """The scheduler's boundary transfers for `tiers`, with these levels and internal moves
    (a validated plan)."""
    d = decisions_from_tiers(problem, tuple(tiers), tuple(keep))
    d = dataclasses.replace(d, save_levels=tuple(levels), saved_tiers=tuple(saved_tiers),
                            internal_transfers=tuple(moves))
    return build_plan(problem, d, solver=SolveRecord(backend="manual"))


def test_levels_by_hand_l2_in_dram_and_l1_in_hbm():
    # 3 blocks, all boundaries hbm; F 1, Fg 1.5, B 2, P = G = 1000 B (1 ms each).
    # block 0 L2 dram: d2h (1500 B, 1.5 ms) in f1, h2d in b1; block 1 L1 hbm; block 2 L0.
    p = tiny_problem(L=3, **LEVEL_COSTS)
    plan = Plan(tiers=("hbm",) * 4, save_levels=("L2", "L1", "L0"),
                saved_tiers=("dram", "hbm", "none"),
                internal_transfers=(I(0, "d2h", "f1"), I(0, "h2d", "b1")))
    r = simulate(p, plan)
    times = {w.name: w.time_ms for w in r.windows}
    # f0: Fg0 1.5 || W1 1;  f1: Fg1 1.5 || W2 1 || S0 d2h 1.5;  f2: F2 1
    assert (times["f0"], times["f1"], times["f2"]) == pytest.approx((1.5, 1.5, 1.0))
    # b2: Fr 1.2 + B2 2 || W1 1 || G? none (block 3 does not exist)      -> 3.2
    # b1: Fr1 0.5 + B1 2 = 2.5 || h2d: W0 1 then S0 1.5 = 2.5 || G2 1    -> 2.5
    # b0: no re-forward, B0 2 || G1 1                                    -> 2
    assert (times["b2"], times["b1"], times["b0"]) == pytest.approx((3.2, 2.5, 2.0))
    kinds = {e.name: e.kind for e in r.events if e.block == 0 and e.kind.startswith("saved")}
    assert kinds == {"S0 d2h 1.00": "saved_d2h", "S0 h2d 1.00": "saved_h2d"}
    assert not [e for e in r.events if e.name == "Fg0" and e.window == "b0"]  # L2: none


def test_a_plan_without_levels_re_forwards_in_full():
    # no save_levels (a plan written before the field): b{j} charges Fg = 1.5, not Fr = 1.2
    p = tiny_problem(L=2, **{k: v[:2] for k, v in LEVEL_COSTS.items()})
    r = simulate(p, Plan(tiers=("hbm",) * 3))
    assert r.window("b1").time_ms == pytest.approx(1.5 + 2.0)
    r = simulate(p, Plan(tiers=("hbm",) * 3, save_levels=("L0", "L0"),
                         saved_tiers=("none", "none")))
    assert r.window("b1").time_ms == pytest.approx(1.2 + 2.0)


def test_the_internals_h2d_must_follow_their_d2h():
    p = tiny_problem(L=2, **{k: v[:2] for k, v in LEVEL_COSTS.items()})
    plan = Plan(tiers=("hbm",) * 3, save_levels=("L2", "L0"), saved_tiers=("dram", "none"),
                internal_transfers=(I(0, "h2d", "f1"), I(0, "d2h", "turn")))
    with pytest.raises(ValueError, match=r"block 0: internals h2d in window f1"):
        simulate(p, plan)


def test_levels_on_a_problem_without_their_costs_are_refused():
    plan = Plan(tiers=("hbm",) * 3, save_levels=("L1", "L0"), saved_tiers=("hbm", "none"))
    with pytest.raises(ValueError, match="saved_bytes"):
        simulate(tiny_problem(L=2), plan)


# --- agreement with the fluid evaluator ---------------------------------------------------------

L5 = dict(fwd_ms=(1.0, 1.2, 0.8, 1.1, 0.9), fwd_grad_ms=(1.4, 1.7, 1.1, 1.5, 1.3),
          bwd_ms=(2.0, 2.5, 1.6, 2.2, 1.8), reforward_ms=(1.1, 1.3, 0.9, 1.2, 1.0),
          reforward_l1_ms=(0.6, 0.7, 0.5, 0.6, 0.5),
          saved_bytes=((300, 900), (350, 1000), (250, 800), (320, 950), (300, 850)),
          weight_bytes=(900, 1100, 800, 1000, 950), grad_bytes=(900, 1100, 800, 1000, 950),
          internal_bytes=(50,) * 5, boundary_bytes=(700, 600, 650, 800, 750, 700),
          params_per_block=(10,) * 5, ends_grad_bytes=300, const_ms=0.7, grad_accum=2)

CASES = {
    # every pair of level and tier; dram moves in the first legal d2h and last legal h2d window
    "all-hbm": (("hbm",) * 6, ("L2", "L1", "L2", "L1", "L0"),
                ("dram", "hbm", "hbm", "dram", "none"),
                (I(0, "d2h", "f1"), I(0, "h2d", "b1"), I(3, "d2h", "f4"), I(3, "h2d", "b4"))),
    # split fractions, a segment with recompute ending at an L1 block, a kept block
    "segments": (("hbm", "recompute", "dram", "recompute", "hbm", "hbm"),
                 ("L1", "L2", "L0", "L1", "L0"), ("dram", "dram", "none", "hbm", "none"),
                 (I(0, "d2h", "f1", 0.5), I(0, "d2h", "f2", 0.5), I(0, "h2d", "b2", 0.25),
                  I(0, "h2d", "b1", 0.75), I(1, "d2h", "turn"), I(1, "h2d", "b3"))),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("links", [1e13, 0.8 * KB_PER_MS], ids=["idle-links", "loaded-links"])
def test_simulator_agrees_with_evaluator_on_gpu_with_levels(name, links):
    p = tiny_problem(L=5, **L5, h2d_bytes_per_s=links, d2h_bytes_per_s=links,
                     duplex_bytes_per_s=2 * links, nvme_read_bytes_per_s=links,
                     nvme_write_bytes_per_s=links)
    tiers, levels, saved, moves = CASES[name]
    plan = _levels_plan(p, tiers, levels, saved, moves, keep=(4,) if name == "segments" else ())
    assert disagreements(p, plan) == []
    assert simulate(p, plan).step_ms == pytest.approx(evaluate(p, plan).step_ms)


@pytest.mark.parametrize("name", sorted(CASES))
def test_simulator_agrees_with_evaluator_on_cpu_with_levels(name):
    p = tiny_problem(L=5, **L5, copies_overlap_compute=False)
    tiers, levels, saved, moves = CASES[name]
    plan = _levels_plan(p, tiers, levels, saved, moves)
    assert disagreements(p, plan) == []
    assert simulate(p, plan).step_ms == pytest.approx(evaluate(p, plan).step_ms)


def test_the_internals_bytes_reach_the_windows_of_both_models():
    # block 0 L2 dram, d2h in f1: the window's D2H carries S2[0] = 900 B on top of nothing else
    p = tiny_problem(L=5, **L5)
    tiers, levels, saved, moves = CASES["all-hbm"]
    plan = _levels_plan(p, tiers, levels, saved, moves)
    d2h = sum(e.work for e in simulate(p, plan).events
              if e.window == "f1" and e.stream == "d2h")
    f1 = next(w for w in evaluate(p, plan).windows if w.name == "f1")
    assert d2h == pytest.approx(900) and f1.d2h_bytes == pytest.approx(900)
