"""DPO from the main job's SFT checkpoint: held-out pair accuracy and exact match, before and
after, per seed.

Run:  python benchmarks/dpo_learning.py [--seeds 0] [--steps 12] [--num-eval 16]
                                        [--sft-run runs/default] [--work runs/dpo_bench]
                                        [--set train.lr=1e-5 ...]

1. The SFT checkpoint: the newest one of `--sft-run` (the main job's run directory); without
   one, the main job is trained there first (`lazytrain train`, a few minutes on 2 cores).
2. Per seed s: `lazytrain train` with `train.method: dpo` from that checkpoint
   (`model.config_path` = the checkpoint directory) on `data.path: embedded:arithmetic`: pairs
   of an embedded problem's worked answer (chosen) and the same answer with one step's result
   off by 1-3 and carried on (rejected), `data.num_eval` held-out pairs whose questions are
   not among the training pairs (`data.preference.arithmetic_pairs`, seed s). The reference
   is the SFT checkpoint itself (the run's initial weights).
3. The run evaluates before and after training: on the held-out pairs, DPO's accuracy (the
   chosen response's reward beta * (log pi - log ref) above the rejected one's) and margin;
   on their prompts, greedy exact match of the `#### n` answer (the main job's grader).

Prints one line per seed and the means. Targets: held-out pair accuracy after > 0.9, exact
match after not lower than before. Not part of CI (minutes per seed on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

TARGET_ACCURACY = 0.9
"""Held-out pair accuracy the benchmark aims for after training."""
DPO_SETTINGS = ["train.method=dpo", "data.path=embedded:arithmetic", "data.seq_len=112",
                "train.micro_batch=4", "train.grad_accum=1", "train.lr=2e-5",
                "train.warmup_steps=1", "train.schedule=constant", "dpo.beta=0.1",
                "dpo.loss=sigmoid", "train.checkpoint_every_min=0", "runtime.calibrate=off"]
"""The DPO run's keys besides the seed, steps and held-out pairs: 4 pairs (8 rows of <= 112
tokens) per step, the DPO paper's beta, a constant 2e-5 after 1 warmup step (2 pairs at 3e-5
were too noisy: README, "DPO"); analytic costs (the plan keeps every boundary in memory on
this CPU either way; no calibration minutes)."""


def lazytrain(*args: str) -> None:
    """Run `lazytrain ARGS` in a subprocess; raise with its stderr tail on failure."""
    res = subprocess.run([sys.executable, "-m", "lazytrain.cli.main", *args],
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"lazytrain {' '.join(args)} exited {res.returncode}:\n"
                           f"{res.stderr[-3000:]}")


def newest_checkpoint(run_dir: Path) -> Path | None:
    done = sorted(p for p in (run_dir / "checkpoints").glob("step-*")
                  if (p / "COMPLETE").is_file())
    return done[-1] if done else None


def run_seed(seed: int, *, ckpt: Path, work: Path, steps: int, num_eval: int,
             extra: list[str]) -> dict:
    """One DPO run from `ckpt`; its summary's before/after figures."""
    run_dir = work / f"seed{seed}"
    t0 = time.perf_counter()
    lazytrain("train", "--run-dir", str(run_dir), "--overwrite", "--no-progress",
              "--steps", str(steps), "--set", f"model.config_path={ckpt}",
              "--set", f"train.seed={seed}", "--set", f"data.num_eval={num_eval}",
              *[x for kv in DPO_SETTINGS + extra for x in ("--set", kv)])
    wall_s = time.perf_counter() - t0
    summary = json.loads((run_dir / "summary.json").read_text())
    before, after = summary["dpo_eval"][0], summary["dpo_eval"][-1]
    eb, ea = summary["eval_before"], summary["eval_after"]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_rec = [r for r in records if "dpo_accuracy" in r]
    return {"seed": seed, "pairs": before["eval_dpo_pairs"],
            "accuracy_before": before["eval_dpo_accuracy"],
            "accuracy_after": after["eval_dpo_accuracy"],
            "margin_before": before["eval_dpo_margin"], "margin_after": after["eval_dpo_margin"],
            "em_before": eb["num_correct"], "em_after": ea["num_correct"],
            "scored": ea["num_scored"], "loss_first": steps_rec[0]["loss"],
            "loss_last": steps_rec[-1]["loss"], "wall_s": wall_s,
            "mean_step_s": summary["mean_step_s"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--num-eval", type=int, default=16)
    parser.add_argument("--sft-run", type=Path, default=Path("runs/default"))
    parser.add_argument("--work", type=Path, default=Path("runs/dpo_bench"))
    parser.add_argument("--out", type=Path, default=None, help="JSON of the results")
    parser.add_argument("--set", dest="extra", action="append", default=[],
                        metavar="KEY=VALUE", help="another key for the DPO runs (repeatable)")
    args = parser.parse_args()
    if newest_checkpoint(args.sft_run) is None:
        print(f"training the main job into {args.sft_run} first", flush=True)
        lazytrain("train", "--run-dir", str(args.sft_run), "--overwrite", "--no-progress")
    ckpt = newest_checkpoint(args.sft_run)
    print(f"SFT checkpoint {ckpt}", flush=True)
    print("| seed | held-out pair accuracy | margin | exact match | DPO loss (first -> last "
          "step) | wall | s/step |\n|---|---|---|---|---|---|---|", flush=True)
    results = []
    for seed in args.seeds:
        r = run_seed(seed, ckpt=ckpt, work=args.work, steps=args.steps, num_eval=args.num_eval,
                     extra=args.extra)
        results.append(r)
        print(f"| {seed} | {r['accuracy_before']:.3f} -> {r['accuracy_after']:.3f} "
              f"({r['pairs']} pairs) | {r['margin_before']:.3f} -> {r['margin_after']:.3f} | "
              f"{r['em_before']}/{r['scored']} -> {r['em_after']}/{r['scored']} | "
              f"{r['loss_first']:.4f} -> {r['loss_last']:.4f} | {r['wall_s']:.0f} s | "
              f"{r['mean_step_s']:.1f} |", flush=True)
    n = len(results)
    acc = sum(r["accuracy_after"] for r in results) / n
    em_b = sum(r["em_before"] for r in results) / n
    em_a = sum(r["em_after"] for r in results) / n
    lower = [r["seed"] for r in results if r["em_after"] < r["em_before"]]
    print(f"mean held-out pair accuracy after {acc:.3f} (target > {TARGET_ACCURACY}); mean "
          f"exact match {em_b:.1f} -> {em_a:.1f} of {results[0]['scored']}; seeds with a lower "
          f"exact match: {lower or 'none'}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
