"""The seed scenario and Llama-3-8B at seq 8192 re-planned with the weight paths
(docs/execution_model.md, "Weight paths"): for each path vector (every block host_convert,
pinned_copy or gpu_cast, and the planner's choice) the predicted step and MFU of the MILP, the
heuristic and the best fixed-K rule, what binds per window (counts of the binding term over
the MILP plan's windows), and the host conversion rate a host_convert plan would need so that
the host never binds, against the rate the planner assumed and the rate measured here on one
thread (the runtime's conversion worker).

    PYTHONPATH=src python benchmarks/weight_paths.py [--time-limit 20]
"""

from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

import torch

from lazytrain.config import load_config
from lazytrain.planner import heuristics
from lazytrain.planner.build import problem_from_config
from lazytrain.planner.evaluate import evaluate
from lazytrain.planner.milp_solve import solve_milp
from lazytrain.planner.path_choice import choose_weight_paths
from lazytrain.planner.weight_paths import with_weight_paths
from lazytrain.planner.window_time import weight_loads

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = {"seed qwen3.5-27b h800 (bf16 masters)": ROOT / "configs/qwen3.6-27b-h800.yaml",
             "llama-3-8b seq 8192 h200 (fp32 masters)": ROOT / "configs/llama-3-8b-8k-h200.yaml"}


def measured_convert_gb_per_s(numel: int = 1 << 24) -> float:
    """fp32 -> bf16 conversion on one thread, GB of bf16 written per second (best of 3)."""
    torch.set_num_threads(1)
    src = torch.randn(numel)
    dst = torch.empty(numel, dtype=torch.bfloat16)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return numel * 2 / best / 1e9


def needed_convert_gb_per_s(problem, plan) -> float:
    """The conversion rate at which no window of `plan` waits for the host: max over windows
    of converted bytes / the window's time without host work, GB/s (0 with no conversion)."""
    free = problem.replace(host_convert_bytes_per_s=0.0, host_accumulate_bytes_per_s=0.0)
    times = [w.time_ms for w in evaluate(free, plan).windows]
    conv = weight_loads(problem, plan.tiers, plan.resident_weights,
                        with_weight_paths(problem, plan.weight_paths).convert_bytes)
    return max((c / t / 1e6 for c, t in zip(conv, times) if t > 0), default=0.0)


def row(label: str, problem, plan, peak: float) -> str:
    if plan is None:
        return f"  {label:<26} no plan fits"
    ev = evaluate(problem, plan)
    binds = collections.Counter(ev.binding_by_window)
    fits = "" if ev.feasible else "  (does not fit)"
    return (f"  {label:<26} step {ev.step_ms:9.1f} ms  MFU {ev.model_tflops * 1e12 / peak:6.1%}"
            f"  binds {dict(binds)}{fits}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--time-limit", type=float, default=20.0, help="MILP seconds per solve")
    args = ap.parse_args()
    measured = measured_convert_gb_per_s()
    print(f"host conversion measured here: {measured:.2f} GB/s of bf16 on one thread "
          f"(fp32 -> bf16)")
    for name, path in SCENARIOS.items():
        cfg = load_config(path)
        base = problem_from_config(cfg)
        peak = base.provenance["hardware_spec"]["peak_flops"]
        chosen = choose_weight_paths(base)
        print(f"\n{name}: {base.num_blocks} blocks, planner's choice "
              f"{dict(collections.Counter(chosen.paths))}; assumed host conversion "
              f"{base.host_convert_bytes_per_s / 1e9:.1f} GB/s, accumulation "
              f"{base.host_accumulate_bytes_per_s / 1e9:.1f} GB/s")
        for label in ("host_convert", "pinned_copy", "gpu_cast"):
            # the MILP held to this path for every block (it chooses per block otherwise)
            problem = with_weight_paths(base, (label,) * base.num_blocks).replace(
                weight_path_choice=False)
            heur = heuristics.heuristic_plan(problem, time_budget_s=2.0)
            milp = solve_milp(problem, time_limit_s=args.time_limit, warm_start=heur)
            fixed = heuristics.best_fixed_k_plan(problem)
            print(f" {label}:")
            print(row("MILP", problem, milp, peak))
            print(row("heuristic", problem, heur, peak))
            print(row(f"best fixed K={heuristics.k_of(fixed) if fixed else '-'}", problem, fixed,
                      peak))
            if label == "host_convert":
                print(f"  host conversion needed so the host never binds (MILP plan): "
                      f"{needed_convert_gb_per_s(problem, milp):.1f} GB/s")
                slow = problem.replace(host_convert_bytes_per_s=measured * 1e9)
                heur = heuristics.heuristic_plan(slow, time_budget_s=2.0)
                print(row(f"heuristic, {measured:.2f} GB/s", slow, heur, peak))
        free = solve_milp(base, time_limit_s=args.time_limit)
        print(f" paths chosen per block by the MILP "
              f"{dict(collections.Counter(free.weight_paths or ()))}:")
        print(row("MILP", base, free, peak))
        slow = base.replace(host_convert_bytes_per_s=measured * 1e9)
        print(f" planner's choice at the measured {measured:.2f} GB/s: "
              f"{dict(collections.Counter(choose_weight_paths(slow).paths))}")


if __name__ == "__main__":
    main()
