"""Planner benchmark (not part of CI): solve time, gap and predicted step for every policy.

Scenarios:
  seed-64   configs/qwen3.6-27b-h800.yaml (Qwen3.5-27B config, h800-paper, seq 1024 x mb 72).
  split-128 the same problem with every block split into two half blocks (compute, weights,
            gradients, internals and parameters halved; boundary activations unchanged, since a
            half block still outputs [micro_batch, seq, hidden]); 128 blocks, same budgets.

For each: SCIP and HiGHS, cold and warm-started from the heuristic (time limit 10 s / gap 0.5%
at 64 blocks; 60 s / 1% at 128 with k_max = 16), the heuristic, the MegaTrain rule (K=4),
the ideal plan and the LP bound; tier counts; the milp speedup over MegaTrain. Gaps are the
solver's own (vs. its dual bound) and vs. the LP relaxation.

Run:  nice python benchmarks/planner.py [--quick]   (--quick: seed scenario only)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from lazytrain.config import load_config
from lazytrain.planner.bounds import ideal_ms, lp_bound_ms, roofline_ms
from lazytrain.planner.build import problem_from_config
from lazytrain.planner.heuristics import heuristic_plan, megatrain_plan
from lazytrain.planner.milp import PlanInfeasibleError, build_milp, solve_milp
from lazytrain.planner.problem import PlanningProblem

REPO = Path(__file__).resolve().parents[1]


def split_blocks(p: PlanningProblem) -> PlanningProblem:
    """Every block -> two half blocks (see module docstring)."""
    two = lambda xs, f=lambda x: x / 2: tuple(v for x in xs for v in (f(x), f(x)))  # noqa: E731
    half_int = lambda x: x // 2  # noqa: E731
    A = p.boundary_bytes
    return p.replace(
        name=p.name + " (128 half blocks)", fwd_ms=two(p.fwd_ms), fwd_grad_ms=two(p.fwd_grad_ms),
        bwd_ms=two(p.bwd_ms), weight_bytes=two(p.weight_bytes, half_int),
        grad_bytes=two(p.grad_bytes, half_int), internal_bytes=two(p.internal_bytes, half_int),
        params_per_block=two(p.params_per_block, half_int),
        boundary_bytes=tuple(v for a in A[:-1] for v in (a, a)) + (A[-1],),
        block_fwd_flops=two(p.block_fwd_flops) if p.block_fwd_flops else ())


def tiers(plan) -> str:
    t = plan.tiers
    return (f"{t.count('hbm')}h/{t.count('dram')}d/{t.count('nvme')}n/"
            f"{t.count('recompute')}r keep{len(plan.keep_internals)}")


def run(name: str, problem: PlanningProblem, *, time_limit_s: float, gap: float,
        backends: tuple[str, ...] = ("scip", "highs")) -> None:
    L = problem.num_blocks
    milp = build_milp(problem)
    print(f"\n== {name}: L={L}, k_max={problem.k_max}, {milp.model.num_vars} vars "
          f"({sum(milp.model.var_integer)} binary), {milp.model.num_rows} rows; "
          f"limit {time_limit_s:g} s, gap {gap:.1%}")
    t0 = time.perf_counter()
    lp = lp_bound_ms(problem)
    lp_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    heur = heuristic_plan(problem)
    heur_s = time.perf_counter() - t0
    mega = megatrain_plan(problem, k=4)
    rows = []
    best = None
    for backend in backends:
        for warm in (False, True):
            t0 = time.perf_counter()
            try:
                plan = solve_milp(problem, backend=backend, time_limit_s=time_limit_s, gap=gap,
                                  warm_start=heur if warm else None)
            except PlanInfeasibleError as exc:
                rows.append((f"milp {backend} {'warm' if warm else 'cold'}", None, "-", "-",
                             time.perf_counter() - t0, str(exc)[:40]))
                continue
            s = plan.solver
            rows.append((f"milp {backend} {'warm' if warm else 'cold'}", plan.predicted.step_ms,
                         f"{s.gap:.3%}" if s.gap is not None else "-", s.status, s.solve_s,
                         tiers(plan)))
            if best is None or plan.predicted.step_ms < best.predicted.step_ms:
                best = plan
    rows.append(("heuristic", heur.predicted.step_ms, "-", heur.solver.status, heur_s,
                 tiers(heur)))
    rows.append(("megatrain K=4", mega.predicted.step_ms, "-", mega.solver.status, 0.0,
                 tiers(mega)))
    rows.append(("ideal (inf. HBM)", ideal_ms(problem), "-", "bound", 0.0, "all hbm"))
    rows.append(("LP relaxation", lp, "-", "bound", lp_s, ""))
    rows.append(("roofline", roofline_ms(problem), "-", "bound", 0.0, ""))
    print(f"{'policy':18} {'step ms':>10} {'vs LP':>8} {'solver gap':>10} {'status':>14} "
          f"{'solve s':>8}  tiers")
    for label, step, sgap, status, secs, tier in rows:
        vs = f"{step / lp - 1:+.3%}" if step else "-"
        st = f"{step:10.1f}" if step else f"{'-':>10}"
        print(f"{label:18} {st} {vs:>8} {sgap:>10} {status[:14]:>14} {secs:8.2f}  {tier}")
    if best is not None:
        print(f"milp speedup over megatrain: {mega.predicted.step_ms / best.predicted.step_ms:.3f}x"
              f"  (model TFLOPS {best.predicted.model_tflops:.1f} vs "
              f"{mega.predicted.model_tflops:.1f}; tiers {tiers(best)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="seed scenario only")
    args = ap.parse_args()
    seed = problem_from_config(load_config(REPO / "configs" / "qwen3.6-27b-h800.yaml"))
    run("seed-64", seed, time_limit_s=10.0, gap=0.005)
    if not args.quick:
        # HiGHS 1.16 overran its 60 s limit by minutes at 128 blocks (cold and warm; its MIP
        # time limit is not checked everywhere, ERGO-Code/HiGHS#885, #2226): SCIP only here.
        run("split-128", split_blocks(seed).replace(k_max=16), time_limit_s=60.0, gap=0.01,
            backends=("scip",))


if __name__ == "__main__":
    main()
