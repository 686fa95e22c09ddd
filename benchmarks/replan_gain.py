"""Stale plan vs re-planned step time under an injected NVMe read slowdown, in one run.

Run:  nice python benchmarks/replan_gain.py [--delay-ms 40 --steps 6]

Same small random Llama and measured profile as `predict_accuracy.py`. One engine (instrumented)
runs the NVMe-heavy plan while every NVMe chunk read sleeps `--delay-ms` (FaultInjector); the
`OnlineReplanner` (check every step, patience 2, heuristic policy) sees the read bandwidth drift,
re-solves in its thread, and the engine switches plans at a step boundary (`Engine.set_plan`);
the run continues under the same slowdown. Prints median step time before and after the switch,
and what each plan was predicted to take under the measured problem. Not part of CI.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from predict_accuracy import batches, make_engine, plans, setup_run


def main(argv: list[str] | None = None) -> int:
    from lazytrain.planner.build import problem_from_config
    from lazytrain.planner.policy import PlannerOptions
    from lazytrain.runtime.nvme import FaultInjector
    from lazytrain.train.replan import OnlineReplanner, resolve

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6, help="steps measured on each plan")
    ap.add_argument("--delay-ms", type=float, default=40.0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(dir=Path.cwd(), prefix="replan-gain-") as tmp:
        root = Path(tmp)
        cfg, adapter, _ = setup_run(root, layers=args.layers, hidden=args.hidden, seq=args.seq,
                                    batch=args.batch, repeats=3)
        stale = plans(cfg)[0]["nvme-heavy"]
        faults = FaultInjector()
        faults.delay_reads(args.delay_ms)
        engine = make_engine(adapter, stale, root / "nvme", fault_hook=faults, instrument=True)
        rep = OnlineReplanner(problem_from_config(cfg), stale, every=1, threshold=0.15,
                              patience=2, solve=lambda p, cur: resolve(p, cur, PlannerOptions(
                                  policy="heuristic", time_limit_s=2.0)))
        data = batches(adapter.config.vocab_size, batch=args.batch, seq=args.seq,
                       n=4 * args.steps + 8)
        before, after, event = [], [], None
        try:
            for n, b in enumerate(data):
                stats = engine.step([b])
                (after if event else before).append(stats.step_s * 1e3)
                if event is None:
                    sw = rep.after_step(n + 1, stats.windows)
                    if sw is not None and sw.event["switched"]:
                        engine.set_plan(sw.plan)
                        event = sw.event
                    elif rep.pending is not None:
                        time.sleep(0.2)  # let the solver thread run on the 2 shared cores
                if event and len(after) >= args.steps:
                    break
        finally:
            rep.close()
            engine.close()
        if event is None:
            print("no re-plan happened")
            return 1
        stale_ms = statistics.median(before[1:][-args.steps:])
        new_ms = statistics.median(after[1:] or after)
        print(f"NVMe reads delayed {args.delay_ms:.0f} ms per chunk; re-plan at step "
              f"{event['step']} (reason: " + ", ".join(
                  f"{r['channel']} {r['ratio']:.3f}x" for r in event["reason"]) + ")")
        print(f"{'plan':<12}{'tiers':>34}{'predicted ms':>14}{'measured ms':>13}")
        print(f"{'stale':<12}{str(event['tiers_before']):>34}"
              f"{event['old_predicted_step_ms_measured']:>14.1f}{stale_ms:>13.1f}")
        print(f"{'re-planned':<12}{str(event['tiers_after']):>34}"
              f"{event['new_predicted_step_ms']:>14.1f}{new_ms:>13.1f}")
        print(f"gain: {stale_ms / new_ms:.2f}x step time (solve {event['solve_s']:.2f} s "
              f"off the training thread)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
