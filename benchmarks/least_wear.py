"""Least-wear benchmark (not part of CI): the seed scenario planned with and without the MILP's
least-wear phase (planner/wear.py, config planner.least_wear / least_wear_slack).

Per run: the step (ms), the NVMe bytes written per step and per 10,000 steps, the tiers, the
gap against the best bound, and the planning time (wall and CPU, s; the CPU time is the
steadier figure on a shared machine). The phase must leave the step within its slack and
must not double the planning time.

Seed: configs/qwen3.6-27b-h800.yaml (Qwen3.5-27B config, h800-paper, seq 1024 x mb 72).

Last run (2026-12-02 05:10 UTC, 2 cores shared with other jobs; wall times are 2-4x the CPU
times):
  least_wear=false: 55196.08 ms, 14 hbm / 14 dram / 37 nvme, 27.93 GB per step, CPU 2.0 s
  least_wear=true:  55196.53 ms, 14 hbm / 14 dram / 36 nvme / boundary 0 re-embedded,
                    27.18 GB per step, CPU 2.4 s
(an hour earlier, before the 8-bit update time and the bounce-buffer rows: 12 / 14 / 39,
29.44 GB -> 12 / 14 / 38 + re-embed, 28.69 GB, CPU 2.3-2.5 s -> 2.8-3.1 s). HBM and DRAM are
full in these plans (peak HBM 75.3-75.7 of 76 GB; 14 boundaries fill the 10.8 GB of DRAM left
beside the states and pools) and recomputing a block costs far more than the 0.1% slack, so
the phase's only gain here is re-embedding boundary 0. At 128 half blocks (benchmarks/
planner.py split-128) it found nothing within the slack and cost 1.4 s of CPU beside the
step-time solve's 3.4 s.
On the formulation of 2026-12-01 (before resident weights) the step-time solve answered the
same step with 2 hbm / 14 dram / 49 nvme (36.99 GB per step, 370 TB per 10,000 steps); the
phase moved it to 12 hbm / 14 dram / 39 nvme (29.44 GB) at the same 55196.08 ms.

Run:  nice python benchmarks/least_wear.py [--time-limit-s 10]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from lazytrain.config import load_config
from lazytrain.planner.build import problem_from_config
from lazytrain.planner.policy import plan, planner_options
from lazytrain.report.plan_table import nvme_write_bytes_per_step

REPO = Path(__file__).resolve().parents[1]
SEED = REPO / "configs" / "qwen3.6-27b-h800.yaml"


def run(least_wear: bool, time_limit_s: float) -> tuple[float, float]:
    """Plan the seed once; print one row; return (step ms, NVMe bytes written per step)."""
    cfg = load_config(SEED, overrides=[f"planner.least_wear={str(least_wear).lower()}",
                                       f"planner.time_limit_s={time_limit_s}"])
    problem = problem_from_config(cfg)
    t0, c0 = time.perf_counter(), time.process_time()
    chosen = plan(problem, planner_options(cfg.planner))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    written = nvme_write_bytes_per_step(chosen, problem.grad_accum)
    t = chosen.tiers
    tiers = "/".join(f"{t.count(x)} {x}" for x in ("hbm", "dram", "nvme", "recompute"))
    gap = "-" if chosen.solver.gap is None else f"{chosen.solver.gap:.3%}"
    print(f"least_wear={str(least_wear).lower():<5}  step {chosen.predicted.step_ms:10.2f} ms  "
          f"NVMe {written / 1e9:6.2f} GB/step, {written * 1e4 / 1e12:6.1f} TB/10k steps  "
          f"{tiers}  gap {gap}  plan {wall:5.1f} s wall, {cpu:4.1f} s CPU", flush=True)
    return chosen.predicted.step_ms, written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit-s", type=float, default=10.0, help="planner.time_limit_s")
    args = ap.parse_args()
    off_ms, off_bytes = run(False, args.time_limit_s)
    on_ms, on_bytes = run(True, args.time_limit_s)
    print(f"least-wear phase: step x{on_ms / off_ms:.6f}, NVMe writes x{on_bytes / off_bytes:.3f}"
          if off_bytes else f"least-wear phase: step x{on_ms / off_ms:.6f}, no NVMe writes")


if __name__ == "__main__":
    main()
